"""ReAct: rectified activations (Sun, Guo & Li, NeurIPS 2021)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, number_check, setting
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead, chunked_percentile


def react_logits(features: torch.Tensor, head: LinearHead, clip: float | torch.Tensor) -> torch.Tensor:
    """``W min(F, c) + b``: the penultimate feature clipped from above at ``c``. ``(B, D) -> (B, K)``. A tensor ``c``
    stays on the device (no host read in the forward)."""
    return head(features.clamp(max=torch.as_tensor(clip, dtype=features.dtype, device=features.device)))


@dataclass
class ReActConfig(DetectorConfig):
    """Settings of rectified activations (:class:`ReActDetector`)."""

    method: ClassVar[str] = "react"
    percentile: float = setting(90.0, number_check(0.0, 100.0),
                                "Percentile of the ID training activations at which they are clipped; 90: the "
                                "paper's default.")


@register_detector
class ReActDetector(FittedDetector):
    """Energy of the logits of the clipped penultimate feature, :func:`react_logits`.

    Sun, Guo, Li, "ReAct: Out-of-distribution Detection With Rectified Activations", NeurIPS 2021
    (code: github.com/deeplearning-wisc/react). The threshold ``c`` is the ``percentile``-th percentile
    of all penultimate activations of the ID fitting data (``np.percentile(activations.flatten(), 90)``
    in the authors' code); here fitted on ID *validation* data, never test.

    Settings: :class:`ReActConfig`.
    """

    config_class = ReActConfig
    in_default_table = True
    search_space = {"percentile": (85.0, 90.0, 95.0, 99.0)}
    search_space_source = "OpenOOD react.yml: percentile_list [85, 90, 95, 99]"
    fit_split = "validation"
    state_names = ("threshold",)

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"threshold": (1,)}

    def _fit(self, accumulated: FeatureStore) -> None:
        # np.percentile's value, selected from the stored batches as they are (no float64 copy, no sorted copy).
        self.check_fit_count(accumulated.count)
        self.threshold = torch.tensor([chunked_percentile(accumulated.features, self.hyperparameters["percentile"])],
                                      dtype=torch.float64)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return energy_score(react_logits(self.features(batch), self.head, self.threshold))
