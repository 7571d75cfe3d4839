"""ViM: virtual-logit matching (Wang, Li, Feng & Zhang, CVPR 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, integer_check, setting
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead


def vim_principal_dim(feature_dim: int) -> int:
    """The authors' choice: 1000 if ``D >= 2048``, 512 if ``D >= 768``, else ``D // 2``."""
    if feature_dim >= 2048:
        return 1000
    if feature_dim >= 768:
        return 512
    return feature_dim // 2


def vim_origin(head: LinearHead) -> torch.Tensor:
    """``u = -pinv(W) b``, ``(D,)``: the feature-space origin that makes the logits bias-free."""
    return -(torch.linalg.pinv(head.weight.double()) @ head.bias.double())


def vim_residual_space(covariance: torch.Tensor, principal_dim: int) -> torch.Tensor:
    """``(D, D - principal_dim)``: eigenvectors of ``covariance`` = ``E[(F - u)(F - u)^T]`` beyond the
    ``principal_dim`` largest."""
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    order = torch.argsort(eigenvalues, descending=True)
    return eigenvectors[:, order[principal_dim:]].contiguous()


def vim_residual_norm(features: torch.Tensor, origin: torch.Tensor, residual_space: torch.Tensor) -> torch.Tensor:
    """``||(F - u) R||_2``: norm of the feature's component outside the principal space, ``(B,)``."""
    return ((features.double() - origin.double()) @ residual_space.double()).norm(dim=-1)


def vim_score(
    features: torch.Tensor, head: LinearHead, origin: torch.Tensor, residual_space: torch.Tensor,
    alpha: float | torch.Tensor,
) -> torch.Tensor:
    """``logsumexp(W F + b) - alpha ||(F - u) R||``: energy minus the scaled virtual logit, ``(B,)``."""
    return energy_score(head(features.double())) - alpha * vim_residual_norm(features, origin, residual_space)


@dataclass
class ViMConfig(DetectorConfig):
    """Settings of virtual-logit matching (:class:`ViMDetector`)."""

    method: ClassVar[str] = "vim"
    principal_dim: int | None = setting(
        None, integer_check(1, optional=True),
        "Dimension of the principal space; ``None``: the authors' rule :func:`vim_principal_dim` (1000 for "
        "``D >= 2048``, 512 for ``D >= 768``, else ``D // 2``; github.com/haoqiwang/vim). Must be below the "
        "feature width (checked at the fit).")


@register_detector
class ViMDetector(FittedDetector):
    """Energy minus ``alpha`` times the residual norm of the feature, :func:`vim_score`.

    Wang, Li, Feng, Zhang, "ViM: Out-Of-Distribution with Virtual-logit Matching", CVPR 2022 (code:
    github.com/haoqiwang/vim). On the ID training data: the origin ``u = -pinv(W) b``, the principal
    space of dimension :func:`vim_principal_dim` of the uncentred (about ``u``) feature covariance,
    and ``alpha = mean(max logit) / mean(residual norm)``.

    Settings: :class:`ViMConfig`.
    """

    config_class = ViMConfig
    search_space_source = ("principal_dim follows the feature width by the paper's rule; OpenOOD's sweep "
                           "[256, 1000] is for 2048-d ResNet-50 features and does not carry over to other widths")
    state_names = ("origin", "residual_space", "alpha")

    def fit_requirement(self) -> tuple[int, str]:
        return self.head.feature_dim, "feature dim, for the feature covariance"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        dim = self.feature_dim
        principal_dim = self.hyperparameters["principal_dim"] or vim_principal_dim(dim)
        return {"origin": (dim,), "residual_space": (dim, dim - principal_dim), "alpha": (1,)}

    def _fit(self, accumulated: FeatureStore) -> None:
        # Two readings of the stored batches, each batch made float64 one at a time: the uncentred covariance about u
        # and the mean max logit, then (the residual space known) the mean residual norm.
        dim = self.head.feature_dim
        principal_dim = self.hyperparameters["principal_dim"] or vim_principal_dim(dim)
        if not principal_dim < dim:
            raise ValueError(f"vim: principal_dim must be < the feature dim {dim}, got {principal_dim}")
        count = accumulated.count
        self.check_fit_count(count)
        self.origin = vim_origin(self.head)
        head = LinearHead(self.head.weight.double(), self.head.bias.double())
        second_moment = torch.zeros(dim, dim, dtype=torch.float64)
        max_logit = torch.zeros((), dtype=torch.float64)
        for features in accumulated.features:
            centred = features.double() - self.origin
            second_moment += centred.T @ centred
            max_logit += head(features.double()).amax(dim=-1).sum()
        self.residual_space = vim_residual_space(second_moment / count, principal_dim)
        residual = sum(vim_residual_norm(features, self.origin, self.residual_space).sum()
                       for features in accumulated.features)
        self.alpha = ((max_logit / count) / (residual / count)).reshape(1)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return vim_score(self.features(batch), self.head, self.origin, self.residual_space, self.alpha)
