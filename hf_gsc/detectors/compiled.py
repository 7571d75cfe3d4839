"""A detector's forward compiled whole: the opt-in served path (:meth:`hf_gsc.OODDetector.compiled`).

Every detector's forward (GSC's step and every one-pass method's scoring) is tensor code with no host round trip:
mask sizes stay tensors, masks have the input's shape, fitted constants are tensors, and the input's values are
checked on the device (a row that is not finite gets a NaN score, decided OOD: :func:`hf_gsc.utils.inputs.fail_closed`).
So ``torch.compile(detector, fullgraph=True)`` takes it in one graph, and :func:`compiled` wraps that for serving:

* the checks a compiled graph cannot make are made first, in eager code: the detector is ready (fitted), the input's
  shape and dtype, and the one-time warning of a detector without a threshold;
* ``mode="reduce-overhead"`` on a GPU records the graph as CUDA graphs, replayed at later calls with one launch;
  each call then starts a new step (``torch.compiler.cudagraph_mark_step_begin``) and the outputs are copied out of
  the graph's memory, so a later call never overwrites what an earlier one returned.

Cost: the first call with a new batch size (or dtype, device, setting value) compiles, seconds to minutes; later
calls with the same ones reuse the graph. Worth it for a served model that sees the same batch sizes again and
again (a batch-1 endpoint most of all, where launches dominate); not for one pass over a data set.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


#: The ``mode`` values of :func:`torch.compile` a served path may ask for.
COMPILE_MODES: tuple[str, ...] = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile_mode(mode: Any, name: str = "mode") -> str:
    """``mode`` if it is one of :data:`COMPILE_MODES`, else a ``ValueError`` naming ``name``."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"{name} must be one of {COMPILE_MODES} (torch.compile's modes), got {mode!r}")
    return mode


class CompiledDetector:
    """``detector``'s forward compiled with :func:`torch.compile` (``fullgraph=True``), called like the detector:
    ``compiled(pixel_values, labels=None)`` returns the detector's output (:class:`hf_gsc.OODDetectorOutput`, or
    GSC's :class:`hf_gsc.GSCOutput`). Settings assigned on ``detector.config`` later are honoured: the compiled
    graph guards on the values it read and compiles again when one changes."""

    def __init__(self, detector: Any, mode: str = "default", backend: str = "inductor",
                 dynamic: bool | None = None) -> None:
        self.detector = detector
        self.mode = check_compile_mode(mode)
        self.backend = backend
        options: dict[str, Any] = {"fullgraph": True, "dynamic": dynamic, "backend": backend}
        if backend == "inductor":
            options["mode"] = mode
        self._forward: Callable[..., Any] = torch.compile(detector.forward, **options)

    def __call__(self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        detector = self.detector
        detector.check_ready()
        pixel_values = detector._check_pixel_values(pixel_values)
        detector.warn_if_uncalibrated(stacklevel=3)  # which a compiled graph cannot give
        cuda_graphs = self.mode == "reduce-overhead" and pixel_values.device.type == "cuda"
        if cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        output = self._forward(pixel_values, labels, **kwargs)
        return _copied(output) if cuda_graphs else output

    def __repr__(self) -> str:
        return f"CompiledDetector({self.detector.method!r}, mode={self.mode!r}, backend={self.backend!r})"


def _copied(output: Any) -> Any:
    """``output`` with every tensor field cloned out of the CUDA graph's memory."""
    values = {field.name: getattr(output, field.name) for field in dataclasses.fields(output)}
    return type(output)(**{name: value.clone() if isinstance(value, torch.Tensor) else value
                           for name, value in values.items()})


def compiled(detector: Any, mode: str = "default", backend: str = "inductor", dynamic: bool | None = None) -> CompiledDetector:
    """``detector``'s forward compiled whole (:class:`CompiledDetector`); see the module docstring for the cost."""
    return CompiledDetector(detector, mode=mode, backend=backend, dynamic=dynamic)


__all__ = ["COMPILE_MODES", "CompiledDetector", "check_compile_mode", "compiled"]
