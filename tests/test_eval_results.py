"""``hf-gsc publish`` writes the Hub's ``.eval_results/*.yaml`` beside the card's ``model-index``: checked against the
format's documented schema (https://huggingface.co/docs/hub/eval-results) in the repo the loopback Hub holds."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hub_server import LoopbackHub


REPO_ROOT = Path(__file__).resolve().parents[1]

# The documented schema: the keys each level may hold, and those it must.
ENTRY_KEYS, ENTRY_REQUIRED = {"dataset", "value", "verifyToken", "date", "source", "notes"}, {"dataset", "value"}
DATASET_KEYS, DATASET_REQUIRED = {"id", "task_id", "revision"}, {"id", "task_id"}
SOURCE_KEYS, SOURCE_REQUIRED = {"url", "name", "user", "org"}, {"url"}


def validate(document: object) -> list[dict]:
    """Raise AssertionError unless ``document`` (a parsed file) follows the documented ``.eval_results`` schema."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    assert isinstance(document, list) and document, document
    for entry in document:
        assert isinstance(entry, dict) and ENTRY_REQUIRED <= set(entry) <= ENTRY_KEYS, entry
        dataset = entry["dataset"]
        assert isinstance(dataset, dict) and DATASET_REQUIRED <= set(dataset) <= DATASET_KEYS, dataset
        try:
            validate_repo_id(dataset["id"])
        except HFValidationError as error:
            raise AssertionError(f"dataset.id {dataset['id']!r} is no Hub id: {error}") from None
        assert "/" in dataset["id"] and isinstance(dataset["task_id"], str) and dataset["task_id"]
        assert isinstance(entry["value"], (int, float)) and not isinstance(entry["value"], bool)
        if "date" in entry:
            datetime.datetime.fromisoformat(str(entry["date"]))  # ISO-8601
        if "source" in entry:
            source = entry["source"]
            assert isinstance(source, dict) and SOURCE_REQUIRED <= set(source) <= SOURCE_KEYS, source
            assert str(source["url"]).startswith(("http://", "https://"))
        if "notes" in entry:
            assert isinstance(entry["notes"], str)
    return document


def _results(directory: Path, **data) -> Path:
    directory.mkdir(parents=True)
    metrics = {"fpr95": 0.25, "auroc": 0.9, "aupr_in": 0.8, "aupr_out": 0.85}
    results = {"model": "user/base-vit", "id_accuracy": 0.9, "created": "2026-11-28T09:00:00+00:00",
               "split_sizes": {"id_test": 100, "ood": {"svhn": 50, "tin": 60}},
               "versions": {"hf_gsc": "0.4.0"},
               "methods": {"gsc": {"threshold": 1.0, "hyperparameters": {"mask_ratio": 0.05, "score": "energy"},
                                   "ood": {"svhn": metrics, "tin": {**metrics, "auroc": 0.75}}},
                           "msp": {"threshold": 0.5, "hyperparameters": {"temperature": 1.0},
                                   "ood": {"svhn": {**metrics, "auroc": 0.6}}}},
               **data}
    (directory / "results.json").write_text(json.dumps(results))
    (directory / "results.md").write_text("| method | svhn |\n|---|---|\n| gsc | 0.9 |\n")
    return directory


def _publish(hub: LoopbackHub, results_dir: Path, repo_id: str, tmp_path: Path, *extra: str) -> str:
    env = {**hub.client_env(hf_home=tmp_path / "hf_home", token=hub.token), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "hf_gsc", "publish", "--results-dir", str(results_dir), "--repo-id",
                           repo_id, *extra], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _files(hub: LoopbackHub, repo_id: str) -> set[str]:
    repo = hub.get_repo(repo_id)
    return set(repo.commits[hub._resolve_revision(repo, "main")].files)


