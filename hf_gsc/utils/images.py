"""Any image input -> the 8-bit PIL image a model's image processor takes: the one decoding rule of hf_gsc.

``hf-gsc evaluate`` (through :mod:`hf_gsc.data.decoding`), ``fit``, ``calibrate`` (:mod:`hf_gsc.utils.inputs`) and the
``ood-image-classification`` pipeline all call :func:`load_image`, so a detector is fitted and calibrated on the
pixels it later serves. What each input turns into (docs/inputs.md has the same table):

==========================================  ===============================================================
input                                        becomes
==========================================  ===============================================================
path, ``http(s)://`` URL, bytes,             opened lazily; the pixel limit (:mod:`hf_gsc.utils.image_limits`) is
``data:image/...`` or base64 string          checked from the header, then the image is decoded
EXIF orientation tag                         applied (the image is turned upright)
mode ``1``, boolean array                    ``L``: False -> 0, True -> 255
16-bit (``I;16``, ``uint16``)                ``L``, scaled: 65535 -> 255
32-bit integer (``I``)                       ``L``, scaled from 0..65535 when every value fits in 16 bits
                                             (16-bit files are often held as ``I``), else from 0..2**31-1
float (``F``, float array)                   values in [0, 1] scaled to 0..255; others refused
other integer arrays                         values in 0..255 taken as they are; others refused
alpha (``LA``, ``RGBA``, ``PA``, a           composited onto white, as transformers' ``convert_to_rgb``
transparency colour)
palette, CMYK, YCbCr, LAB, HSV               ``RGB`` (or ``L`` for a grey palette)
then                                         the model's mode: ``RGB`` for 3 channels, ``L`` for 1
==========================================  ===============================================================

Every failure is an :class:`UnreadableImageError` (or :class:`~hf_gsc.utils.image_limits.ImageTooLargeError`) whose
message names the source: the path, the URL (with its HTTP status), or what the caller names (a dataset and row).
URLs are fetched with ``requests``, with a timeout (:data:`DEFAULT_TIMEOUT`) and a size cap (:data:`MAX_URL_BYTES`).
"""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from .image_limits import ImageTooLargeError, check_image_size, max_image_pixels


#: Seconds to wait for a URL's server (connecting, and between bytes) when the caller gives no timeout.
DEFAULT_TIMEOUT = 10.0
#: The most bytes read from one URL: an image file larger than this is refused before it is read to the end.
MAX_URL_BYTES = 64 * 1024 * 1024

#: The EXIF tag of the orientation (1: upright).
_ORIENTATION = 0x0112
#: PIL modes holding 16-bit unsigned samples.
_SIXTEEN_BIT = ("I;16", "I;16B", "I;16L", "I;16N")
#: PIL modes converted through RGB (colour spaces an image processor does not take).
_COLOUR_SPACES = ("P", "CMYK", "YCbCr", "LAB", "HSV", "RGBX")


class UnreadableImageError(ValueError):
    """An image input could not be read or decoded; the message names the input (path, URL, dataset row)."""


def model_mode(num_channels: int | None) -> str | None:
    """The PIL mode a model of ``num_channels`` input channels takes: ``"L"`` for 1, ``"RGB"`` for 3, ``None``
    (the image's own 8-bit mode) when the model does not say."""
    return {1: "L", 3: "RGB"}.get(num_channels) if num_channels is not None else None


