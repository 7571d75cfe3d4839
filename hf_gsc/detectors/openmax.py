"""OpenMax: the unknown class's probability from Weibull fits of the logits' distances to the class means
(Bendale & Boult, CVPR 2016)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, integer_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead


#: libMR's ``MR()`` default ``translate_amount``: FitHigh shifts the tail so that its smallest value is this.
LIBMR_TRANSLATE = 1.0
#: Bisection steps of :func:`weibull_fit_high`: the bracket ``(0, 1]`` halves each step, below float64's resolution
#: after about 60; 200 leaves the root exact to the last bit for any root above 1e-30.
BISECTION_STEPS = 200


def weibull_fit_high(tails: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """libMR's ``MR().fit_high(tail, len(tail))`` for every row of ``tails`` ``(K, n)`` (the values where ``valid``,
    ``(K, n)`` bool; at least two distinct per row): ``(scale, shape, small_score)``, each ``(K,)`` float64.

    As libMR's ``EvtGeneric`` and ``weibull_fit`` (Vastlab/libMR ``MetaRecognition.cpp``, ``weibull.c``, MATLAB's
    ``wblfit``): the tail is shifted to ``t + 1 - min(t)``, its logs ``x`` rescaled to ``x0 = (x - max x) / range`` in
    ``[-1, 0]``, and the maximum-likelihood Gumbel scale ``s`` of ``x0`` is the root of
    ``s + mean(x0) - sum(x0 e^(x0/s)) / sum(e^(x0/s))``; then ``mu = s log mean(e^(x0/s))``, and the Weibull
    ``scale = exp(range mu + max x)``, ``shape = 1 / (range s)``. libMR finds the root with Brent's method to a
    tolerance of ``2e-6 max(|s|, 1)``; here it is found by bisection on ``(0, 1]`` (the function is increasing, below 0
    as ``s -> 0`` and above 0 at 1) to float64 precision: the maximum-likelihood fit libMR approximates."""
    tails = tails.double()
    count = valid.sum(dim=-1).double()
    small_score = torch.where(valid, tails, torch.inf).amin(dim=-1)
    logs = torch.where(valid, torch.log(tails + LIBMR_TRANSLATE - small_score[:, None]), 0.0)
    maximum = torch.where(valid, logs, -torch.inf).amax(dim=-1)
    span = maximum  # the smallest log is log(1) = 0
    x0 = torch.where(valid, (logs - maximum[:, None]) / span[:, None], 0.0)
    mean = x0.sum(dim=-1) / count

    def likelihood_equation(sigma: torch.Tensor) -> torch.Tensor:
        weights = torch.where(valid, torch.exp(x0 / sigma[:, None]), 0.0)
        return sigma + mean - (weights * x0).sum(dim=-1) / weights.sum(dim=-1)

    low, high = torch.zeros_like(mean), torch.ones_like(mean)
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        above = likelihood_equation(middle) > 0
        high = torch.where(above, middle, high)
        low = torch.where(above, low, middle)
    sigma = (low + high) / 2
    mu = sigma * torch.log(torch.where(valid, torch.exp(x0 / sigma[:, None]), 0.0).sum(dim=-1) / count)
    return torch.exp(span * mu + maximum), 1 / (span * sigma), small_score


def weibull_w_score(distances: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                    small_score: torch.Tensor) -> torch.Tensor:
    """libMR's ``w_score`` (its Weibull CDF of the shifted distance): ``1 - exp(-(x / scale)^shape)`` with
    ``x = d + 1 - small_score``, and 0 where ``x < 0``. ``distances (B, K)``, the rest ``(K,)``."""
    shifted = distances + LIBMR_TRANSLATE - small_score
    cdf = 1 - torch.exp(-torch.pow(shifted.clamp(min=0) / scale, shape))
    return torch.where(shifted < 0, torch.zeros_like(cdf), cdf)


def openmax_unknown_probability(logits: torch.Tensor, means: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                                small_score: torch.Tensor, alpha: int) -> torch.Tensor:
    """The OpenMax probability of the unknown class, ``(B,)`` float64.

    For the ``alpha`` largest logits (rank ``i = 1..alpha`` weighted ``(alpha + 1 - i) / alpha``) the logit ``y_c`` is
    cut by its W-score ``w_c`` (of the distance ``||y - mean_c||``): ``y'_c = y_c (1 - w_c omega_c)``; the unknown
    logit is what was cut, ``u = sum_c (y_c - y'_c)``, and its probability ``e^u / (sum_c e^(y'_c) + e^u)``, taken
    here from a log-sum-exp (the authors' ``np.exp`` overflows above a logit of 709)."""
    logits = logits.double()
    distances = torch.cdist(logits, means.double(), compute_mode="donot_use_mm_for_euclid_dist")
    w_scores = weibull_w_score(distances, scale, shape, small_score)
    ranked = logits.topk(alpha, dim=-1).indices
    weights = torch.arange(alpha, 0, -1, dtype=logits.dtype, device=logits.device) / alpha
    omega = torch.zeros_like(logits).scatter(-1, ranked, weights.expand_as(ranked))
    modified = logits * (1 - w_scores * omega)
    unknown = (logits - modified).sum(dim=-1, keepdim=True)
    return torch.exp(unknown[:, 0] - torch.logsumexp(torch.cat([modified, unknown], dim=-1), dim=-1))


def class_tails(values: torch.Tensor, classes: torch.Tensor, num_classes: int, size: int) -> torch.Tensor:
    """``(num_classes, size)``: the ``size`` largest ``values`` of each class, descending, ``-inf`` where a class has
    fewer. One sort of all the values, then a stable sort by class: within each class the values stay descending."""
    order = values.argsort(descending=True)
    order = order[classes[order].argsort(stable=True)]
    values, classes = values[order], classes[order]
    starts = torch.zeros(num_classes + 1, dtype=torch.long)
    starts[1:] = torch.bincount(classes, minlength=num_classes).cumsum(0)
    rank = torch.arange(values.shape[0]) - starts[classes]
    keep = rank < size
    tails = torch.full((num_classes, size), -torch.inf, dtype=values.dtype)
    tails[classes[keep], rank[keep]] = values[keep]
    return tails


def openmax_fit(batches: FeatureStore, head: LinearHead, tail_size: int, method: str
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(means (K, K), scale, shape, small_score (K,))``: each class's mean logit vector over its correctly classified
    fitting samples, and the Weibull fit of the ``tail_size`` largest distances of those samples to it
    (:func:`weibull_fit_high`). Two readings of the stored features, one batch of logits at a time."""
    num_classes = head.num_classes
    sums = torch.zeros(num_classes, num_classes, dtype=torch.float64)
    counts = torch.zeros(num_classes, dtype=torch.float64)
    for features, labels in batches.batches():
        logits = head(features).double()
        correct = logits.argmax(dim=-1) == labels
        sums.index_add_(0, labels[correct], logits[correct])
        counts += torch.bincount(labels[correct], minlength=num_classes).double()
    short = (counts < 2).nonzero().flatten().tolist()
    if short:
        raise ValueError(f"{method}: classes {short} have fewer than 2 correctly classified fitting samples; the "
                         "Weibull fit of each class needs at least 2 (fit on more ID data, or leave openmax out)")
    means = sums / counts[:, None]
    distances, classes = [], []  # of the correctly classified samples: N numbers, not N K
    for features, labels in batches.batches():
        logits = head(features).double()
        correct = logits.argmax(dim=-1) == labels
        logits, labels = logits[correct], labels[correct]
        distances.append((logits - means[labels]).norm(dim=-1))
        classes.append(labels)
    tails = class_tails(torch.cat(distances), torch.cat(classes), num_classes, tail_size)
    valid = torch.isfinite(tails)
    flat = (tails.amax(dim=-1) <= torch.where(valid, tails, torch.inf).amin(dim=-1)).nonzero().flatten().tolist()
    if flat:
        raise ValueError(f"{method}: the distance tails of classes {flat} hold a single value; the Weibull fit needs "
                         "two distinct distances per class")
    return (means,) + weibull_fit_high(torch.where(valid, tails, 0.0), valid)


@dataclass
class OpenMaxConfig(DetectorConfig):
    """Settings of OpenMax (:class:`OpenMaxDetector`)."""

    method: ClassVar[str] = "openmax"
    #: The tail decides the fitted Weibull models; ``alpha`` is read when scoring.
    structural_names: ClassVar[tuple[str, ...]] = ("tail_size",)
    tail_size: int = setting(20, integer_check(2), "Largest distances of each class fitted by its Weibull model; 20: "
                             "OpenOOD openmax_postprocessor.py ``weibull_tail``.")
    alpha: int = setting(3, integer_check(1), "Top-ranked logits revised, ``alpha``; 3: OpenOOD "
                         "openmax_postprocessor.py ``weibull_alpha``. At most the number of classes.")


@register_detector
class OpenMaxDetector(FittedDetector):
    """Minus the OpenMax probability of the unknown class, :func:`openmax_unknown_probability`.

    Bendale, Boult, "Towards Open Set Deep Networks", CVPR 2016. Reference: OpenOOD v1.5 ``openmax_postprocessor.py``
    with libMR (Vastlab/libMR): per class, the mean logit vector (MAV) of the correctly classified ID training samples,
    and libMR's ``fit_high`` of the ``tail_size`` largest Euclidean distances of those samples to it
    (:func:`openmax_fit`, :func:`weibull_fit_high`); the score is ``-P(unknown)``. As OpenOOD: the logits themselves
    are the activation vectors, the distance is Euclidean (the paper's eucos is an option OpenOOD does not use), and
    the unknown probability takes no max-subtraction: ``e^u / (sum e^(y') + e^u)``, computed here as a log-sum-exp
    (the same number where the authors' ``np.exp`` does not overflow). libMR (a C extension that does not build on
    current Python) is not a dependency: its fit is written here from its source and solves libMR's
    maximum-likelihood equation to float64 precision, where libMR stops Brent's method at a tolerance of ``2e-6``
    (a difference in the W-scores of the order of ``1e-5``). A class needs two correctly classified fitting samples
    with distinct distances (OpenOOD fails on a class with none).

    Settings: :class:`OpenMaxConfig`.
    """

    config_class = OpenMaxConfig
    search_space_source = "OpenOOD openmax.yml: no sweep (weibull_tail 20, weibull_alpha 3 fixed in the postprocessor)"
    state_names = ("means", "weibull_scale", "weibull_shape", "tail_minimum")
    needs_labels = True

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self._check_alpha()

    def _check_alpha(self) -> None:
        alpha = self.hyperparameters["alpha"]
        if alpha > self.num_classes:
            raise ValueError(f"{self.method}: alpha must be at most the model's {self.num_classes} classes, got {alpha}")

    def settings_changed(self, changed: dict[str, Any]) -> None:
        self._check_alpha()
        super().settings_changed(changed)

    def fit_requirement(self) -> tuple[int, str]:
        return 2 * self.num_classes, "two correctly classified samples per class, for its Weibull fit"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        k = self.num_classes
        return {"means": (k, k), "weibull_scale": (k,), "weibull_shape": (k,), "tail_minimum": (k,)}

    def _fit(self, accumulated: FeatureStore) -> None:
        self.check_fit_count(accumulated.count)
        self.means, self.weibull_scale, self.weibull_shape, self.tail_minimum = openmax_fit(
            accumulated, self.head, self.hyperparameters["tail_size"], self.method)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return -openmax_unknown_probability(self.head(self.features(batch)), self.means, self.weibull_scale,
                                            self.weibull_shape, self.tail_minimum, self.hyperparameters["alpha"])
