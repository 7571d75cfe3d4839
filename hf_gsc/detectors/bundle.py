"""Several detectors on one base model, scored (and fitted) from one backbone pass per batch.

    bundle = DetectorBundle({"knn": knn, "vim": vim, "gsc": gsc})   # all on the same base model
    out = bundle(pixel_values)       # out.logits, out.ood_score["knn"], out.is_ood["gsc"], ...
    fit_together([knn, vim], id_train_batches)   # one pass over the fit data for both

The backbone runs once with the union of what the detectors read (:mod:`hf_gsc.detectors.backbone_pass`); each detector
then scores that pass with its own :meth:`~hf_gsc.detectors.OODDetector.score_batch`, so a detector's scores are
the same alone or in a bundle. ODIN perturbs the input and runs its own passes from the batch's ``pixel_values``.

Saved detectors join a bundle when loaded onto one base model object::

    model = AutoModelForImageClassification.from_pretrained("google/vit-base-patch16-224")
    knn = AutoOODDetector.from_pretrained("user/vit-knn", model=model)
    vim = AutoOODDetector.from_pretrained("user/vit-vim", model=model)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from transformers.utils import ModelOutput

from .backbone_pass import BackbonePass, run_backbone_for, shared_model
from .interface import OODDetector, classifier_loss


@dataclass
class BundleOutput(ModelOutput):
    """Output of :class:`DetectorBundle`.

    Attributes:
        loss: ``()`` cross-entropy of ``logits`` against ``labels`` when labels are given.
        logits: ``(B, K)`` the base model's logits.
        ood_score: detector name -> ``(B,)`` ``ood_score`` (higher = more in-distribution), as each detector's own
            output names it.
        is_ood: detector name -> ``(B,)`` bool, or ``None`` for a detector without a threshold.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    ood_score: dict[str, torch.Tensor] | None = None
    is_ood: dict[str, torch.Tensor | None] | None = None

    @property
    def ood_scores(self) -> dict[str, torch.Tensor] | None:
        """The former name of :attr:`ood_score` (attribute access only), kept working with a warning."""
        warnings.warn("BundleOutput.ood_scores is now ood_score, as in every detector's output", FutureWarning,
                      stacklevel=2)
        return self.ood_score


class DetectorBundle(nn.Module):
    """Detectors on one base model that score a batch from one forward (see the module docstring).

    Args:
        detectors: name -> detector (or a sequence, named by method); each wraps the same base model object.
    """

    def __init__(self, detectors: Mapping[str, OODDetector] | Sequence[OODDetector]) -> None:
        super().__init__()
        if not isinstance(detectors, Mapping):
            detectors = {detector.method: detector for detector in detectors}
        shared_model(list(detectors.values()))
        self.detectors = nn.ModuleDict(dict(detectors))

    def _members(self) -> dict[str, OODDetector]:
        """name -> detector, in order (:attr:`detectors` as the detectors they are)."""
        # cast: nn.ModuleDict is not generic (its values are typed nn.Module); __init__ put detectors in it.
        return cast("dict[str, OODDetector]", dict(self.detectors.items()))

    @property
    def model(self) -> nn.Module:
        return next(iter(self._members().values())).model

    def backbone_pass(self, pixel_values: torch.Tensor, logits: bool = True) -> BackbonePass:
        return run_backbone_for(list(self._members().values()), pixel_values, logits)

    def score_batch(self, batch: BackbonePass) -> dict[str, torch.Tensor]:
        """name -> ``(B,)`` ``ood_score`` of every detector from one pass."""
        return {name: detector.score_batch(batch).to(batch.pixel_values.device)
                for name, detector in self._members().items()}

    def scores(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> ``(B,)`` ``ood_score``, from one backbone pass."""
        members = self._members()
        for detector in members.values():
            detector.check_ready()
        first = next(iter(members.values()))
        return self.score_batch(self.backbone_pass(first._check_pixel_values(pixel_values), logits=False))

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None) -> BundleOutput:
        members = self._members()
        for detector in members.values():
            detector.check_ready()
        first = next(iter(members.values()))
        batch = self.backbone_pass(first._check_pixel_values(pixel_values), logits=True)
        scores = self.score_batch(batch)
        return BundleOutput(
            loss=classifier_loss(batch.logits, labels),
            logits=batch.model_logits(),
            ood_score=scores,
            is_ood={name: members[name].decide(score) for name, score in scores.items()},
        )


__all__ = ["BundleOutput", "DetectorBundle"]
