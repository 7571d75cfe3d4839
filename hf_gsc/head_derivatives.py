"""Closed-form logits, vector-Jacobian and Jacobian-vector products of the registered classifier heads.

Every head registered in :data:`hf_gsc.split_points.ARCHITECTURES`, and every ``penultimate`` split, is

    y = W · norm(pool(F)) + b      or      y = W · pool(norm(F)) + b

with ``pool`` linear (first token, mean over tokens, mean over space, or identity), ``norm`` an optional
LayerNorm over the last dimension and ``W, b`` the classifier. GSC needs ``y``, one vector-Jacobian product
(``g = d y_c / dF``) and, for ``first_order``, one Jacobian-vector product ``J (F' - F)`` of all ``K`` logits.

Why not autograd: on these heads the arithmetic is a few microseconds, and GSC's time next to a small
backbone is bookkeeping. Measured on the ViT reference head at batch 16 (2 CPU threads): autograd's
forward + backward 280 µs; ``torch.func.jvp`` 2.0 ms, because functorch runs LayerNorm through a Python
decomposition and the classifier's constant weights get zero tangents that fall back to slow kernels.
The closed forms below take about 130 µs for ``y`` and ``g`` together. Split points without such a head
(earlier blocks, arbitrary module paths) use autograd (:func:`hf_gsc.split_points.linearize_with_autograd`);
the tests compare both on every registered head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

Pool = Literal["first_token", "mean_tokens", "mean_spatial", "identity"]
POOLS: tuple[str, ...] = ("first_token", "mean_tokens", "mean_spatial", "identity")


@dataclass
class LinearizedHead:
    """A head evaluated at ``F``, with its derivatives there.

    Attributes:
        logits: ``y = head(F)``, ``(B, K)``, detached.
        vjp: ``(B, K) cotangent v -> (B, *feature_shape)`` ``v^T J`` per sample.
        jvp: ``(B, *feature_shape) tangent t -> (B, K)`` ``J t`` per sample, all ``K`` logits.
        function: the head itself, ``(B, *feature_shape) -> (B, K)``, for the exact update ``head(F')``.
        class_gradient: ``(B,) classes c -> (B, *feature_shape)`` ``g = d y_c / dF``, the ``vjp`` of a one-hot
            cotangent (defaults to exactly that; closed forms pick the classifier row instead).
    """

    logits: torch.Tensor
    vjp: Callable[[torch.Tensor], torch.Tensor]
    jvp: Callable[[torch.Tensor], torch.Tensor]
    function: Callable[[torch.Tensor], torch.Tensor]
    class_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.class_gradient is None:
            num_classes = self.logits.shape[-1]
            self.class_gradient = lambda c: self.vjp(
                torch.nn.functional.one_hot(c, num_classes).to(self.logits.dtype)
            )


def pool(features: torch.Tensor, kind: Pool) -> torch.Tensor:
    """``(B, N, D) -> (B, D)`` (first_token, mean_tokens), ``(B, C, H, W) -> (B, C)`` (mean_spatial), identity."""
    if kind == "first_token":
        return features[:, 0]
    if kind == "mean_tokens":
        return features.mean(dim=1)
    if kind == "mean_spatial":
        # A product with a constant averaging vector: for small maps (ResNet's 2x2) it runs 3x faster
        # than the reduction kernel of .mean(dim=(-2, -1)), and it is the same average.
        positions = features.shape[-2] * features.shape[-1]
        return features.flatten(2) @ features.new_full((positions,), 1.0 / positions)
    if kind == "identity":
        return features
    raise ValueError(f"pool must be one of {POOLS}, got {kind!r}")


def pool_adjoint(pooled: torch.Tensor, kind: Pool, feature_shape: torch.Size) -> torch.Tensor:
    """The transpose of :func:`pool`: ``(B, D) -> (B, *feature_shape)``."""
    if kind == "first_token":
        spread = pooled.new_zeros(pooled.shape[0], *feature_shape)
        spread[:, 0] = pooled
        return spread
    if kind == "mean_tokens":
        return (pooled / feature_shape[0]).unsqueeze(1).expand(-1, *feature_shape)
    if kind == "mean_spatial":
        return (pooled / (feature_shape[-2] * feature_shape[-1]))[:, :, None, None].expand(-1, *feature_shape)
    if kind == "identity":
        return pooled
    raise ValueError(f"pool must be one of {POOLS}, got {kind!r}")


def layer_norm_statistics(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x̂ = (x - mean) * rstd`` and ``rstd = 1 / sqrt(var + eps)`` over the last dimension (biased variance,
    as ``torch.nn.LayerNorm``); ``rstd`` keeps a trailing dimension of size 1."""
    # The aten kernel behind nn.LayerNorm returns mean and rstd with the output: one op instead of four.
    normalized, mean, rstd = torch.native_layer_norm(x, x.shape[-1:], None, None, eps)
    return normalized, rstd


def layer_norm_jacobian_product(u: torch.Tensor, normalized: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``J u`` for the Jacobian ``J = rstd (I - 1 1^T / D - x̂ x̂^T / D)`` of ``x -> x̂`` (LayerNorm without its
    affine part), over the last dimension. ``J`` is symmetric, so this is also ``u^T J``."""
    return rstd * (u - u.mean(dim=-1, keepdim=True) - normalized * (u * normalized).mean(dim=-1, keepdim=True))


@dataclass(frozen=True)
class PoolNormLinearHead:
    """``y = W · norm(pool(F)) + b`` (``norm_before_pool=False``) or ``y = W · pool(norm(F)) + b``.

    Attributes:
        pool: how tokens or positions are reduced (linear).
        weight: ``(K, D)`` classifier weight; bias: ``(K,)`` or ``None``.
        norm_weight, norm_bias: LayerNorm affine parameters ``(D,)`` (``None`` = no affine part).
        norm_eps: LayerNorm epsilon; ``None`` = no LayerNorm.
        norm_before_pool: apply the LayerNorm per token before pooling (Swin) instead of after (ConvNeXt).
    """

    pool: Pool
    weight: torch.Tensor
    bias: torch.Tensor | None
    norm_eps: float | None = None
    norm_weight: torch.Tensor | None = None
    norm_bias: torch.Tensor | None = None
    norm_before_pool: bool = False

    def _times_norm_weight(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.norm_weight is None else x * self.norm_weight

    def _affine(self, normalized: torch.Tensor) -> torch.Tensor:
        scaled = self._times_norm_weight(normalized)
        return scaled if self.norm_bias is None else scaled + self.norm_bias

    def _classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(pooled, self.weight, self.bias)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """``(B, *feature_shape) -> (B, K)``."""
        if self.norm_eps is None:
            return self._classify(pool(features, self.pool))
        if self.norm_before_pool:
            return self._classify(pool(self._affine(layer_norm_statistics(features, self.norm_eps)[0]), self.pool))
        return self._classify(self._affine(layer_norm_statistics(pool(features, self.pool), self.norm_eps)[0]))

    def linearize(self, features: torch.Tensor) -> LinearizedHead:
        """``y`` at ``F`` and closures for ``v^T J`` and ``J t``; the LayerNorm statistics are computed once."""
        shape = features.shape[1:]
        if self.norm_eps is None:
            logits = self._classify(pool(features, self.pool))

            def pullback(pulled: torch.Tensor) -> torch.Tensor:
                return pool_adjoint(pulled, self.pool, shape)

            def jvp(t: torch.Tensor) -> torch.Tensor:
                return pool(t, self.pool) @ self.weight.T

        elif self.norm_before_pool:
            normalized, rstd = layer_norm_statistics(features, self.norm_eps)
            logits = self._classify(pool(self._affine(normalized), self.pool))

            def pullback(pulled: torch.Tensor) -> torch.Tensor:
                spread = pool_adjoint(pulled, self.pool, shape)
                return layer_norm_jacobian_product(self._times_norm_weight(spread), normalized, rstd)

            def jvp(t: torch.Tensor) -> torch.Tensor:
                moved = layer_norm_jacobian_product(t, normalized, rstd)
                return pool(self._times_norm_weight(moved), self.pool) @ self.weight.T

        else:
            normalized, rstd = layer_norm_statistics(pool(features, self.pool), self.norm_eps)
            logits = self._classify(self._affine(normalized))

            def pullback(pulled: torch.Tensor) -> torch.Tensor:
                scaled = self._times_norm_weight(pulled)
                return pool_adjoint(layer_norm_jacobian_product(scaled, normalized, rstd), self.pool, shape)

            def jvp(t: torch.Tensor) -> torch.Tensor:
                moved = layer_norm_jacobian_product(pool(t, self.pool), normalized, rstd)
                return self._times_norm_weight(moved) @ self.weight.T

        # v^T J = pullback(v^T W); for a one-hot v that is the classifier row W[c].
        return LinearizedHead(
            logits,
            vjp=lambda v: pullback(v @ self.weight),
            jvp=jvp,
            function=self,
            class_gradient=lambda c: pullback(self.weight.index_select(0, c)),
        )
