"""What a fit holds is set by the method, not by the number of fitting samples.

* statistic methods (Gaussian family, MDSEns's per-layer Gaussians, DICE, NCI, fDBD, SHE) hold sums only: the same bytes after 2 and after 8
  batches;
* feature-reading methods (KNN, ViM, ReAct, ConjNorm, NNGuide) hold every feature once, contiguous float32 (float64
  for a float64 model), in chunks of the store's own, shared by those fitted in one pass, and never a view into the
  backbone's token tensor;
* the methods of one pass that read the same statistics share one accumulator (one update per batch);
* statistics combine across processes by sums (two threads standing in for two processes);
* ReAct's percentile equals ``np.percentile`` without concatenating the batches.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.backbone_pass import fit_together
from hf_gsc.detectors.penultimate import CHUNK_BYTES, ClassStatistics, chunked_percentile


STATISTIC_METHODS = ["mahalanobis", "mahalanobis_pp", "rmds", "rmds_pp", "gem", "dice", "nci", "fdbd", "she", "neco",
                     "ora", "mds_ensemble", "residual", "caref", "cadref"]
FEATURE_METHODS = ["knn", "vim", "react", "vra", "conjnorm", "nnguide", "relation", "cfood", "bfact", "optfs", "grood"]
WIDTH = 32


@pytest.fixture(scope="module")
def vit():
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=WIDTH, num_hidden_layers=1,
                                               num_attention_heads=2, intermediate_size=32, num_labels=4)).eval()


def batches(count: int, size: int = 16):
    generator = torch.Generator().manual_seed(count)
    return [(torch.randn(size, 3, 16, 16, generator=generator), torch.arange(size) % 4) for _ in range(count)]


def held_tensors(detector) -> list[torch.Tensor]:
    """Every tensor the detector's fit holds between fit_update and fit_end (its accumulator, walked)."""
    found, seen = [], set()

    def walk(value):
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif hasattr(value, "__dict__") and not callable(value):
            for item in vars(value).values():
                walk(item)

    for name, value in vars(detector).items():
        if not name.startswith("_modules") and name not in ("_buffers", "_parameters"):
            walk(value)
    return found


def held_bytes(detector) -> int:
    """Bytes of the storages behind the held tensors (a view counts its whole base)."""
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in held_tensors(detector)
                if tensor.numel()}
    return sum(storages.values())


def fed(method: str, model, data) -> object:
    detector = get_detector(method, model)
    from hf_gsc.detectors.backbone_pass import run_backbone_for

    detector.fit_begin()
    for pixel_values, labels in data:
        detector.fit_update(run_backbone_for([detector], pixel_values, logits=False), labels)
    return detector


@pytest.mark.parametrize("method", STATISTIC_METHODS)
def test_statistic_methods_hold_the_same_bytes_whatever_the_number_of_samples(vit, method):
    few, many = fed(method, vit, batches(2)), fed(method, vit, batches(8))
    assert held_bytes(few) == held_bytes(many) > 0
    assert held_bytes(many) < 8 * 16 * WIDTH * 4  # less than the features of the 8 batches


@pytest.mark.parametrize("method", FEATURE_METHODS)
def test_feature_methods_hold_one_contiguous_float32_copy_of_each_feature_and_no_token_tensor(vit, method):
    data = batches(4)
    detector = fed(method, vit, data)
    stored = detector._accumulator.features
    assert sum(tensor.numel() for tensor in stored) == 4 * 16 * WIDTH  # once, N x D
    assert all(tensor.dtype == torch.float32 and tensor.is_contiguous() for tensor in stored)
    # Not a view of the (B, T, D) tokens: every float tensor held is one chunk of the store's own, whose storage is its
    # own size (one chunk of at least CHUNK_BYTES here, its untouched tail never made resident).
    held = [tensor for tensor in held_tensors(detector) if tensor.is_floating_point()]
    assert len(held) == 1 and held[0].untyped_storage().nbytes() == held[0].numel() * 4 >= CHUNK_BYTES
    assert all(tensor.untyped_storage().data_ptr() == held[0].untyped_storage().data_ptr() for tensor in stored)
    detector.fit_end()
    assert detector.fitted


