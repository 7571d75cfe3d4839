"""Every fitted tensor of every registered method is checked at load against the shape this model needs (the
per-method WRONG_SHAPES table of test_detector_round_trip covers one tensor of the first methods; this covers every
tensor of every method, new ones included): each dimension of size D (features) or K (classes) is fixed, and a saved
tensor with any fixed dimension one longer, or missing a dimension, is refused when loaded, naming the tensor."""

from __future__ import annotations

import pytest
import torch
from conftest import IMAGE_SIZE
from safetensors.torch import load_file, save_file
from test_detectors import balanced_model

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.settings.config import STATE_FILE


NUM = 150  # a tenth (15: the rows of CFOOD and ActSub; 14 CFOOD fractions) is neither the feature width (12) nor K
FITTED = sorted(method for method, cls in DETECTORS.items() if cls.needs_fit is True)


@pytest.fixture(scope="module")
def data():
    model = balanced_model("resnet").float()
    images = torch.randn(NUM, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # labelled by the model, so that SHE has correct samples of every class
        labels = model(pixel_values=images).logits.argmax(-1)
    return model, [(images[i:i + 32], labels[i:i + 32]) for i in range(0, NUM, 32)]


@pytest.mark.parametrize("method", FITTED)
def test_every_fitted_tensor_is_checked_at_load(data, method, tmp_path):
    model, batches = data
    detector = get_detector(method, model).fit(batches)
    feature_dim, num_classes = detector.head.feature_dim, detector.head.num_classes
    assert feature_dim != num_classes
    state, expected = detector.fitted_state(), detector.expected_state()
    assert state and set(state) == set(expected), f"{method}: expected_state must name every fitted tensor"
    detector.save_pretrained(tmp_path)
    path = tmp_path / STATE_FILE
    saved = load_file(str(path))
    for name, tensor in state.items():
        shape = expected[name]
        assert len(shape) == tensor.dim(), f"{method}.{name}: expected_state {shape} for a tensor {tuple(tensor.shape)}"
        for size, fixed in zip(tensor.shape, shape):
            assert fixed == size or (fixed is None and size not in (feature_dim, num_classes)), (
                f"{method}.{name} {tuple(tensor.shape)}: a dimension of the feature or class count must be fixed, "
                f"expected_state says {shape}")
        wrong_shapes = [tuple(s + (1 if i == d else 0) for i, s in enumerate(tensor.shape))
                        for d in range(tensor.dim()) if shape[d] is not None]
        wrong_shapes.append(tuple(tensor.shape[1:]) if tensor.dim() > 1 else (*tensor.shape, 1))
        for wrong in wrong_shapes:
            save_file({**saved, name: torch.ones(wrong, dtype=tensor.dtype)}, str(path))
            with pytest.raises(ValueError, match=rf"'{name}'") as caught:
                AutoOODDetector.from_pretrained(tmp_path, model=model)
            assert "shape" in str(caught.value), f"{method}.{name} {wrong}: {caught.value}"
    save_file(saved, str(path))
    AutoOODDetector.from_pretrained(tmp_path, model=model)  # the right state loads