def describe(source: Any) -> str:
    """How an input is named in messages: the path or URL, else its kind."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.startswith("data:image/") or len(text) > 200:
            return f"an encoded image string ({len(text)} characters)"
        return text
    if isinstance(source, (bytes, bytearray)):
        return f"{len(source)} bytes of image data"
    if isinstance(source, np.ndarray):
        return f"a NumPy array of shape {source.shape} and dtype {source.dtype}"
    if isinstance(source, Image.Image):
        return f"a PIL image ({source.mode}, {source.width} x {source.height})"
    return f"a {type(source).__name__}"


def fetch_url(url: str, timeout: float | None = None, max_bytes: int = MAX_URL_BYTES) -> bytes:
    """The body of ``url`` (``http://`` or ``https://``), read with a ``timeout`` (seconds, default
    :data:`DEFAULT_TIMEOUT`) and at most ``max_bytes`` bytes.

    Raises:
        UnreadableImageError: naming the URL: not reachable, timed out, an HTTP error status, or too large.
    """
    import requests

    try:
        with requests.get(url, timeout=DEFAULT_TIMEOUT if timeout is None else timeout, stream=True) as response:
            if response.status_code >= 400:
                raise UnreadableImageError(f"cannot fetch the image {url}: HTTP {response.status_code} "
                                           f"{response.reason or ''}".rstrip())
            announced = response.headers.get("Content-Length")
            if announced is not None and announced.isdigit() and int(announced) > max_bytes:
                raise UnreadableImageError(f"the image {url} is {int(announced):,} bytes, more than the "
                                           f"{max_bytes:,} hf_gsc reads from a URL")
            body = bytearray()
            for chunk in response.iter_content(chunk_size=1 << 16):
                body += chunk
                if len(body) > max_bytes:
                    raise UnreadableImageError(f"the image {url} is more than the {max_bytes:,} bytes hf_gsc reads "
                                               "from a URL")
            return bytes(body)
    except requests.RequestException as error:
        raise UnreadableImageError(f"cannot fetch the image {url}: {type(error).__name__}: {error}") from error


def _open(source: Any, timeout: float | None) -> Image.Image:
    """``source`` opened lazily (header read, pixels not decoded)."""
    if isinstance(source, (bytes, bytearray)):
        return Image.open(io.BytesIO(source))
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        raise TypeError(f"an image must be a path, URL, bytes, PIL image or NumPy array, got {type(source).__name__}")
    if source.startswith(("http://", "https://")):
        return Image.open(io.BytesIO(fetch_url(source, timeout)))
    if "::" in source:  # a file inside an archive, as datasets' image-folder loader records it (zip://m::/a.zip)
        import fsspec

        with fsspec.open(source, "rb") as handle:
            return Image.open(io.BytesIO(handle.read()))
    if os.path.isfile(source):
        return Image.open(source)
    encoded = source.split(",", 1)[1] if source.startswith("data:image/") else source
    try:
        return Image.open(io.BytesIO(base64.b64decode(encoded, validate=True)))
    except (ValueError, OSError):  # not base64, or base64 of no image: most likely a mistyped path
        if source.startswith("data:image/"):
            raise
        raise FileNotFoundError("no such file (and not an http(s) URL or a base64-encoded image)") from None


def array_to_image(array: Any) -> Image.Image:
    """A NumPy image as an 8-bit ``L`` or ``RGB`` PIL image: ``H x W`` (grey), ``H x W x 1``, ``H x W x 3`` (RGB) or
    ``H x W x 4`` (RGBA, composited onto white); boolean (0 / 255), ``uint8``, ``uint16`` (scaled: 65535 -> 255), floating point in ``[0, 1]`` (scaled
    to 0..255) or another integer type holding 0..255. Anything else is a ``ValueError`` saying what was expected."""
    array = np.asarray(array)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)) or 0 in array.shape:
        several = " (several images: pass a list of them)" if array.ndim == 4 else ""
        raise ValueError(f"a NumPy image must be H x W, H x W x 1, H x W x 3 or H x W x 4, got shape "
                         f"{array.shape}{several}")
    if array.dtype == np.bool_:
        array = array.astype(np.uint8) * 255
    elif array.dtype == np.uint16:
        array = _scaled(array, 65535)
    elif np.issubdtype(array.dtype, np.floating):
        array = _unit_floats(array, "a floating-point NumPy image")
    elif array.dtype != np.uint8:
        if not np.issubdtype(array.dtype, np.integer) or array.min() < 0 or array.max() > 255:
            found = f"[{array.min()}, {array.max()}]" if np.issubdtype(array.dtype, np.number) else "values"
            raise ValueError(f"an integer NumPy image must hold values in 0..255 (uint8), or be uint16 or boolean; "
                             f"got {array.dtype} in {found}")
    return _eight_bit(Image.fromarray(np.ascontiguousarray(array.astype(np.uint8))))  # RGBA composited on white


def _scaled(values: np.ndarray, top: int) -> np.ndarray:
    """Integer samples in ``0..top`` as uint8, rounded to nearest (``top`` -> 255)."""
    return np.round(values.astype(np.float64) * (255.0 / top)).astype(np.uint8)


def _unit_floats(values: np.ndarray, what: str) -> np.ndarray:
    if values.size and (not np.isfinite(values).all() or values.min() < 0 or values.max() > 1):
        raise ValueError(f"{what} must hold values in [0, 1] (uint8 images hold 0..255), got values in "
                         f"[{np.nanmin(values)}, {np.nanmax(values)}]")
    return np.round(values.astype(np.float64) * 255.0).astype(np.uint8)


def _eight_bit(image: Image.Image) -> Image.Image:
    """A decoded, upright image as ``L`` or ``RGB`` 8-bit samples (see the module docstring's table)."""
    mode = image.mode
    if mode == "1":
        return image.convert("L")  # PIL maps 1 -> 255
    if mode in _SIXTEEN_BIT:
        return Image.fromarray(_scaled(np.asarray(image), 65535), "L")
    if mode == "I":
        values = np.asarray(image)
        if values.size and values.min() < 0:
            raise ValueError(f"a 32-bit integer image must hold non-negative values, got a minimum of {values.min()}")
        top = 65535 if not values.size or values.max() <= 65535 else 2**31 - 1
        return Image.fromarray(_scaled(values, top), "L")
    if mode == "F":
        return Image.fromarray(_unit_floats(np.asarray(image), "a floating-point (mode F) image"), "L")
    if "A" in image.getbands() or "a" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        grey = image.mode in ("L", "LA", "La") or (image.mode in ("P", "PA") and _grey_palette(image))
        flat = Image.alpha_composite(white, rgba).convert("RGB")
        return flat.convert("L") if grey else flat
    if mode in _COLOUR_SPACES:
        return image.convert("L") if mode == "P" and _grey_palette(image) else image.convert("RGB")
    if mode not in ("L", "RGB"):
        return image.convert("RGB")
    return image


def _grey_palette(image: Image.Image) -> bool:
    """Whether a palette image's colours are all grey (it is then read as ``L``, as its pixels are grey)."""
    palette = image.getpalette() or []
    return all(palette[i] == palette[i + 1] == palette[i + 2] for i in range(0, len(palette) - 2, 3))


def to_model_image(image: Image.Image, mode: str | None = None) -> Image.Image:
    """An opened PIL image turned upright (EXIF orientation), in 8 bits and in ``mode`` (``"RGB"``, ``"L"``, or
    ``None`` for its own ``L`` / ``RGB``); decodes it if it is not yet. The result carries no transparency."""
    if image.getexif().get(_ORIENTATION, 1) != 1:  # exif_transpose copies every image; only turn those it turns
        image = ImageOps.exif_transpose(image)
    image.load()
    image = _eight_bit(image)
    if mode is not None and image.mode != mode:
        image = image.convert(mode)
    image.info.pop("transparency", None)  # composited already: no processor composites it a second time
    return image


def decode(source: Any, mode: str | None = None, timeout: float | None = None) -> Image.Image:
    """What :func:`load_image` does, raising the reading library's own error (``OSError``, ``ValueError``, ...)
    without naming the input: for callers that name it their own way (:func:`hf_gsc.data.decoding.decode_image`
    names the dataset and row).

    Every image is decoded at full size, whatever the model's input size. PIL's JPEG draft mode (the decoder
    producing 1/2, 1/4 or 1/8 scale) would be about 4 times cheaper on photos much larger than the input, but it
    only applies to a file not yet decoded: a PIL image the caller already decoded (a ``datasets`` image, a photo
    handed to the pipeline or the demo app) is at full size, so draft decoding would give the same photo other
    pixels, and other scores, depending on the path it took. One rule for every path is worth more than the speed."""
    limit = max_image_pixels()
    if isinstance(source, dict):  # a datasets.Image(decode=False) cell
        source = source["bytes"] if source.get("bytes") is not None else source.get("path")
        if source is None:
            raise ValueError("the cell holds neither image bytes nor a path")
    if isinstance(source, np.ndarray):
        image = array_to_image(source)
    elif isinstance(source, Image.Image):
        image = source
    else:
        image = _open(source, timeout)
    check_image_size(image, limit)  # from the header: an oversized image is refused before its pixels exist
    return to_model_image(image, mode)


def load_image(source: Any, mode: str | None = None, timeout: float | None = None, name: str | None = None) -> Image.Image:
    """``source`` (a path, ``http(s)://`` URL, bytes, ``data:image/`` or base64 string, PIL image, NumPy array, or
    a ``{"bytes", "path"}`` dataset cell) as the 8-bit, upright PIL image of ``mode`` a model's processor takes
    (the module docstring's table). The pixel limit is checked from the header, before decoding.

    Args:
        mode: ``"RGB"``, ``"L"`` or ``None`` (see :func:`to_model_image`); :func:`model_mode` gives a model's.
        timeout: seconds for a URL (default :data:`DEFAULT_TIMEOUT`).
        name: how messages name the input (default: the path, URL or kind, :func:`describe`).

    Raises:
        UnreadableImageError: naming the input, for any input that cannot be read or decoded.
        ImageTooLargeError: naming the input, for an image above the pixel limit.
    """
    max_image_pixels()  # a bad HF_GSC_MAX_IMAGE_PIXELS is its own error, not an unreadable image
    if name is None:
        cell = isinstance(source, dict)
        name = (source.get("path") or "image bytes stored in a dataset") if cell else describe(source)
    try:
        return decode(source, mode, timeout)
    except ImageTooLargeError as error:
        raise ImageTooLargeError(f"{name}: {error}") from None
    except UnreadableImageError as error:  # already names the URL
        raise UnreadableImageError(str(error)) from error
    except Exception as error:  # noqa: BLE001 -- PIL, the file system and the network raise many types
        raise UnreadableImageError(f"cannot read the image {name}: {reason(error)}") from error


def reason(error: BaseException) -> str:
    """The first line of an error's message (or its type's name), for one-line messages."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_URL_BYTES",
    "UnreadableImageError",
    "array_to_image",
    "decode",
    "describe",
    "fetch_url",
    "load_image",
    "model_mode",
    "reason",
    "to_model_image",
]
