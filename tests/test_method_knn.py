"""KNN's float16 bank (``bank_dtype="float16"``): half the bytes, scores within the rounding of unit vectors, searched
chunk by chunk without widening the whole bank, kept by save and load, refused once fitted or when it disagrees with
the config."""

from __future__ import annotations

import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import get_detector
from hf_gsc.detectors.knn import knn_score


WIDTH = 32
#: Rounding a unit row to float16 moves each element by at most 2**-11 of itself, so the row by at most 2**-11 in L2
#: and every distance to it (hence the k-th) by at most that; 1e-5 covers float32's own cdist error at distances ~1.
FLOAT16_DISTANCE_BOUND = 2.0 ** -11 + 1e-5


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=WIDTH, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32, num_labels=4)).eval()


def batches(count: int, size: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, 16, 16, generator=generator), torch.arange(size) % 4) for _ in range(count)]


@pytest.fixture(scope="module")
def fitted(vit):
    data = batches(6)
    return {dtype: get_detector("knn", vit, k=5, bank_dtype=dtype).fit(data) for dtype in ("float32", "float16")}


def test_a_float16_bank_halves_the_bytes_and_scores_within_its_rounding(fitted):
    half, full = fitted["float16"], fitted["float32"]
    assert half.bank.dtype == torch.float16 and full.bank.dtype == torch.float32
    assert half.bank.nbytes * 2 == full.bank.nbytes and half.bank.shape == full.bank.shape == (96, WIDTH)
    assert half.bank.untyped_storage().nbytes() == half.bank.nbytes  # its own storage, not a view of a wider one
    # Normalised in float32, then rounded once.
    torch.testing.assert_close(half.bank, full.bank.to(torch.float16), rtol=0, atol=0)
    images = batches(2, seed=1)[0][0]
    with torch.no_grad():
        scores_half, scores_full = half.score(images), full.score(images)
    assert scores_half.dtype == torch.float32
    torch.testing.assert_close(scores_half, scores_full, rtol=0, atol=FLOAT16_DISTANCE_BOUND)


def test_a_float16_bank_is_widened_chunk_by_chunk(monkeypatch):
    generator = torch.Generator().manual_seed(2)
    bank = torch.nn.functional.normalize(torch.randn(50, 8, generator=generator, dtype=torch.float32), dim=1)
    features = torch.randn(6, 8, generator=generator)
    expected = knn_score(features, bank, k=4)
    searched = []
    addmm = torch.addmm

    def spy(input, mat1, mat2, *args, **kwargs):  # mat2: the chunk searched, transposed
        chunk = mat2.T
        whole = chunk if chunk._base is None else chunk._base  # a slice of a widened whole bank would show it here
        searched.append((whole.shape[0], chunk.dtype))
        return addmm(input, mat1, mat2, *args, **kwargs)

    monkeypatch.setattr(torch, "addmm", spy)
    scores = knn_score(features, bank.to(torch.float16), k=4, chunk_size=16)
    # 4 chunks, each widened into at most 16 rows: never the whole bank widened at once.
    assert len(searched) == 4 and all(rows <= 16 and dtype == torch.float32 for rows, dtype in searched)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, expected, rtol=0, atol=FLOAT16_DISTANCE_BOUND)


def test_a_float16_bank_on_a_float64_model_scores_in_float64(vit):
    model = ViTForImageClassification(vit.config).double().eval()
    detector = get_detector("knn", model, k=3, bank_dtype="float16").fit(
        [(images.double(), labels) for images, labels in batches(2)])
    assert detector.bank.dtype == torch.float16
    with torch.no_grad():
        assert detector.score(batches(1, seed=1)[0][0].double()).dtype == torch.float64


def test_a_float16_bank_survives_save_and_load_and_a_disagreeing_config_is_refused(fitted, vit, tmp_path):
    half, full = fitted["float16"], fitted["float32"]
    half.save_pretrained(tmp_path / "half")
    full.save_pretrained(tmp_path / "full")
    loaded = AutoOODDetector.from_pretrained(tmp_path / "half", model=vit)
    assert loaded.config.bank_dtype == "float16" and loaded.bank.dtype == torch.float16
    torch.testing.assert_close(loaded.bank, half.bank, rtol=0, atol=0)
    images = batches(2, seed=1)[0][0]
    with torch.no_grad():
        torch.testing.assert_close(loaded.score(images), half.score(images), rtol=1e-6, atol=0)
    # A saved bank is not converted to another precision at load: refused, naming the setting and the way out.
    with pytest.raises(ValueError, match=r"bank is torch.float16 but bank_dtype='float32'.*bank_dtype='float16'"):
        AutoOODDetector.from_pretrained(tmp_path / "half", model=vit, bank_dtype="float32")
    with pytest.raises(ValueError, match=r"bank is torch.float32 but bank_dtype='float16'.*bank_dtype='float32'"):
        AutoOODDetector.from_pretrained(tmp_path / "full", model=vit, bank_dtype="float16")


def test_bank_dtype_is_refused_once_fitted_and_checked_when_given(vit):
    detector = get_detector("knn", vit, k=3).fit(batches(1))
    detector.config.bank_dtype = "float16"  # decides the fitted bank: refused and undone
    with pytest.raises(ValueError, match="bank_dtype.*assignment is undone"):
        detector.score(batches(1)[0][0])
    assert detector.config.bank_dtype == "float32" and detector.bank.dtype == torch.float32
    with pytest.raises(ValueError, match=r"bank_dtype must be one of \('float32', 'float16'\), got 'bfloat16'"):
        get_detector("knn", vit, bank_dtype="bfloat16")


def test_a_float16_bank_compiles_whole(fitted):
    """The widening buffer and its copies trace into one graph (``fullgraph=True``), scoring as the eager forward."""
    torch._dynamo.reset()
    detector = fitted["float16"]
    images = batches(2, seed=1)[0][0][:4]
    with torch.no_grad():
        expected = detector(images).ood_score
        compiled = torch.compile(detector, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(images).ood_score, expected, rtol=1e-6, atol=0)
