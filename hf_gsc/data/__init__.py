"""ID / OOD data for hf_gsc: benchmarks as ``datasets`` objects, and model-ready preprocessing.

>>> from hf_gsc.data import load_benchmark
>>> bench = load_benchmark("fmnist-ood")
>>> bench.id_splits["test"], sorted(bench.ood_splits)        # doctest: +SKIP
(Dataset(num_rows: 10000, ...), ['mnist', 'noise', 'notmnist', 'textures'])

See docs/data.md for each split's provenance, licence, size and generation.
"""
from hf_gsc.reference_models import reference_model_path

from .benchmarks import BENCHMARKS, Benchmark, BenchmarkSpec, load_benchmark
from .preprocessing import collate, load_image_processor, make_transform, num_channels, prepare_dataset
from .splits import load_split

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "BenchmarkSpec",
    "collate",
    "load_benchmark",
    "load_image_processor",
    "load_split",
    "make_transform",
    "num_channels",
    "prepare_dataset",
    "reference_model_path",
]
