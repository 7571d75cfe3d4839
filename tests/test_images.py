"""``hf_gsc.utils.images.load_image``, the decoding rule of every entry point, on each row of its table (docs/inputs.md):
bit depths scaled to 8 bits, 1-bit and boolean as 0/255, alpha composited onto white, the model's mode; URLs with a
size cap; the pixel limit before decoding; each error naming its input."""

from __future__ import annotations

import io

import numpy as np
import pytest
from http_files import serve_files
from PIL import Image

from hf_gsc.utils.image_limits import MAX_IMAGE_PIXELS_ENV, ImageTooLargeError
from hf_gsc.utils.images import UnreadableImageError, fetch_url, load_image


GREY = np.array([[0, 1, 127], [128, 254, 255]], np.uint8)


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("source", [
    Image.fromarray(GREY.astype(np.uint16) * 257),                          # I;16
    _png(Image.fromarray(GREY.astype(np.uint16) * 257)),                    # a 16-bit PNG file
    GREY.astype(np.uint16) * 257,                                           # uint16 array
    Image.fromarray(GREY.astype(np.int32) * 257),                           # I holding 16-bit values
    Image.fromarray((GREY.astype(np.int64) * (2**31 - 1) // 255).astype(np.int32)),  # I holding 32-bit values
    Image.fromarray(GREY.astype(np.float32) / 255),                         # F in [0, 1]
    GREY.astype(np.float64) / 255,                                          # float array
    GREY.astype(np.int64),                                                  # int64 array of 0..255
], ids=["I;16", "16-bit png", "uint16", "I 16-bit", "I 32-bit", "F", "float array", "int64 array"])
def test_every_bit_depth_becomes_the_8_bit_image(source):
    image = load_image(source)
    assert image.mode == "L" and np.array_equal(np.asarray(image), GREY)
    assert np.array_equal(np.asarray(load_image(source, "RGB")), np.repeat(GREY[:, :, None], 3, axis=2))


def test_one_bit_and_boolean_mean_0_and_255():
    bits = GREY > 127
    for source in (bits, Image.fromarray(bits), _png(Image.fromarray(bits))):
        assert np.array_equal(np.asarray(load_image(source, "L")), bits.astype(np.uint8) * 255)


def test_alpha_is_composited_onto_white():
    rgb = np.array([[[10, 20, 30], [200, 100, 0]]], np.uint8)
    alpha = np.array([[255, 0]], np.uint8)
    expected = np.array([[[10, 20, 30], [255, 255, 255]]], np.uint8)
    rgba = Image.fromarray(np.concatenate([rgb, alpha[:, :, None]], axis=2), "RGBA")
    assert np.array_equal(np.asarray(load_image(rgba, "RGB")), expected)
    assert np.array_equal(np.asarray(load_image(np.asarray(rgba), "RGB")), expected)
    la = Image.fromarray(np.stack([GREY[0], np.array([255, 0, 255], np.uint8)], axis=1)[None], "LA")
    assert np.array_equal(np.asarray(load_image(la, "L")), [[0, 255, 127]])
    palette = Image.fromarray(rgb).quantize(2)
    palette.info["transparency"] = int(np.asarray(palette)[0, 1])  # the second pixel's colour is transparent
    assert np.array_equal(np.asarray(load_image(palette, "RGB")), expected)
    assert "transparency" not in load_image(palette, "RGB").info  # no processor composites it a second time


def test_values_out_of_range_are_refused_naming_the_input():
    with pytest.raises(UnreadableImageError, match=r"a NumPy array .* must hold values in \[0, 1\]"):
        load_image(np.full((2, 2), 1.5))
    with pytest.raises(UnreadableImageError, match="must hold non-negative values"):
        load_image(Image.fromarray(np.full((2, 2), -1, np.int32)))
    with pytest.raises(UnreadableImageError, match=r"int16 in \[-3, -3\]"):
        load_image(np.full((2, 2), -3, np.int16))


def test_a_url_larger_than_the_cap_is_refused(tmp_path):
    with serve_files({"/big.png": b"x" * 5000}) as base:
        with pytest.raises(UnreadableImageError, match=f"the image {base}/big.png is 5,000 bytes, more than the 4,096"):
            fetch_url(f"{base}/big.png", max_bytes=4096)
        assert fetch_url(f"{base}/big.png", max_bytes=5000) == b"x" * 5000


def test_the_pixel_limit_is_checked_before_decoding(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    Image.new("L", (200, 100)).save(path)
    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, "19999")
    opened = []
    real_load = Image.Image.load
    monkeypatch.setattr(Image.Image, "load", lambda self: opened.append(self) or real_load(self))
    with pytest.raises(ImageTooLargeError, match=f"{path}: image of 200 x 100 = 20,000 pixels exceeds the limit"):
        load_image(path)
    assert opened == []  # refused from the header: no pixel was decoded
