"""ASH: activation shaping, variants P (prune), B (binarise), S (scale) (Djurisic et al., ICLR 2023)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..classifier.architectures import registered_architecture
from ..classifier.split_points import SplitPoint, resolve_split_point
from ..settings.config import DetectorConfig, number_check, setting, split_point_check
from ..utils.feature_shapings import FeatureShaping, register_feature_shaping
from ..utils.precision import full_precision, parameter_dtype, step_dtype
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import BaselineDetector
from .interface import register_detector


ASH_VARIANTS: tuple[str, ...] = ("p", "b", "s")

#: The percentile of the authors' code and paper (ASH-P/B/S at 90 on CIFAR, ASH-S at 90 on ImageNet ResNet-50).
DEFAULT_PERCENTILE = 90.0


def ash_keep_count(num_activations: int, percentile: float) -> int:
    """``n - round(n * p / 100)``: how many of a sample's ``n`` activations ASH keeps (authors' code)."""
    return num_activations - int(round(num_activations * percentile / 100.0))


def ash_shape(features: torch.Tensor, variant: str, percentile: float) -> torch.Tensor:
    """Activation shaping of each row of ``features`` ``(B, n)``, as ``ash_p`` / ``ash_b`` / ``ash_s`` of the ASH code.

    All variants keep the ``k = n - round(n p / 100)`` largest activations of a sample and zero the rest;
    then
        p: keep their values;
        b: give each of them ``s1 / k``, ``s1`` = the sample's sum of activations before pruning;
        s: multiply the pruned sample by ``exp(s1 / s2)``, ``s2`` = its sum after pruning (a sample
           whose ``s2`` is 0 is left pruned, unscaled, instead of becoming NaN).
    Returns:
        ``(B, n)``.
    """
    if variant not in ASH_VARIANTS:
        raise ValueError(f"ASH variant must be one of {ASH_VARIANTS}, got {variant!r}")
    k = ash_keep_count(features.shape[1], percentile)
    if k < 1:
        raise ValueError(f"ASH at percentile {percentile} keeps no activation of {features.shape[1]}; lower the percentile")
    s1 = features.sum(dim=1, keepdim=True)
    values, index = torch.topk(features, k, dim=1)
    if variant == "b":
        values = (s1 / k).expand_as(values)
    shaped = torch.zeros_like(features).scatter(1, index, values)
    if variant == "s":
        s2 = shaped.sum(dim=1, keepdim=True)
        scale = torch.where(s2 != 0, s1 / torch.where(s2 != 0, s2, torch.ones_like(s2)), torch.zeros_like(s2))
        shaped = shaped * torch.exp(scale)
    return shaped


def default_ash_percentile(model: nn.Module, variant: str) -> float:
    """The authors' percentile for this architecture and variant: 90 unless they changed it, which the registry
    records (:attr:`hf_gsc.classifier.architectures.ArchitectureSpec.ash_percentiles`)."""
    spec = registered_architecture(model)
    return DEFAULT_PERCENTILE if spec is None else spec.ash_percentiles.get(variant, DEFAULT_PERCENTILE)


def shaped_energy(batch: BackbonePass, split: SplitPoint, model: nn.Module,
                  shaping: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Energy of the head at the shaped feature of ``split`` (ASH's and SCALE's score): the shaping (a percentile cut,
    sums over thousands of activations, ``exp(s1 / s2)``), the head and the energy in float32 or wider with autocast
    off (:mod:`hf_gsc.utils.precision`); a bf16 model's head gets the shaped feature back in bf16 (its own modules)."""
    features = batch.features(split)
    with full_precision(features.device), torch.no_grad():
        flat = features.flatten(1).to(step_dtype(features.dtype))
        shaped = shaping(flat).view(features.shape)
        logits = split.head(shaped.to(parameter_dtype(model)), batch.pixel_values)
        return energy_score(logits.to(flat.dtype))


