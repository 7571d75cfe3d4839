"""AdaSCALE: adaptive activation scaling (Regmi, 2025), variants A (activation) and L (logit)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, integer_check, number_check, setting
from ..utils.feature_capture import capture
from ..utils.precision import full_precision, parameter_dtype, step_dtype
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass, FitShards
from .common import FittedDetector
from .interface import register_detector
from .penultimate import LinearHead


#: OpenOOD adascale_a.yml / adascale_l.yml ``percentile_list``: every pair ``[low, high]`` of 60, 65, ..., 95, 99.
PERCENTILE_PAIRS: tuple[tuple[float, float], ...] = tuple(
    (float(low), float(high)) for index, low in enumerate((60, 65, 70, 75, 80, 85, 90, 95, 99))
    for high in (60, 65, 70, 75, 80, 85, 90, 95, 99)[index + 1:])


def adascale_perturb(pixel_values: torch.Tensor, gradient: torch.Tensor, fraction: float) -> torch.Tensor:
    """``x + 0.5 sign(g)`` on the ``int(C H W o)`` pixels with the *smallest* ``|g|`` of each sample, ``g`` the
    gradient of its predicted logit; the other pixels unchanged (the authors' ``perturb``). ``(B, C, H, W)``."""
    batch = pixel_values.shape[0]
    flat = gradient.abs().reshape(batch, -1)
    count = int(flat.shape[1] * fraction)
    mask = torch.zeros_like(flat).scatter_(1, flat.topk(count, dim=1, largest=False).indices, 1.0)
    return pixel_values + gradient.sign() * mask.view_as(gradient) * 0.5


def shift_statistic(features: torch.Tensor, perturbed: torch.Tensor, k1: int, k2: int, lmbda: float) -> torch.Tensor:
    """``Q' = sum_{top-k1 of z} relu(z_p) + lambda sum_{top-k2 of z} |z - z_p|``: how much the largest activations
    move under the perturbation (the authors' ``get_percentile``); ``(B, D), (B, D) -> (B,)``."""
    top1 = features.topk(k1, dim=1).indices
    top2 = features.topk(k2, dim=1).indices
    return perturbed.relu().gather(1, top1).sum(dim=1) + lmbda * (features - perturbed).abs().gather(1, top2).sum(dim=1)


def adaptive_percentiles(statistic: torch.Tensor, reference: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``low + (1 - ECDF(Q')) (high - low)`` per sample, the ECDF that of ``reference`` (sorted ``(M,)``, the ID
    fitting samples' ``Q'``; statsmodels' ``ECDF``: the fraction of ``reference`` at or below ``Q'``)."""
    below = torch.searchsorted(reference.contiguous(), statistic.to(reference.dtype).contiguous(), right=True)
    return low + (1.0 - below.to(reference.dtype) / reference.numel()) * (high - low)


def ada_scale(features: torch.Tensor, percentiles: torch.Tensor) -> torch.Tensor:
    """``s1 / s2`` per sample: the sum of ``relu(z)`` over the sum of its ``k = n - round(n p / 100)`` largest
    values, ``p`` the sample's percentile (the authors' ``ada_scale`` on ``relu(feature)``); ``(B, D) -> (B, 1)``.

    ``k`` is computed in float64 whatever the features' dtype: the authors' percentiles come from numpy (float64),
    and a float32 ``p`` can move ``n p / 100`` across a rounding boundary (``k`` one off)."""
    activations = features.relu()
    n = activations.shape[1]
    keep = n - torch.round(n * percentiles.to(torch.float64) / 100.0).to(torch.long)
    values = activations.topk(int(keep.max()), dim=1).values
    kept = values * (torch.arange(values.shape[1], device=values.device)[None, :] < keep[:, None])
    return activations.sum(dim=1, keepdim=True) / kept.sum(dim=1, keepdim=True)


def adascale_logits(features: torch.Tensor, head: LinearHead, scale: torch.Tensor, logit_scaling: bool) -> torch.Tensor:
    """AdaSCALE-A: ``W (z exp(s)) + b``; AdaSCALE-L: ``(W z + b) s^2`` (the authors' ``forward_threshold``)."""
    if logit_scaling:
        return head(features) * scale ** 2.0
    return head(features * torch.exp(scale))


def _percentile_pair(name: str, value: Any) -> Any:
    """A pair ``[low, high]`` with ``0 < low <= high < 100``, held as a tuple of floats (saved as a JSON list): a
    setting is changed by assigning it, which the detector sees, never by editing it in place, which it would not."""
    if (not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
            or not 0 < value[0] <= value[1] < 100):
        raise ValueError(f"{name} must be a pair [low, high] with 0 < low <= high < 100, got {value!r}")
    return (float(value[0]), float(value[1]))


@dataclass
class AdaSCALEConfig(DetectorConfig):
    """Settings of adaptive activation scaling, shared by its two variants (:class:`AdaSCALEDetector`); every
    default is OpenOOD adascale_*.yml ``postprocessor_args``."""

    percentile: tuple[float, float] = setting(
        (75.0, 85.0), _percentile_pair,
        "The range ``[p_min, p_max]`` of the adaptive percentile; ``[75, 85]``: OpenOOD adascale_*.yml (the yml "
        "notes ``[80, 85]`` as best for ResNet-50).")
    k1: float = setting(5.0, number_check(0.0, 100.0),
                        "% of the feature coordinates of the correction term ``C_o``; 5: the same yml.")
    k2: float = setting(1.0, number_check(0.0, 100.0), "% of the feature coordinates of the shift ``Q``; 1: the same yml.")
    lmbda: float = setting(10.0, number_check(0.0, math.inf), "Weight ``lambda`` of ``C_o`` in ``Q'``; 10: the same yml.")
    o: float = setting(0.05, number_check(0.0, 1.0),
                       "Fraction of pixels perturbed; 0.05: the same yml (the step 0.5 is fixed in the code).")
    num_samples: int = setting(5000, integer_check(1), "Fitting samples kept for the ECDF; 5000: the same yml.")


@dataclass
class AdaSCALEAConfig(AdaSCALEConfig):
    """Settings of AdaSCALE-A (:class:`AdaSCALEADetector`)."""

    method: ClassVar[str] = "adascale_a"


@dataclass
class AdaSCALELConfig(AdaSCALEConfig):
    """Settings of AdaSCALE-L (:class:`AdaSCALELDetector`)."""

    method: ClassVar[str] = "adascale_l"


class AdaSCALEDetector(FittedDetector):
    """Energy of the logits after a per-sample SCALE whose percentile adapts to how much the sample's largest
    activations move when a few of its least salient pixels are perturbed.

    Regmi, "AdaSCALE: Adaptive Scaling for OOD Detection", 2025; the reference is OpenOOD v1.5's
    ``adascale_postprocessor.py`` and ``networks/adascale_net.py`` (the authors' implementation). Per sample:

    1. ``g`` = gradient of the predicted logit w.r.t. the input; the ``o`` fraction of pixels with the smallest
       ``|g|`` move by ``0.5 sign(g)`` (:func:`adascale_perturb`, in normalised pixel units as in the code);
    2. ``Q'`` (:func:`shift_statistic`) from the penultimate features of the input and the perturbed input, with
       ``k1 = int(D k1% / 100)`` and ``k2 = int(D k2% / 100)`` of the ``D`` feature coordinates;
    3. its percentile is ``low + (1 - ECDF(Q')) (high - low)``, the ECDF that of the ID fitting samples' ``Q'``;
    4. SCALE at that percentile on ``relu(z)`` (:func:`ada_scale`), then the energy of :func:`adascale_logits`.

    Fitting (ID validation, as the authors' ``setup`` on ``id_loader_dict['val']``): the ``Q'`` of the fitting
    samples, kept sorted (``M`` values). The authors keep ``num_samples`` rows drawn with an unseeded
    ``torch.randperm``; here the draw is seeded (0), so a fit is reproducible. The authors fit the features and
    compute ``Q'`` from them for each grid point (``set_hyperparam``); here ``Q'`` is computed at fit time, which
    is the same numbers (``Q'`` of a sample depends on nothing else in the fit).

    Cost: a forward with gradient, a backward and a second forward of its own per batch, like ODIN
    (``one_pass = False``). They run in float32 with autocast off (:mod:`hf_gsc.utils.precision`), so
    ``--mixed-precision`` keeps the step, and the ``Q'`` of a fit matches that of scoring. Their result is kept on
    the batch's pass, keyed on ``o``: AdaSCALE-A and -L, and every percentile of a tuning grid, share it, so the
    first AdaSCALE detector scored on a batch carries the cost in per-method timings and the others almost none.
    Where ``int(D k / 100)`` is 0 (features narrower than 20 coordinates at ``k1 = 5``) the authors' code sums
    over no coordinate, and so does this.

    Names of ``k1`` and ``k2``: as in OpenOOD's code and yml, ``k1`` counts the coordinates of the correction term
    ``C_o`` (the perturbed activations) and ``k2`` those of the shift ``Q``. The paper names them the other way
    round (``Q`` over the top ``k1 = 1%``, ``C_o`` over the top ``k2 = 5%``): the same numbers at the defaults. The
    authors' own repository (github.com/sudarshanregmi/AdaSCALE, commit 61e23f8, "swap k1<=>k2 to ensure
    consistency with paper") renamed them in its yml (``k1: 1, k2: 5``) and in ``set_hyperparam`` (the fit) but not
    in ``get_percentile`` (scoring), so there the fitted ECDF is that of ``C_o`` over 5% and ``Q`` over 1% while a
    scored sample's ``Q'`` takes ``C_o`` over 1% and ``Q`` over 5%; that mismatch is not reproduced here (OpenOOD,
    the reference, uses one ``Q'`` for both). That repository also fixes ``p_min = 60`` and tunes ``p_max`` only
    (its README; 8 of OpenOOD's 36 pairs).

    Settings: :class:`AdaSCALEConfig` (``AdaSCALEAConfig``, ``AdaSCALELConfig``, one per variant).
    """

    search_space = {"percentile": PERCENTILE_PAIRS}
    search_space_source = ("OpenOOD adascale_a.yml / adascale_l.yml: percentile_list, every pair of [60, 65, 70, 75, "
                           "80, 85, 90, 95, 99] (k1 [5], k2 [1], lmbda [10], o [0.05] fixed there)")
    fit_split = "validation"
    one_pass = False  # a forward with gradient, a backward and a perturbed forward of its own per batch
    state_names = ("reference_statistic",)
    logit_scaling: ClassVar[bool]

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self._fit_statistics: list[torch.Tensor] = []

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"reference_statistic": (None,)}

    def feature_splits(self) -> tuple:
        """Nothing from the shared pass: every feature comes from the method's own forwards (its pixel values)."""
        return ()

    # ------------------------------------------------------------------ the perturbation and Q'
    def _features_with_gradient(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``z`` of ``pixel_values`` with its graph to the input (the base model's own forward, fed in its dtype)."""
        features = capture(lambda: self.model(pixel_values=pixel_values.to(parameter_dtype(self.model))),
                           self.model.get_submodule(self.split.module_path), module_input=True)
        if features is None:
            raise RuntimeError(f"the forward pass never reached the split point {self.split.module_path!r}")
        return features.flatten(1).to(pixel_values.dtype)

    def _perturbed_pair(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z, z_p)``, each ``(B, D)`` without gradient: the features of ``pixel_values`` and of their
        perturbation; the forward with gradient, the backward and the perturbed forward, all in float32 or wider
        with autocast off."""
        with full_precision(pixel_values.device):
            inputs = pixel_values.detach().to(step_dtype(pixel_values.dtype))
            with torch.inference_mode(False), torch.enable_grad():
                # clone(): tensors made under inference mode cannot be saved for backward.
                inputs = inputs.clone().requires_grad_(True)
                features = self._features_with_gradient(inputs)
                logits = features @ self.head_weight.to(features.dtype).T + self.head_bias.to(features.dtype)
                # One backward of the summed predicted logits gives each sample's own gradient (the authors'
                # score.backward(ones)): the model is in eval mode, so samples do not interact.
                predicted_logit = logits.gather(1, logits.detach().argmax(dim=1, keepdim=True)).sum()
                (gradient,) = torch.autograd.grad(predicted_logit, inputs)
            perturbed_inputs = adascale_perturb(inputs.detach(), gradient, self.hyperparameters["o"])
            with torch.no_grad():
                perturbed = self._features_with_gradient(perturbed_inputs)
        return features.detach(), perturbed

    def _features_and_statistic(self, batch: BackbonePass) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z (B, D), Q' (B,))`` of a batch. ``(z, z_p)`` depend on the model and ``o`` only, so they are kept on
        the pass (:meth:`~hf_gsc.detectors.backbone_pass.BackbonePass.memo`): both variants and every grid point of a tuning
        run with the same ``o`` share one gradient step and one perturbed forward per batch."""
        hp = self.hyperparameters
        features, perturbed = batch.memo(("adascale_perturbation", self.split.module_path, float(hp["o"])),
                                         lambda: self._perturbed_pair(batch.pixel_values))
        dim = features.shape[1]
        with full_precision(features.device):
            statistic = shift_statistic(features, perturbed, int(dim * hp["k1"] / 100), int(dim * hp["k2"] / 100),
                                        hp["lmbda"])
        return features, statistic

    # ------------------------------------------------------------------ fitting: the ID samples' Q'
    def fit_begin(self) -> None:
        self._fit_statistics = []

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        self._fit_statistics.append(self._features_and_statistic(batch)[1].double().cpu())

    def fit_gather(self, shards: FitShards) -> None:
        # In the order of the data: the seeded draw of num_samples rows then picks the rows one process would.
        self._fit_statistics = shards.batches(self._fit_statistics or [])

    def fit_end(self) -> None:
        statistics, self._fit_statistics = torch.cat(self._fit_statistics or [torch.empty(0)]), []
        self.check_fit_count(statistics.numel())
        if statistics.numel() > self.hyperparameters["num_samples"]:
            order = torch.randperm(statistics.numel(), generator=torch.Generator().manual_seed(0))
            statistics = statistics[order[: self.hyperparameters["num_samples"]]]
        self.reference_statistic = statistics.sort().values.to(self.device)
        self.fitted = True

    # ------------------------------------------------------------------ scoring
    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features, statistic = self._features_and_statistic(batch)
        low, high = self.hyperparameters["percentile"]
        with full_precision(features.device):
            percentiles = adaptive_percentiles(statistic, self.reference_statistic.to(features.device), low, high)
            scale = ada_scale(features, percentiles)
            head = LinearHead(self.head_weight.to(features.dtype), self.head_bias.to(features.dtype))
            return energy_score(adascale_logits(features, head, scale, self.logit_scaling))


@register_detector
class AdaSCALEADetector(AdaSCALEDetector):
    """AdaSCALE-A: the adaptive scale multiplies the activations, ``W (z exp(s)) + b`` (see :class:`AdaSCALEDetector`)."""

    config_class = AdaSCALEAConfig
    logit_scaling = False


@register_detector
class AdaSCALELDetector(AdaSCALEDetector):
    """AdaSCALE-L: the adaptive scale multiplies the logits, ``(W z + b) s^2`` (see :class:`AdaSCALEDetector`)."""

    config_class = AdaSCALELConfig
    logit_scaling = True
