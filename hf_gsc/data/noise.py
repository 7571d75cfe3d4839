"""The ``noise`` OOD split: synthetic 28x28 grayscale images with no object in them.

Three kinds in equal parts, interleaved (row ``i`` is kind ``i % 3``):

* ``gaussian``: i.i.d. N(mu, sigma) pixels, mu ~ U(0.2, 0.8), sigma ~ U(0.1, 0.35), clipped;
* ``uniform``: i.i.d. U(lo, lo + w) pixels, w ~ U(0.2, 1), the range inside [0, 1];
* ``blobs``: 2-8 random Gaussian bumps (random centre, radius 1.5-6 px, amplitude) on black,
  closer to the blob-like ID images than pixel noise is.
"""
from __future__ import annotations

import datasets
import numpy as np

from .arrays import to_dataset


SIZE = 28
KINDS: tuple[str, ...] = ("gaussian", "uniform", "blobs")


def _gaussian(rng: np.random.Generator) -> np.ndarray:
    mu, sigma = rng.uniform(0.2, 0.8), rng.uniform(0.1, 0.35)
    return rng.normal(mu, sigma, (SIZE, SIZE))


def _uniform(rng: np.random.Generator) -> np.ndarray:
    # A range of at least 0.2 that stays inside [0, 1], so clipping never flattens the image.
    width = rng.uniform(0.2, 1.0)
    lo = rng.uniform(0.0, 1.0 - width)
    return rng.uniform(lo, lo + width, (SIZE, SIZE))


def _blobs(rng: np.random.Generator) -> np.ndarray:
    ys, xs = np.mgrid[0:SIZE, 0:SIZE].astype(np.float64)
    image = np.zeros((SIZE, SIZE))
    for _ in range(rng.integers(2, 9)):
        cy, cx = rng.uniform(2, SIZE - 2, 2)
        radius = rng.uniform(1.5, 6.0)
        image += rng.uniform(0.4, 1.0) * np.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / (2 * radius**2))
    return image / max(image.max(), 1e-6)


_GENERATORS = {"gaussian": _gaussian, "uniform": _uniform, "blobs": _blobs}


def generate_noise(num_images: int = 5_000, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """(num_images, 28, 28) uint8 noise images and the kind of each; same seed -> same pixels."""
    rng = np.random.default_rng(seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(num_images)]
    images = np.stack([_GENERATORS[kind](rng) for kind in kinds])
    return (np.clip(images, 0.0, 1.0) * 255).round().astype(np.uint8), kinds


def build_noise(num_images: int = 5_000, seed: int = 0) -> datasets.Dataset:
    """The ``noise`` OOD split: ``label`` -1, the kind kept in ``source``."""
    images, kinds = generate_noise(num_images, seed)
    return to_dataset(images, [-1] * num_images).add_column("source", kinds)
