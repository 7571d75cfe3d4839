"""ActSub: activation subspaces (Zöngür, Hesse & Roth, ICCV 2025), the authors' OpenOOD postprocessor."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, choice_check, integer_check, number_check, setting
from ..utils.scores import energy_score
from .ash import ash_keep_count, ash_shape
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, linear_head, stored_dtype
from .rankfeat import pools_spatially
from .scale import scale_shape


#: The authors keep a random tenth of the training embeddings (``torch.randperm(N)[:N // 10]``), drawn here with this
#: seed (theirs is unseeded).
SAMPLE_DIVISOR, SAMPLE_SEED = 10, 0
#: Neighbours averaged in the cosine similarity of the insignificant component (``f_cossim``'s ``k``).
NEIGHBOURS = 10
SHAPINGS = ("scale", "ash_s")


def subspace_transforms(weight: torch.Tensor, c_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(V_:c^T V_:c, V_c:^T V_c:)``: the projections on the first ``c_idx`` right singular vectors of the classifier
    weight ``(K, D)`` (``torch.linalg.svd``, full) and on the rest, each ``(D, D)`` (the code's ``split_transform``)."""
    _, _, v_t = torch.linalg.svd(weight)
    return v_t.T[:, :c_idx] @ v_t[:c_idx, :], v_t.T[:, c_idx:] @ v_t[c_idx:, :]


def decisive_count(weight: torch.Tensor, samples: torch.Tensor) -> int:
    """The code's ``find_c_idx`` (Equation 4): the ``idx`` in ``0..D-1`` where the mean norm of the samples' projection
    on the first ``idx`` right singular vectors is closest to that on the rest. The norms are taken from the samples'
    coordinates in the singular basis (cumulative sums of squares), ``N D^2`` work where the code projects ``D``
    times (``N D^3``): the same in exact arithmetic."""
    _, _, v_t = torch.linalg.svd(weight)
    squares = (samples @ v_t.T) ** 2
    before = torch.cat([squares.new_zeros(squares.shape[0], 1), squares.cumsum(dim=1)[:, :-1]], dim=1)
    after = squares.flip(1).cumsum(dim=1).flip(1)
    ratios = (before.sqrt().mean(dim=0) - after.sqrt().mean(dim=0)).abs()
    return int(ratios.argmin())


def decisive_energy(features: torch.Tensor, transform: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], shaping: str,
                    percentile: float) -> torch.Tensor:
    """Equation 9: the energy of the head at the decisive component ``z P_dec^T`` shaped by SCALE or ASH-S."""
    component = features @ transform.T
    shaped = scale_shape(component, percentile) if shaping == "scale" else ash_shape(component, "s", percentile)
    return energy_score(head(shaped))


