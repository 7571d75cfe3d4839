"""``hf-gsc evaluate --detector FOLDER_OR_REPO_ID`` scores a saved detector as it is: its method, settings, fitted
state and threshold; no refit, no recalibration; the TPR and FPR at the shipped threshold; scores equal to the
detector's own forward on the same images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import evaluate_argv
from safetensors.torch import load_file
from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)

from hf_gsc import AutoOODDetector
from hf_gsc.evaluation.options import InputError


@pytest.fixture(scope="module")
def shipped(tiny, tmp_path_factory):  # noqa: F811
    """A KNN detector fitted on a few training images, with a threshold set by hand, saved with its base model."""
    import datasets

    root = tmp_path_factory.mktemp("shipped")
    detector = AutoOODDetector.from_pretrained(tiny["model"], method="knn", k=2)
    train = datasets.load_from_disk(tiny["id"])["train"]
    detector.fit(train.select(range(6)))  # a different fit than the evaluation would make (all of train)
    detector.calibrate(datasets.load_from_disk(tiny["id"])["validation"], tpr=0.5)
    detector.save_pretrained(root / "knn", save_base_model=True)
    return root / "knn", detector


def _argv(tiny, output_dir: Path, *extra: str) -> list[str]:  # noqa: F811
    return ["--id-dataset", tiny["id"], "--ood-dataset", f"noise={tiny['noise']}", "--output-dir", str(output_dir),
            "--batch-size", "4", "--no-plots", *extra]


def test_the_saved_detector_is_evaluated_as_it_is(tiny, tmp_path, shipped, capsys):  # noqa: F811
    folder, detector = shipped
    results = evaluate_argv(_argv(tiny, tmp_path, "--detector", str(folder)))
    assert "detector: the saved 'knn' detector as it is" in capsys.readouterr().out
    entry = results["methods"]["knn"]
    assert set(results["methods"]) == {"knn"} and entry["hyperparameters"]["k"] == 2
    assert entry["threshold"] == detector.config.threshold  # not recalibrated (tpr 0.5, not the evaluation's 0.95)
    assert entry["calibration"]["tpr"] == 0.5
    assert not (tmp_path / "detectors").exists()  # nothing fitted
    id_scores = load_file(str(tmp_path / "scores" / "knn" / "id_test.safetensors"))["ood_score"]
    ood_scores = load_file(str(tmp_path / "scores" / "knn" / "ood_noise.safetensors"))["ood_score"]
    assert entry["id_tpr_at_threshold"] == float((id_scores >= detector.config.threshold).double().mean())
    assert entry["ood"]["noise"]["fpr_at_threshold"] == float((ood_scores >= detector.config.threshold).double().mean())
    assert results["detector"]["evaluated_as"] == "saved: no refit, no recalibration"
    assert "Evaluated as saved: `knn`" in (tmp_path / "results.md").read_text()


def test_scores_equal_the_detectors_own_forward(tiny, tmp_path, shipped):  # noqa: F811
    import datasets

    folder, _ = shipped
    evaluate_argv(_argv(tiny, tmp_path, "--detector", str(folder)))
    loaded = AutoOODDetector.from_pretrained(folder)
    images = list(datasets.load_from_disk(tiny["id"])["test"]["image"])
    pixel_values = loaded.image_processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = loaded(pixel_values).ood_score.double()
    scored = load_file(str(tmp_path / "scores" / "knn" / "id_test.safetensors"))["ood_score"]
    torch.testing.assert_close(scored, expected, rtol=1e-5, atol=1e-6)


def test_options_that_would_change_the_shipped_detector_are_refused(tiny, tmp_path, shipped):  # noqa: F811
    folder, _ = shipped
    for extra in (["--methods", "knn"], ["--hyperparameter", "knn.k=3"], ["--tune"], ["--save-detectors"],
                  ["--tpr", "0.9"], ["--tpr", "0.95"]):  # the shipped threshold is used: nothing is calibrated
        with pytest.raises(InputError, match=f"as it is.*{extra[0]}"):
            evaluate_argv(_argv(tiny, tmp_path, "--detector", str(folder), *extra))
    with pytest.raises(InputError, match="exactly one of --model"):
        evaluate_argv(_argv(tiny, tmp_path, "--detector", str(folder), "--model", tiny["model"]))
    with pytest.raises(InputError, match="not a saved detector"):
        evaluate_argv(_argv(tiny, tmp_path, "--detector", tiny["model"]))


def test_a_saved_detector_as_model_without_methods_is_refused_with_the_hint(tiny, tmp_path, shipped):  # noqa: F811
    """Before, ``--model SAVED_KNN`` evaluated the default methods and silently left KNN out."""
    folder, _ = shipped
    with pytest.raises(InputError, match=rf"saved 'knn' detector: .* use --detector {folder}.*--methods knn"):
        evaluate_argv(["--model", str(folder), *_argv(tiny, tmp_path)])
    # Naming the methods keeps the saved settings as defaults (refitted, recalibrated here).
    results = evaluate_argv(["--model", str(folder), *_argv(tiny, tmp_path), "--methods", "knn"])
    assert set(results["methods"]) == {"knn"} and results["methods"]["knn"]["hyperparameters"]["k"] == 2


def test_a_shipped_detector_on_the_loopback_hub_is_evaluated_by_repo_id(tiny, tmp_path, shipped):  # noqa: F811
    from hub_server import LoopbackHub

    folder, detector = shipped
    local = evaluate_argv(_argv(tiny, tmp_path / "local", "--detector", str(folder)))
    with LoopbackHub() as hub, hub.patch_client(cache_dir=tmp_path / "cache", token=hub.token):
        AutoOODDetector.from_pretrained(folder).push_to_hub("user/knn-shipped", save_base_model=True)
        by_id = evaluate_argv(_argv(tiny, tmp_path / "hub", "--detector", "user/knn-shipped"))
    assert by_id["detector"]["source"] == "user/knn-shipped"
    assert by_id["methods"]["knn"]["threshold"] == detector.config.threshold
    for split in ("id_test", "ood_noise"):
        torch.testing.assert_close(load_file(str(tmp_path / "hub" / "scores" / "knn" / f"{split}.safetensors"))["ood_score"],
                                   load_file(str(tmp_path / "local" / "scores" / "knn" / f"{split}.safetensors"))["ood_score"])
    assert by_id["methods"]["knn"]["ood"] == local["methods"]["knn"]["ood"]
