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
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers.utils import ModelOutput

from ..classifier.split_points import SplitPoint
from ..settings.config import DetectorConfig
from ..settings.registry import DETECTORS, detector_class, get_detector, register_detector, suggest_names
from ..storage.pretrained import DetectorFiles
from ..storage.push import HubPush
from ..storage.saved_format import check_state
from ..utils.calibration import changed_settings, fitted_state_digest
from ..utils.image_data import image_rows
from ..utils.inputs import check_pixel_values, fail_closed
from .backbone_pass import BackbonePass, FitShards, run_backbone
from .calibrated import Calibrated, decide
from .compiled import CompiledDetector, compiled


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


def classifier_loss(logits: torch.Tensor | None, labels: torch.Tensor | None) -> torch.Tensor | None:
    """Cross-entropy of the base logits ``(B, K)`` against ``labels`` ``(B,)``; ``None`` without labels."""
    if labels is None or logits is None:
        return None
    return nn.functional.cross_entropy(logits.detach().float(), labels.to(logits.device).long())


def _in_score_dtype(score_batch: Any) -> Any:
    """``score_batch`` returning its scores in the detector's :attr:`OODDetector.score_dtype`, NaN (decided OOD) in the
    rows whose ``pixel_values`` were not finite (:func:`hf_gsc.utils.inputs.fail_closed`)."""

    @functools.wraps(score_batch)
    def wrapped(self: OODDetector, batch: BackbonePass) -> torch.Tensor:
        return fail_closed(score_batch(self, batch), batch.nonfinite_marks()).to(self.score_dtype)

    wrapped._in_score_dtype = True
    return wrapped


class OODDetector(DetectorFiles, HubPush, Calibrated, nn.Module):
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
    config_class: ClassVar[type[DetectorConfig]] = DetectorConfig

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
        # Bookkeeping of check_config and the fit (plain attributes, set before anything reads them).
        self._setting_names: tuple[type, tuple[str, ...]] | None = None
        self._checked: tuple[DetectorConfig, int] | None = None
        # The settings this detector was built with and last checked (check_config compares the config with them).
        # Read through self.hyperparameters, which caches the setting names now, outside any compiled forward.
        self._built_with = self.hyperparameters
        # Set by from_pretrained when the base model ships one; used to calibrate from images and by the pipeline.
        self.image_processor: Any = None
        self.fitted = not self.needs_fit
        # The threshold, its record and the kept ID calibration scores, as one value (hf_gsc.detectors.calibrated).
        self.init_calibration()
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
        checked = self._checked
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
        self._checked = checking

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

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """Every setting of the method, defaults filled in (read-only copy)."""
        config = self.config
        # The names once per config class (dataclasses.fields, which a compiler does not trace); the values read
        # every time, so an assigned setting is honoured at once.
        names = self._setting_names
        if names is None or names[0] is not type(config):
            names = self._setting_names = (type(config), type(config).setting_names())
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
            label_column: str | None = None) -> OODDetector:
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
            rows = image_rows(id_train_batches, "id_train_batches",  # id2label's names: keeps ImageNet's 2 cranes
                              [name for _, name in sorted(self.id2label.items())] or None,
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

    @property
    def device(self) -> torch.device:
        """The device of the base model's parameters (what ``pixel_values`` are moved to)."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the base model's first parameter; ``pixel_values`` are cast to it."""
        return next(self.model.parameters()).dtype

    def train(self, mode: bool = True) -> OODDetector:
        """The wrapper may be put in train mode; the base model always stays in eval mode."""
        super().train(mode)
        self.model.eval()
        return self


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
