"""ConjNorm: Bregman-divergence density with a p-norm and its conjugate (Peng et al., ICLR 2024)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, choice_check, number_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import ClassStatistics, FeatureStore


EPSILON = 1e-10


def p_normalise(features: torch.Tensor, p: float) -> torch.Tensor:
    """``x / (||x||_p + 1e-10)`` row-wise, float64 (the code's ``normalizer``)."""
    features = features.double()
    return features / (torch.linalg.vector_norm(features, ord=p, dim=-1, keepdim=True) + EPSILON)


def conjnorm_dual(prototypes: torch.Tensor, p: float, dual_norm: str = "feature") -> torch.Tensor:
    """``grad(1/2 ||.||_q^2)(mu_k) = mu_k |mu_k|^(q-2) / ||mu_k||_q^(q-2)`` for every prototype, ``(K, D)`` float64,
    ``q = p / (p - 1)`` the conjugate exponent.

    Args:
        prototypes: ``(K, D)``, already p-normalised.
        dual_norm: the axis of ``||mu||_q``: ``"feature"`` (the formula: the norm of each prototype) or ``"class"`` (the
            public code as written, ``norm(b, axis=-1)`` of the transposed ``(D, K)`` prototype matrix, i.e. for each
            feature coordinate over the classes).
    """
    if dual_norm not in ("feature", "class"):
        raise ValueError(f"dual_norm must be 'feature' or 'class', got {dual_norm!r}")
    q = p / (p - 1.0)
    mu = prototypes.double()
    axis = -1 if dual_norm == "feature" else 0
    mu_norm = torch.linalg.vector_norm(mu, ord=q, dim=axis, keepdim=True) + EPSILON
    # mu |mu|^(q-2), written sign(mu) |mu|^(q-1) so that a zero coordinate stays 0 when q < 2.
    return mu.sign() * mu.abs() ** (q - 1) / mu_norm ** (q - 2)


def conjnorm_similarity(features: torch.Tensor, dual: torch.Tensor, p: float, classes: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """``-1/2 ||a||_q^2 + <a, grad(1/2 ||.||_q^2)(mu_k)>`` for p-normalised ``a``, every prototype ``mu_k``.

    This is minus the Bregman divergence of ``1/2 ||.||_q^2`` between ``a`` and ``mu_k`` without its
    ``-1/2 ||mu_k||_q^2`` term, which the per-class normaliser absorbs (the code's ``dist``).

    Args:
        features: ``(B, D)`` (normalised here).
        dual: ``(K, D)`` the prototypes' gradients, :func:`conjnorm_dual` (derived once from the fitted prototypes).
        classes: ``(B,)``: each row's similarity to its own prototype only, ``(B,)`` (``B D`` work where every
            prototype's is ``B K D``: the fit's normalisers read only the own class).
    Returns:
        ``(B, K)`` float64, or ``(B,)`` with ``classes``.
    """
    q = p / (p - 1.0)
    a = p_normalise(features, p)
    dual = dual.double()
    half_norm = -0.5 * torch.linalg.vector_norm(a, ord=q, dim=-1, keepdim=True).add(EPSILON) ** 2
    if classes is not None:
        return half_norm[:, 0] + (a * dual[classes]).sum(dim=-1)
    return half_norm + a @ dual.T


def conjnorm_score(features: torch.Tensor, dual: torch.Tensor, log_normalisers: torch.Tensor, p: float,
                   temperature: float) -> torch.Tensor:
    """``log sum_k exp(s_k(F) / t) / Z_k``, ``s_k`` = :func:`conjnorm_similarity` (``dual``: :func:`conjnorm_dual` of
    the prototypes), ``(B,)`` float64."""
    logits = conjnorm_similarity(features, dual, p) / temperature
    return torch.logsumexp(logits - log_normalisers.double()[None, :], dim=1)


@dataclass
class ConjNormConfig(DetectorConfig):
    """Settings of ConjNorm (:class:`ConjNormDetector`)."""

    method: ClassVar[str] = "conjnorm"
    p: float = setting(1.5, number_check(1.0, math.inf, low_open=True),
                       "The norm's ``p``; 1.5: the code's ``ord_def`` for ImageNet ResNet-50 (its CIFAR scripts use "
                       "2.2).")
    temperature: float = setting(0.0005, number_check(0.0, math.inf, low_open=True),
                                 "``t``; 0.0005: the code's ``t1`` with ``p = 1.5`` (0.05 in the CIFAR scripts).")
    dual_norm: str = setting(
        "feature", choice_check(("feature", "class")),
        "``\"feature\"``: the paper's gradient of ``1/2 ||mu||_q^2`` (norm of each prototype). The public ``dist`` "
        "takes that norm along the class axis of the transposed prototype matrix instead; ``\"class\"`` reproduces "
        "the code as written. See :func:`conjnorm_dual`.")


@register_detector
class ConjNormDetector(FittedDetector):
    """Normalised class-conditional density of the p-normalised feature, :func:`conjnorm_score`.

    Peng, Luo, Zhang, Li, Fang, "ConjNorm: Tractable Density Estimation for Out-of-Distribution
    Detection", ICLR 2024. Follows the authors' ``run_imagenet_resnet.py`` (the script with ``p = 1.5``):
    prototypes ``mu_k`` = p-normalised mean penultimate feature of the ID training samples of class
    ``k``; the partition function of class ``k`` is estimated on the training samples of class ``k``,
    ``Z_k = sum_{i: y_i = k} exp(s_k(F_i) / t)`` (kept as ``log Z_k``, computed with logsumexp; the code
    exponentiates directly); score ``log sum_k exp(s_k(F) / t) / Z_k``.

    Settings: :class:`ConjNormConfig`.
    """

    config_class = ConjNormConfig
    search_space = {"p": (1.5, 2.0, 2.5, 3.0)}
    search_space_source = "not in OpenOOD: p over the paper's range (1, 3]"
    state_names = ("prototypes", "log_normalisers")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        # Derived from the fitted prototypes by _prepare; a buffer so that .to(device) moves it with the rest.
        self.register_buffer("dual", None, persistent=False)

    def fit_requirement(self) -> tuple[int, str]:
        return self.head.num_classes, "one sample per class"

    needs_labels = True

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"prototypes": (self.num_classes, self.feature_dim), "log_normalisers": (self.num_classes,)}

    def _fit(self, accumulated: FeatureStore) -> None:
        # Two readings of the stored batches (the prototypes need every feature before any similarity), each batch
        # made float64 one at a time.
        num_classes = self.head.num_classes
        self.check_fit_count(accumulated.count)
        statistics = ClassStatistics(num_classes)
        for features, labels in accumulated.batches():
            statistics.update(features, labels)
        p, temperature, dual_norm = (self.hyperparameters[key] for key in ("p", "temperature", "dual_norm"))
        self.prototypes = p_normalise(statistics.class_means(self.method), p)
        dual = conjnorm_dual(self.prototypes, p, dual_norm)
        own = torch.cat([conjnorm_similarity(features, dual, p, classes=labels)
                         for features, labels in accumulated.batches()]) / temperature
        labels = torch.cat(accumulated.labels)
        self.log_normalisers = torch.stack([torch.logsumexp(own[labels == k], dim=0) for k in range(num_classes)])

    def _prepare(self) -> None:
        # The prototypes' gradients, K D powers: once, not per scored batch.
        self.dual = conjnorm_dual(self.prototypes, self.hyperparameters["p"], self.hyperparameters["dual_norm"])

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return conjnorm_score(self.features(batch), self.dual, self.log_normalisers,
                              *(self.hyperparameters[key] for key in ("p", "temperature")))
