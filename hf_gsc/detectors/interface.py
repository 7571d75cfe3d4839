"""The one interface of every OOD detector (GSC and the other methods); the registry by method name is
:mod:`hf_gsc.settings.registry`.

A detector is an ``nn.Module`` that owns (or attaches to) a frozen base classifier and offers

* ``forward(pixel_values)`` -> :class:`OODDetectorOutput` (``logits``, ``ood_score``: higher = more
  in-distribution, ``is_ood``), and ``score(pixel_values)`` -> ``ood_score`` alone;
* ``fit(id_train_batches)`` where the method needs it, ``calibrate(id_validation_data, tpr)``;
* ``save_pretrained`` / ``push_to_hub`` / ``from_pretrained`` (one saved format, :mod:`hf_gsc.storage.saved_format`).

What a method reads from the backbone is declared, not fetched: :attr:`OODDetector.reads_logits` and
:meth:`OODDetector.feature_splits`. :func:`hf_gsc.detectors.backbone_pass.run_backbone` runs the base model once with all of
that captured, and :meth:`OODDetector.score_batch` scores the resulting pass (the feature-level API, like
pytorch-ood's ``predict_features``), so several detectors on one model share one forward
(:class:`hf_gsc.detectors.DetectorBundle`). Fitting shares passes the same way: ``fit_begin`` /
``fit_update(pass, labels)`` / ``fit_end``, and ``fit_gather`` before ``fit_end`` when each of several processes
passed its own share of the data (:mod:`hf_gsc.detectors.backbone_pass`). Fitted tensors are registered buffers: they move
with ``.to(device)``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

import torch
from torch import nn
from transformers.utils import ModelOutput

from .backbone_pass import BackbonePass, FitShards, run_backbone
from ..settings.config import DetectorConfig
from ..storage.push import HubPush
from ..utils.image_data import image_rows
from ..utils.inputs import check_pixel_values, fail_closed, labelled_batches
from .compiled import CompiledDetector, compiled
from ..settings.registry import DETECTORS, detector_class, get_detector, register_detector, suggest_names
from ..storage.pretrained import DetectorFiles
from ..classifier.split_points import SplitPoint
from ..utils.conformal import conformal_p_value, p_value_cut, sorted_calibration_scores
from ..utils.thresholds import (MIN_CALIBRATION_SAMPLES, TOO_FEW_FOR_A_THRESHOLD, calibration_record, check_delta,
                                check_tpr, threshold_for)

@dataclass
class OODDetectorOutput(ModelOutput):
    """Output of every detector's forward.

    Attributes:
        loss: ``()`` cross-entropy of ``logits`` against ``labels`` when labels are given (what ``Trainer.predict``
            expects of a classifier; the detector itself has no loss).
        logits: ``(B, K)`` the base model's logits, unchanged.
        ood_score: ``(B,)`` higher = more in-distribution.
        is_ood: ``(B,)`` bool, ``not ood_score >= threshold`` (a NaN score is OOD); ``None`` while no threshold is set.
        p_value: ``(B,)`` float64 conformal p-value, ``(1 + #{ID calibration scores <= ood_score}) / (n + 1)``: the
            chance that an ID image scores this low (:mod:`hf_gsc.utils.conformal`); ``None`` while the detector keeps
            no calibration scores (not calibrated, or loaded from a folder saved without them).

    ``Trainer.predict`` returns as ``predictions`` the fields other than ``loss`` that are not ``None``, in this
    order: ``(logits, ood_score, is_ood, p_value)``, or ``(logits, ood_score)`` before calibration. ``ood_score`` is
    float32 whatever the base model's dtype (float64 only for a float64 base model). ``label_ids`` are the dataset's
    ``labels``. GSC's output adds fields of its own after these: ``(logits, ood_score, is_ood, p_value, gsc_logits,
    predicted_class)`` (:class:`hf_gsc.GSCOutput`).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    ood_score: torch.Tensor | None = None
    is_ood: torch.Tensor | None = None
    p_value: torch.Tensor | None = None


def decide(ood_score: torch.Tensor, threshold: float | None) -> torch.Tensor | None:
    """``is_ood`` for ``ood_score`` at ``threshold``: ``True`` unless ``ood_score >= threshold``. A non-finite
    score (NaN from extreme inputs or settings) is therefore OOD: the detector fails closed."""
    if threshold is None:
        return None
    return ~(ood_score >= threshold)


