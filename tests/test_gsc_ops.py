"""GSC's step after the backbone is a few dozen ATen ops at most, in eager mode, on each head form; the folded head
it reuses between forwards follows the model's parameters.

On a GPU each dispatched op is a kernel launch, and at batch 1 or in bf16 launches are GSC's cost
(``scripts/benchmark_ops.py`` counts them on ResNet-50, ViT-B/16 and Swin-T, docs/efficiency.md). Counted here on the
tiny models of the suite, the same way: ops of ``detector(x)`` minus ops of ``model(pixel_values=x)``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from hf_gsc import GSCForImageClassification


#: The step's target over the base forward (the base forward includes the head GSC recomputes from F).
MAX_ADDED_OPS = 30


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _ops(call) -> int:
    with torch.no_grad(), _Ops() as counter:
        call()
    return counter.count


@pytest.mark.parametrize("arch", ["vit", "resnet", "swin"])
@pytest.mark.parametrize("approximation", ["first_order", "exact", "predicted_logit"])
def test_gsc_adds_at_most_thirty_ops_to_the_forward(arch, approximation, pixel_values):
    model = make_tiny_model(arch)
    detector = GSCForImageClassification(model, approximation=approximation)
    detector.config.threshold = 0.0
    model(pixel_values=pixel_values), detector(pixel_values)  # warm-up: lazy initialisation, the folded head
    added = _ops(lambda: detector(pixel_values)) - _ops(lambda: model(pixel_values=pixel_values))
    assert added <= MAX_ADDED_OPS, added


@pytest.mark.parametrize("arch", ["swin", "resnet"])
def test_gsc_follows_parameters_changed_between_forwards(arch, pixel_values):
    """The LayerNorm folded into the classifier is kept between forwards; changed in place (as ``load_state_dict``
    does), replaced, or its module replaced, the next forward folds again: the logits are the model's."""
    model = make_tiny_model(arch)
    detector = GSCForImageClassification(model)
    detector(pixel_values)
    path, linear = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        linear.weight.mul_(1.5)
        linear.bias.add_(0.25)
        if arch == "swin":
            model.swin.layernorm.weight.mul_(0.5)
    torch.testing.assert_close(detector(pixel_values).logits, model(pixel_values=pixel_values).logits)
    linear.weight = torch.nn.Parameter(torch.randn_like(linear.weight))
    torch.testing.assert_close(detector(pixel_values).logits, model(pixel_values=pixel_values).logits)
    parent, name = model.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2]
    setattr(parent, name, torch.nn.Linear(linear.in_features, linear.out_features).double())
    torch.testing.assert_close(detector(pixel_values).logits, model(pixel_values=pixel_values).logits)
