"""NECO: neural-collapse-inspired OOD detection (Ben Ammar, Belkhir, Popescu, Manzanera & Franchi, ICLR 2024)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, integer_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import StatisticsPass


#: The share of the standardised features' variance the default ``neco_dim`` explains (the 90% rule of the NECO
#: postprocessor in github.com/mueller-mp/maha-norm and of ``neco_score`` in the ORA authors' repository).
EXPLAINED_VARIANCE = 0.90
#: The architectures (transformers ``model_type``) whose score the authors' code does not multiply by the max logit.
NO_MAX_LOGIT = ("resnet",)
#: The architectures whose score the authors' code divides by the norm of the raw feature, not the standardised one.
RAW_NORM = ("deit", "swin")


def standard_scale(variance: torch.Tensor, mean: torch.Tensor, count: int) -> torch.Tensor:
    """``sqrt(variance)``, with 1 for a feature indistinguishable from a constant: sklearn's ``StandardScaler.scale_``
    (``_is_constant_feature``: ``var <= n eps var + (n mean eps)^2``, float64 ``eps``), ``(D,)`` float64."""
    variance, mean = variance.double().clamp(min=0.0), mean.double()
    eps = torch.finfo(torch.float64).eps
    constant = variance <= count * eps * variance + (count * mean * eps) ** 2
    return torch.where(constant, torch.ones_like(variance), variance.sqrt())


def principal_axes(covariance: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PCA of the standardised features from their raw covariance: ``(eigenvalues (D,) descending, axes (D, D) as
    columns)`` of ``diag(1/s) C diag(1/s)``, float64, the ``explained_variance_`` (up to the ``N / (N - 1)`` factor,
    which no ratio sees) and ``components_.T`` (up to each axis's sign, which no norm sees) of sklearn's
    ``PCA().fit(StandardScaler().fit_transform(features))``."""
    standardised = covariance.double() / scale[:, None] / scale[None, :]
    eigenvalues, eigenvectors = torch.linalg.eigh((standardised + standardised.T) / 2)
    order = torch.argsort(eigenvalues, descending=True)
    return eigenvalues[order], eigenvectors[:, order]


def explained_dim(eigenvalues: torch.Tensor, share: float = EXPLAINED_VARIANCE) -> int:
    """The fewest leading axes whose explained-variance ratios sum to at least ``share``:
    ``np.where(np.cumsum(pca.explained_variance_ratio_) >= 0.90)[0][0] + 1``."""
    cumulative = torch.cumsum(eigenvalues.double() / eigenvalues.double().sum(), dim=0)
    return int((cumulative < share).sum()) + 1


def neco_score(features: torch.Tensor, mean: torch.Tensor, scale: torch.Tensor, axes: torch.Tensor,
               max_logit: torch.Tensor | None, raw_norm: bool) -> torch.Tensor:
    """``||P x|| / ||x||`` (times the max logit where given): ``x = (z - mean) / scale`` the standardised feature,
    ``P`` its projection on the ``axes`` ``(D, d)`` (the leading principal axes of the ID training data), the norm in
    the denominator that of ``x``, or of ``z`` itself with ``raw_norm``; ``(B, D) -> (B,)``, float64."""
    raw = features.double()
    standardised = (raw - mean.double()) / scale.double()
    ratio = (standardised @ axes.double()).norm(dim=-1) / (raw if raw_norm else standardised).norm(dim=-1)
    return ratio if max_logit is None else ratio * max_logit.double()


