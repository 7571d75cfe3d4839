"""OOD evaluation: calibration, score cache / resume, bad input, and 1 vs 2 processes (accelerate launch).

Everything runs on a tiny random 1-channel ViT and small in-memory datasets whose sizes (train 23,
validation 13, test 17, OOD 11 and 9) do not divide evenly by the batch size or the process count.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import evaluate_argv
from safetensors.torch import load_file

from hf_gsc.data.decoding import UndecodableImageError
from hf_gsc.evaluation import cli, evaluator, fingerprints, loop, models, options, validation
from hf_gsc.evaluation.arguments import parse_arguments
from hf_gsc.evaluation.calibration import true_positive_rate
from hf_gsc.evaluation.metrics import METRIC_NAMES, threshold_at_tpr
from hf_gsc.evaluation.result import EverythingSkippedError
from hf_gsc.utils.thresholds import threshold_at_tpr


REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "evaluate_ood.py"
SIZES = {"train": 23, "validation": 13, "test": 17}
OOD_SIZES = {"noise": 11, "flat": 9}


def _images(rng: np.random.Generator, n: int, kind: str) -> list:
    from PIL import Image

    out = []
    for i in range(n):
        if kind == "id":  # a bright horizontal band whose position is the class
            array = rng.integers(0, 40, (16, 16))
            band = i % 3
            array[band * 5 : band * 5 + 5, :] += 180
        elif kind == "noise":
            array = rng.integers(0, 256, (16, 16))
        else:
            array = np.full((16, 16), rng.integers(0, 256))
        out.append(Image.fromarray(array.clip(0, 255).astype(np.uint8), "L"))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny ViT + image processor, an ID DatasetDict and two OOD datasets, all saved to disk."""
    import datasets
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    root = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=8, num_channels=1, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32, num_labels=3)
    ViTForImageClassification(config).save_pretrained(root / "model")
    ViTImageProcessorPil(do_resize=True, size={"height": 16, "width": 16}, image_mean=[0.5], image_std=[0.5],
                         do_convert_rgb=False).save_pretrained(root / "model")
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})

    def dataset(n: int, kind: str) -> datasets.Dataset:
        labels = [i % 3 if kind == "id" else -1 for i in range(n)]
        return datasets.Dataset.from_dict({"image": _images(rng, n, kind), "label": labels}, features=features)

    datasets.DatasetDict({split: dataset(n, "id") for split, n in SIZES.items()}).save_to_disk(root / "id")
    datasets.DatasetDict({"train": dataset(5, "id"), "test": dataset(5, "id")}).save_to_disk(root / "id_no_validation")
    for name, n in OOD_SIZES.items():
        dataset(n, name).save_to_disk(root / name)
    return {"root": str(root), "model": str(root / "model"), "id": str(root / "id"),
            "noise": str(root / "noise"), "flat": str(root / "flat")}


def _methods() -> str:
    from hf_gsc.detectors import DETECTORS

    wanted = ["gsc", "msp", "energy", "react", "knn"]  # react fits on validation, knn on train
    return ",".join(name for name in wanted if name in DETECTORS)


def _argv(tiny: dict[str, str], output_dir: Path, *extra: str) -> list[str]:
    argv = [
        "--model", tiny["model"], "--id-dataset", tiny["id"],
        "--ood-dataset", f"noise={tiny['noise']}", "--ood-dataset", f"flat={tiny['flat']}",
        "--methods", _methods(), "--output-dir", str(output_dir), "--batch-size", "4", "--no-plots",
        "--no-selection",  # these runs are about the test table; the selection has tests/test_selection.py
        *extra,
    ]
    if "knn" in _methods():
        argv += ["--hyperparameter", "knn.k=3"]
    return argv


def _numbers(results: dict) -> dict:
    """The numbers that must not depend on the process count."""
    return {"id_accuracy": results["id_accuracy"], "split_sizes": results["split_sizes"],
            "methods": {name: {key: entry[key] for key in ("threshold", "id_tpr_at_threshold", "ood", "average")}
                        for name, entry in results["methods"].items()}}


