"""``from_pretrained`` / ``save_pretrained`` of every detector: the mixin that binds them to
:mod:`hf_gsc.storage.loading` and :mod:`hf_gsc.storage.saving`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .loading import load_detector
from .repo_ids import check_source
from .saving import save_detector


if TYPE_CHECKING:
    from ..detectors.interface import OODDetector
    from .savable import SavableDetector


class DetectorFiles:
    """``from_pretrained`` / ``save_pretrained`` of every detector (mixed into :class:`hf_gsc.OODDetector`)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> OODDetector:
        """Load a saved detector of this class's method, or build one on an image classifier (Hub id, path or loaded
        model); see :meth:`hf_gsc.AutoOODDetector.from_pretrained` for the arguments."""
        method = cls.__dict__.get("method")
        check_source(pretrained_model_name_or_path)
        return load_detector(pretrained_model_name_or_path, method=kwargs.pop("method", None) or method,
                             expected_class=cls, **kwargs)

    def save_pretrained(
        self: SavableDetector,
        save_directory: str | os.PathLike[str],
        save_base_model: bool = False,
        results_dir: str | os.PathLike[str] | None = None,
        license: str | None = None,
    ) -> str:
        """Write ``detector_config.json`` (method, hyperparameters, threshold, base-model reference), the fitted
        state, a model card, and optionally the base weights and the method's evaluation results (``results_dir``:
        an ``hf-gsc evaluate`` output of this detector's model and settings, checked)."""
        return str(save_detector(self, save_directory, save_base_model, results_dir, license=license))
