"""What every backend returns: ``F`` and the head linearised on the part of ``F`` it reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...classifier.head_jacobians import LinearizedHead, Pool, pool, pool_adjoint
from ...classifier.split_points import SplitPoint
from ...utils.precision import full_precision, step_dtype


if TYPE_CHECKING:
    from ...detectors.backbone_pass import BackbonePass


@dataclass(frozen=True)
class Linearization:
    """``F`` of a batch and the head linearised at it.

    Attributes:
        features: ``F``, ``(B, *feature_shape)``; for two layers, ``[F_earlier, F_final]`` flattened, ``(B, d)``.
        read: the pool keeping the part of ``F`` the head reads (``first_token`` for a first-token head,
            ``identity`` = all of ``F``).
        read_part: ``pool(features, read)``, what ``head`` takes.
        head: the head as a function of ``read_part``, linearised there.
        layer_sizes: coordinates per layer when ``features`` joins several layers, else ``None``.
    """

    features: torch.Tensor
    read: Pool
    read_part: torch.Tensor
    head: LinearizedHead
    layer_sizes: tuple[int, ...] | None = None

    def spread(self, flat: torch.Tensor) -> torch.Tensor:
        """A per-coordinate quantity of the read part, ``(B, d)``, as one of ``F``, ``(B, *feature_shape)``
        (zero, or ``False``, where the head does not read)."""
        return pool_adjoint(flat.view_as(self.read_part), self.read, self.features.shape[1:])

    def restrict(self, diagonal: torch.Tensor | None) -> torch.Tensor | None:
        """A per-coordinate vector of ``F``, ``(d_F,)``, restricted to the read part, ``(d,)``."""
        if diagonal is None or self.read == "identity":
            return diagonal
        return pool(diagonal.view(1, *self.features.shape[1:]), self.read).flatten()


class Backend(ABC):
    """How ``F`` is taken and the head linearised, for one split point of one model (chosen once, see
    :func:`hf_gsc.gsc_math.backends.select_backend`). Holds no per-batch state: one backend may serve many threads."""

    def __init__(self, split_point: SplitPoint) -> None:
        self.split_point = split_point

    @property
    def feature_split(self) -> SplitPoint:
        """The split point whose captured tensor is this backend's ``F`` (what a shared backbone pass captures)."""
        return self.split_point

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``F``, ``(B, *feature_shape)``: the backbone run without gradient up to the split point."""
        return self.feature_split.features(pixel_values)

    def features_of(self, batch: BackbonePass) -> torch.Tensor:
        """``F`` from a shared backbone pass that captured :attr:`feature_split`."""
        return batch.features(self.feature_split)

    def linearize(
        self,
        pixel_values: torch.Tensor,
        features: torch.Tensor | None = None,
        whole_feature: bool = False,
        keep_graph: bool = True,
    ) -> Linearization:
        """``F`` (``features`` when already taken) and the head linearised there, in float32 (float64 for a float64
        model) with autocast off, whatever the backbone ran in (:mod:`hf_gsc.utils.precision`).

        Args:
            whole_feature: linearise on all of ``F`` even where the head reads part of it (random selection
                draws one number per coordinate of ``F``, whatever the head reads).
            keep_graph: autograd backends only: keep the head's graph for ``J t`` (the first-order update);
                otherwise it is freed after ``g``.
        """
        features = self.features(pixel_values) if features is None else features
        with full_precision(features.device):
            return self.linearize_at(features.to(step_dtype(features.dtype)), pixel_values, whole_feature, keep_graph)

    @abstractmethod
    def linearize_at(
        self, features: torch.Tensor, pixel_values: torch.Tensor | None, whole_feature: bool, keep_graph: bool
    ) -> Linearization:
        """:meth:`linearize` at given ``features``; the returned head computes in the dtype of ``features`` (for a
        closed-form head) or at least float32 (autograd heads, see :func:`hf_gsc.gsc_math.backends.autograd.in_model_dtype`)."""
