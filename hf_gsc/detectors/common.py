"""Plumbing shared by the baseline detectors: hyperparameter defaults, logits, penultimate features, fitted state.

* :class:`BaselineDetector`: the settings are the fields of the method's ``config_class`` (a
  :class:`~hf_gsc.settings.config.DetectorConfig` subclass written in the method's file); unknown names raise, naming the
  nearest known one.
* :class:`TemperatureLogitDetector`: a score of the logits at a temperature (MSP, Energy).
* :class:`PenultimateDetector`: reads the penultimate feature ``z`` (input of the last ``nn.Linear``, ``(B, D)``)
  from the shared backbone pass, and holds the linear head (:class:`hf_gsc.detectors.penultimate.LinearHead`).
* :class:`FittedDetector`: ``fit_update`` gives each batch's ``(features, labels)`` (the pass's penultimate feature,
  on the CPU) to the method's accumulator (:meth:`FittedDetector.fit_accumulator`: every feature once, float32, or
  streamed float64 sums), one per kind shared by every detector fitted in that pass; ``fit_end`` hands it to
  ``_fit``. The fitted tensors are the registered buffers named in ``state_names``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch
from torch import nn

from ..classifier.split_points import SplitPoint
from ..settings.config import MIN_TEMPERATURE, DetectorConfig, ReadOnlyDict, number_check, setting
from ..utils.score_names import Score
from ..utils.scores import ood_score
from .backbone_pass import BackbonePass, FitShards
from .interface import OODDetector
from .penultimate import (
    ClassStatistics,
    FeatureStore,
    LinearHead,
    NotEnoughSamplesError,
    StatisticsPass,
    check_fit_samples,
    linear_head,
    penultimate_split,
)


def known_sample_count(data: Any) -> int | None:
    """The number of samples in fitting ``data`` where it is known without reading an image: a ``datasets.Dataset``
    (its rows), or a list of ``(pixel_values, labels)`` batches held as tensors (their rows); else ``None``."""
    if type(data).__name__ == "Dataset" and hasattr(data, "column_names"):
        return len(data)
    if isinstance(data, (list, tuple)) and data and all(
            isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[0], torch.Tensor)
            and batch[0].dim() == 4 for batch in data):
        return sum(int(batch[0].shape[0]) for batch in data)
    return None


def _unlabelled(features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Every row in class 0: the one mean of all the features."""
    return features, torch.zeros(features.shape[0], dtype=torch.long), None


class BaselineDetector(OODDetector):
    """A detector whose hyperparameters are exactly the settings of its ``config_class``.

    The config holds every value (defaults filled in), so a saved ``detector_config.json`` describes the method
    completely; each value is checked by its config field on assignment. Args: ``model``, an optional config of the
    method's ``config_class`` (a saved one), and hyperparameters overriding it
    (:meth:`hf_gsc.DetectorConfig.from_kwargs`, as for every method).
    """

    #: ``{setting: default}`` of ``config_class`` (read-only; derived from the config class, never written).
    defaults: ClassVar[ReadOnlyDict] = ReadOnlyDict()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "config_class" in cls.__dict__:
            cls.defaults = cls.config_class().hyperparameters

    def complete_config(self, model: nn.Module, config: DetectorConfig) -> DetectorConfig:
        for name, value in self.resolve_defaults(model, dict(config.hyperparameters)).items():
            setattr(config, name, value)  # checked by the config field
        return config

    def resolve_defaults(self, model: nn.Module, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        """Replace defaults that depend on the model (``None`` placeholders) by their values (default: none)."""
        return hyperparameters

    def logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The base model's logits ``(B, K)`` of ``pixel_values``, without gradient (for methods that run their
        own forwards, such as ODIN)."""
        with torch.no_grad():
            return self.model(pixel_values=pixel_values).logits


@dataclass
class TemperatureConfig(DetectorConfig):
    """The one setting of a score of the logits at a temperature (MSP, Energy)."""

    temperature: float = setting(1.0, number_check(MIN_TEMPERATURE, math.inf),
                                 "``T`` of the softmax / energy; 1: the authors' plain logits (MSP: Hendrycks & "
                                 "Gimpel, ICLR 2017; Energy: Liu et al., NeurIPS 2020, their setting).")


class TemperatureLogitDetector(BaselineDetector):
    """Scores the base model's logits with ``hf_gsc.utils.scores.ood_score(logits, score, temperature)``."""

    score_name: ClassVar[Score]
    search_space = {"temperature": (1.0, 10.0, 100.0, 1000.0)}
    search_space_source = ("OpenOOD's earlier ebo.yml temperature list [1, 10, 100, 1000] (it now lists [1]; OpenOOD "
                           "sweeps no temperature for MSP or MaxLogit); costs nothing extra")
    reads_logits = True

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return ood_score(batch.model_logits(), self.score_name, self.hyperparameters["temperature"])


