"""NNGuide: nearest-neighbour guidance (Park, Jung & Teoh, ICCV 2023)."""

from __future__ import annotations

import math
from typing import Iterator

import torch

from ..backbone_pass import BackbonePass
from ..detector import register_detector
from ..features import LinearHead, collect_features
from ..scores import energy_score
from .common import FittedDetector


def nnguide_normalise(features: torch.Tensor) -> torch.Tensor:
    """``z / ||z||_2 + 1e-10``, the NNGuide code's ``normalizer`` (the epsilon is added after the division)."""
    return features / features.norm(dim=-1, keepdim=True) + 1e-10


def top_k_mean_similarity(query: torch.Tensor, bank: torch.Tensor, k: int, chunk_size: int = 65536) -> torch.Tensor:
    """Mean of the ``k`` largest inner products ``<q, b>`` of each query row with the bank rows, the bank taken
    ``chunk_size`` rows at a time so that no ``(B, N)`` matrix of the whole bank is held (a 1.28M x 2048 bank is
    10.5 GB in float32; a chunk's similarities are ``B x chunk_size``). ``(B, D), (N, D) -> (B,)``."""
    best = None
    for start in range(0, bank.shape[0], chunk_size):
        similarities = query @ bank[start:start + chunk_size].T
        candidates = similarities if best is None else torch.cat([best, similarities], dim=1)
        best = candidates.topk(min(k, candidates.shape[1]), dim=1).values
    return best.mean(dim=1)


def nnguide_score(features: torch.Tensor, head: LinearHead, bank_guide: torch.Tensor, k: int) -> torch.Tensor:
    """``mean_topk <z_hat, g_i> * logsumexp(W z + b)``: the guidance (mean of the ``k`` largest inner products of the
    normalised feature with the confidence-scaled bank) times the energy; ``(B, D) -> (B,)``, float64."""
    features = features.double()
    guidance = top_k_mean_similarity(nnguide_normalise(features), bank_guide.double(), k)
    return guidance * energy_score(head(features))


@register_detector
class NNGuideDetector(FittedDetector):
    """Energy guided by the nearest ID training features, :func:`nnguide_score`.

    Park, Jung, Teoh, "Nearest Neighbor Guidance for Out-of-Distribution Detection", ICCV 2023 (code:
    github.com/roomo7time/nnguide; OpenOOD v1.5 ``nnguide_postprocessor.py``, the reference). The bank holds the
    normalised ID training features, each multiplied by its confidence (the energy ``logsumexp`` of its logits,
    here ``W z + b`` of the classifier, which is the model's own logits at the penultimate split); a sample's
    guidance is the mean of its ``k`` largest inner products with the bank (faiss ``IndexFlatIP`` in the code).

    Bank size: OpenOOD keeps the first batches of the training loader until they exceed ``alpha`` (1%) of the
    training set, so its size depends on the batch size; here it is the first ``ceil(alpha * N)`` fitting samples,
    and at least ``k`` (``alpha`` of a few thousand fitting images would hold fewer than ``k`` rows), whatever the
    batching. The saved bank is ``M x D`` floats (12,800 x 2048 float64 = 210 MB for ImageNet-1K at 1%, ResNet-50);
    scoring takes it in chunks (:func:`top_k_mean_similarity`), so even a bank of all 1.28M ImageNet images
    (``alpha=1``, 21 GB float64) is scored without a ``B x N`` matrix.

    Hyperparameters:
        k: ``100`` (OpenOOD nnguide.yml ``K``; the paper's ImageNet setting).
        alpha: ``0.01`` (OpenOOD nnguide.yml: the fraction of the training set in the bank).
    """

    method = "nnguide"
    defaults = {"k": 100, "alpha": 0.01}
    search_space_source = ("not tuned: OpenOOD's nnguide.yml sweep is the single point K [100] x alpha [0.01] "
                           "(APS_mode False)")
    state_names = ("bank_guide",)

    def validate(self) -> None:
        self._integer("k", 1)
        self._number("alpha", 0.0, 1.0, low_open=True)

    def fit_requirement(self) -> tuple[int, str]:
        return self.hyperparameters["k"], f"k={self.hyperparameters['k']} neighbours in the bank"

    def bank_size(self, num_samples: int) -> int:
        """Rows of the bank for ``num_samples`` fitting samples: ``ceil(alpha N)``, at least ``k``, at most ``N``."""
        return min(num_samples, max(self.hyperparameters["k"], math.ceil(self.hyperparameters["alpha"] * num_samples)))

    def _fit(self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        features, _ = collect_features(stream)
        self.check_fit_count(features.shape[0])
        features = features[: self.bank_size(features.shape[0])].double()
        confidence = energy_score(self.head(features.to(self.head_weight.dtype)).double())
        self.bank_guide = nnguide_normalise(features) * confidence[:, None]

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"bank_guide": (None, self.feature_dim)}

    def _prepare(self) -> None:
        self.check_fit_count(self.bank_guide.shape[0])

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return nnguide_score(self.features(batch), self.head, self.bank_guide, self.hyperparameters["k"])