def _assert_close(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            _assert_close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), f"{path}: {a} != {b}"
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def single_run(tiny: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    output_dir = tmp_path_factory.mktemp("single")
    results = evaluate_argv(_argv(tiny, output_dir))
    return output_dir, results


# ------------------------------------------------------------------------------------- calibration
def test_threshold_at_tpr_matches_fpr95_rule() -> None:
    scores = np.random.default_rng(0).normal(size=101)
    threshold = threshold_at_tpr(torch.from_numpy(scores), tpr=0.95)
    assert threshold == threshold_at_tpr(scores, 0.95)
    assert true_positive_rate(scores, threshold) >= 0.95
    assert true_positive_rate(scores, np.nextafter(threshold, np.inf)) < 0.95
    assert threshold_at_tpr([3.0, 3.0, 3.0], 0.5) == 3.0  # ties are kept
    with pytest.raises(ValueError, match="tpr"):
        threshold_at_tpr(scores, 0.0)


# ---------------------------------------------------------------------------------- results layout
def test_results_json_and_outputs(single_run: tuple[Path, dict]) -> None:
    output_dir, results = single_run
    saved = json.loads((output_dir / "results.json").read_text())
    tiny_id = os.path.abspath(saved["config"]["id_dataset"])
    assert saved["methods"].keys() == set(_methods().split(","))
    assert saved["num_processes"] == 1
    assert saved["split_sizes"] == {"id_test": 17, "id_validation": 13, "ood": OOD_SIZES,
                                    "fit": {m: SIZES[options.registered_methods()[m].fit_split]
                                            for m in _methods().split(",") if options.registered_methods()[m].needs_fit}}
    assert 0.0 <= saved["id_accuracy"] <= 1.0
    for name, entry in saved["methods"].items():
        kept = entry["calibration"].pop("calibration_scores")  # the kept scores' count and digest
        assert kept["count"] == 13 and kept["digest"].startswith("sha256:")
        assert entry["calibration"] == {"split": "validation", "num_samples": 13, "tpr": 0.95, "method": "quantile",
                                        "delta": None, "source": f"split 'validation' of dataset root {tiny_id}"}
        assert set(entry["selective"]) == {"accuracy", "aurc"}
        assert 0.0 <= entry["id_tpr_at_threshold"] <= 1.0
        assert set(entry["ood"]) == set(OOD_SIZES)
        for metrics in [*entry["ood"].values(), entry["average"]]:
            assert set(metrics) == {*METRIC_NAMES, "fpr95_ood_positive"}
            assert all(0.0 <= value <= 1.0 for value in metrics.values())
        for split in ("id_test", "id_validation", "ood_noise", "ood_flat"):
            assert (output_dir / "scores" / name / f"{split}.safetensors").is_file()
    assert {"hf_gsc", "torch", "transformers", "datasets", "accelerate"} <= set(saved["versions"])
    assert saved["config"]["batch_size"] == 4
    assert "gsc" not in saved["config"]  # each method's settings are under methods.METHOD.hyperparameters
    table = (output_dir / "results.md").read_text()
    assert "| Method | noise | flat | Average |" in table and "FPR95 (ID+)↓ / FPR95 (OOD+)↓ / AUROC↑" in table


def test_threshold_comes_from_validation_scores(single_run: tuple[Path, dict]) -> None:
    from safetensors.torch import load_file

    output_dir, results = single_run
    for name, entry in results["methods"].items():
        validation = load_file(str(output_dir / "scores" / name / "id_validation.safetensors"))["ood_score"]
        test = load_file(str(output_dir / "scores" / name / "id_test.safetensors"))["ood_score"]
        assert entry["threshold"] == threshold_at_tpr(validation, 0.95)
        assert entry["id_tpr_at_threshold"] == true_positive_rate(test, entry["threshold"])


def test_plots_written(tiny: dict[str, str], single_run: tuple[Path, dict], tmp_path: Path) -> None:
    output_dir = tmp_path / "plots_run"
    shutil.copytree(single_run[0], output_dir)  # all scores cached: only the report and plots are made
    argv = [arg for arg in _argv(tiny, output_dir) if arg != "--no-plots"]
    evaluate_argv(argv)
    for name in ("densities.png", "roc.png", "risk_coverage.png"):
        assert (output_dir / "plots" / name).stat().st_size > 1000


def test_model_fingerprint_follows_weights() -> None:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)  # ResNet has 0-dim BatchNorm buffers (num_batches_tracked)
    model = ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8], depths=[1]))
    before = fingerprints.model_fingerprint(model)
    assert fingerprints.model_fingerprint(model) == before
    with torch.no_grad():
        model.classifier[-1].bias[0] += 1e-6
    assert fingerprints.model_fingerprint(model) != before


# -------------------------------------------------------------------------------- cache and resume
def _record_scored_splits(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], Any]:
    """Patch ``loop.score_split`` to record the split of every call; returns the record and the spy."""
    scored: list[str] = []
    real_score_split = loop.score_split

    def spy(accelerator, dataloader, scorers, description="", **options):
        scored.append(description.split(" ")[0])
        return real_score_split(accelerator, dataloader, scorers, description, **options)

    monkeypatch.setattr(loop, "score_split", spy)
    return scored, spy