class PenultimateDetector(BaselineDetector):
    """A detector on the penultimate feature ``z`` ``(B, D)`` and the linear head ``W z + b``."""

    # The base model's head, as buffers (registered in __init__).
    head_weight: torch.Tensor
    head_bias: torch.Tensor

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self.split = penultimate_split(self.model)
        # Buffers (not saved: they are the base model's own weights), so that .to(device) moves them with the
        # features and the fitted state instead of a copy to the features' device in every batch.
        head = linear_head(self.model)
        self.register_buffer("head_weight", head.weight, persistent=False)
        self.register_buffer("head_bias", head.bias, persistent=False)

    @property
    def head(self) -> LinearHead:
        """The classifier ``W z + b`` of the base model (detached copies, on the detector's device)."""
        return LinearHead(self.head_weight, self.head_bias)

    def feature_splits(self) -> tuple[SplitPoint, ...]:
        return (self.split,)

    def features(self, batch: BackbonePass) -> torch.Tensor:
        """``z`` of the pass, ``(B, D)``, without gradient, on the device of the fitted state (the model's)."""
        return batch.flat_features(self.split)


#: What a fit keeps of each batch (:meth:`FittedDetector.fit_accumulator`): ``update(features, labels)`` per batch,
#: ``gather(shards)`` on several processes, ``count`` the samples seen.
FitAccumulator = Union[FeatureStore, StatisticsPass]

#: The accumulators of the detectors fitted together on a process that passed no batch (an uneven share), by the
#: pass's shards and kind: shared as on the processes with batches, so that every process gathers each one once.
_UNFED_ACCUMULATORS: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()


