"""Gram: per-layer ranges of p-th order Gram matrices (Sastry & Oore, ICML 2020), as OpenOOD runs it."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..classifier.architectures import encoder_blocks
from ..classifier.split_points import SplitPoint
from ..settings.config import DetectorConfig, choice_check, setting
from ..utils.precision import full_precision
from .backbone_pass import BackbonePass, FitShards
from .common import FittedDetector
from .interface import register_detector
from .penultimate import NotEnoughSamplesError, check_labels


#: Every ``HELD_OUT_EVERY``-th sample of a class (the 10th, 20th, ...) is held out of the ranges and scored against
#: them for the normalisation: OpenOOD holds out ``int(0.1 * L)`` of a class's ``L`` samples, the same count.
HELD_OUT_EVERY = 10

#: The layer sets a Gram detector may read (:func:`gram_layers`).
LAYER_SETS = ("conv_relu", "blocks")


def gram_row_sums(feature: torch.Tensor, power: int) -> torch.Tensor:
    """OpenOOD's ``G_p``: with ``X`` the feature as ``(B, C, S)`` (dimension 1 the channels, the rest flattened) raised
    elementwise to ``power``, the row sums of the Gram matrix ``X X^T``, ``sum_j (X X^T)_ij``, each taken to the
    signed ``1 / power``-th root: ``(B, C)``."""
    return _signed_root(_row_sums(feature.reshape(feature.shape[0], feature.shape[1], -1) ** power), power)


def _row_sums(matrix: torch.Tensor) -> torch.Tensor:
    """``(X X^T) 1`` of each ``(C, S)`` matrix of ``(B, C, S)``, computed as ``X (X^T 1)``, ``O(C S)``, not by forming
    the ``C x C`` Gram matrix (``O(C^2 S)``) as OpenOOD does: the same sums, added in another order (equal up to
    rounding)."""
    return torch.bmm(matrix, matrix.sum(dim=1).unsqueeze(2)).squeeze(2)


def _signed_root(sums: torch.Tensor, power: int) -> torch.Tensor:
    return sums.sign() * sums.abs() ** (1.0 / power)


def gram_values(features: Sequence[torch.Tensor], powers: Sequence[int]) -> torch.Tensor:
    """Every layer's :func:`gram_row_sums` at every power, concatenated layer by layer, power by power:
    ``(B, P sum_l C_l)``, float64. Each feature is widened once, and ``X^(p+1)`` is ``X^p`` times ``X`` where the
    powers follow each other (equal to :func:`gram_row_sums` up to rounding)."""
    values = []
    for feature in features:
        matrix = feature.double().reshape(feature.shape[0], feature.shape[1], -1)
        raised, last = matrix, 1
        for power in powers:
            raised = raised * matrix if power == last + 1 else matrix ** power
            last = power
            values.append(_signed_root(_row_sums(raised), power))
    return torch.cat(values, dim=1)


def range_deviations(values: torch.Tensor, mins: torch.Tensor, maxs: torch.Tensor) -> torch.Tensor:
    """OpenOOD's ``delta`` per coordinate: how far each value lies below its minimum or above its maximum, relative
    to that bound, ``relu(min - x) / |min + 1e-6| + relu(x - max) / |max + 1e-6|`` (``(B, V)``; ``mins`` and
    ``maxs`` ``(B, V)`` or ``(V,)``)."""
    return (torch.relu(mins - values) / (mins + 1e-6).abs()) + (torch.relu(values - maxs) / (maxs + 1e-6).abs())


def layer_sums(values: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
    """``(B, sum widths) -> (B, len(widths))``: the sum of each consecutive group of ``widths`` columns."""
    return torch.stack([part.sum(dim=1) for part in values.split(list(widths), dim=1)], dim=1)


def _module_paths(model: nn.Module, modules: Sequence[nn.Module]) -> list[str]:
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}
    return [names[id(module)] for module in modules]


def gram_layers(model: nn.Module, layer_set: str) -> list[SplitPoint]:
    """Where the Gram matrices are read, as capture points of the shared backbone pass.

    ``conv_relu``: the output of every ``nn.Conv2d`` and ``nn.ReLU`` module (OpenOOD's ``FeatureExtractor``, after
    the Gram authors' ``gram-ood``); ``blocks``: the input of the encoder's first block and each block's output
    (:func:`hf_gsc.classifier.architectures.encoder_blocks`, as ``mds_ensemble`` reads them).

    Raises:
        ValueError: the model has no such layer (a transformer has no ``nn.ReLU``; a timm model exposes no list of
            encoder blocks here), naming what was looked for.
    """
    if layer_set == "blocks":
        try:
            blocks = list(encoder_blocks(model, "gram"))
        except ValueError as error:
            raise ValueError(f"gram with layer_set='blocks' reads the encoder's blocks: {error}; layer_set='conv_relu' "
                             "reads the nn.Conv2d and nn.ReLU modules instead") from None
        targets = [(blocks[0], True)] + [(block, False) for block in blocks]
    else:
        modules = [module for module in model.modules() if isinstance(module, (nn.Conv2d, nn.ReLU))]
        if not modules:
            raise ValueError(f"gram with layer_set='conv_relu' reads the outputs of the nn.Conv2d and nn.ReLU modules, "
                             f"and {type(model).__name__} has none")
        targets = [(module, False) for module in modules]
    paths = _module_paths(model, [module for module, _ in targets])
    return [SplitPoint(model, f"{path} ({'input' if capture_input else 'output'})", path, capture_input,
                       head_is_linear=False) for path, (_, capture_input) in zip(paths, targets)]


def _powers(name: str, value: Any) -> Any:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value) or len(set(value)) != len(value):
        raise ValueError(f"{name} must be a non-empty list of distinct positive integers (the orders p of the Gram "
                         f"matrices), got {value!r}")
    return tuple(value)


@dataclass
class GramConfig(DetectorConfig):
    """Settings of the Gram-matrix detector (:class:`GramDetector`)."""

    method: ClassVar[str] = "gram"
    powers: tuple[int, ...] = setting(
        (1, 2, 3, 4, 5), _powers,
        "The orders p of the Gram matrices; [1, 2, 3, 4, 5]: OpenOOD gram.yml ``postprocessor_args.powers`` (the "
        "paper uses 1 to 10).")
    layer_set: str = setting(
        "conv_relu", choice_check(LAYER_SETS),
        "Which feature maps are read (:func:`gram_layers`): ``conv_relu``, the output of every nn.Conv2d and "
        "nn.ReLU module (OpenOOD's gram_postprocessor.py, its FeatureExtractor); ``blocks``, the input of the "
        "encoder's first block and each block's output (the layers ``mds_ensemble`` reads; OpenOOD's earlier Gram "
        "code read a ResNet's stem and stage outputs, the last one average-pooled).")


class GramRanges:
    """What a Gram fit keeps: per class the running minimum and maximum of every Gram value over the samples not
    held out (``2 K V`` numbers whatever ``N``), and of the held-out samples (every :data:`HELD_OUT_EVERY`-th sample
    of each class in the order of the data) only the values outside their class's range so far.

    A held-out value inside the range of the samples seen so far stays inside the final range (ranges only widen),
    so its deviation is 0 and it is not kept: each batch keeps ``(class, column, value)`` of its held-out values
    outside the range, one entry tensor per batch (on i.i.d. data, about ``0.2 ln(N_k / 10)`` entries per class and
    value, ``N_k`` that class's samples), and the held-out count."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.mins: torch.Tensor | None = None
        self.maxs: torch.Tensor | None = None
        self.class_counts = torch.zeros(num_classes, dtype=torch.long)
        self.held_out_count = 0
        self.entries: list[torch.Tensor] = []  # per batch (E, 2) long: class, column
        self.entry_values: list[torch.Tensor] = []  # per batch (E,) the values
        self.channels: list[int] = []  # C_l of each layer read
        self.batches = 0

    @property
    def count(self) -> int:
        return int(self.class_counts.sum())

    def update(self, values: torch.Tensor, labels: torch.Tensor, channels: list[int]) -> None:
        check_labels(labels, self.num_classes)
        self.channels = channels
        one_hot = torch.nn.functional.one_hot(labels, self.num_classes)
        # Each sample's position among its class's samples so far, in the order of the data.
        position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1) - 1 + self.class_counts[labels]
        self.class_counts += one_hot.sum(dim=0)
        held = position % HELD_OUT_EVERY == HELD_OUT_EVERY - 1
        kept, kept_labels = values[~held], labels[~held]
        if self.mins is None or self.maxs is None:
            self.mins = torch.full((self.num_classes, values.shape[1]), torch.inf, dtype=values.dtype)
            self.maxs = torch.full((self.num_classes, values.shape[1]), -torch.inf, dtype=values.dtype)
        index = kept_labels[:, None].expand_as(kept)
        self.mins.scatter_reduce_(0, index, kept, "amin")
        self.maxs.scatter_reduce_(0, index, kept, "amax")
        # The held-out values outside their class's range so far (this batch's kept samples included: a held-out
        # sample follows at least nine of its class, so the range exists).
        held_values, held_labels = values[held], labels[held]
        outside = (held_values < self.mins[held_labels]) | (held_values > self.maxs[held_labels])
        rows, columns = outside.nonzero(as_tuple=True)
        self.entries.append(torch.stack([held_labels[rows], columns], dim=1))
        self.entry_values.append(held_values[rows, columns])
        self.held_out_count += int(held.sum())
        self.batches += 1

    def held_out_deviation_sums(self, widths: Sequence[int]) -> torch.Tensor:
        """``(L,)``: per layer (``widths`` its columns), the sum over the held-out samples of their deviation from
        their class's final range (:func:`range_deviations`; a value not kept lies inside and adds 0)."""
        if self.mins is None or self.maxs is None:
            raise RuntimeError("gram: no ranges were fitted")
        entries, values = torch.cat(self.entries), torch.cat(self.entry_values)
        classes, columns = entries[:, 0], entries[:, 1]
        deviations = range_deviations(values, self.mins[classes, columns], self.maxs[classes, columns])
        per_column = torch.zeros(self.mins.shape[1], dtype=deviations.dtype).index_add_(0, columns, deviations)
        return layer_sums(per_column[None], widths)[0]

    def gather(self, shards: FitShards) -> None:
        """Every process's ranges and held-out entries (each process holds out every tenth of each class in its own
        share). The ranges go through ``shards.batches`` as this process's first batch (its other batches empty),
        since a minimum is not a sum."""
        self.entries = shards.batches(self.entries)
        self.entry_values = shards.batches(self.entry_values)
        counts = shards.sum(torch.cat([self.class_counts.double(), torch.tensor([float(self.held_out_count)],
                                                                                 dtype=torch.float64)]))
        if counts is not None:
            self.class_counts, self.held_out_count = counts[:-1].round().long(), int(round(float(counts[-1])))
        every = self._first_batch_only(shards, None if self.mins is None or self.maxs is None
                                       else torch.stack([self.mins, self.maxs]))
        if every:
            stacked = torch.stack(every)
            self.mins, self.maxs = stacked[:, 0].amin(dim=0), stacked[:, 1].amax(dim=0)
        channels = self._first_batch_only(shards, torch.tensor(self.channels, dtype=torch.float64)
                                          if self.channels else None)
        if channels:
            self.channels = [int(width) for width in channels[0].tolist()]

    def _first_batch_only(self, shards: FitShards, local: torch.Tensor | None) -> list[torch.Tensor]:
        """Every process's ``local`` (where it has one): passed to ``shards.batches`` as this process's first batch,
        its other batches empty."""
        rows = [] if local is None else [local[None]] + [local[None][:0]] * (self.batches - 1)
        return [part[0] for part in shards.batches(rows) if part.shape[0]]


@register_detector
class GramDetector(FittedDetector):
    """``-(sum_l delta_l(x) / n_l) / MSP(x)``: the deviation of the input's Gram values from the ranges its predicted
    class had on the ID training data, summed over layers (each normalised by its mean deviation on held-out ID
    samples) and divided by the maximum softmax probability.

    Sastry, Oore, "Detecting Out-of-Distribution Examples with Gram Matrices", ICML 2020. The reference is OpenOOD's
    ``openood/postprocessors/gram_postprocessor.py`` as the paper's first author rewrote it (``G_p``, ``delta``,
    ``sample_estimator``, ``get_deviations``) with ``configs/postprocessors/gram.yml``: for each read layer ``l``
    and power ``p``, the Gram values are :func:`gram_row_sums`; per class, their minimum and maximum over the ID
    training samples of that class (true labels) but a held-out tenth; ``delta_l(x)`` sums over the powers and
    channels :func:`range_deviations` against the ranges of the predicted class (argmax of the logits); ``n_l`` is
    the mean ``delta_l`` of the held-out samples against their own class's ranges. The layers are every
    ``nn.Conv2d`` and ``nn.ReLU`` output (OpenOOD's ``FeatureExtractor``) or, with ``layer_set='blocks'``, the
    encoder's blocks (:func:`gram_layers`).

    Where the code differs from the paper, this follows the code: the paper keeps the upper triangle of each Gram
    matrix and normalises each layer's deviation by its expectation on ID validation data; the code keeps each row's
    sum (``C`` values per layer and power instead of ``C (C + 1) / 2``), holds out a tenth of the training data for
    the normalisation (no OOD data), and divides the total by the MSP. Where this differs from the code: OpenOOD
    draws the held-out tenth at random (``random.sample``, unseeded); here it is every tenth sample of each class in
    the order of the data (the same count, ``int(0.1 L)`` of a class's ``L``), so that a fit is reproducible; on
    several processes, every tenth of each process's share. A module run twice in one forward (one activation module
    shared by two places) is read at its first run, where OpenOOD's hooks append every run: torchvision's Bottleneck
    runs its one ReLU module three times, while transformers' and timm's ResNets have a module per activation, each
    read. The Gram values and
    deviations are computed in float64.

    Cost: one pass (the layers are captured in the shared forward), then per layer and power ``O(C S)`` for the row
    sums. The fit keeps per class the ranges, ``2 K P sum_l C_l`` float64 numbers (3.9 GB for ResNet-50's 102
    ``conv_relu`` layers, ``sum_l C_l = 49,280``, at ``K = 1000`` and five powers: the saved state), and of the
    held-out tenth only the values outside their class's range so far (:class:`GramRanges`). On a transformer,
    ``conv_relu`` reads the patch embedding's convolution only (its activations are GELUs); ``blocks`` reads its
    tokens ``(B, T, D)`` with the tokens as the channels, as OpenOOD's reshape of dimension 1 would.

    Settings: :class:`GramConfig`.
    """

    config_class = GramConfig
    search_space_source = "OpenOOD gram.yml postprocessor_sweep: powers_list [[1, 2, 3, 4, 5]] (one value)"
    reads_logits = True
    needs_labels = True
    #: What it reads, for the method table: its layers are capture points of the shared pass, no head after them.
    reads_description: ClassVar[str] = ("logits, the output of every `nn.Conv2d` and `nn.ReLU` module (`layer_set=blocks`: "
                                        "the encoder blocks' input and outputs)")
    #: ``mins`` / ``maxs`` ``(K, V)`` per class; ``normalizers`` ``(L,)`` each layer's ``n_l``; ``widths`` ``(L,)``
    #: the channels of each layer, ``fitted_powers`` the powers (both checked at load).
    state_names = ("mins", "maxs", "normalizers", "widths", "fitted_powers")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self.layer_splits = tuple(gram_layers(self.model, self.hyperparameters["layer_set"]))
        self._column_widths: list[int] = []

    def feature_splits(self) -> tuple[SplitPoint, ...]:
        return self.layer_splits

    def fit_requirement(self) -> tuple[int, str]:
        return (max(self.num_classes, HELD_OUT_EVERY),
                f"a sample of every class, and {HELD_OUT_EVERY} of one class (every {HELD_OUT_EVERY}th of a class is "
                "held out for the normalisation)")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        layers = len(self.layer_splits)
        return {"mins": (self.num_classes, None), "maxs": (self.num_classes, None), "normalizers": (layers,),
                "widths": (layers,), "fitted_powers": (len(self.hyperparameters["powers"]),)}

    def _values(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        with full_precision(features[0].device), torch.no_grad():
            return gram_values(features, self.hyperparameters["powers"])

    # ------------------------------------------------------------------ fitting
    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        if labels is None:
            raise ValueError("detector 'gram' fits per-class ranges and got no labels: pass a class-folder tree whose "
                             "folder names are the model's labels (config.label2id), a datasets.Dataset with a "
                             "'label' column, or (pixel_values, labels) batches")
        if self._accumulator is None:
            self._accumulator = GramRanges(self.num_classes)
        features = [batch.features(split) for split in self.layer_splits]
        self._accumulator.update(self._values(features).cpu(), labels, [int(f.shape[1]) for f in features])

    def fit_gather(self, shards: FitShards) -> None:
        if self._accumulator is None:  # an empty share: the other processes' parts
            self._accumulator = GramRanges(self.num_classes)
        self._accumulator.gather(shards)

    def _fit(self, accumulated: GramRanges) -> None:
        self.check_fit_count(accumulated.count)
        empty = (accumulated.class_counts == 0).nonzero().flatten().tolist()
        if empty or accumulated.mins is None or accumulated.maxs is None:
            raise NotEnoughSamplesError(f"detector 'gram' needs at least one ID training sample of every class (its "
                                        f"Gram ranges); classes {empty} have none")
        if not accumulated.held_out_count:
            raise NotEnoughSamplesError(f"detector 'gram' holds out every {HELD_OUT_EVERY}th sample of a class for "
                                        f"its normalisation, and no class has {HELD_OUT_EVERY} samples")
        powers = len(self.hyperparameters["powers"])
        normalizers = (accumulated.held_out_deviation_sums([powers * channels for channels in accumulated.channels])
                       / accumulated.held_out_count)
        constant = (normalizers == 0).nonzero().flatten().tolist()
        if constant:
            # OpenOOD divides by n_l whatever it is (0 / 0 and x / 0 give NaN and infinite scores); such a layer is
            # left out of the sum instead (its n_l saved as 0), and said.
            names = [self.layer_splits[index].module_path for index in constant]
            warnings.warn(f"gram: no held-out ID sample leaves the training ranges at {len(names)} layers {names}, "
                          "so their normalisation (the mean held-out deviation) is 0; they are left out of the score",
                          UserWarning, stacklevel=2)
        self.mins, self.maxs, self.normalizers = accumulated.mins, accumulated.maxs, normalizers
        self.widths = torch.tensor([float(channels) for channels in accumulated.channels], dtype=torch.float64)
        self.fitted_powers = torch.tensor([float(power) for power in self.hyperparameters["powers"]],
                                          dtype=torch.float64)

    def _prepare(self) -> None:
        fitted = [int(power) for power in self.fitted_powers.tolist()]
        if fitted != list(self.hyperparameters["powers"]):
            raise ValueError(f"gram: the ranges were fitted at powers {fitted}, not "
                             f"{list(self.hyperparameters['powers'])}; load it with the powers it was fitted at, or "
                             "fit a new detector")
        powers = len(fitted)
        if int(self.widths.sum()) * powers != self.mins.shape[1] or self.maxs.shape != self.mins.shape:
            raise ValueError(f"gram: the saved layer widths {[int(w) for w in self.widths.tolist()]} at {powers} "
                             f"powers do not match the ranges {tuple(self.mins.shape)} and {tuple(self.maxs.shape)}")
        # Each layer's columns (P C_l), read once here: no host read in the forward.
        self._column_widths = [powers * int(width) for width in self.widths.tolist()]

    # ------------------------------------------------------------------ scoring
    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """The Gram values, deviations and softmax in float64 with autocast off."""
        with full_precision(batch.pixel_values.device), torch.no_grad():
            values = self._values([batch.features(split) for split in self.layer_splits]).to(self.mins.device)
            if values.shape[1] != self.mins.shape[1]:
                raise ValueError(f"gram: the layers read give {values.shape[1]} Gram values per sample, the fitted "
                                 f"ranges {self.mins.shape[1]}: load it with the layer_set it was fitted with")
            probabilities = batch.model_logits().double().softmax(dim=1).to(values.device)
            confidence, predicted = probabilities.max(dim=1)
            deviations = layer_sums(range_deviations(values, self.mins.double()[predicted],
                                                     self.maxs.double()[predicted]), self._column_widths)
            normalizers = self.normalizers.double()
            # A layer whose held-out deviation was 0 is left out (see _fit).
            weights = torch.where(normalizers > 0, 1.0 / normalizers, torch.zeros_like(normalizers))
            return -(deviations * weights).sum(dim=1) / confidence
