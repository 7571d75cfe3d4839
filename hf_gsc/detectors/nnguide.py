"""NNGuide: nearest-neighbour guidance (Park, Jung & Teoh, ICCV 2023)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as nnf

from ..settings.config import DetectorConfig, integer_check, number_check, setting
from ..utils.precision import full_precision, step_dtype
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead, take_rows


#: The seed of the authors' bank subsample: their main.py ``--seed`` default 0 (``set_seed``), then
#: ``np.random.shuffle`` in ``dataloaders/factory.py`` ``subsample``.
BANK_SEED = 0

#: Bank rows compared with a batch at once: the similarities held are ``B x (BANK_CHUNK_ROWS + k)`` (64 MB in float32
#: for B = 256), whatever the bank size.
BANK_CHUNK_ROWS = 65536


def nnguide_normalise(features: torch.Tensor) -> torch.Tensor:
    """``z / max(||z||_2, 1e-12)`` row-wise: ``F.normalize(z, dim=1)`` of the authors' ``extract_features``."""
    return nnf.normalize(features, dim=-1)


def bank_rows(num_samples: int, alpha: float, k: int, seed: int = BANK_SEED) -> torch.Tensor:
    """Indices (sorted) of the fitting samples in the bank: the authors' ``subsample``, the first ``int(N alpha)`` of
    ``np.random.RandomState(seed).permutation(N)`` (what their ``np.random.seed(0); np.random.shuffle(arange(N))``
    draws), but at least ``k`` (their faiss search pads a bank of fewer than ``k`` rows with -3.4e38) and at most
    ``N``."""
    count = min(num_samples, max(k, int(num_samples * alpha)))
    chosen = np.random.RandomState(seed).permutation(num_samples)[:count]
    return torch.from_numpy(np.sort(chosen))


def guided_bank(features: torch.Tensor, head: LinearHead) -> torch.Tensor:
    """``normalise(z_i) * logsumexp(W z_i + b)``: each bank feature scaled by its confidence (energy of its logits).
    ``(M, D) -> (M, D)`` in the features' dtype."""
    return nnguide_normalise(features) * energy_score(head(features))[:, None]


def top_k_mean_similarity(query: torch.Tensor, bank: torch.Tensor, k: int,
                          chunk_size: int = BANK_CHUNK_ROWS) -> torch.Tensor:
    """Mean of the ``k`` largest inner products ``<q, b_i>`` of each query row with the bank rows (faiss
    ``IndexFlatIP`` search, then ``D.mean(axis=1)`` in the authors' ``knn_score``). The bank is taken ``chunk_size``
    rows at a time, keeping a running top ``k``, so no ``(B, N)`` matrix of the whole bank is formed.
    ``(B, D), (N, D) -> (B,)``, in the inputs' dtype."""
    if bank.shape[0] < k:
        raise ValueError(f"the bank has {bank.shape[0]} rows, fewer than k={k}")
    best = query.new_empty(query.shape[0], 0)
    for start in range(0, bank.shape[0], chunk_size):
        candidates = torch.cat([best, query @ bank[start:start + chunk_size].T], dim=1)
        best = candidates.topk(min(k, candidates.shape[1]), dim=1).values
    return best.mean(dim=1)


def nnguide_score(features: torch.Tensor, head: LinearHead, bank_guide: torch.Tensor, k: int,
                  chunk_size: int = BANK_CHUNK_ROWS) -> torch.Tensor:
    """``mean_topk <normalise(z), g_i> * logsumexp(W z + b)``: the guidance (:func:`top_k_mean_similarity` with the
    guided bank, :func:`guided_bank`) times the sample's energy. ``(B, D) -> (B,)``, in the bank's dtype."""
    features = features.to(bank_guide.dtype)
    guidance = top_k_mean_similarity(nnguide_normalise(features), bank_guide, k, chunk_size)
    return guidance * energy_score(head(features))


@dataclass
class NNGuideConfig(DetectorConfig):
    """Settings of nearest-neighbour guidance (:class:`NNGuideDetector`)."""

    method: ClassVar[str] = "nnguide"
    k: int = setting(10, integer_check(1),
                     "Neighbours in the bank averaged; 10: the authors' ``configs/detector/nnguide.yaml`` "
                     "``knn_k: 10``, also their code's fallback (OpenOOD's nnguide.yml has ``K: 100``).")
    alpha: float = setting(0.01, number_check(0.0, 1.0, low_open=True),
                           "The fraction of the fitting samples in the bank; 0.01: the authors' "
                           "``get_train_dataloader`` ``bankset_ratio=0.01`` (OpenOOD nnguide.yml ``alpha: 0.01``).")


