"""One forward of the base model, shared by every detector that reads it.

Every method except ODIN is a function of at most three things from one forward: the logits ``y``, the
penultimate feature ``z`` (the input of the last ``nn.Linear``) and ``F`` at a split point with the head after it.
A detector declares which it reads (:attr:`hf_gsc.detectors.OODDetector.reads_logits` and
:meth:`~hf_gsc.detectors.OODDetector.feature_splits`); :func:`run_backbone` runs the model once with all of them
captured (:func:`hf_gsc.feature_capture.capture_many`), and each detector scores the resulting
:class:`BackbonePass`. Without a request for the logits, the forward stops at the last captured module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .feature_capture import Target, capture_many
from .split_points import SplitPoint


def _target(split: SplitPoint) -> Target:
    return (split.module, split.capture_input)


@dataclass
class BackbonePass:
    """What one forward of the base model gave: ``pixel_values``, the logits (when asked for) and the captured
    features, plus a memo of quantities derived from them that several detectors share (the penultimate feature
    flattened, moved to the CPU for fitting, ...).

    Attributes:
        pixel_values: ``(B, C, H, W)`` the model's input (methods that replay or perturb the input read it).
        logits: ``(B, K)`` the base model's logits, or ``None`` when no detector asked for them.
    """

    pixel_values: torch.Tensor
    logits: torch.Tensor | None
    captured: dict[Target, torch.Tensor] = field(default_factory=dict)
    _memo: dict[Any, Any] = field(default_factory=dict, repr=False)

    def features(self, split: SplitPoint) -> torch.Tensor:
        """``F`` at ``split``, ``(B, *feature_shape)``, as the backbone computed it (no gradient)."""
        try:
            return self.captured[_target(split)]
        except KeyError:
            raise RuntimeError(
                f"this backbone pass did not capture the split point {split.name!r} ({split.module_path}); "
                "run_backbone must be given every split point the detectors read"
            ) from None

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per pass and ``key``: detectors that derive the same quantity share it."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def flat_features(self, split: SplitPoint, device: torch.device | str | None = None) -> torch.Tensor:
        """``F`` at ``split`` flattened to ``(B, d)`` (on ``device`` when given), computed once per pass."""
        key = ("flat", _target(split), None if device is None else str(torch.device(device)))
        return self.memo(key, lambda: self.features(split).flatten(1).to(device) if device is not None
                         else self.features(split).flatten(1))

    def model_logits(self) -> torch.Tensor:
        if self.logits is None:
            raise RuntimeError("this backbone pass ran without the logits; a detector reading them must say so "
                               "with reads_logits = True")
        return self.logits


def run_backbone(
    model: nn.Module, pixel_values: torch.Tensor, splits: Sequence[SplitPoint] = (), logits: bool = True
) -> BackbonePass:
    """Run ``model`` once on ``pixel_values`` without gradient, capturing ``F`` at each of ``splits``.

    With ``logits=False`` the forward stops as soon as the last split point is reached (the head is not run).
    Thread-safe: the captures act only in the calling thread (:mod:`hf_gsc.feature_capture`).
    """
    targets = [_target(split) for split in splits]
    if not targets and not logits:  # nothing read from the backbone (ODIN runs its own forwards)
        return BackbonePass(pixel_values, None)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return model(pixel_values=pixel_values).logits

    captured, output = capture_many(run, targets, stop=not logits)
    missing = [split for split in splits if _target(split) not in captured]
    if missing:
        raise RuntimeError(f"the forward pass never reached the split point {missing[0].module_path!r}")
    return BackbonePass(pixel_values, output if logits else None, captured)


def split_union(splits: Sequence[SplitPoint]) -> list[SplitPoint]:
    """The split points of ``splits`` with one per captured tensor (two detectors on the same module share it)."""
    seen: dict[Target, SplitPoint] = {}
    for split in splits:
        seen.setdefault(_target(split), split)
    return list(seen.values())


__all__ = ["BackbonePass", "run_backbone", "split_union"]
