"""Labels by name on a Hub dataset, and the robust-run paths on 2 processes, through the ``hf-gsc`` command.

(a) ID data read from the loopback Hub (``tests/hub_server.py``) whose ``ClassLabel`` names are the model's
``id2label`` names in another order. ``hf-gsc evaluate --id-dataset user/shuffled-id`` maps the labels by name, on
1 and on 2 processes: ``results.json``'s ``label_check`` records the mapping, the score files carry the model's
class indices, the ID accuracy is computed on them, and the evaluation's Mahalanobis fit equals a fit on the same
images with the labels remapped by hand; so does ``detector.fit(datasets.load_dataset("user/shuffled-id"))``.

(b) On 2 processes (``accelerate launch``): a method that cannot be fitted (KNN with ``k`` above the training set)
is skipped with its reason in ``results.json`` and every other method is reported; a run that stops part-way (an
unreadable OOD image) keeps ``tuning.json``, its fits and its finished score files, and the rerun resumes from
them, computing only what is missing. The resumed 2-process results equal the 1-process ones.

Cost: three subprocesses in all, on tiny data: one 1-process run (which also fits through the API) and two
2-process launches (the failing run and its resumption). The runs are subprocesses because ``datasets`` and
``huggingface_hub`` read ``HF_ENDPOINT`` at import.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import NUM_LABELS
from hub_server import LoopbackHub
from safetensors.torch import load_file
from test_first_hour import CLASSES, save_tiny_vit  # CLASSES: the tiny ViT's id2label, cat, dog, bird
from test_fit_labels import NAMES, _detector, named  # noqa: F401  (a balanced 5-class model named boot, coat, ...)


REPO = Path(__file__).resolve().parents[1]
DATA_NAMES = ["dog", "bird", "cat"]  # the Hub dataset's ClassLabel: the same names in another order
BY_NAME = [CLASSES.index(name) for name in DATA_NAMES]  # data label -> model label, written out by hand: [1, 2, 0]
REPO_ID = "user/shuffled-id"
#: Data labels of each split. Train: every class (Mahalanobis needs D + K = 16 + 3 = 19 rows and each class).
#: Test: unbalanced, so that the ID accuracy against the data's indices differs from the one against the mapped
#: labels whatever the (random) model predicts, when it predicts one class for every image.
SPLIT_LABELS = {"train": [i % 3 for i in range(24)], "validation": [i % 3 for i in range(12)],
                "test": [0, 1, 0, 2, 0, 1, 0, 1, 0, 2, 0, 1]}
METHODS = "msp,mahalanobis,knn"
#: KNN with k above the 24 training images cannot be fitted: the method that is skipped.
UNFITTABLE = {"knn": 1000}
STATE_FILE = "detector_state.safetensors"
BASE_MODEL_SCORES = "_base_model"  # the folder of the classifier's own predictions
TIMEOUT = 300

#: The 1-process run: ``hf-gsc evaluate`` (its entry point), then ``detector.fit`` on the Hub split, whose fitted
#: state is saved for the test to compare (one interpreter start for both).
ONE_PROCESS_SCRIPT = """
import json, sys
from hf_gsc.cli import main

args = json.loads(sys.argv[1])
code = main(["evaluate", *args["argv"]])
if code:
    sys.exit(code)
code = main(["evaluate", *args["detector_argv"]])  # the detector the run selected and saved, as it is
if code:
    sys.exit(code)
import datasets
from safetensors.torch import save_file
from hf_gsc import AutoOODDetector

