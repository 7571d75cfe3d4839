"""The Gaussian family's distances to many class means, expanded (``B D^2 + B K D`` work), against the direct float64
form ``(z - mu_k)^T P (z - mu_k)`` over a ``(B, K, D)`` tensor, kept here as the reference.

Tolerances: the reference itself carries rounding of about ``cond(Sigma) * 1e-16`` relative (its own einsum order is
arbitrary), so the comparison is relative, at ``1e-9`` where the covariance is well conditioned. Where it is
near-singular (condition number 1e9) the nearest class's distance (what Mahalanobis, RMDS and GEM read) is held to
float32 resolution, ``2^-24``, the precision in which every score is returned: the expanded sum alone misses it (it
cancels digits against the whole ``x^T P x`` term) and the nearest class retaken from its factors meets it. The other
classes' distances on the near-singular case are compared at ``1e-5`` (below float32 resolution of the scores once
the nearest class dominates them).
"""

from __future__ import annotations

import pytest
import torch

from hf_gsc.detectors.gem import gem_score
from hf_gsc.detectors.mahalanobis import l2_normalised, mahalanobis_score
from hf_gsc.detectors.penultimate import (
    ClassStatistics,
    expanded_distances,
    mahalanobis_distances,
    mahalanobis_terms,
    tied_precision,
)
from hf_gsc.detectors.rmds import background_gaussian, rmds_score


#: The relative resolution of the float32 scores every detector returns.
FLOAT32_RESOLUTION = 2.0**-24


def reference_distances(features: torch.Tensor, class_means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """The direct form, float64: ``(B, K, D)`` differences contracted with ``P``."""
    centred = features.double()[:, None, :] - class_means.double()[None, :, :]
    return torch.einsum("bkd,de,bke->bk", centred, precision.double(), centred)


def fitted(case: str, dim: int = 48, classes: int = 12, samples: int = 1500):
    generator = torch.Generator().manual_seed(3)
    mixing = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
    if case == "near_singular":  # eigenvalues from 1 down to 1e-9
        basis, _ = torch.linalg.qr(mixing)
        mixing = basis * torch.logspace(0, -9, dim, dtype=torch.float64).sqrt()
    means = 10.0 + 3.0 * torch.randn(classes, dim, generator=generator, dtype=torch.float64)
    labels = torch.arange(samples) % classes
    features = means[labels] + torch.randn(samples, dim, generator=generator, dtype=torch.float64) @ mixing.T
    if case == "normalised":
        features = l2_normalised(features)
    statistics = ClassStatistics(classes, second_moment=True)
    statistics.update(features, labels)
    class_means = statistics.class_means("test")
    precision = tied_precision(statistics.tied_covariance("test"))
    queries = torch.cat([features[:64], features[:64] + torch.randn(64, dim, generator=generator, dtype=torch.float64)])
    return statistics, class_means, precision, queries


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs() / want.abs()).max())


@pytest.mark.parametrize("case", ["well_conditioned", "near_singular", "normalised"])
def test_nearest_class_distance_equals_the_direct_float64_form(case):
    _, class_means, precision, queries = fitted(case)
    want = reference_distances(queries, class_means, precision)
    terms = mahalanobis_terms(class_means, precision)
    got = mahalanobis_distances(queries, terms)
    assert relative(got.amin(dim=1), want.amin(dim=1)) < (FLOAT32_RESOLUTION if case == "near_singular" else 1e-9)
    assert relative(got, want) < (1e-5 if case == "near_singular" else 1e-9)
    assert torch.equal(got.argmin(dim=1), want.argmin(dim=1))


def test_expanded_form_alone_cancels_on_a_near_singular_covariance_and_the_retaken_nearest_class_does_not():
    # Why mahalanobis_distances retakes the nearest class from its factors: the expanded sum alone loses digits here,
    # beyond the float32 resolution of the scores returned.
    _, class_means, precision, queries = fitted("near_singular")
    want = reference_distances(queries, class_means, precision).amin(dim=1)
    terms = mahalanobis_terms(class_means, precision)
    assert relative(expanded_distances(queries, terms)[1].amin(dim=1), want) > FLOAT32_RESOLUTION
    assert relative(mahalanobis_distances(queries, terms).amin(dim=1), want) < FLOAT32_RESOLUTION


