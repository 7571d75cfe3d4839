"""Hashes that tie a cached artefact (score file, fitted state, analysis result) to what it was computed from.

* :func:`fingerprint`: a JSON description (settings, split, other fingerprints) -> a short stable hash.
* :func:`model_fingerprint`: the model's class, config and weights, so a cache follows the weights, not a path.
* :func:`dataset_fingerprint`: the content of a split's rows, so a cache follows the data, not its name.
* :func:`file_sha256`: a checkpoint file on disk (``model.safetensors``), recorded next to analysis results.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

import torch


def fingerprint(values: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-serialisable description (sorted keys)."""
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the model's class, config and weights, so cached scores follow the weights, not a path."""
    digest = hashlib.sha256(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def is_streamed(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.IterableDataset`` (no ``len``, no random access)."""
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def dataset_fingerprint(dataset: Any) -> str:
    """Hash of the rows' content (every column's Arrow buffers), so cached scores follow the data, not its name.

    A generated split (``textures``, ``notmnist``) or a Hub dataset can change under the same name and size;
    a cache keyed on the name alone would silently serve scores of the old images. A streamed dataset cannot
    be hashed without reading it all: its fingerprint is its description (builder, config, split, shards),
    and the caller adds the source spec.
    """
    import pyarrow as pa

    digest = hashlib.blake2b(digest_size=16)
    if is_streamed(dataset):
        info = dataset.info
        digest.update(json.dumps({"builder": info.builder_name, "config": info.config_name, "split": str(dataset.split),
                                  "version": str(info.version), "num_shards": dataset.num_shards}).encode())
        return "streamed-" + digest.hexdigest()
    if hasattr(dataset, "content_fingerprint"):  # made on the fly from another dataset (validation_sets.GeneratedImages)
        return dataset.content_fingerprint()
    if not hasattr(dataset, "with_format"):  # not a datasets.Dataset: fall back to its repr
        digest.update(repr(dataset).encode())
        return digest.hexdigest()
    for table in dataset.with_format("arrow").iter(batch_size=4096):
        # The IPC stream holds exactly these rows; the batch's own buffers can be slices of the whole table.
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks())
        digest.update(memoryview(sink.getvalue()))
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """SHA-256 (hex) of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


__all__ = ["dataset_fingerprint", "file_sha256", "fingerprint", "is_streamed", "model_fingerprint"]
