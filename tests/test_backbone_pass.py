"""The evaluation runs the backbone once per batch for every method, and its score cache is keyed on what is in
effect: a method's scores are the same alone or with the others, and a changed default or library version
computes them again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import evaluate_argv
from safetensors.torch import load_file
from test_evaluation import tiny  # noqa: F401  (module fixture: tiny ViT, ID and OOD datasets on disk)

from hf_gsc.evaluation import plan as plan_module


#: Every method the tiny data can fit (its validation split is too small for Mahalanobis / ViM / GEM's covariance).
METHODS = "msp,energy,max_logit,react,dice,ash_p,ash_b,ash_s,knn,gradnorm,gsc,gsc_ash,odin"


def _argv(tiny, output_dir: Path, methods: str, *extra: str) -> list[str]:  # noqa: F811
    return ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"noise={tiny['noise']}",
            "--methods", methods, "--output-dir", str(output_dir), "--batch-size", "8", "--no-plots",
            *(["--hyperparameter", "knn.k=3"] if "knn" in methods.split(",") else []), *extra]


def _scores(output_dir: Path, method: str) -> dict[str, dict[str, torch.Tensor]]:
    return {path.stem: load_file(str(path)) for path in sorted((output_dir / "scores" / method).glob("*.safetensors"))}


@pytest.fixture(scope="module")
def together(tiny, tmp_path_factory) -> Path:  # noqa: F811
    output_dir = tmp_path_factory.mktemp("together")
    evaluate_argv(_argv(tiny, output_dir, METHODS))
    return output_dir


@pytest.mark.parametrize("method", METHODS.split(","))
def test_a_method_scores_the_same_alone_and_with_the_others(tiny, together, tmp_path, method):  # noqa: F811
    evaluate_argv(_argv(tiny, tmp_path, method))
    alone, shared = _scores(tmp_path, method), _scores(together, method)
    assert alone.keys() == shared.keys() == {"id_test", "id_validation", "ood_noise", "val_ood_val_noise", "val_ood_val_jigsaw"}
    for split in alone:
        assert alone[split].keys() == shared[split].keys()
        for key in alone[split]:
            assert torch.equal(alone[split][key], shared[split][key]), (method, split, key)


def test_one_backbone_pass_per_batch_for_all_methods(tiny, together, monkeypatch, tmp_path):  # noqa: F811
    """Counting the base model's forwards: every method but ODIN costs the passes of KNN (fitted on ID train) and
    ReAct (fitted on ID validation) together: one per batch of each fit split and one per batch of each scored split."""
    import hf_gsc.detectors.backbone_pass as backbone_pass

    calls = []
    real = backbone_pass.run_backbone

    def counted(model, pixel_values, splits=(), logits=True):
        calls.append(pixel_values.shape[0])
        return real(model, pixel_values, splits, logits)

    monkeypatch.setattr(backbone_pass, "run_backbone", counted)
    evaluate_argv(_argv(tiny, tmp_path / "one", "knn,react"))
    one = list(calls)
    calls.clear()
    evaluate_argv(_argv(tiny, tmp_path / "all", METHODS.replace(",odin", "")))
    assert sorted(calls) == sorted(one) and len(calls) == len(one)


def test_a_changed_default_computes_the_scores_again(tiny, tmp_path, monkeypatch):  # noqa: F811
    evaluate_argv(_argv(tiny, tmp_path, "react"))
    before = _scores(tmp_path, "react")
    from dataclasses import dataclass

    from hf_gsc.detectors.react import ReActConfig, ReActDetector
    from hf_gsc.settings.config import number_check, setting

    @dataclass
    class ChangedDefault(ReActConfig):  # the same method, its default changed (as a new release might)
        percentile: float = setting(50.0, number_check(0.0, 100.0), "A changed default.")

    monkeypatch.setattr(ReActDetector, "config_class", ChangedDefault)
    monkeypatch.setattr(ReActDetector, "defaults", ChangedDefault().hyperparameters)
    results = evaluate_argv(_argv(tiny, tmp_path, "react"))
    after = _scores(tmp_path, "react")
    assert results["methods"]["react"]["hyperparameters"] == {"percentile": 50.0}
    assert not torch.equal(before["id_test"]["ood_score"], after["id_test"]["ood_score"])
    # Passing the default explicitly is the same setting: the cache is reused.
    monkeypatch.undo()
    evaluate_argv(_argv(tiny, tmp_path / "explicit", "react", "--hyperparameter", "react.percentile=90"))
    evaluate_argv(_argv(tiny, tmp_path / "implicit", "react"))
    assert _fingerprints(tmp_path / "explicit", "react") == _fingerprints(tmp_path / "implicit", "react")


def _fingerprints(output_dir: Path, method: str) -> dict[str, str]:
    from safetensors import safe_open

    found = {}
    for path in sorted((output_dir / "scores" / method).glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            found[path.stem] = handle.metadata()["fingerprint"]
    return found


def test_a_new_library_version_computes_the_scores_again(tiny, tmp_path, monkeypatch):  # noqa: F811
    evaluate_argv(_argv(tiny, tmp_path, "msp"))
    first = _fingerprints(tmp_path, "msp")
    monkeypatch.setattr(plan_module, "__version__", "999.0.0")
    evaluate_argv(_argv(tiny, tmp_path, "msp"))
    second = _fingerprints(tmp_path, "msp")
    assert first.keys() == second.keys() and all(first[split] != second[split] for split in first)


def test_saved_detectors_reproduce_the_score_files(tiny, tmp_path):  # noqa: F811
    """--save-detectors writes each method as a detector (fitted, calibrated on ID validation) that scores the ID
    test split as its score file holds."""
    import datasets

    from hf_gsc import AutoOODDetector

    results = evaluate_argv(_argv(tiny, tmp_path, "knn,gsc,react", "--save-detectors"))
    images = list(datasets.load_from_disk(tiny["id"])["test"]["image"])
    for method in ("knn", "gsc", "react"):
        detector = AutoOODDetector.from_pretrained(str(tmp_path / "detectors" / method))
        assert detector.method == method
        assert detector.config.threshold == results["methods"][method]["threshold"]
        pixel_values = detector.image_processor(images=images, return_tensors="pt")["pixel_values"]
        saved = _scores(tmp_path, method)["id_test"]["ood_score"]
        torch.testing.assert_close(detector.score(pixel_values).double(), saved, rtol=1e-6, atol=1e-7)
