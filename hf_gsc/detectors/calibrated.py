"""The calibration half of every detector: the one :class:`~hf_gsc.utils.calibration.Calibration` it holds (or
none), how it is made (:meth:`Calibrated.calibrate`, :meth:`Calibrated.set_tpr`, the evaluation and a load through
:meth:`Calibrated.set_calibration`), dropped when it no longer applies (a setting assigned, a refit, a load with other
settings: :meth:`Calibrated.stale_threshold`, one warning), and read by the forward (``is_ood``, ``p_value``).

Mixed into :class:`hf_gsc.OODDetector`, as :class:`hf_gsc.storage.pretrained.DetectorFiles` is: it reads the
detector's ``config``, ``method``, :meth:`~hf_gsc.OODDetector.fitted_state`, :meth:`~hf_gsc.OODDetector.score` and
``image_processor``. ``config.threshold`` and ``config.calibration`` are the calibration's saved form: written by
:meth:`Calibrated.set_calibration`; a value assigned to them by hand replaces the calibration (a threshold without
kept scores) before the next score or save.
"""

from __future__ import annotations

import functools
import json
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..settings.config import DetectorConfig
from ..utils.calibration import Calibration, fitted_state_digest
from ..utils.image_data import image_rows
from ..utils.inputs import labelled_batches
from ..utils.thresholds import MIN_CALIBRATION_SAMPLES, TOO_FEW_FOR_A_THRESHOLD, check_delta, check_tpr


def decide(ood_score: torch.Tensor, threshold: float | None) -> torch.Tensor | None:
    """``is_ood`` for ``ood_score`` at ``threshold``: ``True`` unless ``ood_score >= threshold``. A non-finite
    score (NaN from extreme inputs or settings) is therefore OOD: the detector fails closed."""
    if threshold is None:
        return None
    return ~(ood_score >= threshold)


#: The ``fit_end`` functions :func:`_keeping_calibration_honest` made, so that a class reusing one is not wrapped twice.
_CALIBRATION_KEEPERS: weakref.WeakSet[Callable[[Calibrated], None]] = weakref.WeakSet()


def _keeping_calibration_honest(fit_end: Callable[[Calibrated], None]) -> Callable[[Calibrated], None]:
    """``fit_end`` followed, once per fit (not again in a subclass's ``super().fit_end()``), by dropping a threshold
    calibrated for another fitted state."""

    @functools.wraps(fit_end)
    def wrapped(self: Calibrated) -> None:
        outer = not self._ending_fit
        self._ending_fit = True
        try:
            fit_end(self)
        finally:
            if outer:
                self._ending_fit = False
        if outer:
            reason = self.stale_threshold(settings=False, refitted=True)
            if reason is not None:
                self.clear_calibration(reason)

    _CALIBRATION_KEEPERS.add(wrapped)
    return wrapped