def classifier_loss(logits: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor | None:
    """Cross-entropy of the base logits ``(B, K)`` against ``labels`` ``(B,)``; ``None`` without labels."""
    if labels is None or logits is None:
        return None
    return nn.functional.cross_entropy(logits.detach().float(), labels.to(logits.device).long())


def _in_score_dtype(score_batch: Any) -> Any:
    """``score_batch`` returning its scores in the detector's :attr:`OODDetector.score_dtype`, NaN (decided OOD) in the
    rows whose ``pixel_values`` were not finite (:func:`hf_gsc.utils.inputs.fail_closed`)."""

    @functools.wraps(score_batch)
    def wrapped(self: "OODDetector", batch: BackbonePass) -> torch.Tensor:
        return fail_closed(score_batch(self, batch), batch.nonfinite_marks()).to(self.score_dtype)

    wrapped._in_score_dtype = True
    return wrapped


def _keeping_calibration_honest(fit_end: Any) -> Any:
    """``fit_end`` followed, once per fit (not again in a subclass's ``super().fit_end()``), by dropping a threshold
    calibrated for another fitted state."""

    @functools.wraps(fit_end)
    def wrapped(self: "OODDetector") -> None:
        outer = not self.__dict__.get("_ending_fit", False)
        self.__dict__["_ending_fit"] = True
        try:
            fit_end(self)
        finally:
            if outer:
                self.__dict__["_ending_fit"] = False
        if outer:
            reason = self.stale_threshold(settings=False, refitted=True)
            if reason is not None:
                self.clear_calibration(reason)

    wrapped._keeps_calibration_honest = True
    return wrapped


class OODDetector(DetectorFiles, HubPush, nn.Module):
    """A post-hoc OOD detector on a frozen image classifier (see the module docstring for the interface).

    Class attributes:
        method: registry name (``"msp"``, ``"gsc"``, ...), the saved format's type field; taken from
            ``config_class.method``, where the method's config class declares it.
        needs_fit: whether :meth:`fit` must run before scoring (per instance where settings decide it).
        fit_split: the ID split the evaluation fits it on (``"train"`` or ``"validation"``), never test.
        reads_logits: whether :meth:`score_batch` reads the base model's logits.
        config_class: the method's settings class, a :class:`~hf_gsc.settings.config.DetectorConfig` subclass written in the
            method's file (``GSCConfig`` for GSC, ``KNNConfig`` for KNN, ...).

    The base model is put in eval mode and frozen; it never receives ``.grad``.
    """

    method: ClassVar[str]
    #: Hyperparameter -> values searched by ``hf-gsc evaluate --tune`` (the grid is their product, in this order).
    search_space: ClassVar[dict[str, tuple[Any, ...]]] = {}
    #: Where ``search_space`` comes from (e.g. OpenOOD's ``postprocessor_sweep``), or why the method is not tuned.
    search_space_source: ClassVar[str] = "no hyperparameters"
    #: Whether :meth:`score_batch` needs nothing but the shared backbone pass (``False``: the method runs forwards
    #: and backwards of its own, as ODIN does, and is left out of the one-pass cost figures).
    one_pass: ClassVar[bool] = True
    #: Hub tags of a saved detector's card besides the common ones.
    card_tags: ClassVar[tuple[str, ...]] = ()
    #: Whether ``hf-gsc evaluate`` runs the method when ``--methods`` is not given (the default table: GSC and the
    #: main baselines that need no long fit). Read from the class itself, never inherited
    #: (:func:`hf_gsc.settings.registry.default_methods`).
    in_default_table: ClassVar[bool] = False
    needs_fit: bool = False
    fit_split: str = "train"
    min_fit_samples: int = 1
    reads_logits: ClassVar[bool] = False
    config_class: ClassVar[type] = DetectorConfig

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **kwargs: Any) -> None:
        """Args: ``model``, the base classifier; ``config``, the method's settings (a ``config_class``; ``None``:
        defaults); ``kwargs``, its fields replacing those of ``config`` (``k=50``, ``threshold=...``,
        ``base_model_name_or_path=...``): :meth:`hf_gsc.DetectorConfig.from_kwargs`, for every method."""
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module image classifier, got {type(model).__name__}")
        config = self.complete_config(model, self.config_class.from_kwargs(config, **kwargs))
        self.model = model.eval().requires_grad_(False)
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
        self.config = config
        # The settings this detector was built with and last checked (check_config compares the config with them).
        # Read through self.hyperparameters, which caches the setting names now, outside any compiled forward.
        self._built_with = self.hyperparameters
        # Set by from_pretrained when the base model ships one; used to calibrate from images and by the pipeline.
        self.image_processor: Any = None
        self.fitted = not self.needs_fit
        self._warned_uncalibrated = False
        # (n,) float64 ascending ID calibration scores on the CPU (hf_gsc.utils.conformal), saved in
        # detector_state.safetensors. Not a buffer: detector.to(torch.bfloat16) would round them. A copy per device
        # the scores were on is kept, so that a forward on a GPU copies nothing from the host.
        self._calibration_scores: torch.Tensor | None = None
        self._calibration_scores_on: dict[torch.device, torch.Tensor] = {}
        # Why p_value is None although a threshold is set (a folder saved without calibration scores), warned once.
        self._no_p_value_reason: str | None = None
        self._warned_no_p_value = False
        base_config = getattr(model, "config", None)
        self._expected_channels: int | None = getattr(base_config, "num_channels", None)
        image_size = getattr(base_config, "image_size", None)
        self._expected_size: tuple[int, int] | None = (
            None if image_size is None
            else tuple(image_size) if isinstance(image_size, (list, tuple)) else (image_size, image_size)
        )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The method's name is declared once, by its config class (the saved format's type field).
        if "config_class" in cls.__dict__ and "method" not in cls.__dict__:
            cls.method = cls.config_class.method
        # One score dtype for every method, whatever the method computes in: ``score_batch`` as each method writes
        # it is wrapped once here (every caller, the bundle and the evaluation included, goes through it).
        own = cls.__dict__.get("score_batch")
        if own is not None and not getattr(own, "_in_score_dtype", False):
            cls.score_batch = _in_score_dtype(own)
        # A refit (however it is reached: fit, fit_together, fit_fisher, the evaluation) drops a stale threshold.
        own = cls.__dict__.get("fit_end")
        if own is not None and not getattr(own, "_keeps_calibration_honest", False):
            cls.fit_end = _keeping_calibration_honest(own)

    @property
    def id2label(self) -> dict[int, str]:
        """The base classifier's class names by index (``config.id2label``; ``{}`` when it has none)."""
        return dict(getattr(getattr(self.model, "config", None), "id2label", None) or {})

    @property
    def label2id(self) -> dict[str, int]:
        """The base classifier's class indices by name (``config.label2id``; ``{}`` when it has none)."""
        return dict(getattr(getattr(self.model, "config", None), "label2id", None) or {})

    @property
    def num_channels(self) -> int | None:
        """The channels of the images the base model takes (``config.num_channels``); ``None`` when it does not say.
        Images are converted to it (1: grey, 3: RGB) by :func:`hf_gsc.utils.images.load_image`."""
        return self._expected_channels

    @property
    def score_dtype(self) -> torch.dtype:
        """``ood_score``'s dtype: float32, whatever the base model's dtype (a bf16 or fp16 model too), and float64
        only when the base model runs in float64."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    @classmethod
    def model_defaults(cls, image_processor: Any) -> dict[str, Any]:
        """Hyperparameters whose right value depends on the base model's image processor (ODIN's ``image_std``);
        the evaluation passes them unless the user set them. Default: none."""
        return {}

    def complete_config(self, model: nn.Module, config: DetectorConfig) -> DetectorConfig:
        """``config`` (a fresh copy, this detector's own) with the defaults that depend on ``model`` filled in
        (ASH's percentile, GSC's shaping percentile). Default: unchanged."""
        return config

    # ------------------------------------------------------------------ the config: structure and threshold
    def check_config(self) -> None:
        """Bring this detector in line with its config before it scores or saves (the config itself is passive).

        A structural setting assigned since the detector was built (:attr:`DetectorConfig.structural_names`) is
        rebuilt for (:meth:`rebuild`), any other is checked against the fitted state (:meth:`settings_changed`); when
        either refuses or fails, the assignments are undone and the error raised. A threshold whose calibration
        record no longer matches the settings is dropped (:meth:`stale_threshold`, :meth:`clear_calibration`).

        Skipped inside a compiled forward (a compiler cannot trace it; the compiled graph guards on the settings it
        reads and recompiles when one changes): :meth:`compiled`'s forward runs this check eagerly before each call.
        Skipped too while the config has taken no assignment (:attr:`DetectorConfig.assignments`) since the last
        check that passed (each forward would otherwise compare every setting and the calibration record again)."""
        if torch.compiler.is_compiling():
            return
        config = self.config
        checking = (config, config.assignments)
        checked = self.__dict__.get("_checked")
        if checked is not None and checked[0] is config and checked[1] == checking[1]:
            return
        now = self.hyperparameters
        changed = {name: (self._built_with[name], value) for name, value in now.items()
                   if value != self._built_with.get(name)}
        if changed:
            structural = {name: values for name, values in changed.items()
                          if name in self.config.structural_setting_names()}
            try:
                if structural:
                    self.rebuild(structural)
                self.settings_changed(changed)
            except Exception:
                for name, (old, _) in changed.items():
                    object.__setattr__(self.config, name, old)  # already checked when it was first assigned
                raise
            self._built_with = now
        reason = self.stale_threshold(fitted_state=False)
        if reason is not None:
            self.clear_calibration(reason)
        # The count read before the check: an assignment made by the check itself (a rebuild, the dropped
        # threshold) has the next call check again.
        self.__dict__["_checked"] = checking

    def rebuild(self, changed: dict[str, tuple[Any, Any]]) -> None:
        """Rebuild what depends on the structural settings in ``changed`` (``name -> (built with, now)``).
        Default: refuse (what was built and fitted depends on the old values); :meth:`check_config` then undoes the
        assignment."""
        name, (old, new) = next(iter(changed.items()))
        raise ValueError(
            f"{type(self).__name__}.config.{name} was set to {new!r} on a detector built with {old!r}; it decides what "
            f"this detector built and fitted, so the assignment is undone: build a new detector instead, "
            f"AutoOODDetector.from_pretrained(model, method={self.method!r}, {name}={new!r})"
        )

    def settings_changed(self, changed: dict[str, tuple[Any, Any]]) -> None:
        """Called by :meth:`check_config` after settings changed (``name -> (before, now)``), structural ones
        rebuilt for: re-derive what depends on them, or raise to have them undone. Default: nothing."""

    def calibration_settings(self, config: DetectorConfig | None = None) -> dict[str, Any]:
        """The values ``ood_score`` depends on besides the fitted tensors (the settings and fitted values other than
        the threshold and its record), as JSON stores them: what a calibration record keeps as ``settings``. Those of
        this detector's config, or of ``config`` (at load: the saved one)."""
        return json.loads(json.dumps((self.config if config is None else config).score_hyperparameters()))

    def calibration_dependencies(self) -> dict[str, Any]:
        """What a threshold calibrated now depends on: ``settings`` (:meth:`calibration_settings`) and
        ``fitted_state`` (:func:`fitted_state_digest` of :meth:`fitted_state`; ``None`` when nothing is fitted)."""
        return {"settings": self.calibration_settings(), "fitted_state": fitted_state_digest(self.fitted_state())}

    def clear_calibration(self, reason: str) -> None:
        """Drop the threshold, its calibration record and the kept calibration scores, saying why in one warning;
        ``is_ood`` and ``p_value`` are then ``None`` until :meth:`calibrate` runs again."""
        self.config.threshold = None
        self.config.calibration = None
        self.keep_calibration_scores(None, reason)
        self._warned_uncalibrated = True  # this warning says it: no second one at the next forward
        warnings.warn(
            f"detector {self.method!r}: its threshold was dropped because {reason}, so is_ood is None (no decision, "
            f"not 'in-distribution'): call .calibrate(id_validation_data) with at least {MIN_CALIBRATION_SAMPLES} ID "
            "validation images",
            UserWarning,
            stacklevel=3,
        )

    def check_loaded_calibration(self, saved_settings: dict[str, Any]) -> None:
        """After a load: keep the saved threshold only for the settings and fitted state it was calibrated for
        (:meth:`stale_threshold`; ``saved_settings``: the saved values of the settings given again at load)."""
        reason = self.stale_threshold(saved_settings=saved_settings)
        if reason is not None:
            self.clear_calibration(reason)

    def stale_threshold(self, settings: bool = True, fitted_state: bool = True,
                        saved_settings: dict[str, Any] | None = None, refitted: bool = False) -> str | None:
        """Why the threshold no longer applies to this detector (the reason :meth:`clear_calibration` gives), or
        ``None`` while it does or none is set; the one check at load, before each score or save, and after a refit.

        Args:
            settings: compare the calibration record's ``settings`` with :meth:`calibration_settings`. A record
                written without them (an older format) is compared, on the settings in ``saved_settings`` only, with
                ``saved_settings`` when given (at load: the saved values of the settings given again, so that a
                keyword given to ``from_pretrained`` that changes one drops the threshold), else not at all.
            fitted_state: compare the record's ``fitted_state`` with :func:`fitted_state_digest` of
                :meth:`fitted_state`. A record without one is kept unverified (the older format saved the threshold
                with the state file it was calibrated with) unless ``refitted``: after a fit it vouches for nothing.
            refitted: the detector was fitted since the record was written.
        """
        calibration = self.config.calibration or {}
        if self.config.threshold is None:
            return None
        differ = ""
        if settings and "settings" in calibration:
            differ = changed_settings(calibration["settings"], self.calibration_settings())
        elif settings and saved_settings is not None:
            current = self.calibration_settings()
            differ = changed_settings(saved_settings, {name: current.get(name) for name in saved_settings})
        if differ:
            return f"{differ} changed since it was calibrated"
        if fitted_state:
            recorded = calibration.get("fitted_state")
            if refitted and recorded is None:
                return "the detector was fitted again since it was calibrated, with no fitted state recorded to compare"
            if "fitted_state" in calibration and recorded != fitted_state_digest(self.fitted_state()):
                return "the fitted state changed since it was calibrated"
        return None

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """Every setting of the method, defaults filled in (read-only copy)."""
        config = self.config
        # The names once per config class (dataclasses.fields, which a compiler does not trace); the values read
        # every time, so an assigned setting is honoured at once.
        names = self.__dict__.get("_setting_names")
        if names is None or names[0] is not type(config):
            names = (type(config), type(config).setting_names())
            self.__dict__["_setting_names"] = names
        return {name: getattr(config, name) for name in names[1]}

    # ------------------------------------------------------------------ what it reads, and scoring
    def feature_splits(self) -> tuple[SplitPoint, ...]:
        """The split points whose ``F`` :meth:`score_batch` reads from the shared backbone pass."""
        return ()

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """``(B,)`` ``ood_score`` (higher = more in-distribution) from one backbone pass."""
        raise NotImplementedError

    def check_ready(self) -> None:
        """Raise when the detector cannot score yet (a method that needs fitting, not fitted); first
        :meth:`check_config`."""
        self.check_config()
        if self.needs_fit and not self.fitted:
            raise RuntimeError(
                f"detector {self.method!r} must be fitted first: call .fit(batches) on ID {self.fit_split} data"
            )

    def _check_pixel_values(self, pixel_values: Any, finite: bool = False) -> torch.Tensor:
        """Checked ``pixel_values`` on the model's device, in its dtype. Shapes and dtype only, unless ``finite``
        (fitting, calibrating): a forward never reads the values on the host; a row that is not finite gets a NaN
        score instead, decided OOD (:func:`hf_gsc.utils.inputs.fail_closed`)."""
        checked = check_pixel_values(pixel_values, self._expected_channels, self._expected_size, self.dtype,
                                     finite=finite)
        return checked.to(self.device)

    def backbone_pass(self, pixel_values: torch.Tensor, logits: bool = True) -> BackbonePass:
        """One forward of the base model with what this detector reads captured."""
        return run_backbone(self.model, pixel_values, self.feature_splits(), logits=logits or self.reads_logits)

    def score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B,)`` ``ood_score``, higher = more in-distribution (no logits returned)."""
        self.check_ready()
        pixel_values = self._check_pixel_values(pixel_values)
        return self.score_batch(self.backbone_pass(pixel_values, logits=False)).to(pixel_values.device)

    def forward(
        self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None, return_dict: bool | None = None
    ) -> OODDetectorOutput:
        """Score a batch: ``logits`` (the base model's), ``ood_score`` and ``is_ood``. ``labels`` only set ``loss``
        (as for any ``*ForImageClassification`` model); ``return_dict`` is accepted and ignored."""
        self.check_ready()
        pixel_values = self._check_pixel_values(pixel_values)
        return self.output_of(self.backbone_pass(pixel_values, logits=True), labels)

    def compiled(self, mode: str = "default", backend: str = "inductor", dynamic: bool | None = None) -> CompiledDetector:
        """This detector's forward compiled whole with ``torch.compile(..., fullgraph=True)``, called like the detector
        (:class:`hf_gsc.detectors.compiled.CompiledDetector`). ``mode="reduce-overhead"`` replays CUDA graphs on a GPU.
        The first call per batch size compiles (seconds to minutes); use it where the same shapes come again
        (serving), not for one pass over a data set. Scores equal the eager forward's within float tolerance."""
        return compiled(self, mode=mode, backend=backend, dynamic=dynamic)

    def output_of(self, batch: BackbonePass, labels: torch.Tensor | None = None) -> OODDetectorOutput:
        """The forward's output from a backbone pass that holds the logits."""
        ood_score = self.score_batch(batch).to(batch.pixel_values.device)
        logits = batch.model_logits()
        return OODDetectorOutput(
            loss=classifier_loss(logits, labels), logits=logits, ood_score=ood_score, is_ood=self.decide(ood_score),
            p_value=self.p_value(ood_score),
        )

    def decide(self, ood_score: torch.Tensor) -> torch.Tensor | None:
        """``is_ood`` at the calibrated threshold (NaN -> OOD); ``None``, with a warning once, before calibration
        (in eager code: a compiled forward cannot warn, so :func:`hf_gsc.detectors.compiled.compiled` warns before
        its first call)."""
        threshold = self.config.threshold
        if threshold is None and not torch.compiler.is_compiling():
            self.warn_if_uncalibrated(stacklevel=4)
        return decide(ood_score, threshold)

    def warn_if_uncalibrated(self, stacklevel: int = 2) -> None:
        """The one-time warning that ``is_ood`` is ``None`` until :meth:`calibrate` sets a threshold."""
        if self.config.threshold is None and not self._warned_uncalibrated:
            self._warned_uncalibrated = True
            warnings.warn(
                f"detector {self.method!r} has no threshold, so is_ood is None (no decision, not 'in-distribution'): "
                f"call .calibrate(id_validation_data) with at least {MIN_CALIBRATION_SAMPLES} ID validation images",
                UserWarning,
                stacklevel=stacklevel,
            )

    def p_value(self, ood_score: torch.Tensor) -> torch.Tensor | None:
        """``(B,)`` float64 conformal p-values of ``ood_score`` against the kept ID calibration scores
        (:func:`hf_gsc.utils.conformal.conformal_p_value`); ``None`` without them, with a warning once when a threshold
        is set all the same (a folder saved without calibration scores)."""
        scores = self._calibration_scores
        compiling = torch.compiler.is_compiling()
        if scores is None:
            if self.config.threshold is not None and not self._warned_no_p_value and not compiling:
                self._warned_no_p_value = True
                warnings.warn(f"detector {self.method!r}: p_value is None: {self.p_value_unavailable}", UserWarning,
                              stacklevel=3)
            return None
        if compiling:  # no cache mutation inside a compiled forward; a copy to the same device is free
            return conformal_p_value(ood_score, scores.to(ood_score.device))
        on_device = self._calibration_scores_on.get(ood_score.device)
        if on_device is None:
            on_device = self._calibration_scores_on[ood_score.device] = scores.to(ood_score.device)
        return conformal_p_value(ood_score, on_device)

    @property
    def calibration_scores(self) -> torch.Tensor | None:
        """``(n,)`` float64, ascending, on the CPU: the ``ood_score`` of every ID image the threshold was calibrated on
        (saved as ``calibration_scores`` in ``detector_state.safetensors``); ``None`` when not kept."""
        return self._calibration_scores

    @property
    def p_value_unavailable(self) -> str | None:
        """Why :meth:`p_value` gives ``None`` (``None`` when p-values are available)."""
        if self.calibration_scores is not None:
            return None
        if self.config.threshold is None:
            return (self._no_p_value_reason or "the detector is not calibrated") + (
                "; call .calibrate(id_validation_data) to keep the ID calibration scores p-values are computed from")
        return self._no_p_value_reason or (
            "the threshold was set without keeping the ID calibration scores (set by hand, or saved by a version that "
            "did not keep them); call .calibrate(id_validation_data) to keep them")

    @property
    def p_value_cut(self) -> float | None:
        """The p-value at and below which an input is flagged: ``is_ood == (p_value <= p_value_cut)`` for the
        threshold ``calibrate`` or :meth:`set_tpr` set (:func:`hf_gsc.utils.conformal.p_value_cut`); ``None`` without
        calibration scores or threshold."""
        if self.calibration_scores is None or self.config.threshold is None:
            return None
        return p_value_cut(self.calibration_scores, self.config.threshold)

    def keep_calibration_scores(self, scores: torch.Tensor | None, reason: str | None = None) -> None:
        """Keep ``scores`` ``(n,)`` (the ``ood_score`` of the ID images the threshold was calibrated on: all of them,
        sorted, float64) for p-values and :meth:`set_tpr`; ``None`` drops them, ``reason`` saying why."""
        self._calibration_scores = None if scores is None else sorted_calibration_scores(scores)
        self._calibration_scores_on = {}
        self._no_p_value_reason = reason if scores is None else None
        self._warned_no_p_value = False

    def set_tpr(self, tpr: float, delta: float | None = None) -> float:
        """Move the threshold to keep a fraction ``tpr`` of ID data, from the kept calibration scores (no new forward):
        the threshold ``calibrate(data, tpr=tpr, delta=delta)`` would set on the same data
        (:func:`hf_gsc.utils.thresholds.threshold_for`). Updates ``config.threshold`` and the ``tpr`` / ``delta`` of
        ``config.calibration``; returns the threshold."""
        tpr = check_tpr(tpr)
        if self.calibration_scores is None:
            raise RuntimeError(f"set_tpr: detector {self.method!r} keeps no ID calibration scores: "
                               f"{self.p_value_unavailable}")
        scores = self.calibration_scores
        threshold = threshold_for(scores, tpr, delta)
        record = dict(self.config.calibration or {})
        record.update(tpr=tpr, delta=None if delta is None else float(delta))
        if "method" in record:
            record["method"] = "quantile" if delta is None else "conformal"
        self.config.threshold = threshold
        self.config.calibration = record
        return threshold

    # ------------------------------------------------------------------ fitting (one pass shared by many detectors)
    def fit_begin(self) -> None:
        """Start a fit (called before the first :meth:`fit_update`)."""

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        """Take one batch of ID fitting data (its backbone pass and labels)."""

    def fit_end(self) -> None:
        """Finish the fit: compute the fitted state from what :meth:`fit_update` took."""
        self.fitted = True

    def fit_gather(self, shards: FitShards) -> None:
        """On several processes, between the last :meth:`fit_update` and :meth:`fit_end`: replace what
        :meth:`fit_update` took from this process's batches by what every process took (``shards.batches`` for
        per-sample values, kept in the order of the data; ``shards.sum`` for sums), so that :meth:`fit_end` computes
        the whole fit, the same on every process. A method that fits must say how its parts combine."""
        raise NotImplementedError(f"detector {self.method!r} cannot be fitted on several processes: its class does not "
                                  "say how the processes' parts of its fit combine (fit_gather)")

    def fit(self, id_train_batches: Iterable[Any], image_column: str | None = None,
            label_column: str | None = None) -> "OODDetector":
        """Fit on ID data, streamed: batches of ``(pixel_values, labels)`` (or mappings with ``pixel_values`` and
        ``labels``), or images prepared by ``image_processor``: a class-folder tree (labels by folder name through the
        model's ``config.label2id``), a ``datasets.Dataset`` (``image_column``, default ``image``, and
        ``label_column``, default ``label``: ``ClassLabel`` indices or class-name strings, mapped by name to the
        model's labels), a folder, file, URL, PIL or NumPy image or a list of them (for methods that need no labels).

        A dataset root (a folder with ``train/``, ``validation/``, ``test/``, a saved ``DatasetDict`` or a
        ``DatasetDict``) is read at the detector's :attr:`fit_split` only, which is logged; a root without it is
        refused. A method that needs no fitting returns at once."""
        from .backbone_pass import fit_together

        if self.needs_fit:
            rows = image_rows(id_train_batches, "id_train_batches", self.label2id or None,
                              getattr(self, "needs_labels", False), self.fit_split, image_column, label_column)
            id_train_batches = id_train_batches if rows is None else rows
        fit_together([self], id_train_batches)
        return self

    # ------------------------------------------------------------------ fitted state (registered buffers)
    state_names: ClassVar[tuple[str, ...]] = ()

    def fitted_state(self) -> dict[str, torch.Tensor]:
        """The fitted tensors (empty for methods that fit nothing), as saved in ``detector_state.safetensors``."""
        if not self.fitted:
            return {}
        return {name: getattr(self, name) for name in self.state_names if getattr(self, name, None) is not None}

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        """``name -> shape`` of every fitted tensor (``None`` for a free dimension); checked at load."""
        return {}

    def load_fitted_state(self, state: dict[str, torch.Tensor], source: str = "the saved state") -> None:
        """Put saved fitted tensors in place after checking each one (present, floating point, finite, shape),
        so that a wrong file fails here, naming the tensor, and not at the first forward."""
        check_state(self.method, state, self.expected_state(), source)
        for name in self.state_names:
            if name in state:
                setattr(self, name, state[name].to(self.device))
        self._prepare()
        self.fitted = True

    def _prepare(self) -> None:
        """Derive scoring-time quantities from the fitted state (after a fit and after loading)."""

    # ------------------------------------------------------------------ calibration
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
        """Set ``config.threshold`` so that a fraction ``tpr`` of ID validation data is accepted as ID, and keep the
        ID validation scores (sorted) for p-values and :meth:`set_tpr`.

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
        self.config.threshold = threshold_for(all_scores, tpr, delta)
        self.keep_calibration_scores(all_scores)
        self.config.calibration = calibration_record(read_split, all_scores.numel(), tpr, delta, source=source,
                                                     **self.calibration_dependencies())
        return self.config.threshold

    @property
    def device(self) -> torch.device:
        """The device of the base model's parameters (what ``pixel_values`` are moved to)."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the base model's first parameter; ``pixel_values`` are cast to it."""
        return next(self.model.parameters()).dtype

    def train(self, mode: bool = True) -> "OODDetector":
        """The wrapper may be put in train mode; the base model always stays in eval mode."""
        super().train(mode)
        self.model.eval()
        return self


def fitted_state_digest(state: dict[str, torch.Tensor]) -> str | None:
    """``"sha256:<hex>"`` of fitted tensors (names, dtypes, shapes and bytes, in name order), the identity a
    calibration record keeps; ``None`` when nothing is fitted. The same on every device."""
    if not state:
        return None
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def changed_settings(recorded: Any, current: dict[str, Any]) -> str:
    """``""`` when ``recorded`` (a calibration record's ``settings``) equals ``current``; else the differing
    settings, ``"k (50 -> 5)"``."""
    recorded = recorded if isinstance(recorded, dict) else {}
    names = sorted(name for name in set(recorded) | set(current) if recorded.get(name) != current.get(name))
    return ", ".join(f"{name} ({recorded.get(name)!r} -> {current.get(name)!r})" for name in names)


def check_state(
    method: str, state: dict[str, torch.Tensor], expected: dict[str, tuple[int | None, ...]], source: str
) -> None:
    """Each expected fitted tensor is present, floating point, finite and of the expected shape; else a
    ``ValueError`` naming the tensor, its shape and the expected one, and ``source``."""
    for name, shape in expected.items():
        where = f"{method}: fitted tensor {name!r} in {source}"
        if name not in state:
            raise ValueError(f"{where} is missing (the file holds {sorted(state)}); fit the detector again")
        tensor = state[name]
        if not tensor.is_floating_point():
            raise ValueError(f"{where} must be floating point, got {tensor.dtype}")
        wanted = "(" + ", ".join("*" if d is None else str(d) for d in shape) + ")"
        if tensor.ndim != len(shape) or any(d is not None and d != got for d, got in zip(shape, tensor.shape)):
            raise ValueError(f"{where} has shape {tuple(tensor.shape)}, expected {wanted} for this base model; "
                             "it was fitted for another model or settings")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{where} holds NaN or infinite values; fit the detector again")


__all__ = [
    "DETECTORS",
    "OODDetector",
    "OODDetectorOutput",
    "changed_settings",
    "check_state",
    "classifier_loss",
    "decide",
    "detector_class",
    "fitted_state_digest",
    "get_detector",
    "register_detector",
    "suggest_names",
]
