"""Where the feature ``F`` is taken and what the remaining head ``f_{>L}`` is.

The per-architecture knowledge lives in :mod:`hf_gsc.classifier.architectures`. A split point is one of

* ``"final_encoder_output"`` (default): the output of the last encoder block or stage, *before* the final
  norm, pooler and classifier (:data:`hf_gsc.classifier.architectures.ARCHITECTURES`, or found from the model's
  structure). Where the head has a LayerNorm (ViT, DeiT, Swin, ConvNeXt, ...) it is nonlinear and the
  gradient ``g`` depends on the input; where it is pooling + linear (ResNet, MobileNet, ...)
  ``g = W[c] / (H*W)`` is the same for every input and the first-order Taylor step is exact.
* ``"penultimate"``: the input of the last ``nn.Linear`` (the classifier). The head is linear for every
  architecture: ``g = W[c]`` does not depend on the input, and first order equals exact.
* a dotted module path inside the base model (``"vit.layers.2"``, negative indices allowed), whose
  output (first element when it returns a tuple) is ``F``. Paths are resolved by attribute lookup only.

The backbone runs once, without gradient, and stops at the split point. Derivatives involve the head
only: in closed form where the head has the pool / LayerNorm / linear form of a
:class:`~hf_gsc.classifier.heads.HeadSpec` (see :mod:`hf_gsc.classifier.head_jacobians`); by autograd through the model's
own head modules where it is a :class:`~hf_gsc.classifier.heads.ModuleHead`; by autograd through the rest of the
model elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..utils.feature_capture import capture, install_hooks, with_replaced_output
from .architectures import ARCHITECTURES, architecture_for, registered_architecture
from .head_jacobians import LinearizedHead, Pool, PoolNormLinearHead, read_pool, restrict_to_read_part
from .heads import HeadSpec, bind_head_paths, block_list, normalise_path, submodule
from .split_point_names import validate_split_point_name
from .timm_models import timm_classifier_path


def _call_block(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    output = block(hidden)
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass
class SplitPoint:
    """A resolved split point of one model: ``features(x) = F`` and ``head(F, x) = logits``.

    Attributes:
        name: the configured split point (``"final_encoder_output"``, ``"penultimate"`` or a path).
        module_path: the resolved module whose output (or, for ``penultimate``, input) is ``F``.
        head_is_linear: whether the head is affine in ``F``.
        head_spec: the pool/LayerNorm/linear form of the head where it has one (``final_encoder_output``
            of a registered architecture, and ``penultimate``): its derivatives are then computed in
            closed form (:mod:`hf_gsc.classifier.head_jacobians`) instead of by autograd.
    """

    model: nn.Module
    name: str
    module_path: str
    capture_input: bool
    head_is_linear: bool
    head_spec: HeadSpec | None = None
    _block_head: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        install_hooks(self.module)  # once, for the model's lifetime: a forward registers nothing

    @property
    def read_pool(self) -> Pool:
        """The pool keeping the coordinates of ``F`` the head reads (``first_token`` for ViT and DeiT, where
        only the first token reaches the classifier; ``identity`` = all of ``F``); see
        :func:`hf_gsc.classifier.head_jacobians.read_pool`."""
        return "identity" if self.head_spec is None else read_pool(self.head_spec.pool)

    def bound_head(self, on_read_part: bool = False) -> PoolNormLinearHead:
        """The registered head with the model's current parameters (folded on every call, so it follows
        replaced or changed parameters), as a function of ``F`` or (``on_read_part``) of
        ``pool(F, self.read_pool)``."""
        if self.head_spec is None:
            raise ValueError(f"split point {self.name!r} has no registered head form (HeadSpec); its head is "
                             "differentiated by autograd")
        head = self.head_spec.bind(self.model)
        return restrict_to_read_part(head) if on_read_part else head

    @property
    def module(self) -> nn.Module:
        return submodule(self.model, self.module_path)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Run the backbone up to the split point, without gradient. ``(B, C, H, W) -> (B, *feature_shape)``.

        Thread-safe: the split module's persistent hook captures ``F`` for the calling thread only
        (:mod:`hf_gsc.utils.feature_capture`)."""

        def run() -> None:
            with torch.no_grad():
                self.model(pixel_values=pixel_values)

        features = capture(run, self.module, module_input=self.capture_input)
        if features is None:
            raise RuntimeError(f"the forward pass never reached the split point {self.module_path!r}")
        return features

    def head(self, features: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """``f_{>L}(F)``: logits ``(B, K)`` from features ``(B, *feature_shape)``.

        ``pixel_values`` is needed only for split points without a registered head, where the head is
        the model's forward with the split module's output replaced by ``F`` (the prefix recomputes
        without gradient because the base parameters do not require it).
        """
        if self.head_spec is not None:
            return self.bound_head()(features)
        if self._block_head is not None:
            return self._block_head(features)
        if pixel_values is None:
            raise ValueError(f"split point {self.name!r} has no direct head: pass pixel_values to replay the model")
        return with_replaced_output(lambda: self.model(pixel_values=pixel_values), self.module, features).logits

    def linearize_read_part(self, read_part: torch.Tensor) -> LinearizedHead:
        """The head as a function of ``read_part = pool(F, self.read_pool)``, linearized there (closed form;
        only for split points with a :class:`HeadSpec`)."""
        return self.bound_head(on_read_part=True).linearize(read_part)


def _last_linear_path(model: nn.Module) -> str:
    """The classifier: timm's ``get_classifier()`` for a timm model, else the last ``nn.Linear`` registered."""
    classifier = timm_classifier_path(model)
    if classifier is not None:
        return classifier
    paths = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not paths:
        raise ValueError("split_point='penultimate' needs an nn.Linear classifier; the model has none")
    return paths[-1]


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)


