"""Penultimate features and the linear classifier head, streamed batch by batch, for the baselines.

Every feature-space baseline (Mahalanobis, KNN, ViM, ...) reads the same two things:

* ``F``: the *penultimate* feature, the input of the model's last ``nn.Linear`` (its classifier),
  ``(B, D)``, computed without gradient by :func:`hf_gsc.classifier.split_points.resolve_split_point`;
* the head ``logits = F @ W.T + b`` (:class:`LinearHead`).

Fitting data arrive as an iterable of ``(pixel_values, labels)`` batches; :func:`penultimate_features`
turns them into ``(features, labels)`` batches one at a time, so the image set is never held in memory. A fit keeps
of each batch only what its method reads afterwards: float64 sums (:class:`ClassStatistics` through
:class:`StatisticsPass`), or every feature once, float32 (:class:`FeatureStore`). The Gaussian family's distances to
many class means are Euclidean ones after whitening, expanded (:func:`whitening`, :func:`mahalanobis_terms`,
:func:`mahalanobis_distances`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ..classifier.split_points import SplitPoint, resolve_split_point


if TYPE_CHECKING:
    from .backbone_pass import FitShards


@dataclass(frozen=True)
class LinearHead:
    """The classifier ``logits = features @ weight.T + bias``.

    Attributes:
        weight: ``(K, D)``. bias: ``(K,)`` (zeros when the linear layer has none).
    """

    weight: torch.Tensor
    bias: torch.Tensor

    @property
    def num_classes(self) -> int:
        return self.weight.shape[0]

    @property
    def feature_dim(self) -> int:
        return self.weight.shape[1]

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """``(B, D) -> (B, K)``, on the features' device and in their dtype."""
        return torch.nn.functional.linear(features, self.weight.to(features), self.bias.to(features))


def penultimate_split(model: nn.Module) -> SplitPoint:
    """The split point at the input of the last ``nn.Linear`` (features ``(B, D)``)."""
    return resolve_split_point(model, "penultimate")


def linear_head(model: nn.Module) -> LinearHead:
    """Weight and bias of the model's last ``nn.Linear``, detached, on the model's device."""
    linear = model.get_submodule(penultimate_split(model).module_path)
    assert isinstance(linear, nn.Linear)  # the penultimate split point is the input of an nn.Linear
    weight = linear.weight.detach()
    bias = linear.bias.detach() if linear.bias is not None else weight.new_zeros(linear.out_features)
    return LinearHead(weight, bias)


