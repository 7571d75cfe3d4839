"""The user's walk-through, from a wheel installed outside the checkout, each step in a fresh interpreter.

Image folders (a few PNGs per class) and a tiny ViT classifier with its image processor -> for each of gsc, knn, vim,
mahalanobis, react and energy, in a process of its own: build with ``AutoOODDetector``, fit from images, calibrate
from an image folder, push to the loopback Hub -> in another process: load each by repo id and through the
``ood-image-classification`` pipeline, with the same scores and decisions -> ``hf-gsc evaluate --save-detectors`` on
1 and on 2 processes (``accelerate launch``) -> each saved detector, loaded in a fresh process, reproduces the
evaluation's score files.

Marked ``slow`` (it builds and installs a wheel, like ``test_packaging``): ``pytest -m 'not slow'`` leaves it out,
a plain ``pytest tests`` (``make test``) runs it.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hub_server import LoopbackHub
from safetensors.torch import load_file
from test_packaging import _run, install_wheel


pytestmark = pytest.mark.slow

CLASSES = ("circle", "square", "stripe")
#: Images per class and split: knn (k=5), vim (D=16) and mahalanobis (D + K = 19) fit on 36 train images; 102
#: validation images calibrate without the few-samples warning.
PER_CLASS = {"train": 12, "validation": 34, "test": 6}
NUM_OOD, NUM_PROBE = 15, 5
METHODS = ("gsc", "knn", "vim", "mahalanobis", "react", "energy")
HYPERPARAMETERS = {"gsc": {"mask_ratio": 0.1}, "knn": {"k": 5}}
BASE_REPO = "user/tiny-vit"
#: GSC is built from the local folder and pushed with its base weights; the others reference BASE_REPO.
WITH_BASE = {"gsc"}
TIMEOUT = 300


def _repo_id(method: str) -> str:
    return f"user/{method}-walkthrough"


# ------------------------------------------------------------------------------------------------ scripts
#: One method, in a fresh process: build on the classifier, fit from images, calibrate from a folder, score the probe
#: images (directly and through the pipeline), push. Writes what it saw to a JSON file.
BUILD_SCRIPT = """
    import json, sys
    from pathlib import Path
    import datasets, torch, transformers
    from PIL import Image
    import hf_gsc
    from hf_gsc import AutoOODDetector

    args = json.loads(sys.argv[1])
    method, data = args["method"], Path(args["data"])
    detector = AutoOODDetector.from_pretrained(args["classifier"], method=method, **args["hyperparameters"])
    assert detector.image_processor is not None, "the classifier's image processor was not loaded"
    if detector.needs_fit:
        if method == "mahalanobis":  # per-class statistics: images with their labels (class folders)
            detector.fit(datasets.load_dataset("imagefolder", data_dir=str(data / "id" / "train"), split="train"))
        else:  # a folder of images
            detector.fit(data / "id" / "train")
    detector.calibrate(data / "id" / "validation")
    probe = sorted((data / "probe").glob("*.png"))
    inputs = detector.image_processor(images=[Image.open(p).convert("RGB") for p in probe], return_tensors="pt")
    out = detector(**inputs)
    served = transformers.pipeline("ood-image-classification", model=detector)([str(p) for p in probe])
    detector.push_to_hub(args["repo_id"], save_base_model=args["save_base_model"])
    Path(args["output"]).write_text(json.dumps({
        "file": hf_gsc.__file__, "class": type(detector).__name__, "threshold": detector.config.threshold,
        "calibration": detector.config.calibration, "ood_score": out.ood_score.tolist(),
        "is_ood": out.is_ood.tolist(), "served": served,
        "state": {name: tensor.tolist() for name, tensor in detector.fitted_state().items()},
    }))
