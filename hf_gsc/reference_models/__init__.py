"""Small reference classifiers shipped with hf_gsc, trained by scripts/train_reference_models.py.

Each sub-folder (``vit``, ``swin``, ``resnet`` for ``fmnist-ood``; ``<arch>-openset`` for
``fmnist-openset`` where present) holds ``config.json``, ``model.safetensors``,
``preprocessor_config.json`` and ``training_results.json``, and loads with
``AutoModelForImageClassification.from_pretrained(reference_model_path("vit"))``.
"""
from __future__ import annotations

from pathlib import Path


ARCHS: tuple[str, ...] = ("vit", "swin", "resnet")
_ROOT = Path(__file__).resolve().parent
_SUFFIX = {"fmnist-ood": "", "fmnist-openset": "-openset"}


def reference_model_path(arch: str, benchmark: str = "fmnist-ood") -> Path:
    """Directory of the shipped reference model ``arch`` trained on ``benchmark``'s train split.

    Raises:
        ValueError: for an unknown arch or benchmark.
        FileNotFoundError: when that checkpoint is not shipped (train it with the script).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if benchmark not in _SUFFIX:
        raise ValueError(f"no reference models for benchmark {benchmark!r}; expected one of {sorted(_SUFFIX)}")
    path = _ROOT / f"{arch}{_SUFFIX[benchmark]}"
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{path} holds no checkpoint; create it with `python scripts/train_reference_models.py "
            f"--arch {arch} --benchmark {benchmark} --output-dir {path}`"
        )
    return path
