"""One forward of the base model, shared by every detector that reads it.

Every method except ODIN is a function of at most three things from one forward: the logits ``y``, the
penultimate feature ``z`` (the input of the last ``nn.Linear``) and ``F`` at a split point with the head after it.
A detector declares which it reads (:attr:`hf_gsc.detectors.OODDetector.reads_logits` and
:meth:`~hf_gsc.detectors.OODDetector.feature_splits`); :func:`run_backbone` runs the model once with all of them
captured (:func:`hf_gsc.utils.feature_capture.capture_many`), and each detector scores the resulting
:class:`BackbonePass`. Without a request for the logits, the forward stops at the last captured module.

For several detectors on one base model, :func:`run_backbone_for` runs that one forward with the union of what they
read, and :func:`fit_together` fits every detector that needs it from one such pass per batch. The evaluation, the
analyses, :class:`hf_gsc.DetectorBundle` and each detector's own ``fit`` go through these.

A fit can run on several processes, each passing its own batches (:class:`FitShards`, given by the evaluation:
:mod:`hf_gsc.evaluation.distributed`): between the last ``fit_update`` and ``fit_end`` each detector's
:meth:`~hf_gsc.detectors.interface.OODDetector.fit_gather` replaces what it took from this process's batches by what every
process took, so that ``fit_end`` computes the whole fit on every process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..classifier.split_points import SplitPoint
from ..utils.feature_capture import Target, capture_many
from ..utils.image_data import ImageRows
from ..utils.inputs import labelled_batches, nonfinite_marks
from ..utils.label_names import model_label_names


if TYPE_CHECKING:
    from .interface import OODDetector


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

    def nonfinite_marks(self) -> torch.Tensor:
        """``(B,)``: 0 for each finite row of ``pixel_values``, NaN for the others (on the device, once per pass:
        :func:`hf_gsc.utils.inputs.nonfinite_marks`)."""
        return self.memo("nonfinite_marks", lambda: nonfinite_marks(self.pixel_values))

    def model_logits(self) -> torch.Tensor:
        if self.logits is None:
            raise RuntimeError("this backbone pass ran without the logits; a detector reading them must say so "
                               "with reads_logits = True")
        return self.logits


class FitShards(Protocol):
    """How the parts of one fit that several processes took combine (:mod:`hf_gsc.evaluation.distributed`).

    ``batches`` and ``sum`` are collectives: every process calls them, in the same order, for the same detectors.
    """

    num_processes: int

    def batches(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every process's batches, in the order of the data: ``local`` holds one tensor per batch this process
        passed to ``fit_update`` (rows first); the same list object for the same tensors (detectors fitted in one
        pass share the pass's features) is gathered once."""
        ...

    def sum(self, local: torch.Tensor | None) -> torch.Tensor | None:
        """The sum over processes of ``local`` (``None`` where a process has nothing), added in process order, so
        that every process gets the same tensor; ``None`` when no process has one."""
        ...

    def agree(self, errors: dict[str, str]) -> dict[str, str]:
        """Every process's failed methods added to ``errors`` (and returned), so that all go on with the same
        detectors; raises on every process where an image could not be read and unreadable images raise."""
        ...


