"""ORA: OOD detection with relative angles (Demirel, Fumero & Locatello, NeurIPS 2025)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, choice_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .fdbd import boundary_denominators
from .interface import register_detector
from .penultimate import ClassStatistics, LinearHead, StatisticsPass


AGGREGATIONS = ("mean", "max", "min")


def relative_angles(features: torch.Tensor, head: LinearHead, centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(angles (B, K), defined (B, K))``: for each class ``c``, the angle at ``centre`` between the feature ``z`` and
    its projection ``z_c`` on the decision boundary between the predicted class ``p`` and ``c``, over ``pi`` (in
    ``[0, 1]``); float64.

    ``z_c = z - (y_p - y_c) / ||w_p - w_c||^2 (w_p - w_c)`` (``y = W z + b``). With ``a = z - centre``, ``u`` the unit
    normal ``(w_p - w_c) / ||w_p - w_c||``, ``s = a.u`` and ``delta = (y_p - y_c) / ||w_p - w_c||`` (the distance to
    the boundary), ``z_c - centre = a - delta u``, and the angle is ``atan2(delta sqrt(||a||^2 - s^2), ||a||^2 - delta
    s)``: ``(B, K)`` work on top of the logits, ``a W^T`` and the ``B x K`` weight-row distances
    (:func:`~hf_gsc.detectors.fdbd.boundary_denominators`), never a ``(B, K, D)`` tensor. ``defined`` is False where
    the authors' code divides ``0 / 0`` (``c = p``, or a class whose weight row equals ``w_p``). A feature exactly at
    the centre has no direction: the code's ``F.normalize`` makes it the zero vector, of cosine 0 with everything,
    so its angles are ``1/2``, as here.
    """
    features = features.double()
    weight = head.weight.double()
    logits = head(features)
    top, predicted = logits.max(dim=-1)
    centred = features - centre.double()
    along = centred @ weight.T  # a . w_c
    distances = boundary_denominators(weight, predicted)  # ||w_p - w_c||, 1 at c = p
    rows = torch.arange(features.shape[0], device=features.device)
    defined = (torch.arange(weight.shape[0], device=features.device)[None, :] != predicted[:, None]) & (distances > 0)
    distances = torch.where(defined, distances, torch.ones_like(distances))
    delta = (top[:, None] - logits) / distances
    s = (along[rows, predicted][:, None] - along) / distances
    squared = (centred**2).sum(dim=-1, keepdim=True)
    angles = torch.atan2(delta * (squared - s**2).clamp(min=0.0).sqrt(), squared - delta * s) / math.pi
    return torch.where(squared > 0, angles, torch.full_like(angles, 0.5)), defined


def ora_score(features: torch.Tensor, head: LinearHead, centre: torch.Tensor, aggregation: str) -> torch.Tensor:
    """The relative angles (:func:`relative_angles`) aggregated over the classes, ``(B, D) -> (B,)``, float64:
    ``mean`` and ``max`` count the undefined angles as 0 (the authors' ``nan_to_num``), ``min`` leaves them out."""
    angles, defined = relative_angles(features, head, centre)
    if aggregation == "min":
        return torch.where(defined, angles, torch.full_like(angles, math.inf)).amin(dim=-1)
    angles = torch.where(defined, angles, torch.zeros_like(angles))
    return angles.amax(dim=-1) if aggregation == "max" else angles.mean(dim=-1)


@dataclass
class ORAConfig(DetectorConfig):
    """Settings of OOD detection with relative angles (:class:`ORADetector`)."""

    method: ClassVar[str] = "ora"
    structural_names: ClassVar[tuple[str, ...]] = ()
    aggregation: str = setting(
        "mean", choice_check(AGGREGATIONS),
        "How the per-class angles become one score; ``\"mean\"``: the authors' OpenOOD ora.yml ``postprocessor_args`` "
        "(recommended there for cross-entropy backbones, ``\"max\"`` for SupCon ones; their stand-alone repository's "
        "runs use ``max``).")


@register_detector
class ORADetector(FittedDetector):
    """The angles, seen from the ID centre, between the feature and its projections on the decision boundaries
    between the predicted class and every other, aggregated over the classes (:func:`ora_score`); higher is ID.

    Demirel, Fumero, Locatello, "OOD Detection with Relative Angles", NeurIPS 2025. The reference is the authors'
    OpenOOD postprocessor, ``openood/postprocessors/ora_postprocessor.py`` of github.com/berkerdemirel/OpenOOD
    (their pull request to OpenOOD), with its ``configs/postprocessors/ora.yml``; the centre is the mean of the
    per-class means of the ID training features (true labels). Their stand-alone repository
    (github.com/berkerdemirel/ORA-OOD-Detection-with-Relative-Angles, ``util/ood_methods.py`` ``ora_score``) computes
    the same angles but takes the class means from the ID *evaluation* features it then scores, and the max over
    classes; here, as in the postprocessor, the centre is fitted on ID training data only.

    Differences from the code: the angle is ``atan2`` of the two components of ``z_c - centre`` along and across
    ``z - centre`` from the logits and ``(B, K)`` products (:func:`relative_angles`), where the code normalises
    both ``(B, D)`` vectors per class and takes ``arccos`` of their clamped dot product: the same angle, more
    accurate near 0 and 1 (``arccos`` loses half the digits there); float64 where the code is float32. A class with
    no fitting sample is refused (the code's ``clamp(min=1)`` puts a zero mean into the centre). A feature that is
    NaN stays NaN (decided OOD) where the code's ``nan_to_num`` would score it 0.

    Settings: :class:`ORAConfig`.
    """

    config_class = ORAConfig
    search_space = {"aggregation": AGGREGATIONS}
    search_space_source = "the authors' OpenOOD ora.yml postprocessor_sweep: aggregation_list [mean, max, min]"
    state_names = ("centre",)
    needs_labels = True

    def fit_requirement(self) -> tuple[int, str]:
        return self.head.num_classes, "one sample of every class, for the class means"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"centre": (self.feature_dim,)}

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        # Streamed float64 class sums: K D numbers whatever N.
        return "class means", lambda: StatisticsPass(ClassStatistics(self.head.num_classes),
                                                     lambda features, labels: (features, labels, None))

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.check_fit_count(accumulated.count)
        self.centre = accumulated.statistics.class_means(self.method).mean(dim=0)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return ora_score(self.features(batch), self.head, self.centre, self.hyperparameters["aggregation"])
