"""Everything hf_gsc knows per architecture: where the final encoder output ``F`` is and what reads it.

:data:`ARCHITECTURES` maps a transformers ``model_type`` (and :data:`CLASS_ARCHITECTURES` a class name) to an
:class:`ArchitectureSpec`: the module whose output is ``F`` (the output of the last encoder block or stage,
before the final norm, pooler and classifier) and the head from ``F`` to the logits, a closed-form
:class:`~hf_gsc.classifier.heads.HeadSpec` or the model's own modules as a :class:`~hf_gsc.classifier.heads.ModuleHead`.

A model type that is not registered is found from its structure (:func:`discover_architecture`): the
encoder's block list and a head of the :class:`~hf_gsc.classifier.heads.HeadSpec` form, accepted only when that head
reproduces the model's own logits. :data:`NOT_APPLICABLE` says why a split at the final encoder output does not
apply to a model type. ``python -m hf_gsc.classifier.architectures`` prints the table of ``docs/architectures.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .head_jacobians import Pool
from .heads import (
    Head,
    HeadSpec,
    ModuleHead,
    bind_head_paths,
    block_list,
    first_tensor,
    normalise_path,
    reproduces_logits,
)
from .timm_models import example_pixel_values, features_and_logits, is_timm_model, timm_head


@dataclass(frozen=True)
class ArchitectureSpec:
    """How one family of ``*ForImageClassification`` models is split at its final encoder output.

    Attributes:
        blocks: dotted path of the ``nn.ModuleList`` of encoder blocks or stages.
        head: the head from the final encoder output ``F`` to the logits.
        blocks_take_hidden_only: whether ``block(hidden)`` alone runs a block, so a split at an
            earlier block can run the remaining blocks directly instead of replaying the model.
        final: the module whose output is ``F``; ``None`` = the last of ``blocks``. Set where the encoder
            ends with layers outside its block list (EfficientNet's top convolution, MobileNetV2's last 1x1
            convolution) or the block list is nested (PVT).
        inner_blocks: the attribute of a stage that holds its blocks (Swin: ``"blocks"``), for the ablation
            split points one and two blocks before the end; ``None`` = the entries of ``blocks`` are blocks.
        ash_percentiles: ASH variant -> the percentile its authors use on this architecture, where they
            changed the default (see :func:`hf_gsc.detectors.ash.default_ash_percentile`).
    """

    blocks: str
    head: Head
    blocks_take_hidden_only: bool = False
    final: str | None = None
    inner_blocks: str | None = None
    ash_percentiles: Mapping[str, float] = field(default_factory=dict)

    @property
    def final_path(self) -> str:
        """The (unnormalised) module path whose output is ``F``."""
        return self.final if self.final is not None else f"{self.blocks}.-1"

    def blocks_before_final(self, model: nn.Module, count: int) -> str:
        """The module path of the encoder block ``count`` blocks before the final encoder output (1 or 2)."""
        blocks = block_list(model, self.blocks)
        if self.inner_blocks is not None:
            # Stages hold blocks; the last stage's blocks are the last blocks of the encoder.
            last = len(blocks) - 1
            inner = len(getattr(blocks[last], self.inner_blocks))
            if inner >= count + 1:
                return f"{self.blocks}.{last}.{self.inner_blocks}.{inner - 1 - count}"
            return f"{self.blocks}.{last - 1}"
        if len(blocks) < 3:
            raise ValueError(f"{self.blocks} has {len(blocks)} blocks; the split-point table needs at least 3")
        return f"{self.blocks}.-{count + 1}"


def _swin_like(base: str, layernorm: str | None = "layernorm") -> ArchitectureSpec:
    norm = None if layernorm is None else f"{base}.{layernorm}"
    return ArchitectureSpec(
        f"{base}.encoder.layers", HeadSpec("mean_tokens", "classifier", norm, norm_before_pool=norm is not None),
        inner_blocks="blocks",
    )


def _vit_like(base: str, blocks: str = "layers", **spec: Any) -> ArchitectureSpec:
    return ArchitectureSpec(f"{base}.{blocks}", HeadSpec("first_token", "classifier", f"{base}.layernorm"), True, **spec)


def _beit_like(base: str, blocks: str) -> ArchitectureSpec:
    # The pooler averages the patch tokens and normalises (use_mean_pooling), or takes the normalised CLS token.
    return ArchitectureSpec(f"{base}.{blocks}", ModuleHead((f"{base}.layernorm", f"{base}.pooler", "classifier")))


def _clip_like() -> ArchitectureSpec:
    # The encoder's output is not normalised (post_layernorm only normalises the unused pooled CLS token).
    return ArchitectureSpec("vision_model.encoder.layers", ModuleHead(("@mean_patch_tokens", "classifier")))


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "vit": _vit_like("vit", ash_percentiles={"s": 95.0}),  # the ASH authors' vit_config.yml runs ash_s@95
    "deit": _vit_like("deit"),
    "vit_msn": _vit_like("vit"),
    "swin": _swin_like("swin"),
    "swinv2": _swin_like("swinv2"),
    "donut-swin": _swin_like("donut", layernorm=None),
    "focalnet": ArchitectureSpec(
        "focalnet.encoder.stages", HeadSpec("mean_tokens", "classifier", "focalnet.layernorm", norm_before_pool=True)
    ),
    "resnet": ArchitectureSpec("resnet.encoder.stages", HeadSpec("mean_spatial", "classifier.1"), True),
    "regnet": ArchitectureSpec("regnet.encoder.stages", HeadSpec("mean_spatial", "classifier.1")),
    "convnext": ArchitectureSpec(
        "convnext.encoder.stages", HeadSpec("mean_spatial", "classifier", "convnext.layernorm"), True
    ),
    "convnextv2": ArchitectureSpec(
        "convnextv2.encoder.stages", HeadSpec("mean_spatial", "classifier", "convnextv2.layernorm")
    ),
    "beit": _beit_like("beit", "layers"),
    "data2vec-vision": _beit_like("data2vec_vision", "encoder.layer"),
    "dinov2": ArchitectureSpec(
        "dinov2.encoder.layer",
        ModuleHead(("dinov2.layernorm", "@first_token_and_mean_patch_tokens", "classifier")),
    ),
    "dinov2_with_registers": ArchitectureSpec(
        "dinov2_with_registers.encoder.layer",
        ModuleHead(("dinov2_with_registers.layernorm", "@first_token_and_mean_patch_tokens", "classifier")),
    ),
    "ijepa": ArchitectureSpec(
        "ijepa.layers", HeadSpec("mean_tokens", "classifier", "ijepa.layernorm", norm_before_pool=True)
    ),
    "clip": _clip_like(),
    "metaclip_2": _clip_like(),
    "siglip": ArchitectureSpec(
        "vision_model.encoder.layers",
        HeadSpec("mean_tokens", "classifier", "vision_model.post_layernorm", norm_before_pool=True),
    ),
    "hiera": ArchitectureSpec("hiera.encoder.stages", HeadSpec("mean_tokens", "classifier", "hiera.pooler.layernorm")),
    "bit": ArchitectureSpec("bit.encoder.stages", ModuleHead(("bit.norm", "bit.pooler", "classifier"))),
    # F: the last layer's tokens, the CLS token first (CvtForImageClassification runs only with cls_token[-1]
    # set); the head normalises the CLS token alone.
    "cvt": ArchitectureSpec(
        "cvt.encoder.stages", HeadSpec("first_token", "classifier", "layernorm"), final="cvt.encoder.stages.-1.layers.-1"
    ),
    "efficientnet": ArchitectureSpec(
        "efficientnet.encoder.blocks", ModuleHead(("efficientnet.pooler", "@flatten", "classifier")),
        final="efficientnet.encoder.top_activation",
    ),
    "hgnet_v2": ArchitectureSpec("encoder.stages", HeadSpec("mean_spatial", "fc")),
    "textnet": ArchitectureSpec("textnet.encoder.stages", HeadSpec("mean_spatial", "fc")),
    "levit": ArchitectureSpec(
        "levit.encoder.stages", ModuleHead(("@mean_tokens", "classifier"), affine=True)  # BatchNorm1d + Linear
    ),
    "mobilenet_v1": ArchitectureSpec("mobilenet_v1.layer", HeadSpec("mean_spatial", "classifier")),
    "mobilenet_v2": ArchitectureSpec(
        "mobilenet_v2.layer", HeadSpec("mean_spatial", "classifier"), final="mobilenet_v2.conv_1x1"
    ),
    "mobilevit": ArchitectureSpec(
        "mobilevit.encoder.layer", HeadSpec("mean_spatial", "classifier"), final="mobilevit.conv_1x1_exp"
    ),
    "mobilevitv2": ArchitectureSpec("mobilevitv2.encoder.layer", HeadSpec("mean_spatial", "classifier")),
    "perceiver": ArchitectureSpec(
        "perceiver.encoder.self_attends", ModuleHead(("@perceiver_decoder",)),
        # The self-attention blocks run num_blocks times over; the encoder's output is the last run's.
        final="perceiver.encoder",
    ),
    "poolformer": ArchitectureSpec(
        "poolformer.encoder.block", ModuleHead(("norm", "@mean_spatial", "classifier")),
        final="poolformer.encoder.block.-1.-1",
    ),
    "pvt": ArchitectureSpec(
        "pvt.encoder.block", HeadSpec("first_token", "classifier", "pvt.encoder.layer_norm"),
        final="pvt.encoder.block.-1.-1",
    ),
    "pvt_v2": ArchitectureSpec(
        "pvt_v2.encoder.layers",
        HeadSpec("mean_tokens", "classifier", "pvt_v2.encoder.layers.-1.layer_norm", norm_before_pool=True),
        final="pvt_v2.encoder.layers.-1.blocks.-1",
    ),
    "segformer": ArchitectureSpec(
        "segformer.stages",
        HeadSpec("mean_tokens", "classifier", "segformer.stages.-1.layer_norm", norm_before_pool=True),
        final="segformer.stages.-1.blocks.-1",
    ),
    "swiftformer": ArchitectureSpec(
        "swiftformer.encoder.network", ModuleHead(("norm", "@mean_spatial", "@mean_of_head_and_dist_head"))
    ),
}

#: The other classes of a model type in transformers' mapping (distilled variants, other input preprocessors), by
#: class name: their heads differ from the first class's, or they are listed to be tested and documented.
CLASS_ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "DeiTForImageClassificationWithTeacher": dataclasses.replace(
        ARCHITECTURES["deit"], head=ModuleHead(("deit.layernorm", "@mean_of_cls_and_distillation_token_classifiers"))
    ),
    "LevitForImageClassificationWithTeacher": dataclasses.replace(
        ARCHITECTURES["levit"],
        head=ModuleHead(("@mean_tokens", "@mean_of_classifier_and_classifier_distill"), affine=True),
    ),
    # Other input preprocessors, the same latents and decoder.
    "PerceiverForImageClassificationFourier": ARCHITECTURES["perceiver"],
    "PerceiverForImageClassificationConvProcessing": ARCHITECTURES["perceiver"],
}

#: Model types of transformers' image-classification mapping that wrap a timm model: ``F`` and the head are read from
#: timm's ``forward_features`` / ``forward_head`` (:func:`timm_architecture`), and why.
TIMM_MODEL_TYPES: dict[str, str] = {
    "timm_wrapper": "TimmWrapperForImageClassification (every timm checkpoint on the Hub): `F` is the output of its "
    "timm model's `forward_features`, the head timm's `forward_head` (needs the `[timm]` extra)",
}

#: Model types of transformers' image-classification mapping where a final encoder output does not apply,
#: and why.
NOT_APPLICABLE: dict[str, str] = {
    "imagegpt": "ImageGPT classifies sequences of colour-cluster ids (input_ids), not pixel_values",
    "shieldgemma2": "ShieldGemma 2 is a vision-language model whose two logits are next-token scores of a "
    "text prompt; it takes input_ids as well as pixel_values",
    "siglip2": "SigLIP 2 takes patchified pixel_values with pixel_attention_mask and spatial_shapes, which "
    "GSCForImageClassification does not pass",
    "pp_lcnet": "PPLCNetForImageClassification's forward returns no logits (a BaseModelOutputWithNoAttention)",
    "dinat": "DiNAT needs the natten package (neighbourhood-attention kernels), which is not a dependency",
}


def registered_architecture(model: nn.Module) -> ArchitectureSpec | None:
    """The registered spec for ``model``'s class (:data:`CLASS_ARCHITECTURES`) or model type, or ``None``."""
    spec = CLASS_ARCHITECTURES.get(type(model).__name__)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return spec if spec is not None or not isinstance(model_type, str) else ARCHITECTURES.get(model_type)