def test_rerun_reuses_cache_and_resumes_after_crash(
    tiny: dict[str, str], single_run: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output_dir = tmp_path / "resume"
    shutil.copytree(single_run[0], output_dir)
    scored, spy = _record_scored_splits(monkeypatch)
    # 1. Everything cached: no split is scored again, same numbers.
    again = evaluate_argv(_argv(tiny, output_dir))
    assert scored == []
    _assert_close(_numbers(again), _numbers(single_run[1]))

    # 2. A crash while scoring ood_flat: the earlier splits are on disk, ood_flat is not.
    shutil.rmtree(output_dir / "scores")

    def crash(accelerator, dataloader, scorers, description="", **options):
        if description.startswith("ood_flat"):
            raise KeyboardInterrupt("simulated crash")
        return spy(accelerator, dataloader, scorers, description, **options)

    monkeypatch.setattr(loop, "score_split", crash)
    with pytest.raises(KeyboardInterrupt):
        evaluate_argv(_argv(tiny, output_dir))
    assert (output_dir / "scores" / "gsc" / "ood_noise.safetensors").is_file()
    assert not (output_dir / "scores" / "gsc" / "ood_flat.safetensors").exists()

    # 3. Resume: only the split lost in the crash is scored, plus one whose file was truncated.
    scored.clear()
    monkeypatch.setattr(loop, "score_split", spy)
    truncated = output_dir / "scores" / "msp" / "id_validation.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:20])
    resumed = evaluate_argv(_argv(tiny, output_dir))
    assert sorted(scored) == ["id_validation", "ood_flat"]
    _assert_close(_numbers(resumed), _numbers(single_run[1]))

    # 4. Other settings invalidate only the affected method's files.
    scored.clear()
    argv = _argv(tiny, output_dir, "--mask-ratio", "0.2")
    evaluate_argv(argv)
    assert len(scored) == 4  # the 4 splits, for gsc only
    assert json.loads((output_dir / "results.json").read_text())["methods"]["gsc"]["hyperparameters"]["mask_ratio"] == 0.2


def test_cache_follows_the_data_content(tiny: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An OOD split with new images under the same path and size is scored again, for every method;
    a cache keyed on the name alone would silently report the old images' metrics."""
    import datasets

    flat = tmp_path / "flat"
    original = datasets.load_from_disk(tiny["flat"])
    original.save_to_disk(flat)
    argv = _argv(dict(tiny, flat=str(flat)), tmp_path / "out")
    evaluate_argv(argv)
    scored, _ = _record_scored_splits(monkeypatch)
    new_images = _images(np.random.default_rng(7), len(original), "flat")
    replaced = datasets.Dataset.from_dict({"image": new_images, "label": [-1] * len(original)}, features=original.features)
    replaced.save_to_disk(tmp_path / "staging")
    shutil.rmtree(flat)
    shutil.copytree(tmp_path / "staging", flat)
    evaluate_argv(argv)
    assert scored == ["ood_flat"]


def test_odin_takes_the_image_std_from_the_processor(tiny: dict[str, str], tmp_path: Path) -> None:
    """ODIN's epsilon is in pixel units: the evaluation divides it by the processor's std unless told otherwise."""
    from types import SimpleNamespace

    from hf_gsc.detectors.odin import ODINDetector as ODIN

    base = ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", tiny["noise"],
            "--methods", "msp,odin", "--no-plots"]
    automatic = evaluate_argv([*base, "--output-dir", str(tmp_path / "auto")])
    assert automatic["methods"]["odin"]["hyperparameters"]["image_std"] == [0.5]  # the tiny processor's std
    given = evaluate_argv([*base, "--output-dir", str(tmp_path / "given"), "--hyperparameter", "odin.image_std=2.0"])
    assert given["methods"]["odin"]["hyperparameters"]["image_std"] == 2.0
    assert ODIN.model_defaults(SimpleNamespace(image_std=[0.2, 0.3], do_normalize=False)) == {"image_std": [1.0]}
    assert ODIN.model_defaults(SimpleNamespace(image_std=0.25)) == {"image_std": [0.25]}


def test_saved_detector_as_model(tiny: dict[str, str], tmp_path: Path) -> None:
    """--model may be a saved GSC detector: its GSCConfig is the default, CLI GSC options override it."""
    from hf_gsc import GSCForImageClassification

    detector_dir = tmp_path / "detector"
    GSCForImageClassification.from_pretrained(tiny["model"], mask_ratio=0.2).save_pretrained(detector_dir)
    results = evaluate_argv([
        "--model", str(detector_dir), "--id-dataset", tiny["id"], "--ood-dataset", tiny["noise"],
        "--methods", "gsc,msp", "--operation", "clip", "--output-dir", str(tmp_path / "out"), "--no-plots",
    ])
    settings = results["methods"]["gsc"]["hyperparameters"]
    assert (settings["mask_ratio"], settings["operation"]) == (0.2, "clip")
    assert set(results["methods"]["gsc"]["ood"]) == {"noise"}


# ------------------------------------------------------------------------------------- bad input
def _fails_fast(argv: list[str], match: str, monkeypatch: pytest.MonkeyPatch, before_model: bool = False,
               error: type[Exception] = options.InputError) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("expensive work started before the input was checked")

    monkeypatch.setattr(loop, "score_split", forbidden)
    monkeypatch.setattr(evaluator, "fit_detectors", forbidden)
    if before_model:
        monkeypatch.setattr(evaluator, "load_model", forbidden)
    with pytest.raises(error, match=match):
        evaluate_argv(argv)


def test_unknown_method(tiny, tmp_path, monkeypatch) -> None:
    argv = _argv(tiny, tmp_path / "out")
    argv[argv.index("--methods") + 1] = "gsc,not_a_method"
    _fails_fast(argv, r"--methods: unknown method\(s\) 'not_a_method'; registered methods: .*msp", monkeypatch)


def test_missing_validation_split(tiny, tmp_path, monkeypatch) -> None:
    argv = _argv(tiny, tmp_path / "out")
    argv[argv.index("--id-dataset") + 1] = str(Path(tiny["root"]) / "id_no_validation")
    _fails_fast(argv, r"ID 'validation' split, needed for threshold calibration \(ID validation\).*has no split 'validation'", monkeypatch)


def test_unknown_ood_split_of_benchmark(tiny, tmp_path, monkeypatch) -> None:
    argv = ["--model", tiny["model"], "--benchmark", "fmnist-ood", "--ood-splits", "mnist,cifar10",
            "--output-dir", str(tmp_path / "out")]
    _fails_fast(argv, r"--ood-splits: 'cifar10' not in the ood_splits of fmnist-ood", monkeypatch)


def test_output_dir_not_writable(tiny, tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    _fails_fast(_argv(tiny, blocker / "out"), r"--output-dir .* is not writable", monkeypatch)


def unsupported_model(tiny, tmp_path, monkeypatch) -> str:  # noqa: F811
    """A RegNet whose architecture is taken out of the registry (and out of discovery): GSC's default split point
    does not apply to it, the penultimate one does."""
    from transformers import RegNetConfig, RegNetForImageClassification

    from hf_gsc.classifier.architectures import ARCHITECTURES, NOT_APPLICABLE

    monkeypatch.delitem(ARCHITECTURES, "regnet")
    monkeypatch.setitem(NOT_APPLICABLE, "regnet", "removed from the registry by this test")
    model_dir = tmp_path / "regnet"
    RegNetForImageClassification(
        RegNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8], depths=[1], groups_width=8, num_labels=3)
    ).save_pretrained(model_dir)
    (model_dir / "preprocessor_config.json").write_text((Path(tiny["model"]) / "preprocessor_config.json").read_text())
    return str(model_dir)


