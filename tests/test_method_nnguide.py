"""NNGuide against the authors' code (roomo7time/nnguide: ``NNGuideOODDetector``, ``knn_score`` with a faiss
``IndexFlatIP`` done by brute force, ``extract_features``' ``F.normalize``, ``subsample``), written again in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from test_detectors import NUM_FIT, setting  # noqa: F401  (tiny ViT and ResNet with fitting data)
from torch.overrides import TorchFunctionMode

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.nnguide import top_k_mean_similarity
from hf_gsc.detectors.penultimate import NotEnoughSamplesError


def normalize(x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.normalize(x, dim=1): x / max(||x||, 1e-12)."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def authors_bank_indices(n: int, alpha: float) -> np.ndarray:
    """The authors' subsample after set_seed(0): np.random.shuffle(arange(N)), the first int(N alpha)."""
    state = np.random.get_state()
    try:
        np.random.seed(0)
        indices = np.arange(n)
        np.random.shuffle(indices)
    finally:
        np.random.set_state(state)
    return indices[: int(n * alpha)]


def reference_nnguide(F_bank: np.ndarray, F_test: np.ndarray, W: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """NNGuideOODDetector.setup / infer: scaled_feas_train = feas * logsumexp(logits); guidance = the mean of the k
    largest inner products with it; score = guidance * logsumexp(logits of the sample)."""
    bank = normalize(F_bank) * logsumexp(F_bank @ W.T + b, axis=1)[:, None]
    similarities = normalize(F_test) @ bank.T
    guidance = -np.sort(-similarities, axis=1)[:, :k].mean(axis=1)
    return guidance * logsumexp(F_test @ W.T + b, axis=1)


@pytest.mark.parametrize("k, alpha", [(5, 0.5), (3, 1.0), (1, 0.25)])
def test_nnguide_matches_the_authors_code(setting, k, alpha):  # noqa: F811
    """int(N alpha) >= k here, so the bank is exactly the authors' random subsample (same seed, same draw)."""
    rows = authors_bank_indices(NUM_FIT, alpha)
    assert len(rows) >= k
    expected = reference_nnguide(setting.F_fit[rows], setting.F_test, setting.W, setting.b, k)
    detector = setting.detector("nnguide", k=k, alpha=alpha)
    np.testing.assert_allclose(detector.score(setting.x_test).numpy(), expected, rtol=1e-9)
    assert detector.bank_guide.shape == (len(rows), setting.F_fit.shape[1])


def test_defaults_are_the_authors_and_a_small_bank_holds_k_rows(setting):  # noqa: F811
    """k = 10, alpha = 0.01: int(128 * 0.01) = 1 row in the authors' bank (their faiss search would pad the other 9
    neighbours with -3.4e38); here the bank holds the first k = 10 rows of the same random order."""
    detector = setting.detector("nnguide")
    assert detector.hyperparameters == {"k": 10, "alpha": 0.01}
    order = np.random.RandomState(0).permutation(NUM_FIT)
    assert order[0] == authors_bank_indices(NUM_FIT, 0.01)[0]
    expected = reference_nnguide(setting.F_fit[order[:10]], setting.F_test, setting.W, setting.b, 10)
    np.testing.assert_allclose(detector.score(setting.x_test).numpy(), expected, rtol=1e-9)
    assert detector.bank_guide.shape[0] == 10


def test_bank_does_not_depend_on_the_batching(setting):  # noqa: F811
    """The bank is drawn from the fitting samples, not from the first batches until they exceed int(N alpha)
    (OpenOOD's way: 16 rows with batches of 16, 64 with batches of 64). The backbone's features differ by the batch
    size in the last bits only."""
    batched = {size: get_detector("nnguide", setting.model, k=3, alpha=0.1).fit(setting.batches(size, limit=64))
               for size in (16, 64)}
    assert batched[16].bank_guide.shape[0] == int(64 * 0.1)
    torch.testing.assert_close(batched[16].bank_guide, batched[64].bank_guide, rtol=1e-12, atol=1e-12)


class _MatmulShapes(TorchFunctionMode):
    """Records the shape of every matrix product's result."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm):
            self.shapes.append(tuple(result.shape))
        return result


def test_chunked_top_k_equals_whole_bank_and_never_forms_b_by_n():
    generator = torch.Generator().manual_seed(0)
    query, bank = torch.randn(7, 5, generator=generator), torch.randn(103, 5, generator=generator)
    whole = (query @ bank.T).topk(9, dim=1).values.mean(dim=1)
    for chunk_size in (1, 8, 50, 103, 1000):
        with _MatmulShapes() as recorded:
            got = top_k_mean_similarity(query, bank, 9, chunk_size)
        torch.testing.assert_close(got, whole)
        assert recorded.shapes and max(shape[1] for shape in recorded.shapes) == min(chunk_size, 103)


def test_detector_scores_the_bank_in_chunks(setting):  # noqa: F811
    """A detector whose bank (64 rows) is compared 16 rows at a time gives the same scores, with no product wider
    than a chunk."""
    detector = get_detector("nnguide", setting.model, k=5, alpha=0.5).fit(setting.batches())
    whole = detector.score(setting.x_test)
    detector.bank_chunk_rows = 16
    with _MatmulShapes() as recorded:
        chunked = detector.score(setting.x_test)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=0)
    bank_products = [shape for shape in recorded.shapes if shape == (len(setting.x_test), 16)]
    assert len(bank_products) == 64 // 16
    assert not any(shape == (len(setting.x_test), 64) for shape in recorded.shapes)


def test_float32_model_keeps_a_float32_bank(setting):  # noqa: F811
    """The bank is stored in the features' dtype (10.5 GB for all of ImageNet-1K at D = 2048, not 21 GB); the
    scores stay close to the float64 ones (one architecture: the dtype path is the same for both)."""
    if setting.arch != "resnet":
        pytest.skip("run on the ResNet only")
    model32 = type(setting.model)(setting.model.config)
    model32.load_state_dict(setting.model.state_dict())
    model32 = model32.float().eval()
    batches = [(x.float(), y) for x, y in setting.batches()]
    detector = get_detector("nnguide", model32, k=5, alpha=0.5).fit(batches)
    assert detector.bank_guide.dtype == torch.float32
    expected = reference_nnguide(setting.F_fit[authors_bank_indices(NUM_FIT, 0.5)], setting.F_test, setting.W,
                                 setting.b, 5)
    scores = detector.score(setting.x_test.float())
    assert scores.dtype == torch.float32
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-4)


def test_too_few_fitting_samples_and_bad_settings_fail_early(setting):  # noqa: F811
    with pytest.raises(NotEnoughSamplesError, match=r"nnguide.*at least 20.*k=20.*got 16"):
        get_detector("nnguide", setting.model, k=20).fit(setting.batches(limit=16))
    with pytest.raises(ValueError, match=r"NNGuideConfig\.k must be an integer >= 1, got 0"):
        get_detector("nnguide", setting.model, k=0)
    with pytest.raises(ValueError, match=r"NNGuideConfig\.alpha must be in \(0.0, 1.0\], got 0.0"):
        get_detector("nnguide", setting.model, alpha=0.0)
    with pytest.raises(ValueError, match=r"NNGuideConfig\.alpha must be in \(0.0, 1.0\], got 1.5"):
        get_detector("nnguide", setting.model, alpha=1.5)


def test_normaliser_is_torch_normalize_not_openood_s():
    """The authors' F.normalize leaves an all-zero feature (a dead ReLU sample) at 0, so its guidance is 0;
    OpenOOD's z / ||z|| + 1e-10 makes it NaN."""
    from hf_gsc.detectors.nnguide import nnguide_normalise

    features = torch.tensor([[0.0, 0.0, 0.0], [3.0, 0.0, 4.0]], dtype=torch.float64)
    assert torch.equal(nnguide_normalise(features), torch.tensor([[0.0, 0.0, 0.0], [0.6, 0.0, 0.8]],
                                                                 dtype=torch.float64))