"""

#: Every method, in one other fresh process: load by repo id, score the probe images, and serve them by repo id.
LOAD_SCRIPT = """
    import json, sys
    from pathlib import Path
    import transformers
    from PIL import Image
    import hf_gsc
    from hf_gsc import AutoOODDetector

    args = json.loads(sys.argv[1])
    probe = sorted((Path(args["data"]) / "probe").glob("*.png"))
    seen = {}
    for method, repo_id in args["repos"].items():
        detector = AutoOODDetector.from_pretrained(repo_id)
        inputs = detector.image_processor(images=[Image.open(p).convert("RGB") for p in probe], return_tensors="pt")
        out = detector(**inputs)
        served = transformers.pipeline("ood-image-classification", model=repo_id)([str(p) for p in probe])
        seen[method] = {
            "file": hf_gsc.__file__, "class": type(detector).__name__, "method": detector.method,
            "threshold": detector.config.threshold, "base": detector.config.base_model_name_or_path,
            "hyperparameters": detector.hyperparameters, "ood_score": out.ood_score.tolist(),
            "is_ood": out.is_ood.tolist(), "served": served,
            "state": {name: tensor.tolist() for name, tensor in detector.fitted_state().items()},
        }
    Path(args["output"]).write_text(json.dumps(seen))