def test_model_without_known_split_point(tmp_path, tiny, monkeypatch) -> None:
    model_dir = unsupported_model(tiny, tmp_path, monkeypatch)
    argv = _argv(tiny, tmp_path / "out")
    argv[argv.index("--model") + 1] = model_dir
    argv = [*argv[:argv.index("--methods")], "--methods", "gsc", "--output-dir", str(tmp_path / "out"),
            "--no-plots"]  # the one method cannot be built: skipped, nothing left, before any work
    _fails_fast(argv, r"gsc: cannot build this detector on this model", monkeypatch, error=EverythingSkippedError)


@pytest.mark.parametrize(
    "flag, value, match",
    [("--max-samples", "0", "--max-samples must be a positive integer"),
     ("--batch-size", "-1", "--batch-size must be a positive integer"),
     ("--tpr", "1.5", r"--tpr must be in \(0, 1\]"),
     ("--conformal-delta", "1.5", r"--conformal-delta must be in \(0, 1\), got 1.5"),
     ("--conformal-delta", "0.01", "--conformal-delta 0.01 with --tpr 0.95: 13 calibration scores cannot guarantee"),
     ("--mask-ratio", "2", "gsc options: GSCConfig.mask_ratio"),
     ("--hyperparameter", "odin", "expected METHOD.NAME=VALUE")],
)
def test_bad_numbers(tiny, tmp_path, monkeypatch, flag, value, match) -> None:
    _fails_fast(_argv(tiny, tmp_path / "out", flag, value), match, monkeypatch)


