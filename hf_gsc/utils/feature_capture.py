"""Taking module inputs or outputs out of a model's forward, and replacing a module's output, thread-safely.

Each split module carries one pair of hooks for its lifetime, registered once (:func:`install_hooks`, when a
:class:`hf_gsc.classifier.split_points.SplitPoint` on it is built). They act only on a request the *calling thread* made
(thread-local state), so threads sharing one model never see each other's requests, a forward registers
nothing on the model, and a plain call of the model (no request) passes through them untouched.

One request may capture several tensors in one forward (:func:`capture_many`): that is how one backbone pass
serves every detector on a model (:mod:`hf_gsc.detectors.backbone_pass`). It stops the forward once everything asked
for is captured, unless the caller also wants the logits at the end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


class _ThreadRequests(threading.local):
    """The calling thread's current request; ``None`` outside a capturing forward (set in each thread's
    ``__init__``, so the attribute always exists and a compiled forward's guard on it holds from the first call)."""

    def __init__(self) -> None:
        self.request: _Request | None = None


_REQUESTS = _ThreadRequests()
_HOOK_LOCK = threading.Lock()

#: A capture target: a module and whether its first positional *input* (True) or its output (False) is taken.
Target = tuple[nn.Module, bool]


class _Reached(Exception):
    """Raised by a capture hook to stop the forward once every captured tensor is known."""


@dataclass
class _Request:
    """What the calling thread wants in its current forward: the ``targets`` to capture (then the forward stops
    when ``stop`` and all are captured), or one module's output replaced (``replacing``: the module and the tensor
    put in place of its output)."""

    targets: tuple[Target, ...] = ()
    stop: bool = True
    replacing: tuple[nn.Module, torch.Tensor] | None = None
    captured: dict[Target, torch.Tensor] = field(default_factory=dict)

    def record(self, target: Target, value: torch.Tensor) -> None:
        if target in self.targets and target not in self.captured:
            self.captured[target] = value
            if self.stop and len(self.captured) == len(self.targets):
                raise _Reached


def _first_tensor(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _replace_first(output: Any, replacement: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return replacement
    if isinstance(output, tuple):
        return (replacement, *output[1:])
    raise TypeError(f"cannot replace the output of type {type(output).__name__} at the split point")


def _before_forward(module: nn.Module, args: Any) -> None:
    request = _REQUESTS.request
    if request is not None and args:
        request.record((module, True), args[0])


def _after_forward(module: nn.Module, args: Any, output: Any) -> Any:
    request = _REQUESTS.request
    if request is None:
        return None
    if request.replacing is not None and request.replacing[0] is module:
        return _replace_first(output, request.replacing[1])
    request.record((module, False), _first_tensor(output))
    return None


def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` carries the capture hooks: read from the module's own hook tables, so no registry outside
    the model holds state about it (a copy of a hooked model is hooked; any number of models and compiled
    detectors coexist)."""
    return any(hook is _before_forward for hook in module._forward_pre_hooks.values())


def install_hooks(module: nn.Module) -> None:
    """Register the capture hooks of ``module`` once (again only for a module that replaced a hooked one)."""
    if has_hooks(module):
        return
    with _HOOK_LOCK:
        if not has_hooks(module):
            module.register_forward_pre_hook(_before_forward)
            module.register_forward_hook(_after_forward)


@contextmanager
def _requesting(request: _Request) -> Iterator[_Request]:
    """Make ``request`` the calling thread's current one for the duration of the block."""
    # Hooks are installed when a split point is built; this catches a module replaced since, in eager code (a
    # compiled forward traces the hooks the model has and must not register new ones mid-trace).
    if not torch.compiler.is_compiling():
        for module, _ in request.targets:
            install_hooks(module)
        if request.replacing is not None:
            install_hooks(request.replacing[0])
    previous = _REQUESTS.request
    _REQUESTS.request = request
    try:
        yield request
    finally:
        _REQUESTS.request = previous


def capture_many(run: Callable[[], Any], targets: Sequence[Target], stop: bool = True) -> tuple[dict[Target, torch.Tensor], Any]:
    """The tensors at ``targets`` in the forward ``run()`` starts in the calling thread, and what ``run()`` returned
    (``None`` when the forward was stopped: with ``stop``, right after the last target is reached). A target the
    forward never reaches is missing from the dict."""
    request = _Request(targets=tuple(dict.fromkeys(targets)), stop=stop and bool(targets))
    result = None
    with _requesting(request):
        try:
            result = run()
        except _Reached:
            pass
    return request.captured, result


def capture(run: Callable[[], Any], module: nn.Module, module_input: bool = False) -> torch.Tensor | None:
    """The output of ``module`` (its first positional input with ``module_input``) in the forward ``run()``
    starts in the calling thread, which stops right there; ``None`` when the forward never reaches ``module``."""
    captured, _ = capture_many(run, [(module, module_input)])
    return captured.get((module, module_input))


def with_replaced_output(run: Callable[[], Any], module: nn.Module, replacement: torch.Tensor) -> Any:
    """``run()``, with the output of ``module`` (its first element when it returns a tuple) replaced by
    ``replacement`` in the calling thread's forward."""
    with _requesting(_Request(replacing=(module, replacement))):
        return run()