def _optional_bool(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None (the authors' rule for the model), got {value!r}")
    return value


@dataclass
class NECOConfig(DetectorConfig):
    """Settings of neural-collapse-inspired OOD detection (:class:`NECODetector`)."""

    method: ClassVar[str] = "neco"
    structural_names: ClassVar[tuple[str, ...]] = ()  # every axis is kept: each setting applies at scoring
    neco_dim: int | None = setting(
        None, integer_check(1, optional=True),
        "Principal axes scored on; ``None``: the fewest that explain 90% of the standardised ID features' variance (the "
        "NECO postprocessor of github.com/mueller-mp/maha-norm and the ORA authors' ``neco_score``; the NECO "
        "authors' ``test_all_ood.py`` takes it per model on the command line, with no default). At most the "
        "feature width.")
    max_logit: bool | None = setting(
        None, _optional_bool,
        "Multiply the ratio by the max logit; ``None``: the authors' rule, every architecture but ResNet "
        "(``if model_architecture_type != 'resnet': score *= maxlogit``), read from ``config.model_type``.")
    raw_norm: bool | None = setting(
        None, _optional_bool,
        "Divide by the norm of the raw feature ``z`` instead of the standardised one; ``None``: the authors' rule, "
        "raw for DeiT and Swin (``if model_architecture_type in ['deit', 'swin']``), read from "
        "``config.model_type``.")


@register_detector
class NECODetector(FittedDetector):
    """The share of the standardised feature's norm in the leading principal subspace of the ID training features,
    ``||P x|| / ||x||``, times the max logit (:func:`neco_score`).

    Ben Ammar, Belkhir, Popescu, Manzanera, Franchi, "NECO: NEural Collapse Based Out-of-distribution Detection",
    ICLR 2024. The reference is the authors' code (gitlab.com/drti/neco, its ``neco()`` OOD evaluation, read from
    a public copy): ``StandardScaler`` fitted on the ID training features, ``PCA(D)`` fitted on the standardised
    ones; a feature's score is the norm of its first ``neco_dim`` PCA coordinates over the norm of its standardised
    vector, multiplied by its max logit. Paper and code differ; this follows the code:

    * the paper writes the score as ``||P h(x)|| / ||h(x)||`` of the feature ``h(x)``; the code standardises the
      feature first and projects the standardised one, divides by its norm except for DeiT and Swin (there, the
      raw feature's norm: ``raw_norm``), and multiplies by the max logit for every architecture but ResNet
      (``max_logit``). Both switches are settings whose ``None`` default applies the code's rule to
      ``config.model_type``.
    * ``neco_dim`` is a command-line argument of the code, chosen per model; the default here is the 90% rule of
      the other public NECO postprocessors (maha-norm's OpenOOD ``neco_postprocessor.py``, the ORA authors'
      ``neco_score``), on the same standardised PCA.

    Numerical differences only: the PCA is the eigendecomposition of the standardised features' covariance, derived
    from streamed float64 sums (the features are never held), where sklearn takes the SVD of the centred
    standardised features; the mean of the standardised training features, which sklearn's PCA subtracts, is zero
    in exact arithmetic and is not subtracted. Fitting needs at least ``D`` samples, as the code's ``PCA(D)``.
    Every principal axis and its variance is kept (``D x D`` float64, as the code's ``PCA(D)``), so that
    ``neco_dim`` can change after the fit without another.

    Settings: :class:`NECOConfig`.
    """

    config_class = NECOConfig
    search_space_source = ("the authors choose neco_dim per model on the command line; neither their "
                           "code nor maha-norm's neco.yml has a sweep")
    reads_logits = False
    state_names = ("mean", "scale", "axes", "variances")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        dim = self.hyperparameters["neco_dim"]
        if dim is not None and dim > self.feature_dim:
            raise ValueError(f"neco: neco_dim must be at most the feature width {self.feature_dim}, got {dim}")

    def resolve_defaults(self, model: nn.Module, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if hyperparameters["max_logit"] is None:
            hyperparameters["max_logit"] = model_type not in NO_MAX_LOGIT
        if hyperparameters["raw_norm"] is None:
            hyperparameters["raw_norm"] = model_type in RAW_NORM
        return hyperparameters

    def fit_requirement(self) -> tuple[int, str]:
        return self.head.feature_dim, "feature dim, for the PCA of every feature dimension (the code's PCA(D))"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        dim = self.feature_dim
        return {"mean": (dim,), "scale": (dim,), "axes": (dim, dim), "variances": (dim,)}

    def _prepare(self) -> None:
        # The axes scored on: the first neco_dim, or as many as explain 90% of the variance.
        self.neco_dim = self.hyperparameters["neco_dim"] or explained_dim(self.variances)

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        # The mean and covariance of every feature, streamed: (D + D^2) float64 whatever N.
        return self.moment_accumulator()

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.check_fit_count(accumulated.count)
        statistics = accumulated.statistics
        covariance = statistics.tied_covariance(self.method)  # one class: the covariance about the mean
        self.mean = statistics.class_means(self.method)[0]
        self.scale = standard_scale(torch.diagonal(covariance), self.mean, statistics.count)
        self.variances, self.axes = principal_axes(covariance, self.scale)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch)
        max_logit = self.head(features.double()).amax(dim=-1) if self.hyperparameters["max_logit"] else None
        return neco_score(features, self.mean, self.scale, self.axes[:, :self.neco_dim], max_logit,
                          self.hyperparameters["raw_norm"])