@pytest.mark.parametrize("case", ["well_conditioned", "near_singular"])
def test_scores_of_the_family_equal_the_direct_form(case):
    statistics, class_means, precision, queries = fitted(case)
    reference = reference_distances(queries, class_means, precision)
    terms = mahalanobis_terms(class_means, precision)
    tolerance = FLOAT32_RESOLUTION if case == "near_singular" else 1e-9
    torch.testing.assert_close(mahalanobis_score(queries, terms), -reference.amin(dim=1), rtol=tolerance, atol=0)
    torch.testing.assert_close(gem_score(queries, terms), torch.logsumexp(-0.5 * reference, dim=1), rtol=tolerance,
                               atol=0)
    mean, background_precision = background_gaussian(statistics, "test")
    background = reference_distances(queries, mean[None, :], background_precision)[:, 0]
    # -d_c + d_0 is a difference of two large terms: its error is relative to them, not to the difference.
    scale = float(torch.maximum(reference.amin(dim=1), background).max())
    torch.testing.assert_close(rmds_score(queries, terms, mean, background_precision),
                               -reference.amin(dim=1) + background, rtol=0, atol=tolerance * scale)


def test_memory_per_batch_is_set_by_batch_times_dim_plus_classes():
    # At K=1000, D=512 a (B, K, D) float64 tensor for B=64 is 262 MB; the expanded form's largest temporary is (B, K).
    dim, classes, batch = 512, 1000, 64
    class_means = torch.randn(classes, dim, dtype=torch.float64)
    terms = mahalanobis_terms(class_means, torch.eye(dim, dtype=torch.float64))
    queries = torch.randn(batch, dim)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        mahalanobis_distances(queries, terms)
    largest = max(event.cpu_memory_usage for event in profiler.key_averages())
    assert largest <= 8 * batch * (dim + classes) * 2, largest


def test_the_family_fitted_together_decomposes_the_shared_covariance_once(monkeypatch):
    # Mahalanobis, RMDS and GEM read the same class statistics in one pass: the tied precision and its whitening are
    # derived once for the three (2 eigendecompositions) and RMDS adds its background Gaussian's (1); fitted apart,
    # each method derives its own. The scores are the same either way.
    from conftest import IMAGE_SIZE
    from test_detectors import NUM_FIT, balanced_model

    from hf_gsc.detectors import get_detector
    from hf_gsc.detectors.backbone_pass import fit_from_passes

    model = balanced_model("resnet")
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(NUM_FIT, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    labels = torch.arange(NUM_FIT) % model.config.num_labels
    batches = [(images[i:i + 16], labels[i:i + 16]) for i in range(0, NUM_FIT, 16)]
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda *args, **kwargs: calls.append(1) or eigh(*args, **kwargs))
    names = ("mahalanobis", "rmds", "gem")
    together = [get_detector(name, model) for name in names]
    fit_from_passes(together, batches, "test images")
    assert len(calls) == 3
    calls.clear()
    apart = [get_detector(name, model).fit(batches) for name in names]
    assert len(calls) == 7
    queries = 1.5 * torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    for joint, alone in zip(together, apart):
        torch.testing.assert_close(joint.score(queries), alone.score(queries), rtol=1e-12, atol=0)


def test_a_fits_whitening_follows_the_fitted_state_to_its_device():
    # A fit hands its whitening over from the CPU statistics while fit_end moves the fitted means and precision to
    # the model's device: every scoring term is derived on theirs (the meta device stands here for an accelerator).
    from hf_gsc.detectors.penultimate import whitening

    generator = torch.Generator().manual_seed(0)
    class_means = torch.randn(3, 4, generator=generator, dtype=torch.float64)
    precision = torch.eye(4, dtype=torch.float64)
    terms = mahalanobis_terms(class_means.to("meta"), precision.to("meta"), whitening(precision))
    assert {name: value.device.type for name, value in terms._asdict().items()} == dict.fromkeys(terms._fields, "meta")


def test_a_whitening_left_by_a_failed_fit_is_not_taken_for_another_precision():
    # A fit that fails after deriving its precision and whitening (RMDS's background Gaussian, the move to the device)
    # leaves the hand-over behind; a later load of another state derives its own whitening.
    from conftest import IMAGE_SIZE
    from test_detectors import NUM_FIT, balanced_model

    from hf_gsc.detectors import get_detector

    model = balanced_model("resnet")
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(NUM_FIT, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    labels = torch.arange(NUM_FIT) % model.config.num_labels
    fitted = get_detector("mahalanobis", model).fit([(images[i:i + 16], labels[i:i + 16]) for i in range(0, NUM_FIT, 16)])
    other = get_detector("mahalanobis", model).fit([(2.0 * images[i:i + 16], labels[i:i + 16])
                                                   for i in range(0, NUM_FIT, 16)])
    stale = get_detector("mahalanobis", model)
    stale._fitted_whitening = (fitted.precision, fitted.terms.whitening)  # what a failed fit would leave
    stale.load_fitted_state(other.fitted_state())
    queries = 1.5 * torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(stale.score(queries), other.score(queries), rtol=1e-12, atol=0)