@register_detector
class NNGuideDetector(FittedDetector):
    """The energy guided by the nearest ID training features, :func:`nnguide_score`.

    Park, Jung, Teoh, "Nearest Neighbor Guidance for Out-of-Distribution Detection", ICCV 2023. Reference: the
    authors' code (github.com/roomo7time/nnguide: ``ood_detectors/nnguide.py``, ``ood_detectors/assets.py``
    ``knn_score``, ``model_engines/assets.py`` ``extract_features``, ``dataloaders/factory.py`` ``subsample``).

    Fit, on ID *train* data (as the authors and OpenOOD): a bank of ``M`` training features ``z_i`` (the input of the
    classifier), each L2-normalised and multiplied by its confidence ``logsumexp(W z_i + b)``. The authors take the
    logits from the model; here they are the head ``W z + b`` (the last ``nn.Linear``, the classifier), the model's
    own logits at the penultimate split. Score: the guidance, the mean of the ``k`` largest inner products of the
    normalised feature with the bank, times the sample's energy ``logsumexp(W z + b)``.

    Bank: ``M = int(alpha N)`` of the ``N`` fitting samples, drawn as the authors' ``subsample`` draws them
    (:func:`bank_rows`; the same rows for the same data order), and at least ``k``. Fitted state: ``bank_guide``,
    ``M x D`` in the features' dtype (float32 for a float32 or bf16 model): ImageNet-1K at 1% (12,811 images) with
    ResNet-50 (``D = 2048``) is 105 MB; a bank of all 1,281,167 images (``alpha=1``) is 10.5 GB, which fits one GPU,
    and is scored in chunks of :data:`BANK_CHUNK_ROWS` rows (no ``B x N`` similarity matrix). The fit itself reads
    the ``N x D`` fitting features held once on the CPU (:class:`~hf_gsc.detectors.penultimate.FeatureStore`,
    shared with the other methods of the pass that read every feature), and computes only the ``M`` bank rows.

    Differences from the authors' code: (1) where ``int(alpha N) < k`` the bank holds ``k`` rows (the first ``k`` of
    the same random order) instead of faiss's padding of the missing neighbours with -3.4e38; (2) inner products in
    the bank's dtype (float64 for a float64 model) by torch instead of faiss (float32). Their ResNet-50
    results use a ReAct-clipped backbone (``resnet50-react``: features clipped at the 95th percentile of the bank's
    activations) for both the bank and the queries: a choice of model, not of the detector, not made here.
    OpenOOD v1.5's ``nnguide_postprocessor.py`` differs from the authors': its normaliser is ``z / ||z|| + 1e-10``
    (the epsilon added to every coordinate), its bank is the *first* training batches until they hold more than
    ``int(alpha N)`` images (so it depends on the batch size and on the loader's order; its evaluator does not
    shuffle by default), and its ``K`` is 100.

    Settings: :class:`NNGuideConfig`.
    """

    config_class = NNGuideConfig
    search_space = {"k": (10, 100)}
    search_space_source = ("the two published settings: k=10 (the authors' configs/detector/nnguide.yaml knn_k) and "
                           "K=100 (OpenOOD nnguide.yml, whose sweep is that single point K [100] x alpha [0.01]); "
                           "alpha stays at both sources' 0.01. A k above the fitting set's size is left out")
    state_names = ("bank_guide",)
    #: Rows of the bank per similarity block when scoring (:func:`top_k_mean_similarity`); the score does not depend
    #: on it.
    bank_chunk_rows: int = BANK_CHUNK_ROWS

    def fit_requirement(self) -> tuple[int, str]:
        return self.hyperparameters["k"], f"k={self.hyperparameters['k']} neighbours in the bank"

    def _fit(self, accumulated: FeatureStore) -> None:
        batches = accumulated.features  # the stored batches, read in place
        total = sum(batch.shape[0] for batch in batches)
        self.check_fit_count(total)
        rows = bank_rows(total, self.hyperparameters["alpha"], self.hyperparameters["k"])
        dtype = step_dtype(batches[0].dtype)
        # The confidence in float64 (a logsumexp over K classes), on the CPU where the fitting features are.
        head = LinearHead(self.head_weight.detach().to("cpu", torch.float64),
                          self.head_bias.detach().to("cpu", torch.float64))
        bank = torch.empty(rows.numel(), batches[0].shape[1], dtype=dtype)
        filled = 0
        with full_precision(torch.device("cpu")):
            for chosen in take_rows(batches, rows):
                bank[filled:filled + chosen.shape[0]] = guided_bank(chosen.double(), head).to(dtype)
                filled += chosen.shape[0]
        self.bank_guide = bank

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"bank_guide": (None, self.feature_dim)}

    def _prepare(self) -> None:
        self.check_fit_count(self.bank_guide.shape[0])

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """Similarities, top-k and energy in the bank's dtype with autocast off (:mod:`hf_gsc.utils.precision`): an
        autocast bf16 matmul would round the similarities that the top-k ranks."""
        features = self.features(batch)
        with full_precision(features.device), torch.no_grad():
            return nnguide_score(features, self.head, self.bank_guide, self.hyperparameters["k"],
                                 self.bank_chunk_rows)
