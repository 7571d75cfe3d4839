"""The largest image hf_gsc decodes, checked from the file's header before any pixel is decoded.

A compressed file can announce far more pixels than its size suggests: a 0.1 MB PNG of 10,000 x 10,000 pixels
decodes to 300 MB of RGB, and to more once preprocessed. PIL only warns between ``PIL.Image.MAX_IMAGE_PIXELS``
(about 89 megapixels) and twice that, and refuses beyond. hf_gsc refuses every image above
:func:`max_image_pixels` pixels, in the serving pipeline and in the evaluation, with
:class:`ImageTooLargeError` naming the limit and how to raise it.

The limit is read from the environment variable ``HF_GSC_MAX_IMAGE_PIXELS`` (a positive integer) each time an
image is checked, so it also reaches DataLoader worker processes; :func:`hf_gsc.utils.images.load_image`, the one
decoding path of every entry point, checks it; the default is :data:`DEFAULT_MAX_IMAGE_PIXELS`,
PIL's warning threshold. Images above twice ``PIL.Image.MAX_IMAGE_PIXELS`` are still refused by PIL itself.
"""

from __future__ import annotations

import os

from PIL import Image


#: Environment variable holding the limit, in pixels (width x height).
MAX_IMAGE_PIXELS_ENV = "HF_GSC_MAX_IMAGE_PIXELS"
#: The default limit: PIL's own decompression-bomb warning threshold (1024 * 1024 * 1024 // 4 // 3 pixels,
#: 89,478,485), written out so that a program changing ``PIL.Image.MAX_IMAGE_PIXELS`` does not change it.
DEFAULT_MAX_IMAGE_PIXELS = 1024 * 1024 * 1024 // 4 // 3


class ImageTooLargeError(ValueError):
    """An image has more pixels than :func:`max_image_pixels`; the message names the limit and how to raise it."""


def max_image_pixels() -> int:
    """The limit in force: ``HF_GSC_MAX_IMAGE_PIXELS`` when set, else :data:`DEFAULT_MAX_IMAGE_PIXELS`.

    Raises:
        ValueError: the variable is set to something other than a positive integer.
    """
    text = os.environ.get(MAX_IMAGE_PIXELS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_IMAGE_PIXELS
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{MAX_IMAGE_PIXELS_ENV} must be a positive integer (pixels), got {text!r}")
    return value


def check_image_size(image: Image.Image, limit: int | None = None) -> Image.Image:
    """``image`` unchanged when its size (known from the header, before decoding) is within ``limit`` pixels
    (default: :func:`max_image_pixels`).

    Raises:
        ImageTooLargeError: one line naming the image's size, the limit and ``HF_GSC_MAX_IMAGE_PIXELS``.
    """
    width, height = image.size
    limit = max_image_pixels() if limit is None else limit
    if width * height > limit:
        raise ImageTooLargeError(
            f"image of {width} x {height} = {width * height:,} pixels exceeds the limit of {limit:,} pixels; "
            f"set the environment variable {MAX_IMAGE_PIXELS_ENV} to a larger number of pixels to accept it"
        )
    return image


__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "MAX_IMAGE_PIXELS_ENV",
    "ImageTooLargeError",
    "check_image_size",
    "max_image_pixels",
]
