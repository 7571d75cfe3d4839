"""CADRef: class-aware decoupled relative feature error (Ling et al., CVPR 2025)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, choice_check, setting
from .backbone_pass import BackbonePass
from .caref import LOGIT_METHODS, PredictedClassMeanDetector, logit_score, relative_errors
from .interface import register_detector
from .penultimate import StatisticsPass


def decoupled_errors(errors: torch.Tensor, weight_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E+, E-)``: the L1 norms of the relative error's coordinates that move the feature along, and against, the
    sign of the predicted class's weight row (``relu(e sign(w_c))``, ``relu(-e sign(w_c))``); ``(B, D) -> (B,), (B,)``."""
    signed = errors * weight_rows.sign().to(errors)
    return signed.clamp(min=0).sum(dim=1), (-signed).clamp(min=0).sum(dim=1)


@dataclass
class CADRefConfig(DetectorConfig):
    """Settings of CADRef (:class:`CADRefDetector`)."""

    method: ClassVar[str] = "cadref"
    logit_method: str = setting(
        "energy", choice_check(LOGIT_METHODS),
        "The logit score dividing the positive error, and whose ID training mean divides the negative one; "
        "``\"energy\"``: the authors' ``--logit_method`` default (``ood_eval.py``).")


@register_detector
class CADRefDetector(PredictedClassMeanDetector):
    """``-(E+ / S(x) + E- / mean S)``: the relative error of the feature from its predicted class's mean
    (:func:`~hf_gsc.detectors.caref.relative_errors`), split by the sign of that class's weight row into the part
    that raises its logit, ``E+``, and the part that lowers it, ``E-`` (:func:`decoupled_errors`); ``E+`` is divided by
    the sample's logit score ``S(x)`` and ``E-`` by the mean logit score of the ID training samples.

    Ling et al., "CADRef: Robust Out-of-Distribution Detection via Class-Aware Decoupled Relative Feature
    Leveraging", CVPR 2025. The reference is the authors' code, github.com/LingAndZero/CADRef ``ood_methods/CADRef.py``
    with ``utils/get_stat.py`` and ``ood_eval.py``: the class means are of the training features grouped by the class
    the model predicts (not the label), the weight row is the classifier's, and the mean logit score is over every
    training sample. Every class must be predicted for at least one training sample (the code's mean of an empty
    class is undefined).

    Settings: :class:`CADRefConfig`.
    """

    config_class = CADRefConfig
    search_space_source = "the authors' ood_eval.py has no sweep (logit_method Energy by default)"
    #: ``mean_logit_score``: the ID training samples' mean logit score (``global_mean_logit_score``).
    state_names = ("class_means", "mean_logit_score")

    def logit_method(self) -> str:
        return self.hyperparameters["logit_method"]

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"class_means": (self.num_classes, self.feature_dim), "mean_logit_score": (1,)}

    def _fit(self, accumulated: StatisticsPass) -> None:
        means = self.predicted_class_means(accumulated)
        counts = accumulated.statistics.class_counts
        self.class_means = means[:, :-1]
        self.mean_logit_score = ((means[:, -1] * counts).sum() / counts.sum()).reshape(1)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch)
        logits = self.head(features.double())
        predicted = logits.argmax(dim=1)
        positive, negative = decoupled_errors(relative_errors(features, self.class_means, predicted),
                                              self.head_weight[predicted])
        return -(positive / logit_score(logits, self.logit_method())
                 + negative / self.mean_logit_score.double())
