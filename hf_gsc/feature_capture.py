"""Taking a module's input or output out of a model's forward, and replacing its output, thread-safely.

Each split module carries one pair of hooks for its lifetime, registered once (:func:`install_hooks`, when a
:class:`hf_gsc.split_points.SplitPoint` on it is built). They act only on a request the *calling thread* made
(thread-local state), so threads sharing one model never see each other's requests, a forward registers
nothing on the model, and a plain call of the model (no request) passes through them untouched.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

_REQUESTS = threading.local()
_HOOKED: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()
_HOOK_LOCK = threading.Lock()


class _Reached(Exception):
    """Raised by a capture hook to stop the forward once the captured tensor is known."""


@dataclass
class _Request:
    """What the calling thread wants from ``module`` in its current forward: ``capture_input``,
    ``capture_output`` (both then stop the forward) or ``replace_output`` (with ``replacement``)."""

    module: nn.Module
    action: str
    replacement: torch.Tensor | None = None
    captured: torch.Tensor | None = None


def _first_tensor(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _replace_first(output: Any, replacement: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return replacement
    if isinstance(output, tuple):
        return (replacement, *output[1:])
    raise TypeError(f"cannot replace the output of type {type(output).__name__} at the split point")


def _current_request(module: nn.Module) -> _Request | None:
    request = getattr(_REQUESTS, "request", None)
    return request if request is not None and request.module is module else None


def _before_forward(module: nn.Module, args: Any) -> None:
    request = _current_request(module)
    if request is not None and request.action == "capture_input":
        request.captured = args[0]
        raise _Reached


def _after_forward(module: nn.Module, args: Any, output: Any) -> Any:
    request = _current_request(module)
    if request is None or request.action == "capture_input":
        return None
    if request.action == "replace_output":
        return _replace_first(output, request.replacement)
    request.captured = _first_tensor(output)
    raise _Reached


def install_hooks(module: nn.Module) -> None:
    """Register the capture hooks of ``module`` once (again only for a module that replaced a hooked one)."""
    if module in _HOOKED:
        return
    with _HOOK_LOCK:
        if module not in _HOOKED:
            _HOOKED[module] = (
                module.register_forward_pre_hook(_before_forward),
                module.register_forward_hook(_after_forward),
            )


@contextmanager
def _requesting(request: _Request) -> Iterator[_Request]:
    """Make ``request`` the calling thread's current one for the duration of the block."""
    install_hooks(request.module)
    previous = getattr(_REQUESTS, "request", None)
    _REQUESTS.request = request
    try:
        yield request
    finally:
        _REQUESTS.request = previous


def capture(run: Callable[[], Any], module: nn.Module, module_input: bool = False) -> torch.Tensor | None:
    """The output of ``module`` (its first positional input with ``module_input``) in the forward ``run()``
    starts in the calling thread, which stops right there; ``None`` when the forward never reaches ``module``."""
    with _requesting(_Request(module, "capture_input" if module_input else "capture_output")) as request:
        try:
            run()
        except _Reached:
            pass
    return request.captured


def with_replaced_output(run: Callable[[], Any], module: nn.Module, replacement: torch.Tensor) -> Any:
    """``run()``, with the output of ``module`` (its first element when it returns a tuple) replaced by
    ``replacement`` in the calling thread's forward."""
    with _requesting(_Request(module, "replace_output", replacement=replacement)):
        return run()