def penultimate_features(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Stream ``(pixel_values, labels)`` batches into ``(features (B, D), labels (B,))`` batches, on the CPU."""
    split = penultimate_split(model)
    for pixel_values, labels in batches:
        features = split.features(pixel_values).flatten(1).cpu()
        yield features, torch.as_tensor(labels).reshape(-1).long().cpu()


def stored_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which fitting features are held: float64 for a float64 model (exactness tests), else float32
    (the authors' code reads float32 features; half-precision features are widened as their ``.float()`` does)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Bytes of one chunk of a :class:`FeatureStore` at least: glibc's largest dynamic mmap threshold (32 MiB on 64-bit),
#: so that every chunk is mapped apart from the heap, never between the forward's transient tensors.
CHUNK_BYTES = 32 * 2**20


class FeatureStore:
    """Every fitting feature and its label, held once, for the fits that read every feature after the pass (KNN's
    bank, ReAct's percentile, ViM's residual norms, ConjNorm's normalisers, NNGuide's bank).

    Batches are copied (:func:`stored_dtype`, contiguous) into chunks of at least :data:`CHUNK_BYTES` (rows of one
    batch may span two chunks), allocated as the fit reaches them and never moved: ``N D`` elements (``4 N D`` bytes in
    float32) and ``N`` labels, plus the untouched tail of the last chunk, which an allocation that size leaves
    unmapped. A copy per batch would be a small allocation landing between the large transient tensors of each
    forward, where the C allocator cannot give the heap back: the peak resident memory of a ViT fit then grows by
    about 0.4 MiB per fitting input whatever the method keeps. A feature the backbone gave as a view (a ViT's CLS
    token) is copied, never kept with its base. Shared by every detector of a pass that reads the features.
    """

    def __init__(self) -> None:
        self._clear()

    def _clear(self) -> None:
        self._chunks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (features (R, D), labels (R,)) buffers
        self._filled = 0  # rows used in the last chunk
        self._pieces: list[tuple[int, int, int]] = []  # (chunk, start, rows) per stored piece, in the data's order

    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        features, labels = features.detach(), labels.detach().reshape(-1)
        done, rows = 0, features.shape[0]
        while done < rows:
            if not self._chunks or self._filled == self._chunks[-1][0].shape[0]:
                self._chunks.append(self._new_chunk(features, labels))
                self._filled = 0
            chunk_features, chunk_labels = self._chunks[-1]
            take = min(rows - done, chunk_features.shape[0] - self._filled)
            chunk_features[self._filled:self._filled + take].copy_(features[done:done + take])
            chunk_labels[self._filled:self._filled + take].copy_(labels[done:done + take])
            self._pieces.append((len(self._chunks) - 1, self._filled, take))
            self._filled += take
            done += take

    @staticmethod
    def _new_chunk(features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = stored_dtype(features.dtype)
        width = features[0].numel() if features.shape[0] else 1
        row_bytes = max(1, width * torch.empty((), dtype=dtype).element_size())
        rows = max(features.shape[0], -(-CHUNK_BYTES // row_bytes))
        return (torch.empty(rows, *features.shape[1:], dtype=dtype),
                torch.empty(rows, dtype=labels.dtype))

    @property
    def features(self) -> list[torch.Tensor]:
        """The stored features, one view per stored piece (a batch, or its part in one chunk), in the data's order."""
        return [self._chunks[chunk][0].narrow(0, start, rows) for chunk, start, rows in self._pieces]

    @property
    def labels(self) -> list[torch.Tensor]:
        """The labels of :attr:`features`, piece by piece."""
        return [self._chunks[chunk][1].narrow(0, start, rows) for chunk, start, rows in self._pieces]

    @property
    def count(self) -> int:
        return sum(rows for _, _, rows in self._pieces)

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(features (B, D), labels (B,))`` per stored piece, in the order of the data."""
        return iter(zip(self.features, self.labels))

    def gather(self, shards: FitShards) -> None:
        """On several processes: every process's batches, in the order of the data (``shards.batches``)."""
        features, labels = shards.batches(self.features), shards.batches(self.labels)
        self._clear()
        for batch_features, batch_labels in zip(features, labels):
            self.update(batch_features, batch_labels)


def take_rows(batches: Sequence[torch.Tensor], rows: torch.Tensor) -> Iterator[torch.Tensor]:
    """The rows ``rows`` (sorted indices into the concatenation of ``batches``), batch by batch, without
    concatenating the batches."""
    start = 0
    for batch in batches:
        end = start + batch.shape[0]
        lo, hi = torch.searchsorted(rows, torch.tensor([start, end])).tolist()
        if hi > lo:
            yield batch[rows[lo:hi] - start]
        start = end


class StatisticsPass:
    """Streaming :class:`ClassStatistics` of the fitting features as a method shapes them: nothing of a batch is
    kept but its sums.

    Args:
        statistics: the sums to accumulate into.
        shape: ``(features, labels) -> (features, labels, keep)``: the features as the method fits them (float64,
            L2-normalised, ...), the labels, and the rows that count (``None``: all).
    """

    def __init__(self, statistics: ClassStatistics,
                 shape: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
                 ) -> None:
        self.statistics = statistics
        self.shape = shape
        self.count = 0  # rows seen, kept or not

    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        features, labels, keep = self.shape(features, labels)
        self.statistics.update(features, labels, keep)
        self.count += features.shape[0]

    def gather(self, shards: FitShards) -> None:
        self.statistics.gather(shards)
        count = shards.sum(torch.tensor([float(self.count)], dtype=torch.float64))
        assert count is not None  # every process gave a count
        self.count = int(round(float(count[0])))


class NotEnoughSamplesError(ValueError):
    """Raised when a detector is fitted on fewer samples than its statistics need."""


def check_fit_samples(method: str, got: int, needed: int, reason: str) -> None:
    """Raise :class:`NotEnoughSamplesError` unless ``got >= needed``."""
    if got < needed:
        raise NotEnoughSamplesError(
            f"detector {method!r} needs at least {needed} ID fitting samples ({reason}), got {got}"
        )


def check_labels(labels: torch.Tensor, num_classes: int) -> None:
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"fitting labels must be class indices in [0, {num_classes}), got range "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )


