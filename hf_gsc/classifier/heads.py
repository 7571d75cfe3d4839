"""The head after a split point, in the two forms hf_gsc differentiates.

* :class:`HeadSpec`: ``y = W · norm(pool(F)) + b`` or ``W · pool(norm(F)) + b`` with an optional LayerNorm
  ``norm``; its derivatives are computed in closed form (:mod:`hf_gsc.classifier.head_jacobians`).
* :class:`ModuleHead`: the model's own head modules (final norm, pooler, classifier) and the few tensor
  operations (:data:`HEAD_OPERATIONS`) the model's ``forward`` does between them, run on ``F``; autograd
  differentiates it.

Module paths in both are dotted paths inside the model; :func:`bind_head_paths` resolves negative indices.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .head_jacobians import Pool, PoolNormLinearHead, pool


def submodule(model: nn.Module, path: str) -> nn.Module:
    """``model.get_submodule(path)`` for a normalised dotted path (names and non-negative indices).

    It runs several times per batch: a lookup in each module's ``_modules`` takes 0.1 µs per level, against
    1.5 µs for ``nn.Module.__getattr__`` and 6 µs for ``get_submodule`` (more right after the backbone, whose
    kernels evict the interpreter from the caches). Attribute lookup is the fallback, for its error message.
    """
    module = model
    for name in path.split("."):
        child = module._modules.get(name)
        module = getattr(module, name) if child is None else child
    return module


def block_list(model: nn.Module, path: str) -> nn.ModuleList | nn.Sequential:
    """The module at ``path`` in ``model`` as a list of blocks (or stages); any other module is refused."""
    blocks = model.get_submodule(path)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"{path} is a {type(blocks).__name__}, not a list of blocks (nn.ModuleList or nn.Sequential)")
    return blocks


def _parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    """``module.<name>`` for a registered parameter, without ``nn.Module.__getattr__``."""
    parameters = module._parameters
    return parameters[name] if name in parameters else getattr(module, name)


@dataclass(frozen=True)
class HeadSpec:
    """The head after the final encoder output, ``y = W · norm(pool(F)) + b`` or ``W · pool(norm(F)) + b``.

    Attributes:
        pool: how tokens or positions are reduced (see :data:`hf_gsc.classifier.head_jacobians.POOLS`).
        classifier: dotted path of the ``nn.Linear`` classifier.
        layernorm: dotted path of the final ``nn.LayerNorm``; ``None`` = none.
        norm_before_pool: the LayerNorm runs per token before pooling (Swin) rather than on the pooled
            vector. For ViT either order gives the same logits (LayerNorm is per token and the head reads
            the first token only); normalising after pooling is cheaper.
    """

    pool: Pool
    classifier: str
    layernorm: str | None = None
    norm_before_pool: bool = False

    def parameters(
        self, model: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The head's parameters in ``model``: classifier weight and bias, LayerNorm weight and bias."""
        linear = submodule(model, self.classifier)
        if not isinstance(linear, nn.Linear):
            raise ValueError(
                f"{self.classifier} is a {type(linear).__name__}, not nn.Linear: the model has no classifier "
                "(num_labels=0?), so there are no logits to short-circuit"
            )
        weight = _parameter(linear, "weight")
        if weight is None:
            raise ValueError(f"{self.classifier} has no weight: there are no logits to short-circuit")
        norm = self.layer_norm(model)
        if norm is None:
            return weight, _parameter(linear, "bias"), None, None
        return weight, _parameter(linear, "bias"), _parameter(norm, "weight"), _parameter(norm, "bias")

    def layer_norm(self, model: nn.Module) -> nn.LayerNorm | None:
        """The head's LayerNorm in ``model`` (``None`` without one); anything but a LayerNorm over the last
        dimension is refused."""
        if self.layernorm is None:
            return None
        norm = submodule(model, self.layernorm)
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise ValueError(f"{self.layernorm} must be an nn.LayerNorm over the last dimension, got {norm}")
        return norm

    def through_modules(self, model: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """The head run through ``model``'s own LayerNorm and Linear (nothing folded), for autograd through
        the encoder blocks before it: ``(B, *feature_shape) -> (B, K)``."""
        linear = submodule(model, self.classifier)
        if self.layernorm is None:
            return linear(pool(features, self.pool))
        norm = submodule(model, self.layernorm)
        if self.norm_before_pool:
            return linear(pool(norm(features), self.pool))
        return linear(norm(pool(features, self.pool)))

    def bind(self, model: nn.Module) -> PoolNormLinearHead:
        """The head with ``model``'s current parameters (LayerNorm affine part folded into the classifier)."""
        weight, bias, norm_weight, norm_bias = self.parameters(model)
        norm = self.layer_norm(model)
        norm_eps = None if norm is None else norm.eps
        return PoolNormLinearHead.fold(
            self.pool, weight, bias, norm_eps, norm_weight, norm_bias, self.norm_before_pool
        )

    def is_affine(self, model: nn.Module) -> bool:
        """Whether the head is affine in ``F`` (then ``g`` is input independent): no LayerNorm."""
        return self.layernorm is None

    def describe(self) -> str:
        """``norm → pool → classifier`` in the order the head applies them."""
        steps = [f"@{self.pool}", self.classifier]
        if self.layernorm is not None:
            steps.insert(0 if self.norm_before_pool else 1, self.layernorm)
        return " → ".join(steps)


def reproduces_logits(head: HeadSpec, model: nn.Module, features: torch.Tensor, logits: torch.Tensor) -> bool:
    """Whether the closed-form ``head`` of ``model`` maps ``features`` to ``logits`` (a head found from a model's
    structure is accepted only then); ``False`` also where the shapes do not fit its form."""
    try:
        with torch.no_grad():
            candidate = head.bind(model)(features)
    except (RuntimeError, ValueError):  # shapes that do not fit this form
        return False
    return candidate.shape == logits.shape and torch.allclose(candidate, logits, rtol=1e-4, atol=1e-5)


def _mean_patch_tokens(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return tokens[:, 1:].mean(dim=1)


def _first_token_and_mean_patch_tokens(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """DINOv2: ``[CLS, mean of the patch tokens]``; register tokens (after CLS) are left out."""
    registers = getattr(model.config, "num_register_tokens", 0)
    return torch.cat([tokens[:, 0], tokens[:, 1 + registers :].mean(dim=1)], dim=1)


def _mean_of_classifiers(classifier: str, distillation: str) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """Distilled models at inference: the average of the classifier's and the distillation classifier's logits."""
    def mean(model: nn.Module, pooled: torch.Tensor) -> torch.Tensor:
        return (submodule(model, classifier)(pooled) + submodule(model, distillation)(pooled)) / 2

    return mean


def _mean_of_cls_and_distillation_token_classifiers(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """DeiT with teacher: the CLS token's classifier and the distillation token's (the second), averaged."""
    return (submodule(model, "cls_classifier")(tokens[:, 0])
            + submodule(model, "distillation_classifier")(tokens[:, 1])) / 2


def _timm_forward_head(model: nn.Module, features: torch.Tensor) -> torch.Tensor:
    """timm's own head, ``forward_head`` (global pool, norm, dropout, classifier as the model builds them), of the
    timm model inside transformers' ``TimmWrapperForImageClassification`` or of the model itself."""
    root: nn.Module = getattr(model, "timm_model", model)
    # timm's method, which nn.Module's type does not know: its type is what timm documents.
    forward_head: Callable[[torch.Tensor], torch.Tensor] = getattr(root, "forward_head")
    return forward_head(features)


def _perceiver_decoder(model: nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """Perceiver: the cross-attention classification decoder; its query depends on the batch size only."""
    from transformers.models.perceiver.modeling_perceiver import PerceiverClassificationDecoder

    decoder = submodule(model, "perceiver.decoder")
    if not isinstance(decoder, PerceiverClassificationDecoder):
        raise ValueError(f"@perceiver_decoder: perceiver.decoder is a {type(decoder).__name__}, not transformers' "
                         "PerceiverClassificationDecoder")
    return decoder(decoder.decoder_query(latents), z=latents).logits


#: Tensor operations of a :class:`ModuleHead` (``"@name"`` in its steps): ``(model, x) -> x'``, and whether
#: each is linear in ``x``.
HEAD_OPERATIONS: dict[str, tuple[Callable[[nn.Module, torch.Tensor], torch.Tensor], bool]] = {
    "first_token": (lambda model, x: pool(x, "first_token"), True),
    "mean_tokens": (lambda model, x: pool(x, "mean_tokens"), True),
    "mean_spatial": (lambda model, x: x.mean(dim=(-2, -1)), True),
    "flatten": (lambda model, x: x.flatten(1), True),
    "mean_patch_tokens": (_mean_patch_tokens, True),
    "first_token_and_mean_patch_tokens": (_first_token_and_mean_patch_tokens, True),
    "mean_of_head_and_dist_head": (_mean_of_classifiers("head", "dist_head"), True),
    "mean_of_classifier_and_classifier_distill": (_mean_of_classifiers("classifier", "classifier_distill"), True),
    "mean_of_cls_and_distillation_token_classifiers": (_mean_of_cls_and_distillation_token_classifiers, True),
    "perceiver_decoder": (_perceiver_decoder, False),
    # A head timm builds of other parts than a HeadSpec's (hf_gsc.classifier.timm_models): linear or not, unknown.
    "timm_forward_head": (_timm_forward_head, False),
}

#: Modules that are affine maps of their input in eval mode, and containers that only chain their children.
_AFFINE_MODULES = (
    nn.Linear, nn.Identity, nn.Dropout, nn.Flatten, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AvgPool1d,
    nn.AvgPool2d, nn.BatchNorm1d, nn.BatchNorm2d,
)
_CHAINING_MODULES = (nn.Sequential,)


def first_tensor(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


@dataclass(frozen=True)
class ModuleHead:
    """The head as the model's own modules and tensor operations, applied in order to ``F``.

    Attributes:
        steps: dotted module paths (called on the running tensor; a tuple output gives its first element)
            and ``"@name"`` entries of :data:`HEAD_OPERATIONS`.
        affine: whether the head is affine in ``F``; ``None`` = decided from the module types (every module
            in the steps an affine layer in eval mode, every operation linear).
    """

    steps: tuple[str, ...]
    affine: bool | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s.startswith("@") and s[1:] not in HEAD_OPERATIONS]
        if unknown:
            raise ValueError(f"unknown head operations {unknown}; known: {sorted(HEAD_OPERATIONS)}")

    def through_modules(self, model: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """``(B, *feature_shape) -> (B, K)`` through the model's modules."""
        x = features
        for step in self.steps:
            if step.startswith("@"):
                x = HEAD_OPERATIONS[step[1:]][0](model, x)
            else:
                x = first_tensor(submodule(model, step)(x))
        return x

    def is_affine(self, model: nn.Module) -> bool:
        """Whether the head is affine in ``F``: as declared, else from the module types. A module of another type
        (a custom pooler, a norm with an activation) counts as nonlinear, whatever its children."""
        if self.affine is not None:
            return self.affine
        for step in self.steps:
            if step.startswith("@"):
                if not HEAD_OPERATIONS[step[1:]][1]:
                    return False
                continue
            for module in submodule(model, step).modules():
                if not isinstance(module, _AFFINE_MODULES + _CHAINING_MODULES):
                    return False
        return True

    def describe(self) -> str:
        """The steps in the order the head applies them."""
        return " → ".join(self.steps)


Head = HeadSpec | ModuleHead


def normalise_path(model: nn.Module, path: str, what: str = "split point") -> str:
    """``path`` with negative indices resolved by attribute lookup; the error names the failing component."""
    module: Any = model
    parts: list[str] = []
    for part in path.split("."):
        if re.fullmatch(r"-?[0-9]+", part):
            if not isinstance(module, (nn.ModuleList, nn.Sequential)):
                raise ValueError(f"{what} {path!r}: {'.'.join(parts) or 'model'} is not indexable")
            index = int(part)
            if not -len(module) <= index < len(module):
                raise ValueError(f"{what} {path!r}: index {index} out of range for {len(module)} blocks")
            index %= len(module)
            module, part = module[index], str(index)
        else:
            child = module._modules.get(part) if isinstance(module, nn.Module) else None
            if child is None:
                raise ValueError(f"{what} {path!r}: {'.'.join(parts) or 'the model'} has no submodule {part!r}")
            module = child
        parts.append(part)
    return ".".join(parts)


def bind_head_paths(model: nn.Module, head: Head) -> Head:
    """``head`` with its module paths normalised on ``model`` (negative indices resolved, existence checked)."""
    def normal(path: str) -> str:
        return normalise_path(model, path, what="head module")

    if isinstance(head, HeadSpec):
        norm = None if head.layernorm is None else normal(head.layernorm)
        return dataclasses.replace(head, classifier=normal(head.classifier), layernorm=norm)
    return dataclasses.replace(head, steps=tuple(s if s.startswith("@") else normal(s) for s in head.steps))
