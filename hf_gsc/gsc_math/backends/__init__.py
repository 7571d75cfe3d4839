"""How ``F`` is taken and the head linearised, chosen once per detector, when its configuration is set.

Like PEFT's list of dispatchers, each backend module has ``dispatch(model, split_point, config)`` returning a
backend or ``None``; the first that returns one serves the detector:

1. :mod:`~hf_gsc.gsc_math.backends.multi_layer`: ``earlier_split_point`` is set (two layers, one budget; autograd).
2. :mod:`~hf_gsc.gsc_math.backends.closed_form`: the head has the registered pool / LayerNorm / linear form.
3. :mod:`~hf_gsc.gsc_math.backends.autograd`: any other split point (autograd through the model's own head modules).

There is no compiled (``torch.compile``, AOTInductor) or tabulated (per-class ``g`` and mask) backend: at
realistic scale (ResNet-50, ViT-B/16, Swin-T at 224 px) each saves under 2% of a forward (docs/efficiency.md).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...classifier.head_jacobians import LinearizedHead
from ...classifier.split_points import SplitPoint, resolve_split_point
from . import autograd, closed_form, multi_layer
from .base import Backend, Linearization


DISPATCHERS = (multi_layer.dispatch, closed_form.dispatch, autograd.dispatch)


def select_backend(model: nn.Module, config: Any) -> Backend:
    """The backend for ``config.split_point`` (and ``earlier_split_point``) of ``model``."""
    split_point = resolve_split_point(model, config.split_point)
    for dispatch in DISPATCHERS:
        backend = dispatch(model, split_point, config)
        if backend is not None:
            return backend
    raise AssertionError("the autograd backend applies to every split point")


def split_point_backend(split_point: SplitPoint) -> Backend:
    """The backend of one resolved split point (closed form where it applies, else autograd)."""
    if split_point.head_spec is not None:
        return closed_form.ClosedFormHead(split_point)
    return autograd.AutogradHead(split_point)


def linearize_head(
    split_point: SplitPoint, features: torch.Tensor, pixel_values: torch.Tensor | None = None, keep_graph: bool = True
) -> LinearizedHead:
    """The head of ``split_point`` at all of ``F`` with its vector-Jacobian and Jacobian-vector products, by the split
    point's backend (closed form where the head has a ``HeadSpec``, autograd otherwise, whose graph
    ``keep_graph=False`` frees after the first ``vjp``)."""
    return split_point_backend(split_point).linearize_at(features, pixel_values, whole_feature=True,
                                                         keep_graph=keep_graph).head


__all__ = ["DISPATCHERS", "Backend", "Linearization", "linearize_head", "select_backend", "split_point_backend"]
