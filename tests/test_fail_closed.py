"""Fail closed: links in folders hf_gsc reads or writes, oversized images, inconsistent score files, non-finite scores.

Every test plants what someone else could control (a link, a header, a file with a valid fingerprint) and checks
that hf_gsc refuses it or recomputes, and that nothing outside the folder is read or written.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, evaluate_argv, make_tiny_model
from PIL import Image, ImageFile
from safetensors.torch import load_file, save_file
from test_evaluation import tiny  # noqa: F401  (module fixture: tiny ViT, ID and OOD datasets on disk)

from hf_gsc import GSCForImageClassification
from hf_gsc.cli import publish
from hf_gsc.data.decoding import UndecodableImageError, decode_image
from hf_gsc.evaluation import loop, options, score_cache, validation
from hf_gsc.evaluation.arguments import parse_arguments
from hf_gsc.evaluation.metrics import NonFiniteScoreError
from hf_gsc.evaluation.report import method_results, write_report
from hf_gsc.storage.results import read_results
from hf_gsc.utils import confined_files
from hf_gsc.utils.image_limits import (
    DEFAULT_MAX_IMAGE_PIXELS,
    MAX_IMAGE_PIXELS_ENV,
    ImageTooLargeError,
    max_image_pixels,
)


SECRET = "secret outside the folder\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file outside every folder under test, whose content must neither leak nor change."""
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def _results_dir(directory: Path, model: str = "base") -> Path:
    (directory / "plots").mkdir(parents=True)
    results = {"model": model, "benchmark": "fmnist-ood", "id_accuracy": 0.9,
               "methods": {"gsc": {"threshold": 1.0, "hyperparameters": {}, "ood": {}, "average": {}}}}
    (directory / "results.json").write_text(json.dumps(results))
    (directory / "results.md").write_text("| method |\n|---|\n| gsc |\n")
    (directory / "plots" / "roc.png").write_bytes(b"\x89PNG fake")
    return directory


@pytest.fixture
def base_dir(tmp_path) -> Path:
    directory = tmp_path / "base-vit"
    make_tiny_model("vit").float().save_pretrained(directory)
    return directory


# ----------------------------------------------------------------------------- 1. reads do not follow links out
@pytest.mark.parametrize("linked", ["results.md", "results.json", "plots/roc.png"])
def test_reading_results_refuses_a_link_leading_outside(tmp_path, outside, linked):
    results = _results_dir(tmp_path / "results")
    (results / linked).unlink()
    (results / linked).symlink_to(outside)
    with pytest.raises(confined_files.LinkError, match=f"{results / linked}.*symbolic link to {outside}"):
        read_results(results)


def test_links_that_stay_inside_the_folder_are_read(tmp_path):
    results = _results_dir(tmp_path / "results")
    (results / "plots" / "copy.png").symlink_to(results / "plots" / "roc.png")
    _, table, plots = read_results(results)
    assert table.startswith("| method |")
    assert plots == [Path("plots/copy.png"), Path("plots/roc.png")]


def test_a_linked_folder_is_not_descended(tmp_path, outside):
    results = _results_dir(tmp_path / "results")
    (outside.parent / "private.png").write_bytes(b"\x89PNG private")
    (results / "plots" / "more").symlink_to(outside.parent, target_is_directory=True)
    assert read_results(results)[2] == [Path("plots/roc.png")]


def test_publish_names_the_link_and_uploads_nothing(tmp_path, outside, capsys):
    results = _results_dir(tmp_path / "results")
    (results / "results.md").unlink()
    (results / "results.md").symlink_to(outside)
    # The refusal comes before any Hub call: the endpoint is never contacted.
    assert publish(["--results-dir", str(results), "--repo-id", "user/leak"]) == 1
    error = capsys.readouterr().err
    assert f"{results / 'results.md'} is a symbolic link to {outside}" in error
    assert SECRET.strip() not in error


def test_push_to_hub_refuses_a_results_folder_linking_outside(base_dir, tmp_path, outside):
    results = _results_dir(tmp_path / "results", model=str(base_dir))
    (results / "plots" / "roc.png").unlink()
    (results / "plots" / "roc.png").symlink_to(outside)
    detector = GSCForImageClassification.from_pretrained(base_dir)
    with pytest.raises(confined_files.LinkError, match="roc.png is a symbolic link"):
        detector.push_to_hub("user/leak", save_base_model=True, results_dir=results)
    with pytest.raises(confined_files.LinkError, match="roc.png is a symbolic link"):
        detector.save_pretrained(tmp_path / "saved", results_dir=results)