def _final_encoder_output(model: nn.Module, split_point: str) -> SplitPoint:
    """The split at the final encoder output of a registered or discovered architecture."""
    try:
        spec = architecture_for(model)
    except ValueError as error:
        raise ValueError(
            f"{error}. Registered model types: {', '.join(supported_model_types())}. Supported model types: "
            "those, and others whose structure matches (see hf_gsc.classifier.architectures.discover_architecture)"
        ) from None
    path = normalise_path(model, spec.final_path)
    head = bind_head_paths(model, spec.head)
    if isinstance(head, HeadSpec):
        head.bind(model)  # fail here, not at the first forward, when the head is not as registered
        return SplitPoint(model, split_point, path, False, head.is_affine(model), head_spec=head)

    def module_head(features: torch.Tensor) -> torch.Tensor:
        return head.through_modules(model, features)

    # The model's own head modules, differentiated by autograd (linearize_with_autograd).
    return SplitPoint(model, split_point, path, False, head.is_affine(model), _block_head=module_head)


def resolve_split_point(model: nn.Module, split_point: str = "final_encoder_output") -> SplitPoint:
    """Resolve ``split_point`` on ``model`` (a ``*ForImageClassification`` from transformers).

    Raises:
        ValueError: ``final_encoder_output`` on an architecture that is neither registered nor discovered
            (the message says why, lists the registered model types and how to pass a module path), or a
            path that does not exist.
    """
    validate_split_point_name(split_point)

    if split_point == "penultimate":
        path = _last_linear_path(model)
        return SplitPoint(model, split_point, path, True, head_is_linear=True, head_spec=HeadSpec("identity", path))

    if split_point == "final_encoder_output":
        return _final_encoder_output(model, split_point)

    spec = registered_architecture(model)
    path = normalise_path(model, split_point)
    block_head = None
    if spec is not None and spec.blocks_take_hidden_only and path.startswith(spec.blocks + "."):
        # A block of the registered encoder: run the remaining blocks, then the registered head.
        index = int(path[len(spec.blocks) + 1 :].split(".")[0])
        if path == f"{spec.blocks}.{index}":
            remaining = list(block_list(model, spec.blocks))[index + 1 :]
            if not remaining:  # the last block: this is the final encoder output
                return _final_encoder_output(model, split_point)
            head = bind_head_paths(model, spec.head)

            def run_remaining_then_head(features: torch.Tensor) -> torch.Tensor:
                for block in remaining:
                    features = _call_block(block, features)
                return head.through_modules(model, features)

            block_head = run_remaining_then_head

    return SplitPoint(model, split_point, path, False, head_is_linear=False, _block_head=block_head)


def resolve_block_chain(model: nn.Module, earlier_split_point: str, split_point: str) -> tuple[SplitPoint, Callable[[torch.Tensor], torch.Tensor]]:
    """For multi-layer short-circuit: the earlier split point and the blocks mapping its ``F`` to the final one's.

    ``earlier_split_point`` must be a block of the registered encoder (e.g. ``"vit.layers.-3"``) and
    ``split_point`` must be ``"final_encoder_output"``; returns ``(earlier, blocks)`` with
    ``blocks(F_earlier) = F_final``.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = registered_architecture(model)
    supported = sorted(name for name, entry in ARCHITECTURES.items() if entry.blocks_take_hidden_only)
    if split_point != "final_encoder_output":
        raise ValueError(f"earlier_split_point needs split_point='final_encoder_output', got {split_point!r}")
    if spec is None or not spec.blocks_take_hidden_only:
        raise ValueError(
            f"earlier_split_point is not supported for model type {model_type!r}: its encoder blocks need more "
            f"than the hidden states to run (e.g. Swin's patch grid size); supported model types: {supported}"
        )
    path = normalise_path(model, earlier_split_point)
    blocks = list(block_list(model, spec.blocks))
    prefix = spec.blocks + "."
    index = path[len(prefix):] if path.startswith(prefix) else ""
    if not index.isdigit() or int(index) >= len(blocks) - 1:
        raise ValueError(
            f"earlier_split_point {earlier_split_point!r} must be a block of {spec.blocks} before the last one "
            f"(indices 0..{len(blocks) - 2} or -{len(blocks)}..-2)"
        )
    remaining = blocks[int(index) + 1 :]

    def run_blocks(features: torch.Tensor) -> torch.Tensor:
        for block in remaining:
            features = _call_block(block, features)
        return features

    earlier = SplitPoint(model, earlier_split_point, path, False, head_is_linear=False)
    return earlier, run_blocks
