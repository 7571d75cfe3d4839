"""What saving and pushing read of a detector: :class:`SavableDetector`, the part of :class:`hf_gsc.OODDetector` that
:mod:`hf_gsc.storage.saving`, :mod:`hf_gsc.storage.results` and the mixins that give every detector
``save_pretrained`` and ``push_to_hub`` (:mod:`hf_gsc.storage.pretrained`, :mod:`hf_gsc.storage.push`) use. This floor
cannot import the detectors' own, so it names what it needs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ..settings.config import DetectorConfig
from ..utils.calibration import Calibration


class SavableDetector(Protocol):
    """A detector as a save reads it (every :class:`hf_gsc.OODDetector` is one). Read-only members, so that a
    method's detector whose ``config`` is its own config class is one too."""

    @property
    def method(self) -> str: ...

    @property
    def config(self) -> DetectorConfig: ...

    @property
    def model(self) -> nn.Module: ...

    @property
    def image_processor(self) -> Any: ...

    @property
    def needs_fit(self) -> bool: ...

    @property
    def fitted(self) -> bool: ...

    @property
    def fit_split(self) -> str: ...

    @property
    def calibration(self) -> Calibration | None: ...

    def check_config(self) -> None: ...

    def fitted_state(self) -> Mapping[str, torch.Tensor]: ...


__all__ = ["SavableDetector"]
