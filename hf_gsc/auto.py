"""``AutoOODDetector``: one entry point that builds any registered method on a classifier, or loads any saved one.

    det = AutoOODDetector.from_pretrained("google/vit-base-patch16-224", method="knn", k=50)  # build
    det.fit(id_train_batches); det.calibrate(id_validation_images)
    det.push_to_hub("user/vit-knn")
    det = AutoOODDetector.from_pretrained("user/vit-knn")                                    # load, any method

Like PEFT's ``AutoPeftModel``, the saved ``method`` field decides the class, in one place
(:func:`hf_gsc.storage.loading.load_detector`).
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from .detectors.interface import OODDetector


class AutoOODDetector:
    """Builds or loads a detector of whichever registered method; not instantiable itself."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("AutoOODDetector is not instantiated: use AutoOODDetector.from_pretrained(...)")

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike | nn.Module, method: str | None = None, **kwargs: Any
    ) -> OODDetector:
        """A saved detector (folder or Hub repo id: its ``method`` is read from ``detector_config.json``), or a new
        detector of ``method`` on an image classifier (Hub id, folder, or a loaded ``nn.Module``).

        Args:
            pretrained_model_name_or_path: the saved detector or the classifier.
            method: a registered method (``hf_gsc.detectors.DETECTORS``); needed to build one on a classifier.
            **kwargs: the method's hyperparameters (``k=50``, ``mask_ratio=0.1``; override saved ones), Hub
                arguments (``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download``),
                ``model=`` (an already loaded base model for a saved detector), and arguments for
                ``AutoModelForImageClassification.from_pretrained`` (``dtype``, ``device_map``, ...).
        """
        from .storage.loading import load_detector
        from .storage.repo_ids import check_source

        check_source(pretrained_model_name_or_path)
        return load_detector(pretrained_model_name_or_path, method=method, **kwargs)


__all__ = ["AutoOODDetector"]
