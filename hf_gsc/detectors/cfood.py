"""CFOOD: the neighbourhood fraction at which a sample's distance becomes typical of the ID reference set, as OpenOOD
v1.5 runs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from ..settings.config import DetectorConfig, number_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .knn import l2_normalise
from .penultimate import FeatureStore, stored_dtype


#: The seed of the reference subsample (OpenOOD draws an unseeded ``torch.randperm``).
REFERENCE_SEED = 0
#: Rows of the reference set per step of the fit's self-distances and of the scoring.
CHUNK_ROWS = 1024


def neighbour_fractions() -> np.ndarray:
    """The code's grid of neighbourhood fractions ``kval``: 100 from 0.001 to 0.1, 81 from 0.105 to 0.5, 49 from 0.51
    to 0.99 (float64)."""
    return np.concatenate((np.linspace(0.001, 0.1, 100), np.linspace(0.105, 0.5, 81), np.linspace(0.51, 0.99, 49)))


def neighbour_positions(count: int) -> tuple[np.ndarray, np.ndarray]:
    """``(kval, kpos)`` for a reference set of ``count`` rows: ``kpos = int(kval count - 1)`` (truncated toward zero,
    as ``np.array(..., dtype=int)``), each fraction kept only where its position is above the previous one's."""
    kval = neighbour_fractions()
    kpos = np.array(kval * count - 1, dtype=int)
    keep = np.concatenate(([True], kpos[:-1] < kpos[1:]))
    return kval[keep], kpos[keep]


