"""The ``notmnist`` OOD split: letters A-J rendered from the fonts of Debian font packages.

Like notMNIST (letters A-J in many typefaces), but generated locally: each image picks a letter,
a font from ``fonts-dejavu-core`` / ``fonts-liberation`` / ``fonts-freefont-ttf`` (whichever are
installed), and jitter (rotation, scale, aspect, position, stroke brightness, slight blur), and
draws it light-on-black like the Fashion-MNIST images. The glyph is drawn at 48x48 and reduced to
28x28 with antialiasing.

Determinism: the same seed and the same installed fonts give identical pixels.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import datasets
import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from .arrays import to_dataset


LETTERS = "ABCDEFGHIJ"
SIZE = 28
_DRAW_SIZE = 48
_FONT_PX = 36
#: Folders of the Debian font packages used; overridable with HF_GSC_FONT_DIRS (":"-separated).
FONT_DIRS: tuple[Path, ...] = tuple(
    Path(p)
    for p in os.environ.get(
        "HF_GSC_FONT_DIRS",
        "/usr/share/fonts/truetype/dejavu:/usr/share/fonts/truetype/liberation:"
        "/usr/share/fonts/truetype/freefont",
    ).split(":")
)


@functools.lru_cache(maxsize=1)
def font_files() -> tuple[Path, ...]:
    """Installed ``.ttf`` / ``.otf`` files that draw every letter A-J (sorted, for determinism)."""
    found = sorted(
        f for d in FONT_DIRS if d.is_dir() for f in d.rglob("*") if f.suffix.lower() in {".ttf", ".otf"}
    )
    usable = tuple(f for f in found if _draws_letters(f))
    if not usable:
        raise FileNotFoundError(
            f"no usable fonts in {[str(d) for d in FONT_DIRS]}: install them with "
            "`apt-get install fonts-dejavu-core fonts-liberation fonts-freefont-ttf`."
        )
    return usable


def _draws_letters(path: Path) -> bool:
    """Fonts such as DejaVuMathTeXGyre may map letters to nothing or to the same box glyph."""
    try:
        font = ImageFont.truetype(str(path), _FONT_PX)
    except OSError:
        return False
    masks = [np.asarray(font.getmask(letter), dtype=np.uint8) for letter in "AB"]
    return all(m.size and m.max() > 0 for m in masks) and (
        masks[0].shape != masks[1].shape or not np.array_equal(masks[0], masks[1])
    )


@functools.lru_cache(maxsize=64)
def _font(path: Path) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(path), _FONT_PX)


def render_letter(letter: str, font: Path, rng: np.random.Generator) -> np.ndarray:
    """One jittered 28x28 uint8 image of ``letter`` drawn in ``font``."""
    canvas = Image.new("L", (_DRAW_SIZE, _DRAW_SIZE), 0)
    draw = ImageDraw.Draw(canvas)
    draw.text((_DRAW_SIZE / 2, _DRAW_SIZE / 2), letter, fill=int(rng.integers(170, 256)),
              font=_font(font), anchor="mm")
    canvas = canvas.rotate(float(rng.uniform(-15, 15)), resample=Image.Resampling.BILINEAR)
    box = canvas.getbbox()
    if box is None:  # cannot happen for fonts that passed _draws_letters; keep the image valid
        box = (0, 0, _DRAW_SIZE, _DRAW_SIZE)
    glyph = canvas.crop(box)
    # Fit the glyph's longer side to 16-26 px (notMNIST letters nearly fill the frame), with a
    # random aspect change of +-15%.
    target = rng.uniform(16, 26)
    scale = target / max(glyph.size)
    aspect = rng.uniform(0.85, 1.15)
    w = max(1, min(SIZE, round(glyph.width * scale * aspect)))
    h = max(1, min(SIZE, round(glyph.height * scale)))
    glyph = glyph.resize((w, h), resample=Image.Resampling.BOX)
    out = Image.new("L", (SIZE, SIZE), 0)
    left = int(np.clip((SIZE - w) // 2 + rng.integers(-2, 3), 0, SIZE - w))
    top = int(np.clip((SIZE - h) // 2 + rng.integers(-2, 3), 0, SIZE - h))
    out.paste(glyph, (left, top))
    if rng.random() < 0.3:
        out = out.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.3, 0.8))))
    return np.asarray(out, dtype=np.uint8)


def generate_letters(num_images: int = 5_000, seed: int = 0) -> tuple[np.ndarray, list[str], list[str]]:
    """(num_images, 28, 28) uint8 letters, the letter of each, and the font file name of each.

    Letters cycle A..J so the classes are balanced; fonts are drawn at random.
    """
    rng = np.random.default_rng(seed)
    fonts = font_files()
    letters = [LETTERS[i % len(LETTERS)] for i in range(num_images)]
    images, chosen = [], []
    for letter in letters:
        # Font and jitter drawn per image from one stream, so the first k images do not depend on
        # num_images (a split of 5,000 starts with the split of 100).
        font = fonts[int(rng.integers(len(fonts)))]
        images.append(render_letter(letter, font, rng))
        chosen.append(font.name)
    return np.stack(images), letters, chosen


def build_notmnist(num_images: int = 5_000, seed: int = 0) -> datasets.Dataset:
    """The ``notmnist`` OOD split: ``label`` -1, the letter in ``source_label``, font in ``source``."""
    images, letters, fonts = generate_letters(num_images, seed)
    ds = to_dataset(images, [-1] * num_images)
    return ds.add_column("source_label", letters).add_column("source", fonts)
