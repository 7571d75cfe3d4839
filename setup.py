"""Packaging for hf_gsc. torch is pinned to the local CPU wheel on the project's machines (see README)."""
import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("hf_gsc/__init__.py").read_text()).group(1)

setup(
    name="hf_gsc",
    version=version,
    description="Gradient Short-Circuit out-of-distribution detection for Hugging Face image classifiers",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["hf_gsc", "hf_gsc.*"]),
    package_data={
        "hf_gsc": [
            "py.typed",
            "evaluation/ood_detection_metric/*.py",
            "reference_models/*/*.json",
            "reference_models/*/*.safetensors",
        ]
    },
    python_requires=">=3.10",
    # No torchvision: image processors run with the PIL backend.
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0",
        "datasets>=3.0",
        "accelerate>=1.0",
        "huggingface_hub>=1.0",
        "safetensors>=0.4",
        "evaluate>=0.4",
        "scikit-learn>=1.3",
        "scikit-image>=0.22",
        "matplotlib>=3.7",
        "tqdm>=4.60",
        "pillow>=10.0",
        "numpy>=1.24",
    ],
    extras_require={"test": ["pytest>=8"]},
    license="Apache-2.0",
)