class FittedDetector(PenultimateDetector):
    """A penultimate-feature detector with statistics fitted on ID data.

    The fit keeps, from each batch, what :meth:`fit_accumulator` says (every feature once, float32:
    :class:`~hf_gsc.detectors.penultimate.FeatureStore`; or streamed sums only:
    :class:`~hf_gsc.detectors.penultimate.StatisticsPass`), one accumulator shared by the detectors of a pass that
    keep the same kind; ``_fit(accumulated)`` reads it once (without changing it: others read it too), checks the count
    with :meth:`check_fit_count` and sets the buffers named in ``state_names``; ``_prepare()`` derives anything else
    from them (it also runs after loading); ``expected_state()`` gives their shapes, checked at load.
    ``min_fit_samples`` is set per instance by :meth:`fit_requirement`.
    """

    needs_fit = True
    #: Whether the fit reads class labels (per-class statistics).
    needs_labels: ClassVar[bool] = False

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        for name in self.state_names:
            self.register_buffer(name, None)
        self.min_fit_samples, self.fit_requirement_reason = self.fit_requirement()
        self._accumulator: Any = None

    def settings_changed(self, changed: dict[str, Any]) -> None:
        # A setting that is not structural (KNN's k) changes what the fit needs and what is derived from it: both
        # are derived again (a fitted state too small for the new value raises, and the change is undone).
        self.min_fit_samples, self.fit_requirement_reason = self.fit_requirement()
        if self.fitted:
            self._prepare()

    def fit_requirement(self) -> tuple[int, str]:
        """``(minimum number of fitting samples, why)`` for this model and these hyperparameters."""
        return 1, "at least one sample"

    def check_fit_count(self, got: int) -> None:
        """Raise :class:`hf_gsc.detectors.penultimate.NotEnoughSamplesError` below ``min_fit_samples``."""
        check_fit_samples(self.method, got, self.min_fit_samples, self.fit_requirement_reason)

    def check_fit_size(self, num_samples: int, flag: str = "the number of fitting samples") -> None:
        """Refuse, before any image is read, a fit on ``num_samples`` samples that cannot satisfy this method at this
        model's feature width ``D`` and classes ``K`` (the Gaussian family needs ``D + K``, ViM ``D``, KNN ``k``, ...);
        the error names the method, what it needs and ``flag``, the setting that sets the number."""
        if num_samples < self.min_fit_samples:
            raise NotEnoughSamplesError(
                f"detector {self.method!r} needs at least {self.min_fit_samples} ID fitting samples "
                f"({self.fit_requirement_reason}; feature dim {self.feature_dim}, {self.num_classes} classes), got "
                f"{num_samples} from {flag}: give more, or leave {self.method!r} out (refused before reading any image)")

    def fit(self, id_train_batches: Iterable[Any], image_column: str | None = None,
            label_column: str | None = None) -> FittedDetector:
        # Refused before the backbone pass where the number of samples is known without reading them.
        count = known_sample_count(id_train_batches)
        if count is not None:
            self.check_fit_size(count, "the fitting data")
        super().fit(id_train_batches, image_column, label_column)
        return self

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], FitAccumulator]]:
        """``(kind, new accumulator)``: what the fit keeps of each batch. Detectors of one pass with the same kind
        share one accumulator, so a kind must name everything that changes what is kept. Default: every feature and
        label, once (:class:`~hf_gsc.detectors.penultimate.FeatureStore`)."""
        return "features", FeatureStore

    def _accumulator_key(self) -> Hashable:
        kind, _ = self.fit_accumulator()
        return ("fit accumulator", self.split.module_path, self.split.capture_input, kind)

    def fit_begin(self) -> None:
        self._accumulator = None

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        # The CPU feature is memoised on the pass: detectors fitted together read the same tensor.
        features = batch.flat_features(self.split, "cpu")
        if labels is None:
            if self.needs_labels:
                raise ValueError(f"detector {self.method!r} fits per-class statistics and got no labels: pass a "
                                 "class-folder tree whose folder names are the model's labels (config.label2id), a "
                                 "datasets.Dataset with a 'label' column, or (pixel_values, labels) batches")
            labels = torch.zeros(features.shape[0], dtype=torch.long)
        if self._accumulator is None:  # the first pass: take the accumulator the pass's other detectors took
            self._accumulator = batch.memo(self._accumulator_key(), self.fit_accumulator()[1])
        accumulator = self._accumulator
        # Once per pass and accumulator, whichever of its detectors comes first (an update that raises is not
        # memoised: the next detector sharing it raises too).
        batch.memo(("fit accumulated", id(accumulator)), lambda: accumulator.update(features, labels) or True)

    def fit_gather(self, shards: FitShards) -> None:
        # Each accumulator once, by the first of its detectors (every process runs them in the same order): feature
        # stores gather every process's batches in the order of the data; statistics add every process's sums.
        if self._accumulator is None:
            unfed = _UNFED_ACCUMULATORS.setdefault(shards, {})
            self._accumulator = unfed.setdefault(self._accumulator_key(), self.fit_accumulator()[1]())
        if not getattr(self._accumulator, "gathered", False):
            self._accumulator.gather(shards)
            self._accumulator.gathered = True

    def fit_end(self) -> None:
        accumulated, self._accumulator = self._accumulator, None
        self._fit(self.fit_accumulator()[1]() if accumulated is None else accumulated)
        for name in self.state_names:
            setattr(self, name, getattr(self, name).to(self.device))
        self._prepare()
        self.fitted = True

    def _fit(self, accumulated: Any) -> None:
        """Set the fitted state from the accumulator of :meth:`fit_accumulator` (shared: read, never changed)."""
        raise NotImplementedError

    def mean_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        """The accumulator of the methods that centre on the training mean (DICE, NCI, fDBD): float64 sums of every
        sample, labels ignored."""
        return "mean", lambda: StatisticsPass(ClassStatistics(num_classes=1), _unlabelled)

    def moment_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        """The accumulator of the methods that read the mean and covariance of every feature, labels ignored (NECO,
        Residual): float64 sums and the sum of outer products about the first batch's mean, ``D + D^2`` numbers
        whatever ``N``."""
        return "mean and covariance", lambda: StatisticsPass(ClassStatistics(num_classes=1, second_moment=True),
                                                             _unlabelled)

    def mean_feature(self, accumulated: StatisticsPass) -> torch.Tensor:
        """``(D,)`` float64 mean of the ID features of :meth:`mean_accumulator`, every sample counted (the fit count
        checked): the fitted state of the methods that centre on the training mean (DICE, NCI, fDBD)."""
        self.check_fit_count(accumulated.count)
        return accumulated.statistics.class_means(self.method)[0]

    @property
    def feature_dim(self) -> int:
        return self.head.feature_dim

    @property
    def num_classes(self) -> int:
        return self.head.num_classes
