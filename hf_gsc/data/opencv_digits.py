"""The ``mnist`` OOD split: the 5,000 handwritten digits of OpenCV's ``digits.png``.

``digits.png`` (Debian package ``opencv-doc``) is a 2000x1000 grayscale sheet of 50 rows x 100
columns of 20x20 digits, 500 per class, classes in order 0..9 (5 rows each). MNIST itself was made
by fitting each digit into a 20x20 box and placing that box in a 28x28 canvas so that its centre of
mass is at the centre; the same is done here, so the split looks like MNIST to a 28x28 model.
"""
from __future__ import annotations

import os
from pathlib import Path

import datasets
import numpy as np
from PIL import Image

from .arrays import to_dataset


DIGITS_PNG = Path(
    os.environ.get("HF_GSC_OPENCV_DIGITS", "/usr/share/doc/opencv-doc/examples/data/digits.png")
)
CELL = 20
CANVAS = 28


def _centre_by_mass(cell: np.ndarray) -> np.ndarray:
    """Place a 20x20 uint8 digit in a 28x28 canvas with its centre of mass at (14, 14)."""
    canvas = np.zeros((CANVAS, CANVAS), dtype=np.uint8)
    mass = cell.astype(np.float64)
    total = mass.sum()
    if total == 0:
        cy = cx = (CELL - 1) / 2
    else:
        ys, xs = np.indices(cell.shape)
        cy, cx = (ys * mass).sum() / total, (xs * mass).sum() / total
    # Offset of the cell's top-left corner, clipped so the whole cell stays inside the canvas.
    top = int(np.clip(round((CANVAS - 1) / 2 - cy), 0, CANVAS - CELL))
    left = int(np.clip(round((CANVAS - 1) / 2 - cx), 0, CANVAS - CELL))
    canvas[top:top + CELL, left:left + CELL] = cell
    return canvas


def load_digits(path: Path = DIGITS_PNG) -> tuple[np.ndarray, np.ndarray]:
    """(5000, 28, 28) uint8 digits, MNIST-style, and their (5000,) int64 digit classes."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: install it with `apt-get install opencv-doc` "
            "(or set HF_GSC_OPENCV_DIGITS to a copy of OpenCV's samples/data/digits.png)."
        )
    sheet = np.asarray(Image.open(path).convert("L"), dtype=np.uint8)
    rows, cols = sheet.shape[0] // CELL, sheet.shape[1] // CELL
    cells = sheet[: rows * CELL, : cols * CELL].reshape(rows, CELL, cols, CELL).swapaxes(1, 2)
    cells = cells.reshape(rows * cols, CELL, CELL)
    images = np.stack([_centre_by_mass(c) for c in cells])
    # 500 digits per class, in class order.
    labels = np.repeat(np.arange(10, dtype=np.int64), len(cells) // 10)
    return images, labels


def build_opencv_digits() -> datasets.Dataset:
    """The ``mnist`` OOD split: 5,000 rows, ``label`` -1, the digit kept in ``source_label``."""
    images, digits = load_digits()
    return to_dataset(images, [-1] * len(images)).add_column("source_label", digits.tolist())