"""

#: In a fresh process: each saved detector of an evaluation output folder scores the evaluated splits' images again.
REPRODUCE_SCRIPT = """
    import json, sys
    from pathlib import Path
    import torch
    from safetensors.torch import load_file
    from hf_gsc import AutoOODDetector
    from hf_gsc.data import load_split

    args = json.loads(sys.argv[1])
    run = Path(args["run"])
    results = json.loads((run / "results.json").read_text())
    splits = {name: load_split(spec) for name, spec in args["splits"].items()}
    report = {}
    for method in args["methods"]:
        detector = AutoOODDetector.from_pretrained(run / "detectors" / method)
        assert detector.method == method and detector.config.threshold == results["methods"][method]["threshold"]
        # The saved record is results.json's, plus what the threshold depends on (checked when it loads).
        calibration = results["methods"][method]["calibration"]
        assert {key: detector.config.calibration[key] for key in calibration} == calibration
        assert detector.config.calibration["settings"] == detector.calibration_settings()
        report[method] = {}
        for split, dataset in splits.items():
            saved = load_file(str(run / "scores" / method / f"{split}.safetensors"))
            assert saved["ood_score"].dtype == torch.float64, saved["ood_score"].dtype
            images = [image.convert("RGB") for image in dataset["image"]]
            with torch.no_grad():
                scores = torch.cat([
                    detector.score(detector.image_processor(images=images[i:i + 8], return_tensors="pt")["pixel_values"])
                    for i in range(0, len(images), 8)]).double()
            # Batches of 8 here, 16 in the evaluation: float32 rounding (about 1e-7) only.
            torch.testing.assert_close(scores, saved["ood_score"], rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{method} {split}: {m}")
            assert saved["labels"].tolist() == list(dataset["label"]), (method, split)
            report[method][split] = {"num_samples": len(images),
                                     "max_abs_difference": float((scores - saved["ood_score"]).abs().max())}
    Path(args["output"]).write_text(json.dumps(report))
"""


# ----------------------------------------------------------------------------------------------- fixtures
def _png(array: np.ndarray, path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array.astype(np.uint8)).save(path)


def _class_image(rng: np.random.Generator, label: int) -> np.ndarray:
    """A 20x20 RGB picture of the class: a disc, a square or stripes, in a random colour on a dark background."""
    yy, xx = np.mgrid[:20, :20]
    shape = [(yy - 10) ** 2 + (xx - 10) ** 2 < 36, (abs(yy - 10) < 5) & (abs(xx - 10) < 5), (xx // 3) % 2 == 0][label]
    image = rng.integers(0, 40, (20, 20, 3))
    image[shape] = rng.integers(150, 256, 3)
    return image


def write_data(root: Path) -> Path:
    """``id/{train,validation,test}/{class}/*.png``, ``ood/*.png`` (noise) and ``probe/*.png`` (mixed)."""
    rng = np.random.default_rng(0)
    for split, count in PER_CLASS.items():
        for label, name in enumerate(CLASSES):
            for i in range(count):
                _png(_class_image(rng, label), root / "id" / split / name / f"{i:03d}.png")
    for i in range(NUM_OOD):
        _png(rng.integers(0, 256, (20, 20, 3)), root / "ood" / f"{i:03d}.png")
    for i in range(NUM_PROBE):
        array = _class_image(rng, i % 3) if i < 3 else rng.integers(0, 256, (20, 20, 3))
        _png(array, root / "probe" / f"{i:03d}.png")
    return root


def write_classifier(directory: Path) -> Path:
    """A tiny ViT (float32, 16x16 RGB, the three classes as labels) and its image processor."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=32, num_labels=len(CLASSES),
                       id2label=dict(enumerate(CLASSES)), label2id={name: i for i, name in enumerate(CLASSES)})
    ViTForImageClassification(config).save_pretrained(directory)
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(directory)
    return directory


class Walkthrough:
    def __init__(self, root: Path, hub: LoopbackHub) -> None:
        self.root, self.hub = root, hub
        self.env_dir = install_wheel(root)[0]
        self.python = self.env_dir / "bin" / "python"
        self.command = self.env_dir / "bin" / "hf-gsc"
        self.data = write_data(root / "data")
        self.classifier = write_classifier(root / "classifier")
        self.elsewhere = root / "elsewhere"  # neither the checkout nor the venv: imports come from the wheel
        self.elsewhere.mkdir()
        self.env = {**hub.client_env(hf_home=root / "hf_home", token=hub.token), "OMP_NUM_THREADS": "1",
                    "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        self.env.pop("PYTHONPATH", None)
        self.evaluations: dict[int, Path] = {}

    def python_script(self, script: str, **args) -> dict:
        output = self.root / f"output-{len(list(self.root.glob('output-*')))}.json"
        _run([str(self.python), "-c", textwrap.dedent(script), json.dumps({**args, "output": str(output)}, default=str)],
             self.elsewhere, self.env, TIMEOUT)
        return json.loads(output.read_text())

    def evaluate_argv(self, output_dir: Path) -> list[str]:
        return ["evaluate", "--model", str(self.classifier), "--id-dataset", str(self.data / "id"),
                "--ood-dataset", f"noise={self.data / 'ood'}", "--methods", ",".join(METHODS),
                "--hyperparameter", "knn.k=5", "--hyperparameter", "gsc.mask_ratio=0.1", "--batch-size", "16",
                "--no-plots", "--save-detectors", "--output-dir", str(output_dir)]

    def splits(self) -> dict[str, str]:
        return {"id_test": f"{self.data / 'id'}:test", "id_validation": f"{self.data / 'id'}:validation",
                "ood_noise": str(self.data / "ood")}


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory):
    with LoopbackHub() as hub:
        yield Walkthrough(tmp_path_factory.mktemp("walkthrough"), hub)


@pytest.fixture(scope="module")
def one_process(walkthrough) -> Path:
    output_dir = walkthrough.root / "run-1"
    _run([str(walkthrough.command), *walkthrough.evaluate_argv(output_dir)], walkthrough.elsewhere, walkthrough.env,
         TIMEOUT)
    return output_dir


def _two_processes_unavailable() -> str | None:
    """Why ``accelerate launch --multi_gpu`` on 2 CPU processes cannot run here, or ``None``."""
    if importlib.util.find_spec("accelerate") is None:
        return "accelerate is not installed (pip install 'hf_gsc[evaluation]')"
    import torch.distributed

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        return "this torch build has no torch.distributed gloo backend, which 2 CPU processes need"
    return None


# ------------------------------------------------------------------------------------------------- tests
def test_build_push_then_load_and_serve_in_fresh_processes(walkthrough):
    from huggingface_hub import HfApi

    with walkthrough.hub.patch_client(cache_dir=walkthrough.root / "test-cache", token=walkthrough.hub.token):
        api = HfApi(token=walkthrough.hub.token)
        api.create_repo(BASE_REPO)
        api.upload_folder(repo_id=BASE_REPO, folder_path=str(walkthrough.classifier))

    built = {}
    for method in METHODS:  # a fresh process each
        built[method] = walkthrough.python_script(
            BUILD_SCRIPT, method=method, data=walkthrough.data, repo_id=_repo_id(method),
            classifier=walkthrough.classifier if method in WITH_BASE else BASE_REPO,
            hyperparameters=HYPERPARAMETERS.get(method, {}), save_base_model=method in WITH_BASE)
        assert built[method]["file"].startswith(str(walkthrough.env_dir)), built[method]["file"]
        assert built[method]["calibration"]["num_samples"] == len(CLASSES) * PER_CLASS["validation"]
        assert len(built[method]["ood_score"]) == NUM_PROBE
        assert [entry["method"] for entry in built[method]["served"]] == [method] * NUM_PROBE
        assert built[method]["served"][0]["predictions"][0]["label"] in CLASSES

    loaded = walkthrough.python_script(LOAD_SCRIPT, data=walkthrough.data,
                                       repos={method: _repo_id(method) for method in METHODS})
    for method in METHODS:
        first, second = built[method], loaded[method]
        assert second["file"].startswith(str(walkthrough.env_dir))
        assert second["class"] == first["class"] and second["method"] == method
        assert second["base"] == (_repo_id(method) if method in WITH_BASE else BASE_REPO)
        assert second["hyperparameters"].items() >= HYPERPARAMETERS.get(method, {}).items()
        assert second["threshold"] == first["threshold"]
        assert second["state"] == first["state"], method
        assert bool(first["state"]) == (method in ("knn", "vim", "mahalanobis", "react"))
        assert second["ood_score"] == first["ood_score"], method
        assert second["is_ood"] == first["is_ood"], method
        assert second["served"] == first["served"], method
        # The pipeline's per-image score is the detector's, up to float32 rounding (batches of one against five).
        np.testing.assert_allclose([entry["ood_score"] for entry in second["served"]], first["ood_score"], rtol=1e-4,
                                   atol=1e-5, err_msg=method)


def _score_files(run: Path) -> dict[tuple[str, str], object]:
    from safetensors.torch import load_file

    return {(method, path.stem): load_file(str(path)) for method in METHODS
            for path in sorted((run / "scores" / method).glob("*.safetensors"))}


def _check_saved_detectors(walkthrough, run: Path) -> dict:
    results = json.loads((run / "results.json").read_text())
    assert set(results["methods"]) == set(METHODS)
    assert results["label_check"]["status"] == "match"
    for method in METHODS:
        folder = run / "detectors" / method
        saved = json.loads((folder / "detector_config.json").read_text())
        assert saved["method"] == method and saved["threshold"] == results["methods"][method]["threshold"]
        assert (folder / "README.md").is_file() and (folder / "results.json").is_file()
        # Every one keeps its ID validation scores (p-values); those that fit something, their fitted tensors too.
        state = set(load_file(folder / "detector_state.safetensors"))
        assert "calibration_scores" in state
        assert bool(state - {"calibration_scores"}) == (method in ("knn", "vim", "mahalanobis", "react"))
    report = walkthrough.python_script(REPRODUCE_SCRIPT, run=run, methods=list(METHODS), splits=walkthrough.splits())
    sizes = {"id_test": len(CLASSES) * PER_CLASS["test"], "id_validation": len(CLASSES) * PER_CLASS["validation"],
             "ood_noise": NUM_OOD}
    assert {split: entry["num_samples"] for split, entry in report["gsc"].items()} == sizes
    return report


def test_evaluate_saves_detectors_that_reproduce_the_scores(walkthrough, one_process):
    results = json.loads((one_process / "results.json").read_text())
    assert results["num_processes"] == 1
    assert results["methods"]["knn"]["hyperparameters"]["k"] == 5
    _check_saved_detectors(walkthrough, one_process)


def test_evaluate_on_two_processes_matches_one(walkthrough, one_process):
    reason = _two_processes_unavailable()
    if reason is not None:
        pytest.skip(f"2-process evaluation not run: {reason}")
    output_dir = walkthrough.root / "run-2"
    with socket.socket() as probe:  # a free port: other runs may hold accelerate's default 29500
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # docs/demo.md's recipe (ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 -m hf_gsc evaluate),
    # with the venv's interpreter so that both processes import the installed wheel.
    env = {**walkthrough.env, "ACCELERATE_USE_CPU": "1"}
    _run([str(walkthrough.python), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
          "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no",
          "-m", "hf_gsc", *walkthrough.evaluate_argv(output_dir)], walkthrough.elsewhere, env, TIMEOUT)
    one, two = (json.loads((run / "results.json").read_text()) for run in (one_process, output_dir))
    assert two["num_processes"] == 2
    for method in METHODS:
        assert two["methods"][method]["threshold"] == pytest.approx(one["methods"][method]["threshold"], rel=1e-6)
        for split, metrics in one["methods"][method]["ood"].items():
            assert two["methods"][method]["ood"][split] == pytest.approx(metrics, rel=1e-6, abs=1e-6), (method, split)
    files_one, files_two = _score_files(one_process), _score_files(output_dir)
    # ID test, ID validation, the OOD split and the selection's two generated OOD validation sets
    assert files_one.keys() == files_two.keys() and len(files_one) == len(METHODS) * 5
    assert two["selection"]["method"] == one["selection"]["method"]
    assert all(two["selection"]["validation"][m]["auroc"] == pytest.approx(entry["auroc"], abs=1e-6)
               for m, entry in one["selection"]["validation"].items())
    for key, saved in files_one.items():
        np.testing.assert_allclose(files_two[key]["ood_score"].numpy(), saved["ood_score"].numpy(), rtol=1e-6,
                                   atol=1e-6, err_msg=str(key))
        assert files_two[key]["labels"].tolist() == saved["labels"].tolist(), key
    _check_saved_detectors(walkthrough, output_dir)


@pytest.fixture(scope="module")
def published(walkthrough, one_process) -> str:
    """``hf-gsc publish --detector-dir`` of the knn detector the 1-process evaluation saved; the repo id."""
    usage = _run([str(walkthrough.command), "publish", "--help"], walkthrough.elsewhere, walkthrough.env)
    if "--detector-dir" not in usage:
        pytest.skip("hf-gsc publish has no --detector-dir option in this version")
    # The evaluated classifier is a local folder: its weights go with the detector.
    _run([str(walkthrough.command), "publish", "--detector-dir", str(one_process / "detectors" / "knn"),
          "--repo-id", "user/knn-published", "--save-base-model"], walkthrough.elsewhere, walkthrough.env)
    return "user/knn-published"


def test_publish_a_saved_detector(walkthrough, one_process, published):
    folder = one_process / "detectors" / "knn"
    pulled = walkthrough.python_script(LOAD_SCRIPT, data=walkthrough.data, repos={"knn": published})["knn"]
    local = walkthrough.python_script(LOAD_SCRIPT, data=walkthrough.data, repos={"knn": str(folder)})["knn"]
    assert pulled["base"] == published and pulled["hyperparameters"] == {"bank_dtype": "float32", "bank_fraction": 1.0, "k": 5}
    assert pulled["threshold"] == local["threshold"] and pulled["state"] == local["state"]
    assert pulled["ood_score"] == local["ood_score"] and pulled["is_ood"] == local["is_ood"]
    assert pulled["served"] == local["served"]
    card = walkthrough.hub.read_file(published, "README.md").decode()
    assert f'model="{published}"' in card and "| `k` | `5` |" in card
    assert "## Evaluation" in card and "github.com" not in card
    config = walkthrough.hub.read_file(published, "detector_config.json").decode()
    assert json.loads(config)["base_model_name_or_path"] == published and str(walkthrough.root) not in config
    from hf_gsc.storage.results import public_results

    local = json.loads((one_process / "results.json").read_text())
    pushed = json.loads(walkthrough.hub.read_file(published, "results.json"))
    assert pushed == public_results(local, None)[0] and str(walkthrough.root) not in json.dumps(pushed)


def test_published_card_holds_no_local_path(walkthrough, published):
    card = walkthrough.hub.read_file(published, "README.md").decode()
    assert str(walkthrough.root) not in card, card