def test_methods_of_one_pass_share_their_accumulators(vit, monkeypatch):
    updates = []
    original = ClassStatistics.update

    def counted(self, *args, **kwargs):
        updates.append(self.second_moment)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ClassStatistics, "update", counted)
    detectors = [get_detector(method, vit) for method in ["mahalanobis", "rmds", "gem", "mahalanobis_pp", "rmds_pp",
                                                          "knn", "vim", "react"]]
    fit_together(detectors, batches(4))
    # One tied-Gaussian sum per feature shaping (raw, L2-normalised) and batch: 2 x 4, not 5 x 4.
    assert updates.count(True) == 2 * 4
    assert all(detector.fitted and detector._accumulator is None for detector in detectors)  # released at fit_end


def test_feature_store_is_shared_during_the_pass(vit):
    from hf_gsc.detectors.backbone_pass import run_backbone_for

    detectors = [get_detector(method, vit) for method in FEATURE_METHODS]
    for detector in detectors:
        detector.fit_begin()
    for pixel_values, labels in batches(2):
        batch = run_backbone_for(detectors, pixel_values, logits=False)
        for detector in detectors:
            detector.fit_update(batch, labels)
    assert len({id(detector._accumulator) for detector in detectors}) == 1


class ThreadShards:
    """Two threads standing in for two processes: ``sum`` adds both parts in process order."""

    num_processes = 2

    def __init__(self, barrier: threading.Barrier, parts: list, rank: int) -> None:
        self.barrier, self.parts, self.rank = barrier, parts, rank

    def sum(self, local):
        self.parts[self.rank] = local
        self.barrier.wait()
        present = [part for part in self.parts if part is not None]
        total = None if not present else present[0] + sum(present[1:]) if len(present) > 1 else present[0].clone()
        self.barrier.wait()
        return total