@pytest.mark.parametrize(
    "flag, value, match",
    [("--num-workers", "-1", "--num-workers must be a nonnegative integer"),
     ("--mixed-precision", "fp8x", "--mixed-precision must be one of no, fp16, bf16, got 'fp8x'"),
     ("--image-backend", "opencv", "--image-backend must be one of auto, pil, torchvision")],
)
def test_bad_device_options_fail_before_the_model(tiny, tmp_path, monkeypatch, flag, value, match) -> None:
    _fails_fast(_argv(tiny, tmp_path / "out", flag, value), match, monkeypatch, before_model=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 autocast exists on CUDA")
def test_fp16_on_cpu_fails_before_the_model(tiny, tmp_path, monkeypatch) -> None:
    """accelerate accepts fp16 on a CPU and runs it as fp32: the evaluation refuses instead of mislabelling."""
    _fails_fast(_argv(tiny, tmp_path / "out", "--mixed-precision", "fp16"),
                r"--mixed-precision fp16: not available on device cpu", monkeypatch, before_model=True)


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchvision") is not None, reason="torchvision is installed")
def test_torchvision_backend_without_torchvision_fails_before_the_model(tiny, tmp_path, monkeypatch) -> None:
    _fails_fast(_argv(tiny, tmp_path / "out", "--image-backend", "torchvision"),
                r"--image-backend torchvision: torchvision is not installed", monkeypatch, before_model=True)


def test_streaming_a_local_folder_fails_before_the_model(tiny, tmp_path, monkeypatch) -> None:
    _fails_fast(_argv(tiny, tmp_path / "out", "--streaming"), r"--streaming needs Hub dataset ids; .* is a local folder",
                monkeypatch, before_model=True)


def test_streaming_a_generated_benchmark_fails_before_the_model(tiny, tmp_path, monkeypatch) -> None:
    argv = ["--model", tiny["model"], "--benchmark", "fmnist-ood", "--streaming", "--output-dir", str(tmp_path / "out")]
    _fails_fast(argv, r"--streaming needs Hub dataset ids; --benchmark fmnist-ood is built locally", monkeypatch,
                before_model=True)


def test_streaming_a_hub_benchmark_passes_validation() -> None:
    """The paper's benchmarks are read from the Hub, so they may be streamed (loading them needs the Hub)."""
    from hf_gsc.data import HUB_BENCHMARKS

    name = sorted(HUB_BENCHMARKS)[0]
    args = parse_arguments(["--model", "m", "--benchmark", name, "--streaming", "--output-dir", "out"])
    assert args.ood_split_names is None


def test_cli_exit_status_and_message(tiny, tmp_path, capsys) -> None:
    argv = _argv(tiny, tmp_path / "out")
    argv[argv.index("--methods") + 1] = "nope"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv, prog="evaluate_ood.py")
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err
    assert "evaluate_ood.py: error: --methods: unknown method(s) 'nope'" in stderr
    assert "Traceback" not in stderr


# ------------------------------------------------------------------------------- unreadable images
#: Row of the corrupt file in the ``broken`` OOD folder (7 PNGs, ``00.png`` ... ``06.png``).
BROKEN_ROW = 4


def _write_broken_folder(folder: Path, corrupt: bool = True) -> Path:
    """An OOD image folder of 7 PNGs; ``04.png`` holds a PNG signature and garbage when ``corrupt``."""
    folder.mkdir(parents=True)
    for i, image in enumerate(_images(np.random.default_rng(1), 7, "noise")):
        image.save(folder / f"{i:02d}.png")
    if corrupt:
        (folder / f"{BROKEN_ROW:02d}.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not the rest of a PNG")
    return folder


@pytest.fixture(scope="module")
def broken_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_write_broken_folder(tmp_path_factory.mktemp("unreadable") / "broken"))


def _score_file(output_dir: Path, method: str, split: str) -> Path:
    return output_dir / "scores" / method / f"{split}.safetensors"


