"""Multi-layer backend (``earlier_split_point``): one feature joining an earlier encoder block and the final
encoder output, under one shared mask budget; autograd through the blocks between them and the head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...classifier.split_points import SplitPoint, resolve_block_chain
from ...utils.precision import parameter_dtype, step_dtype
from .autograd import in_model_dtype, linearize_with_autograd, use_eager_attention_for_first_order
from .base import Backend, Linearization


class MultiLayerHead(Backend):
    """The feature is ``[F1, F2]`` flattened, ``(B, d1 + d2)``, and ``H([F1, F2]) = head(blocks(F1) + F2 - F2_0)``
    with ``F2_0 = blocks(F1_0)``: its gradient holds ``d y_c / dF1`` (through the blocks) and ``d y_c / dF2``,
    and moving both parts moves both layers."""

    def __init__(
        self, split_point: SplitPoint, earlier: SplitPoint, run_blocks: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
        super().__init__(split_point)
        self.earlier, self.run_blocks = earlier, run_blocks

    @property
    def feature_split(self) -> SplitPoint:
        """``F1``, the earlier layer's feature, is what the backbone gives; the linearisation's ``features`` join it
        with ``F2_0``."""
        return self.earlier

    def linearize_at(
        self, features: torch.Tensor, pixel_values: torch.Tensor | None, whole_feature: bool, keep_graph: bool
    ) -> Linearization:
        # The blocks and the head run in the model's parameter dtype; F1, F2_0 and the step in at least float32.
        dtype = parameter_dtype(self.split_point.model)
        with torch.no_grad():
            final_0 = self.run_blocks(features.to(dtype))
        final_0 = final_0.to(step_dtype(final_0.dtype))
        shapes = [features.shape[1:], final_0.shape[1:]]
        sizes = (features[0].numel(), final_0[0].numel())
        head = self.split_point.head

        def joint_head(joint: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
            f1, f2 = torch.split(joint, list(sizes), dim=1)
            moved = self.run_blocks(f1.reshape(-1, *shapes[0])) + (f2.reshape(-1, *shapes[1]) - final_0).to(dtype)
            return head(moved, pixel_values)

        joint = torch.cat([features.flatten(1), final_0.flatten(1)], dim=1)
        linearized = linearize_with_autograd(in_model_dtype(joint_head, self.split_point.model), joint, pixel_values,
                                             keep_graph)
        return Linearization(joint, "identity", joint, linearized, sizes)


def dispatch(model: torch.nn.Module, split_point: SplitPoint, config: Any) -> Backend | None:
    """This backend where ``earlier_split_point`` is set."""
    if config.earlier_split_point is None:
        return None
    earlier, run_blocks = resolve_block_chain(model, config.earlier_split_point, config.split_point)
    use_eager_attention_for_first_order(model, config)
    return MultiLayerHead(split_point, earlier, run_blocks)
