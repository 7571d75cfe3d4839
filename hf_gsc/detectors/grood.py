"""GROOD: gradient-aware OOD detection with class prototypes (OpenOOD v1.5's ``grood.py``), in its ID-only mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, integer_check, setting
from .backbone_pass import BackbonePass
from .cfood import squared_distances
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, stored_dtype


#: Bank rows per step of the nearest-gradient search.
CHUNK_ROWS = 65_536


def noise_prototype_gradients(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """The gradient of ``CE(-||z - p_j||, c)`` (the nearest-centroid logits over the class prototypes and, last, the
    noise prototype; ``c`` a class) with respect to the noise prototype: ``softmax_noise * (z - p_noise) /
    ||z - p_noise||``, the same for every class label ``c`` (its one-hot term is 0 at the noise entry), ``(B, D)``.
    ``prototypes`` ``(K + 1, D)``, the noise prototype last. The code's autograd gradient, and its
    ``use_direct_grad`` formula."""
    logits = -torch.cdist(features, prototypes)
    towards = features - prototypes[-1]
    return torch.softmax(logits, dim=1)[:, -1:] * nn.functional.normalize(towards, dim=1)


def kth_nearest_squared(queries: torch.Tensor, bank: torch.Tensor, k: int, chunk_rows: int = CHUNK_ROWS
                        ) -> torch.Tensor:
    """The ``k``-th smallest squared L2 distance of each query to the bank rows (faiss's ``search(x, k)[0][:, -1]``),
    ``(B,)``, chunked over the bank."""
    kept = [squared_distances(queries, bank[start:start + chunk_rows].to(queries)).topk(
        min(k, bank[start:start + chunk_rows].shape[0]), dim=1, largest=False).values
        for start in range(0, bank.shape[0], chunk_rows)]
    return torch.cat(kept, dim=1).topk(k, dim=1, largest=False).values[:, -1]


@dataclass
class GROODConfig(DetectorConfig):
    """Settings of GROOD (:class:`GROODDetector`)."""

    method: ClassVar[str] = "grood"
    structural_names: ClassVar[tuple[str, ...]] = ()  # k applies at scoring
    k: int = setting(1, integer_check(1), "The neighbour whose distance is the score; 1: OpenOOD grood.yaml ``k``.")


@register_detector
class GROODDetector(FittedDetector):
    """Minus the squared distance of the sample's gradient with respect to the noise prototype to the ``k``-th nearest
    such gradient of the correctly classified ID training samples (:func:`noise_prototype_gradients`).

    The reference is OpenOOD v1.5's ``openood/postprocessors/grood.py`` with ``configs/postprocessors/grood.yaml``:
    class prototypes are the means of the penultimate ID training features by label; a noise prototype is added;
    each sample's nearest-centroid cross-entropy (against its predicted class) is differentiated with respect to the
    noise prototype, and the gradients of the training samples that the model classifies correctly are indexed.

    The ID-only mode: OpenOOD's yaml builds the noise prototype from its OOD validation set (``use_val_ood: True``);
    here it is the mean of the class prototypes (its ``use_proto_mean`` option), which reads ID data only. Where this
    differs from OpenOOD's code otherwise: the search is exact (OpenOOD's faiss ``IndexIVFFlat``, trained on the first
    ``min(600, 0.8 n_batches)`` batches' gradients and searched with ``nprobe = 4``, is approximate), and every
    correctly classified training sample is indexed (OpenOOD leaves out the batch at which it trains the index). Left
    out: the other noise prototypes (Gaussian-noise images, mixup through an intermediate layer) and the variants its
    flags select (cosine search, gradient norms, distances without gradients).

    Cost: the bank holds one gradient per correctly classified training sample, ``N D`` floats, saved; scoring is the
    ``B (K + 1) D`` prototype distances and a ``B N D`` search, chunked.

    Settings: :class:`GROODConfig`.
    """

    config_class = GROODConfig
    search_space = {"k": (1, 10, 20, 50, 100)}
    search_space_source = "OpenOOD grood.yaml postprocessor_sweep: k [1, 10, 20, 50, 100]"
    needs_labels = True
    state_names = ("prototypes", "bank")

    def fit_requirement(self) -> tuple[int, str]:
        return max(self.num_classes, self.hyperparameters["k"]), "one sample of every class, and k indexed gradients"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"prototypes": (self.num_classes + 1, self.feature_dim), "bank": (None, self.feature_dim)}

    def _fit(self, accumulated: FeatureStore) -> None:
        self.check_fit_count(accumulated.count)
        dtype = stored_dtype(accumulated.features[0].dtype)
        sums = torch.zeros(self.num_classes, self.feature_dim, dtype=torch.float64)
        counts = torch.zeros(self.num_classes, dtype=torch.float64)
        for features, labels in accumulated.batches():
            sums.index_add_(0, labels, features.double())
            counts += torch.bincount(labels, minlength=self.num_classes).double()
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"detector 'grood' needs at least one ID sample of every class; classes {empty} have none")
        means = (sums / counts[:, None]).to(dtype)
        self.prototypes = torch.cat([means, means.mean(dim=0, keepdim=True)])
        weight, bias = self.head.weight.to("cpu", dtype), self.head.bias.to("cpu", dtype)
        gradients = []
        for features, labels in accumulated.batches():
            features = features.to(dtype)
            correct = (features @ weight.T + bias).argmax(dim=1) == labels
            gradients.append(noise_prototype_gradients(features[correct], self.prototypes))
        self.bank = torch.cat(gradients)
        if self.bank.shape[0] < self.hyperparameters["k"]:
            raise ValueError(f"grood: {self.bank.shape[0]} correctly classified training samples, fewer than "
                             f"k = {self.hyperparameters['k']}")

    def _prepare(self) -> None:
        if self.bank.shape[0] < self.hyperparameters["k"]:
            raise ValueError(f"grood: k = {self.hyperparameters['k']} is above the {self.bank.shape[0]} indexed "
                             "gradients")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch).to(self.bank.dtype)
        gradients = noise_prototype_gradients(features, self.prototypes.to(features))
        return -kth_nearest_squared(gradients, self.bank, self.hyperparameters["k"])
