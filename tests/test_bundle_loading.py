"""Saved detectors in one bundle: loaded on their own they wrap two copies of the base model, and the bundle's error
names the fix (``from_pretrained(folder, model=model)``); loaded that way they share one pass. The bundle's output
names its scores ``ood_score``, as every detector's output does."""

from __future__ import annotations

import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS, make_tiny_model
from transformers import AutoModelForImageClassification

from hf_gsc import AutoOODDetector, DetectorBundle


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bundle")
    model = make_tiny_model("vit").float()
    images = torch.randn(64, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    knn = AutoOODDetector.from_pretrained(model, method="knn")
    knn.fit([(images, torch.arange(64) % NUM_LABELS)])
    knn.calibrate(images)
    knn.save_pretrained(folder / "knn", save_base_model=True)
    AutoOODDetector.from_pretrained(model, method="energy").save_pretrained(folder / "energy", save_base_model=True)
    return folder, images


def test_separately_loaded_detectors_are_refused_naming_the_fix(saved):
    folder, _ = saved
    knn = AutoOODDetector.from_pretrained(folder / "knn")
    energy = AutoOODDetector.from_pretrained(folder / "energy")
    with pytest.raises(ValueError, match=r"same base model object.*from_pretrained\(folder_or_repo_id, model=model\)"):
        DetectorBundle([knn, energy])


def test_detectors_loaded_on_one_model_share_a_bundle(saved):
    folder, images = saved
    model = AutoModelForImageClassification.from_pretrained(folder / "knn")
    knn = AutoOODDetector.from_pretrained(folder / "knn", model=model)
    energy = AutoOODDetector.from_pretrained(folder / "energy", model=model)
    output = DetectorBundle([knn, energy])(images[:4])
    assert set(output.keys()) == {"logits", "ood_score", "is_ood"}
    for detector in (knn, energy):
        alone = detector(images[:4])
        assert torch.equal(output.ood_score[detector.method], alone.ood_score)
    assert output.is_ood["energy"] is None and output.is_ood["knn"].dtype == torch.bool
    with pytest.warns(FutureWarning, match="ood_scores is now ood_score"):
        assert output.ood_scores is output.ood_score