def test_publish_writes_eval_results_that_follow_the_schema(tmp_path):
    pytest.importorskip("datasets")  # the Hub benchmarks' registry
    hub_benchmark = _results(tmp_path / "cifar", benchmark="cifar10-ood", id_dataset=None)
    hub_dataset = _results(tmp_path / "photos", benchmark=None, id_dataset="user/photos")
    generated = _results(tmp_path / "fmnist", benchmark="fmnist-ood", id_dataset=None)
    with LoopbackHub() as hub:
        said = _publish(hub, hub_benchmark, "user/gsc-cifar", tmp_path)
        assert "wrote .eval_results/cifar10-ood.yaml (Hub dataset uoft-cs/cifar10)" in said, said
        document = validate(yaml.safe_load(hub.read_file("user/gsc-cifar", ".eval_results/cifar10-ood.yaml")))
        # One entry per OOD split and metric, the values results.json holds, the run's settings in the notes.
        assert {(e["dataset"]["task_id"], e["value"]) for e in document} == {
            ("ood-svhn-auroc", 0.9), ("ood-svhn-fpr95", 0.25), ("ood-tin-auroc", 0.75), ("ood-tin-fpr95", 0.25)}
        assert {e["dataset"]["id"] for e in document} == {"uoft-cs/cifar10"}
        notes = next(e["notes"] for e in document if e["dataset"]["task_id"] == "ood-tin-auroc")
        assert "method gsc (mask_ratio=0.05, score=energy)" in notes and "OOD split tin (100 ID test / 60 OOD" in notes
        assert "hf_gsc 0.4.0" in notes and "user/base-vit" in notes
        assert all(e["source"]["url"].endswith("/user/gsc-cifar/blob/main/results.json") for e in document)
        assert all(e["date"] == "2026-11-28T09:00:00+00:00" for e in document)
        assert {"README.md", "results.json", ".eval_results/cifar10-ood.yaml"} <= _files(hub, "user/gsc-cifar")

        _publish(hub, hub_dataset, "user/gsc-photos", tmp_path)
        document = validate(yaml.safe_load(hub.read_file("user/gsc-photos", ".eval_results/user__photos.yaml")))
        assert {e["dataset"]["id"] for e in document} == {"user/photos"}

        # The generated benchmark is no Hub dataset: no file, and the command says why.
        said = _publish(hub, generated, "user/gsc-fmnist", tmp_path)
        assert "no .eval_results/ file: the ID data (fmnist-ood) is no Hub dataset" in said, said
        assert not any(name.startswith(".eval_results/") for name in _files(hub, "user/gsc-fmnist"))
        assert "README.md" in _files(hub, "user/gsc-fmnist")


def test_eval_results_round_trip_through_huggingface_hub(tmp_path):
    """huggingface_hub's own reader and writer of the format (where the installed version has them) give back the
    same entries."""
    hub_api = pytest.importorskip("huggingface_hub")
    if not hasattr(hub_api, "parse_eval_result_entries"):
        pytest.skip("this huggingface_hub has no .eval_results reader")
    from hf_gsc.storage.eval_results import eval_results_entries, eval_results_yaml

    results = json.loads((_results(tmp_path / "r", benchmark=None, id_dataset="user/photos") / "results.json").read_text())
    name, entries = eval_results_entries(results, "gsc", "https://huggingface.co/user/x/blob/main/results.json")
    parsed = yaml.safe_load(eval_results_yaml(entries))
    assert hub_api.eval_result_entries_to_yaml(hub_api.parse_eval_result_entries(parsed)) == validate(parsed)
    assert name == ".eval_results/user__photos.yaml"


def test_push_to_hub_with_results_writes_them_too(tmp_path):
    """``push_to_hub(..., results_dir=...)`` (and ``hf-gsc publish --detector-dir``): the detector's own results in
    the Hub's format beside its card."""
    from conftest import make_tiny_model

    from hf_gsc import GSCConfig

    base = tmp_path / "base"
    make_tiny_model("resnet").float().save_pretrained(base)
    config = GSCConfig(mask_ratio=0.1)
    results_dir = _results(tmp_path / "run", benchmark=None, id_dataset="user/photos", model=str(base))
    results = json.loads((results_dir / "results.json").read_text())
    results["methods"]["gsc"]["hyperparameters"] = {name: getattr(config, name) for name in GSCConfig.score_names()}
    (results_dir / "results.json").write_text(json.dumps(results))
    script = (f"from hf_gsc import GSCForImageClassification\n"
              f"d = GSCForImageClassification.from_pretrained({str(base)!r}, mask_ratio=0.1)\n"
              f"d.push_to_hub('user/gsc-photos', save_base_model=True, results_dir={str(results_dir)!r})\n")
    with LoopbackHub() as hub:
        env = {**hub.client_env(hf_home=tmp_path / "hf_home", token=hub.token), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        document = validate(yaml.safe_load(hub.read_file("user/gsc-photos", ".eval_results/user__photos.yaml")))
    assert {(e["dataset"]["task_id"], e["value"]) for e in document} >= {("ood-svhn-auroc", 0.9), ("ood-tin-auroc", 0.75)}
    assert all(str(tmp_path) not in e["notes"] for e in document)  # the local model path is published as local:NAME
