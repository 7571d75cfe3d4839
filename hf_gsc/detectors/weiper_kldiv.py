"""WeiPer+KLD: KL divergence of a sample's densities of its features and of randomly perturbed class projections to
the training set's (Granz, Heurich & Landgraf, NeurIPS 2024)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, integer_check, number_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead


#: ``eps`` of the authors' ``batch_histogram``: the top bin edge is the training maximum plus this (in the features'
#: precision, where it vanishes above ~0.1 in float32: the maximum itself then falls above the last bin).
HISTOGRAM_EPS = 1e-8
#: ``epsilon`` and ``epsilon_noise`` of the authors' ``calculate_WeiPerKLDiv_score``: added to both densities before
#: the divergence of the features' densities and of the perturbed logits' densities.
FEATURE_DENSITY_EPS = 0.01
PERTURBED_DENSITY_EPS = 0.025


def perturbed_head(head: LinearHead, n_repeats: int, distance: float, seed: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' ``calculate_weiper_space`` weights: ``r`` copies of the head, each row ``W_k`` moved by
    ``distance ||W_k|| n / ||n||`` with ``n ~ N(0, I)`` (``F.normalize(torch.randn_like(W))``), repeat after repeat,
    drawn on the CPU from a ``torch.Generator`` seeded with ``seed`` (the authors draw from torch's global generator,
    unseeded); the bias repeated. Returns ``(weight (r K, D), bias (r K,))`` in ``dtype``, on the CPU."""
    weight = head.weight.detach().to("cpu", dtype)
    bias = head.bias.detach().to("cpu", dtype)
    row_norms = weight.norm(dim=1, keepdim=True)
    generator = torch.Generator().manual_seed(seed)
    num_classes = weight.shape[0]
    perturbed = torch.empty(n_repeats * num_classes, weight.shape[1], dtype=dtype)
    for repeat in range(n_repeats):
        noise = torch.nn.functional.normalize(torch.randn(weight.shape, generator=generator, dtype=dtype), dim=1)
        perturbed[repeat * num_classes:(repeat + 1) * num_classes] = weight + distance * noise * row_norms
    return perturbed, bias.repeat(n_repeats)


def histogram_edges(low: torch.Tensor, high: torch.Tensor, n_bins: int, dtype: torch.dtype) -> torch.Tensor:
    """``(n_bins + 1,)`` bin edges from ``low`` to ``high + 1e-8`` as the authors' ``linspace`` computes them: steps
    ``i / n_bins`` rounded to float32, then ``low + step (high + 1e-8 - low)`` in ``dtype``."""
    low, high = low.to(dtype), high.to(dtype) + HISTOGRAM_EPS
    steps = (torch.arange(n_bins + 1, dtype=torch.float32, device=low.device) / n_bins).to(dtype)
    return low + steps * (high - low)