# ----------------------------------------------------------------------------- 3. oversized images
def _png(size: tuple[int, int], mode: str = "L") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def bomb_png(tmp_path_factory) -> Path:
    """A 10,000 x 10,000 PNG (100 Mpx, between PIL's warning and its hard limit) of a few kB."""
    path = tmp_path_factory.mktemp("bomb") / "bomb.png"
    path.write_bytes(_png((10_000, 10_000), mode="1"))
    assert path.stat().st_size < 100_000
    return path


@pytest.fixture
def no_decoding(monkeypatch):
    """Any decoding of pixels fails the test: the size must be judged from the header alone."""

    def load(self, *args, **kwargs):
        raise AssertionError(f"the pixels of a {self.size} image were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)


def test_default_limit_is_pils_warning_threshold():
    assert DEFAULT_MAX_IMAGE_PIXELS == 89_478_485 == max_image_pixels()


def test_evaluation_refuses_an_oversized_image_from_its_header(bomb_png, no_decoding):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(UndecodableImageError, match=rf"row 7.*10000 x 10000 = 100,000,000 pixels exceeds the "
                                                         rf"limit of 89,478,485 pixels.*{MAX_IMAGE_PIXELS_ENV}"):
            decode_image({"bytes": bomb_png.read_bytes(), "path": None}, "bombs", 7)
        assert decode_image(str(bomb_png), "bombs", 7, on_error="skip") is None


def test_the_limit_is_raised_and_lowered_by_its_environment_variable(monkeypatch):
    value = {"bytes": _png((100, 100)), "path": None}
    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, "9999")
    with pytest.raises(UndecodableImageError, match="limit of 9,999 pixels"):
        decode_image(value, "small", 0)
    with pytest.raises(UndecodableImageError, match="limit of 9,999 pixels"):
        decode_image(Image.new("L", (100, 100)), "small", 0)  # an image given already open is held to it too
    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, "10000")
    assert decode_image(value, "small", 0).size == (100, 100)


@pytest.mark.parametrize("text", ["many", "0", "-5"])
def test_a_bad_limit_is_an_error_not_a_skipped_image(monkeypatch, text):
    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, text)
    with pytest.raises(ValueError, match=f"{MAX_IMAGE_PIXELS_ENV} must be a positive integer"):
        decode_image({"bytes": _png((4, 4)), "path": None}, "small", 0, on_error="skip")
    with pytest.raises(options.InputError, match=MAX_IMAGE_PIXELS_ENV):
        parse_arguments(["--model", "m", "--benchmark", "fmnist-ood", "--output-dir", "o"])


@pytest.fixture
def served(tmp_path):
    from transformers import ViTImageProcessor, pipeline

    base = tmp_path / "served"
    make_tiny_model("vit").float().save_pretrained(base)
    ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(base)
    GSCForImageClassification.from_pretrained(base).save_pretrained(tmp_path / "detector")
    return pipeline("ood-image-classification", model=str(tmp_path / "detector"))


def test_pipeline_refuses_an_oversized_image_before_decoding(served, bomb_png, no_decoding):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with pytest.raises(ImageTooLargeError, match=f"100,000,000 pixels exceeds.*{MAX_IMAGE_PIXELS_ENV}"):
            served(str(bomb_png))


def test_pipeline_limit_follows_the_environment_variable(served, tmp_path, monkeypatch):
    path = tmp_path / "image.png"
    path.write_bytes(_png((60, 50), mode="RGB"))
    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, "2999")
    for image in (str(path), Image.open(path)):
        with pytest.raises(ImageTooLargeError, match="60 x 50 = 3,000 pixels exceeds the limit of 2,999"):
            served(image)
    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, "3000")
    assert isinstance(served(str(path))["ood_score"], float)


# ----------------------------------------------------------------------------- 4. score files checked before use
def _argv(tiny, output_dir: Path) -> list[str]:  # noqa: F811
    return ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"noise={tiny['noise']}",
            "--methods", "msp,energy", "--output-dir", str(output_dir), "--batch-size", "8", "--no-plots"]


@pytest.fixture(scope="module")
def evaluated(tiny, tmp_path_factory) -> tuple[Path, dict]:  # noqa: F811
    output_dir = tmp_path_factory.mktemp("evaluated")
    return output_dir, evaluate_argv(_argv(tiny, output_dir))


