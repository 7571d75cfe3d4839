"""A pip user's first hour with ``hf-gsc evaluate``: what must fail early, be said, or be kept.

* plots without matplotlib fail before any scoring, naming the ``plots`` extra and ``--no-plots``;
* the run header says how many processes run, and ``accelerate launch ... -m hf_gsc evaluate`` runs 2 of them;
* ID class names that differ from the model's ``id2label`` are warned about and recorded;
* a missing local folder is named as such, the user's ``NAME=`` is kept, local folders are not "downloaded",
  ``--list-methods`` lists every method, and a cached rerun keeps the timings of the run that scored.

Everything runs on a tiny 1-channel ViT whose classes are named ``cat``, ``dog``, ``bird``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import evaluate_argv

from hf_gsc import cli as hf_gsc_cli
from hf_gsc.evaluation import cli, evaluator, labels, options, run_info
from hf_gsc.evaluation.arguments import parse_arguments
from hf_gsc.evaluation.labels import LabelMismatchWarning


REPO = Path(__file__).resolve().parents[1]
CLASSES = ["cat", "dog", "bird"]
SIZES = {"train": 8, "validation": 9, "test": 10}


def _images(rng: np.random.Generator, n: int, ood: bool) -> list:
    from PIL import Image

    out = []
    for i in range(n):
        array = rng.integers(0, 256, (16, 16)) if ood else rng.integers(0, 40, (16, 16))
        if not ood:
            array[(i % 3) * 5:(i % 3) * 5 + 5, :] += 180
        out.append(Image.fromarray(array.clip(0, 255).astype(np.uint8), "L"))
    return out


def _id_data(root: Path, names: list[str], rng: np.random.Generator) -> str:
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    splits = {split: datasets.Dataset.from_dict({"image": _images(rng, n, False), "label": [i % 3 for i in range(n)]},
                                               features=features) for split, n in SIZES.items()}
    datasets.DatasetDict(splits).save_to_disk(root)
    return str(root)


def save_tiny_vit(folder: Path, num_channels: int = 1) -> None:
    """A random 16 px ViT of ``num_channels`` channels (1: grey, 3: RGB) with the classes ``CLASSES`` (cat, dog,
    bird) and its PIL image processor, in ``folder``; seeded, so the same model every time."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=8, num_channels=num_channels, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32, num_labels=3,
                       id2label=dict(enumerate(CLASSES)), label2id={name: i for i, name in enumerate(CLASSES)})
    ViTForImageClassification(config).save_pretrained(folder)
    ViTImageProcessorPil(do_resize=True, size={"height": 16, "width": 16}, image_mean=[0.5] * num_channels,
                         image_std=[0.5] * num_channels, do_convert_rgb=False).save_pretrained(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny ViT (classes cat, dog, bird), ID data with the same names, others, and an OOD image folder."""
    root = tmp_path_factory.mktemp("first_hour")
    save_tiny_vit(root / "model")
    rng = np.random.default_rng(0)
    folder = root / "far"
    folder.mkdir()
    for i, image in enumerate(_images(rng, 7, True)):
        image.save(folder / f"{i:02d}.png")
    return {"model": str(root / "model"), "id": _id_data(root / "id", CLASSES, rng),
            "id_other": _id_data(root / "id_other", ["apple", "pear", "plum"], rng), "far": str(folder),
            "root": str(root)}


def _argv(tiny: dict[str, str], output_dir: Path, *extra: str, plots: bool = False) -> list[str]:
    return ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"far={tiny['far']}",
            "--methods", "msp,energy", "--output-dir", str(output_dir), "--batch-size", "4",
            *([] if plots else ["--no-plots"]), *extra]


# ------------------------------------------------------------------------------- 1. plots, extras
def test_plots_without_matplotlib_fail_before_any_scoring(tiny, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ModuleNotFoundError
    with pytest.raises(SystemExit) as exit_:
        hf_gsc_cli.main(["evaluate", *_argv(tiny, tmp_path / "run", plots=True)])
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "pip install 'hf_gsc[plots]'" in error and "--no-plots" in error, error
    assert not (tmp_path / "run" / "scores").exists()  # failed before the model, the data, any score


def test_no_plots_without_matplotlib_prints_the_table(tiny, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert hf_gsc_cli.main(["evaluate", *_argv(tiny, tmp_path / "run")]) == 0
    assert "| Method | far | Average |" in capsys.readouterr().out


@pytest.mark.parametrize("module, extra", [("matplotlib", "plots"), ("skimage", "benchmarks"),
                                          ("accelerate", "evaluation")])
def test_a_missing_module_names_its_extra(module, extra, monkeypatch, capsys) -> None:
    def missing(*args, **kwargs):
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)

    monkeypatch.setattr(cli, "main", missing)
    assert hf_gsc_cli.main(["evaluate", "--help"]) == 1
    error = capsys.readouterr().err
    assert f"pip install 'hf_gsc[{extra}]'" in error and "[all]" not in error, error
    assert ("--no-plots" in error) == (extra == "plots")


# --------------------------------------------------------------------------- 2. processes, header
def test_run_header_says_what_runs(tiny, tmp_path, capsys) -> None:
    evaluate_argv(_argv(tiny, tmp_path / "run"))
    header = capsys.readouterr().out
    assert f"hf-gsc evaluate: {tiny['model']} on ID {tiny['id']}, OOD far={tiny['far']}" in header
    assert "device cpu, 1 process, mixed precision no, 0 data workers per process" in header
    assert "methods: msp, energy" in header
    assert f"samples: ID test {SIZES['test']}, ID validation {SIZES['validation']}, OOD far 7" in header
    # 2 methods x (ID test, ID validation, OOD far, the 2 generated OOD validation sets) + the base model on ID test
    assert "score files: 11 to compute, 0 from the cache" in header
    assert "OOD validation val_noise 4, OOD validation val_jigsaw 4" in header  # the selection's data, half of 9


def test_processes_that_would_each_run_alone_are_refused() -> None:
    """``accelerate launch --multi_gpu`` on a machine without GPUs, without ACCELERATE_USE_CPU=1."""
    alone = SimpleNamespace(num_processes=1, device="cpu")
    with pytest.raises(options.InputError, match=r"WORLD_SIZE=2.*ACCELERATE_USE_CPU=1"):
        run_info.check_process_count(alone, {"WORLD_SIZE": "2"})
    run_info.check_process_count(alone, {})
    run_info.check_process_count(SimpleNamespace(num_processes=2, device="cpu"), {"WORLD_SIZE": "2"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="WORLD_SIZE=2 on a GPU machine would wait for a second process")
def test_a_run_whose_processes_would_each_run_alone_stops_before_the_model(tiny, tmp_path, monkeypatch) -> None:
    from hf_gsc.evaluation.accelerator import make_accelerator

    make_accelerator(None)  # accelerate's shared state: this one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(options.InputError, match=r"launched as 2 processes"):
        evaluate_argv(_argv(tiny, tmp_path / "run"))
    assert not (tmp_path / "run" / "scores").exists()


def test_two_processes_from_the_installed_command(tiny, tmp_path) -> None:
    """The documented CPU recipe with the package, not scripts/: ``accelerate launch -m hf_gsc evaluate``."""
    with socket.socket() as probe:  # a free port: other runs may hold accelerate's default 29500
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(port), "-m", "hf_gsc", "evaluate", *_argv(tiny, tmp_path / "two")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads((tmp_path / "two" / "results.json").read_text())["num_processes"] == 2
    assert result.stdout.count("hf-gsc evaluate: ") == 1 and ", 2 processes," in result.stdout
    assert result.stdout.count("| Method | far") == 1


# ------------------------------------------------------------------------------------ 6. labels
def test_compare_labels() -> None:
    assert labels.compare_labels(["T-shirt/top", "ankle_boot"], ["t-shirt/top", "Ankle boot"]) == {"status": "match"}
    order = labels.compare_labels(["dog", "cat", "bird"], CLASSES)
    assert order["status"] == "order_differs"
    assert order["positions"] == [{"index": 0, "data": "dog", "model": "cat"}, {"index": 1, "data": "cat", "model": "dog"}]
    assert "0 is 'dog' in the data, 'cat' in the model" in labels.label_warning(order)
    names = labels.compare_labels(["cat", "wolf"], CLASSES)
    assert names["only_in_data"] == ["wolf"] and names["only_in_model"] == ["dog", "bird"]
    assert labels.compare_labels(None, CLASSES)["status"] == "unchecked"
    assert labels.model_class_names(SimpleNamespace(id2label={0: "LABEL_0", 1: "LABEL_1"})) is None
    assert labels.label_warning({"status": "match"}) is None


def test_other_class_names_are_warned_before_scoring_and_recorded(tiny, tmp_path, monkeypatch) -> None:
    seen_at_scoring = []
    real = evaluator.score_missing

    def spy(*args, **kwargs):
        seen_at_scoring.append(len(caught))
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluator, "score_missing", spy)
    argv = _argv(tiny, tmp_path / "run")
    argv[argv.index("--id-dataset") + 1] = tiny["id_other"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = evaluate_argv(argv)
    mismatches = [w for w in caught if issubclass(w.category, LabelMismatchWarning)]
    assert len(mismatches) == 1 and seen_at_scoring and set(seen_at_scoring) == {len(caught)} and len(caught) >= 1
    message = str(mismatches[0].message)
    assert "'apple', 'pear', 'plum'" in message and "'cat', 'dog', 'bird'" in message, message
    assert results["label_check"]["status"] == "names_differ"
    assert json.loads((tmp_path / "run" / "results.json").read_text())["label_check"]["only_in_data"] == ["apple", "pear", "plum"]
    report = (tmp_path / "run" / "results.md").read_text()  # said once, above the tables the figures are in
    note = report.index("**Labels do not match:** the ID data's class names differ")
    assert note < report.index("| Method") and report.count("class names differ") == 1


def test_matching_class_names_are_recorded_without_warning(tiny, tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", LabelMismatchWarning)
        results = evaluate_argv(_argv(tiny, tmp_path / "run"))
    assert results["label_check"] == {"status": "match"}


# ---------------------------------------------------------------------------- 8. messages, records
def test_a_missing_local_folder_is_named(tiny, tmp_path) -> None:
    missing = str(tmp_path / "no_such_folder")
    for spec in (missing, f"{missing}:test", "relative_folder_that_is_not_here"):
        with pytest.raises(options.InputError, match=r"no such folder") as error:
            parse_arguments(_argv(tiny, tmp_path / "run", "--ood-dataset", f"near={spec}"))
        assert f"--ood-dataset 'near={spec}'" in str(error.value) and "split" not in str(error.value).split("(")[0]
    with pytest.raises(options.InputError, match=r"--id-dataset .*no such folder"):
        argv = _argv(tiny, tmp_path / "run")
        argv[argv.index("--id-dataset") + 1] = missing
        parse_arguments(argv)
    from hf_gsc.data import load_split

    with pytest.raises(FileNotFoundError, match=r"no such folder: '.*no_such_folder'"):
        load_split(missing)


def test_the_users_split_name_is_kept(tiny, tmp_path) -> None:
    not_a_folder = tmp_path / "notes.txt"
    not_a_folder.write_text("not images")
    argv = _argv(tiny, tmp_path / "run", "--ood-dataset", f"my_photos={not_a_folder}")
    with pytest.raises(options.InputError, match=rf"^--ood-dataset my_photos={not_a_folder}: could not load"):
        evaluate_argv(argv)
    results = evaluate_argv(_argv(tiny, tmp_path / "run"))
    table = (tmp_path / "run" / "results.md").read_text()
    assert table.startswith(f"## OOD detection: {tiny['model']} on ID {tiny['id']}\n") and "custom" not in table
    assert results["ood_datasets"] == {"far": tiny["far"]} and results["id_dataset"] == tiny["id"]


def test_a_local_folder_is_read_without_progress_bars(tmp_path, capfd) -> None:
    """datasets' bars ("Downloading data", "Generating train split") are off while hf_gsc reads a local folder, and
    the user's own setting is what it was afterwards, on or off."""
    import datasets
    from PIL import Image

    from hf_gsc.data import load_split

    for i in range(20):  # datasets shows its file progress bar from 16 files on
        Image.new("L", (8, 8), i * 10).save(tmp_path / f"{i:02d}.png")
    assert not datasets.are_progress_bars_disabled()
    assert len(load_split(str(tmp_path))) == 20
    output = capfd.readouterr().err
    assert "Downloading" not in output and "Generating" not in output and "%|" not in output, output
    assert not datasets.are_progress_bars_disabled()  # the user's setting, on, is kept for their own loads
    datasets.disable_progress_bars()
    try:
        load_split(str(tmp_path))
        assert datasets.are_progress_bars_disabled()  # and off stays off
    finally:
        datasets.enable_progress_bars()


def test_list_methods(capsys) -> None:
    from hf_gsc.detectors import DETECTORS

    with pytest.raises(SystemExit) as exit_:
        hf_gsc_cli.main(["evaluate", "--list-methods"])  # no --model / --output-dir needed
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(DETECTORS)
    assert all(len(line.split()) > 2 for line in lines)
    assert next(line for line in lines if line.startswith("knn ")).endswith("[fitted on ID train]")
    with pytest.raises(SystemExit):
        hf_gsc_cli.main(["evaluate", "--help"])
    assert "--list-methods" in capsys.readouterr().out


def test_a_cached_rerun_keeps_the_timings_of_the_run_that_scored(tiny, tmp_path) -> None:
    first = evaluate_argv(_argv(tiny, tmp_path / "run"))
    again = evaluate_argv(_argv(tiny, tmp_path / "run"))
    scored, kept = first["seconds"]["splits_scored"], again["seconds"]["splits_scored"]
    assert set(scored) == set(kept) == {"id_test", "id_validation", "ood_far", "val_ood_val_noise", "val_ood_val_jigsaw"}
    for split, entry in scored.items():
        assert entry["cached"] is False and kept[split]["cached"] is True
        assert {k: v for k, v in kept[split].items() if k != "cached"} == {k: v for k, v in entry.items() if k != "cached"}
    assert again["seconds"]["scoring_main_process"] == first["seconds"]["scoring_main_process"]
    # The shared backbone pass of each split apart from each method's own work, kept with the cached timings too.
    backbone = first["seconds"]["scoring_main_process"]["_backbone"]
    assert set(backbone) == set(scored)
    assert all(backbone[split] == entry["backbone_seconds"] > 0 for split, entry in scored.items())
    # One method scored again: its splits report the new pass, and only that method.
    third = evaluate_argv(_argv(tiny, tmp_path / "run", "--methods", "msp,energy,max_logit"))
    assert {entry["methods"][0] for entry in third["seconds"]["splits_scored"].values()} == {"max_logit"}
    assert third["seconds"]["scoring_main_process"]["msp"] == first["seconds"]["scoring_main_process"]["msp"]
    assert third["seconds"]["scoring_main_process"]["_backbone"] == {
        split: entry["backbone_seconds"] for split, entry in third["seconds"]["splits_scored"].items()}