detector = AutoOODDetector.from_pretrained(args["model"], method="mahalanobis")
detector.fit(datasets.load_dataset(args["repo_id"], split="train"))
save_file({name: tensor.contiguous() for name, tensor in detector.fitted_state().items()}, args["api_fit"])
"""


def _images(labels: list[int], rng: np.random.Generator, ood: bool = False) -> list:
    """16x16 grey images: a bright band whose position is the (data) class, or noise for OOD."""
    from PIL import Image

    out = []
    for label in labels:
        if ood:
            array = rng.integers(0, 256, (16, 16))
        else:
            array = rng.integers(0, 40, (16, 16))
            array[label * 5:label * 5 + 5, :] += 180
        out.append(Image.fromarray(array.clip(0, 255).astype(np.uint8), "L"))
    return out


def _folder(path: Path, images: list) -> Path:
    path.mkdir(parents=True)
    for index, image in enumerate(images):
        image.save(path / f"{index:02d}.png")
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    """A tiny ViT (classes cat, dog, bird), the ID data on the loopback Hub with its classes in another order, two
    OOD image folders (``far``, ``late``) and ``late``'s copy with an unreadable image (for the run that fails)."""
    import datasets

    root = tmp_path_factory.mktemp("hub2p")
    save_tiny_vit(root / "model")
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=DATA_NAMES)})
    splits = {split: datasets.Dataset.from_dict({"image": _images(labels, rng), "label": labels}, features=features)
              for split, labels in SPLIT_LABELS.items()}
    upload = root / "upload"
    (upload / "data").mkdir(parents=True)
    for split, dataset in splits.items():
        dataset.to_parquet(str(upload / "data" / f"{split}-00000-of-00001.parquet"))
    far = _folder(root / "far", _images([0] * 7, rng, ood=True))
    late = _folder(root / "late", _images([0] * 5, rng, ood=True))
    late_broken = root / "late_broken"  # the same images, and one that cannot be decoded; removed for the rerun
    shutil.copytree(late, late_broken)
    (late_broken / "99.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not the rest of a PNG")
    with LoopbackHub() as hub:
        with hub.patch_client(token=hub.token):
            from huggingface_hub import HfApi

            api = HfApi()
            api.create_repo(REPO_ID, repo_type="dataset")
            api.upload_folder(folder_path=str(upload), repo_id=REPO_ID, repo_type="dataset")
        yield {"hub": hub, "root": root, "model": str(root / "model"), "splits": splits, "far": str(far),
               "late": str(late), "late_broken": str(late_broken)}


def _argv(world: dict, output_dir: Path, late: str, save: bool = False) -> list[str]:
    """The run; ``save``: also ``--save-detectors`` (the 1-process run, whose selected detector ``--detector`` then
    evaluates; saving rewrites ``detectors/``, which the resume test checks is left as the failed run left it)."""
    return ["--model", world["model"], "--id-dataset", REPO_ID, "--ood-dataset", f"far={world['far']}",
            "--ood-dataset", f"late={late}", "--methods", METHODS,
            *(f"--hyperparameter={name}.k={k}" for name, k in UNFITTABLE.items()),
            "--tune", *(["--save-detectors"] if save else []), "--batch-size", "4", "--no-plots",
            "--output-dir", str(output_dir)]


def _detector_argv(world: dict, detector_dir: Path, output_dir: Path) -> list[str]:
    """``--detector``: the saved selected detector evaluated as it is, on the same Hub data."""
    return ["--detector", str(detector_dir), "--id-dataset", REPO_ID, "--ood-dataset", f"far={world['far']}",
            "--ood-dataset", f"late={world['late']}", "--batch-size", "4", "--no-plots", "--output-dir", str(output_dir)]


def _env(world: dict) -> dict[str, str]:
    # CPU for every run (CUDA_VISIBLE_DEVICES=""): on a GPU machine the 1-process run would otherwise use the GPU and
    # the 2-process one (ACCELERATE_USE_CPU) the CPU, and the scores compared would differ by more than rounding.
    return {**world["hub"].client_env(hf_home=world["root"] / "hf"), "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _launch_two_processes(world: dict, argv: list[str]) -> subprocess.CompletedProcess:
    """``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m hf_gsc evaluate ...``."""
    with socket.socket() as probe:  # a free port: other runs may hold accelerate's default 29500
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
               "--dynamo_backend", "no", "-m", "hf_gsc", "evaluate", *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**_env(world), "ACCELERATE_USE_CPU": "1"}, cwd=world["root"])


@pytest.fixture(scope="module")
def one_process(world: dict) -> dict[str, Any]:
    output_dir = world["root"] / "one"
    api_fit = world["root"] / "api_fit.safetensors"
    args = {"argv": _argv(world, output_dir, world["late"], save=True), "model": world["model"], "repo_id": REPO_ID,
            "api_fit": str(api_fit),
            "detector_argv": _detector_argv(world, output_dir / "detectors" / "selected", world["root"] / "one_shipped")}
    result = subprocess.run([sys.executable, "-c", ONE_PROCESS_SCRIPT, json.dumps(args)], capture_output=True,
                            text=True, timeout=TIMEOUT, env=_env(world), cwd=world["root"])
    assert result.returncode == 0, result.stderr[-4000:]
    return {"output_dir": output_dir, "results": json.loads((output_dir / "results.json").read_text()),
            "api_fit": load_file(str(api_fit)), "stdout": result.stdout,
            "shipped": json.loads((world["root"] / "one_shipped" / "results.json").read_text())}


