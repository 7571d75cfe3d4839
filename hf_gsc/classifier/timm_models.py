"""timm models: ``F`` is what timm's ``forward_features`` returns, and the head is timm's ``forward_head``.

Every timm checkpoint on the Hub loads through ``AutoModelForImageClassification`` as transformers'
``TimmWrapperForImageClassification`` (model type ``timm_wrapper``), whose ``timm_model`` is the timm model itself;
timm splits every classifier in two methods, ``forward_features`` (stem, stages or blocks, and whatever norm the
architecture applies before its head) and ``forward_head`` (global pooling, an optional norm, dropout, classifier).
GSC's final encoder output is the first's output, found as the module that returns it
(:func:`timm_architecture`); the head is read as timm builds it:

* its global pool: ``global_pool`` of the model or of its ``head`` (``"avg"``: the mean over the positions of a
  ``(B, C, H, W)`` map or of a channels-last ``(B, H, W, C)`` / ``(B, N, C)`` one, ``"token"``: the first token,
  ``""``: none);
* its norm after pooling: ``fc_norm`` (ViT) or ``head.norm`` (ConvNeXt's ``NormMlpClassifierHead``), when a
  LayerNorm, and no other layer between pool and classifier (``pre_logits`` and dropout are identities in eval);
* its classifier: ``get_classifier()``, an ``nn.Linear``.

That head is accepted only when it reproduces ``forward_head(F)`` on two random images; otherwise (another pool, a
norm of another kind, a hidden layer in the head) the head is ``forward_head`` itself, differentiated by autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .head_jacobians import Pool
from .heads import HeadSpec, ModuleHead, reproduces_logits


@dataclass(frozen=True)
class TimmRoot:
    """The timm model inside a model: its path prefix (``"timm_model."`` in a transformers
    ``TimmWrapperForImageClassification``, ``""`` for the timm model itself), the module, and timm's two halves of
    its forward (methods timm defines, which ``nn.Module``'s type does not know)."""

    prefix: str
    module: nn.Module
    forward_features: Callable[[torch.Tensor], torch.Tensor]
    forward_head: Callable[[torch.Tensor], torch.Tensor]


def timm_root(model: nn.Module) -> TimmRoot | None:
    """The timm model inside ``model`` (:class:`TimmRoot`), or ``None`` when ``model`` exposes neither
    ``forward_features`` nor ``forward_head``, itself or as its ``timm_model``."""
    for prefix, module in (("timm_model.", getattr(model, "timm_model", None)), ("", model)):
        if isinstance(module, nn.Module):
            features, head = getattr(module, "forward_features", None), getattr(module, "forward_head", None)
            if callable(features) and callable(head):
                return TimmRoot(prefix, module, features, head)
    return None


def _timm_root(model: nn.Module) -> TimmRoot:
    found = timm_root(model)
    if found is None:
        raise ValueError(f"{type(model).__name__} is not a timm model: it has no forward_features and forward_head, "
                         "itself or as its timm_model")
    return found


def is_timm_model(model: nn.Module) -> bool:
    """Whether ``model`` is (or wraps) a timm model with ``forward_features`` and ``forward_head``."""
    return timm_root(model) is not None


def timm_classifier_path(model: nn.Module) -> str | None:
    """The dotted path of timm's classifier (``get_classifier()``) when it is an ``nn.Linear``, else ``None``."""
    found = timm_root(model)
    get_classifier = None if found is None else getattr(found.module, "get_classifier", None)
    if found is None or not callable(get_classifier):
        return None
    classifier = get_classifier()
    if not isinstance(classifier, nn.Linear):
        return None
    return next((found.prefix + name for name, module in found.module.named_modules() if module is classifier), None)


def example_pixel_values(model: nn.Module) -> torch.Tensor:
    """Two random images of the size the model takes: its patch embedding's ``img_size`` where it has a fixed one
    (ViT, Swin built with another ``img_size`` than their ``pretrained_cfg`` says), else the ``input_size`` of timm's
    ``pretrained_cfg`` (224 x 224 x 3 if none); in the model's dtype and on its device."""
    root = _timm_root(model).module
    config = getattr(root, "pretrained_cfg", None) or getattr(root, "default_cfg", None) or {}
    channels, height, width = tuple(config.get("input_size", (3, 224, 224)))
    fixed = getattr(getattr(root, "patch_embed", None), "img_size", None)
    if fixed is not None:
        height, width = (fixed, fixed) if isinstance(fixed, int) else tuple(fixed)[-2:]
    parameter = next(model.parameters())
    images = torch.randn(2, channels, height, width, generator=torch.Generator().manual_seed(0))
    return images.to(dtype=parameter.dtype, device=parameter.device)


def features_and_logits(model: nn.Module, pixel_values: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor]:
    """``(path of the module whose output forward_features returns, F, forward_head(F))`` on ``pixel_values``.

    Every module's output is recorded on one call of ``forward_features``; the module is the last one to return the
    very tensor that ``forward_features`` returns (the outermost, where a stage returns its last block's output).

    Raises:
        ValueError: ``forward_features`` returns a tensor that no module returned (it ends with a tensor operation
            of its own); the message says what to pass instead.
    """
    found = _timm_root(model)
    root = found.module
    outputs: list[tuple[str, Any]] = []
    handles = [
        module.register_forward_hook(lambda _m, _a, out, name=name: outputs.append((name, out)))
        for name, module in root.named_modules() if name
    ]
    try:
        with torch.no_grad():
            features = found.forward_features(pixel_values)
            logits = found.forward_head(features)
    finally:
        for handle in handles:
            handle.remove()
    names = [name for name, out in outputs if out is features]
    if not isinstance(features, torch.Tensor) or not names:
        raise ValueError(
            f"split_point='final_encoder_output' on the timm model {type(root).__name__}: its forward_features "
            "returns a tensor that no submodule returns, so there is no module to hook for F; pass "
            "split_point='penultimate' or a dotted module path inside the model"
        )
    return found.prefix + names[-1], features, logits


def global_pool_type(root: nn.Module) -> str | None:
    """timm's global pool type (``"avg"``, ``"token"``, ``""``, ...) of the model or its ``head``, or ``None``."""
    for owner in (root, getattr(root, "head", None)):
        pool = getattr(owner, "global_pool", None)
        if isinstance(pool, str):
            return pool
        pool_type = getattr(pool, "pool_type", None)
        if isinstance(pool_type, str):
            return pool_type
    return None


def _norm_after_pool(root: nn.Module, prefix: str) -> tuple[bool, str | None]:
    """``(whether the head has a closed form so far, path of its LayerNorm after pooling or None)``: ``fc_norm``
    (ViT) or ``head.norm`` (``NormMlpClassifierHead``), each an identity or a LayerNorm, and no hidden layer
    (``pre_logits``) before the classifier."""
    head = getattr(root, "head", None)
    pre_logits = getattr(head, "pre_logits", None)
    if isinstance(pre_logits, nn.Module) and not isinstance(pre_logits, nn.Identity):
        return False, None
    norm_path = None
    for path in ("fc_norm", "head.norm"):
        try:
            norm = root.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(norm, nn.LayerNorm):
            norm_path = prefix + path
        elif not isinstance(norm, nn.Identity):
            return False, None
    return True, norm_path


def _candidate_pools(pool_type: str | None, rank: int) -> tuple[Pool, ...]:
    """The :class:`HeadSpec` pools timm's ``pool_type`` may be on a feature of ``rank`` dimensions (batch included);
    which one is decided by the logits."""
    if pool_type == "avg":
        return ("mean_spatial", "mean_tokens") if rank == 4 else ("mean_tokens",) if rank == 3 else ()
    if pool_type == "token" and rank == 3:
        return ("first_token",)
    if pool_type == "" and rank == 2:
        return ("identity",)
    return ()


def timm_head(model: nn.Module, features: torch.Tensor, logits: torch.Tensor) -> HeadSpec | ModuleHead:
    """timm's head as a closed-form :class:`HeadSpec` where timm builds it as pool -> LayerNorm or nothing ->
    ``nn.Linear`` and that reproduces ``logits`` from ``features``; else ``forward_head`` run by autograd."""
    found = _timm_root(model)
    classifier = timm_classifier_path(model)
    closed, norm = _norm_after_pool(found.module, found.prefix)
    if classifier is not None and closed:
        for kind in _candidate_pools(global_pool_type(found.module), features.dim()):
            head = HeadSpec(kind, classifier, norm)
            if reproduces_logits(head, model, features, logits):
                return head
    return ModuleHead(("@timm_forward_head",))


def describe_timm_split(model: nn.Module, spec: Any) -> str:
    """``| F | head | closed form | g depends on the input |`` of a timm model's ``spec`` (an
    :class:`~hf_gsc.classifier.architectures.ArchitectureSpec`), the columns of ``docs/architectures.md``'s timm
    table."""
    closed = "yes" if isinstance(spec.head, HeadSpec) else "no (autograd)"
    depends = "no" if spec.head.is_affine(model) else "yes"
    return f"| `{spec.final_path}` | `{spec.head.describe()}` | {closed} | {depends} |"
