"""CARef: class-aware relative feature error (Ling et al., CVPR 2025)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from ..utils.scores import energy_score, max_logit_score, msp_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .gen import gen_score
from .interface import register_detector
from .penultimate import ClassStatistics, LinearHead, StatisticsPass


#: The logit scores of the CADRef authors' ``get_logits_score`` (``--logit_method``).
LOGIT_METHODS = ("energy", "msp", "max_logit", "gen")


def logit_score(logits: torch.Tensor, method: str) -> torch.Tensor:
    """The authors' ``get_logits_score``: ``logsumexp`` (energy), the max softmax probability (msp), the max logit, or
    ``1 / sum_{top M} p^0.1 (1 - p)^0.1`` (gen, ``M = max(K // 10, 10)``); ``(B, K) -> (B,)``."""
    if method == "energy":
        return energy_score(logits)
    if method == "msp":
        return msp_score(logits)
    if method == "max_logit":
        return max_logit_score(logits)
    return -1.0 / gen_score(logits, 0.1, max(logits.shape[1] // 10, 10))


def predicted_class_statistics(head: LinearHead, method: str) -> StatisticsPass:
    """Streamed float64 sums of each ID training feature and its logit score (one more column), by the class the
    model predicts for it (the authors' ``get_features`` files every training sample under ``output.argmax(1)``,
    not its label)."""
    def shape(features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        wide = features.double()
        logits = head(wide)
        return torch.cat([wide, logit_score(logits, method)[:, None]], dim=1), logits.argmax(dim=1), None

    return StatisticsPass(ClassStatistics(head.num_classes), shape)


def relative_errors(features: torch.Tensor, class_means: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """``z - mu_c`` with ``c`` each sample's predicted class, over ``||z||_1`` (``(B, D)``, float64)."""
    features = features.double()
    return (features - class_means.double()[predicted]) / features.norm(p=1, dim=1, keepdim=True)


class PredictedClassMeanDetector(FittedDetector):
    """CARef and CADRef: the means of the ID training features by the class the model predicts for them, fitted from
    streamed sums that carry each sample's logit score as one more column (shared by the two in a pass)."""

    def logit_method(self) -> str:
        return "energy"

    def fit_requirement(self) -> tuple[int, str]:
        return self.num_classes, "a training sample predicted in every class"

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        # (K, D + 1) float64 sums whatever N; one accumulator for CARef and CADRef at the same logit score.
        return ("predicted-class means", self.logit_method()), lambda: predicted_class_statistics(
            LinearHead(self.head_weight.double().cpu(), self.head_bias.double().cpu()), self.logit_method())

    def predicted_class_means(self, accumulated: StatisticsPass) -> torch.Tensor:
        """``(K, D + 1)``: each class's mean feature and mean logit score (every class must be predicted once)."""
        self.check_fit_count(accumulated.count)
        return accumulated.statistics.class_means(self.method, "training sample predicted")

    def predicted(self, features: torch.Tensor) -> torch.Tensor:
        """The predicted class of each feature (``argmax softmax``, the authors' ``class_ids``)."""
        return self.head(features.double()).argmax(dim=1)


@dataclass
class CARefConfig(DetectorConfig):
    """CARef has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "caref"


@register_detector
class CARefDetector(PredictedClassMeanDetector):
    """Minus the L1 distance of the feature to the mean of its predicted class over its own L1 norm,
    ``-||z - mu_c||_1 / ||z||_1`` (:func:`relative_errors`).

    Ling et al., "CADRef: Robust Out-of-Distribution Detection via Class-Aware Decoupled Relative Feature
    Leveraging", CVPR 2025; CARef is its class-aware relative error without the decoupling. The reference is the
    authors' code, github.com/LingAndZero/CADRef ``ood_methods/CARef.py`` with ``utils/get_stat.py``: the means are of
    the training features grouped by the class the model predicts (not the label), the predicted class of a scored
    sample is its ``argmax``. Every class must be predicted for at least one training sample (the code's mean of an
    empty class is undefined).

    Settings: :class:`CARefConfig`.
    """

    config_class = CARefConfig
    state_names = ("class_means",)

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"class_means": (self.num_classes, self.feature_dim)}

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.class_means = self.predicted_class_means(accumulated)[:, :-1]

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch)
        return -relative_errors(features, self.class_means, self.predicted(features)).norm(p=1, dim=1)
