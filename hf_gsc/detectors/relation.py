"""Relation: the neural relation graph's edge sum (Kim, Yun & Song, NeurIPS 2023), as OpenOOD v1.5 runs it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, number_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead, stored_dtype


#: Bank rows per step of the scoring: a ``(B, 65,536)`` kernel block at a time, whatever the bank's size.
CHUNK_ROWS = 65_536


def relation_normalise(features: torch.Tensor) -> torch.Tensor:
    """``f / sqrt(sum(f^2) + 1e-10)`` row-wise, the code's ``normalize``."""
    return features / torch.sqrt((features ** 2).sum(-1) + 1e-10).reshape(-1, 1)


def relation_score(features: torch.Tensor, probabilities: torch.Tensor, bank: torch.Tensor,
                   bank_probabilities: torch.Tensor, power: float, cutoff: float,
                   chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """``sum_j sign(r_j) |r_j|^power`` over the bank's edges with ``|r_j| > cutoff``, ``r_j = max(f.f_j, 0) (p.p_j)``:
    the code's ``get_relation`` (``kernel`` then the masked edge sum) for normalised features ``f`` ``(B, D)`` and
    softmax probabilities ``p`` ``(B, K)`` against the bank's ``(N, D)``, ``(N, K)``; ``(B,)``, chunked over the bank
    rows."""
    total = features.new_zeros(features.shape[0])
    for start in range(0, bank.shape[0], chunk_rows):
        dot = (features @ bank[start:start + chunk_rows].to(features).T).clamp(min=0.0)
        relation = dot * (probabilities @ bank_probabilities[start:start + chunk_rows].to(probabilities).T)
        kept = (relation.abs() > cutoff) * relation
        total += (kept.sign() * kept.abs() ** power).sum(-1)
    return total


@dataclass
class RelationConfig(DetectorConfig):
    """Settings of the neural relation graph score (:class:`RelationDetector`)."""

    method: ClassVar[str] = "relation"
    structural_names: ClassVar[tuple[str, ...]] = ()  # the bank does not depend on either setting
    power: float = setting(1.0, number_check(0.0, math.inf, low_open=True),
                           "Exponent of each kept edge (``pow``); 1: OpenOOD relation.yml ``postprocessor_args``.")
    cutoff: float = setting(0.03, number_check(0.0, math.inf),
                            "Edges at or below it are dropped (``thres``); 0.03: the default of the code's "
                            "``get_relation``, which OpenOOD calls without it.")


@register_detector
class RelationDetector(FittedDetector):
    """The sum of a sample's edges to the ID training samples in the neural relation graph, an edge being the cosine
    similarity of the penultimate features (clipped at 0) times the dot product of the softmax probabilities
    (:func:`relation_score`).

    Kim, Yun, Song, "Neural Relation Graph: A Unified Framework for Identifying Label Noise and Outlier Data", NeurIPS
    2023 (code: github.com/snu-mllab/Neural-Relation-Graph). The reference is OpenOOD v1.5's
    ``openood/postprocessors/relation_postprocessor.py`` (borrowed from the authors' code) with
    ``configs/postprocessors/relation.yml``: the bank is every ID training sample's normalised feature and softmax
    probabilities; a sample's score sums ``max(f.f_j, 0)^power (p.p_j)^power`` over the bank edges above ``cutoff``.
    OpenOOD runs it with ``APS_mode: True``, choosing ``power`` on its OOD validation set; here the default is its
    ``postprocessor_args`` and ``--tune`` searches its grid on ID validation data with generated OOD validation sets
    only (the ID-only mode).

    Cost: the bank holds every fitting sample, ``N (D + K)`` floats (float32; float64 for a float64 model), saved
    with the detector; scoring is ``B N (D + K)`` work, chunked over the bank (:data:`CHUNK_ROWS`).

    Settings: :class:`RelationConfig`.
    """

    config_class = RelationConfig
    search_space = {"power": (1.0, 2.0, 4.0, 6.0, 8.0)}
    search_space_source = "OpenOOD relation.yml postprocessor_sweep: pow_list [1, 2, 4, 6, 8]"
    state_names = ("bank", "bank_probabilities")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"bank": (None, self.feature_dim), "bank_probabilities": (None, self.num_classes)}

    def _fit(self, accumulated: FeatureStore) -> None:
        # Each stored batch normalised and classified on its own (no concatenated copy of the raw features).
        self.check_fit_count(accumulated.count)
        dtype = stored_dtype(accumulated.features[0].dtype) if accumulated.features else torch.float32
        head = LinearHead(self.head.weight.to(dtype), self.head.bias.to(dtype))
        self.bank = torch.cat([relation_normalise(features.to(dtype)) for features in accumulated.features])
        self.bank_probabilities = torch.cat([torch.softmax(head(features.to(dtype)), dim=1)
                                             for features in accumulated.features])

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch).to(self.bank.dtype)
        probabilities = torch.softmax(self.head(features), dim=1)
        return relation_score(relation_normalise(features), probabilities, self.bank, self.bank_probabilities,
                              self.hyperparameters["power"], self.hyperparameters["cutoff"])
