"""Shared fixtures: tiny randomly initialised classifiers of each registered architecture."""

from __future__ import annotations

import os


# Tests never reach a real Hub; fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import pytest
import torch
from transformers import (
    ConvNextConfig,
    ConvNextForImageClassification,
    DeiTConfig,
    DeiTForImageClassification,
    ResNetConfig,
    ResNetForImageClassification,
    SwinConfig,
    SwinForImageClassification,
    ViTConfig,
    ViTForImageClassification,
)


IMAGE_SIZE = 16
NUM_LABELS = 5


def make_tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny float64 classifier (3 channels, 16x16 images, 5 classes) in eval mode."""
    torch.manual_seed(seed)
    common = {"num_channels": 3, "num_labels": NUM_LABELS}
    if arch == "vit":
        model = ViTForImageClassification(
            ViTConfig(image_size=IMAGE_SIZE, patch_size=4, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=32, **common)
        )
    elif arch == "deit":
        model = DeiTForImageClassification(
            DeiTConfig(image_size=IMAGE_SIZE, patch_size=4, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=32, **common)
        )
    elif arch == "swin":
        model = SwinForImageClassification(
            SwinConfig(image_size=IMAGE_SIZE, patch_size=2, embed_dim=8, depths=[1, 1], num_heads=[1, 2],
                       window_size=4, **common)
        )
    elif arch == "resnet":
        model = ResNetForImageClassification(
            ResNetConfig(embedding_size=8, hidden_sizes=[8, 12], depths=[1, 1], **common)
        )
    elif arch == "convnext":
        model = ConvNextForImageClassification(
            ConvNextConfig(num_stages=2, hidden_sizes=[8, 12], depths=[1, 1], image_size=IMAGE_SIZE, **common)
        )
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; a larger classifier makes predictions and gradients distinct.
    with torch.no_grad():
        linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
        linear.weight.mul_(20.0)
    return model.double().eval()


def float64_fit_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """96 float64 images of the tiny models' size in batches of 32, labels cycling over the classes: the fitting data
    of the tests that compare a method with its authors' code in float64."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(96, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    y = torch.arange(96) % NUM_LABELS
    return [(x[i:i + 32], y[i:i + 32]) for i in range(0, 96, 32)]


@pytest.fixture
def pixel_values() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)


def evaluate_argv(argv: list[str]) -> dict | None:
    """An evaluation run from a ``hf-gsc evaluate`` command line in this process: ``results.json``'s content (``None``
    on a process other than the main one)."""
    from hf_gsc.evaluation.arguments import parse_arguments
    from hf_gsc.evaluation.evaluator import OODEvaluator

    result = OODEvaluator(args=parse_arguments(argv)).evaluate()
    return None if result is None else result.to_dict()