def squared_distances(queries: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``||q - r||^2`` of every pair, ``(B, D), (n, D) -> (B, n)`` (expanded, clamped at 0)."""
    squared = (queries ** 2).sum(-1, keepdim=True) + (reference ** 2).sum(-1)[None, :] - 2.0 * queries @ reference.T
    return squared.clamp_(min=0.0)


def self_neighbour_distances(reference: torch.Tensor, positions: torch.Tensor, chunk_rows: int = CHUNK_ROWS
                             ) -> torch.Tensor:
    """Each reference row's squared distance to its ``(kpos + 1)``-th nearest row (the ``+ 1`` skips itself), the
    code's ``knndst``: ``(n, len(kpos))``, ``chunk_rows`` rows sorted at a time."""
    return torch.cat([squared_distances(reference[start:start + chunk_rows], reference).sort(dim=1).values[
        :, positions + 1] for start in range(0, reference.shape[0], chunk_rows)])


def cfood_score(features: torch.Tensor, reference: torch.Tensor, neighbour_distances: torch.Tensor,
                fractions: torch.Tensor, k: float, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """``-kappa``: ``kappa`` the first fraction of the grid at which at least a share ``k`` of the reference rows have
    their neighbour distance at or above the sample's own distance to them (1 where none does); the code's
    ``postprocess`` on normalised features ``(B, D)``, ``(B,)``."""
    at_or_above = torch.zeros(features.shape[0], fractions.shape[0], dtype=torch.long, device=features.device)
    for start in range(0, reference.shape[0], chunk_rows):
        distances = squared_distances(features, reference[start:start + chunk_rows])  # (B, c)
        block = neighbour_distances[start:start + chunk_rows].to(distances)  # (c, klen)
        at_or_above += (block[None, :, :] >= distances[:, :, None]).sum(dim=1)
    reached = at_or_above.to(torch.float64) / reference.shape[0] >= k
    first = torch.where(reached.any(dim=1), reached.to(torch.int8).argmax(dim=1), fractions.shape[0])
    kappa = torch.cat([fractions.to(torch.float64), fractions.new_ones(1, dtype=torch.float64)])[first]
    return -kappa


@dataclass
class CFOODConfig(DetectorConfig):
    """Settings of CFOOD (:class:`CFOODDetector`)."""

    method: ClassVar[str] = "cfood"
    structural_names: ClassVar[tuple[str, ...]] = ("alpha",)  # k applies at scoring
    alpha: float = setting(0.1, number_check(0.0, 1.0, low_open=True),
                           "Share of the ID training features kept as the reference set; 0.1: OpenOOD cfood.yml "
                           "``postprocessor_args``.")
    k: float = setting(0.01, number_check(0.0, 1.0),
                       "Share of the reference rows whose neighbour distance must reach the sample's; 0.01: OpenOOD "
                       "cfood.yml ``postprocessor_args``.")


@register_detector
class CFOODDetector(FittedDetector):
    """Minus the smallest neighbourhood fraction ``kappa`` of the grid at which at least a share ``k`` of the ID
    reference rows are as far from their own ``kappa n``-th neighbour as the sample is from them (:func:`cfood_score`).

    The reference is OpenOOD v1.5's ``openood/postprocessors/cfood_postprocessor.py`` with
    ``configs/postprocessors/cfood.yml`` (the only public code found; no paper of its is cited there): the reference
    set is a share ``alpha`` of the L2-normalised ID training features, and for each of its ``n`` rows the squared
    distance to its ``(int(kval n - 1) + 1)``-th nearest row is kept for every fraction ``kval`` of a fixed grid of
    230 (:func:`neighbour_fractions`). A sample's score is ``-kappa``, ``kappa`` the first fraction at which at least
    ``k n`` reference rows have that distance at or above the sample's squared distance to them.

    Where this differs from OpenOOD: the reference subsample is drawn with a seeded generator
    (:data:`REFERENCE_SEED`), where OpenOOD's ``torch.randperm`` is unseeded, so that a fit is reproducible; the
    squared distances are expanded (``||q||^2 + ||r||^2 - 2 q.r``, clamped at 0) where OpenOOD sums ``(q - r)^2``, the
    same up to rounding; the share ``count / n`` is compared with ``k`` in float64.

    Cost: the fit sorts every reference row's distances to all ``n`` rows (``n^2 D`` work and ``n^2 log n`` sorting,
    ``CHUNK_ROWS`` rows at a time; at ImageNet-1K, ``alpha = 0.1`` gives ``n = 128,116``); scoring is ``B n D`` work
    and a ``(B, CHUNK_ROWS, 230)`` comparison per chunk. The reference set and its neighbour distances are saved.

    Settings: :class:`CFOODConfig`.
    """

    config_class = CFOODConfig
    search_space = {"alpha": (0.1, 0.5, 1.0), "k": (0.001, 0.005, 0.01, 0.05)}
    search_space_source = ("OpenOOD cfood.yml postprocessor_sweep: every [alpha, k] of alpha [0.1, 0.5, 1] and "
                           "k [0.001, 0.005, 0.01, 0.05]")
    #: ``fractions``: the grid's fractions whose positions are distinct at this ``n`` (``kval`` of the code).
    state_names = ("reference", "neighbour_distances", "fractions")

    def reference_count(self, count: int) -> int:
        """``n = int(alpha N)`` for ``alpha < 1``, else ``N`` (the code's)."""
        alpha = self.hyperparameters["alpha"]
        return int(alpha * count) if alpha < 1.0 else count

    def fit_requirement(self) -> tuple[int, str]:
        needed = 2
        while self.reference_count(needed) < 2:
            needed += 1
        return needed, "a reference set of at least 2 rows (a row's neighbour other than itself)"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"reference": (None, self.feature_dim), "neighbour_distances": (None, None), "fractions": (None,)}

    def _fit(self, accumulated: FeatureStore) -> None:
        self.check_fit_count(accumulated.count)
        dtype = stored_dtype(accumulated.features[0].dtype)
        features = torch.cat([l2_normalise(batch.to(dtype)) for batch in accumulated.features])
        count = self.reference_count(features.shape[0])
        if count < features.shape[0]:
            chosen = torch.randperm(features.shape[0], generator=torch.Generator().manual_seed(REFERENCE_SEED))[:count]
            features = features[chosen]
        kval, kpos = neighbour_positions(count)
        self.reference = features.contiguous()
        self.neighbour_distances = self_neighbour_distances(self.reference, torch.from_numpy(kpos))
        self.fractions = torch.from_numpy(kval)

    def _prepare(self) -> None:
        if self.neighbour_distances.shape != (self.reference.shape[0], self.fractions.shape[0]):
            raise ValueError(f"cfood: neighbour_distances has shape {tuple(self.neighbour_distances.shape)}, expected "
                             f"(reference rows {self.reference.shape[0]}, fractions {self.fractions.shape[0]})")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = l2_normalise(self.features(batch).to(self.reference.dtype))
        return cfood_score(features, self.reference, self.neighbour_distances, self.fractions, self.hyperparameters["k"])
