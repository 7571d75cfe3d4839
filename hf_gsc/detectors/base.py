"""One interface for every OOD detection method (GSC and the baselines), and a registry by name.

Sign convention: ``score`` returns ``(B,)`` with higher = more in-distribution, like ``ood_score``.
Fitted state is a flat ``dict[str, torch.Tensor]`` saved with safetensors, never pickle.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterable

import torch
from torch import nn

from ..config import CONFIG_NAME, STATE_FILE, GSCConfig
from ..safe_files import atomic_write_text
from ..serialization import read_state, save_state

DETECTORS: dict[str, type["Detector"]] = {}
HYPERPARAMETERS_FILE = "detector_config.json"


def register_detector(cls: type["Detector"]) -> type["Detector"]:
    """Class decorator: make ``cls`` available by ``cls.name`` (the name used by the CLI and JSON)."""
    if cls.name in DETECTORS:
        raise ValueError(f"detector name {cls.name!r} is registered twice")
    DETECTORS[cls.name] = cls
    return cls


class Detector(ABC):
    """A post-hoc OOD detector on a frozen image classifier.

    Class attributes:
        name: registry name (``"msp"``, ``"gsc"``, ...).
        needs_fit: whether :meth:`fit` must run before :meth:`score`.
        fit_split: the ID split the evaluation fits it on (``"train"`` or ``"validation"``), never test.
        min_fit_samples: fewer fitting samples than this raise an error.

    Args:
        model: a ``*ForImageClassification`` model; put in eval mode and frozen.
        **hyperparameters: method settings; defaults are documented per method.
    """

    name: ClassVar[str]
    needs_fit: ClassVar[bool] = False
    fit_split: ClassVar[str] = "train"
    min_fit_samples: ClassVar[int] = 1

    def __init__(self, model: nn.Module, **hyperparameters: Any) -> None:
        self.model = model.eval().requires_grad_(False)
        self.hyperparameters = hyperparameters
        self.fitted = False

    def fit(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> "Detector":
        """Fit on ID data, streamed as ``(pixel_values (B, C, H, W), labels (B,))`` batches."""
        self.fitted = True
        return self

    @abstractmethod
    def _score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B,)``, higher = more in-distribution."""

    def score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B,)`` float, higher = more in-distribution."""
        if self.needs_fit and not self.fitted:
            raise RuntimeError(
                f"detector {self.name!r} must be fitted first: call .fit(batches) on ID {self.fit_split} data"
            )
        return self._score(pixel_values)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Fitted tensors (empty for methods that need no fitting)."""
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str = "the saved state") -> None:
        """Restore fitted tensors; ``source`` (the file they came from) is named in errors."""
        self.fitted = True

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``detector_config.json`` (name, hyperparameters) and ``detector_state.safetensors``."""
        atomic_write_text(os.path.join(directory, HYPERPARAMETERS_FILE),
                          json.dumps({"name": self.name, "hyperparameters": self.hyperparameters}, indent=2, sort_keys=True))
        save_state(self.state_dict(), os.path.join(directory, STATE_FILE))

    @classmethod
    def load(cls, directory: str | os.PathLike, model: nn.Module) -> "Detector":
        """Rebuild a detector on ``model``: one saved by :meth:`save` (any registered method), or a GSC
        detector folder written by ``GSCForImageClassification.save_pretrained`` (its settings and fitted state)."""
        if os.path.isfile(os.path.join(directory, CONFIG_NAME)):
            config = GSCConfig.from_json_file(os.path.join(directory, CONFIG_NAME))
            name, hyperparameters = "gsc", {**config.settings(), "gradient_mass": config.gradient_mass}
        else:
            with open(os.path.join(directory, HYPERPARAMETERS_FILE)) as handle:
                saved = json.load(handle)
            name, hyperparameters = saved["name"], saved["hyperparameters"]
        detector = get_detector(name, model, **hyperparameters)
        path = os.path.join(directory, STATE_FILE)
        state = read_state(path) if os.path.isfile(path) else {}
        if state or not detector.needs_fit:
            detector.load_state_dict(state, source=path)
        return detector


def get_detector(name: str, model: nn.Module, **hyperparameters: Any) -> Detector:
    """Instantiate the registered method ``name``; the error lists the known names."""
    try:
        cls = DETECTORS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(sorted(DETECTORS))}") from None
    return cls(model, **hyperparameters)