def _forge(path: Path, **changes) -> None:
    """Rewrite a score file with its own fingerprint but other tensors (``None`` removes a key)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = {**load_file(str(path)), **changes}
    save_file({k: v for k, v in tensors.items() if v is not None}, str(path), metadata)


FORGERIES = {
    "fewer rows": lambda t: {"ood_score": t["ood_score"][:3], "labels": t["labels"][:3]},
    "rows and labels disagree": lambda t: {"ood_score": t["ood_score"][:3]},
    "NaN score": lambda t: {"ood_score": t["ood_score"].clone().index_fill_(0, torch.tensor([0]), float("nan"))},
    "float32 scores": lambda t: {"ood_score": t["ood_score"].float()},
    "missing labels": lambda t: {"labels": None},
    "extra key": lambda t: {"extra": torch.zeros(1)},
    "negative skipped count": lambda t: {"num_skipped": torch.tensor(-1)},
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_score_file_that_does_not_fit_its_split_is_computed_again(
    tiny, evaluated, tmp_path, monkeypatch, caplog, forgery  # noqa: F811
):
    output_dir = tmp_path / "run"
    shutil.copytree(evaluated[0], output_dir)
    path = output_dir / "scores" / "msp" / "ood_noise.safetensors"
    _forge(path, **FORGERIES[forgery](load_file(str(path))))
    scored = []
    real = loop.score_split
    monkeypatch.setattr(loop, "score_split", lambda *a, **k: scored.append(k["description"]) or real(*a, **k))
    with caplog.at_level(logging.WARNING, logger="hf_gsc.evaluation.loop"):
        results = evaluate_argv(_argv(tiny, output_dir))
    assert [d.split(" ")[0] for d in scored] == ["ood_noise"]
    assert f"ignoring score file {path}, its fingerprint matches but" in caplog.text
    assert results["split_sizes"]["ood"]["noise"] == 11
    assert results["methods"]["msp"]["ood"] == evaluated[1]["methods"]["msp"]["ood"]
    assert load_file(str(path))["ood_score"].shape == (11,)


def test_a_valid_score_file_is_reused_with_its_row_count(evaluated):
    cache = score_cache.ScoreCache(evaluated[0])
    from hf_gsc.evaluation.score_cache import score_file_problem

    tensors = load_file(str(cache.path("msp", "ood_noise")))
    assert score_file_problem("msp", tensors, 11) is None
    assert "the split has 12 images" in score_file_problem("msp", tensors, 12)
    assert score_file_problem("msp", tensors, None) is None  # a streamed split: size unknown


# ----------------------------------------------------------------------------- non-finite scores in the evaluation
def test_method_results_refuse_non_finite_scores_naming_method_and_split():
    good = np.linspace(0.0, 1.0, 20)
    bad = good.copy()
    bad[[2, 5]] = [np.nan, np.inf]
    with pytest.raises(NonFiniteScoreError, match=r"method 'odin' gave 2 non-finite ood_score value\(s\).*"
                                                  r"of 20 on split 'ood_noise'"):
        method_results(good, good, {"mnist": good, "noise": bad}, method="odin")


def test_evaluation_skips_a_method_with_non_finite_scores_without_caching_them(tiny, tmp_path, monkeypatch):  # noqa: F811
    from hf_gsc.detectors.msp import MSPDetector

    real = MSPDetector.score_batch

    def nan_score(self, batch):
        scores = real(self, batch).clone()
        scores[0] = float("nan")
        return scores

    monkeypatch.setattr(MSPDetector, "score_batch", nan_score)
    results = evaluate_argv(_argv(tiny, tmp_path / "nan"))
    assert re.match(r"method 'msp' gave \d+ non-finite .* on split 'id_test'", results["skipped"]["msp"])
    assert "msp" not in results["methods"] and results["methods"]  # the others are reported
    assert not (tmp_path / "nan" / "scores" / "msp" / "id_test.safetensors").exists()


# ----------------------------------------------------------------------------- 5. writes do not go through links
def _plant(path: Path, target: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def test_save_pretrained_replaces_planted_links_instead_of_writing_through_them(base_dir, tmp_path, outside):
    saved = tmp_path / "saved"
    names = ["detector_config.json", "README.md", "config.json", "model.safetensors", "preprocessor_config.json"]
    for name in names:
        _plant(saved / name, outside)
    detector = GSCForImageClassification.from_pretrained(base_dir)
    detector.save_pretrained(saved, save_base_model=True)
    assert outside.read_text() == SECRET
    for name in names[:4]:
        assert (saved / name).is_file() and not (saved / name).is_symlink(), name
    assert GSCForImageClassification.from_pretrained(saved).config.split_point == detector.config.split_point
    assert not [p for p in saved.iterdir() if p.name.startswith(".")]  # no staging folder or temporary file left


def test_saved_fit_state_is_not_written_through_links(tmp_path, outside):
    from hf_gsc.detectors import get_detector

    detector = get_detector("msp", make_tiny_model("vit").float())
    folder = tmp_path / "fit"
    for name in ("detector_config.json", "detector_state.safetensors"):
        _plant(folder / name, outside)
    detector.save_pretrained(folder)
    assert outside.read_text() == SECRET
    assert json.loads((folder / "detector_config.json").read_text())["method"] == "msp"
    assert not (folder / "detector_state.safetensors").is_symlink()


def test_report_replaces_links_and_ignores_links_at_temporary_names(tmp_path, outside):
    output_dir = tmp_path / "out"
    _plant(output_dir / "results.md", outside)
    # The old writer's temporary name was predictable: a link planted there was written through.
    _plant(output_dir / f".results.json.{os.getpid()}.tmp", outside)
    results = {"model": "m", "benchmark": "b", "id_accuracy": 1.0, "methods": {}}
    write_report(output_dir, results)
    assert outside.read_text() == SECRET
    assert json.loads((output_dir / "results.json").read_text())["model"] == "m"
    assert not (output_dir / "results.json").is_symlink() and not (output_dir / "results.md").is_symlink()
    umask = os.umask(0)
    os.umask(umask)
    assert (output_dir / "results.json").stat().st_mode & 0o777 == 0o666 & ~umask  # as open(path, "w") makes it


def test_plots_and_scores_refuse_a_linked_folder_leading_outside(tmp_path, outside):
    from hf_gsc.evaluation.plots import write_plots

    output_dir = tmp_path / "out"
    output_dir.mkdir()
    (output_dir / "plots").symlink_to(outside.parent, target_is_directory=True)
    scores = torch.linspace(0, 1, 10, dtype=torch.float64)
    results = {"methods": {"msp": {"threshold": 0.5, "ood": {"noise": {"auroc": 0.5}}}}}
    with pytest.raises(confined_files.LinkError, match=f"{output_dir / 'plots'} is a symbolic link"):
        write_plots(output_dir, {"msp": scores}, {"msp": {"noise": scores}}, results)
    (output_dir / "scores").symlink_to(outside.parent, target_is_directory=True)
    with pytest.raises(confined_files.LinkError, match=f"{output_dir / 'scores'} is a symbolic link"):
        score_cache.ScoreCache(output_dir).save("msp", "id_test", {"ood_score": scores}, "fp")
    assert sorted(p.name for p in outside.parent.iterdir()) == ["secret.txt"]


def test_fit_json_and_score_files_replace_planted_links(tmp_path, outside):
    output_dir = tmp_path / "out"
    path = score_cache.ScoreCache(output_dir).path("msp", "id_test")
    _plant(path, outside)
    score_cache.ScoreCache(output_dir).save("msp", "id_test", {"ood_score": torch.zeros(3, dtype=torch.float64)}, "fp")
    assert outside.read_text() == SECRET and not path.is_symlink()


def test_output_dir_probe_does_not_write_through_a_planted_link(tmp_path, outside):
    output_dir = tmp_path / "out"
    _plant(output_dir / f".write_test.{os.getpid()}.0", outside)
    validation.check_output_dir(output_dir)
    assert outside.read_text() == SECRET


def test_outputs_land_under_a_relative_output_dir(tiny, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    argv = _argv(tiny, Path("run"))
    argv[argv.index("--methods") + 1] = "react"  # fits: detectors/react/ is written too
    evaluate_argv(argv)
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["run/.hf_gsc_run.json",  # the marker by which a later run knows the folder as a run
                       "run/detectors/react/detector_state.safetensors",
                       "run/detectors/react/fit.json", "run/p_values/react.safetensors", "run/results.json",
                       "run/results.md",
                       *(f"run/scores/{m}/{s}.safetensors" for m in ("_base_model",) for s in ("id_test",)),
                       *(f"run/scores/react/{s}.safetensors" for s in ("id_test", "id_validation", "ood_noise",
                                                                         "val_ood_val_jigsaw", "val_ood_val_noise")),
                       "run/scores/timings.json"]
    assert not (tmp_path / "run" / "run").exists()  # folders are created under the output dir, not under it twice


def test_calibrating_from_an_oversized_image_file_is_refused_before_decoding(tmp_path, monkeypatch):
    """Images given to calibrate / fit by path go through the same pixel limit as the pipeline and the evaluation."""
    from transformers import ViTImageProcessor

    monkeypatch.setenv(MAX_IMAGE_PIXELS_ENV, "100")
    path = tmp_path / "big.png"
    Image.new("RGB", (20, 20)).save(path)
    detector = GSCForImageClassification(make_tiny_model("vit").float())
    detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    with pytest.raises(ImageTooLargeError, match="400 pixels exceeds the limit of 100"):
        detector.calibrate([str(path)])