def test_unreadable_image_stops_with_one_line_and_keeps_finished_splits(
    tiny: dict[str, str], single_run: tuple[Path, dict], broken_folder: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
) -> None:
    output_dir = tmp_path / "out"
    argv = _argv(tiny, output_dir, "--ood-dataset", f"broken={broken_folder}")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv, prog="evaluate_ood.py")
    assert exit_info.value.code == 2
    stderr = capsys.readouterr().err.strip()
    assert "Traceback" not in stderr, stderr
    last = stderr.splitlines()[-1]  # after the progress bars: the error, in one line
    assert last.startswith("evaluate_ood.py: error: cannot decode the image of dataset") and "skip-unreadable-images" in last
    assert f"dataset 'ood_broken ({broken_folder})', row {BROKEN_ROW}, file {broken_folder}/04.png" in last
    methods = _methods().split(",")
    for method in methods:  # every split scored before the broken one kept its scores
        assert all(_score_file(output_dir, method, split).is_file() for split in ("id_test", "id_validation", "ood_noise", "ood_flat"))
        assert not _score_file(output_dir, method, "ood_broken").exists()

    # Fixed: a rerun scores only the split that failed.
    fixed_dir = tmp_path / "fixed"
    shutil.copytree(output_dir, fixed_dir)
    fixed_folder = _write_broken_folder(tmp_path / "fixed_folder", corrupt=False)
    scored, _ = _record_scored_splits(monkeypatch)
    fixed = evaluate_argv(_argv(tiny, fixed_dir, "--ood-dataset", f"broken={fixed_folder}"))
    assert scored == ["ood_broken"]
    assert fixed["num_skipped"]["ood"]["broken"] == 0 and fixed["split_sizes"]["ood"]["broken"] == 7
    assert "Unreadable" not in (fixed_dir / "results.md").read_text()

    # Skipped: a rerun scores only the split that failed, without the unreadable image, and says so.
    scored.clear()
    results = evaluate_argv(argv + ["--skip-unreadable-images"])
    assert scored == ["ood_broken"]
    assert results["num_skipped"] == {"id_test": 0, "id_validation": 0, "ood": {"noise": 0, "flat": 0, "broken": 1},
                                      "fit": {name: 0 for name in results["split_sizes"]["fit"]}}
    assert results["split_sizes"]["ood"]["broken"] == 6
    assert "Unreadable images left out (--skip-unreadable-images): OOD broken 1." in (output_dir / "results.md").read_text()
    for method in methods:  # the readable images have the scores they have in the fixed run
        kept = [row for row in range(7) if row != BROKEN_ROW]
        skipped_scores = load_file(str(_score_file(output_dir, method, "ood_broken")))["ood_score"]
        fixed_scores = load_file(str(_score_file(fixed_dir, method, "ood_broken")))["ood_score"]
        torch.testing.assert_close(skipped_scores, fixed_scores[kept], atol=1e-6, rtol=1e-6)
        for split in ("noise", "flat"):
            assert results["methods"][method]["ood"][split] == pytest.approx(single_run[1]["methods"][method]["ood"][split])


def test_unreadable_fit_image_is_counted(tiny: dict[str, str], tmp_path: Path) -> None:
    """An unreadable image in the data a detector fits on: a named error, or left out of the fit and counted."""
    import datasets

    broken_id = tmp_path / "id"
    splits = datasets.load_from_disk(tiny["id"])
    train = splits["train"].cast_column("image", datasets.Image(decode=False))
    rows = train.to_list()
    rows[2]["image"] = {"bytes": b"not an image", "path": "train_2.png"}
    splits["train"] = datasets.Dataset.from_list(rows, features=train.features).cast_column("image", datasets.Image())
    splits.save_to_disk(broken_id)
    argv = _argv(tiny, tmp_path / "out")
    argv[argv.index("--id-dataset") + 1] = str(broken_id)
    if "knn" not in _methods():
        pytest.skip("no registered method fits on the train split")
    with pytest.raises(UndecodableImageError, match=r"dataset 'ID train \(.*\)', row 2, file train_2.png"):
        evaluate_argv(argv)
    results = evaluate_argv(argv + ["--skip-unreadable-images"])
    assert results["num_skipped"]["fit"]["knn"] == 1 and results["methods"]["knn"]["fit"]["num_samples"] == SIZES["train"] - 1
    bank = load_file(str(tmp_path / "out" / "detectors" / "knn" / "detector_state.safetensors"))["bank"]
    assert bank.shape[0] == SIZES["train"] - 1  # the fit saw no placeholder
    assert "fit of knn 1" in (tmp_path / "out" / "results.md").read_text()


