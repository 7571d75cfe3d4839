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
                "(a detector loaded on its own loads its own copy). Load the base model once and put every detector "
                "on it: model = AutoModelForImageClassification.from_pretrained(base); a saved detector: "
                "AutoOODDetector.from_pretrained(folder_or_repo_id, model=model); a new one: "
                "AutoOODDetector.from_pretrained(model, method=...)"
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
    detectors: Sequence[OODDetector], id_batches: Iterable[Any], name: str = "id_train_batches",
    errors: dict[str, str] | None = None,
) -> list[OODDetector]:
    """Fit every detector of ``detectors`` that needs it from one backbone pass per batch of ``id_batches``
    (batches of ``(pixel_values, labels)``, mappings, or images as ``calibrate`` takes them). Returns the fitted ones.

    All of them must fit on the same data (the same ``fit_split``) and wrap the same base model. ``errors``: where
    given, a detector whose fit raises is left out of the rest of the pass and its method mapped to the reason, while
    the others go on (a full-table evaluation does not die for one method); otherwise the error propagates.
    """
    to_fit = [detector for detector in detectors if detector.needs_fit]
    if not to_fit:
        for detector in detectors:
            detector.fitted = True
        return []
    # No batch at all is left to each detector's own count check, which says how many samples it needs.
    fit_from_passes(to_fit, id_batches, name, allow_empty=True, errors=errors)
    return [detector for detector in to_fit if errors is None or detector.method not in errors]


def fit_from_passes(
    detectors: Sequence[OODDetector], id_batches: Iterable[Any], name: str, allow_empty: bool = False,
    errors: dict[str, str] | None = None,
) -> None:
    """``fit_begin`` / ``fit_update`` with one shared backbone pass per batch / ``fit_end`` for every detector of
    ``detectors`` (on one base model), whether or not it says it needs a fit. ``errors``: see :func:`fit_together`
    (the data's own errors, an unreadable image, always propagate)."""
    shared_model(detectors)
    first = detectors[0]
    live = list(detectors)

    def each(step: Any) -> None:
        for detector in list(live):
            if errors is None:
                step(detector)
                continue
            try:
                step(detector)
            except Exception as error:  # noqa: BLE001  (any failure of one method's fit skips that method)
                errors[detector.method] = f"fit failed: {type(error).__name__}: {error}"
                live.remove(detector)

    each(lambda detector: detector.fit_begin())
    label2id = getattr(getattr(first.model, "config", None), "label2id", None)
    # Images that cannot be labelled are refused before any is read where a method needs labels (with ``errors``,
    # each such method fails on its own at its first batch and the others go on).
    need_labels = errors is None and any(getattr(detector, "needs_labels", False) for detector in detectors)
    for pixel_values, labels in labelled_batches(id_batches, name, first.image_processor, allow_empty=allow_empty,
                                                 label2id=label2id, channels=first._expected_channels,
                                                 need_labels=need_labels):
        if not live:
            break
        batch = shared_pass(live, first._check_pixel_values(pixel_values), logits=False)
        labels = None if labels is None else torch.as_tensor(labels).reshape(-1).long().cpu()
        each(lambda detector: detector.fit_update(batch, labels))
    each(lambda detector: detector.fit_end())


__all__ = ["fit_from_passes", "fit_together", "shared_model", "shared_pass"]
