"""The evaluation's ``accelerate.Accelerator``: device, processes and mixed precision.

A precision the device cannot run is an error here, not a silent fp32 run.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from .errors import InputError


def make_accelerator(mixed_precision: str | None = None) -> Any:
    """An ``Accelerator`` with ``mixed_precision`` (``None``: accelerate's config / ``ACCELERATE_MIXED_PRECISION``).

    Raises :class:`InputError` for a precision the device cannot run: accelerate itself refuses bf16 on a
    GPU without it, and accepts fp16 on a CPU while running it as fp32 (no autocast), which would
    silently report fp32 numbers as fp16.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import InitProcessGroupKwargs

    flag = "--mixed-precision" if mixed_precision is not None else "ACCELERATE_MIXED_PRECISION (or accelerate config)"
    if mixed_precision is None:  # what accelerate reads itself (`accelerate launch` puts its config there)
        mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    # A process waits at a barrier while another loads data first or writes a saved fit: allow for a long wait.
    options = {"mixed_precision": mixed_precision, "kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(hours=3))]}
    try:
        try:
            accelerator = Accelerator(**options)
        except ValueError as error:
            if "already been initialized" not in str(error):
                raise
            # An earlier evaluation in this Python process fixed another precision in accelerate's shared
            # state; the process group (PartialState) is kept, only the precision settings are reset.
            AcceleratorState._reset_state(reset_partial_state=False)
            accelerator = Accelerator(**options)
    except ValueError as error:
        raise InputError(f"{flag}: {error}") from None
    if accelerator.mixed_precision not in ("no", "fp16", "bf16"):
        raise InputError(f"{flag}: {accelerator.mixed_precision!r} is not supported here; use no, fp16 or bf16")
    if accelerator.mixed_precision != "no" and not accelerator.native_amp:
        raise InputError(f"{flag} {accelerator.mixed_precision}: not available on device {accelerator.device.type} "
                         "(accelerate would run it as fp32); use bf16 or no on a CPU")
    return accelerator


def quiet_libraries() -> None:
    """No progress bars from ``datasets`` / ``transformers`` on processes other than the main one."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


__all__ = ["make_accelerator", "quiet_libraries"]
