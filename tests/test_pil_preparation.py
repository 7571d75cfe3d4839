"""The PIL backend's resize + crop straight on PIL images (hf_gsc.data.pil_preparation): the DataLoader workers'
uint8 batches must be the processor's own, bit for bit, and the shortcut must stand aside wherever it cannot be."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from test_normalization import PIL_PROCESSORS, photos, pil_processor

from hf_gsc.data import ImageTransform, load_image_processor
from hf_gsc.data.pil_preparation import PilPreparation, pil_preparation


#: Processors of PIL_PROCESSORS whose resize / crop / batching steps are PilBackend's own.
SHORTCUT = {"ViT", "DeiT", "CLIP", "Siglip", "Bit"}


def processor_uint8(processor, images) -> torch.Tensor:
    return processor(images, do_rescale=False, do_normalize=False, return_tensors="pt")["pixel_values"].to(torch.uint8)


@pytest.mark.parametrize("module,prefix", PIL_PROCESSORS)
def test_shortcut_equals_the_processor_or_stands_aside(module: str, prefix: str) -> None:
    processor = pil_processor(module, prefix)
    preparation = pil_preparation(processor)
    assert (preparation is not None) == (prefix in SHORTCUT)
    transform = ImageTransform(processor, num_channels=3)
    assert transform.pil_preparation == preparation
    for size in ((500, 375), (200, 300), (97, 131)):  # one size per batch: resizing to a shortest edge keeps ratios
        images = [photo for photo in photos(6) if photo.size == size]
        expected = processor_uint8(processor, images)
        if preparation is not None:
            assert torch.equal(preparation(images), expected)
        assert torch.equal(transform.prepare(images), expected)
        assert torch.equal(transform(images), processor(images, return_tensors="pt")["pixel_values"])


def test_the_loop_transform_takes_the_shortcut() -> None:
    processor = pil_processor("vit", "ViT")
    transform = ImageTransform(processor, num_channels=3)
    images = photos()
    expected = processor_uint8(processor, images)

    def refuse(*args, **kwargs):
        raise AssertionError("the processor ran")

    transform.image_processor = refuse  # the shortcut alone makes the batch
    assert torch.equal(transform.prepare(images), expected)


def test_grayscale_reference_model() -> None:
    from hf_gsc.data import reference_model_path

    processor = load_image_processor(reference_model_path("vit"))
    transform = ImageTransform(processor, num_channels=1)
    assert transform.pil_preparation is not None
    images = [image.convert("L") for image in photos()]
    prepared = transform.prepare(images)
    assert prepared.shape[1] == 1
    assert torch.equal(prepared, processor_uint8(processor, images))


def test_images_smaller_than_the_crop_go_through_the_processor() -> None:
    # shortest edge 40, crop 48 high: portrait images fit, landscape ones the processor pads (the shortcut stands aside)
    processor = pil_processor("clip", "CLIP", size={"shortest_edge": 40}, crop_size={"height": 48, "width": 30})
    transform = ImageTransform(processor, num_channels=3)
    assert transform.pil_preparation is not None
    portrait = [photo for photo in photos(6) if photo.size == (200, 300)]
    assert torch.equal(transform.pil_preparation(portrait), processor_uint8(processor, portrait))
    landscape = [photo for photo in photos(6) if photo.size == (500, 375)]
    assert transform.pil_preparation(landscape) is None
    assert torch.equal(transform.prepare(landscape), processor_uint8(processor, landscape))


def test_rgb_with_a_transparency_colour_goes_through_the_processor() -> None:
    processor = pil_processor("clip", "CLIP")  # converts to RGB: composites a transparency colour on white
    transform = ImageTransform(processor, num_channels=3)
    array = np.zeros((40, 50, 3), dtype=np.uint8)
    array[:20] = 255
    image = Image.fromarray(array)
    image.info["transparency"] = (0, 0, 0)
    assert transform.pil_preparation([image]) is None
    assert torch.equal(transform.prepare([image]), processor_uint8(processor, [image]))


def test_ragged_batch_is_left_to_the_processor() -> None:
    processor = pil_processor("clip", "CLIP", do_center_crop=False)  # shortest edge only: sizes follow the input
    preparation = pil_preparation(processor)
    assert isinstance(preparation, PilPreparation)
    assert preparation([photos(2)[0], photos(2)[1]]) is None


def test_batches_from_workers_arrive_in_shared_memory() -> None:
    from torch.utils.data import DataLoader

    processor = pil_processor("vit", "ViT")
    transform = ImageTransform(processor, num_channels=3)
    images = photos()
    batches = list(DataLoader(range(2), batch_size=1, num_workers=1, collate_fn=lambda _: transform.prepare(images)))
    assert all(batch.is_shared() and torch.equal(batch, processor_uint8(processor, images)) for batch in batches)
    assert not transform.prepare(images).is_shared()  # outside a worker: ordinary memory
