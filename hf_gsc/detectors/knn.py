"""Deep nearest neighbours (Sun, Ming, Zhu & Li, ICML 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..settings.config import DetectorConfig, choice_check, integer_check, number_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, check_fit_samples, stored_dtype, take_rows


def l2_normalise(features: torch.Tensor) -> torch.Tensor:
    """``x / (||x||_2 + 1e-10)`` row-wise, the normaliser of the KNN code."""
    return features / (features.norm(dim=-1, keepdim=True) + 1e-10)


#: The seed of the authors' bank draw: ``np.random.seed(args.seed)`` with ``--seed`` default 0 (run_imagenet.py).
BANK_SEED = 0


def knn_bank_rows(num_samples: int, fraction: float, seed: int = BANK_SEED) -> torch.Tensor | None:
    """Sorted indices of the fitting samples kept in the bank, ``int(N fraction)`` of them as the authors draw them
    (``np.random.choice(N, int(N * ALPHA), replace=False)`` after ``np.random.seed(0)``; the order of a bank does not
    change a nearest-neighbour distance); ``None`` for the whole set (``fraction = 1``)."""
    if fraction >= 1.0:
        return None
    chosen = np.random.RandomState(seed).choice(num_samples, int(num_samples * fraction), replace=False)
    return torch.from_numpy(np.sort(chosen))


#: ``bank_dtype`` values: float32 keeps the fitting features' precision (float64 for a float64 model), float16 halves
#: the bank's bytes.
BANK_DTYPES = ("float32", "float16")


def bank_storage_dtype(bank_dtype: str, feature_dtype: torch.dtype) -> torch.dtype:
    """The dtype the bank is held in: ``float16`` for ``bank_dtype="float16"``, else the fitting features' stored
    dtype (:func:`~hf_gsc.detectors.penultimate.stored_dtype`: float32, float64 for a float64 model)."""
    return torch.float16 if bank_dtype == "float16" else stored_dtype(feature_dtype)


def search_dtype(bank: torch.Tensor, feature_dtype: torch.dtype) -> torch.dtype:
    """The precision a bank is searched in: its own, or for a float16 bank the features' stored one
    (:func:`~hf_gsc.detectors.penultimate.stored_dtype`: float32, float64 for a float64 model)."""
    return stored_dtype(feature_dtype) if bank.dtype == torch.float16 else bank.dtype


def bank_squared_norms(bank: torch.Tensor, feature_dtype: torch.dtype, chunk_size: int = 4096) -> torch.Tensor:
    """``||b_i||^2`` of every bank row, ``(N,)``, in the precision the bank is searched in (:func:`search_dtype`; a
    float16 bank widened chunk by chunk): 1 up to the rows' rounding, taken as they are so that the search's distances
    are exact."""
    wide = search_dtype(bank, feature_dtype)
    return torch.cat([bank[start:start + chunk_size].to(wide).square().sum(dim=-1)
                      for start in range(0, bank.shape[0], chunk_size)]) if bank.shape[0] else bank.new_zeros(0, dtype=wide)


def knn_score(features: torch.Tensor, bank: torch.Tensor, k: int, chunk_size: int = 4096,
              squared_norms: torch.Tensor | None = None) -> torch.Tensor:
    """``-||z - z_(k)||_2``: minus the distance of the normalised feature to its ``k``-th nearest normalised
    training feature. ``features (B, D)``, ``bank (N, D)`` already normalised; returns ``(B,)``.

    The neighbours are found chunk by chunk by squared distances ``||q||^2 + ||b||^2 - 2 q.b`` (one ``addmm``, as
    faiss's ``IndexFlatL2`` and ``torch.cdist`` beyond 25 rows compute them), the ``k`` smallest of each chunk kept;
    the score is then the ``k``-th neighbour's distance taken directly, ``||q - b_(k)||``: the expanded form rounds
    relative to ``||q||^2 + ||b||^2`` (about ``1e-7 / d`` in float32 for a distance ``d``, its products' rounding
    varying with the batch's shape), the direct one relative to ``d``. ``squared_norms``: :func:`bank_squared_norms`
    of the bank where it is already known (else taken per chunk, ``N D`` more work per call). A float16 bank is
    searched chunk by chunk, each chunk widened to the query's precision (float32, float64 for float64 features):
    half-precision products are slow or missing on a CPU, and the whole bank is never widened at once. Rounding a
    unit row to float16 moves it by at most ``2**-11`` (relative rounding of each element), so each distance, hence
    the ``k``-th, moves by at most that much."""
    wide = search_dtype(bank, features.dtype)
    query = l2_normalise(features.to(wide))
    query_norms = query.square().sum(dim=-1, keepdim=True)
    # One chunk buffer, reused: a fresh widened chunk per step costs its allocation (page faults on a CPU), about a
    # sixth of the search at N = 50,000, D = 2048.
    widened = None if bank.dtype == wide else torch.empty(min(chunk_size, bank.shape[0]), bank.shape[1], dtype=wide,
                                                           device=bank.device)
    nearest, rows = [], []
    for start in range(0, bank.shape[0], chunk_size):
        chunk = bank[start : start + chunk_size]
        if widened is not None:
            chunk = widened[: chunk.shape[0]].copy_(chunk)
        norms = (chunk.square().sum(dim=-1) if squared_norms is None
                 else squared_norms[start : start + chunk_size].to(wide))
        squared = torch.addmm(query_norms + norms[None, :], query, chunk.T, alpha=-2.0)
        kept = squared.topk(min(k, squared.shape[1]), dim=1, largest=False)
        nearest.append(kept.values)
        rows.append(kept.indices + start)
    position = torch.cat(nearest, dim=1).topk(k, dim=1, largest=False).indices[:, -1:]
    kth = bank[torch.cat(rows, dim=1).gather(1, position)[:, 0]].to(wide)
    return -(query - kth).norm(dim=-1)


@dataclass
class KNNConfig(DetectorConfig):
    """Settings of deep nearest neighbours (:class:`KNNDetector`)."""

    method: ClassVar[str] = "knn"
    #: ``bank_fraction`` and ``bank_dtype`` decide the fitted bank (refused on a fitted detector); ``k`` is read when
    #: scoring, not fitting: assignable on a fitted detector (a bank smaller than ``k`` refuses it).
    structural_names: ClassVar[tuple[str, ...]] = ("bank_fraction", "bank_dtype")
    bank_fraction: float = setting(
        1.0, number_check(0.0, 1.0, low_open=True),
        "Fraction of the fitting samples kept in the bank, drawn as the authors' ``ALPHA`` (run_imagenet.py: "
        "``np.random.choice(N, int(N * ALPHA))``, seed 0); 1: the whole set. The paper's ImageNet results use 1 with "
        "``k = 1000`` and 0.01 with ``k = 10``: a bank, and a search, 100 times smaller.")
    bank_dtype: str = setting(
        "float32", choice_check(BANK_DTYPES),
        "The bank's precision. float32: the fitting features' (float64 for a float64 model). float16: half the bytes "
        "(2 N D instead of 4 N D), each row normalised in the features' precision then rounded; the search widens the bank chunk by "
        "chunk, so the score keeps the features' precision (float32) and moves by at most 2**-11 (a distance between unit "
        "vectors lies in [0, 2]).")
    k: int = setting(50, integer_check(1), "The neighbour whose distance is the score: the ``k``-th nearest. 50: the "
                     "paper's CIFAR-10 setting (ImageNet: 1000 with the whole training set, 10 with 1% of it).")


@register_detector
class KNNDetector(FittedDetector):
    """Minus the distance to the ``k``-th nearest L2-normalised ID training feature, :func:`knn_score`.

    Sun, Ming, Zhu, Li, "Out-of-Distribution Detection with Deep Nearest Neighbors", ICML 2022 (code:
    github.com/deeplearning-wisc/knn-ood). The authors' faiss index returns squared distances; the
    ranking, hence every metric, is the same. The bank is the whole normalised training feature set
    ``(N, D)`` (features, not images), held in ``bank_dtype`` (float16: half the bytes, searched widened chunk by chunk).

    Settings: :class:`KNNConfig`.
    """

    config_class = KNNConfig
    search_space = {"k": (1, 10, 50, 100, 200, 500, 1000)}
    search_space_source = ("OpenOOD knn.yml: K_list [50, 100, 200, 500, 1000] (for banks of 50k-1.2M images); 1 and 10 "
                           "added since the bank here is the --max-fit-samples subset. A k above the bank size is left out")
    state_names = ("bank",)

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        # Derived from the bank by _prepare (its rows' squared norms, N numbers); a buffer so that .to(device) moves it.
        self.register_buffer("bank_squared_norms", None, persistent=False)

    def fit_requirement(self) -> tuple[int, str]:
        k, fraction = self.hyperparameters["k"], self.hyperparameters["bank_fraction"]
        if fraction >= 1.0:
            return k, f"k={k} neighbours"
        needed = math.ceil(k / fraction)
        while int(needed * fraction) < k:  # int() of a rounded product: the smallest N whose bank holds k
            needed += 1
        return needed, f"k={k} neighbours in a bank of bank_fraction={fraction} of them"

    def _fit(self, accumulated: FeatureStore) -> None:
        # Normalised batch by batch into the one bank tensor: the fit holds the stored features and the bank, never a
        # concatenation of either.
        self.check_fit_count(accumulated.count)
        batches = accumulated.features
        rows = knn_bank_rows(accumulated.count, self.hyperparameters["bank_fraction"])
        chosen = iter(batches) if rows is None else take_rows(batches, rows)
        self.bank = torch.empty(accumulated.count if rows is None else rows.numel(), batches[0].shape[1],
                                dtype=bank_storage_dtype(self.hyperparameters["bank_dtype"], batches[0].dtype))
        filled = 0
        for features in chosen:
            # Normalised in the features' precision, rounded once by the copy into a float16 bank.
            self.bank[filled:filled + features.shape[0]] = l2_normalise(features)
            filled += features.shape[0]

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"bank": (None, self.feature_dim)}

    def _prepare(self) -> None:
        # A loaded bank's precision must be the config's: refused rather than converted, since widening a float16 bank
        # would not restore the float32 one (and rounding a float32 one changes the fitted state the record names).
        bank_dtype = self.hyperparameters["bank_dtype"]
        if (self.bank.dtype == torch.float16) != (bank_dtype == "float16"):
            saved = "float16" if self.bank.dtype == torch.float16 else "float32"
            raise ValueError(
                f"{self.method}: the bank is {self.bank.dtype} but bank_dtype={bank_dtype!r}; load it with "
                f"bank_dtype={saved!r} (what it was fitted with), or fit a new detector with bank_dtype={bank_dtype!r}")
        # The bank, fitted or loaded, must hold k rows (a fraction of the fitting samples where bank_fraction < 1).
        k = self.hyperparameters["k"]
        check_fit_samples(self.method, self.bank.shape[0], k, f"k={k} neighbours in the bank")
        self.bank_squared_norms = bank_squared_norms(self.bank, self.head.weight.dtype)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return knn_score(self.features(batch), self.bank, self.hyperparameters["k"],
                         squared_norms=self.bank_squared_norms)