@pytest.mark.parametrize("split", [300, 0])
def test_class_statistics_reduce_across_processes_to_the_one_process_sums(split):
    generator = torch.Generator().manual_seed(0)
    features = 50.0 + torch.randn(600, 6, generator=generator, dtype=torch.float64)
    labels = torch.arange(600) % 3
    one = ClassStatistics(3, second_moment=True)
    for start in range(0, 600, 100):
        one.update(features[start:start + 100], labels[start:start + 100])
    parts = [ClassStatistics(3, second_moment=True), ClassStatistics(3, second_moment=True)]
    for start in range(0, 600, 100):
        part = parts[0] if start < split else parts[1]
        part.update(features[start:start + 100], labels[start:start + 100])
    barrier, slots = threading.Barrier(2), [None, None]
    threads = [threading.Thread(target=parts[rank].gather, args=(ThreadShards(barrier, slots, rank),))
               for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for part in parts:
        assert part.count == 600
        torch.testing.assert_close(part.class_means("test"), one.class_means("test"), rtol=1e-13, atol=0)
        torch.testing.assert_close(part.tied_covariance("test"), one.tied_covariance("test"), rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunked_percentile_is_numpy_percentile(dtype):
    rng = np.random.default_rng(0)
    for trial in range(60):
        values = rng.standard_normal(int(rng.integers(1, 2000))).astype(dtype)
        if trial % 3 == 0:
            values = np.round(values, 1).astype(dtype)  # ties
        if trial % 4 == 0:
            values = np.maximum(values, 0)  # ReLU features: many zeros
        cuts = np.sort(rng.integers(0, values.size, 3))
        chunks = [torch.from_numpy(chunk.copy()) for chunk in np.split(values, cuts)]
        for q in (0.0, 50.0, 85.0, 90.0, 99.0, 99.9, 100.0, float(rng.uniform(0, 100))):
            assert chunked_percentile(chunks, q) == float(np.percentile(values.astype(np.float64), q)), (trial, q)


@pytest.mark.parametrize("method, needed", [("mahalanobis", WIDTH + 4), ("rmds_pp", WIDTH + 4), ("vim", WIDTH)])
def test_too_few_fitting_samples_are_refused_before_the_backbone_pass(vit, method, needed, monkeypatch):
    import hf_gsc.detectors.backbone_pass as backbone_pass
    from hf_gsc.detectors.penultimate import NotEnoughSamplesError

    def no_pass(*args, **kwargs):
        raise AssertionError("the backbone ran")

    monkeypatch.setattr(backbone_pass, "run_backbone", no_pass)
    detector = get_detector(method, vit)
    with pytest.raises(NotEnoughSamplesError, match=rf"{method}.*at least {needed} .*feature dim {WIDTH}, 4 classes.*"
                                                   r"got 16 from the fitting data"):
        detector.fit(batches(1))
    with pytest.raises(NotEnoughSamplesError, match=r"--max-fit-samples"):
        detector.check_fit_size(needed - 1, "--max-fit-samples")
    detector.check_fit_size(needed, "--max-fit-samples")


def test_the_evaluation_refuses_a_method_its_fit_split_cannot_satisfy_before_the_pass(vit):
    from hf_gsc.evaluation.fitting import refuse_too_small

    detectors = {name: get_detector(name, vit) for name in ("mahalanobis", "vim", "dice")}
    data = list(range(33))  # 33 rows: below D + K = 36, enough for ViM's D = 32 and for DICE
    failed: dict[str, str] = {}
    kept = refuse_too_small(detectors, list(detectors), {name: data for name in detectors}, failed)
    assert kept == ["vim", "dice"]
    assert failed["mahalanobis"].startswith("fit failed: NotEnoughSamplesError: detector 'mahalanobis' needs at "
                                            "least 36")
    assert "--max-fit-samples" in failed["mahalanobis"] and "got 33 from" in failed["mahalanobis"]


def test_knn_bank_fraction_keeps_the_authors_draw(vit):
    data = batches(4)  # 64 samples
    detector = get_detector("knn", vit, k=3, bank_fraction=0.25)
    detector.fit(data)
    # The authors' run_imagenet.py: np.random.seed(0); rand_ind = np.random.choice(N, int(N * ALPHA), replace=False).
    np.random.seed(0)
    rows = np.sort(np.random.choice(64, int(64 * 0.25), replace=False))
    whole = get_detector("knn", vit, k=3)
    whole.fit(data)
    assert detector.bank.shape == (16, WIDTH)
    torch.testing.assert_close(detector.bank, whole.bank[torch.from_numpy(rows)], rtol=0, atol=0)
    assert get_detector("knn", vit, k=10, bank_fraction=0.01).min_fit_samples == 1000
    with pytest.raises(ValueError, match="bank_fraction"):
        get_detector("knn", vit, bank_fraction=0.0)


def test_a_fitted_knn_with_a_bank_fraction_scores_and_reloads(vit, tmp_path):
    detector = get_detector("knn", vit, k=3, bank_fraction=0.25)
    detector.fit(batches(4))
    images = batches(1)[0][0][:4]
    scores = detector.score(images)
    detector.save_pretrained(tmp_path)
    from hf_gsc import AutoOODDetector

    loaded = AutoOODDetector.from_pretrained(tmp_path, model=vit)
    assert loaded.bank.shape == (16, WIDTH)
    torch.testing.assert_close(loaded.score(images), scores, rtol=1e-6, atol=0)


def test_feature_store_keeps_batches_in_order_across_chunks(monkeypatch):
    """Chunks of a few rows here (CHUNK_BYTES lowered): batches that span two chunks come back whole, in order, with
    their labels, and in the store's dtype (a half-precision batch widened to float32)."""
    from hf_gsc.detectors import penultimate

    monkeypatch.setattr(penultimate, "CHUNK_BYTES", 5 * 3 * 4)  # five rows of three float32 values
    store = penultimate.FeatureStore()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randn(rows, 3, generator=generator) for rows in (2, 4, 7, 1, 0, 3)]
    for index, batch in enumerate(batches):
        store.update(batch.half() if index == 1 else batch, torch.full((batch.shape[0],), index))
    assert store.count == 17 and all(piece.dtype == torch.float32 for piece in store.features)
    expected = torch.cat([batch.half().float() if index == 1 else batch for index, batch in enumerate(batches)])
    assert torch.equal(torch.cat(store.features), expected)
    assert torch.cat(store.labels).tolist() == [index for index, batch in enumerate(batches) for _ in range(len(batch))]
    # Chunks of 5, 5 and 7 rows (a chunk holds at least the batch that opens it): the 4- and 7-row batches span two.
    assert [chunk.shape[0] for chunk, _ in store._chunks] == [5, 5, 7]
