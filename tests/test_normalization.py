"""Deferred normalization (hf_gsc.data.normalization): DataLoader workers send uint8 batches, the model's device
runs the image processor's rescale + normalize. The numbers must be the processor's own, bit for bit, and a
processor whose last step cannot be split off must keep running whole in the workers."""

from __future__ import annotations

import importlib

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from hf_gsc.data import ImageTransform, PixelNormalization, deferred_normalization, load_image_processor
from hf_gsc.data.normalization import apply_table, normalization_table, normalize_pixels
from hf_gsc.evaluation.accelerator import make_accelerator
from hf_gsc.evaluation.loaders import device_batches, make_dataloader, model_pixel_values
from hf_gsc.evaluation.loop import score_split
from hf_gsc.utils.images import decode


PIL_PROCESSORS = [("vit", "ViT"), ("convnext", "ConvNext"), ("deit", "DeiT"), ("clip", "CLIP"), ("beit", "Beit"),
                  ("levit", "Levit"), ("mobilenet_v2", "MobileNetV2"), ("poolformer", "PoolFormer"),
                  ("siglip", "Siglip"), ("bit", "Bit")]


def pil_processor(module: str, prefix: str, **kwargs):
    classes = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
    return getattr(classes, f"{prefix}ImageProcessorPil")(**kwargs)


def photos(count: int = 3, seed: int = 0) -> list[Image.Image]:
    """Images of differing sizes and aspect ratios (a 500x375 photo size among them), smooth and noisy parts."""
    rng = np.random.default_rng(seed)
    sizes = [(500, 375), (200, 300), (97, 131)]
    images = []
    for index in range(count):
        width, height = sizes[index % len(sizes)]
        ramp = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
        noise = rng.integers(-40, 41, size=(height, width, 3))
        images.append(Image.fromarray(np.clip(ramp + noise, 0, 255).astype(np.uint8)))
    return images


@pytest.mark.parametrize("module,prefix", PIL_PROCESSORS)
def test_deferred_normalization_reproduces_each_processor_exactly(module: str, prefix: str) -> None:
    processor = pil_processor(module, prefix)
    transform = ImageTransform(processor, num_channels=3)
    assert transform.normalization is not None
    images = photos()
    prepared = transform.prepare(images)
    assert prepared.dtype == torch.uint8
    assert torch.equal(transform.normalization(prepared), processor(images, return_tensors="pt")["pixel_values"])
    assert torch.equal(transform(images), processor(images, return_tensors="pt")["pixel_values"])


def test_reference_model_processors_defer_in_grayscale() -> None:
    from hf_gsc.data import reference_model_path

    processor = load_image_processor(reference_model_path("vit"))
    transform = ImageTransform(processor, num_channels=1)
    images = [image.convert("L") for image in photos()]
    assert transform.normalization == PixelNormalization("pil", processor.rescale_factor, (0.286,), (0.353,))
    assert transform.prepare(images).shape == (3, 1, 28, 28)
    assert torch.equal(transform(images), processor(images, return_tensors="pt")["pixel_values"])


def test_processors_that_cannot_be_split_run_whole() -> None:
    padding = pil_processor("vit", "ViT", do_pad=True, pad_size={"height": 240, "width": 240})
    assert deferred_normalization(padding) is None  # pads with zeros after normalizing
    assert deferred_normalization(pil_processor("efficientnet", "EfficientNet")) is None  # normalizes twice
    assert deferred_normalization(pil_processor("vit", "ViT", do_rescale=False, do_normalize=False)) is None
    assert deferred_normalization(object()) is None
    kept = ImageTransform(pil_processor("vit", "ViT"), defer_normalization=False)
    assert kept.normalization is None and kept.prepare(photos(1)).dtype == torch.float32
    efficientnet = pil_processor("efficientnet", "EfficientNet")
    whole = ImageTransform(efficientnet)
    assert whole.normalization is None
    assert torch.equal(whole(photos()), efficientnet(photos(), return_tensors="pt")["pixel_values"])


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("rescale", [True, False])
def test_processor_switches_are_followed(rescale: bool, normalize: bool) -> None:
    processor = pil_processor("vit", "ViT", do_rescale=rescale, do_normalize=normalize, image_mean=[0.4, 0.5, 0.6],
                              image_std=[0.2, 0.25, 0.3])
    transform = ImageTransform(processor)
    if not (rescale or normalize):
        assert transform.normalization is None
        return
    assert transform.normalization is not None
    images = photos()
    assert torch.equal(transform(images), processor(images, return_tensors="pt")["pixel_values"])


