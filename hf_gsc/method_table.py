"""The table of every registered method, written from what each method's class declares (``hf-gsc evaluate
--list-methods`` prints it; ``python -m hf_gsc.method_table`` too).

Nothing in it is typed by hand, so it cannot go stale: the summary is the first paragraph of the class docstring,
what a method reads is what it declares to the shared backbone pass (``reads_logits``, ``feature_splits()``,
``one_pass``), what it fits on is ``needs_fit`` / ``fit_split`` / ``needs_labels``, the fitted state is
``expected_state()`` on a small model with feature width ``D`` and ``K`` classes (a ViT; a ResNet for a method the
ViT is refused by: BATS; ``N``: one row per fitting sample), the grid is ``search_space`` with its ``search_space_source``.
"""

from __future__ import annotations

import re
import sys


#: Feature width and class count of the model the fitted-state shapes are read on: distinct numbers, so that each
#: dimension can be named back.
WIDTH, CLASSES = 24, 7


def _model():
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=WIDTH, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32, num_labels=CLASSES)).eval()


def _cnn():
    """A ResNet of the same ``D`` and ``K``, for a method that a ViT does not have what it reads for (BATS: a
    BatchNorm before the head)."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, WIDTH], depths=[1, 1],
                                                     num_labels=CLASSES)).eval()


def _built(cls, model, cnn):
    """``cls`` on the ViT, or on the ResNet where the ViT is refused."""
    try:
        return cls(model)
    except ValueError:
        return cls(cnn())


def _shape(shape: tuple) -> str:
    names = {None: "N", WIDTH: "D", CLASSES: "K"}
    return "(" + ", ".join(names.get(size, str(size)) for size in shape) + ")" if shape else "scalar"


def _markdown(text: str) -> str:
    """reStructuredText roles and literals of a docstring as Markdown code."""
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")


def _reads(detector) -> str:
    if not detector.one_pass:
        # A method with passes of its own says what they read where it is not a step on the input (NAC).
        return getattr(detector, "reads_description", "the input: a gradient step on it, then forwards of its own")
    described = getattr(detector, "reads_description", None)  # capture points that are not split points (Gram)
    if described is not None:
        return described
    parts = ["logits"] if detector.reads_logits else []
    gradient = hasattr(detector, "backend")  # GSC and GSC + ASH: the gradient through the head after the split
    for split in detector.feature_splits():
        plain = split.name == "penultimate" and not gradient
        parts.append("penultimate feature z" if plain else f"F at `{split.name}` + the head")
    return ", ".join(parts)


def rows() -> list[str]:
    from .detectors import DETECTORS

    model = _model()
    lines = ["| Method | What it is | Reads (one backbone pass unless said) | Fits on | Fitted state | "
             "Tuning grid (`--tune`) |", "|---|---|---|---|---|---|"]
    for method in sorted(DETECTORS):
        cls = DETECTORS[method]
        detector = _built(cls, model, _cnn)
        summary = _markdown(" ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())).rstrip(".")
        fits = f"ID {detector.fit_split}" + (" (labels)" if getattr(cls, "needs_labels", False) else "") \
            if detector.needs_fit else "nothing"
        state = ", ".join(f"`{name}` {_shape(shape)}" for name, shape in detector.expected_state().items()) or "none"
        grid = "; ".join(f"`{name}` {list(values)}" for name, values in cls.search_space.items())
        grid = f"{grid} ({cls.search_space_source})" if grid else f"not tuned: {cls.search_space_source}"
        cells = [f"`{method}`", summary, _reads(detector), fits, state, grid]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def method_table() -> str:
    """Every registered method as a Markdown table (see the module docstring)."""
    return "\n".join([
        "Shapes: `D` the feature width, `K` the classes, `N` the fitting samples; the fitted state is what a saved",
        "detector holds in `detector_state.safetensors`. Each method's file under `hf_gsc/detectors/` (GSC:",
        "`hf_gsc/detectors/gsc.py`) holds its settings and defaults with their sources, its reference, and where the",
        "authors' code and the paper differ; its settings class is `DETECTORS[method].config_class`.",
        "",
        *rows(),
    ])


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_gsc.method_table``: print the table (``--help`` says what it is)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m hf_gsc.method_table",
        description="Print every registered OOD method as a Markdown table: what it is, what it reads from the "
                    "backbone, what it fits on, its fitted state and its tuning grid (all read from each method's "
                    "class). Takes no other arguments.")
    parser.parse_args(argv)
    print(method_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
