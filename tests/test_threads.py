"""One detector shared by several threads gives every thread its own, single-threaded result.

``F`` is taken by hooks that live on the split module for the model's lifetime and act only on the calling
thread's request; a forward registers nothing and keeps no state. Each configuration exercises one kind of
request: capturing a block's output (ViT, ResNet at ``final_encoder_output``), capturing the classifier's input
(``penultimate``) and replaying the model with a stage's output replaced (Swin at an earlier stage).
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc import GSCForImageClassification


THREADS, CALLS = 4, 50


def _inputs(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64) for _ in range(count)]


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("vit", {}),
        ("resnet", {}),
        ("vit", {"split_point": "penultimate"}),
        ("swin", {"split_point": "swin.encoder.layers.0", "approximation": "exact"}),
    ],
)
def test_threads_sharing_one_detector_get_their_own_results(arch, settings):
    model = make_tiny_model(arch)
    detector = GSCForImageClassification(model, **settings)
    inputs = _inputs(THREADS * CALLS)
    with torch.no_grad():
        expected = [detector(x).ood_score for x in inputs]
        plain = [model(pixel_values=x).logits for x in inputs[:CALLS]]
    results: dict[int, torch.Tensor] = {}
    plain_results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS + 1)

    def work(thread: int) -> None:
        start.wait()
        try:
            with torch.no_grad():
                for call in range(CALLS):
                    index = thread * CALLS + call  # every thread scores different images
                    results[index] = detector(inputs[index]).ood_score
        except BaseException as error:  # noqa: BLE001 - reported below with the thread's traceback
            errors.append(error)

    def use_the_base_model_directly() -> None:
        start.wait()
        with torch.no_grad():
            for call in range(CALLS):
                plain_results[call] = model(pixel_values=inputs[call]).logits

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    threads.append(threading.Thread(target=use_the_base_model_directly))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    # Calls that run at the same time share torch's intra-op threads, and a BLAS kernel may split a product in
    # another order with fewer of them: equal to rounding (rtol 1e-6), while a call that saw another's state (hooks,
    # captured features) would be off by far more.
    wrong = [i for i, score in enumerate(expected) if not torch.allclose(results[i], score, rtol=1e-6, atol=1e-9)]
    assert not wrong, f"{len(wrong)} of {len(expected)} calls returned another result than single-threaded"
    # The base model, called directly while the detector runs in other threads, is unaffected by its hooks.
    assert all(torch.allclose(plain_results[i], plain[i], rtol=1e-6, atol=1e-9) for i in range(CALLS))


def test_a_forward_registers_nothing_on_the_model(pixel_values):
    model = make_tiny_model("vit")
    detector = GSCForImageClassification(model, split_point="vit.layers.0")

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    before = hooks()
    detector(pixel_values)
    detector(pixel_values)
    GSCForImageClassification(model, split_point="vit.layers.0")  # a second detector on the same module
    assert hooks() == before