def test_torchvision_formula_matches_float64_reference() -> None:
    # transformers fuses rescale into mean/std on its torchvision backend; without torchvision here the processor
    # cannot be run, so its formula is checked against the float64 arithmetic it stands for.
    pixels = torch.arange(256, dtype=torch.uint8).repeat(2, 3, 1, 1)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    out = normalize_pixels(pixels, "torchvision", 1 / 255, mean, std)
    reference = (pixels.double() / 255 - torch.tensor(mean).double().view(-1, 1, 1)) / torch.tensor(std).double().view(-1, 1, 1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)
    assert torch.equal(normalize_pixels(pixels, "torchvision", 1 / 255, None, None), pixels * (1 / 255))


def test_torchvision_backend_defers_exactly_when_installed() -> None:
    pytest.importorskip("torchvision")
    from transformers import ViTImageProcessor

    processor = ViTImageProcessor()  # the torchvision-backed class when torchvision is installed
    transform = ImageTransform(processor)
    assert transform.normalization is not None and transform.normalization.backend == "torchvision"
    assert torch.equal(transform(photos()), processor(photos(), return_tensors="pt")["pixel_values"])


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("rescale_factor,mean,std", [(1 / 255, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
                                                     (1 / 255, None, None), (None, (127.5,), (127.5,)),
                                                     (1 / 127.5, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])
def test_table_lookup_equals_the_arithmetic(backend: str, rescale_factor, mean, std) -> None:
    """PixelNormalization looks values up in a 256-entry table per channel: every uint8 value, every channel,
    exactly as the arithmetic computes it."""
    pixels = torch.cat([torch.arange(256, dtype=torch.uint8).view(1, 1, 16, 16).expand(1, 3, 16, 16),
                        torch.randint(0, 256, (2, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))])
    expected = normalize_pixels(pixels, backend, rescale_factor, mean, std)
    assert torch.equal(PixelNormalization(backend, rescale_factor, mean, std)(pixels), expected)
    table = normalization_table(backend, rescale_factor, mean, std)
    assert table.shape == (1 if mean is None else len(mean), 256) and table.dtype == torch.float32


def test_table_of_other_channel_count_is_refused() -> None:
    table = normalization_table("pil", 1 / 255, (0.5, 0.5), (0.5, 0.5))
    with pytest.raises(ValueError, match="a table for 2 channels cannot normalize 3-channel pixels"):
        apply_table(torch.zeros(1, 3, 2, 2, dtype=torch.uint8), table)
    with pytest.raises(ValueError, match="uint8"):
        apply_table(torch.zeros(1, 2, 2, 2), table)


def test_normalize_pixels_rejects_float_input() -> None:
    with pytest.raises(ValueError, match="uint8"):
        normalize_pixels(torch.zeros(1, 3, 4, 4), "pil", 1 / 255, (0.5,), (0.5,))


def test_loop_scores_equal_with_and_without_deferral(tmp_path) -> None:
    """The evaluation loop, with a worker process: uint8 batches travel with their normalization, and the scores
    and fit batches equal those of the processor run whole in the worker."""
    paths = []
    for index, image in enumerate(photos(6, seed=1)):
        paths.append(str(tmp_path / f"{index}.jpg"))
        image.save(paths[-1], quality=90)
    dataset = datasets.Dataset.from_dict({"image": paths, "label": list(range(6))}).cast_column("image", datasets.Image())
    processor = pil_processor("vit", "ViT", size={"height": 32, "width": 32})
    deferred, whole = ImageTransform(processor), ImageTransform(processor, defer_normalization=False)

    batch = next(iter(make_dataloader(dataset, deferred, batch_size=4, num_workers=1)))
    assert batch["pixel_values"].dtype == torch.uint8 and batch["pixel_normalization"] == deferred.normalization
    # Decoded as every entry point decodes (hf_gsc.utils.images.decode, at full size).
    assert torch.equal(model_pixel_values(batch, "cpu"), whole([decode(p, "RGB") for p in paths[:4]]))

    def score(pixel_values: torch.Tensor) -> torch.Tensor:
        return pixel_values.double().flatten(1).sum(1)

    accelerator = make_accelerator("no")
    outputs = [score_split(accelerator, make_dataloader(dataset, transform, 4, num_workers=1), {"sum": score})
               for transform in (deferred, whole)]
    assert torch.equal(outputs[0]["sum"], outputs[1]["sum"]) and torch.equal(outputs[0]["labels"], outputs[1]["labels"])
    fit = [list(device_batches(make_dataloader(dataset, transform, 4), "cpu")) for transform in (deferred, whole)]
    assert all(torch.equal(a[0], b[0]) and a[0].dtype == torch.float32 for a, b in zip(*fit))
