"""GSC's update after the backbone compiled ahead of time: ``torch.export`` + AOTInductor, one package file.

``torch.compile`` (:meth:`hf_gsc.GSCForImageClassification.compile_update`) fuses the 25-35 small ops of
:func:`hf_gsc.fused_update.gsc_update` into a few kernels, but every call still goes through dynamo's guard
check and the compiled region's Python wrappers: on the ViT reference head at batch 16 that costs as much as
the fusion saves. An AOTInductor package runs the same kernels from C++ behind a single call. Measured with
``scripts/benchmark_efficiency.py`` on this project's 2-core CPU (``docs/efficiency.md``, paired per round, four
runs): at batch 16 the package saves 0.48-0.75 ms per batch against the eager update on the ViT reference model
and 0.68-0.83 ms on Swin, about 0.07-0.11x of MSP's time.

What is baked into a package, and must match at call time (:func:`package_key`): the GSC settings
``gsc_update`` takes as Python values (mask ratio, operation and its parameters, approximation, score,
temperature), the head's structure (pool, LayerNorm epsilon, whether it has a bias), the per-sample shape of
the read part of ``F``, dtype, device, and the torch version and CPU capability it was compiled with. The batch
size is dynamic. The head's tensors are inputs, so a package follows changes to the model's parameters.
"""

from __future__ import annotations

import os
import platform
import tempfile
from typing import Any, NamedTuple

import torch
from torch import nn

from .fused_update import UpdateOutput, gsc_update
from .head_derivatives import PoolNormLinearHead

KEY_METADATA = "hf_gsc_update_key"


class UpdateSettings(NamedTuple):
    """The arguments of :func:`hf_gsc.fused_update.gsc_update` after ``read_part`` and ``head``."""

    mask_ratio: tuple[int, int]
    k_bound: int
    operation: str
    alpha: float
    clip_bound: float
    beta: float
    approximation: str
    score: str
    temperature: float


# What the compiled C++ depends on in this process: a package built elsewhere may use other instructions.
_BUILD = (torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability())


def package_key(read_part: torch.Tensor, head: PoolNormLinearHead, settings: UpdateSettings) -> tuple:
    """Everything a package's compiled code depends on besides the batch size and the head's tensor values.

    A tuple of plain values, cheap enough to compare on every batch; its ``repr`` is stored in the package.
    """
    return (
        tuple(settings),
        (head.pool, head.norm_eps, head.norm_before_pool, head.bias is not None),
        tuple(read_part.shape[1:]),
        str(read_part.dtype),
        read_part.device.type,
        _BUILD,
    )


class _ExportedUpdate(nn.Module):
    """``gsc_update`` with the head's tensors as inputs: ``(read_part, weight, centered_weight[, bias])``."""

    def __init__(self, head: PoolNormLinearHead, settings: UpdateSettings) -> None:
        super().__init__()
        self.structure = (head.pool, head.norm_eps, head.norm_before_pool)
        self.settings = settings

    def forward(
        self,
        read_part: torch.Tensor,
        weight: torch.Tensor,
        centered_weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        pool_kind, norm_eps, norm_before_pool = self.structure
        head = PoolNormLinearHead(pool_kind, weight, bias, norm_eps, norm_before_pool, centered_weight)
        return tuple(gsc_update(read_part, head, *self.settings))


def _head_inputs(head: PoolNormLinearHead) -> list[torch.Tensor]:
    return [head.weight, head.centered_weight] + ([] if head.bias is None else [head.bias])


class UpdatePackage:
    """A loaded AOTInductor package of ``gsc_update`` for one :func:`package_key`; call it like ``gsc_update``."""

    def __init__(self, runner: Any, key: tuple) -> None:
        self.key = key
        self._runner = runner
        # AOTICompiledModel.__call__ parses its input and output tree specs from JSON on every call (about 0.1 ms
        # next to a small backbone); the loader's boxed_run takes the flat tensor list directly.
        loader = getattr(runner, "loader", None)
        self._boxed_run = getattr(loader, "boxed_run", None)

    def __call__(self, read_part: torch.Tensor, head: PoolNormLinearHead) -> UpdateOutput:
        inputs = [read_part, *_head_inputs(head)]
        if self._boxed_run is not None:
            return UpdateOutput(*self._boxed_run(inputs))
        return UpdateOutput(*self._runner(*inputs))


def load_or_compile_package(
    read_part: torch.Tensor,
    head: PoolNormLinearHead,
    settings: UpdateSettings,
    package_path: str | os.PathLike | None = None,
) -> UpdatePackage:
    """The update package for these example inputs: loaded from ``package_path`` when the file there was built
    for the same :func:`package_key`, otherwise compiled (10-30 s on a CPU; needs a C++ compiler) and, when
    ``package_path`` is given, written there (replacing a GSC update package built for another key; any other
    file there is an error, never overwritten).

    Raises:
        ValueError: ``package_path`` holds something other than a GSC update package.
        RuntimeError: the compilation failed.

    Args:
        read_part: an example ``pool(F, read)`` ``(B, *shape)``; any batch size is accepted afterwards.
        head: the head on the read part (:meth:`hf_gsc.split_points.SplitPoint.bound_head`), with a LayerNorm.
        settings: baked into the package.
        package_path: a ``.pt2`` file to reuse or write; ``None`` compiles into a temporary file.
    """
    if head.centered_weight is None:
        raise ValueError("an update package needs a head with a LayerNorm (centered_weight); affine heads use tables")
    key = package_key(read_part, head, settings)
    if package_path is not None and os.path.exists(package_path):
        runner = _load_own_package(os.fspath(package_path))
        if runner.get_metadata()[KEY_METADATA] == repr(key):
            return UpdatePackage(runner, key)
    inputs = (read_part, *_head_inputs(head))
    batch = torch.export.Dim("batch", min=1)
    dynamic_shapes = ({0: batch},) + (None,) * (len(inputs) - 1)
    with torch.no_grad():
        exported = torch.export.export(_ExportedUpdate(head, settings), inputs, dynamic_shapes=dynamic_shapes)
    inductor_configs = {"aot_inductor.metadata": {KEY_METADATA: repr(key)}}
    with tempfile.TemporaryDirectory() as scratch:
        path = os.fspath(package_path) if package_path is not None else os.path.join(scratch, "gsc_update.pt2")
        try:
            path = torch._inductor.aoti_compile_and_package(exported, package_path=path, inductor_configs=inductor_configs)
        except Exception as error:
            raise RuntimeError(
                f"compiling the GSC update ahead of time failed ({type(error).__name__}: {error}); AOTInductor needs "
                "a working C++ compiler. compile_update(ahead_of_time=False) or the eager forward still work."
            ) from error
        runner = torch._inductor.aoti_load_package(path)
    return UpdatePackage(runner, key)


def _load_own_package(path: str) -> Any:
    """The package at ``path``, which must be a GSC update package (one that :func:`load_or_compile_package` wrote)."""
    try:
        runner = torch._inductor.aoti_load_package(path)
    except Exception as error:
        raise ValueError(
            f"package_path {path!r} exists but is not an AOTInductor package ({type(error).__name__}: {error}); "
            "remove it or pass another path"
        ) from error
    if KEY_METADATA not in runner.get_metadata():
        raise ValueError(
            f"package_path {path!r} is an AOTInductor package but not a GSC update package; it is not overwritten: "
            "pass another path"
        )
    return runner