def _snapshot(output_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file a rerun must reuse as it is: path -> (inode, mtime, bytes); an atomic rewrite changes the inode."""
    files = [output_dir / "tuning.json", *(output_dir / "detectors").rglob("*"), *(output_dir / "scores").rglob("*")]
    return {str(path.relative_to(output_dir)): (path.stat().st_ino, path.stat().st_mtime_ns, path.read_bytes())
            for path in files if path.is_file()}


@pytest.fixture(scope="module")
def two_processes(world: dict, one_process: dict) -> dict[str, Any]:
    """The 2-process run that stops at ``late``'s unreadable image, then its rerun once the image is removed, then
    the 1-process run's selected detector evaluated as it is (``--detector``) on 2 processes."""
    output_dir = world["root"] / "two"
    argv = _argv(world, output_dir, world["late_broken"])
    failed = _launch_two_processes(world, argv)
    after_failure = _snapshot(output_dir) if output_dir.is_dir() else {}
    (Path(world["late_broken"]) / "99.png").unlink()  # now the same images as `late`
    resumed = _launch_two_processes(world, argv)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    shipped_dir = world["root"] / "two_shipped"
    shipped = _launch_two_processes(
        world, _detector_argv(world, one_process["output_dir"] / "detectors" / "selected", shipped_dir))
    assert shipped.returncode == 0, shipped.stderr[-4000:]
    return {"failed": failed, "after_failure": after_failure, "resumed": resumed, "output_dir": output_dir,
            "results": json.loads((output_dir / "results.json").read_text()),
            "shipped": json.loads((shipped_dir / "results.json").read_text())}


# ------------------------------------------------------------------------------------------------- helpers
def _mapped(labels: list[int]) -> torch.Tensor:
    return torch.tensor([BY_NAME[label] for label in labels])


def _hand_fit(world: dict) -> dict[str, torch.Tensor]:
    """Mahalanobis fitted on the Hub data's training images with the labels remapped by hand: (pixel_values, model
    label) batches, so that no label-mapping code of the library runs."""
    from hf_gsc import AutoOODDetector

    detector = AutoOODDetector.from_pretrained(world["model"], method="mahalanobis")
    train = world["splits"]["train"]
    pixel_values = detector.image_processor(images=list(train["image"]), return_tensors="pt")["pixel_values"]
    detector.fit([(pixel_values, _mapped(SPLIT_LABELS["train"]))])
    return {name: tensor.double() for name, tensor in detector.fitted_state().items()}


def _assert_fit_equals(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], what: str) -> None:
    state = {name: tensor for name, tensor in state.items() if name != "calibration_scores"}  # the threshold's, kept
    assert set(state) == set(reference) == {"class_means", "precision"}, what
    # Taken by index, the class means would be the same rows in another order: far apart, not a rounding error.
    permuted = reference["class_means"][torch.tensor(BY_NAME)]
    assert (state["class_means"].double() - permuted).abs().max() > 1e-2, what
    # The same features; the class statistics summed over other batches (4 rows here, 24 in the reference): float64
    # rounding, which the pseudo-inverse of the near-singular covariance of 24 rows of a 16-dim feature amplifies
    # (precision entries up to ~1e8; observed differences ~1e-10 of that).
    for name in reference:
        error = float((state[name].double() - reference[name]).abs().max())
        assert error <= 1e-8 * float(reference[name].abs().max()), (what, name, error)


def _check_label_mapping(output_dir: Path, results: dict) -> None:
    """``label_check`` records the mapping; the score files' labels are the model's; the accuracy is on them."""
    check = results["label_check"]
    assert check["status"] == "order_differs" and check["mapped_by"] == "name"
    assert check["mapping"] == {"dog": "dog", "bird": "bird", "cat": "cat"}
    assert [(p["data"], p["model"]) for p in check["positions"]] == list(zip(DATA_NAMES, CLASSES))
    expected = _mapped(SPLIT_LABELS["test"])
    by_index = torch.tensor(SPLIT_LABELS["test"])
    for method in ("msp", "mahalanobis", BASE_MODEL_SCORES):
        saved = load_file(str(output_dir / "scores" / method / "id_test.safetensors"))
        assert torch.equal(saved["labels"].long(), expected), method
    predictions = load_file(str(output_dir / "scores" / BASE_MODEL_SCORES / "id_test.safetensors"))["predictions"]
    accuracy = float((predictions.long() == expected).double().mean())
    assert accuracy != float((predictions.long() == by_index).double().mean())  # the test tells the two apart
    assert results["id_accuracy"] == accuracy