class Calibrated:
    """The calibration of a detector (module docstring); mixed into :class:`hf_gsc.OODDetector`."""

    # Attributes and methods of the detector it is mixed into.
    config: Any
    method: ClassVar[str]
    image_processor: Any
    _expected_channels: int | None
    fitted_state: Callable[[], dict[str, torch.Tensor]]
    fit_end: Callable[[], None]
    score: Callable[[torch.Tensor], torch.Tensor]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A refit (however it is reached: fit, fit_together, fit_fisher, the evaluation) drops a stale threshold.
        own = cls.__dict__.get("fit_end")
        if own is not None and own not in _CALIBRATION_KEEPERS:
            # setattr: the class's own method replaced by its wrapped form while the class is made (a plain
            # assignment reads to a type checker as patching a method of every instance).
            setattr(cls, "fit_end", _keeping_calibration_honest(own))

    def init_calibration(self) -> None:
        """No calibration yet, or the ``threshold`` the config was given (by hand, or the saved one at a load); the
        two one-time warnings (no threshold; a threshold without p-values) not given yet."""
        self._calibration: Calibration | None = None
        # The values set_calibration gave config.threshold and config.calibration: others were assigned by hand.
        self._saved_form: tuple[float | None, dict[str, Any] | None] = (None, None)
        self._uncalibrated_because: str | None = None
        self._warned_uncalibrated = self._warned_no_p_value = False
        self._ending_fit = False
        if self.config.threshold is not None:
            self.set_calibration(Calibration.by_hand(self.config.threshold, self.config.calibration))

    def calibration_settings(self, config: DetectorConfig | None = None) -> dict[str, Any]:
        """The values ``ood_score`` depends on besides the fitted tensors (the settings and fitted values other than
        the threshold and its record), as JSON stores them: what a calibration record keeps as ``settings``. Those of
        this detector's config, or of ``config`` (at load: the saved one)."""
        return json.loads(json.dumps((self.config if config is None else config).score_hyperparameters()))

    def calibration_dependencies(self) -> dict[str, Any]:
        """What a threshold calibrated now depends on: ``settings`` (:meth:`calibration_settings`) and
        ``fitted_state`` (:func:`hf_gsc.utils.calibration.fitted_state_digest` of :meth:`fitted_state`; ``None`` when
        nothing is fitted)."""
        return {"settings": self.calibration_settings(), "fitted_state": fitted_state_digest(self.fitted_state())}

    # ------------------------------------------------------------------ calibration: one Calibration or none
    @property
    def calibration(self) -> Calibration | None:
        """The threshold with its record and kept ID calibration scores (:class:`hf_gsc.utils.calibration.Calibration`),
        ``None`` until :meth:`calibrate`; ``config.threshold`` and ``config.calibration`` are its saved form, and a
        value assigned to them by hand replaces it (a threshold without kept scores) before it is read."""
        if not torch.compiler.is_compiling():  # a compiled forward runs check_config, which follows it, before
            self._follow_config_threshold()
        return self._calibration

    def set_calibration(self, calibration: Calibration | None, reason: str | None = None) -> None:
        """The one place a detector's calibration changes (``reason``: why there is none); ``config.threshold`` and
        ``config.calibration`` follow it."""
        self._calibration = calibration
        self._uncalibrated_because = reason if calibration is None else None
        self._warned_no_p_value = False
        saved = {"threshold": None, "calibration": None} if calibration is None else calibration.to_dict()
        self.config.threshold, self.config.calibration = saved["threshold"], saved["calibration"]
        self._saved_form = (self.config.threshold, self.config.calibration)

    def _follow_config_threshold(self) -> None:
        """A ``config.threshold`` (or record) assigned by hand replaces the calibration: the kept scores and the
        record no longer belong to it (a record assigned with it is kept)."""
        config, (threshold, record) = self.config, self._saved_form
        if config.threshold == threshold and config.calibration is record:
            return
        if config.threshold is None:
            self.set_calibration(None, "config.threshold was set to None")
            return
        given = None if config.calibration is record else config.calibration
        self.set_calibration(Calibration.by_hand(config.threshold, given, "config.threshold was set by hand, so no ID "
                                                 "calibration scores belong to it"))

    def clear_calibration(self, reason: str) -> None:
        """Drop the calibration (threshold, record, kept scores), saying why in one warning; ``is_ood`` and
        ``p_value`` are then ``None`` until :meth:`calibrate` runs again."""
        self.set_calibration(None, reason)
        self._warned_uncalibrated = True  # this warning says it: no second one at the next forward
        warnings.warn(
            f"detector {self.method!r}: its threshold was dropped because {reason}, so is_ood is None (no decision, "
            f"not 'in-distribution'): call .calibrate(id_validation_data) with at least {MIN_CALIBRATION_SAMPLES} ID "
            "validation images",
            UserWarning,
            stacklevel=3,
        )

    def check_loaded_calibration(self, saved_settings: dict[str, Any]) -> None:
        """After a load: keep the saved calibration only for the settings and fitted state it was calibrated for
        (:meth:`stale_threshold`; ``saved_settings``: the saved values of the settings given again at load)."""
        reason = self.stale_threshold(saved_settings=saved_settings)
        if reason is not None:
            self.clear_calibration(reason)

    def stale_threshold(self, settings: bool = True, fitted_state: bool = True,
                        saved_settings: dict[str, Any] | None = None, refitted: bool = False) -> str | None:
        """Why the calibration no longer applies to this detector (:meth:`hf_gsc.utils.calibration.Calibration.why_stale`,
        against :meth:`calibration_settings` when ``settings`` and the digest of :meth:`fitted_state` when
        ``fitted_state``), or ``None`` while it does or there is none."""
        calibration = self.calibration
        if calibration is None:
            return None
        state = {"fitted_state": fitted_state_digest(self.fitted_state())} if fitted_state else {}
        return calibration.why_stale(self.calibration_settings() if settings else None, saved_settings=saved_settings,
                                     refitted=refitted, **state)

    def decide(self, ood_score: torch.Tensor) -> torch.Tensor | None:
        """``is_ood`` at the calibrated threshold (NaN -> OOD); ``None``, with a warning once, before calibration
        (in eager code: a compiled forward cannot warn, so :func:`hf_gsc.detectors.compiled.compiled` warns before
        its first call)."""
        calibration = self.calibration
        if calibration is None and not torch.compiler.is_compiling():
            self.warn_if_uncalibrated(stacklevel=4)
        return decide(ood_score, None if calibration is None else calibration.threshold)

    def warn_if_uncalibrated(self, stacklevel: int = 2) -> None:
        """The one-time warning that ``is_ood`` is ``None`` until :meth:`calibrate` sets a threshold."""
        if self.calibration is None and not self._warned_uncalibrated:
            self._warned_uncalibrated = True
            warnings.warn(
                f"detector {self.method!r} has no threshold, so is_ood is None (no decision, not 'in-distribution'): "
                f"call .calibrate(id_validation_data) with at least {MIN_CALIBRATION_SAMPLES} ID validation images",
                UserWarning,
                stacklevel=stacklevel,
            )

    def p_value(self, ood_score: torch.Tensor) -> torch.Tensor | None:
        """``(B,)`` float64 conformal p-values of ``ood_score`` against the kept ID calibration scores
        (:meth:`hf_gsc.utils.calibration.Calibration.p_value`); ``None`` without them, with a warning once when a
        threshold is set all the same (a folder saved without calibration scores, a threshold set by hand)."""
        calibration = self.calibration
        p_value = None if calibration is None else calibration.p_value(ood_score)
        if (p_value is None and calibration is not None and not self._warned_no_p_value
                and not torch.compiler.is_compiling()):
            self._warned_no_p_value = True
            warnings.warn(f"detector {self.method!r}: p_value is None: {self.p_value_unavailable}", UserWarning,
                          stacklevel=3)
        return p_value

    @property
    def calibration_scores(self) -> torch.Tensor | None:
        """``(m,)`` float64, ascending, on the CPU: the kept ``ood_score`` of the ID images the threshold was
        calibrated on (saved as ``calibration_scores`` in ``detector_state.safetensors``); ``None`` when not kept."""
        calibration = self.calibration
        return None if calibration is None else calibration.scores

    @property
    def p_value_unavailable(self) -> str | None:
        """Why :meth:`p_value` gives ``None`` (``None`` when p-values are available)."""
        calibration = self.calibration
        if calibration is None:
            return (self._uncalibrated_because or "the detector is not calibrated") + (
                "; call .calibrate(id_validation_data) to keep the ID calibration scores p-values are computed from")
        return calibration.missing_scores

    @property
    def p_value_cut(self) -> float | None:
        """The p-value at and below which an input is flagged: ``is_ood == (p_value <= p_value_cut)``
        (:attr:`hf_gsc.utils.calibration.Calibration.p_value_cut`); ``None`` without kept scores."""
        calibration = self.calibration
        return None if calibration is None else calibration.p_value_cut

    def set_tpr(self, tpr: float, delta: float | None = None) -> float:
        """Move the threshold to keep a fraction ``tpr`` of ID data, from the kept calibration scores (no new forward):
        the threshold ``calibrate(data, tpr=tpr, delta=delta)`` would set on the same data
        (:meth:`hf_gsc.utils.calibration.Calibration.with_tpr`); returns the threshold."""
        calibration = self.calibration
        if calibration is None or calibration.scores is None:
            raise RuntimeError(f"set_tpr: detector {self.method!r} keeps no ID calibration scores: "
                               f"{self.p_value_unavailable}")
        moved = calibration.with_tpr(tpr, delta)
        self.set_calibration(moved)
        return moved.threshold

    def calibrate(
        self,
        id_validation_data: Any,
        tpr: float = 0.95,
        split: str = "validation",
        batch_size: int = 32,
        delta: float | None = None,
        image_column: str | None = None,
        label_column: str | None = None,
    ) -> float:
        """Set the threshold so that a fraction ``tpr`` of ID validation data is accepted as ID, and keep the ID
        validation scores (sorted; a sorted sample of :data:`~hf_gsc.utils.calibration.MAX_KEPT_SCORES` beyond) for
        p-values and :meth:`set_tpr`: one :class:`~hf_gsc.utils.calibration.Calibration`
        (:meth:`~hf_gsc.utils.calibration.Calibration.from_scores`).

        Use ID *validation* data only, never the test split or OOD data. ``config.calibration`` records what was
        read (``source``: ``"folder /abs/path"``, ``"split 'validation' of dataset root /abs/path"``,
        ``"datasets.Dataset (N rows)"``, ``"tensors given by the caller"``, ...; ``split``: the split this call chose
        from a dataset root, else ``None``), ``num_samples``, ``tpr``, ``delta``, and what the threshold depends on
        (``settings``, ``fitted_state``): a later change of either drops it (:meth:`clear_calibration`). Fewer than
        :data:`~hf_gsc.utils.thresholds.MIN_CALIBRATION_SAMPLES` samples warn.

        Args:
            id_validation_data: a ``(N, C, H, W)`` tensor; an iterable of batches (tensors, ``(pixel_values,
                labels)`` tuples, mappings with ``"pixel_values"``); or images: PIL or NumPy images, file paths,
                URLs, a folder, or a ``datasets.Dataset`` (its ``image_column``), prepared by the detector's
                ``image_processor``; or a dataset root (a folder with ``train/``, ``validation/``, ``test/``, a saved
                ``DatasetDict`` or a ``DatasetDict``), read at ``split`` only (logged; refused when it has none).
            tpr: fraction of ID samples to keep, in ``(0, 1]``.
            split: the split read from a dataset root (recorded as ``split``); never ``"test"``. Other data is read
                as it is, and recorded with ``split`` ``None``.
            batch_size: images per forward when images are given.
            image_column: the image column of a ``datasets.Dataset`` (default ``image``).
            label_column: its label column (default ``label``; calibration reads no labels, but names one that is
                missing).
            delta: ``None`` keeps the fraction ``tpr`` of these samples; a number in ``(0, 1)`` picks the
                split-conformal order statistic instead, which keeps at least ``tpr`` of *new* ID data with
                probability at least ``1 - delta`` (assuming those are drawn like the calibration samples;
                :func:`hf_gsc.utils.thresholds.conformal_threshold`). Recorded in ``config.calibration``.
        Returns:
            The threshold.
        """
        tpr, delta = check_tpr(tpr), check_delta(delta)  # before any forward: a bad one is refused at once
        rows = image_rows(id_validation_data, "id_validation_data", None, False, split, image_column, label_column)
        source, read_split = ("tensors given by the caller", None) if rows is None else (rows.source, rows.split)
        scores = []
        for pixel_values, _ in labelled_batches(id_validation_data if rows is None else rows, "id_validation_data",
                                                self.image_processor, batch_size, channels=self._expected_channels,
                                                split=split, image_column=image_column, label_column=label_column):
            with torch.no_grad():
                scores.append(self.score(pixel_values).double().cpu())
        all_scores = torch.cat(scores)
        if not torch.isfinite(all_scores).all():
            raise ValueError(
                f"calibrate: {int((~torch.isfinite(all_scores)).sum())} of {all_scores.numel()} ID validation scores "
                f"are NaN or infinite for method {self.method!r}; check the inputs and the settings (e.g. a tiny "
                "temperature)"
            )
        if all_scores.numel() < MIN_CALIBRATION_SAMPLES:
            warnings.warn(
                f"calibrate: {all_scores.numel()} ID validation samples is {TOO_FEW_FOR_A_THRESHOLD}",
                UserWarning,
                stacklevel=2,
            )
        calibration = Calibration.from_scores(all_scores, tpr, delta, split=read_split, source=source,
                                              depends_on=self.calibration_dependencies())
        self.set_calibration(calibration)
        return calibration.threshold


__all__ = ["Calibrated", "decide"]
