"""Residual: the norm of the feature outside the principal space (Wang, Li, Feng & Zhang, CVPR 2022), as OpenOOD v1.5
runs it."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import StatisticsPass
from .vim import ViMConfig, vim_origin, vim_principal_dim, vim_residual_norm, vim_residual_space


def second_moment_about(mean: torch.Tensor, covariance: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """``E[(z - u)(z - u)^T] = C + (m - u)(m - u)^T`` from the features' mean ``m`` and covariance ``C`` (about ``m``,
    divided by ``N``): sklearn's ``EmpiricalCovariance(assume_centered=True).fit(z - u).covariance_``, ``(D, D)``."""
    offset = mean.double() - origin.double()
    return covariance.double() + offset[:, None] * offset[None, :]


@dataclass
class ResidualConfig(ViMConfig):
    """Settings of the residual norm (:class:`ResidualDetector`): ViM's ``principal_dim``, with its default by the ViM
    authors' rule for the width (OpenOOD residual.yml's fixed ``dim: 512`` is for its ImageNet ResNet-50)."""

    method: ClassVar[str] = "residual"


@register_detector
class ResidualDetector(FittedDetector):
    """Minus the norm of the feature's component outside the principal space of the ID features, ``-||(z - u) R||``
    (:func:`~hf_gsc.detectors.vim.vim_residual_norm`).

    The Residual score of Wang, Li, Feng, Zhang, "ViM: Out-Of-Distribution with Virtual-logit Matching", CVPR 2022
    (ViM without its logits). The reference is OpenOOD v1.5's ``openood/postprocessors/residual_postprocessor.py``
    with ``configs/postprocessors/residual.yml``: the origin ``u = -pinv(W) b``; the second moment of ``z - u`` over
    the ID validation features (``id_loader_dict['val']``; here the ``validation`` fit split, never test),
    ``EmpiricalCovariance(assume_centered=True)``; ``R`` its eigenvectors beyond the ``principal_dim`` largest.

    Numerical differences only: the second moment is derived from streamed float64 sums (the mean and the
    covariance about it; the features are never held), and the eigenvectors from ``eigh`` of the symmetric matrix
    where OpenOOD calls the general ``np.linalg.eig``; the residual space is the same up to rounding (a norm sees no
    rotation within it). ``principal_dim`` defaults to the ViM authors' rule for the width, not to OpenOOD's fixed
    512 (see :class:`ResidualConfig`).

    Settings: :class:`ResidualConfig`.
    """

    config_class = ResidualConfig
    search_space_source = "OpenOOD residual.yml has no sweep (dim 512)"
    fit_split = "validation"
    state_names = ("origin", "residual_space")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        if not self.principal_dim < self.feature_dim:
            raise ValueError(f"residual: principal_dim must be below the feature width {self.feature_dim}, got "
                             f"{self.principal_dim}")

    @property
    def principal_dim(self) -> int:
        return self.hyperparameters["principal_dim"] or vim_principal_dim(self.feature_dim)

    def fit_requirement(self) -> tuple[int, str]:
        return self.feature_dim, "feature dim, for the feature covariance"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"origin": (self.feature_dim,), "residual_space": (self.feature_dim, self.feature_dim - self.principal_dim)}

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        return self.moment_accumulator()

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.check_fit_count(accumulated.count)
        statistics = accumulated.statistics
        self.origin = vim_origin(self.head)
        moment = second_moment_about(statistics.class_means(self.method)[0], statistics.tied_covariance(self.method),
                                     self.origin)
        self.residual_space = vim_residual_space(moment, self.principal_dim)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return -vim_residual_norm(self.features(batch), self.origin, self.residual_space)