_BLOCK_LIST_NAMES = ("layer", "layers", "stages", "block", "blocks")
_FINAL_NORM_NAMES = ("layernorm", "layer_norm", "norm", "post_layernorm", "pooler.layernorm")


def _example_pixel_values(model: nn.Module) -> torch.Tensor:
    """Two random images of the size and channel count in ``model.config`` or its ``vision_config`` (224 x 224 x 3
    if it names none)."""
    config = getattr(model.config, "vision_config", None) or model.config
    size = getattr(config, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    parameter = next(model.parameters())
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, getattr(config, "num_channels", 3), height, width, generator=generator)
    return images.to(dtype=parameter.dtype, device=parameter.device)


def _output_of(model: nn.Module, path: str, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output of the module at path, logits)`` of one forward pass."""
    captured: list[torch.Tensor] = []
    handle = model.get_submodule(path).register_forward_hook(lambda _m, _a, out: captured.append(first_tensor(out)))
    try:
        with torch.no_grad():
            logits = model(pixel_values=pixel_values).logits
    finally:
        handle.remove()
    return captured[-1], logits


def discover_architecture(model: nn.Module) -> ArchitectureSpec:
    """Find ``F`` and a closed-form head of an unregistered model from its structure, and check them.

    The blocks are the base model's (or vision tower's) ``encoder.<layer|layers|stages|block|blocks>`` (or the
    same names on it directly), ``F`` is the last block's output, the classifier is the last ``nn.Linear`` and the
    final norm a LayerNorm named ``layernorm``, ``layer_norm``, ``norm``, ``post_layernorm`` or
    ``pooler.layernorm`` on the base model. Each
    :class:`HeadSpec` these allow (first token or mean over tokens for ``(B, N, D)`` features, mean over space
    for ``(B, C, H, W)``; the norm before or after pooling, or none) is tried on one forward pass of two random
    images; the first that reproduces the model's logits is the head.

    Raises:
        ValueError: no block list, or no head of that form reproduces the logits; the message says what
            was tried and what to pass instead.
    """
    model_type = getattr(model.config, "model_type", None)
    # The backbone: the base model (its attribute is named by base_model_prefix), a vision tower, or the model.
    # base_model_prefix: transformers' class attribute (architecture_for checked the model has one).
    names = (getattr(model, "base_model_prefix", None), "vision_model")
    bases = [f"{name}." for name in names if isinstance(name, str) and isinstance(_get(model, name), nn.Module)]
    candidates = [f"{base}{owner}{name}" for base in bases + [""] for owner in ("encoder.", "") for name in _BLOCK_LIST_NAMES]
    blocks, block_count = None, 0
    for path in candidates:
        found = _get(model, path)
        if isinstance(found, nn.ModuleList) and len(found):
            blocks, block_count = path, len(found)
            break
    base = next((b for b in bases if blocks is not None and blocks.startswith(b)), "")
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    advice = (
        "pass split_point='penultimate' or a dotted module path (for example 'encoder.layers.-1'), or register the "
        "architecture in hf_gsc.classifier.architectures.ARCHITECTURES"
    )
    if blocks is None or not linears:
        raise ValueError(
            f"split_point='final_encoder_output' is not registered for model type {model_type!r}, and its structure "
            f"has no {'encoder block list (tried ' + ', '.join(candidates) + ')' if blocks is None else 'nn.Linear'}; "
            + advice
        )
    norms = [None] + [f"{base}{n}" for n in _FINAL_NORM_NAMES if isinstance(_get(model, f"{base}{n}"), nn.LayerNorm)]
    features, logits = _output_of(model, f"{blocks}.{block_count - 1}", _example_pixel_values(model))
    pools: tuple[Pool, ...] = ("mean_spatial",) if features.dim() == 4 else ("first_token", "mean_tokens") if features.dim() == 3 else ()
    tried = []
    for kind in pools:
        for norm in norms:
            for before in (False, True) if norm is not None and kind != "mean_spatial" else (False,):
                head = HeadSpec(kind, linears[-1], norm, norm_before_pool=before)
                tried.append(head.describe())
                if reproduces_logits(head, model, features, logits):
                    return ArchitectureSpec(blocks, head)
    raise ValueError(
        f"split_point='final_encoder_output' is not registered for model type {model_type!r}, and no head of the "
        f"pool / LayerNorm / linear form on the output of {blocks}.-1 {tuple(features.shape[1:])} reproduces its "
        f"logits (tried: {'; '.join(tried) or 'none for this feature rank'}); " + advice
    )


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def timm_architecture(model: nn.Module) -> ArchitectureSpec:
    """The spec of a timm model (transformers' ``TimmWrapperForImageClassification``, or any model with timm's
    ``forward_features`` / ``forward_head``): ``F`` is the output of ``forward_features``, taken at the module that
    returns it, and the head is timm's, in closed form where timm builds it as pool, LayerNorm or nothing, then
    the linear classifier (:mod:`hf_gsc.classifier.timm_models`).

    Its ``blocks`` is ``F``'s module: no block list of a timm model is read (the ablations' split points before ``F``
    and ``earlier_split_point`` are for registered architectures).

    Raises:
        ValueError: no module returns ``forward_features``' output (the message says what to pass instead).
    """
    final, features, logits = features_and_logits(model, example_pixel_values(model))
    return ArchitectureSpec(final, timm_head(model, features, logits), final=final)


def encoder_blocks(model: nn.Module, reader: str) -> nn.ModuleList | nn.Sequential:
    """The list of encoder blocks (or stages) of ``model``, for a method that reads them (``reader`` names it).

    Raises:
        ValueError: the model exposes no such list: a timm model is read at ``forward_features``' output only (its
            spec's ``blocks`` is that module), so methods that read inner blocks do not apply to it.
    """
    spec = architecture_for(model)
    blocks = model.get_submodule(spec.blocks)
    # A timm model's spec names forward_features' output module as its blocks (a ResNet's last stage: its entries
    # are that stage's blocks, not the encoder's stages), so a method reading stages would read the wrong ones.
    if is_timm_model(model) or not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(f"{reader} reads the encoder's blocks, and model type {model_type!r} exposes no list of "
                         f"them here ({spec.blocks!r} is a {type(blocks).__name__}; timm models are read at "
                         f"forward_features' output only)")
    return blocks


def architecture_for(model: nn.Module) -> ArchitectureSpec:
    """The spec of ``model``: registered (:data:`ARCHITECTURES`), a timm model's (:func:`timm_architecture`) or
    discovered (:func:`discover_architecture`).

    Raises:
        ValueError: the model type is in :data:`NOT_APPLICABLE` (the message says why), or discovery fails.
    """
    spec = registered_architecture(model)
    if spec is not None:
        return spec
    if is_timm_model(model):
        return timm_architecture(model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in NOT_APPLICABLE:
        raise ValueError(
            f"split_point='final_encoder_output' does not apply to model type {model_type!r}: "
            f"{NOT_APPLICABLE[model_type]}. Use a vision classifier taking pixel_values, or pass a dotted module "
            "path inside the model as split_point"
        )
    if getattr(model, "config", None) is None or not hasattr(model, "base_model_prefix"):
        raise ValueError(
            "split_point='final_encoder_output' needs a transformers *ForImageClassification model (with a config); "
            "pass split_point='penultimate' or a dotted module path"
        )
    return discover_architecture(model)


def supported_architectures_table() -> str:
    """The table of supported architectures (``docs/architectures.md``), from :data:`ARCHITECTURES`, :data:`CLASS_ARCHITECTURES`,
    :data:`TIMM_MODEL_TYPES` and :data:`NOT_APPLICABLE`.

    Each row is resolved on the architecture's default configuration, built on the ``meta`` device (no
    weights are allocated), so the head form and whether ``g`` depends on the input are those of the real
    modules.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

    rows = [
        "| model type | classes | final encoder output `F` | head (in order) | closed form | `g` depends on the input |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model_type in sorted(ARCHITECTURES):
        names = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES[model_type]
        # One row per distinct spec of the model type's classes, built as its first class.
        by_spec: dict[int, list[str]] = {}
        for name in names if isinstance(names, tuple) else (names,):
            by_spec.setdefault(id(CLASS_ARCHITECTURES.get(name, ARCHITECTURES[model_type])), []).append(name)
        for class_names in by_spec.values():
            rows.append(_table_row(model_type, class_names))
    rows.append("")
    rows.append("Read from timm's `forward_features` / `forward_head` (see the timm section below):")
    rows.append("")
    rows.extend(f"- {model_type}: {reason}." for model_type, reason in sorted(TIMM_MODEL_TYPES.items()))
    rows.append("")
    rows.append("Not applicable at `final_encoder_output`:")
    rows.append("")
    rows.extend(f"- {model_type}: {reason}." for model_type, reason in sorted(NOT_APPLICABLE.items()))
    return "\n".join(rows)


def _table_row(model_type: str, class_names: list[str]) -> str:
    """The table row of ``class_names`` of ``model_type``, resolved on the first class at the default configuration."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with torch.device("meta"):
        model = getattr(transformers, class_names[0])(CONFIG_MAPPING[model_type]())
    spec = registered_architecture(model)
    if spec is None:
        raise ValueError(f"model type {model_type!r} ({class_names[0]}) is not registered in ARCHITECTURES")
    head = bind_head_paths(model, spec.head)
    closed = "yes" if isinstance(head, HeadSpec) else "no (autograd)"
    depends = "no" if head.is_affine(model) else "yes"
    final = normalise_path(model, spec.final_path)
    classes = ", ".join(class_names)
    return f"| {model_type} | {classes} | `{final}` | `{head.describe()}` | {closed} | {depends} |"


if __name__ == "__main__":
    print(supported_architectures_table())
