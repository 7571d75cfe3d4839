"""ID / OOD data for hf_gsc: benchmarks as ``datasets`` objects, and model-ready preprocessing.

>>> from hf_gsc.data import load_benchmark
>>> bench = load_benchmark("fmnist-ood")
>>> bench.id_splits["test"], sorted(bench.ood_splits)        # doctest: +SKIP
(Dataset(num_rows: 10000, ...), ['mnist', 'noise', 'notmnist', 'textures'])

The paper's benchmarks (``cifar10-ood``, ``cifar100-ood``, ``imagenet-ood``) read Hub datasets, also as
``IterableDataset`` with ``load_benchmark(name, streaming=True)``. See docs/data.md for each split's provenance,
licence, size and generation, and for how undecodable images are reported or skipped.
"""
from hf_gsc.reference_models import reference_model_path

from .benchmarks import BENCHMARKS, Benchmark, BenchmarkSpec, load_benchmark
from .decoding import UndecodableImageError, decode_image, decode_images, without_decoding
from .hub_benchmarks import HUB_BENCHMARKS, HubBenchmarkSpec, HubSplit
from .normalization import PixelNormalization, deferred_normalization
from .preprocessing import ImageTransform, collate, load_image_processor, make_transform, num_channels, prepare_dataset
from .splits import GatedDatasetError, load_split


__all__ = [
    "BENCHMARKS",
    "HUB_BENCHMARKS",
    "Benchmark",
    "BenchmarkSpec",
    "GatedDatasetError",
    "HubBenchmarkSpec",
    "HubSplit",
    "ImageTransform",
    "PixelNormalization",
    "UndecodableImageError",
    "collate",
    "decode_image",
    "decode_images",
    "deferred_normalization",
    "load_benchmark",
    "load_image_processor",
    "load_split",
    "make_transform",
    "num_channels",
    "prepare_dataset",
    "reference_model_path",
    "without_decoding",
]
