"""Loading like transformers and PEFT: Hub arguments passed through, offline from the cache, attaching a saved
detector to a loaded model, one saved format for every reader; the card and push checks. In-process against the
loopback Hub (``LoopbackHub.patch_client``)."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS, make_tiny_model
from hub_server import LoopbackHub
from huggingface_hub import HfApi, ModelCard
from test_hub import write_results
from transformers import AutoModelForImageClassification

from hf_gsc import GSCConfig, GSCForImageClassification
from hf_gsc.detectors import DETECTORS


@pytest.fixture
def base_dir(tmp_path) -> Path:
    directory = tmp_path / "base-vit"
    make_tiny_model("vit").save_pretrained(directory)
    return directory


def _x() -> torch.Tensor:
    return torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _publish(hub: LoopbackHub, repo_id: str, folder: Path) -> None:
    api = HfApi(token=hub.token)
    api.create_repo(repo_id, exist_ok=True)
    api.upload_folder(repo_id=repo_id, folder_path=str(folder))


def _loads(loader) -> bool:
    try:
        loader()
    except OSError:
        return False
    return True


def test_offline_from_the_cache_exactly_when_transformers_is(base_dir, tmp_path):
    cache = tmp_path / "cache"
    with LoopbackHub() as hub:
        with hub.patch_client(cache_dir=cache, token=hub.token):
            _publish(hub, "user/base-vit", base_dir)
            _publish(hub, "user/other-base", base_dir)
            GSCForImageClassification.from_pretrained("user/base-vit", mask_ratio=0.2).push_to_hub("user/gsc")
            expected = GSCForImageClassification.from_pretrained("user/gsc")(_x()).ood_score
        with hub.patch_client(cache_dir=cache, token=hub.token, offline=True):
            detector = GSCForImageClassification.from_pretrained("user/gsc")
            torch.testing.assert_close(detector(_x()).ood_score, expected, rtol=0, atol=0)
            assert detector.config.mask_ratio == 0.2
            # A repo never downloaded: both fail the same way; one downloaded: both load.
            for repo, cached in (("user/base-vit", True), ("user/other-base", False)):
                assert _loads(lambda: AutoModelForImageClassification.from_pretrained(repo)) is cached
                assert _loads(lambda: GSCForImageClassification.from_pretrained(repo)) is cached


def test_hub_arguments_reach_detector_base_and_processor(base_dir, tmp_path):
    from transformers import ViTImageProcessor

    other_cache = tmp_path / "other-cache"
    v2 = tmp_path / "v2"
    make_tiny_model("vit", seed=1).save_pretrained(v2)
    ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(v2)
    with LoopbackHub() as hub:
        with hub.patch_client(cache_dir=tmp_path / "cache", token=hub.token):
            _publish(hub, "user/base-vit", base_dir)
            api = HfApi(token=hub.token)
            api.create_branch("user/base-vit", branch="v2")
            api.upload_folder(repo_id="user/base-vit", folder_path=str(v2), revision="v2")
            GSCForImageClassification.from_pretrained("user/base-vit", revision="v2").push_to_hub("user/gsc")
            detector = GSCForImageClassification.from_pretrained("user/gsc", cache_dir=other_cache)
            assert {path.name for path in other_cache.glob("models--*")} == {"models--user--gsc", "models--user--base-vit"}
        # The base model and its image processor come from the referenced revision (only v2 has a processor).
        assert detector.config.base_model_revision == "v2"
        expected = make_tiny_model("vit", seed=1).state_dict()
        assert all(torch.equal(value, expected[name]) for name, value in detector.model.state_dict().items())
        assert detector.image_processor is not None
        # local_files_only: served from other_cache with the server gone.
        again = GSCForImageClassification.from_pretrained("user/gsc", cache_dir=other_cache, local_files_only=True)
        assert again.config == detector.config and again.image_processor is not None


def test_attach_a_saved_detector_to_a_loaded_model(base_dir, tmp_path):
    saved = tmp_path / "detector"
    original = GSCForImageClassification.from_pretrained(base_dir, mask_ratio=0.1)
    original.calibrate(_x())
    original.save_pretrained(saved)
    model = AutoModelForImageClassification.from_pretrained(base_dir, dtype=torch.bfloat16)
    shutil.rmtree(base_dir)  # the reference in detector_config.json is not needed
    attached = GSCForImageClassification.from_pretrained(saved, model=model)
    assert attached.model is model and attached.dtype == torch.bfloat16 and attached.config == original.config
    # bf16 rounding of the backbone: close to the float64 scores, not equal.
    torch.testing.assert_close(attached(_x()).ood_score.double(), original(_x()).ood_score, rtol=0, atol=0.05)


def test_push_refuses_a_local_base_and_the_card_names_only_hub_ids(base_dir, tmp_path):
    detector = GSCForImageClassification.from_pretrained(base_dir)
    with pytest.raises(ValueError, match="is not a Hub repo id, so nobody could load 'user/x'. Pass save_base_model=True"):
        detector.push_to_hub("user/x")
    for reference, metadata in (("hf_gsc/reference_models/resnet", None), (str(base_dir), None), ("google/vit", "google/vit")):
        detector.config.base_model_name_or_path = reference
        detector.save_pretrained(tmp_path / "card")
        card = ModelCard.load(tmp_path / "card" / "README.md")
        assert card.data.base_model == metadata
        assert card.data.license == "apache-2.0" and "released under `apache-2.0`" in " ".join(card.text.split())


@pytest.mark.parametrize("mismatch", ["model", "settings"])
def test_results_of_another_evaluation_are_refused(base_dir, tmp_path, mismatch):
    detector = GSCForImageClassification.from_pretrained(base_dir, mask_ratio=0.1)
    model, settings = ("other/model", {"mask_ratio": 0.1}) if mismatch == "model" else (str(base_dir), {"mask_ratio": 0.2})
    results_dir = write_results(tmp_path / "results", model, **settings)
    expected = "evaluated the model 'other/model'" if mismatch == "model" else "mask_ratio: results 0.2 vs detector 0.1"
    with pytest.raises(ValueError, match=expected):
        detector.save_pretrained(tmp_path / "detector", results_dir=results_dir)
    assert not (tmp_path / "detector").exists()  # checked before anything is written


def test_one_saved_format_for_every_reader(base_dir, tmp_path):
    """save_pretrained's folder is read by from_pretrained, AutoOODDetector and the evaluation's --model; the fitted
    tensors come back exactly."""
    from transformers import ViTImageProcessor

    from hf_gsc import AutoOODDetector
    from hf_gsc.evaluation.models import load_model

    ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(base_dir)
    detector = GSCForImageClassification.from_pretrained(base_dir, selection="fisher", operation="perturb")
    detector.fit_fisher([(_x(), torch.arange(3) % NUM_LABELS)])
    detector.save_pretrained(tmp_path / "detector")

    loaded = AutoOODDetector.from_pretrained(tmp_path / "detector", model=make_tiny_model("vit"))
    assert loaded.method == "gsc" and loaded.config.operation == "perturb"
    torch.testing.assert_close(loaded.score(_x()), detector(_x()).ood_score, rtol=0, atol=0)
    torch.testing.assert_close(loaded.fisher_diagonal, detector.fisher_diagonal, rtol=0, atol=0)

    with LoopbackHub() as hub, hub.patch_client(cache_dir=tmp_path / "cache", token=hub.token):
        _publish(hub, "user/gsc-fisher", tmp_path / "detector")
        model, processor, saved, source = load_model("user/gsc-fisher")
    assert saved == {"gsc": {name: getattr(detector.config, name) for name in GSCConfig.score_names()}}
    assert source == str(base_dir)


def test_one_list_of_fields_drives_cli_cache_card_and_variants():
    from hf_gsc.analysis.ablations import Variant
    from hf_gsc.evaluation.arguments import METHOD_FLAGS, EvaluationArgumentParser

    settings = GSCConfig.setting_names()
    assert set(METHOD_FLAGS) == {"gsc"}  # gsc_ash, a GSC subclass, is set with --hyperparameter
    assert set(METHOD_FLAGS["gsc"].values()) == set(settings)
    flags = {action.dest for action in EvaluationArgumentParser()._actions}
    assert set(METHOD_FLAGS["gsc"]) <= flags
    assert set(DETECTORS["gsc_ash"].config_class.setting_names()) == set(settings)  # GSC + ASH: GSC's settings
    assert [f.name for f in dataclasses.fields(Variant)] == ["kind", *settings, "steps"]
    assert set(GSCConfig.score_names()) == set(settings) | {"gradient_mass"}
    assert GSCConfig.names("setting", "fitted", "provenance") == tuple(f.name for f in dataclasses.fields(GSCConfig))
    assert set(GSCConfig.names("provenance")) == {"base_model_name_or_path", "base_model_revision", "hf_gsc_version"}
