"""Hyperparameter selection on validation only (``hf-gsc evaluate --tune``, :mod:`hf_gsc.evaluation.tuning`).

The search must never read the ID test split or an OOD split, must pick the grid point the rule says, and the
evaluation must then run with the chosen values; without ``--tune`` nothing changes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import evaluate_argv
from PIL import Image
from test_evaluation import _argv, tiny  # noqa: F401  (the tiny model and data fixture)
from test_variants import NoTestSplits

from hf_gsc.evaluation import loaders, options, ranking, tuning, validation_sets
from hf_gsc.evaluation.arguments import parse_arguments


#: A small grid for the tiny runs, none of whose values is a default, so that "the chosen values are used" can fail.
TEST_GRIDS = {"msp": {"temperature": (3.0, 7.0)}, "react": {"percentile": (80.0, 97.0)},
              "gsc": {"mask_ratio": (0.1, 0.2)}, "knn": {"k": (2, 4)}, "dice": {"sparsity": (50.0, 70.0)}}
#: The tiny runs' methods plus DICE, fitted on ID train (knn's k is fixed by the tiny runs' --hyperparameter).
TUNED_METHODS = ("--methods", "gsc,msp,energy,react,knn,dice")


# ------------------------------------------------------------------------------------------------- pure parts
def test_best_grid_point_highest_auroc_then_fpr_then_order() -> None:
    assert ranking.best_index([{"auroc": 0.7, "fpr95": 0.2}, {"auroc": 0.9, "fpr95": 0.9},
                                {"auroc": 0.8, "fpr95": 0.1}]) == 1
    assert ranking.best_index([{"auroc": 0.9, "fpr95": 0.5}, {"auroc": 0.9, "fpr95": 0.3}]) == 1  # tie: lower FPR95
    assert ranking.best_index([{"auroc": 0.9, "fpr95": 0.3}, {"auroc": 0.9, "fpr95": 0.3}]) == 0  # tie: grid order
    assert ranking.best_index([None, {"auroc": 0.1, "fpr95": 1.0}]) == 1  # unusable points are never chosen
    assert ranking.best_index([None, None]) is None


def test_grid_points_product_and_fixed_names() -> None:
    grids = {"odin": {"temperature": (1.0, 10.0), "epsilon": (0.0, 0.1)}}
    assert tuning.grid_points("odin", grids=grids) == [
        {"temperature": 1.0, "epsilon": 0.0}, {"temperature": 1.0, "epsilon": 0.1},
        {"temperature": 10.0, "epsilon": 0.0}, {"temperature": 10.0, "epsilon": 0.1}]
    assert tuning.grid_points("odin", fixed=["temperature"], grids=grids) == [{"epsilon": 0.0}, {"epsilon": 0.1}]
    assert tuning.grid_points("odin", fixed=["temperature", "epsilon"], grids=grids) == []
    assert tuning.grid_points("max_logit") == []
    from hf_gsc.detectors import DETECTORS

    for method in DETECTORS:  # every registered method has a grid or a stated reason
        cls = DETECTORS[method]
        assert cls.search_space_source, method  # a grid's source, or why there is none
        assert set(cls.search_space) <= set(cls.defaults if hasattr(cls, "defaults") else cls.config_class.setting_names()), method
    assert set(tuning.search_spaces()) == {m for m, cls in DETECTORS.items() if cls.search_space}


def test_generated_images_jigsaw_and_noise() -> None:
    import datasets

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (18, 17, 3), dtype=np.uint8), rng.integers(0, 256, (16, 16), dtype=np.uint8)]
    source = datasets.Dataset.from_dict({"image": [Image.fromarray(a) for a in arrays], "label": [0, 1]},
                                        features=datasets.Features({"image": datasets.Image(),
                                                                    "label": datasets.Value("int64")}))
    jigsaw = validation_sets.GeneratedImages(source, "jigsaw")
    noise = validation_sets.GeneratedImages(source, "noise")
    assert len(jigsaw) == len(noise) == 2
    batch = jigsaw[[0, 1]]
    assert batch["label"] == [-1, -1]
    for array, image in zip(arrays, batch["image"]):
        cropped = array[:16, :16]  # 4x4 patches of 4x4 pixels
        shuffled = np.asarray(image)
        assert shuffled.shape == cropped.shape and not np.array_equal(shuffled, cropped)
        def patches(a):
            return sorted(a[i:i + 4, j:j + 4].tobytes() for i in range(0, 16, 4) for j in range(0, 16, 4))
        assert patches(shuffled) == patches(cropped)  # the same patches, moved
    # An image depends on its row and the seed only, not on the batch it is read in.
    assert np.array_equal(np.asarray(jigsaw[1]["image"][0]), np.asarray(batch["image"][1]))
    made = noise[[0, 1]]["image"]
    assert [(im.mode, im.size) for im in made] == [("RGB", (17, 18)), ("L", (16, 16))]
    assert np.array_equal(np.asarray(noise[[0]]["image"][0]), np.asarray(made[0]))
    other = validation_sets.GeneratedImages(source, "noise", seed=validation_sets.VALIDATION_SEED + 1)
    assert not np.array_equal(np.asarray(other[[0]]["image"][0]), np.asarray(made[0]))


def test_split_halves_disjoint_and_seeded() -> None:
    fit, select = validation_sets.split_halves(13, seed=0)
    assert len(fit) == 6 and len(select) == 7 and sorted(fit + select) == list(range(13))
    assert validation_sets.split_halves(13, seed=0) == (fit, select)
    assert validation_sets.split_halves(13, seed=1) != (fit, select)


def test_tune_with_streaming_is_refused(tiny, tmp_path) -> None:
    with pytest.raises(options.InputError, match="--tune"):
        parse_arguments(_argv(tiny, tmp_path, "--tune", "--streaming"))


# ----------------------------------------------------------------------------------------------- whole runs
def _raw_images(dataset) -> set[bytes]:
    """The encoded bytes of every image of a dataset (of its source, for a generated set)."""
    from hf_gsc.data.decoding import without_decoding

    if isinstance(dataset, validation_sets.GeneratedImages):
        dataset = dataset.source
    return {value["bytes"] for value in without_decoding(dataset)["image"]}


@pytest.fixture(scope="module")
def tuned_run(tiny, tmp_path_factory):
    """One ``--tune`` run on the tiny data with :data:`TEST_GRIDS`, recording what the search read."""
    output_dir = tmp_path_factory.mktemp("tuned")
    seen = {"splits": None, "datasets": []}
    search = tuning.tune_hyperparameters
    make_dataloader = loaders.make_dataloader

    def spy_search(context, model, hyperparameters, fixed, id_splits, *args, **kwargs):
        seen["splits"] = NoTestSplits(id_splits)
        seen["fixed"] = fixed
        return search(context, model, hyperparameters, fixed, seen["splits"], *args, **kwargs)

    def spy_loader(dataset, *args, **kwargs):
        seen["datasets"].append(dataset)
        return make_dataloader(dataset, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tuning, "search_spaces", lambda: TEST_GRIDS)
        patch.setattr(tuning, "tune_hyperparameters", spy_search)
        patch.setattr(loaders, "make_dataloader", spy_loader)  # the search imports it from loaders when it runs
        results = evaluate_argv(_argv(tiny, output_dir, "--tune", *TUNED_METHODS))
    return output_dir, results, seen


def test_search_reads_validation_and_train_only(tuned_run, tiny) -> None:
    import datasets

    _, _, seen = tuned_run
    assert seen["splits"].read == {"validation", "train"}  # train: DICE's fit data; never test
    ids = datasets.load_from_disk(tiny["id"])
    forbidden = _raw_images(ids["test"]) | _raw_images(datasets.load_from_disk(tiny["noise"])) \
        | _raw_images(datasets.load_from_disk(tiny["flat"]))
    allowed = _raw_images(ids["validation"]) | _raw_images(ids["train"])
    assert seen["datasets"], "the search loaded no data through the evaluation's loader"
    kinds = set()
    for dataset in seen["datasets"]:
        images = _raw_images(dataset)
        assert images and images <= allowed and not images & forbidden
        kinds.add(type(dataset).__name__)
    assert "GeneratedImages" in kinds  # the OOD side is generated from ID validation
    validation = _raw_images(ids["validation"])
    read_validation = [_raw_images(d) for d in seen["datasets"] if _raw_images(d) <= validation]
    # tune_fit (react's fit, the generated sets' source) and tune_select are disjoint halves of ID validation
    halves = {frozenset(images) for images in read_validation}
    assert len(halves) == 2 and not set.intersection(*map(set, halves))
    assert set.union(*map(set, halves)) == validation


def test_chosen_values_are_recorded_and_used(tuned_run) -> None:
    output_dir, results, seen = tuned_run
    record = results["tuning"]
    assert record["seconds"] > 0 and record["num_grid_points"] == 8
    assert record["num_samples"]["tune_fit"] + record["num_samples"]["tune_select"] == results["split_sizes"]["id_validation"]
    assert set(record["num_samples"]["ood"]) == {"val_noise", "val_jigsaw"}
    assert set(record["methods"]) == {"msp", "react", "gsc", "dice"}
    assert record["num_samples"]["fit"] == {"tune_fit": record["num_samples"]["tune_fit"], "train": 23}
    assert record["not_tuned"] == {"knn": "fixed by the command line (k)", "energy": "no grid defined"}
    for method, entry in record["methods"].items():
        metrics = [None if "error" in point else point for point in entry["grid"]]
        best = entry["grid"][ranking.best_index(metrics)]
        assert entry["chosen"] == best["hyperparameters"]  # the rule's choice
        for point in entry["grid"]:
            assert 0 <= point["auroc"] <= 1 and set(point["ood"]) == {"val_noise", "val_jigsaw"}
            assert point["auroc"] == pytest.approx(np.mean([m["auroc"] for m in point["ood"].values()]))
        used = results["methods"][method]["hyperparameters"]
        assert {name: used[name] for name in entry["chosen"]} == entry["chosen"]  # evaluated with the chosen values
    assert results["methods"]["knn"]["hyperparameters"]["k"] == 3  # --hyperparameter knn.k=3 wins
    assert results["methods"]["energy"]["hyperparameters"]["temperature"] == 1.0
    assert results["config"]["tune"] is True
    text = (output_dir / "results.md").read_text()
    assert "Hyperparameters chosen on validation only" in text
    assert f"temperature={record['methods']['msp']['chosen']['temperature']}" in text


def test_the_grid_is_fitted_once_by_fit_detectors_and_kept_for_a_rerun(tuned_run) -> None:
    """The grid points are fitted like the evaluation's own detectors (``fitting.fit_detectors``: on the main process,
    the others load the fit), each kept with its fingerprint under ``OUTPUT/tuning/detectors/METHOD[i]/``."""
    output_dir, results, _ = tuned_run
    fits = {path.parent.name: json.loads(path.read_text()) for path in
            (output_dir / tuning.TUNING_FITS / "detectors").glob("*/fit.json")}
    assert {name.split("[")[0] for name in fits} == {"react", "dice"}  # the grid's methods fitted on ID data
    sizes = results["tuning"]["num_samples"]["fit"]
    assert {fit["num_samples"] for name, fit in fits.items() if name.startswith("react")} == {sizes["tune_fit"]}
    assert {fit["num_samples"] for name, fit in fits.items() if name.startswith("dice")} == {sizes["train"]}
    assert len({fit["fingerprint"] for fit in fits.values()}) == len(fits)


def test_without_tune_nothing_changes(tiny, tmp_path, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the search ran without --tune")

    monkeypatch.setattr(tuning, "tune_hyperparameters", refuse)
    results = evaluate_argv(_argv(tiny, tmp_path))
    assert "tuning" not in results and results["config"]["tune"] is False
    assert results["methods"]["msp"]["hyperparameters"]["temperature"] == 1.0
    assert results["methods"]["gsc"]["hyperparameters"]["mask_ratio"] == 0.05
    assert "chosen on validation" not in (tmp_path / "results.md").read_text()


def test_two_processes_choose_as_one(tiny, tmp_path) -> None:
    """Under ``accelerate launch`` (2 CPU processes, sharded scoring) the search measures and chooses as one process."""
    import json

    from test_evaluation import _assert_close, _launch_two_processes

    one = evaluate_argv(_argv(tiny, tmp_path / "one", "--tune"))
    result = _launch_two_processes(tmp_path, _argv(tiny, tmp_path / "two", "--tune"), streaming=False)
    assert result.returncode == 0, result.stderr[-4000:]
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["num_processes"] == 2
    def strip(record):
        return {key: value for key, value in record.items() if key != "seconds"}
    _assert_close(strip(two["tuning"]), strip(one["tuning"]))
    for method, entry in two["tuning"]["methods"].items():
        assert {k: two["methods"][method]["hyperparameters"][k] for k in entry["chosen"]} == entry["chosen"]
    assert result.stdout.count("tuning:") == 1  # printed by the main process only