def test_text_image_column_fails_before_scoring(tiny: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    captions = tmp_path / "captions"
    datasets.Dataset.from_dict({"image": [f"a photo of thing {i}" for i in range(5)]}).save_to_disk(captions)
    argv = _argv(tiny, tmp_path / "out", "--ood-dataset", f"captions={captions}")
    _fails_fast(argv, r"--ood-dataset .*captions.*column 'image' holds text, not images: row 0 is 'a photo of thing 0'",
                monkeypatch)


# ------------------------------------------------------------ device, precision, workers, streaming
def test_results_record_device_precision_and_throughput(single_run: tuple[Path, dict]) -> None:
    _, results = single_run
    assert results["device"] == str(torch.device("cuda", 0) if torch.cuda.is_available() else "cpu")
    assert results["mixed_precision"] == "no" and results["num_processes"] == 1
    assert results["num_workers"] == (max(1, len(os.sched_getaffinity(0)) - 1) if torch.cuda.is_available() else 0)
    assert results["image_backend"] in ("pil", "torchvision")
    assert results["pixel_normalization"] == "device"  # the tiny model's ViT processor can be split
    scored = results["seconds"]["splits_scored"]
    assert set(scored) == {"id_test", "id_validation", "ood_noise", "ood_flat"}
    assert scored["id_test"]["num_samples"] == SIZES["test"] and scored["ood_flat"]["num_samples"] == OOD_SIZES["flat"]
    assert all(entry["seconds"] > 0 and entry["images_per_second"] > 0 for entry in scored.values())


def test_bf16_from_the_environment_runs_under_autocast(
    tiny: dict[str, str], single_run: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ACCELERATE_MIXED_PRECISION=bf16 (what `accelerate launch --mixed_precision bf16` sets) changes the
    scores: the backbone ran under autocast. Before, the score files were bit-identical to fp32."""
    from safetensors.torch import load_file

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    results = evaluate_argv(_argv(tiny, tmp_path / "bf16"))
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert results["mixed_precision"] == "bf16"
    for name in ("msp", "gsc"):
        fp32 = load_file(str(single_run[0] / "scores" / name / "id_test.safetensors"))["ood_score"]
        bf16 = load_file(str(tmp_path / "bf16" / "scores" / name / "id_test.safetensors"))["ood_score"]
        assert not torch.equal(fp32, bf16), name
        assert torch.allclose(fp32, bf16, atol=0.1, rtol=0.05), name
    # The next evaluation in this process runs in fp32 again (accelerate's shared state is reset).
    again = evaluate_argv(_argv(tiny, tmp_path / "fp32"))
    assert again["mixed_precision"] == "no"


def test_worker_processes_give_the_same_numbers(tiny: dict[str, str], single_run: tuple[Path, dict], tmp_path: Path) -> None:
    results = evaluate_argv(_argv(tiny, tmp_path / "workers", "--num-workers", "2"))
    assert results["num_workers"] == 2
    _assert_close(_numbers(results), _numbers(single_run[1]))


def test_streaming_matches_the_map_style_run_and_resumes(
    tiny: dict[str, str], single_run: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--streaming reads datasets.IterableDataset splits (here the local datasets through
    ``to_iterable_dataset``, standing in for Hub ids): same metrics; a rerun reuses every score file."""
    import datasets

    import hf_gsc.data

    loaded = hf_gsc.data.load_split
    requested = []

    def load_split(spec: str, streaming: bool = False, **columns):
        requested.append(streaming)
        dataset = loaded(spec, **columns)
        return dataset.to_iterable_dataset(num_shards=3) if streaming else dataset

    monkeypatch.setattr(hf_gsc.data, "load_split", load_split)
    monkeypatch.setattr(validation, "_is_local", lambda spec: False)
    output_dir = tmp_path / "streamed"
    results = evaluate_argv(_argv(tiny, output_dir, "--streaming"))
    assert requested and all(requested)
    assert isinstance(load_split(tiny["noise"], streaming=True), datasets.IterableDataset)
    _assert_close(_numbers(results), _numbers(single_run[1]))
    scored, _ = _record_scored_splits(monkeypatch)
    again = evaluate_argv(_argv(tiny, output_dir, "--streaming"))
    assert scored == []
    _assert_close(_numbers(again), _numbers(single_run[1]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scores_match_a_cpu_reference(tiny: dict[str, str], single_run: tuple[Path, dict]) -> None:
    """On a CUDA machine every run of this module is on the GPU: its MSP scores equal a plain CPU forward."""
    from safetensors.torch import load_file

    from hf_gsc.data import load_split
    from hf_gsc.utils.scores import ood_score

    output_dir, results = single_run
    assert results["device"].startswith("cuda")
    model, processor, _, _ = models.load_model(tiny["model"])
    images = load_split(f"{tiny['id']}:test")["image"]
    with torch.no_grad():
        logits = model(pixel_values=models.image_transform(processor, model)(images)).logits
    saved = load_file(str(output_dir / "scores" / "msp" / "id_test.safetensors"))["ood_score"]
    torch.testing.assert_close(saved, ood_score(logits, "msp").double(), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- 1 vs 2 processes
#: Runs the evaluation with the local datasets streamed (``to_iterable_dataset``, 3 shards: uneven over 2
#: processes), standing in for Hub ids, under ``accelerate launch``.
STREAMING_SCRIPT = """
import sys
import hf_gsc.data
from hf_gsc.evaluation import main, validation

loaded = hf_gsc.data.load_split
hf_gsc.data.load_split = lambda spec, streaming=False, **columns: (loaded(spec, **columns).to_iterable_dataset(num_shards=3)
                                                                   if streaming else loaded(spec, **columns))
validation._is_local = lambda spec: False
sys.exit(main(sys.argv[1:], prog="evaluate_ood.py"))
"""


def _launch_two_processes(tmp_path: Path, argv: list[str], streaming: bool,
                          script_text: str | None = None) -> subprocess.CompletedProcess:
    """``accelerate launch`` of the evaluation on 2 CPU processes (streamed: the local data as 3 uneven shards;
    ``script_text``: this script instead of ``scripts/evaluate_ood.py``)."""
    script = SCRIPT
    if script_text is not None:
        script = tmp_path / "evaluate_custom.py"
        script.write_text(script_text)
    if streaming:
        script = tmp_path / "evaluate_streamed.py"
        script.write_text(STREAMING_SCRIPT)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    accelerate = Path(sys.executable).with_name("accelerate")
    with socket.socket() as probe:  # a free port: other runs may hold accelerate's default 29500
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
               str(script), *argv, *(["--streaming"] if streaming else [])]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_two_processes_match_one(tiny: dict[str, str], single_run: tuple[Path, dict], tmp_path: Path, streaming: bool) -> None:
    output_dir = tmp_path / "two"
    result = _launch_two_processes(tmp_path, _argv(tiny, output_dir), streaming)
    assert result.returncode == 0, result.stderr[-4000:]
    two = json.loads((output_dir / "results.json").read_text())
    assert two["num_processes"] == 2 and two["config"]["streaming"] == streaming
    try:
        _assert_close(_numbers(two), _numbers(single_run[1]))
    except AssertionError as error:
        raise AssertionError(f"{error}\n2 processes: {json.dumps(_numbers(two))}\n"
                             f"1 process: {json.dumps(_numbers(single_run[1]))}") from None
    assert "| Method | noise | flat | Average |" in result.stdout  # the table is printed once
    assert result.stdout.count("| Method | noise") == 1


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_two_processes_skip_the_same_unreadable_image(
    tiny: dict[str, str], broken_folder: str, tmp_path: Path, streaming: bool
) -> None:
    """The unreadable image leaves the two processes with unequal numbers of kept rows: the gathered scores
    are still exactly those of one process, one per readable image, in order."""
    argv = [*_argv(tiny, tmp_path / "one", "--ood-dataset", f"broken={broken_folder}"), "--skip-unreadable-images"]
    one = evaluate_argv(argv)
    argv[argv.index("--output-dir") + 1] = str(tmp_path / "two")
    result = _launch_two_processes(tmp_path, argv, streaming)
    assert result.returncode == 0, result.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["num_processes"] == 2 and two["num_skipped"] == one["num_skipped"]
    assert one["num_skipped"]["ood"]["broken"] == 1
    _assert_close(_numbers(two), _numbers(one))
    for method in _methods().split(","):  # streamed shards come back in shard order, map-style data in dataset order
        scores = [load_file(str(_score_file(tmp_path / run, method, "ood_broken")))["ood_score"] for run in ("two", "one")]
        if streaming:
            scores = [values.sort().values for values in scores]
        torch.testing.assert_close(*scores)


def test_two_processes_stop_together_at_an_unreadable_image(tiny: dict[str, str], broken_folder: str, tmp_path: Path) -> None:
    """Only one process reads the broken image; both stop with its message instead of one waiting forever."""
    result = _launch_two_processes(tmp_path, _argv(tiny, tmp_path / "two", "--ood-dataset", f"broken={broken_folder}"),
                                   streaming=False)
    assert result.returncode != 0
    errors = re.findall(r"evaluate_ood.py: error: cannot decode[^\n]*", result.stderr)  # may follow a progress bar
    assert len(errors) == 2 and f"row {BROKEN_ROW}, file {broken_folder}/04.png" in errors[0], result.stderr[-4000:]
    assert _score_file(tmp_path / "two", "msp", "ood_flat").is_file()
