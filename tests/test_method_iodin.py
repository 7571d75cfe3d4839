"""i-ODIN against OpenOOD v1.5's ``iodin_postprocessor.py`` (``get_mask`` and ``postprocess``, with
``configs/postprocessors/iodin.yml``), written again in torch on the tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from torch import nn

from hf_gsc.detectors import DETECTORS, get_detector


#: float64 on both sides (measured: at most 2.3e-16 relative).
RTOL = 1e-12


def get_mask(grad):
    batch_size, channels, height, width = grad.shape
    abs_grad = abs(grad).view(batch_size, -1)
    max_indices = torch.argmax(abs_grad, dim=1, keepdim=True)
    mask = torch.zeros_like(abs_grad, dtype=torch.uint8)
    mask.scatter_(1, max_indices, 1)
    return mask.view(batch_size, channels, height, width)


def openood_iodin(model, data, temperature, noise, input_std):
    net = lambda x: model(pixel_values=x).logits  # noqa: E731
    data = data.clone().requires_grad_(True)
    output = net(data)
    labels = output.detach().argmax(axis=1)
    loss = nn.CrossEntropyLoss()(output / temperature, labels)
    loss.backward()
    grad = data.grad.detach()
    mask = get_mask(grad)
    gradient = (torch.ge(grad, 0).double() - 0.5) * 2
    for channel in range(3):
        gradient[:, channel] = gradient[:, channel] / input_std[channel]
    temp_inputs = torch.add(data.detach(), gradient * mask, alpha=-noise)
    with torch.no_grad():
        output = net(temp_inputs) / temperature
    output = output - output.max(dim=1, keepdims=True).values
    output = output.exp() / output.exp().sum(dim=1, keepdims=True)
    return output.max(dim=1)[0].numpy()


@pytest.mark.parametrize("arch", ["resnet", "vit"])
@pytest.mark.parametrize("temperature, noise", [(1000.0, 0.0014), (1.0, 0.5), (10.0, 2.0)])
def test_iodin_matches_openood(arch, temperature, noise):
    model = make_tiny_model(arch)
    x = torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    std = [0.229, 0.224, 0.225]
    expected = openood_iodin(model, x, temperature, noise, std)
    detector = get_detector("iodin", model, temperature=temperature, epsilon=noise, image_std=std)
    np.testing.assert_allclose(detector.score(x).double().numpy(), expected, rtol=RTOL)
    odin = get_detector("odin", model, temperature=temperature, epsilon=noise, image_std=std).score(x).numpy()
    assert np.abs(odin - expected).max() > 0  # one element stepped is not every element


def test_iodin_defaults_and_grid():
    assert DETECTORS["iodin"].defaults == DETECTORS["odin"].defaults
    assert DETECTORS["iodin"].search_space == {"temperature": (1.0, 10.0, 100.0, 1000.0), "epsilon": (0.0014, 0.0028)}
    assert DETECTORS["iodin"].one_pass is False and not DETECTORS["iodin"].in_default_table