def _numbers(results: dict) -> dict:
    """What must not depend on the process count."""
    return {"id_accuracy": results["id_accuracy"], "split_sizes": results["split_sizes"],
            "skipped": results["skipped"], "label_check": results["label_check"],
            "tuning": results["tuning"]["methods"],  # every grid point's validation metrics and the choice
            "selection": {key: value for key, value in results["selection"].items() if key != "seconds"},
            "methods": {name: {key: entry[key] for key in ("threshold", "id_tpr_at_threshold", "ood", "average")}
                        for name, entry in results["methods"].items()}}


def _assert_close(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            _assert_close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for index, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f"{path}[{index}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6), f"{path}: {a} != {b}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


# --------------------------------------------------------------------------------------------------- tests
def test_one_process_maps_hub_labels_by_name_in_the_evaluation_and_in_fit(world, one_process):
    output_dir, results = one_process["output_dir"], one_process["results"]
    _check_label_mapping(output_dir, results)
    said = ("ID labels mapped to the model's id2label (by name), 3 classes: data class 'dog' -> model class 1 'dog', "
            "data class 'bird' -> model class 2 'bird', data class 'cat' -> model class 0 'cat'")
    assert said in one_process["stdout"]
    reference = _hand_fit(world)
    saved = load_file(str(output_dir / "detectors" / "mahalanobis" / STATE_FILE))
    _assert_fit_equals(saved, reference, "the evaluation's fit (1 process)")
    _assert_fit_equals(one_process["api_fit"], reference, "detector.fit(the Hub dataset)")


def test_one_process_skips_the_method_that_cannot_fit(one_process):
    results = one_process["results"]
    assert set(results["skipped"]) == set(UNFITTABLE) and results["skipped"]["knn"].startswith("fit failed:")
    assert set(results["methods"]) == {"msp", "mahalanobis"}


def test_two_processes_map_hub_labels_by_name_and_skip_the_method_that_cannot_fit(world, one_process, two_processes):
    output_dir, results = two_processes["output_dir"], two_processes["results"]
    assert results["num_processes"] == 2
    _check_label_mapping(output_dir, results)
    _assert_fit_equals(load_file(str(output_dir / "detectors" / "mahalanobis" / STATE_FILE)), _hand_fit(world),
                       "the evaluation's fit (2 processes)")
    skipped = results["skipped"]
    assert set(skipped) == set(UNFITTABLE) and skipped["knn"].startswith("fit failed:")
    assert "k=1000" in skipped["knn"], skipped
    assert set(results["methods"]) == {"msp", "mahalanobis"}  # every other method is reported
    assert not (output_dir / "scores" / "knn").exists() or not any((output_dir / "scores" / "knn").iterdir())
    assert f"skipped knn: {skipped['knn']}" in two_processes["resumed"].stdout
    assert f"* `knn`: {skipped['knn']}" in (output_dir / "results.md").read_text()
    # The same score files (each image's score and label, in dataset order), and the same numbers, skips, label
    # record and tuning search as on 1 process.
    one_dir = one_process["output_dir"]
    files = sorted(path.relative_to(one_dir) for path in (one_dir / "scores").rglob("*.safetensors"))
    assert files == sorted(path.relative_to(output_dir) for path in (output_dir / "scores").rglob("*.safetensors"))
    # (msp, mahalanobis) x (ID test, ID validation, far, late, the selection's 2 generated OOD validation sets) + the
    # base model
    assert len(files) == 2 * 6 + 1
    for path in files:
        one, two = load_file(str(one_dir / path)), load_file(str(output_dir / path))
        assert one.keys() == two.keys() and torch.equal(one["labels"], two["labels"]), path
        for key in set(one) - {"labels"}:
            torch.testing.assert_close(two[key], one[key], rtol=1e-6, atol=1e-6, msg=lambda m: f"{path} {key}: {m}")
    try:
        _assert_close(_numbers(results), _numbers(one_process["results"]))
    except AssertionError as error:
        raise AssertionError(f"{error}\n2 processes: {json.dumps(_numbers(results))}\n"
                             f"1 process: {json.dumps(_numbers(one_process['results']))}") from None


def test_two_processes_keep_what_a_failed_run_computed_and_resume_from_it(two_processes):
    failed, before = two_processes["failed"], two_processes["after_failure"]
    assert failed.returncode != 0
    assert "cannot decode the image" in failed.stderr and "99.png" in failed.stderr, failed.stderr[-4000:]
    # Kept: the tuning search, the fit, and the score files of every split finished before `late`.
    assert "tuning.json" in before
    assert {"detectors/mahalanobis/fit.json", f"detectors/mahalanobis/{STATE_FILE}"} <= set(before)
    scores = sorted(path for path in before if path.startswith("scores/") and path.endswith(".safetensors"))
    finished = {f"scores/{method}/{split}.safetensors" for method in ("msp", "mahalanobis")
                for split in ("id_test", "id_validation", "ood_far")}
    assert finished | {f"scores/{BASE_MODEL_SCORES}/id_test.safetensors"} <= set(scores), scores
    assert not [path for path in scores if "ood_late" in path or path.startswith("scores/knn/")], scores
    # The rerun reuses all of it as it is (same inode, time and bytes) and computes only what is missing.
    after = _snapshot(two_processes["output_dir"])
    changed = [path for path, stamp in before.items() if after.get(path) != stamp]
    assert not changed, f"rewritten by the rerun: {changed}"
    out = two_processes["resumed"].stdout
    assert "tuning: reusing the search saved in" in out
    # (ID test, ID validation, far, late, the 2 generated OOD validation sets) x 3 methods + the base model on ID test
    num_scores = 6 * 3 + 1
    assert f"score files: {num_scores - len(scores)} to compute, {len(scores)} from the cache" in out, out
    assert {f"scores/{method}/ood_late.safetensors" for method in ("msp", "mahalanobis")} <= set(after)


def test_fit_compares_class_names_as_the_evaluation_does(named):
    """``detector.fit(dataset)`` maps ``ClassLabel`` names by the evaluation's rule (ignoring case and surrounding
    whitespace, ``_`` / ``-`` as spaces): a dataset that ``hf-gsc evaluate`` maps by name is not fitted by index. (It
    was: ``fit`` compared names exactly, found none of these, and kept the data's indices without a word.)"""
    import datasets

    from hf_gsc.utils.label_names import label_mapping

    model, processor, images = named
    data_names = ["BAG", "Shirt", " dress", "COAT", "Boot"]  # the model's NAMES reversed, none spelled as the model
    by_hand = [NAMES.index(name.strip().lower()) for name in data_names]
    assert label_mapping(data_names, NAMES) == by_hand  # what the evaluation does with these names
    labels = [i % NUM_LABELS for i in range(len(images))]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=data_names)})
    fitted = _detector("mahalanobis", model, processor).fit(
        datasets.Dataset.from_dict({"image": images, "label": labels}, features=features))
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    reference = _detector("mahalanobis", model, processor).fit(
        [(pixel_values, torch.tensor([by_hand[label] for label in labels]))])
    by_index = _detector("mahalanobis", model, processor).fit([(pixel_values, torch.tensor(labels))])
    assert (fitted.class_means - by_index.class_means).abs().max() > 1e-2
    torch.testing.assert_close(fitted.class_means, reference.class_means, rtol=1e-12, atol=1e-12)
    # Names partly the model's, by the same rule: refused, naming only the name that is not one.
    partly = datasets.Features({"image": datasets.Image(),
                                "label": datasets.ClassLabel(names=["BOOT", "coat", "sandal", "Shirt", "bag"])})
    with pytest.raises(ValueError, match=r"cannot be mapped to the model's labels: 'sandal' are not among"):
        _detector("mahalanobis", model, processor).fit(
            datasets.Dataset.from_dict({"image": images, "label": labels}, features=partly))


def test_the_selected_detector_is_evaluated_as_it_is_on_one_and_two_processes(world, one_process, two_processes):
    """``--detector`` on the Hub dataset: the detector the run selected, its shipped threshold, no refit; the labels
    mapped by name; the same numbers on 2 processes as on 1."""
    chosen = one_process["results"]["selection"]["method"]
    assert two_processes["results"]["selection"]["method"] == chosen
    one, two = one_process["shipped"], two_processes["shipped"]
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    for results in (one, two):
        assert results["detector"]["method"] == chosen and list(results["methods"]) == [chosen]
        assert results["detector"]["evaluated_as"] == "saved: no refit, no recalibration"
        assert results["label_check"]["mapped_by"] == "name"
    shipped_threshold = json.loads((one_process["output_dir"] / "detectors" / "selected" / "detector_config.json")
                                   .read_text())["threshold"]
    assert one["detector"]["threshold"] == shipped_threshold
    _assert_close(two["detector"], one["detector"])
    _assert_close({key: two["methods"][chosen][key] for key in ("threshold", "id_tpr_at_threshold", "ood", "average")},
                  {key: one["methods"][chosen][key] for key in ("threshold", "id_tpr_at_threshold", "ood", "average")})
