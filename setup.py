"""Packaging for hf_gsc. torch is pinned to the local CPU wheel on the project's machines (see README).

A light core install serves detectors (load, save, push, the ``ood-image-classification`` pipeline); the
extras add the evaluation (``hf-gsc evaluate``), its plots and the offline benchmark data. The model-card
template stays in the top-level ``model_cards/`` folder and is installed inside the package as
``hf_gsc/model_cards/``.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("hf_gsc/utils/version.py").read_text()).group(1)

extras = {
    "evaluation": ["datasets>=3.0", "accelerate>=1.1", "scikit-learn>=1.3", "evaluate>=0.4", "tqdm>=4.60"],
    "plots": ["matplotlib>=3.7"],
    # The offline benchmarks' photo and texture sources (scikit-image ships its sample images).
    "benchmarks": ["scikit-image>=0.22"],
    "test": ["pytest>=8"],
    # scripts/benchmark_scale.py: KNN's exact search against faiss IndexFlatL2 on the same bank (optional).
    "scale": ["faiss-cpu>=1.7"],
    # make docs: the documentation site and its API reference from the docstrings (pymdown-extensions: GitHub's
    # heading ids, so that #anchors work on GitHub and on the site alike).
    "docs": ["mkdocs>=1.6", "mkdocstrings[python]>=0.27", "pymdown-extensions>=10.0"],
}
extras["all"] = sorted({requirement for name in ("evaluation", "plots", "benchmarks") for requirement in extras[name]})

setup(
    name="hf_gsc",
    version=version,
    description="Gradient Short-Circuit out-of-distribution detection for Hugging Face image classifiers",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hf_gsc", "hf_gsc.*"]) + ["hf_gsc.model_cards"],
    package_dir={"hf_gsc.model_cards": "model_cards"},
    package_data={
        "hf_gsc": [
            "py.typed",
            "evaluation/ood_detection_metric/*.py",
            "reference_models/*/*.json",
            "reference_models/*/*.safetensors",
        ],
        "hf_gsc.model_cards": ["*.md"],
    },
    python_requires=">=3.10",
    # No torchvision: image processors fall back to the PIL backend. torch>=2.6: the oldest torch transformers 5
    # supports (its `torch` extra); hf_gsc itself needs nothing newer.
    install_requires=[
        "torch>=2.6",
        "transformers>=5.0",
        "huggingface_hub>=1.0",
        "safetensors>=0.4",
        "numpy>=1.24",
        "pillow>=10.0",
        "packaging>=20.0",
        # Image URLs (fit, calibrate, the pipeline) are fetched with a timeout and a size cap (hf_gsc.utils.images).
        "requests>=2.28",
    ],
    extras_require=extras,
    entry_points={"console_scripts": ["hf-gsc = hf_gsc.cli:main"]},
    license="Apache-2.0",
)
