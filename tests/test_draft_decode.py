"""JPEG draft mode: a photo much larger than the model's input is decoded at a reduced scale, upright, close to the
full decode followed by the same resize; nothing else changes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers import ConvNextImageProcessor, ViTImageProcessor

from hf_gsc.data.preprocessing import ImageTransform, resize_min_side
from hf_gsc.utils.images import decode

ORIENTATION = 0x0112


def _photo(width: int, height: int) -> Image.Image:
    """Smooth but asymmetric content (a turn or a mirror changes it a lot): a ramp to the right, one down, a disc."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    red = 255 * x / width
    green = 255 * y / height
    blue = 255.0 * ((x - 0.3 * width) ** 2 + (y - 0.3 * height) ** 2 < (0.15 * min(width, height)) ** 2)
    return Image.fromarray(np.stack([red, green, blue], axis=-1).astype(np.uint8))


def _save(image: Image.Image, path, orientation: int = 1, **options) -> str:
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    image.save(path, exif=exif, **options)
    return str(path)


@pytest.mark.parametrize("orientation", [1, 6])
def test_a_large_jpeg_is_decoded_at_a_reduced_scale_upright_and_close_to_the_full_decode(tmp_path, orientation):
    path = _save(_photo(1200, 900), tmp_path / "photo.jpg", orientation, quality=95)
    full = decode(path, "RGB")
    drafted = decode(path, "RGB", min_side=200)
    # 1/4 scale is the smallest keeping both sides >= 200 (1/8 would give 150 x 112); turned like the full decode.
    assert drafted.size == ((300, 225) if orientation == 1 else (225, 300))
    assert full.size == ((1200, 900) if orientation == 1 else (900, 1200))
    target = (200, 150) if orientation == 1 else (150, 200)
    ours = np.asarray(drafted.resize(target, Image.BILINEAR), dtype=np.float64)
    reference = np.asarray(full.resize(target, Image.BILINEAR), dtype=np.float64)
    assert np.abs(ours - reference).mean() < 2.0 and np.abs(ours - reference).max() < 64


def test_draft_mode_leaves_small_jpegs_and_other_formats_alone(tmp_path):
    small = _save(_photo(300, 250), tmp_path / "small.jpg")
    png = _save(_photo(1200, 900), tmp_path / "photo.png")
    assert decode(small, "RGB", min_side=200).size == (300, 250)
    assert decode(png, "RGB", min_side=200).size == (1200, 900)
    assert decode(_save(_photo(1200, 900), tmp_path / "big.jpg"), "RGB").size == (1200, 900)  # no min_side


def test_min_side_follows_the_processor_resize():
    assert resize_min_side(ViTImageProcessor(size={"height": 224, "width": 224})) == 224
    # ConvNeXt below 384: the shortest edge is resized to 224 / crop_pct = 256, then cropped to 224.
    assert resize_min_side(ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875)) == 256
    assert resize_min_side(ViTImageProcessor(do_resize=False)) is None
    assert ImageTransform(ViTImageProcessor(size={"height": 64, "width": 48})).min_side == 64
