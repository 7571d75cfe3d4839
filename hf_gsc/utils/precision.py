"""Where a computation must not follow the backbone's precision: float32 with autocast off.

A bf16 backbone (a bf16 model, or ``accelerator.autocast()``) is fine for features; what comes after it in GSC
(the gradient ranking, the short-circuit, the first-order update), ODIN (an input step of about 0.004, below
bf16's resolution near 1) and ASH (percentile cuts, sums and ``exp(s1 / s2)`` over thousands of activations)
works on small differences that bf16's 8-bit mantissa rounds away. Those parts run under
:func:`full_precision` on inputs cast to :func:`step_dtype`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def step_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to compute in for inputs of ``dtype``: float32, or float64 for float64 (a comparison, not
    ``torch.promote_types``, which a forward would count as one more dispatched op)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def parameter_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first parameter: what its own modules must be fed."""
    return next(model.parameters()).dtype


@contextlib.contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """Autocast off, on CPU and on ``device``'s type, so that each op runs in its inputs' dtype. Written as plain
    ``with`` blocks (no ``ExitStack``), which ``torch.compile`` traces without a graph break."""
    other = device.type != "cpu" and (device.type == "cuda" or torch.amp.is_autocast_available(device.type))
    with torch.autocast("cpu", enabled=False):
        if other:
            with torch.autocast(device.type, enabled=False):
                yield
        else:
            yield


__all__ = ["full_precision", "parameter_dtype", "step_dtype"]
