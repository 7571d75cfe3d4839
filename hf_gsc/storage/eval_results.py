"""An evaluation's results in the Hub's ``.eval_results/*.yaml`` format (https://huggingface.co/docs/hub/eval-results),
beside the model card's ``model-index``: the Hub shows them on the model page and, when the dataset is a registered
Benchmark, on its leaderboard.

One file per benchmark, ``.eval_results/<benchmark>.yaml``: a list of entries, one per OOD split and metric
(:data:`METRICS`), each with the benchmark's Hub dataset id (``dataset.id``, required by the format: where the
leaderboard lives), a ``task_id`` naming the OOD split and the metric, the ``value`` as ``results.json`` records it
(a fraction), the run's date, the source (the repo's ``results.json``) and ``notes`` with the run's settings (method,
hyperparameters, model, split sizes, hf_gsc version).

The ID data must be a Hub dataset: a registered benchmark read from the Hub (``cifar10-ood`` ...: its ID test
split's dataset) or ``--id-dataset`` given as a Hub id. The generated benchmarks (``fmnist-ood``, built from Debian's
files) and local folders have none, so no file is written for them (:func:`benchmark_dataset_id` is ``None``), and
``hf-gsc publish`` says so.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .repo_ids import is_hub_id


#: The folder the Hub reads, at the repo's root.
EVAL_RESULTS_DIR = ".eval_results"
#: The metrics written, each an entry per OOD split (results.json's keys; docs/evaluation.md defines them).
METRICS = {"auroc": "AUROC", "fpr95": "FPR@95%TPR (ID positive)"}


def benchmark_dataset_id(results: Mapping[str, Any]) -> str | None:
    """The Hub dataset id of the run's ID data, or None when it was not read from the Hub."""
    benchmark = results.get("benchmark")
    if benchmark:
        try:
            from ..data.hub_benchmarks import HUB_BENCHMARKS
        except ImportError:  # the evaluation extra (datasets) is not installed: no Hub benchmark was run here
            return None
        spec = HUB_BENCHMARKS.get(benchmark)
        return spec.id_builders["test"].dataset_id if spec is not None else None
    id_dataset = str(results.get("id_dataset") or "")
    dataset_id = id_dataset.split(":")[0]  # "dataset_id[:config][:split]"
    return dataset_id if "/" in dataset_id and is_hub_id(dataset_id) else None


def file_name(results: Mapping[str, Any], dataset_id: str) -> str:
    """``.eval_results/<benchmark>.yaml``: the registered benchmark's name, else the dataset id's."""
    stem = results.get("benchmark") or dataset_id.replace("/", "__")
    return f"{EVAL_RESULTS_DIR}/{re.sub(r'[^A-Za-z0-9._-]+', '_', stem)}.yaml"


def _settings(results: Mapping[str, Any], method: str) -> str:
    hyperparameters = (results.get("methods") or {}).get(method, {}).get("hyperparameters") or {}
    shown = ", ".join(f"{key}={value}" for key, value in sorted(hyperparameters.items()))
    return f"method {method}" + (f" ({shown})" if shown else "")


def eval_results_entries(results: Mapping[str, Any], method: str, source_url: str | None = None
                         ) -> tuple[str, list[dict[str, Any]]] | None:
    """``(file name, entries)`` of ``method``'s results in the ``.eval_results`` format, or None when the ID data is
    no Hub dataset or ``method`` has no OOD results. ``source_url``: where the entries come from (the published
    ``results.json``)."""
    dataset_id = benchmark_dataset_id(results)
    ood = ((results.get("methods") or {}).get(method) or {}).get("ood") or {}
    if dataset_id is None or not ood:
        return None
    sizes = results.get("split_sizes") or {}
    versions = results.get("versions") or {}
    run = (f"{_settings(results, method)}; model {results.get('model')}; "
           f"benchmark {results.get('benchmark') or results.get('id_dataset')}")
    entries = []
    for split, metrics in sorted(ood.items()):
        counted = ""
        if sizes.get("id_test") is not None and (sizes.get("ood") or {}).get(split) is not None:
            counted = f" ({sizes['id_test']} ID test / {sizes['ood'][split]} OOD images)"
        for metric, metric_name in METRICS.items():
            if metric not in metrics:
                continue
            entry: dict[str, Any] = {"dataset": {"id": dataset_id, "task_id": f"ood-{split}-{metric}"},
                                     "value": float(metrics[metric])}
            if results.get("created"):
                entry["date"] = str(results["created"])
            if source_url:
                entry["source"] = {"url": source_url, "name": "hf_gsc evaluation (results.json)"}
            entry["notes"] = (f"{metric_name} as a fraction, ID test against OOD split {split}{counted}; {run}"
                              + (f"; hf_gsc {versions['hf_gsc']}" if versions.get("hf_gsc") else ""))
            entries.append(entry)
    return (file_name(results, dataset_id), entries) if entries else None


def write_eval_results(folder: str | Path, results: Mapping[str, Any], method: str, repo_id: str,
                       revision: str | None = None) -> Path | None:
    """Write ``method``'s ``.eval_results`` file into ``folder`` (a repo about to be uploaded to ``repo_id``), its
    source the repo's ``results.json``; returns the file, or None when the ID data is no Hub dataset."""
    from huggingface_hub import constants

    source = f"{constants.ENDPOINT}/{repo_id}/blob/{revision or 'main'}/results.json"
    found = eval_results_entries(results, method, source)
    if found is None:
        return None
    name, entries = found
    path = Path(folder) / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(eval_results_yaml(entries), encoding="utf-8")
    return path


def eval_results_yaml(entries: list[dict[str, Any]]) -> str:
    """The file's text (YAML, keys in the documented order)."""
    import yaml  # PyYAML: a dependency of huggingface_hub

    return yaml.safe_dump(entries, sort_keys=False, allow_unicode=True)


__all__ = ["EVAL_RESULTS_DIR", "METRICS", "benchmark_dataset_id", "eval_results_entries", "eval_results_yaml",
           "file_name", "write_eval_results"]