class ShapedEnergyDetector(BaselineDetector):
    """Energy of the head at a shaped activation of ``split_point`` (ASH's and SCALE's score, :func:`shaped_energy`);
    a subclass gives the shaping, :meth:`shape`, of the flattened feature ``(B, n)`` with its ``percentile``."""

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self.split = resolve_split_point(self.model, self.hyperparameters["split_point"])

    def feature_splits(self) -> tuple[SplitPoint, ...]:
        return (self.split,)

    def shape(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """The backbone in whatever precision it runs in; the shaping (a percentile cut, sums over thousands of
        activations, ``exp(s1 / s2)``), the head and the energy in float32 with autocast off (:mod:`hf_gsc.utils.precision`).
        A bf16 *model*'s head gets the shaped feature back in bf16 (its own modules) and its logits in float32."""
        return shaped_energy(batch, self.split, self.model, self.shape)


@dataclass
class ASHConfig(DetectorConfig):
    """Settings of activation shaping, shared by its three variants (:class:`ASHDetector`)."""

    percentile: float | None = setting(
        None, number_check(0.0, 100.0, optional=True),
        "Percentile of a sample's activations pruned; ``None``: the authors' value for the architecture, 90 (their "
        "CIFAR and ImageNet ResNet-50 ASH-S setting) or 95 for ASH-S on ViT (their ``vit_config.yml``), set when the "
        "detector is built (:func:`default_ash_percentile`).")
    split_point: str = setting(
        "penultimate", split_point_check(),
        "Where the activation is shaped; ``\"penultimate\"``: the input of the last ``nn.Linear``, where the authors "
        "shape it (after global average pooling for ResNet, the ``[CLS]`` token after the final LayerNorm for ViT).")


@dataclass
class ASHPConfig(ASHConfig):
    """Settings of ASH-P (:class:`ASHPDetector`)."""

    method: ClassVar[str] = "ash_p"


@dataclass
class ASHBConfig(ASHConfig):
    """Settings of ASH-B (:class:`ASHBDetector`)."""

    method: ClassVar[str] = "ash_b"


@dataclass
class ASHSConfig(ASHConfig):
    """Settings of ASH-S (:class:`ASHSDetector`)."""

    method: ClassVar[str] = "ash_s"


class ASHDetector(ShapedEnergyDetector):
    """Energy of the logits recomputed through the head from the ASH-shaped activation.

    Djurisic, Bozanic, Ashok, Liu, "Extremely Simple Activation Shaping for Out-of-Distribution
    Detection", ICLR 2023 (code: github.com/andrijazz/ash). No fitting: the threshold is per sample.

    Where: the authors shape the activation that feeds the classifier, after global average pooling for
    ResNet and on the ``[CLS]`` token after the final LayerNorm for ViT; that is ``split_point =
    "penultimate"`` here (the input of the last ``nn.Linear``) for every architecture. For ConvNeXt the
    authors shape before the final LayerNorm, which this split does not reproduce.
    ``split_point="final_encoder_output"`` shapes the whole last feature map (before pooling) instead.

    Settings: :class:`ASHConfig` (``ASHPConfig``, ``ASHBConfig``, ``ASHSConfig``, one per variant).
    """

    variant: ClassVar[str]
    search_space = {"percentile": (65.0, 70.0, 75.0, 80.0, 85.0, 90.0, 95.0)}
    search_space_source = "OpenOOD ash.yml: percentile_list [65, 70, 75, 80, 85, 90, 95], for each ASH variant"

    def resolve_defaults(self, model: nn.Module, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        if hyperparameters["percentile"] is None:
            hyperparameters["percentile"] = default_ash_percentile(model, self.variant)
        return hyperparameters

    def shape(self, flat: torch.Tensor) -> torch.Tensor:
        return ash_shape(flat, self.variant, self.hyperparameters["percentile"])


@register_detector
class ASHPDetector(ASHDetector):
    """ASH-P: prune all but the top ``100 - percentile`` % activations (see :class:`ASHDetector`)."""

    config_class = ASHPConfig
    variant = "p"


@register_detector
class ASHBDetector(ASHDetector):
    """ASH-B: prune, then binarise the kept activations to ``s1 / k`` (see :class:`ASHDetector`)."""

    config_class = ASHBConfig
    in_default_table = True
    variant = "b"


@register_detector
class ASHSDetector(ASHDetector):
    """ASH-S: prune, then scale by ``exp(s1 / s2)`` (see :class:`ASHDetector`)."""

    config_class = ASHSConfig
    variant = "s"


def _ash_feature_shaping(variant: str) -> FeatureShaping:
    """ASH-``variant``'s shaping and its authors' percentile, as GSC's ``feature_shaping="ash_<variant>"``."""

    def shape(features: torch.Tensor, percentile: float) -> torch.Tensor:
        return ash_shape(features, variant, percentile)

    def default_percentile(model: nn.Module) -> float:
        return default_ash_percentile(model, variant)

    return FeatureShaping(shape=shape, default_percentile=default_percentile)


# GSC's feature_shaping="ash_p" / "ash_b" / "ash_s" (and the "gsc_ash" method) shape F with ASH's own math.
for _variant in ASH_VARIANTS:
    register_feature_shaping(f"ash_{_variant}", _ash_feature_shaping(_variant))
