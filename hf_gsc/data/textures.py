"""The ``textures`` OOD split: random crops of real photographs and texture images.

Sources (all local, read in a fixed order for determinism: OpenCV's, then scikit-image's, by file name):

* the images bundled with scikit-image (``skimage/data/*.png|jpg``: brick, grass, gravel, camera,
  coins, moon, astronaut, coffee, ...; BSD-3-Clause / public domain / CC0, see skimage's README);
* OpenCV's sample images from the Debian package ``opencv-doc``
  (``/usr/share/doc/opencv-doc/examples/data``; Apache-2.0 / BSD-3-Clause), except ``digits.png``
  (the ``mnist`` split), ``sudoku.png`` and the stereo-calibration chessboard photos.

Each image of the split: pick a source at random, crop a random square of 24-50% of its shorter
side (at least 28 px), reduce it to 28x28 grayscale with antialiasing, and flip it at random.
"""
from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

from .arrays import to_dataset


SIZE = 28
OPENCV_DATA = Path(os.environ.get("HF_GSC_OPENCV_DATA", "/usr/share/doc/opencv-doc/examples/data"))
#: OpenCV samples not used: digits.png is the ``mnist`` OOD split itself and sudoku.png is mostly
#: printed digits; the 26 stereo-calibration photos (left01.jpg ... right14.jpg) all show the same
#: chessboard and would make a third of the split chessboards.
_CALIBRATION = re.compile(r"^(left|right)\d+\.jpg$")


def _excluded(name: str) -> bool:
    return name in {"digits.png", "sudoku.png"} or bool(_CALIBRATION.match(name))
_SUFFIXES = {".png", ".jpg", ".jpeg"}


def _skimage_dir() -> Path | None:
    try:
        import skimage.data  # only for its folder of bundled images
    except ImportError:
        return None
    return Path(skimage.data.__file__).parent


def source_files() -> tuple[Path, ...]:
    """The photographs / textures sampled from, sorted; raises when none is installed."""
    # OpenCV's folder first, then scikit-image's, each by file name. Sorting full paths instead made the
    # order (and so every crop of the split) depend on where the virtual environment lives: a clone under
    # /tmp put scikit-image first, one under /work put OpenCV first. This is the /work order, in which
    # the committed results in docs/ were computed.
    dirs = [d for d in (OPENCV_DATA, _skimage_dir()) if d is not None and d.is_dir()]
    files = tuple(
        f
        for d in dirs
        for f in sorted(d.iterdir(), key=lambda path: path.name)
        if f.suffix.lower() in _SUFFIXES and not _excluded(f.name)
    )
    if not files:
        raise FileNotFoundError(
            "no texture images found: install scikit-image (pip) or `apt-get install opencv-doc`."
        )
    return files


@functools.lru_cache(maxsize=1)
def _load_sources() -> tuple[tuple[str, np.ndarray], ...]:
    """(file name, grayscale uint8 array) of every source at least 56 px on its shorter side, so a
    crop never has to be upsampled much."""
    out = []
    for path in source_files():
        try:
            with Image.open(path) as im:
                # JPEGs: let the decoder scale down by 2/4/8 while staying >= 512 px (faster).
                im.draft("L", (512, 512))
                gray = np.asarray(im.convert("L"), dtype=np.uint8)
        except OSError:
            continue  # an unreadable sample image just is not used
        if min(gray.shape) >= 56 and gray.std() > 5:
            out.append((path.name, gray))
    return tuple(out)


def generate_textures(num_images: int = 5_000, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """(num_images, 28, 28) uint8 crops and the source file name of each; same seed -> same pixels.

    Near-constant crops (std < 8 grey levels, e.g. sky) are redrawn so that every image has texture.
    """
    rng = np.random.default_rng(seed)
    sources = _load_sources()
    images: list[np.ndarray] = []
    names: list[str] = []
    while len(images) < num_images:
        name, gray = sources[int(rng.integers(len(sources)))]
        short = min(gray.shape)
        side = int(max(SIZE, rng.uniform(0.24, 0.5) * short))
        top = int(rng.integers(0, gray.shape[0] - side + 1))
        left = int(rng.integers(0, gray.shape[1] - side + 1))
        crop = Image.fromarray(gray[top:top + side, left:left + side]).resize((SIZE, SIZE), Image.Resampling.BOX)
        arr = np.asarray(crop, dtype=np.uint8)
        if rng.random() < 0.5:
            arr = arr[:, ::-1]
        if arr.std() < 8:
            continue
        images.append(np.ascontiguousarray(arr))
        names.append(name)
    return np.stack(images), names


def build_textures(num_images: int = 5_000, seed: int = 0) -> datasets.Dataset:
    """The ``textures`` OOD split: ``label`` -1, the source image's file name in ``source``."""
    images, names = generate_textures(num_images, seed)
    return to_dataset(images, [-1] * num_images).add_column("source", names)
