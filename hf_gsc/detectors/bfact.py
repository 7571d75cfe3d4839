"""BFAct: Butterworth-filtered activations (2023), as the OptFS authors run it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, integer_check, number_check, setting
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, chunked_percentile


def butterworth(features: torch.Tensor, threshold: torch.Tensor, order: int) -> torch.Tensor:
    """``z / sqrt(1 + (z / t)^(2 n))``: each activation through the gain of an order-``n`` Butterworth low-pass filter
    with cut-off ``t`` (the code's ``softcap``); ``(B, D) -> (B, D)``."""
    threshold = threshold.to(features)
    return (1 / ((1 + ((features / threshold) ** (2 * order))) ** 0.5)) * features


@dataclass
class BFActConfig(DetectorConfig):
    """Settings of Butterworth-filtered activations (:class:`BFActDetector`)."""

    method: ClassVar[str] = "bfact"
    structural_names: ClassVar[tuple[str, ...]] = ("percentile",)  # the order applies at scoring
    percentile: float = setting(95.0, number_check(0.0, 100.0),
                                "Percentile of the ID training activations that is the cut-off ``t``; 95: the "
                                "OptFS authors' ``detector/bfact.py`` (``np.percentile(feature_train, 95)``).")
    order: int = setting(2, integer_check(1), "Order ``n`` of the filter; 2: the same file (``self.n = 2``).")


@register_detector
class BFActDetector(FittedDetector):
    """Energy of the logits of the penultimate feature through a Butterworth gain, ``logsumexp(W bf(z) + b)``
    (:func:`butterworth`), the cut-off a percentile of the ID training activations.

    "BFAct: Out-of-Distribution Detection with Butterworth Filter Rectified Activations", 2023. No code of
    the BFAct authors was found; the reference is the OptFS authors' implementation (github.com/Qinyu-Allen-Zhao/
    OptFSOOD, ``detector/bfact.py``, ``use_surrogate=False``): the cut-off is ``np.percentile`` of every penultimate
    activation of the ID training features. Its other mode (``use_surrogate=True``) picks the percentile in
    ``5, 10, ..., 95`` and the order in ``1..4`` by AUROC against Gaussian-noise surrogate OOD images; here that grid is
    ``--tune``'s, searched on ID validation data with generated OOD validation sets.

    Settings: :class:`BFActConfig`.
    """

    config_class = BFActConfig
    search_space = {"percentile": tuple(float(p) for p in range(5, 100, 5)), "order": (1, 2, 3, 4)}
    search_space_source = ("the OptFS authors' bfact.py surrogate search: percentile 5, 10, ..., 95 x n [1, 2, 3, 4] "
                           "(its AUROC on Gaussian-noise images; here --tune's ID-only validation)")
    #: ``percentile``: the percentile the cut-off was fitted at, checked at load (the activations are not kept).
    state_names = ("threshold", "percentile")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"threshold": (1,), "percentile": (1,)}

    def _fit(self, accumulated: FeatureStore) -> None:
        self.check_fit_count(accumulated.count)
        percentile = self.hyperparameters["percentile"]
        self.threshold = torch.tensor([chunked_percentile(accumulated.features, percentile)], dtype=torch.float64)
        self.percentile = torch.tensor([percentile], dtype=torch.float64)

    def _prepare(self) -> None:
        fitted, wanted = float(self.percentile[0]), self.hyperparameters["percentile"]
        if fitted != wanted:
            raise ValueError(f"bfact: the cut-off was fitted at percentile={fitted:g}, not {wanted:g}; load it with the "
                             "percentile it was fitted at, or fit a new detector")
        if float(self.threshold[0]) == 0.0:
            raise ValueError(f"bfact: the cut-off (percentile {wanted:g} of the ID activations) is 0, and z / t is "
                             "undefined; choose a higher percentile")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch)
        return energy_score(self.head(butterworth(features, self.threshold, self.hyperparameters["order"])))
