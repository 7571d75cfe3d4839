"""What docs/saved_format.md ("Pickling") says: a detector pickles and copies whole, ``torch.load`` refuses the
pickle by default, and ``save_pretrained`` writes no pickle."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc import AutoOODDetector, GSCForImageClassification


def test_a_detector_pickles_whole_and_torch_load_refuses_the_pickle_by_default(tmp_path):
    x = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1))
    gsc = GSCForImageClassification(make_tiny_model("resnet").float(), mask_ratio=0.2)
    gsc.calibrate(torch.randn(40, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)))
    knn = AutoOODDetector.from_pretrained(make_tiny_model("resnet").float(), method="knn", k=1)
    knn.fit(torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(2)))
    for detector in (gsc, knn):
        for copied in (pickle.loads(pickle.dumps(detector)), copy.deepcopy(detector)):
            assert torch.equal(copied(x).ood_score, detector(x).ood_score)
            assert copied.config == detector.config
    assert torch.equal(pickle.loads(pickle.dumps(gsc)).calibration_scores, gsc.calibration_scores)
    buffer = io.BytesIO()
    torch.save(gsc, buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False)(x).ood_score, gsc(x).ood_score)
    gsc.save_pretrained(tmp_path / "saved", save_base_model=True)
    assert {path.suffix for path in (tmp_path / "saved").iterdir()} <= {".json", ".safetensors", ".md"}
