"""The feature shapings GSC can apply, by name: the values of ``GSCConfig.feature_shaping`` besides ``"none"``.

Each is registered by the method that defines it, in that method's own file (``ash_p`` / ``ash_b`` / ``ash_s`` by
:mod:`hf_gsc.detectors.ash`, ``scale`` by :mod:`hf_gsc.detectors.scale`), so GSC reuses the method's own math and a
new shaping needs no edit here. A ground-floor module: it imports nothing from hf_gsc, so the config checks and the
backends read the names without depending on the methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass(frozen=True)
class FeatureShaping:
    """``shape(features (B, n), percentile) -> (B, n)`` and the authors' percentile for a model."""

    shape: Callable[[torch.Tensor, float], torch.Tensor]
    default_percentile: Callable[[nn.Module], float]


#: name -> :class:`FeatureShaping`; filled by the methods that define a shaping.
FEATURE_SHAPINGS: dict[str, FeatureShaping] = {}


def register_feature_shaping(name: str, shaping: FeatureShaping) -> None:
    """Make ``name`` a value of ``GSCConfig.feature_shaping``."""
    if name in FEATURE_SHAPINGS or name == "none":
        raise ValueError(f"feature shaping {name!r} is registered twice")
    FEATURE_SHAPINGS[name] = shaping


def feature_shaping(name: str) -> FeatureShaping:
    """The registered shaping ``name``; the error lists the registered ones."""
    try:
        return FEATURE_SHAPINGS[name]
    except KeyError:
        raise ValueError(f"feature_shaping must be 'none' or one of {sorted(FEATURE_SHAPINGS)}, got {name!r}") from None