class ClassStatistics:
    """Streaming per-class sums (and optionally the sum of outer products) of features, in float64.

    Both are accumulated about a shift ``s``, the mean of the first batch: ``sum (x - s)`` and ``sum (x - s)(x - s)^T``.
    The within-class covariance is then ``(sum (x - s)(x - s)^T - sum_c n_c (mu_c - s)(mu_c - s)^T) / N``, the same
    value as without the shift, but where features sit far from the origin relative to their spread (normalised
    features) the raw ``sum x x^T - sum_c n_c mu_c mu_c^T`` cancels about ``eps * ||mu||^2 / lambda_min`` of it, and
    the shifted sums cancel only ``eps * ||mu - s||^2 / lambda_min``, like a two-pass fit (sklearn's).

    Args:
        num_classes: ``K``.
        second_moment: also accumulate ``sum_i x_i x_i^T`` for a tied covariance.
    """

    def __init__(self, num_classes: int, second_moment: bool = False) -> None:
        self.num_classes = num_classes
        self.second_moment = second_moment
        self.count = 0
        self.class_counts = torch.zeros(num_classes, dtype=torch.float64)
        self.class_sums: torch.Tensor | None = None  # sum of (x - shift) per class
        self.outer: torch.Tensor | None = None  # sum of (x - shift)(x - shift)^T
        self.shift: torch.Tensor | None = None
        self._derived: dict[str, Any] = {}

    def update(self, features: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Add a batch; ``keep`` (``(B,)`` bool) selects the rows that count."""
        check_labels(labels, self.num_classes)
        self._derived.clear()
        features = features.detach().to(torch.float64)
        if keep is not None:
            features, labels = features[keep], labels[keep]
        if self.class_sums is None:
            self.class_sums = torch.zeros(self.num_classes, features.shape[1], dtype=torch.float64)
            if self.second_moment:
                self.outer = torch.zeros(features.shape[1], features.shape[1], dtype=torch.float64)
        if self.shift is None and features.shape[0]:
            self.shift = features.mean(dim=0)
        if self.shift is not None:
            features = features - self.shift
        self.count += features.shape[0]
        self.class_counts += torch.bincount(labels, minlength=self.num_classes).double()
        self.class_sums.index_add_(0, labels, features)
        if self.outer is not None:
            self.outer += features.T @ features

    def gather(self, shards: FitShards) -> None:
        """On several processes: replace this process's sums by every process's, added (``shards.sum``), so that every
        process holds the statistics of all the fitting features (what one process holds: ``(K, D)`` and ``(D, D)``,
        not the features). The sums are first moved to one shift for all, the mean of every process's features:
        ``sum (x - s) = sum (x - s_p) + n_p (s_p - s)`` per class, and ``sum (x - s)(x - s)^T`` gains ``d S^T + S d^T +
        n_p d d^T`` with ``d = s_p - s`` and ``S = sum (x - s_p)``: exact in exact arithmetic, and the same float64
        rounding level as one process's sums."""
        # (shift is set only once class_sums is: testing both states that for the type checker.)
        local_sum = None if self.shift is None or self.class_sums is None else \
            self.shift * self.count + self.class_sums.sum(dim=0)
        count = shards.sum(torch.tensor([float(self.count)], dtype=torch.float64))
        total = shards.sum(local_sum)
        assert count is not None  # every process gave a count
        if total is None:  # no process has a sample
            return
        shift = total / count
        class_sums = outer = None
        if self.shift is not None and self.class_sums is not None:
            offset = self.shift - shift
            class_sums = self.class_sums + self.class_counts[:, None] * offset
            if self.outer is not None:
                shifted = self.class_sums.sum(dim=0)
                cross = offset[:, None] * shifted[None, :]
                outer = self.outer + cross + cross.T + self.count * offset[:, None] * offset[None, :]
        self.class_sums = shards.sum(class_sums)
        if self.second_moment:
            self.outer = shards.sum(outer)
        class_counts = shards.sum(self.class_counts)
        assert class_counts is not None  # every process gave its counts
        self.class_counts = class_counts
        self.count = int(round(float(count[0])))
        self.shift = shift
        self._derived.clear()

    def derived(self, name: str, derive: Callable[[], Any]) -> Any:
        """``derive()``, computed once per state of the sums and shared by the detectors that read these statistics
        (the Gaussian family's precision and its whitening: one ``D^3`` eigendecomposition each for Mahalanobis, RMDS
        and GEM fitted together, not one per method)."""
        if name not in self._derived:
            self._derived[name] = derive()
        return self._derived[name]

    def class_means(self, method: str, what: str = "sample") -> torch.Tensor:
        """``(K, D)``; raises when a class has no sample (its mean would be undefined)."""
        empty = (self.class_counts == 0).nonzero().flatten().tolist()
        if self.class_sums is None or self.shift is None or empty:
            raise ValueError(f"detector {method!r} needs at least one ID {what} of every class; classes {empty or 'all'} have none")
        return self._shifted_means() + self.shift

    def _shifted_means(self) -> torch.Tensor:
        assert self.class_sums is not None  # read after class_means checked there are samples
        return self.class_sums / self.class_counts[:, None]

    def tied_covariance(self, method: str) -> torch.Tensor:
        """Within-class covariance shared by all classes, ``(1/N) sum_i (x_i - mu_{y_i})(x_i - mu_{y_i})^T``.

        Same estimate as ``sklearn.covariance.EmpiricalCovariance`` fitted on class-centred features,
        as in Lee et al. (2018)'s code.
        """
        if self.outer is None:
            raise RuntimeError("ClassStatistics was built without second_moment=True")
        self.class_means(method)  # every class has a sample
        means = self._shifted_means()
        between = (means * self.class_counts[:, None]).T @ means
        return (self.outer - between) / self.count


#: Eigenvalues of a covariance below this fraction of its largest are treated as 0 by :func:`tied_precision`.
#: Float64 statistics carry rounding noise of about ``D * 1e-16`` of the largest eigenvalue; 1e-10 is a thousand times
#: above that for ``D`` up to 10^4, and below the smallest eigenvalue of any covariance worth inverting.
PRECISION_RCOND = 1e-10


def tied_precision(covariance: torch.Tensor) -> torch.Tensor:
    """Pseudo-inverse of a symmetric covariance with a stated rank cutoff, float64: eigenvalues at or below
    :data:`PRECISION_RCOND` times the largest count as 0.

    Where the covariance is well conditioned this is its inverse, as ``sklearn``'s ``pinvh`` (the authors' code for
    Mahalanobis, RMDS, GEM, Mahalanobis++). Where it is singular, pinvh's cutoff (``D * eps`` of the largest
    eigenvalue) sits at the level of rounding noise, so whether it keeps a direction of zero variance (the
    all-ones direction of ViT's LayerNorm features: every feature vector sums to the same value) depends on the
    order of the sums, i.e. on the batch size, and a kept noise eigenvalue dominates the distances. Here that
    direction is always dropped, and the fit no longer depends on batching.
    """
    covariance = covariance.double()
    eigenvalues, eigenvectors = torch.linalg.eigh((covariance + covariance.T) / 2)
    keep = eigenvalues > PRECISION_RCOND * eigenvalues.abs().max()
    inverse = torch.where(keep, 1.0 / torch.where(keep, eigenvalues, torch.ones_like(eigenvalues)), 0.0)
    return (eigenvectors * inverse) @ eigenvectors.T


class MahalanobisTerms(NamedTuple):
    """What scoring the squared Mahalanobis distances to ``K`` class means needs, derived once from the fitted means
    and precision (:func:`mahalanobis_terms`), float64: the distances are Euclidean ones after whitening.

    Attributes:
        centre: ``(D,)`` the point the features and means are taken about (the mean of the class means).
        whitening: ``(D, D)`` ``W`` with ``W W^T = P`` (``V diag(sqrt(p))`` of the eigendecomposition of ``P``).
        whitened_means: ``(K, D)`` ``w_k = W^T (mu_k - centre)``.
        mean_terms: ``(K,)`` ``||w_k||^2``.
    """

    centre: torch.Tensor
    whitening: torch.Tensor
    whitened_means: torch.Tensor
    mean_terms: torch.Tensor


def whitening(precision: torch.Tensor) -> torch.Tensor:
    """``W`` ``(D, D)`` with ``W W^T = P`` for a symmetric positive semi-definite precision ``P``, float64: the
    eigenvectors scaled by the square roots of the eigenvalues (rounding's negative eigenvalues count as 0). One
    ``D^3`` eigendecomposition, at the fit's end or at load, so that scoring is Euclidean."""
    precision = precision.double()
    eigenvalues, eigenvectors = torch.linalg.eigh((precision + precision.T) / 2)
    return eigenvectors * eigenvalues.clamp(min=0.0).sqrt()


def mahalanobis_terms(class_means: torch.Tensor, precision: torch.Tensor,
                      whitened_by: torch.Tensor | None = None) -> MahalanobisTerms:
    """The terms of :func:`mahalanobis_distances` for ``class_means`` ``(K, D)`` and ``precision`` ``(D, D)``;
    ``whitened_by``: :func:`whitening` of that precision where it is already known (a fit's, on the CPU where its
    statistics are: taken to the means' device)."""
    class_means = class_means.double()
    centre = class_means.mean(dim=0)
    transform = whitening(precision) if whitened_by is None else whitened_by.to(class_means)
    whitened_means = (class_means - centre) @ transform
    return MahalanobisTerms(centre, transform, whitened_means.contiguous(), (whitened_means**2).sum(dim=-1))


def mahalanobis_distances(features: torch.Tensor, terms: MahalanobisTerms) -> torch.Tensor:
    """Squared Mahalanobis distance to every class mean, ``(B, D) -> (B, K)``, float64.

    ``d_k(z) = (z - mu_k)^T P (z - mu_k) = ||w - w_k||^2`` with ``w = W^T (z - c)``, ``w_k = W^T (mu_k - c)``
    (:class:`MahalanobisTerms`), expanded: ``||w||^2 - 2 w^T w_k + ||w_k||^2``. That is ``B D^2 + B K D`` work and
    ``(B, D + K)`` memory, where the direct form is ``B K D^2`` work over a ``(B, K, D)`` tensor. Taking the features
    about ``c`` keeps the three terms of the size of the distances of ID features (a feature far from every mean has
    a large ``d_k`` anyway), so the sum cancels few digits; the one distance a score is most sensitive to, the nearest
    class's, is then taken again as ``||w - w_n||^2`` (:func:`nearest_class_distances`).
    """
    return nearest_class_distances(*expanded_distances(features, terms), terms)


def expanded_distances(features: torch.Tensor, terms: MahalanobisTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, the expanded distances (B, K))`` of :func:`mahalanobis_distances`: every class's distance the expanded
    sum, the nearest class not yet retaken."""
    whitened = (features.double() - terms.centre) @ terms.whitening
    own = (whitened**2).sum(dim=-1, keepdim=True)
    distances = own - 2.0 * whitened @ terms.whitened_means.T + terms.mean_terms
    return whitened, distances.clamp_(min=0.0)  # a squared distance under a positive semi-definite P


def nearest_class_distances(whitened: torch.Tensor, distances: torch.Tensor, terms: MahalanobisTerms) -> torch.Tensor:
    """``distances`` ``(B, K)`` with each row's smallest entry retaken as ``||w - w_n||^2``, ``B D`` work: the
    expanded sum's rounding is relative to the whole ``||w||^2`` term and, where the covariance is near-singular, can
    exceed a small nearest distance; the difference of the whitened vectors keeps it relative to the distance itself
    (``tests/test_gaussian_scoring.py``, against the direct float64 form at condition number 1e9)."""
    nearest = distances.argmin(dim=1)
    exact = ((whitened - terms.whitened_means[nearest]) ** 2).sum(dim=-1)
    return distances.scatter(1, nearest[:, None], exact[:, None])


def percentile(values: torch.Tensor, q: float) -> float:
    """``numpy.percentile(values, q)`` (linear interpolation) over all elements."""
    return float(np.percentile(values.detach().double().cpu().numpy().ravel(), q))


def _sortable_keys(values: torch.Tensor) -> torch.Tensor:
    """Integers in the order of the floats ``values`` (float32 -> int32, float64 -> int64; ``-0.0`` just below
    ``0.0``): the bit pattern, with every bit but the sign flipped for negative numbers. Its own inverse."""
    if values.is_floating_point():
        values = values.view(torch.int32 if values.dtype == torch.float32 else torch.int64)
    bits = values
    width = bits.element_size() * 8
    return bits ^ ((bits >> (width - 1)) & ((1 << (width - 1)) - 1))


def _kth_smallest_key(chunks: Sequence[torch.Tensor], k: int) -> int:
    """The key (:func:`_sortable_keys`) of the ``k``-th smallest (0-based) element over ``chunks`` (one float dtype),
    by radix selection on 16-bit digits: one counting pass over the chunks per digit, each chunk's keys made one at a
    time, so that nothing the size of the values is copied."""
    width = chunks[0].element_size() * 8
    prefix: int | None = None
    for shift in range(width - 16, -1, -16):
        counts = torch.zeros(1 << 16, dtype=torch.int64)
        for chunk in chunks:
            keys = _sortable_keys(chunk.reshape(-1))
            if prefix is not None:
                keys = keys[(keys >> (shift + 16)) == prefix]
            digits = (keys >> shift) & 0xFFFF if prefix is not None else (keys >> shift) + (1 << 15)
            counts += torch.bincount(digits.long(), minlength=1 << 16)
        cumulative = counts.cumsum(0)
        digit = int(torch.searchsorted(cumulative, torch.tensor(k + 1)))
        k -= int(cumulative[digit - 1]) if digit else 0
        prefix = digit - (1 << 15) if prefix is None else (prefix << 16) | digit
    assert prefix is not None  # keys of 32 or 64 bits: the loop took two digits or more
    return prefix


def _key_value(key: int, dtype: torch.dtype) -> float:
    keys = torch.tensor([key], dtype=torch.int32 if dtype == torch.float32 else torch.int64)
    return float(_sortable_keys(keys).view(dtype)[0])


def chunked_percentile(chunks: Sequence[torch.Tensor], q: float) -> float:
    """``numpy.percentile(np.concatenate([c.ravel() for c in chunks]).astype(float64), q)`` (linear interpolation),
    the same float64 value, without concatenating or sorting a copy: the two order statistics it interpolates are
    selected exactly (:func:`_kth_smallest_key`) from the chunks as held (float32 or float64, no NaN)."""
    return chunked_quantile(chunks, np.true_divide(np.float64(q), 100))


def chunked_quantile(chunks: Sequence[torch.Tensor], fraction: float) -> float:
    """``numpy.quantile(np.concatenate([c.ravel() for c in chunks]).astype(float64), fraction)``, as
    :func:`chunked_percentile` (``numpy.percentile`` at ``q`` is this at ``q / 100``; a fraction such as ``1 - 1e-3``
    is no float ``q`` over 100)."""
    chunks = [chunk for chunk in chunks if chunk.numel()]
    if not chunks:
        raise ValueError("percentile of no values")
    dtype = chunks[0].dtype
    if dtype not in (torch.float32, torch.float64) or any(chunk.dtype != dtype for chunk in chunks):
        raise ValueError(f"chunked_percentile: float32 or float64 chunks of one dtype expected, got "
                         f"{sorted({str(chunk.dtype) for chunk in chunks})}")
    n = sum(chunk.numel() for chunk in chunks)
    # numpy's 'linear' method: virtual index (n - 1) q, its floor and the lerp's weight, in float64 as numpy.
    virtual = (n - 1) * np.float64(fraction)
    if virtual >= n - 1:
        return _key_value(_kth_smallest_key(chunks, n - 1), dtype)
    lower = int(np.floor(virtual))
    gamma = virtual - lower
    low_key = _kth_smallest_key(chunks, lower)
    below = sum(int((_sortable_keys(chunk.reshape(-1)) <= low_key).sum()) for chunk in chunks)
    if below > lower + 1:  # ties: the next order statistic is the same value
        high_key = low_key
    else:
        high_key = min(int(_sortable_keys(chunk.reshape(-1))[_sortable_keys(chunk.reshape(-1)) > low_key].min())
                       for chunk in chunks if bool((_sortable_keys(chunk.reshape(-1)) > low_key).any()))
    a, b = np.float64(_key_value(low_key, dtype)), np.float64(_key_value(high_key, dtype))
    difference = b - a
    return float(b - difference * (1 - gamma) if gamma >= 0.5 else a + difference * gamma)
