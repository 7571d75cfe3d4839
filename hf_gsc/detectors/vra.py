"""VRA: variational rectified activations (Xu, Lian, Liu & Tao, NeurIPS 2023), as OpenOOD v1.5 runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, number_check, setting
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead, chunked_percentile


def vra_logits(features: torch.Tensor, head: LinearHead, thresholds: torch.Tensor) -> torch.Tensor:
    """``W clip(z, low, high) + b`` with ``thresholds = [low, high]``: every penultimate activation clipped into the
    band, ``(B, D) -> (B, K)`` (the thresholds stay on the device: no host read in the forward)."""
    thresholds = thresholds.to(features)
    return head(features.clamp(min=thresholds[0], max=thresholds[1]))


@dataclass
class VRAConfig(DetectorConfig):
    """Settings of variational rectified activations (:class:`VRADetector`)."""

    method: ClassVar[str] = "vra"
    percentile_high: float = setting(
        90.0, number_check(0.0, 100.0),
        "Percentile of the ID validation activations above which they are clipped; 90: OpenOOD vra.yml "
        "``postprocessor_args``.")
    percentile_low: float = setting(
        10.0, number_check(0.0, 100.0),
        "Percentile of the ID validation activations below which they are raised to it; 10: OpenOOD vra.yml "
        "``postprocessor_args``. At most ``percentile_high``.")


@register_detector
class VRADetector(FittedDetector):
    """Energy of the logits of the penultimate feature clipped into the band between two percentiles of the ID
    activations, ``logsumexp(W clip(z, low, high) + b)`` (:func:`vra_logits`).

    Xu, Lian, Liu, Tao, "VRA: Variational Rectified Activation for Out-of-distribution Detection", NeurIPS 2023. The
    reference is OpenOOD v1.5's ``openood/postprocessors/vra_postprocessor.py`` with ``configs/postprocessors/
    vra.yml``: ``low`` and ``high`` are ``np.percentile`` of every penultimate activation of the ID validation data
    (``id_loader_dict['val']``; here the ``validation`` fit split, never test), and the score is the energy of the
    clipped feature's logits.

    OpenOOD's code and the authors' own (github.com/zeroQiaoba/VRA, ``models/resnet.py``, ``data_type='clip2'``)
    differ; this follows OpenOOD's: the authors' code adds a constant ``lamb`` to every activation, sets those below
    ``featmin + lamb`` to **zero** and those above ``featmax + lamb`` to ``featmax``; OpenOOD's raises the
    activations below ``low`` **to** ``low``, caps those above ``high`` at ``high``, and adds nothing. OpenOOD runs
    VRA with ``APS_mode: True``, choosing both percentiles on its OOD validation set; here the defaults are
    OpenOOD's ``postprocessor_args`` and ``--tune`` searches its grid on ID validation data with generated OOD
    validation sets only (the ID-only mode).

    Settings: :class:`VRAConfig`.
    """

    config_class = VRAConfig
    search_space = {"percentile_high": (85.0, 90.0, 95.0, 99.0), "percentile_low": (1.0, 5.0, 10.0, 15.0)}
    search_space_source = ("OpenOOD vra.yml postprocessor_sweep: percentile_high_list [85, 90, 95, 99], "
                           "percentile_low_list [1, 5, 10, 15]")
    fit_split = "validation"
    #: ``percentiles``: ``[percentile_low, percentile_high]`` the thresholds were fitted at, checked at load.
    state_names = ("thresholds", "percentiles")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        low, high = self.hyperparameters["percentile_low"], self.hyperparameters["percentile_high"]
        if low > high:
            raise ValueError(f"vra: percentile_low ({low}) must be at most percentile_high ({high}): the band "
                             "[low, high] the activations are clipped into would be empty")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"thresholds": (2,), "percentiles": (2,)}

    def _settings(self) -> list[float]:
        return [self.hyperparameters["percentile_low"], self.hyperparameters["percentile_high"]]

    def _fit(self, accumulated: FeatureStore) -> None:
        # Both np.percentile values, selected from the stored batches as they are (no float64 or sorted copy).
        self.check_fit_count(accumulated.count)
        self.thresholds = torch.tensor([chunked_percentile(accumulated.features, q) for q in self._settings()],
                                       dtype=torch.float64)
        self.percentiles = torch.tensor(self._settings(), dtype=torch.float64)

    def _prepare(self) -> None:
        # The thresholds are the activations' values at the fitted percentiles (the activations are not kept): a load
        # with other percentiles is refused rather than scored with thresholds that are not theirs.
        fitted = [float(value) for value in self.percentiles.tolist()]
        if fitted != self._settings():
            raise ValueError(f"{self.method}: the thresholds were fitted at percentile_low={fitted[0]:g}, "
                             f"percentile_high={fitted[1]:g}, not {self._settings()[0]:g}, {self._settings()[1]:g}; "
                             "load it with the percentiles it was fitted at, or fit a new detector")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return energy_score(vra_logits(self.features(batch), self.head, self.thresholds))
