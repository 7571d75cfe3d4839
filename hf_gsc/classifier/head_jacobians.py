"""Closed-form logits, vector-Jacobian and Jacobian-vector products of the registered classifier heads.

Every :class:`hf_gsc.classifier.heads.HeadSpec` head (most entries of :data:`hf_gsc.classifier.architectures.ARCHITECTURES`), and every
``penultimate`` split, is

    y = W · norm(pool(F)) + b      or      y = W · pool(norm(F)) + b

with ``pool`` linear (first token, mean over tokens, mean over space, or identity), ``norm`` an optional
LayerNorm over the last dimension and ``W, b`` the classifier. GSC needs ``y``, one vector-Jacobian product
(``g = d y_c / dF``) and, for ``first_order``, one Jacobian-vector product ``J (F' - F)`` of all ``K`` logits.

Why not autograd: on these heads the arithmetic is a few microseconds, and GSC's time next to a small
backbone is bookkeeping: the number of ops. Measured on the ViT reference head at batch 16 (2 CPU threads):
autograd's forward + backward 280 µs; ``torch.func.jvp`` 2.0 ms, because functorch runs LayerNorm through a
Python decomposition and the classifier's constant weights get zero tangents that fall back to slow kernels.
The closed forms below, with the LayerNorm's affine part folded into the classifier each time the head is bound
(every call, so that they follow replaced or changed parameters), take about 100 µs for ``y`` and ``g`` together and 20 µs for ``J t`` (on the first token only, see
:func:`read_pool`). Split points without such a head (earlier blocks, arbitrary module paths) use autograd
(:func:`hf_gsc.gsc_math.backends.autograd.linearize_with_autograd`); the tests compare the closed forms with autograd through
the model's own LayerNorm and Linear modules, and with a central difference, on every registered head.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch


Pool = Literal["first_token", "mean_tokens", "mean_spatial", "identity"]
POOLS: tuple[Pool, ...] = get_args(Pool)


@dataclass(init=False)
class LinearizedHead:
    """A head evaluated at ``F``, with its derivatives there.

    Attributes:
        logits: ``y = head(F)``, ``(B, K)``, detached.
        vjp: ``(B, K) cotangent v -> (B, *feature_shape)`` ``v^T J`` per sample.
        jvp: ``(B, *feature_shape) tangent t -> (B, K)`` ``J t`` per sample, all ``K`` logits.
        function: the head itself, ``(B, *feature_shape) -> (B, K)``, for the exact update ``head(F')``.
        class_gradient: ``(B,) classes c -> (B, *feature_shape)`` ``g = d y_c / dF``, the ``vjp`` of a one-hot
            cotangent (defaults to exactly that; closed forms pick the classifier row instead).
        pooled_read: where the head reads ``F`` only through its mean over positions, the head on that mean
            (:class:`PooledRead`); the GSC step then works per channel (:mod:`hf_gsc.gsc_math.step`).
    """

    logits: torch.Tensor
    vjp: Callable[[torch.Tensor], torch.Tensor]
    jvp: Callable[[torch.Tensor], torch.Tensor]
    function: Callable[[torch.Tensor], torch.Tensor]
    class_gradient: Callable[[torch.Tensor], torch.Tensor]
    pooled_read: PooledRead | None

    def __init__(
        self,
        logits: torch.Tensor,
        vjp: Callable[[torch.Tensor], torch.Tensor],
        jvp: Callable[[torch.Tensor], torch.Tensor],
        function: Callable[[torch.Tensor], torch.Tensor],
        class_gradient: Callable[[torch.Tensor], torch.Tensor] | None = None,
        pooled_read: PooledRead | None = None,
    ) -> None:
        # Written out (``init=False``) so that ``class_gradient`` is always a function: the one-hot ``vjp`` unless
        # the caller gives one.
        self.logits, self.vjp, self.jvp, self.function = logits, vjp, jvp, function
        self.class_gradient = self._one_hot_gradient if class_gradient is None else class_gradient
        self.pooled_read = pooled_read

    def _one_hot_gradient(self, classes: torch.Tensor) -> torch.Tensor:
        return self.vjp(torch.nn.functional.one_hot(classes, self.logits.shape[-1]).to(self.logits.dtype))


#: Pools that average over positions: the gradient of a head after one repeats over the positions of each channel.
MEAN_POOLS: tuple[Pool, ...] = ("mean_spatial", "mean_tokens")


@dataclass(frozen=True)
class PooledRead:
    """A head that reads ``F`` only through its mean over positions, ``y = h(pool(F))`` (``pool`` =
    ``mean_spatial`` or ``mean_tokens``, ``h`` a LayerNorm and a linear layer, or a linear layer).

    ``g = d y_c / dF`` is then ``u / P`` at each of the ``P`` positions of a channel, ``u = d y_c / d pool(F)``,
    and a move of ``F`` reaches ``h`` only as ``pool(F' - F)``: GSC's ranking, mask and update reduce to
    per-channel quantities (:func:`hf_gsc.gsc_math.shortcircuit.repeated_top_k_counts`,
    :func:`hf_gsc.gsc_math.shortcircuit.masked_shift`).

    Attributes:
        pool: ``mean_spatial`` (``F`` is ``(B, C, H, W)``, channel-major: the positions of a channel are
            consecutive coordinates) or ``mean_tokens`` (``F`` is ``(B, N, D)`` or a channels-last ``(B, H, W, C)``,
            position-major).
        feature_shape: ``F``'s shape without the batch dimension.
        pooled: ``(B, C)`` ``pool(F)``.
        head: ``h`` linearised at ``pooled``.
    """

    pool: Pool
    feature_shape: torch.Size
    pooled: torch.Tensor
    head: LinearizedHead

    @property
    def positions(self) -> int:
        """``P``, the positions each channel is averaged over."""
        shape = self.feature_shape
        return shape[-2] * shape[-1] if self.pool == "mean_spatial" else math.prod(shape[:-1])

    @property
    def position_major(self) -> bool:
        """Whether coordinate ``(channel, position)`` of ``F`` flattened is ``position * C + channel``."""
        return self.pool == "mean_tokens"

    def by_channel(self, features: torch.Tensor) -> torch.Tensor:
        """``F`` ``(B, *feature_shape)`` as ``(B, C, P)`` (a view)."""
        if self.position_major:
            return features.flatten(1, -2).transpose(1, 2)
        return features.flatten(2)

    def coordinate_gradient(self, pooled_gradient: torch.Tensor) -> torch.Tensor:
        """``(B, C)`` ``u -> u / P``: each coordinate's ``g``, the same division :func:`pool_adjoint` makes."""
        return pooled_gradient / self.positions

    def channel_values(self, vector: torch.Tensor) -> torch.Tensor | None:
        """A per-coordinate ``(d,)`` vector of ``F`` as ``(C,)`` when it is the same at every position of each
        channel, else ``None``."""
        if self.position_major:
            grid = vector.view(-1, self.feature_shape[-1]).transpose(0, 1)
        else:
            grid = vector.view(self.feature_shape[0], -1)
        first = grid[:, :1]
        return first[:, 0] if torch.equal(grid, first.expand_as(grid)) else None

    def coordinates(self, per_channel: torch.Tensor) -> torch.Tensor:
        """A per-(channel, position) quantity ``(B, C, P)`` as flattened coordinates of ``F``, ``(B, d)``."""
        if self.position_major:
            per_channel = per_channel.transpose(1, 2)
        return per_channel.reshape(per_channel.shape[0], -1)


def pool(features: torch.Tensor, kind: Pool) -> torch.Tensor:
    """``(B, N, D) -> (B, D)`` (first_token, mean_tokens; mean_tokens also ``(B, H, W, C) -> (B, C)``, a
    channels-last map), ``(B, C, H, W) -> (B, C)`` (mean_spatial), identity."""
    if kind == "first_token":
        return features[:, 0]
    if kind == "mean_tokens":
        # Channels last: (B, N, D) tokens, or a (B, H, W, C) map (timm's Swin), averaged over every position.
        return features.mean(dim=1) if features.dim() == 3 else features.flatten(1, -2).mean(dim=1)
    if kind == "mean_spatial":
        # One op (a product with an averaging vector is five: views, the vector, the product).
        return features.mean(dim=(-2, -1))
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
        positions = math.prod(feature_shape[:-1])
        spread = (pooled / positions).view(pooled.shape[0], *[1] * (len(feature_shape) - 1), pooled.shape[-1])
        return spread.expand(-1, *feature_shape)
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


def layer_norm_jacobian_product(
    u: torch.Tensor, normalized: torch.Tensor, rstd: torch.Tensor, skip_mean_term: bool = False
) -> torch.Tensor:
    """``J u`` for the Jacobian ``J = rstd (I - 1 1^T / D - x̂ x̂^T / D)`` of ``x -> x̂`` (LayerNorm without its
    affine part), over the last dimension. ``J`` is symmetric, so this is also ``u^T J``.

    ``skip_mean_term``: leave out ``1 1^T u / D`` (two ops fewer). Exact when ``u`` has zero mean, or when the
    result only goes through a map that sends constant vectors to zero (the centred classifier ``W'_c``).
    """
    if not skip_mean_term:
        u = u - u.mean(dim=-1, keepdim=True)
    along_normalized = (u * normalized).sum(dim=-1, keepdim=True)
    return torch.addcmul(u, normalized, along_normalized, value=-1.0 / u.shape[-1]).mul(rstd)


@dataclass(frozen=True)
class PoolNormLinearHead:
    """``y = W · norm(pool(F)) + b`` (``norm_before_pool=False``) or ``y = W · pool(norm(F)) + b``, folded.

    Build it with :meth:`fold`. Every pool here averages (its weights sum to one) and LayerNorm is
    ``norm(x) = a ⊙ x̂ + β`` with ``x̂`` the normalised vector, so both forms are

        y = W' · pool(x̂) + b'    (or W' · x̂(pool(F)) + b'),   W' = W diag(a),  b' = b + W β,

    and the LayerNorm's Jacobian ``J = rstd (I - 1 1^T / D - x̂ x̂^T / D)`` reaches the classes as
    ``W' J = rstd (W'_c - (W'_c x̂) x̂^T / D)``, with ``W'_c`` the rows of ``W'`` minus their means (``1^T x̂ = 0``).
    The folded ``W'``, ``b'`` and ``W'_c`` are computed each time the head is bound, on every call (see
    :meth:`hf_gsc.classifier.split_points.SplitPoint.bound_head`), so they follow replaced or changed parameters; they and the
    per-batch ops are a few small matrix operations, which is what GSC's overhead next to a small backbone consists of.

    Attributes:
        pool: how tokens or positions are reduced (linear, weights summing to one).
        weight: ``(K, D)`` ``W'``; bias: ``(K,)`` ``b'`` or ``None``.
        norm_eps: LayerNorm epsilon; ``None`` = no LayerNorm (then ``W' = W``, ``b' = b``).
        norm_before_pool: the LayerNorm runs per token before pooling (Swin) instead of after (ConvNeXt).
        centered_weight: ``(K, D)`` ``W'_c`` (``None`` without LayerNorm).
    """

    pool: Pool
    weight: torch.Tensor
    bias: torch.Tensor | None
    norm_eps: float | None = None
    norm_before_pool: bool = False
    centered_weight: torch.Tensor | None = None
    # Transposed copies, (D, K): ``x @ W^T`` is then one op (``addmm`` / ``mm``) instead of two (``t`` + ``mm``).
    weight_t: torch.Tensor = field(init=False, repr=False)
    centered_weight_t: torch.Tensor | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if (self.norm_eps is None) != (self.centered_weight is None):
            raise ValueError("a PoolNormLinearHead has centered_weight exactly when it has norm_eps (a LayerNorm); "
                             "build it with PoolNormLinearHead.fold")
        object.__setattr__(self, "weight_t", self.weight.T.contiguous())
        centered = self.centered_weight
        object.__setattr__(self, "centered_weight_t", None if centered is None else centered.T.contiguous())

    @classmethod
    def fold(
        cls,
        pool: Pool,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        norm_eps: float | None = None,
        norm_weight: torch.Tensor | None = None,
        norm_bias: torch.Tensor | None = None,
        norm_before_pool: bool = False,
    ) -> PoolNormLinearHead:
        """The head of classifier ``(weight, bias)`` after an optional LayerNorm ``(norm_eps, norm_weight,
        norm_bias)``; the LayerNorm's affine part is folded into the classifier (in float64, then cast back)."""
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        if norm_before_pool and pool not in ("first_token", "mean_tokens"):
            raise ValueError(f"a LayerNorm before pooling normalises tokens; pool {pool!r} does not pool tokens")
        if norm_eps is None:
            return cls(pool, weight.detach(), None if bias is None else bias.detach())
        with torch.no_grad():
            folded = weight.double()
            if norm_weight is not None:
                folded = folded * norm_weight.double()
            folded_bias = None if bias is None else bias.double()
            if norm_bias is not None:
                shift = weight.double() @ norm_bias.double()
                folded_bias = shift if folded_bias is None else folded_bias + shift
            centered = folded - folded.mean(dim=1, keepdim=True)
        dtype = weight.dtype
        return cls(
            pool,
            folded.to(dtype),
            None if folded_bias is None else folded_bias.to(dtype),
            norm_eps,
            norm_before_pool,
            centered.to(dtype),
        )

    def _classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """``(B, D) -> (B, K)``."""
        return pooled @ self.weight_t if self.bias is None else torch.addmm(self.bias, pooled, self.weight_t)

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """``(B, *feature_shape) -> (B, K)``."""
        eps = self.norm_eps
        if eps is None:
            return self._classify(pool(features, self.pool))
        if self.norm_before_pool:
            return self._classify(pool(layer_norm_statistics(features, eps)[0], self.pool))
        return self._classify(layer_norm_statistics(pool(features, self.pool), eps)[0])

    def linearize(self, features: torch.Tensor) -> LinearizedHead:
        """``y`` at ``F`` and closures for ``v^T J`` and ``J t``; the LayerNorm statistics are computed once.

        A head that reads ``F`` through a mean over positions (LayerNorm, if any, after it) is linearised on
        ``pool(F)`` and carries that as :attr:`LinearizedHead.pooled_read`; its products on ``F`` are the pooled
        ones spread by :func:`pool_adjoint` (the same numbers as linearising on ``F`` directly).
        """
        kind = self.pool
        if kind not in MEAN_POOLS or (self.norm_eps is not None and self.norm_before_pool):
            return self._linearize(features, kind, self)
        shape = features.shape[1:]
        pooled = pool(features, kind)
        inner = self._linearize(pooled, "identity", self._on_pooled)
        return LinearizedHead(
            inner.logits,
            vjp=lambda v: pool_adjoint(inner.vjp(v), kind, shape),
            jvp=lambda t: inner.jvp(pool(t, kind)),
            function=self,
            class_gradient=lambda c: pool_adjoint(inner.class_gradient(c), kind, shape),
            pooled_read=PooledRead(kind, shape, pooled, inner),
        )

    def _on_pooled(self, pooled: torch.Tensor) -> torch.Tensor:
        """The head after its pool, ``(B, D) -> (B, K)`` (LayerNorm, if any, after pooling)."""
        eps = self.norm_eps
        return self._classify(pooled if eps is None else layer_norm_statistics(pooled, eps)[0])

    def _linearize(
        self, features: torch.Tensor, kind: Pool, function: Callable[[torch.Tensor], torch.Tensor]
    ) -> LinearizedHead:
        """:meth:`linearize` with pool ``kind``; ``function`` is the head as a function of ``features``."""
        shape = features.shape[1:]
        eps = self.norm_eps
        if eps is None:
            logits = self._classify(pool(features, kind))
            return LinearizedHead(
                logits,
                vjp=lambda v: pool_adjoint(v @ self.weight, kind, shape),
                jvp=lambda t: pool(t, kind) @ self.weight_t,
                function=function,
                class_gradient=lambda c: pool_adjoint(self.weight.index_select(0, c), kind, shape),
            )

        # Products with W' go through W'_c: W' J = W'_c J (J 1 = 0), and W'_c 1 = 0 lets J's 1 1^T / D term be
        # skipped (skip_mean_term) on either side.
        centered, centered_t = self.centered_weight, self.centered_weight_t
        assert centered is not None and centered_t is not None  # set with norm_eps (checked in __post_init__)
        if self.norm_before_pool:
            # Per token: x̂, rstd (B, N, D), (B, N, 1); the classes see pool(x̂).
            normalized, rstd = layer_norm_statistics(features, eps)
            logits = self._classify(pool(normalized, kind))

            def pullback(rows: torch.Tensor) -> torch.Tensor:  # rows (B, D) of W'_c -> (B, *shape)
                spread = pool_adjoint(rows, kind, shape)
                return layer_norm_jacobian_product(spread, normalized, rstd, skip_mean_term=True)

            def jvp(t: torch.Tensor) -> torch.Tensor:  # pool (linear) before the product with W'_c
                return pool(layer_norm_jacobian_product(t, normalized, rstd, skip_mean_term=True), kind) @ centered_t

        else:
            normalized, rstd = layer_norm_statistics(pool(features, kind), eps)
            logits = self._classify(normalized)

            def pullback(rows: torch.Tensor) -> torch.Tensor:
                pulled = layer_norm_jacobian_product(rows, normalized, rstd, skip_mean_term=True)
                return pool_adjoint(pulled, kind, shape)

            def jvp(t: torch.Tensor) -> torch.Tensor:
                return layer_norm_jacobian_product(pool(t, kind), normalized, rstd, skip_mean_term=True) @ centered_t

        # v^T W' J = pullback(v^T W'_c); for a one-hot v that is the row W'_c[c].
        return LinearizedHead(
            logits,
            vjp=lambda v: pullback(v @ centered),
            jvp=jvp,
            function=function,
            class_gradient=lambda c: pullback(centered.index_select(0, c)),
        )


def read_pool(kind: Pool) -> Pool:
    """The pool that keeps exactly the coordinates of ``F`` a ``kind`` head reads.

    A first-token head (ViT, DeiT) reads ``F[:, 0]`` only: its gradient is zero on every other token, so
    the mask, the short-circuit and the logit update can all run on ``pool(F, "first_token")`` (``(B, D)``
    instead of ``(B, N, D)``) and be spread back with :func:`pool_adjoint`. Every other head reads all of ``F``.
    """
    return "first_token" if kind == "first_token" else "identity"


def restrict_to_read_part(head: PoolNormLinearHead) -> PoolNormLinearHead:
    """``head`` as a function of ``pool(F, read_pool(head.pool))``: a first-token head becomes an identity-pool
    head on the first token (a per-token LayerNorm commutes with picking the token); other heads are unchanged."""
    if read_pool(head.pool) == "identity":
        return head
    return dataclasses.replace(head, pool="identity", norm_before_pool=False)
