"""One backbone pass shared by several detectors on one base model, for scoring and for fitting.

:func:`shared_pass` runs the base model once with the union of what the detectors read
(:mod:`hf_gsc.backbone_pass`); :func:`fit_together` fits every detector that needs it from one such pass per batch.
The evaluation, the analyses, :class:`hf_gsc.DetectorBundle` and each detector's own ``fit`` go through these.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .backbone_pass import BackbonePass, run_backbone, split_union
from .inputs import labelled_batches

if TYPE_CHECKING:
    from .detector import OODDetector


def shared_model(detectors: Sequence[OODDetector]) -> nn.Module:
    if not detectors:
        raise ValueError("a detector bundle needs at least one detector")
    model = detectors[0].model
    for detector in detectors[1:]:
        if detector.model is not model:
            raise ValueError(
                f"every detector of a bundle must wrap the same base model object; {detector.method!r} has another "
                "(build them on one loaded model: AutoOODDetector.from_pretrained(model, method=...))"
            )
    return model


def shared_pass(
    detectors: Sequence[OODDetector], pixel_values: torch.Tensor, logits: bool = True
) -> BackbonePass:
    """One backbone pass with everything the ``detectors`` (on one base model) read."""
    model = shared_model(detectors)
    splits = split_union([split for detector in detectors for split in detector.feature_splits()])
    return run_backbone(model, pixel_values, splits, logits=logits or any(d.reads_logits for d in detectors))


def fit_together(
    detectors: Sequence[OODDetector], id_batches: Iterable[Any], name: str = "id_train_batches"
) -> list[OODDetector]:
    """Fit every detector of ``detectors`` that needs it from one backbone pass per batch of ``id_batches``
    (batches of ``(pixel_values, labels)``, mappings, or images as ``calibrate`` takes them). Returns the fitted ones.

    All of them must fit on the same data (the same ``fit_split``) and wrap the same base model.
    """
    to_fit = [detector for detector in detectors if detector.needs_fit]
    if not to_fit:
        for detector in detectors:
            detector.fitted = True
        return []
    # No batch at all is left to each detector's own count check, which says how many samples it needs.
    fit_from_passes(to_fit, id_batches, name, allow_empty=True)
    return to_fit


def fit_from_passes(
    detectors: Sequence[OODDetector], id_batches: Iterable[Any], name: str, allow_empty: bool = False
) -> None:
    """``fit_begin`` / ``fit_update`` with one shared backbone pass per batch / ``fit_end`` for every detector of
    ``detectors`` (on one base model), whether or not it says it needs a fit."""
    shared_model(detectors)
    first = detectors[0]
    for detector in detectors:
        detector.fit_begin()
    for pixel_values, labels in labelled_batches(id_batches, name, first.image_processor, allow_empty=allow_empty):
        batch = shared_pass(detectors, first._check_pixel_values(pixel_values), logits=False)
        labels = None if labels is None else torch.as_tensor(labels).reshape(-1).long().cpu()
        for detector in detectors:
            detector.fit_update(batch, labels)
    for detector in detectors:
        detector.fit_end()

__all__ = ["fit_from_passes", "fit_together", "shared_model", "shared_pass"]
