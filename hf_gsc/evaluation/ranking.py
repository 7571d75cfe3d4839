"""The one validation metric and the one ranking rule of the package: the selection (:mod:`.selection`), the
``--tune`` search (:mod:`.tuning`) and the GSC variants protocol (:mod:`hf_gsc.analysis.variants`) all rank their
candidates with :func:`rank` on the :func:`validation_metrics` of their validation data.

Rule (:data:`RANKING_RULE`): the highest mean AUROC over the OOD validation sets (ID = positive), ties broken by the
lower mean FPR95 (ID+), then by the order the candidates are given in. A candidate whose scores are not all finite
has no metrics (``None``) and is never ranked.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from .metrics import auroc, fpr_at_tpr, fpr_at_tpr_ood_positive


RANKING_RULE = ("the highest mean AUROC over the OOD validation sets (ID = positive), ties broken by the lower mean "
                "FPR95 (ID+), then by the candidates' order")
#: The metrics of each OOD validation set, and of their mean.
VALIDATION_METRICS = ("auroc", "fpr95", "fpr95_ood_positive")

Key = TypeVar("Key", bound=Hashable)


def _values(scores: Any) -> np.ndarray:
    return scores.double().cpu().numpy() if isinstance(scores, torch.Tensor) else np.asarray(scores, dtype=np.float64)


def validation_metrics(id_scores: Any, ood_scores: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"auroc", "fpr95", "fpr95_ood_positive", "ood": {set: {...}}}``: each metric of ``id_scores`` (ID = positive)
    against every OOD validation set, and its mean over the sets (float64); ``None`` when a score is not finite."""
    ids = _values(id_scores)
    sets = {name: _values(scores) for name, scores in ood_scores.items()}
    if not sets or not all(np.isfinite(values).all() for values in [ids, *sets.values()]):
        return None
    per_set = {name: {"auroc": auroc(ids, values), "fpr95": fpr_at_tpr(ids, values),
                      "fpr95_ood_positive": fpr_at_tpr_ood_positive(ids, values)} for name, values in sets.items()}
    means = {metric: float(np.mean([entry[metric] for entry in per_set.values()])) for metric in VALIDATION_METRICS}
    return {**means, "ood": per_set}


def rank(table: Mapping[Key, Mapping[str, Any] | None]) -> list[Key]:
    """The candidates of ``table`` (candidate -> :func:`validation_metrics`, in the candidates' order) best first by
    :data:`RANKING_RULE`; those without metrics are left out."""
    order = {key: index for index, key in enumerate(table)}
    usable = {key: entry for key, entry in table.items() if entry is not None}
    return sorted(usable, key=lambda key: (-usable[key]["auroc"], usable[key]["fpr95"], order[key]))


def best(table: Mapping[Key, Mapping[str, Any] | None]) -> Key | None:
    """The first of :func:`rank` (``None`` when no candidate has metrics)."""
    ranked = rank(table)
    return ranked[0] if ranked else None


def best_index(metrics: Sequence[Mapping[str, Any] | None]) -> int | None:
    """:func:`best` of a list of candidates (grid points): its index."""
    return best(dict(enumerate(metrics)))


__all__ = ["RANKING_RULE", "VALIDATION_METRICS", "best", "best_index", "rank", "validation_metrics"]
