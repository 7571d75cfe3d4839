"""KL matching: KL divergence of the softmax to the nearest class's mean softmax (Hendrycks et al., ICML 2022)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import ClassStatistics, LinearHead, StatisticsPass


def softmax_by_prediction(features: torch.Tensor, head: LinearHead) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(W z + b), argmax(W z + b))`` in float64: what KL matching averages, and the class it goes to."""
    logits = head(features).double()
    return torch.softmax(logits, dim=-1), logits.argmax(dim=-1)


def klm_templates(class_sums: torch.Tensor, class_counts: torch.Tensor) -> torch.Tensor:
    """``(K, K)``: row ``k`` the mean softmax of the fitting samples predicted as ``k``, or the one-hot vector ``e_k``
    where none is (as OpenOOD's ``setup`` does for a class without a sample)."""
    num_classes = class_counts.shape[0]
    empty = class_counts == 0
    templates = class_sums / class_counts.clamp(min=1)[:, None]
    templates[empty] = torch.eye(num_classes, dtype=templates.dtype, device=templates.device)[empty]
    return templates


def kl_to_templates(probabilities: torch.Tensor, templates: torch.Tensor) -> torch.Tensor:
    """``KL(p || q_k)`` for every row ``p`` of ``probabilities`` ``(B, K)`` and template ``q_k`` of ``templates``
    ``(T, K)``, ``(B, T)``, float64, as ``scipy.stats.entropy(p, q_k)``: both normalised to sum to 1, terms with
    ``p_j = 0`` count 0, and a term with ``p_j > 0 = q_kj`` makes the divergence infinite (a one-hot template).
    Computed as ``sum p log p - p . log q_k`` in one product (a ``(B, T, K)`` tensor would be 256 MB for a batch of 32
    at ``K = 1000``)."""
    p = probabilities.double()
    q = templates.double()
    p = p / p.sum(dim=-1, keepdim=True)
    q = q / q.sum(dim=-1, keepdim=True)
    negative_entropy = torch.special.xlogy(p, p).sum(dim=-1, keepdim=True)
    finite_log_q = torch.where(q > 0, q.log(), torch.zeros((), dtype=q.dtype, device=q.device))
    divergence = negative_entropy - p @ finite_log_q.T
    unsupported = ((p > 0).double() @ (q == 0).double().T) > 0
    return divergence.masked_fill(unsupported, torch.inf)


def klm_score(features: torch.Tensor, head: LinearHead, templates: torch.Tensor) -> torch.Tensor:
    """``-min_k KL(softmax(W z + b) || q_k)``, ``(B,)``."""
    probabilities, _ = softmax_by_prediction(features, head)
    return -kl_to_templates(probabilities, templates).amin(dim=-1)


@dataclass
class KLMConfig(DetectorConfig):
    """KL matching has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "klm"


@register_detector
class KLMDetector(FittedDetector):
    """Minus the smallest KL divergence of the softmax to a class template, :func:`klm_score`.

    Hendrycks, Basart, Mazeika, Zou, Kwon, Mostajabi, Steinhardt, Song, "Scaling Out-of-Distribution Detection for
    Real-World Settings", ICML 2022 (KL matching). Reference: OpenOOD v1.5 ``kl_matching_postprocessor.py``: the
    template of class ``k`` is the mean softmax of the ID samples the model *predicts* as ``k`` (no labels read), a
    one-hot vector for a class never predicted, and the score is ``-min_k scipy.stats.entropy(p, q_k)``. OpenOOD
    fits the templates on its ID validation split; here on the fit split (ID training data), never test or OOD data.
    The softmax is taken in float64 (OpenOOD: float32 on the GPU).

    Settings: :class:`KLMConfig`.
    """

    config_class = KLMConfig
    search_space_source = "OpenOOD klm.yml: no hyperparameters"
    state_names = ("templates",)

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"templates": (self.num_classes, self.num_classes)}

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        # Streamed float64 sums of the softmax per predicted class: K^2 numbers whatever N.
        return "softmax sums by predicted class", lambda: StatisticsPass(ClassStatistics(self.num_classes),
                                                                         self._softmax_by_prediction)

    def _softmax_by_prediction(self, features: torch.Tensor, labels: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor, None]:
        probabilities, predicted = softmax_by_prediction(features, self.head)
        return probabilities, predicted.cpu(), None

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.check_fit_count(accumulated.count)
        statistics = accumulated.statistics
        assert statistics.class_sums is not None and statistics.shift is not None  # the count checked: samples seen
        # The sums are kept about a shift (ClassStatistics): sum x = sum (x - s) + n s per class.
        sums = statistics.class_sums + statistics.class_counts[:, None] * statistics.shift
        self.templates = klm_templates(sums, statistics.class_counts)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return klm_score(self.features(batch), self.head, self.templates)
