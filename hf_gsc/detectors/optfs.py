"""OptFS: the optimal piecewise-constant feature shaping (Zhao et al., ICLR 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..settings.config import DetectorConfig, choice_check, setting
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead, chunked_quantile


#: The share of the ID activations left out below and above the shaped range (``np.quantile(feature, 1e-3)`` and
#: ``1 - 1e-3``), and the number of intervals it is cut into.
TAIL, INTERVALS = 1e-3, 100.0
OOD_SCORES = ("vanilla", "energy")


def shaping_intervals(chunks: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
    """``(left boundaries (M,), width)``: ``np.arange(left, right, (right - left) / 100)`` between the ``1e-3`` and
    ``1 - 1e-3`` quantiles of every ID activation (float64)."""
    left, right = chunked_quantile(chunks, TAIL), chunked_quantile(chunks, 1 - TAIL)
    width = (right - left) / INTERVALS
    return torch.from_numpy(np.arange(left, right, width)), float(width)


def in_intervals(features: torch.Tensor, boundaries: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """``(B, D, M)``: whether each activation is in ``[x_i, x_i + width)`` for each left boundary ``x_i`` (``width``
    ``(1,)``, on the device: no host read in the forward)."""
    boundaries = boundaries.to(features)
    expanded = features[..., None]
    return (expanded >= boundaries) & (expanded < boundaries + width.to(features))


def shaped(features: torch.Tensor, boundaries: torch.Tensor, width: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``z theta_i`` for the interval ``i`` each activation is in (0 outside ``[x_1, x_M + width)``): the code's
    ``feat_p``; ``(B, D) -> (B, D)``."""
    weights = (in_intervals(features, boundaries, width) * theta.to(features)).sum(dim=-1)
    return features * weights


@dataclass
class OptFSConfig(DetectorConfig):
    """Settings of the optimal feature shaping (:class:`OptFSDetector`)."""

    method: ClassVar[str] = "optfs"
    structural_names: ClassVar[tuple[str, ...]] = ()  # the shaping does not depend on the score read from it
    ood_score: str = setting(
        "vanilla", choice_check(OOD_SCORES),
        "``\"vanilla\"``: the predicted class's logit of the shaped feature, without bias (\"Ours (V)\", the default "
        "of the authors' ``detector/ours.py``); ``\"energy\"``: the energy of the shaped feature's logits.")


@register_detector
class OptFSDetector(FittedDetector):
    """The predicted class's logit (no bias) of the feature shaped piecewise-constantly, ``sum_d w_cd z_d theta(z_d)``
    (:func:`shaped`), ``theta`` on 100 intervals of the ID activations' range set to each interval's mean contribution
    to the predicted logit of the ID training samples (normalised to norm 1000).

    Zhao et al., "Towards Optimal Feature-Shaping Methods for Out-of-Distribution Detection", ICLR 2024.
    The reference is the authors' code, github.com/Qinyu-Allen-Zhao/OptFSOOD ``detector/ours.py`` (``setup`` with the
    fixed weight, ``postprocess``): the intervals split the range between the ``1e-3`` and ``1 - 1e-3`` quantiles of
    every ID training activation; ``theta_i = mean_n sum_d [z_nd in interval i] w_{c_n d} z_nd`` over the training
    features with their predicted classes ``c_n``, then ``theta / ||theta|| 1000``. The shaped feature's predicted
    logit without bias (``ood_score="vanilla"``) or its energy (``"energy"``, also the CADRef authors' OptFS) is the
    score.

    Where this differs from the code: the quantiles and boundaries are float64 (numpy keeps float32 features'
    quantiles in float32), so on a float32 model an activation within rounding of a boundary may fall on its other
    side. Left out: the code's dynamic-weight variant (``dynamic_weight``, off by default; its appendix).

    Cost: scoring compares every activation with the ``M`` (about 100) boundaries, a ``(B, D, M)`` mask; the fit
    reads the stored features twice (the quantiles, then ``theta``).

    Settings: :class:`OptFSConfig`.
    """

    config_class = OptFSConfig
    search_space_source = "the authors fit theta on ID data and sweep nothing"
    state_names = ("boundaries", "width", "theta")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"boundaries": (None,), "width": (1,), "theta": (None,)}

    def _fit(self, accumulated: FeatureStore) -> None:
        self.check_fit_count(accumulated.count)
        boundaries, width = shaping_intervals(accumulated.features)
        head = LinearHead(self.head.weight.double().cpu(), self.head.bias.double().cpu())
        totals = torch.zeros(boundaries.shape[0], dtype=torch.float64)
        for features in accumulated.features:  # one batch at a time, one interval at a time: (B, D) temporaries
            features = features.double()
            contribution = head.weight[head(features).argmax(dim=1)] * features
            for index, left in enumerate(boundaries.tolist()):
                totals[index] += (((features >= left) & (features < left + width)) * contribution).sum()
        means = totals / accumulated.count
        self.boundaries, self.width = boundaries, torch.tensor([width], dtype=torch.float64)
        self.theta = means / means.norm() * 1000

    def _prepare(self) -> None:
        if self.boundaries.shape != self.theta.shape:
            raise ValueError(f"optfs: boundaries {tuple(self.boundaries.shape)} and theta {tuple(self.theta.shape)} "
                             "must have one entry per interval")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch).double()
        logits = self.head(features)
        feature_shaped = shaped(features, self.boundaries.double(), self.width.double(), self.theta.double())
        if self.hyperparameters["ood_score"] == "energy":
            return energy_score(self.head(feature_shaped))
        weight = self.head_weight.double()[logits.argmax(dim=1)]
        return (weight * feature_shaped).sum(dim=1)
