"""NAC: neuron activation coverage (Liu, Tian, Li, Ma & Wang, ICLR 2024), as its authors' code runs it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..classifier.architectures import architecture_for, encoder_blocks
from ..classifier.split_point_names import split_point_name_list
from ..classifier.split_points import resolve_split_point
from ..settings.config import DetectorConfig, setting
from ..utils.feature_capture import Target, capture_many
from ..utils.precision import full_precision, parameter_dtype, step_dtype
from .backbone_pass import BackbonePass, FitShards
from .common import FittedDetector
from .interface import register_detector
from .rankfeat import pools_spatially


# --------------------------------------------------------------------------- the math, on tensors
def uniform_kl_loss(logits: torch.Tensor) -> torch.Tensor:
    """``sum_b sum_k -(1/K) log softmax(y_b)_k``: the cross-entropy of the softmax against the uniform distribution,
    ``KL(u || softmax)`` up to a constant, summed over the batch (the authors' ``kl_grad``: ``targets = ones / K``,
    ``sum(-targets * logsoftmax(outputs), -1)``, ``loss.sum()``). Each sample's gradient is its own term's."""
    return -(torch.log_softmax(logits, dim=-1) / logits.shape[-1]).sum()


def pool_positions(hidden: torch.Tensor) -> torch.Tensor:
    """A layer's tensor summed over its positions, one value per neuron (the authors' ``StatePooling``): a feature
    map ``(B, C, H, W) -> (B, C)`` (``avg_pooling``: a sum, "since the denominator can be scaled by sigmoid smooth"),
    tokens ``(B, T, D) -> (B, D)`` (``pooling_vit_mlp`` / ``pooling_swin_mlp`` with ``avg``: a sum), a vector
    ``(B, D)`` as it is."""
    if hidden.dim() == 4:
        return hidden.sum(dim=(2, 3))
    if hidden.dim() == 3:
        return hidden.sum(dim=1)
    if hidden.dim() == 2:
        return hidden
    raise ValueError(f"nac: a layer output (B, C, H, W), (B, T, D) or (B, D) expected, got shape {tuple(hidden.shape)}")


def neuron_states(activation: torch.Tensor, gradient: torch.Tensor, alpha: float) -> torch.Tensor:
    """``sigmoid(alpha * o * g)`` of the pooled output ``o`` and pooled gradient ``g`` (each pooled on its own, then
    multiplied: the authors' ``transform`` of both, then ``state_func``), written as their ``sigmoid``:
    ``1 / (1 + exp(-alpha x))``."""
    return 1 / (1 + torch.exp(-alpha * (activation * gradient)))


def coverage_edges(bins: int) -> torch.Tensor:
    """The ``M = bins`` interval edges of the states, ``(M,)`` float64 (the authors' ``logspace(1e3, M)``): ``M / 2``
    points ``log_1000`` of an even grid on ``[1, sqrt(1000)]`` (``[0, 0.5]``, dense near 0), mirrored about 0.5 onto
    ``[0.5, 1]`` (dense near 1); the last edge 1.01, then 1.2 appended. The ``M - 1`` intervals are
    ``[e_i, e_{i+1})``."""
    if bins < 4 or bins % 2:
        raise ValueError(f"nac: bins must be an even integer >= 4 (the authors' logspace halves it), got {bins!r}")
    half = bins // 2
    low = torch.log(torch.linspace(1.0, math.sqrt(1e3), half, dtype=torch.float64)) / math.log(1e3)
    edges = torch.cat([low[:-1], (1 - low).flip(0), torch.tensor([1.2], dtype=torch.float64)])
    edges[-2] += 1e-2
    return edges


def interval_indices(states: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``(B, N)`` the interval ``i`` with ``e_i <= s < e_{i+1}`` of every state, ``-1`` where none holds it (compared
    in float64, as the authors' float32 states against their float64 edges)."""
    return torch.bucketize(states.double(), edges.to(states.device), right=True) - 1


def interval_counts(states: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``(M - 1, N)`` float64: how many of the ``B`` samples' states fall in each interval, per neuron (the authors'
    ``Estimator.update``)."""
    intervals, neurons = edges.shape[0] - 1, states.shape[1]
    index = interval_indices(states, edges)
    flat = (index * neurons + torch.arange(neurons, device=index.device))[(index >= 0) & (index < intervals)]
    return torch.bincount(flat, minlength=intervals * neurons).double().view(intervals, neurons)


def coverage_table(counts: torch.Tensor, min_count: float) -> torch.Tensor:
    """``min(counts / O, 1)``: an interval is covered once ``O = min_count`` fitting states fell in it (the authors'
    ``Estimator.get_score``, ``t_score``)."""
    return torch.clamp(counts / min_count, max=1.0)


def coverage_scores(states: torch.Tensor, edges: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``(B,)``: the coverage of the interval each neuron's state falls in, 0 outside every interval, averaged over
    the neurons (the authors' ``Estimator.ood_test`` with ``method='avg'``)."""
    index = interval_indices(states, edges)
    inside = (index >= 0) & (index < table.shape[0])
    covered = torch.gather(table, 0, index.clamp(0, table.shape[0] - 1))
    return torch.where(inside, covered, torch.zeros((), dtype=covered.dtype, device=covered.device)).mean(dim=1)


# --------------------------------------------------------------------------- the layers and the authors' settings
#: The authors' per-layer ``(O, M, sig_alpha)``, in the order of the default layers (the input of the classifier
#: first), from the ``layer_kwargs`` of their ImageNet configs (github.com/BierOne/ood_coverage,
#: ``configs/postprocessors/nac/{resnet,vit}/nac_imagenet.yml``): a CNN's are ResNet-50's (``avgpool``, ``layer3``,
#: ``layer2``, ``layer1``), a transformer's ViT-B/16's (``layer_norm``, ``layer_11``, ``layer_10``, ``layer_9``).
AUTHORS_SETTINGS: dict[str, tuple[tuple[float, int, float], ...]] = {
    "cnn": ((10.0, 50, 3000.0), (500.0, 50, 300.0), (50.0, 500, 0.01), (5000.0, 1000, 1.0)),
    "transformer": ((500.0, 50, 100.0), (50.0, 500, 1.0), (10.0, 500, 10.0), (10.0, 1000, 1.0)),
}

#: Names of the LayerNorm before a transformer block's MLP (the authors' ViT ``ln_2``): transformers' ViT, DeiT,
#: BEiT and Swin blocks (``layernorm_after``), CLIP and SigLIP (``layer_norm2``), DINOv2 (``norm2``).
MLP_NORM_NAMES = ("layernorm_after", "layer_norm2", "norm2", "ln_2")


def family(model: nn.Module) -> str:
    """``"cnn"`` where the head averages a feature map (ResNet, ConvNeXt, ...), else ``"transformer"``: which of the
    authors' two layer choices and settings apply."""
    return "cnn" if pools_spatially(model) else "transformer"


def default_layers(model: nn.Module) -> tuple[str, ...]:
    """The layers the authors read, on ``model``: the input of the classifier (their ResNet's ``avgpool`` output and
    their ViT's CLS token after ``encoder.ln``, both the last linear layer's input), then

    * a CNN: the outputs of the stages before the last, last first (ResNet-50's ``layer3``, ``layer2``, ``layer1``);
    * a transformer: the LayerNorm before the MLP of the last three blocks, last first (their ViT's
      ``encoder_layer_{11,10,9}.ln_2``), a Swin's blocks taken across its stages;

    as many as the model has, up to three.

    Raises:
        ValueError: no list of encoder blocks is read on this model (timm models), or a transformer's blocks have no
            LayerNorm before their MLP under the names of :data:`MLP_NORM_NAMES`.
    """
    try:
        blocks = encoder_blocks(model, "nac")
    except ValueError as error:
        raise ValueError(f"nac reads layers inside the encoder by default: {error}; pass layers=[...] (module paths "
                         "inside the model, or 'penultimate') to read others") from None
    spec = architecture_for(model)
    if family(model) == "cnn":
        inner = [f"{spec.blocks}.{index}" for index in range(len(blocks) - 1)]
    else:
        paths = []
        for index, block in enumerate(blocks):
            if spec.inner_blocks is None:
                paths.append((f"{spec.blocks}.{index}", block))
            else:
                paths.extend((f"{spec.blocks}.{index}.{spec.inner_blocks}.{j}", inner_block)
                             for j, inner_block in enumerate(getattr(block, spec.inner_blocks)))
        inner = []
        for path, block in paths:
            norm = next((name for name in MLP_NORM_NAMES if isinstance(getattr(block, name, None), nn.LayerNorm)), None)
            if norm is None:
                model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
                raise ValueError(f"nac reads the LayerNorm before each transformer block's MLP, and the blocks of "
                                 f"model type {model_type!r} ({type(model).__name__}) have none named "
                                 f"{' / '.join(MLP_NORM_NAMES)}; pass layers=[...] explicitly")
            inner.append(f"{path}.{norm}")
    return ("penultimate", *reversed(inner[-3:]))


def _layer_names(name: str, value: Any) -> Any:
    """``None`` or a non-empty list of distinct layer names, held as a tuple (saved as a JSON list)."""
    return split_point_name_list(name, value, "['penultimate', 'resnet.encoder.stages.2']", distinct=True)


def _per_layer(kind: str) -> Any:
    """A field check: ``None`` or a non-empty list of one value per layer, each a positive finite number (``kind``
    ``"number"``) or an even integer >= 4 (``"bins"``)."""
    def check(name: str, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
            raise ValueError(f"{name} must be None or a non-empty list with one value per layer, got {value!r}")
        if kind == "bins":
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 4 or v % 2 for v in value):
                raise ValueError(f"{name} must hold even integers >= 4 (the authors' interval edges halve M), got "
                                 f"{value!r}")
            return tuple(value)
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 for v in value):
            raise ValueError(f"{name} must hold finite numbers > 0, got {value!r}")
        return tuple(float(v) for v in value)

    return check


@dataclass
class NACConfig(DetectorConfig):
    """Settings of neuron activation coverage (:class:`NACDetector`).

    ``bins``, ``min_count`` and ``alpha`` hold one value per layer of ``layers``. The authors choose them per layer by
    their automatic parameter search on OpenOOD's OOD validation set (``APS_mode: True`` in their ImageNet configs);
    the defaults here are the values that search gave, as their configs publish them (``layer_kwargs``), and nothing
    is searched on OOD data (the ID-only mode: ``--tune`` has no grid for NAC).
    """

    method: ClassVar[str] = "nac"
    #: ``min_count`` applies at scoring (the coverage is derived from the saved counts); the others decide the fit.
    structural_names: ClassVar[tuple[str, ...]] = ("layers", "bins", "alpha")
    layers: tuple[str, ...] | None = setting(
        None, _layer_names,
        "The layers whose neurons are covered: 'penultimate' (the input of the classifier), 'final_encoder_output' or "
        "module paths inside the model (negative indices allowed), each read at its output. ``None``: the authors' "
        "choice for the architecture (:func:`default_layers`): the classifier's input, then a CNN's stages before the "
        "last (ResNet-50: ``avgpool``, ``layer3``, ``layer2``, ``layer1`` in their README's command) or the LayerNorm "
        "before the MLP of a transformer's last three blocks (ViT-B/16: ``layer_norm``, ``layer_11``, ``layer_10``, "
        "``layer_9``).")
    bins: tuple[int, ...] | None = setting(
        None, _per_layer("bins"),
        "``M`` per layer: the number of interval edges of the states (``M - 1`` intervals, even, >= 4). ``None``: the "
        "authors' ``M`` of the layer in that order (:data:`AUTHORS_SETTINGS`: ResNet-50 ImageNet ``[50, 50, 500, "
        "1000]``, ViT-B/16 ``[50, 500, 500, 1000]``, from their APS on OOD validation data).")
    min_count: tuple[float, ...] | None = setting(
        None, _per_layer("number"),
        "``O`` per layer: the fitting states an interval needs to count as covered (a count out of the fitting "
        "samples: the authors build on 1,000 class-balanced ImageNet training images for ResNet-50, 50,000 for "
        "ViT-B/16). ``None``: the authors' ``O`` (ResNet-50 ``[10, 500, 50, 5000]``, ViT-B/16 ``[500, 50, 10, 10]``, "
        "from their APS on OOD validation data). Applies at scoring; no refit.")
    alpha: tuple[float, ...] | None = setting(
        None, _per_layer("number"),
        "``sig_alpha`` per layer: the steepness of the sigmoid of the neuron states. ``None``: the authors' (ResNet-50 "
        "``[3000, 300, 0.01, 1]``, ViT-B/16 ``[100, 1, 10, 1]``, from their APS on OOD validation data).")


@register_detector
class NACDetector(FittedDetector):
    """The coverage of the intervals the sample's neuron states fall in, learnt from ID training data and averaged
    over neurons and layers; a neuron's state is ``sigmoid(alpha * o * g)`` of its output ``o`` and the gradient
    ``g`` of the KL divergence between the softmax and the uniform distribution with respect to it.

    Liu, Tian, Li, Ma, Wang, "Neuron Activation Coverage: Rethinking Out-of-distribution Detection and
    Generalization", ICLR 2024. The reference is the authors' code, github.com/BierOne/ood_coverage (NAC-UE, on
    OpenOOD v1.5): ``openood/postprocessors/nac_postprocessor.py`` and ``openood/postprocessors/nac/`` (``coverage.py``:
    ``KMNC``, ``Estimator``, ``logspace``; ``utils.py``: ``get_state_func('sigmoid(o*g_kl)')``, ``StatePooling``;
    ``instr_state.py``: ``kl_grad``), with ``configs/postprocessors/nac/{resnet,vit}/nac_imagenet.yml`` and their
    README's commands (layers ``avgpool layer3 layer2 layer1`` on ResNet-50, ``layer_norm layer_11 layer_10 layer_9`` on
    ViT-B/16). Per layer: ``o`` and ``g`` are each summed over the positions (:func:`pool_positions`), the state is
    :func:`neuron_states`; the fit counts, per neuron, the states in each of ``M - 1`` intervals
    (:func:`coverage_edges`, :func:`interval_counts`) and covers an interval at ``O`` states
    (:func:`coverage_table`); a sample's score is its states' coverage averaged over the neurons
    (:func:`coverage_scores`), then over the layers.

    Which layers stand in for the authors' (:func:`default_layers`): their ResNet-50 ``avgpool`` (the pooled
    ``(B, 2048, 1, 1)`` map, summed over its one position) and ViT's ``encoder.ln`` (its CLS token) are the input of
    the classifier, ``penultimate`` here; their ResNet ``layer1``-``layer3`` are the outputs of a transformers ResNet's
    (or ConvNeXt's) ``encoder.stages`` before the last; their ViT ``encoder_layer_i.ln_2`` is ``layernorm_after`` of a
    transformers ViT block (Swin's blocks too). Their Swin mapping (``mlp.0`` of some blocks, in ``instr_state.py``)
    comes with no published settings and is not followed; Swin takes the transformer rule. A model with fewer stages
    or blocks reads fewer layers, with the authors' settings of the first ones. Models whose encoder blocks are not
    read (timm models) are refused when built unless ``layers`` names modules.

    Everything is written from the code (the paper's full text was not available to this project, its abstract only),
    including what a paper would leave open: the KL divergence to the uniform is differentiated as the cross-entropy
    against the uniform target (the same gradient); a layer's ``o`` and ``g`` are each summed over the positions, then
    multiplied; the interval edges are log-spaced towards 0 and 1 (:func:`coverage_edges`); the layers' scores are
    averaged with equal weights. The authors build on a class-balanced subset of the training set (``valid_num``);
    here the fit reads the data it is given
    (``hf-gsc evaluate``: the ID train split after ``--max-fit-samples``), every sample counted (the code's
    ``sigmoid(o*g_kl)`` ignores whether it is classified correctly), which changes what ``O`` means. The ID-only mode:
    the settings are the published values of their OOD-validated search (:class:`NACConfig`).

    Cost: its own forward with gradient and one backward per batch, fitting and scoring (``one_pass = False``); the fit
    keeps ``(M_l - 1) N_l`` float64 counts per layer of ``N_l`` neurons (5.3 MB at ResNet-50's defaults, 12.6 MB at
    ViT-B/16's), saved; scoring looks up ``B sum_l N_l`` intervals.

    Settings: :class:`NACConfig`.
    """

    config_class = NACConfig
    search_space_source = ("the authors' postprocessor_sweep is per layer (O, M and sig_alpha of each of four "
                           "layers, 576 fits on ResNet-50 ImageNet) and chosen on OOD validation data; their published "
                           "values are the defaults (the ID-only mode)")
    one_pass = False  # a forward with gradient and a backward of its own per batch
    #: What :mod:`hf_gsc.method_table` says the method reads.
    reads_description: ClassVar[str] = ("its own forward and backward: each layer's output and the gradient of the "
                                        "KL divergence to the uniform with respect to it")
    #: ``counts``: per layer the ``(M_l - 1, N_l)`` interval counts, flattened and concatenated; ``widths`` the
    #: ``N_l``, ``fitted_bins`` and ``fitted_alpha`` the ``M_l`` and ``sig_alpha`` they were counted with (checked at
    #: load).
    state_names = ("counts", "widths", "fitted_bins", "fitted_alpha")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        layers = self.hyperparameters["layers"]
        for name in ("bins", "min_count", "alpha"):
            if len(self.hyperparameters[name]) != len(layers):
                raise ValueError(f"nac: {name} must have one value per layer ({len(layers)} layers {list(layers)}), "
                                 f"got {len(self.hyperparameters[name])}: {list(self.hyperparameters[name])}")
        self._targets = self._layer_targets(layers)
        self._counts: list[torch.Tensor] | None = None
        self._fit_count = 0

    def _layer_targets(self, layers: Sequence[str]) -> list[Target]:
        targets = []
        for layer in layers:
            try:
                split = resolve_split_point(self.model, layer)
            except (ValueError, AttributeError, IndexError) as error:
                raise ValueError(f"nac: layer {layer!r} cannot be read on {type(self.model).__name__}: {error}") from None
            targets.append((split.module, split.capture_input))
        if len(set(targets)) != len(targets):
            raise ValueError(f"nac: layers {list(layers)} name one tensor twice")
        return targets

    def resolve_defaults(self, model: nn.Module, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        if hyperparameters["layers"] is None:
            hyperparameters["layers"] = default_layers(model)
        count = len(hyperparameters["layers"])
        missing = [name for name in ("min_count", "bins", "alpha") if hyperparameters[name] is None]
        if missing:
            authors = AUTHORS_SETTINGS[family(model)]
            if count > len(authors):
                raise ValueError(f"nac: the authors publish settings for {len(authors)} layers, and {count} are read; "
                                 f"give {', '.join(missing)} with one value per layer")
            for position, name in enumerate(("min_count", "bins", "alpha")):
                if hyperparameters[name] is None:
                    hyperparameters[name] = tuple(entry[position] for entry in authors[:count])
        return hyperparameters

    def feature_splits(self) -> tuple:
        """Nothing from the shared pass: the layers and their gradients come from the method's own forward."""
        return ()

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        count = len(self.hyperparameters["layers"])
        return {"counts": (None,), "widths": (count,), "fitted_bins": (count,), "fitted_alpha": (count,)}

    # ------------------------------------------------------------------ the states of a batch
    def _pooled(self, pixel_values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the output and the gradient of :func:`uniform_kl_loss` with respect to it, each summed over the
        positions (:func:`pool_positions`), ``(B, N_l)`` in float32 or wider: the model's own forward (fed in its
        dtype) and one backward."""
        with torch.inference_mode(False), torch.enable_grad():
            # The input requires the gradient so that every layer's output does (the base model's parameters are
            # frozen); clone(): tensors made under inference mode cannot be saved for backward.
            inputs = pixel_values.detach().clone().to(parameter_dtype(self.model)).requires_grad_(True)
            captured, logits = capture_many(lambda: self.model(pixel_values=inputs).logits, self._targets, stop=False)
            missing = [layer for layer, target in zip(self.hyperparameters["layers"], self._targets)
                       if target not in captured]
            if missing:
                raise RuntimeError(f"nac: the forward never reached layers {missing}")
            outputs = [captured[target] for target in self._targets]
            gradients = torch.autograd.grad(uniform_kl_loss(logits.to(step_dtype(logits.dtype))), outputs,
                                            allow_unused=True)
        unused = [layer for layer, gradient in zip(self.hyperparameters["layers"], gradients) if gradient is None]
        if unused:
            raise ValueError(f"nac: the logits do not depend on the output of layers {unused}, so it has no gradient; "
                             "name layers on the way from the input to the logits")
        return [(pool_positions(output.detach().to(step_dtype(output.dtype))),
                 pool_positions(gradient.to(step_dtype(gradient.dtype))))
                for output, gradient in zip(outputs, gradients)]

    def _states(self, batch: BackbonePass) -> list[torch.Tensor]:
        """Per layer ``(B, N_l)`` neuron states; the forward and backward shared by the NAC detectors of the pass that
        read the same layers."""
        pooled = batch.memo(("nac pooled", self.hyperparameters["layers"]), lambda: self._pooled(batch.pixel_values))
        return [neuron_states(output, gradient, alpha)
                for (output, gradient), alpha in zip(pooled, self.hyperparameters["alpha"])]

    # ------------------------------------------------------------------ fitting: interval counts per neuron
    def fit_begin(self) -> None:
        self._counts, self._fit_count = None, 0

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        with full_precision(batch.pixel_values.device):
            states = self._states(batch)
            counts = [interval_counts(state, coverage_edges(bins)).cpu()
                      for state, bins in zip(states, self.hyperparameters["bins"])]
        self._counts = counts if self._counts is None else [a + b for a, b in zip(self._counts, counts)]
        self._fit_count += batch.pixel_values.shape[0]

    def fit_gather(self, shards: FitShards) -> None:
        # Counts add over the processes (a process without batches adds nothing, layer by layer).
        local: list[torch.Tensor | None] = (list(self._counts) if self._counts is not None
                                             else [None] * len(self.hyperparameters["layers"]))
        summed = [shards.sum(counts) for counts in local]
        gathered = [counts for counts in summed if counts is not None]
        self._counts = gathered if len(gathered) == len(summed) else None  # None: no process counted a sample
        total = shards.sum(torch.tensor([float(self._fit_count)], dtype=torch.float64))
        self._fit_count = 0 if total is None else int(round(float(total[0])))

    def fit_end(self) -> None:
        counts, self._counts = self._counts, None
        self.check_fit_count(self._fit_count)
        assert counts is not None  # samples were counted (check_fit_count)
        device = self.device
        self.counts = torch.cat([c.reshape(-1) for c in counts]).to(device)
        self.widths = torch.tensor([float(c.shape[1]) for c in counts if c is not None], dtype=torch.float64,
                                   device=device)
        self.fitted_bins = torch.tensor([float(m) for m in self.hyperparameters["bins"]], dtype=torch.float64,
                                        device=device)
        self.fitted_alpha = torch.tensor(self.hyperparameters["alpha"], dtype=torch.float64, device=device)
        self._prepare()
        self.fitted = True

    def _prepare(self) -> None:
        bins, alpha = list(self.hyperparameters["bins"]), list(self.hyperparameters["alpha"])
        fitted_bins = [int(m) for m in self.fitted_bins.tolist()]
        fitted_alpha = self.fitted_alpha.tolist()
        if fitted_bins != bins or fitted_alpha != alpha:
            raise ValueError(f"nac: the coverage was counted with bins {fitted_bins} and alpha {fitted_alpha}, not "
                             f"bins {bins} and alpha {alpha}; load it with the settings it was fitted with, or fit a new "
                             "detector")
        widths = [int(w) for w in self.widths.tolist()]
        if sum((m - 1) * n for m, n in zip(bins, widths)) != self.counts.numel():
            raise ValueError(f"nac: the saved widths {widths} and bins {bins} do not match counts "
                             f"{tuple(self.counts.shape)}")

    def layer_counts(self) -> list[torch.Tensor]:
        """Per layer the ``(M_l - 1, N_l)`` interval counts, views of the fitted buffer (wherever ``.to`` moved it)."""
        widths = [int(w) for w in self.widths.tolist()]
        sizes = [(m - 1) * n for m, n in zip(self.hyperparameters["bins"], widths)]
        return [block.view(m - 1, n)
                for block, m, n in zip(self.counts.split(sizes), self.hyperparameters["bins"], widths)]

    # ------------------------------------------------------------------ scoring
    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """The forward, the backward and the coverage in float32 or wider with autocast off
        (:mod:`hf_gsc.utils.precision`)."""
        with full_precision(batch.pixel_values.device):
            states = self._states(batch)
            scores = [coverage_scores(state, coverage_edges(bins), coverage_table(counts.to(state.device), min_count))
                      for state, bins, min_count, counts in zip(states, self.hyperparameters["bins"],
                                                                self.hyperparameters["min_count"], self.layer_counts())]
            return torch.stack(scores).mean(dim=0)