def sample_densities(values: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``(B, n_bins)`` float64: per row of ``values`` ``(B, M)``, the fraction of its ``M`` values in each bin
    ``[e_(j-1), e_j)`` (values outside the edges count in no bin), as the authors' ``batch_histogram`` with
    ``probability=True``."""
    n_bins = edges.shape[0] - 1
    index = torch.bucketize(values.contiguous(), edges.to(values), right=True)  # 0 below, n_bins + 1 at or above
    counts = torch.zeros(values.shape[0], n_bins + 2, dtype=torch.float64, device=values.device)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float64))
    return counts[:, 1:-1] / counts.sum(dim=1, keepdim=True)


def uniform_smoothing(densities: torch.Tensor, size: int) -> torch.Tensor:
    """The authors' ``UniformKernel``: a moving average of ``size`` bins over each row of ``densities`` ``(B, n)``,
    ``padding="same"`` (``(size - 1) // 2`` bins before, the rest after) with the edge bins repeated
    (``padding_mode="replicate"``)."""
    before = (size - 1) // 2
    after = size - 1 - before
    padded = torch.cat([densities[:, :1].expand(-1, before), densities, densities[:, -1:].expand(-1, after)], dim=1)
    return padded.unfold(1, size, 1).mean(dim=-1)


def symmetric_kl(train_density: torch.Tensor, densities: torch.Tensor, eps: float) -> torch.Tensor:
    """``KL(p || q) + KL(q || p)`` per row, ``(B,)``, of ``p = train_density + eps`` and ``q = densities + eps``,
    each normalised to sum to 1 (the authors' ``kldiv``, ``symmetric=True``)."""
    p = train_density.double() + eps
    p = p / p.sum()
    q = densities.double() + eps
    q = q / q.sum(dim=-1, keepdim=True)
    log_ratio = q.log() - p.log()
    return -(p * log_ratio).sum(dim=-1) + (q * log_ratio).sum(dim=-1)


def perturbed_msp(perturbed_logits: torch.Tensor, n_repeats: int) -> torch.Tensor:
    """The maximum softmax probability of each perturbed head, averaged over the ``r`` heads, ``(B,)`` float64."""
    logits = perturbed_logits.double().reshape(perturbed_logits.shape[0], n_repeats, -1)
    return torch.softmax(logits, dim=-1).amax(dim=-1).mean(dim=-1)


@dataclass
class WeiPerKLDivConfig(DetectorConfig):
    """Settings of WeiPer+KLD (:class:`WeiPerKLDivDetector`). Defaults: the authors' ``weiper_kldiv.yml``
    ``postprocessor_args`` (their CIFAR-10 ResNet-18 values); their README lists per model: ImageNet-1K ViT-B/16
    ``perturbation_distance=2.0, n_bins=80, lambda_1=2.5, lambda_2=0.1, smoothing=40, smoothing_perturbed=15``,
    ResNet-50 ``2.4, 100, 2.5, 0.25, 40, 15``."""

    method: ClassVar[str] = "weiper_kldiv"
    #: The perturbed head, the training ranges and densities are fitted; the divergences' weights and smoothing are
    #: read when scoring.
    structural_names: ClassVar[tuple[str, ...]] = ("n_repeats", "perturbation_distance", "n_bins", "seed")
    n_repeats: int = setting(100, integer_check(1), "Perturbed copies of the head, ``r``; 100: weiper_kldiv.yml "
                             "``n_repeats`` (every model in the authors' README).")
    perturbation_distance: float = setting(
        1.8, number_check(0.0, math.inf, low_open=True),
        "Relative length ``delta`` of each row's perturbation (``delta ||W_k||``); 1.8: weiper_kldiv.yml.")
    n_bins: int = setting(100, integer_check(2), "Histogram bins of each density; 100: weiper_kldiv.yml.")
    lambda_1: float = setting(2.5, number_check(0.0, math.inf), "Weight of the perturbed logits' divergence; 2.5: "
                              "weiper_kldiv.yml.")
    lambda_2: float = setting(0.1, number_check(0.0, math.inf), "Weight of the perturbed heads' mean MSP; 0.1: "
                              "weiper_kldiv.yml.")
    smoothing: int = setting(4, integer_check(1), "Moving-average width (bins) of a sample's feature density, ``s_1``; "
                             "4: weiper_kldiv.yml.")
    smoothing_perturbed: int = setting(15, integer_check(1), "Moving-average width (bins) of a sample's perturbed-logit "
                                       "density, ``s_2``; 15: weiper_kldiv.yml.")
    seed: int = setting(0, integer_check(0), "Seed of the perturbations' generator (the authors draw from torch's "
                        "global generator, unseeded); the perturbed head is drawn again from it at load.")


@register_detector
class WeiPerKLDivDetector(FittedDetector):
    """Minus ``KL_s(features) + lambda_1 KL_s(perturbed logits) - lambda_2 mean perturbed MSP``.

    Granz, Heurich, Landgraf, "WeiPer: OOD Detection using Weight Perturbations of Class Projections", NeurIPS 2024.
    Reference: the authors' OpenOOD fork (github.com/mgranz/weiper, ``Weiper/OpenOOD/openood/postprocessors/
    weiper_kldiv_postprocessor.py`` and ``weiper_kldiv/utils.py``; OpenOOD v1.5's main branch has no WeiPer). The head
    ``W`` is repeated ``r`` times, each row moved by ``delta ||W_k||`` in a random direction (:func:`perturbed_head`).
    On the ID training data: the smallest and largest feature value and perturbed logit (over every sample and
    dimension), and the mean over samples of each sample's histogram of its ``D`` features and of its ``r K`` perturbed
    logits between them (:func:`sample_densities`). A sample's score: the symmetric KL divergences of its two
    histograms, each smoothed by a moving average (:func:`uniform_smoothing`) and offset by 0.01 / 0.025, to the
    training means (:func:`symmetric_kl`), and the perturbed heads' mean MSP (:func:`perturbed_msp`).

    Where the code differs from the paper, the code is followed (the smoothing of the sample's density only, the
    offsets), with one exception: the perturbed head is drawn once, at the fit (the paper's ``W~``, and what the
    postprocessor keeps as ``self.W_tilde``), where the code draws a new one for every batch it scores and every
    fitting batch after the first (it passes ``W_tilde=`` to ``calculate_WeiPerKLDiv_score``, whose parameter is
    ``perturbed_fc``, and the keyword is swallowed by ``**params``): its scores would be random and depend on the
    batch. Where the code's results depend on how the data are batched, the batch-free value is taken: the training
    density is the mean over all samples (the authors average per-batch means: the same for batches of equal size),
    and a histogram counts every dimension once (the authors' histogram of more than 1,000 dimensions averages
    per-chunk fractions of 1,000 dimensions, weighting the last, smaller chunk's dimensions more, e.g. ResNet-50's
    2,048 features as 1,000 + 1,000 + 48). The authors choose the settings with OpenOOD's search on OOD validation
    data; the defaults here are their published values, no OOD data is read, and no grid is searched (each grid point
    holds its own ``r K x D`` perturbed head).

    Settings: :class:`WeiPerKLDivConfig`.
    """

    config_class = WeiPerKLDivConfig
    search_space_source = (
        "weiper_kldiv.yml's postprocessor_sweep (lambda_1 [0.1, 1, 2.5, 4] x lambda_2 [0.1, 0.25, 1, 2.5, 5] x n_bins "
        "[60, 80, 100] x perturbation_distance [1.8, 2.0, 2.2, 2.4] x smoothing [4, 8, 12, 20, 40] x "
        "smoothing_perturbed [15, 25, 40]: 3,600 points, each with its own r K x D perturbed head) is not searched")
    state_names = ("feature_range", "perturbed_range", "feature_density", "perturbed_density")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self._check_smoothing()
        # Derived from the seed (not saved: r K D numbers): the perturbed head, on the fitted state's device.
        self.register_buffer("perturbed_weight", None, persistent=False)
        self.register_buffer("perturbed_bias", None, persistent=False)

    def _check_smoothing(self) -> None:
        n_bins = self.hyperparameters["n_bins"]
        for name in ("smoothing", "smoothing_perturbed"):
            if self.hyperparameters[name] > n_bins:
                raise ValueError(f"{self.method}: {name} must be at most n_bins={n_bins}, got "
                                 f"{self.hyperparameters[name]}")

    def settings_changed(self, changed: dict[str, Any]) -> None:
        self._check_smoothing()
        super().settings_changed(changed)

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        n_bins = self.hyperparameters["n_bins"]
        return {"feature_range": (2,), "perturbed_range": (2,), "feature_density": (n_bins,),
                "perturbed_density": (n_bins,)}

    @property
    def _compute_dtype(self) -> torch.dtype:
        return torch.float64 if self.head.weight.dtype == torch.float64 else torch.float32

    def _draw_perturbed_head(self) -> None:
        hp = self.hyperparameters
        weight, bias = perturbed_head(self.head, hp["n_repeats"], hp["perturbation_distance"], hp["seed"],
                                      self._compute_dtype)
        self.perturbed_weight, self.perturbed_bias = weight.to(self.device), bias.to(self.device)

    def _perturbed_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``W~ z + b~`` ``(B, r K)`` on the perturbed head's device (a fitting batch goes there, not the head here)."""
        features = features.to(self.perturbed_weight.device, self._compute_dtype)
        return nn.functional.linear(features, self.perturbed_weight, self.perturbed_bias)

    def _fit(self, accumulated: FeatureStore) -> None:
        # Two readings of the stored features, each batch on the perturbed head's device: the ranges, then (the bins
        # known) the mean densities.
        self.check_fit_count(accumulated.count)
        self._draw_perturbed_head()
        dtype, n_bins, device = self._compute_dtype, self.hyperparameters["n_bins"], self.perturbed_weight.device
        feature_low = perturbed_low = torch.tensor(torch.inf, dtype=dtype, device=device)
        feature_high = perturbed_high = torch.tensor(-torch.inf, dtype=dtype, device=device)
        for features in accumulated.features:
            features = features.to(device, dtype)
            perturbed = self._perturbed_logits(features)
            feature_low, feature_high = torch.minimum(feature_low, features.min()), torch.maximum(feature_high, features.max())
            perturbed_low = torch.minimum(perturbed_low, perturbed.min())
            perturbed_high = torch.maximum(perturbed_high, perturbed.max())
        self.feature_range = torch.stack([feature_low, feature_high]).double().cpu()
        self.perturbed_range = torch.stack([perturbed_low, perturbed_high]).double().cpu()
        feature_edges = histogram_edges(feature_low, feature_high, n_bins, dtype)
        perturbed_edges = histogram_edges(perturbed_low, perturbed_high, n_bins, dtype)
        feature_sum = torch.zeros(n_bins, dtype=torch.float64, device=device)
        perturbed_sum = torch.zeros(n_bins, dtype=torch.float64, device=device)
        for features in accumulated.features:
            features = features.to(device, dtype)
            feature_sum += sample_densities(features, feature_edges).sum(dim=0)
            perturbed_sum += sample_densities(self._perturbed_logits(features), perturbed_edges).sum(dim=0)
        self.feature_density = feature_sum.cpu() / accumulated.count
        self.perturbed_density = perturbed_sum.cpu() / accumulated.count

    def _prepare(self) -> None:
        if self.perturbed_weight is None:  # loaded: drawn again from the seed
            self._draw_perturbed_head()
        self.perturbed_weight = self.perturbed_weight.to(self.device)
        self.perturbed_bias = self.perturbed_bias.to(self.device)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        hp = self.hyperparameters
        features = self.features(batch).to(self._compute_dtype)
        perturbed = self._perturbed_logits(features)
        dtype, n_bins = self._compute_dtype, hp["n_bins"]
        feature_edges = histogram_edges(self.feature_range[0], self.feature_range[1], n_bins, dtype)
        perturbed_edges = histogram_edges(self.perturbed_range[0], self.perturbed_range[1], n_bins, dtype)
        feature_kl = symmetric_kl(self.feature_density, uniform_smoothing(
            sample_densities(features, feature_edges), hp["smoothing"]), FEATURE_DENSITY_EPS)
        perturbed_kl = symmetric_kl(self.perturbed_density, uniform_smoothing(
            sample_densities(perturbed, perturbed_edges), hp["smoothing_perturbed"]), PERTURBED_DENSITY_EPS)
        return -(feature_kl + hp["lambda_1"] * perturbed_kl - hp["lambda_2"] * perturbed_msp(perturbed, hp["n_repeats"]))
