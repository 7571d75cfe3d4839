"""Plumbing shared by the baseline detectors: hyperparameter defaults, logits, penultimate features, fitted state.

* :class:`BaselineDetector`: the settings are the fields of the method's ``config_class`` (a
  :class:`~hf_gsc.settings.config.DetectorConfig` subclass written in the method's file); unknown names raise, naming the
  nearest known one.
* :class:`TemperatureLogitDetector`: a score of the logits at a temperature (MSP, Energy).
* :class:`PenultimateDetector`: reads the penultimate feature ``z`` (input of the last ``nn.Linear``, ``(B, D)``)
  from the shared backbone pass, and holds the linear head (:class:`hf_gsc.detectors.penultimate.LinearHead`).
* :class:`FittedDetector`: ``fit_update`` takes ``(features, labels)`` batches (the pass's penultimate feature,
  on the CPU, shared by every detector fitted in that pass); ``fit_end`` hands them to ``_fit``. The fitted tensors
  are the registered buffers named in ``state_names``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import torch
from torch import nn

from .backbone_pass import BackbonePass, FitShards
from ..settings.config import MIN_TEMPERATURE, DetectorConfig, ReadOnlyDict, number_check, setting
from .penultimate import ClassStatistics, LinearHead, check_fit_samples, linear_head, penultimate_split
from ..utils.scores import ood_score
from ..classifier.split_points import SplitPoint
from .interface import OODDetector


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

    score_name: ClassVar[str]
    search_space = {"temperature": (1.0, 10.0, 100.0, 1000.0)}
    search_space_source = ("OpenOOD's earlier ebo.yml temperature list [1, 10, 100, 1000] (it now lists [1]; OpenOOD "
                           "sweeps no temperature for MSP or MaxLogit); costs nothing extra")
    reads_logits = True

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return ood_score(batch.model_logits(), self.score_name, self.hyperparameters["temperature"])


class PenultimateDetector(BaselineDetector):
    """A detector on the penultimate feature ``z`` ``(B, D)`` and the linear head ``W z + b``."""

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


class FittedDetector(PenultimateDetector):
    """A penultimate-feature detector with statistics fitted on ID data.

    Subclasses implement ``_fit(stream)``, which consumes ``(features (B, D), labels (B,))`` batches once, checks
    the count with :meth:`check_fit_count` and sets the buffers named in ``state_names``; ``_prepare()`` derives
    anything else from them (it also runs after loading); ``expected_state()`` gives their shapes, checked at load.
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
        self._fit_batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

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

    def fit_begin(self) -> None:
        self._fit_batches = []

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        # The CPU copy is memoised on the pass: detectors fitted together hold the same tensors.
        features = batch.flat_features(self.split, "cpu")
        if labels is None:
            if self.needs_labels:
                raise ValueError(f"detector {self.method!r} fits per-class statistics and got no labels: pass a "
                                 "class-folder tree whose folder names are the model's labels (config.label2id), a "
                                 "datasets.Dataset with a 'label' column, or (pixel_values, labels) batches")
            labels = torch.zeros(features.shape[0], dtype=torch.long)
        self._fit_batches.append((features, labels))

    def fit_gather(self, shards: FitShards) -> None:
        # Every process's (features, labels) batches, in the order of the data and with the same batch boundaries as
        # on one process, so that ``_fit`` (streamed float64 sums, banks, percentiles) sees what one process sees.
        # The features' list is the same objects for every detector of the pass: gathered once, shared.
        batches = self._fit_batches or []
        features = shards.batches([features for features, _ in batches])
        labels = shards.batches([labels for _, labels in batches])
        self._fit_batches = list(zip(features, labels))

    def fit_end(self) -> None:
        stream, self._fit_batches = self._fit_batches or [], None
        self._fit(iter(stream))
        for name in self.state_names:
            setattr(self, name, getattr(self, name).to(self.device))
        self._prepare()
        self.fitted = True

    def _fit(self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise NotImplementedError

    def mean_feature(self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """``(D,)`` float64 mean of the streamed ID features, every sample counted (the fit count checked): the
        fitted state of the methods that centre on the training mean (DICE, NCI, fDBD)."""
        statistics = ClassStatistics(num_classes=1)
        for features, _ in stream:
            statistics.update(features, torch.zeros(features.shape[0], dtype=torch.long))
        self.check_fit_count(statistics.count)
        return statistics.class_means(self.method)[0]

    @property
    def feature_dim(self) -> int:
        return self.head.feature_dim

    @property
    def num_classes(self) -> int:
        return self.head.num_classes
