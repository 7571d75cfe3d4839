"""The generated OOD validation sets, shared by ``--tune`` (:mod:`.tuning`) and the selection (:mod:`.selection`).

* the ID validation subset is split once at random (``--seed``) into two halves, ``tune_fit`` and ``tune_select``
  (:func:`split_halves`); the OOD sets are generated from ``tune_fit`` and compared with ``tune_select``, so no image
  of the ID side reappears, shuffled, on the OOD side;
* :func:`validation_ood_sets`: ``val_noise`` (uniform random pixels, the source image's size and mode) and
  ``val_jigsaw`` (the source image's 4x4 grid of patches in a random non-identity order, :func:`jigsaw_image`), one
  image per source image, seed :data:`VALIDATION_SEED`; plus ``val_heldout_classes`` where a benchmark holds classes
  out of distribution with validation rows of their own (``fmnist-openset``, :data:`HELDOUT_VALIDATION`).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..data.decoding import decode_image, without_decoding


#: Seed of everything generated for the OOD validation sets (the generated test OOD splits use seed 0).
VALIDATION_SEED = 1001
#: Patches per side of the jigsaw OOD validation set.
JIGSAW_GRID = 4


def split_halves(num_rows: int, seed: int) -> tuple[list[int], list[int]]:
    """``(tune_fit rows, tune_select rows)``: a random half of ``range(num_rows)`` and the rest (the larger half with
    an odd count), each sorted."""
    order = np.random.default_rng([seed, zlib.crc32(b"tune")]).permutation(num_rows)
    half = num_rows // 2
    return sorted(order[:half].tolist()), sorted(order[half:].tolist())


def _array_of(image: Any) -> np.ndarray:
    """uint8 ``(H, W)`` or ``(H, W, 3)`` pixels of a PIL image (other modes as RGB)."""
    return np.asarray(image if image.mode in ("L", "RGB") else image.convert("RGB"))


def jigsaw_image(pixels: np.ndarray, rng: np.random.Generator, grid: int = JIGSAW_GRID) -> np.ndarray:
    """``pixels`` ``(H, W[, C])`` cropped to a multiple of ``grid`` per side, its ``grid x grid`` patches in a random
    non-identity order."""
    height, width = pixels.shape[0] // grid, pixels.shape[1] // grid
    if height == 0 or width == 0:
        raise ValueError(f"an image of {pixels.shape[1]}x{pixels.shape[0]} pixels is too small for a {grid}x{grid} jigsaw")
    rest = pixels.shape[2:]
    cropped = pixels[: grid * height, : grid * width]
    patches = cropped.reshape(grid, height, grid, width, *rest).swapaxes(1, 2).reshape(grid * grid, height, width, *rest)
    order = rng.permutation(grid * grid)
    while np.array_equal(order, np.arange(grid * grid)):
        order = rng.permutation(grid * grid)
    shuffled = patches[order].reshape(grid, grid, height, width, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(shuffled.reshape(grid * height, grid * width, *rest))


class GeneratedImages:
    """An OOD validation set generated on the fly from the images of ``source`` (one image per source row), read by
    :func:`~hf_gsc.evaluation.loaders.make_dataloader` like a ``datasets.Dataset`` (``image`` and ``label`` = -1).

    ``kind``: ``"noise"`` (uniform random pixels of the source image's size and mode) or ``"jigsaw"``
    (:func:`jigsaw_image`). Image ``i`` depends on ``(seed, i)`` only, not on the batch it is read in.
    """

    features = None  # no datasets.Image column to cast: the images are made here
    column_names = ("image", "label")
    KINDS = ("noise", "jigsaw")

    def __init__(self, source: Any, kind: str, seed: int = VALIDATION_SEED, source_name: str = "ID validation") -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        self.source, self.kind, self.seed, self.source_name = without_decoding(source), kind, seed, source_name

    def __len__(self) -> int:
        return len(self.source)

    def content_fingerprint(self) -> str:
        """What the images depend on (the source rows, the kind, the seed), for the score cache."""
        from .fingerprints import dataset_fingerprint, fingerprint

        return fingerprint({"generated": self.kind, "seed": self.seed, "source": dataset_fingerprint(self.source)})

    def _make(self, value: Any, row: int) -> Any:
        from PIL import Image

        image = decode_image(value, self.source_name, row, on_error="skip")
        if image is None:  # left as it is: the loader's own decoding reports (or skips) it like any unreadable image
            return value
        pixels = _array_of(image)
        rng = np.random.default_rng([self.seed, zlib.crc32(self.kind.encode()), row])
        if self.kind == "noise":
            return Image.fromarray(rng.integers(0, 256, size=pixels.shape, dtype=np.uint8))
        return Image.fromarray(jigsaw_image(pixels, rng))

    def __getitem__(self, rows: Any) -> dict[str, list[Any]]:
        rows = [int(rows)] if isinstance(rows, (int, np.integer)) else [int(row) for row in rows]
        values = self.source[rows]["image"]
        return {"image": [self._make(value, row) for value, row in zip(values, rows)], "label": [-1] * len(rows)}


def heldout_classes_validation(num_samples: int, seed: int = VALIDATION_SEED) -> Any:
    """``fmnist-openset``: at most ``num_samples`` Fashion-MNIST *validation* rows (never test images) of the classes
    the benchmark keeps out of distribution, drawn at random with ``seed``."""
    from ..data import fashion_mnist
    from ..data.arrays import to_dataset
    from ..data.benchmarks import OPENSET_OOD_CLASSES

    validation = fashion_mnist.load_arrays()["validation"]
    rows = np.flatnonzero(np.isin(validation.labels, OPENSET_OOD_CLASSES))
    rows = rows[:num_samples] if len(rows) <= num_samples else np.sort(
        np.random.default_rng(seed).choice(rows, size=num_samples, replace=False)
    )
    return to_dataset(validation.images[rows], [-1] * len(rows))


#: Benchmarks whose OOD classes have validation rows -> ``(num_samples, seed) -> dataset`` of them.
HELDOUT_VALIDATION: dict[str, Callable[[int, int], Any]] = {"fmnist-openset": heldout_classes_validation}


def validation_ood_sets(benchmark: str | None, source: Any, num_samples: int, seed: int = VALIDATION_SEED
                        ) -> dict[str, Any]:
    """The OOD validation sets: ``val_noise`` and ``val_jigsaw`` from the images of ``source`` (ID validation rows),
    and ``val_heldout_classes`` (``num_samples`` rows) where :data:`HELDOUT_VALIDATION` defines it for ``benchmark``."""
    sets = {f"val_{kind}": GeneratedImages(source, kind, seed) for kind in GeneratedImages.KINDS}
    if benchmark in HELDOUT_VALIDATION:
        sets["val_heldout_classes"] = HELDOUT_VALIDATION[benchmark](num_samples, seed)
    return sets


__all__ = ["HELDOUT_VALIDATION", "JIGSAW_GRID", "VALIDATION_SEED", "GeneratedImages", "heldout_classes_validation",
           "jigsaw_image", "split_halves", "validation_ood_sets"]