def insignificant_score(features: torch.Tensor, transform: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """Equation 7: ``-log(1 - s)``, ``s`` the mean of the ``NEIGHBOURS`` largest cosine similarities of the
    insignificant component ``z P_ins^T`` to the training samples' (``bank``, normalised rows)."""
    component = nn.functional.normalize(features @ transform.T, dim=1)
    similarity = (component @ bank.T).topk(NEIGHBOURS, dim=1).values.mean(dim=1)
    return -(1.0 - similarity).log()


@dataclass
class ActSubConfig(DetectorConfig):
    """Settings of activation subspaces (:class:`ActSubDetector`)."""

    method: ClassVar[str] = "actsub"
    structural_names: ClassVar[tuple[str, ...]] = ("c_idx",)  # the others apply at scoring
    shaping: str = setting("scale", choice_check(SHAPINGS),
                           "Activation shaping of the decisive component; ``\"scale\"``: the authors' actsub.yml "
                           "``func``.")
    percentile: float | None = setting(
        None, number_check(0.0, 100.0, optional=True),
        "Pruning percentile of the shaping (``pp``); ``None``: the authors' reported values, 97.5 on a transformer "
        "and 95 on a CNN and any other model (actsub.yml's ``pp: 95`` and its comments), 95 where 97.5 would keep no "
        "activation (fewer than 20).")
    lmbd: float | None = setting(
        None, number_check(0.0, math.inf, optional=True),
        "Exponent ``lambda`` of the insignificant score (Equation 10); ``None``: the authors' reported values, 1 on a "
        "transformer and 2 on a CNN and any other model (actsub.yml's ``lmbd: 2`` and its comments).")
    c_idx: int | None = setting(
        None, integer_check(0, optional=True),
        "Number ``k`` of decisive right singular vectors (Equation 4); ``None``: computed from the training samples, "
        "the authors' ``c_idx: -1``. At most the feature width.")


@register_detector
class ActSubDetector(FittedDetector):
    """``E_dec(x) * S_ins(x)^lambda``: the energy of the SCALE-shaped component of the feature in the classifier's
    decisive subspace (:func:`decisive_energy`) times the cosine-similarity score of its insignificant component to
    the training samples' (:func:`insignificant_score`).

    Zöngür, Hesse, Roth, "Activation Subspaces for Out-of-Distribution Detection", ICCV 2025. The reference is the authors'
    code, github.com/visinf/actsub ``actsub_openood/openood/postprocessors/actsub_postprocessor.py`` with
    ``actsub_openood/configs/postprocessors/actsub.yml`` and ``extract_train_samples.py``: the subspaces split the
    right singular vectors of the classifier weight at ``c_idx`` (:func:`decisive_count`); the training samples are a
    random tenth of the ID training features.

    Where this differs from the code: the tenth is drawn with a seeded generator (:data:`SAMPLE_SEED`; theirs is
    unseeded); ``c_idx`` is computed from cumulative sums in the singular basis (see :func:`decisive_count`). The
    authors run it with ``APS_mode: True`` (``lmbd`` and ``pp`` chosen on OOD validation data); here the defaults are
    their reported values and ``--tune`` searches their grids on ID-only validation. Left out: the prototype variant
    (``is_proto``: k-means centres of the samples) and ActSub-GEN.

    Settings: :class:`ActSubConfig`.
    """

    config_class = ActSubConfig
    search_space = {"lmbd": (0.5, 1.0, 1.5, 2.0), "percentile": (85.0, 90.0, 92.5, 95.0, 97.5)}
    search_space_source = "the authors' actsub.yml: lmbd_list [0.5, 1.0, 1.5, 2] x pp_list [85, 90, 92.5, 95, 97.5]"
    state_names = ("decisive_transform", "insignificant_transform", "bank")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        c_idx, width = self.hyperparameters["c_idx"], self.feature_dim
        if c_idx is not None and c_idx > width:
            raise ValueError(f"actsub: c_idx must be at most the feature width {width}, got {c_idx}")
        if ash_keep_count(width, self.hyperparameters["percentile"]) < 1:
            raise ValueError(f"actsub: percentile {self.hyperparameters['percentile']} keeps none of the {width} "
                             "activations; lower it")

    def resolve_defaults(self, model: nn.Module, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        try:
            transformer = not pools_spatially(model)
        except ValueError:  # an architecture the registry neither has nor discovers: actsub.yml's own values
            transformer = False
        if hyperparameters["percentile"] is None:
            width = linear_head(model).feature_dim
            hyperparameters["percentile"] = 97.5 if transformer and ash_keep_count(width, 97.5) >= 1 else 95.0
        if hyperparameters["lmbd"] is None:
            hyperparameters["lmbd"] = 1.0 if transformer else 2.0
        return hyperparameters

    def fit_requirement(self) -> tuple[int, str]:
        return SAMPLE_DIVISOR * NEIGHBOURS, f"a tenth of them for the {NEIGHBOURS} nearest training samples"

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        dim = self.feature_dim
        return {"decisive_transform": (dim, dim), "insignificant_transform": (dim, dim), "bank": (None, dim)}

    def _fit(self, accumulated: FeatureStore) -> None:
        self.check_fit_count(accumulated.count)
        dtype = stored_dtype(accumulated.features[0].dtype)
        features = torch.cat([batch.to(dtype) for batch in accumulated.features])
        chosen = torch.randperm(features.shape[0], generator=torch.Generator().manual_seed(SAMPLE_SEED))
        samples = features[chosen[:features.shape[0] // SAMPLE_DIVISOR]]
        weight = self.head.weight.to(device="cpu", dtype=dtype)
        c_idx = self.hyperparameters["c_idx"]
        c_idx = decisive_count(weight, samples) if c_idx is None else c_idx
        self.decisive_transform, self.insignificant_transform = subspace_transforms(weight, c_idx)
        self.bank = nn.functional.normalize(samples @ self.insignificant_transform.T, dim=1)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch).to(self.bank.dtype)
        hp = self.hyperparameters
        energy = decisive_energy(features, self.decisive_transform, self.head, hp["shaping"], hp["percentile"])
        return energy * insignificant_score(features, self.insignificant_transform, self.bank) ** hp["lmbd"]