def run_backbone(
    model: nn.Module, pixel_values: torch.Tensor, splits: Sequence[SplitPoint] = (), logits: bool = True
) -> BackbonePass:
    """Run ``model`` once on ``pixel_values`` without gradient, capturing ``F`` at each of ``splits``.

    With ``logits=False`` the forward stops as soon as the last split point is reached (the head is not run).
    Thread-safe: the captures act only in the calling thread (:mod:`hf_gsc.utils.feature_capture`).
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


def run_backbone_for(
    detectors: Sequence[OODDetector], pixel_values: torch.Tensor, logits: bool = True
) -> BackbonePass:
    """One backbone pass with everything the ``detectors`` (on one base model) read."""
    model = shared_model(detectors)
    splits = split_union([split for detector in detectors for split in detector.feature_splits()])
    return run_backbone(model, pixel_values, splits, logits=logits or any(d.reads_logits for d in detectors))


def fit_together(
    detectors: Sequence[OODDetector], id_batches: Iterable[Any] | ImageRows, name: str = "id_train_batches",
    errors: dict[str, str] | None = None, shards: FitShards | None = None, names: Sequence[str] | None = None,
) -> list[OODDetector]:
    """Fit every detector of ``detectors`` that needs it from one backbone pass per batch of ``id_batches``
    (batches of ``(pixel_values, labels)``, mappings, or images as ``calibrate`` takes them). Returns the fitted ones.

    All of them must fit on the same data (the same ``fit_split``) and wrap the same base model. ``errors``: where
    given, a detector whose fit raises is left out of the rest of the pass and its name mapped to the reason, while
    the others go on (a full-table evaluation does not die for one method); otherwise the error propagates.
    ``names``: each detector's name in ``errors`` (default: its method; a tuning grid fits one method many times).
    ``shards``: ``id_batches`` are this process's share of the data, and the fit combines every process's share
    (see the module docstring).
    """
    key = _names(detectors, names)
    to_fit = [detector for detector in detectors if detector.needs_fit]
    if not to_fit:
        for detector in detectors:
            detector.fitted = True
        return []
    # No batch at all is left to each detector's own count check, which says how many samples it needs.
    fit_from_passes(to_fit, id_batches, name, allow_empty=True, errors=errors, shards=shards,
                    names=[key[id(detector)] for detector in to_fit])
    return [detector for detector in to_fit if errors is None or key[id(detector)] not in errors]


def _names(detectors: Sequence[OODDetector], names: Sequence[str] | None) -> dict[int, str]:
    """``id(detector) -> its name in errors`` (its method by default)."""
    if names is None:
        return {id(detector): detector.method for detector in detectors}
    if len(names) != len(detectors):
        raise ValueError(f"names: one per detector expected, got {len(names)} names for {len(detectors)} detectors")
    return {id(detector): name for detector, name in zip(detectors, names)}


def fit_from_passes(
    detectors: Sequence[OODDetector], id_batches: Iterable[Any] | ImageRows, name: str, allow_empty: bool = False,
    errors: dict[str, str] | None = None, shards: FitShards | None = None, names: Sequence[str] | None = None,
) -> None:
    """``fit_begin`` / ``fit_update`` with one shared backbone pass per batch / ``fit_end`` for every detector of
    ``detectors`` (on one base model), whether or not it says it needs a fit. ``errors`` and ``names``: see
    :func:`fit_together` (the data's own errors, an unreadable image, always propagate). ``shards``: the processes
    agree on the failed detectors, then (several processes) each live detector's ``fit_gather`` combines the
    processes' parts before ``fit_end``, and they agree again after it."""
    shared_model(detectors)
    first = detectors[0]
    live = list(detectors)
    key = _names(detectors, names)

    def each(step: Any) -> None:
        for detector in list(live):
            if errors is None:
                step(detector)
                continue
            try:
                step(detector)
            except Exception as error:  # noqa: BLE001  (any failure of one method's fit skips that method)
                errors[key[id(detector)]] = f"fit failed: {type(error).__name__}: {error}"
                live.remove(detector)

    def agree(shards: FitShards) -> None:
        """Drop from ``live`` the detectors that failed on any process: every process goes on with the same ones,
        in the same order (the gathering that follows is a collective per detector)."""
        failed = shards.agree({} if errors is None else errors)
        if errors is None and failed:  # no per-detector errors asked for: another process's failure raises here
            raise RuntimeError(next(iter(failed.values())))
        live[:] = [detector for detector in live if key[id(detector)] not in failed]

    each(lambda detector: detector.fit_begin())
    label2id = model_label_names(getattr(first.model, "config", None))  # id2label's names: keeps ImageNet's 2 cranes
    # Images that cannot be labelled are refused before any is read where a method needs labels (with ``errors``,
    # each such method fails on its own at its first batch and the others go on).
    need_labels = errors is None and any(getattr(detector, "needs_labels", False) for detector in detectors)
    for pixel_values, labels in labelled_batches(id_batches, name, first.image_processor, allow_empty=allow_empty,
                                                 label2id=label2id, channels=first._expected_channels,
                                                 need_labels=need_labels):
        if not live:
            break
        batch = run_backbone_for(live, first._check_pixel_values(pixel_values, finite=True), logits=False)
        labels = None if labels is None else torch.as_tensor(labels).reshape(-1).long().cpu()
        each(lambda detector: detector.fit_update(batch, labels))
    if shards is not None:
        agree(shards)
        if shards.num_processes > 1:
            # Not caught per detector: fit_gather is a collective, and a process that left it would leave the
            # others waiting.
            for detector in live:
                detector.fit_gather(shards)
    each(lambda detector: detector.fit_end())
    if shards is not None:
        agree(shards)


__all__ = ["BackbonePass", "FitShards", "fit_from_passes", "fit_together", "run_backbone", "run_backbone_for", "shared_model",
           "split_union"]
