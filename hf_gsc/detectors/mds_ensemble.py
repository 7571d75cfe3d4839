"""MDSEns: the Mahalanobis score of several layers with input pre-processing (Lee, Lee, Lee & Shin, NeurIPS 2018), as
OpenOOD v1.5 runs it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..classifier.architectures import encoder_blocks
from ..settings.config import DetectorConfig, number_check, setting
from ..utils.feature_capture import Target, capture_many, install_hooks
from ..utils.precision import full_precision, parameter_dtype, step_dtype
from .backbone_pass import BackbonePass, FitShards
from .common import FittedDetector
from .interface import register_detector
from .penultimate import ClassStatistics, StatisticsPass, mahalanobis_distances, mahalanobis_terms, tied_precision


def channel_means(hidden_state: torch.Tensor) -> torch.Tensor:
    """OpenOOD's ``feature_type: mean``: each channel's mean over the positions, ``(B, C, H, W) -> (B, C)``; of a
    transformer's tokens ``(B, T, D)``, each width coordinate's mean over the tokens, ``(B, D)``."""
    if hidden_state.dim() == 4:
        return hidden_state.flatten(2).mean(dim=-1)
    if hidden_state.dim() == 3:
        return hidden_state.mean(dim=1)
    raise ValueError(f"mds_ensemble: a hidden state (B, C, H, W) or (B, T, D) expected, got shape "
                     f"{tuple(hidden_state.shape)}")


def gaussian_scores(features: torch.Tensor, class_means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """``-0.5 (m - mu_k)^T P (m - mu_k)`` for every class ``k``, ``(B, D) -> (B, K)``, float64 (OpenOOD's
    ``gaussian_score``)."""
    return -0.5 * mahalanobis_distances(features.double(), mahalanobis_terms(class_means, precision))


def layer_targets(model: nn.Module, layers: Sequence[int]) -> list[Target]:
    """Where each of ``layers`` is read: layer 0 is the input of the encoder's first block, layer ``i`` the output of
    its block ``i - 1`` (:mod:`hf_gsc.classifier.architectures`), the model's ``hidden_states`` for a transformers
    ResNet (stem, then each stage) and ViT (embeddings, then each block), captured by hooks (transformers'
    ``output_hidden_states=True`` installs hooks on the model that make it unpicklable)."""
    try:
        blocks = list(encoder_blocks(model, "mds_ensemble"))
    except ValueError as error:
        raise ValueError(f"mds_ensemble reads the layers of the encoder's blocks: {error}") from None
    count = len(blocks) + 1
    bad = [index for index in layers if not -count <= index < count]
    if bad:
        raise ValueError(f"mds_ensemble: layers {bad} out of range for the {count} layers of {type(model).__name__} "
                         f"(the input of the first of its {len(blocks)} blocks, then each block's output; indices "
                         f"-{count}..{count - 1})")
    targets = [(blocks[0], True) if index % count == 0 else (blocks[index % count - 1], False) for index in layers]
    for module, _ in targets:
        install_hooks(module)
    return targets


def _indices(name: str, value: Any) -> Any:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value or any(
            isinstance(v, bool) or not isinstance(v, int) for v in value) or len(set(value)) != len(value):
        raise ValueError(f"{name} must be a non-empty list of distinct layer indices (integers, negative from the "
                         f"end), got {value!r}")
    return tuple(value)


def _weights(name: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not value or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in value):
        raise ValueError(f"{name} must be None or a non-empty list of finite numbers (one per layer), got {value!r}")
    return tuple(float(v) for v in value)


@dataclass
class MDSEnsembleConfig(DetectorConfig):
    """Settings of the Mahalanobis layer ensemble (:class:`MDSEnsembleDetector`)."""

    method: ClassVar[str] = "mds_ensemble"
    layers: tuple[int, ...] = setting(
        (0,), _indices,
        "The layers whose channel means are scored (negative from the end): 0 is the input of the encoder's first "
        "block, ``i`` the output of its block ``i - 1`` (:func:`layer_targets`: the model's ``hidden_states`` for a "
        "transformers ResNet and ViT); ``[0]``: OpenOOD mds_ensemble.yml (``feature_type_list: [mean]``: the first "
        "entry of its ResNet's feature list, the stem's output after max-pooling, which is layer 0 of a transformers "
        "ResNet).")
    alpha: tuple[float, ...] | None = setting(
        None, _weights,
        "Weight of each layer's score, one per entry of ``layers``; ``None``: 1 for each (OpenOOD mds_ensemble.yml "
        "``alpha_list: [1]``). The authors fit the weights by logistic regression on OOD validation data; that is "
        "not done here (the ID-only mode).")
    noise: float = setting(0.0014, number_check(0.0, math.inf),
                           "Step of the input pre-processing; 0.0014: OpenOOD mds_ensemble.yml ``noise`` (its sweep "
                           "``noise_list: [0.0014]``). 0: no pre-processing (one forward scores every layer).")
    image_std: float = setting(0.5, number_check(0.0, math.inf, low_open=True),
                               "What the gradient's sign is divided by in every channel; 0.5: OpenOOD's constant "
                               "(\"here we use the default value of 0.5\").")


@register_detector
class MDSEnsembleDetector(FittedDetector):
    """``sum_l alpha_l max_k -0.5 (m_l(x~) - mu_lk)^T P_l (m_l(x~) - mu_lk)``: per layer ``l``, the Gaussian score of
    the channel means ``m_l`` (:func:`channel_means`) of the input pre-processed against that layer's nearest class
    Gaussian, ``x~ = x - noise sign(grad_x 0.5 d_l(x)) / image_std`` (:func:`gaussian_scores`).

    Lee, Lee, Lee, Shin, "A Simple Unified Framework for Detecting Out-of-Distribution Samples and Adversarial
    Attacks", NeurIPS 2018. The reference is OpenOOD v1.5's ``openood/postprocessors/mds_ensemble_postprocessor.py``
    with ``configs/postprocessors/mds_ensemble.yml``: per layer, class means and the tied covariance
    (``EmpiricalCovariance`` of the class-centred features; its pseudo-inverse the precision) of the ID training
    features; at scoring, one forward and backward per layer for its input step, then a forward of the stepped
    input. The layers are the input of the encoder's first block and each block's output (:func:`layer_targets`),
    which are the model's ``hidden_states``: a transformers ResNet's are exactly OpenOOD's ResNet feature list before
    its last pooling (stem after max-pooling, then each stage); a ViT's are the embeddings and each block's output,
    whose channel means here are means over the tokens (OpenOOD has no feature list for its ViT). They are captured
    by hooks, not with ``output_hidden_states=True``, whose hooks would make the base model unpicklable.

    Where this differs from OpenOOD: the layer weights ``alpha`` are a setting (1 each by default, OpenOOD's yml);
    OpenOOD's alternative of fitting them by logistic regression on its OOD validation set (``alpha_list`` empty) is
    not offered, since it reads OOD data. Left out: the ``flat`` and ``stat`` feature types and the ``pca`` /
    ``lda`` / ``capca`` reductions of the code (its yml uses ``mean`` and ``none``). The precision drops directions
    of (numerically) zero variance (:func:`~hf_gsc.detectors.penultimate.tied_precision`), where sklearn's ``pinvh``
    would keep rounding noise.

    Cost: its own forwards (``one_pass = False``): with ``noise > 0``, one forward with gradient, one backward per
    layer and one forward of the stepped input per layer, per batch; with ``noise = 0``, one forward. The fit reads
    every layer's channel means from one forward per batch and keeps per layer ``(K + D_l) D_l`` float64 sums.

    Settings: :class:`MDSEnsembleConfig`.
    """

    config_class = MDSEnsembleConfig
    search_space_source = "OpenOOD mds_ensemble.yml postprocessor_sweep: noise_list [0.0014] (one value)"
    one_pass = False  # a forward with gradient, a backward and a forward per layer of its own per batch
    needs_labels = True
    #: Per layer, concatenated: ``class_means`` ``(K, sum D_l)``, ``precisions`` the flattened ``(D_l, D_l)`` blocks,
    #: ``widths`` the ``D_l``, ``fitted_layers`` the hidden-state indices they were fitted on (checked at load).
    state_names = ("class_means", "precisions", "widths", "fitted_layers")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        layers, alpha = self.hyperparameters["layers"], self.hyperparameters["alpha"]
        if alpha is not None and len(alpha) != len(layers):
            raise ValueError(f"mds_ensemble: alpha must have one weight per layer ({len(layers)} layers {list(layers)}), "
                             f"got {len(alpha)}: {list(alpha)}")
        self._targets = layer_targets(self.model, layers)

    @property
    def alpha(self) -> tuple[float, ...]:
        return self.hyperparameters["alpha"] or (1.0,) * len(self.hyperparameters["layers"])

    def feature_splits(self) -> tuple:
        """Nothing from the shared pass: the hidden states come from the method's own forwards."""
        return ()

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        count = len(self.hyperparameters["layers"])
        return {"class_means": (self.num_classes, None), "precisions": (None,), "widths": (count,),
                "fitted_layers": (count,)}

    def fit_requirement(self) -> tuple[int, str]:
        return self.num_classes + 1, "one sample of every class, and more than classes for a covariance"

    # ------------------------------------------------------------------ the layers' channel means
    def _layer_means(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """``m_l`` of each layer of ``layers``, ``(B, D_l)`` in ``pixel_values``' dtype or wider: the model's own
        forward (fed in its dtype; with the graph to the input where grad mode is on), stopped at the last layer
        read."""
        captured, _ = capture_many(lambda: self.model(pixel_values=pixel_values.to(parameter_dtype(self.model))),
                                   self._targets, stop=True)
        missing = [index for index, target in zip(self.hyperparameters["layers"], self._targets) if target not in captured]
        if missing:
            raise RuntimeError(f"mds_ensemble: the forward never reached layers {missing}")
        return [channel_means(captured[target].to(step_dtype(captured[target].dtype))) for target in self._targets]

    # ------------------------------------------------------------------ fitting: per layer class means and tied covariance
    def fit_begin(self) -> None:
        self._accumulator = None

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        if labels is None:
            raise ValueError("detector 'mds_ensemble' fits per-class statistics and got no labels: pass a class-folder "
                             "tree whose folder names are the model's labels (config.label2id), a datasets.Dataset "
                             "with a 'label' column, or (pixel_values, labels) batches")
        with torch.no_grad(), full_precision(batch.pixel_values.device):
            means = batch.memo(("mds_ensemble layer means", self.hyperparameters["layers"]),
                               lambda: [m.cpu() for m in self._layer_means(batch.pixel_values)])
        if self._accumulator is None:
            self._accumulator = [StatisticsPass(ClassStatistics(self.num_classes, second_moment=True),
                                                lambda features, labels: (features, labels, None)) for _ in means]
        for accumulator, features in zip(self._accumulator, means):
            accumulator.update(features, labels)

    def fit_gather(self, shards: FitShards) -> None:
        # Every layer's sums added over the processes (an empty process takes the layer count from the setting).
        if self._accumulator is None:
            self._accumulator = [StatisticsPass(ClassStatistics(self.num_classes, second_moment=True),
                                                lambda features, labels: (features, labels, None))
                                 for _ in self.hyperparameters["layers"]]
        for accumulator in self._accumulator:
            accumulator.gather(shards)

    def fit_end(self) -> None:
        accumulated, self._accumulator = self._accumulator, None
        self.check_fit_count(0 if accumulated is None else accumulated[0].count)
        means, precisions = [], []
        for statistics in (accumulator.statistics for accumulator in accumulated):
            means.append(statistics.class_means(self.method))
            precisions.append(tied_precision(statistics.tied_covariance(self.method)))
        device = self.device
        self.class_means = torch.cat(means, dim=1).to(device)
        self.precisions = torch.cat([p.reshape(-1) for p in precisions]).to(device)
        self.widths = torch.tensor([float(m.shape[1]) for m in means], dtype=torch.float64, device=device)
        self.fitted_layers = torch.tensor([float(i) for i in self.hyperparameters["layers"]], dtype=torch.float64,
                                          device=device)
        self._prepare()
        self.fitted = True

    def _prepare(self) -> None:
        fitted = [int(i) for i in self.fitted_layers.tolist()]
        if fitted != list(self.hyperparameters["layers"]):
            raise ValueError(f"mds_ensemble: the Gaussians were fitted on layers {fitted}, not "
                             f"{list(self.hyperparameters['layers'])}; load it with the layers it was fitted on, or "
                             "fit a new detector")
        widths = [int(w) for w in self.widths.tolist()]
        if sum(widths) != self.class_means.shape[1] or sum(w * w for w in widths) != self.precisions.numel():
            raise ValueError(f"mds_ensemble: the saved widths {widths} do not match class_means "
                             f"{tuple(self.class_means.shape)} and precisions {tuple(self.precisions.shape)}")

    @property
    def layer_terms(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer ``(class means (K, D_l), precision (D_l, D_l))``, float64 views of the fitted buffers (wherever
        ``.to`` moved them)."""
        widths = [int(w) for w in self.widths.tolist()]
        means = self.class_means.double().split(widths, dim=1)
        blocks = self.precisions.double().split([w * w for w in widths])
        return [(m, p.view(w, w)) for m, p, w in zip(means, blocks, widths)]

    # ------------------------------------------------------------------ scoring
    def _layer_score(self, pixel_values: torch.Tensor, layer: int, class_means: torch.Tensor,
                     precision: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s (position in ``layers``) score of the input stepped against its nearest Gaussian."""
        with torch.inference_mode(False), torch.enable_grad():
            # clone(): tensors made under inference mode cannot be saved for backward.
            inputs = pixel_values.detach().clone().requires_grad_(True)
            features = self._layer_means(inputs)[layer].double()
            nearest = gaussian_scores(features.detach(), class_means, precision).argmax(dim=1)
            centred = features - class_means[nearest]
            loss = (0.5 * ((centred @ precision) * centred).sum(dim=1)).mean()
            (gradient,) = torch.autograd.grad(loss, inputs)
        sign = torch.where(gradient >= 0, 1.0, -1.0).to(pixel_values) / self.hyperparameters["image_std"]
        stepped = pixel_values.detach() - self.hyperparameters["noise"] * sign
        with torch.no_grad():
            return gaussian_scores(self._layer_means(stepped)[layer], class_means, precision).amax(dim=1)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """The forwards, the step and the Gaussians in float32 or wider with autocast off, as ODIN's
        (:mod:`hf_gsc.utils.precision`)."""
        pixel_values = batch.pixel_values
        with full_precision(pixel_values.device):
            pixel_values = pixel_values.to(step_dtype(pixel_values.dtype))
            if self.hyperparameters["noise"] == 0:  # x - 0 * step is x: every layer from one forward
                with torch.no_grad():
                    means = self._layer_means(pixel_values)
                scores = [gaussian_scores(m, *terms).amax(dim=1) for m, terms in zip(means, self.layer_terms)]
            else:
                scores = [self._layer_score(pixel_values, layer, *terms) for layer, terms in enumerate(self.layer_terms)]
            weighted = [weight * score for weight, score in zip(self.alpha, scores)]
            return sum(weighted[1:], weighted[0])
