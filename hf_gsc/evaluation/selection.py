"""Choosing the detector to ship, on validation data only: every scored method ranked on ID validation against OOD
validation sets, never on a test split.

Data (:func:`selection_sets`):

* with ``--val-ood-dataset NAME=SPEC`` (repeatable): those OOD sets (``--max-samples`` rows each) against the whole ID
  validation subset the thresholds are calibrated on;
* otherwise the OOD validation sets ``--tune`` uses (:func:`hf_gsc.evaluation.validation_sets.validation_ood_sets`): the ID
  validation subset is split in the same two halves, the OOD sets are generated from the ``tune_fit`` half
  (``val_noise``, ``val_jigsaw``; ``val_heldout_classes`` for ``fmnist-openset``) and the ID side is the
  ``tune_select`` half, so no image of the ID side reappears, shuffled, on the OOD side.

The sets are scored like any split (one backbone pass per batch for every method, cached as ``val_ood_{name}``).
Methods fitted on ID validation (ReAct, AdaSCALE) were fitted on rows that include the ID side: their validation
figures can be slightly optimistic.

Rule (:data:`SELECTION_RULE`, :func:`hf_gsc.evaluation.ranking.rank`): the highest mean AUROC over the OOD validation
sets (ID = positive), ties broken by the
lower mean FPR95 (ID+), then by name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from ..storage.model_card import SELECTION_SENTENCE_START, VALIDATION_RANKING_START
from .plan import VAL_OOD_PREFIX
from .ranking import RANKING_RULE, rank, validation_metrics


SELECTION_RULE = f"{RANKING_RULE} (by method name)"


class SelectionData(NamedTuple):
    """The data the selection ranks the methods on (:func:`selection_sets`).

    Attributes:
        sets: the OOD validation sets by name (empty where none can be had).
        id_rows: the rows of the ID validation subset that form the ID side (``None``: all of them).
        description: what the data is, for the console and the selection record.
    """

    sets: dict[str, Any]
    id_rows: list[int] | None
    description: str


def selection_sets(validation: Any, *, given: Sequence[tuple[str, str]], benchmark: str | None, max_samples: int | None,
                   seed: int, streaming: bool = False, test_splits: Mapping[str, Any] | None = None) -> SelectionData:
    """The OOD validation sets and the ID side the selection ranks the methods on; ``validation`` is the evaluation's ID validation subset, ``given`` the ``(NAME, SPEC)`` of each
    ``--val-ood-dataset``. Empty sets where none can be had (a streamed ID validation split without
    ``--val-ood-dataset``). ``test_splits``: name -> every test split (ID test, each OOD split); a given set holding
    the same images as one (a Hub copy of it, a folder given twice by another path) is refused
    (:class:`~hf_gsc.evaluation.errors.InputError`): what the spec names is checked before loading
    (:func:`hf_gsc.evaluation.validation.check_validation_is_not_test`), what was loaded here."""
    from .errors import InputError
    from .fingerprints import is_streamed
    from .plan import _load_split, same_images, subset
    from .validation_sets import VALIDATION_SEED, split_halves, validation_ood_sets

    if given:
        sets = {}
        for name, spec in given:
            loaded = _load_split(spec, f"--val-ood-dataset {name}={spec}", streaming)
            same = [test for test, dataset in (test_splits or {}).items() if same_images(loaded, dataset)]
            if same:
                raise InputError(f"--val-ood-dataset {name}={spec} holds the same images as the test split {same[0]}: "
                                 "the selection is made on validation data only; give OOD validation data that is "
                                 "no test split")
            sets[name] = subset(loaded, max_samples, seed, VAL_OOD_PREFIX + name)
        return SelectionData(sets, None, "--val-ood-dataset " + ", ".join(f"{name}={spec}" for name, spec in given))
    if is_streamed(validation):
        return SelectionData({}, None, "none: a streamed ID validation split cannot be split in halves; pass "
                             "--val-ood-dataset")
    fit_rows, select_rows = split_halves(len(validation), seed)
    sets = validation_ood_sets(benchmark, validation.select(fit_rows), len(select_rows), VALIDATION_SEED)
    return SelectionData(sets, select_rows, "OOD sets generated from a random half of the ID validation subset, "
                         "against its other half")


def selection_record(validation_scores: Mapping[str, torch.Tensor], ood_scores: Mapping[str, Mapping[str, torch.Tensor]],
                     id_rows: Sequence[int] | None, data: str) -> dict[str, Any]:
    """``results.json``'s ``selection``: the chosen method, the rule, the data and the whole validation table (best
    first; its scoring time is ``seconds.selection``). ``validation_scores``: method -> ID validation scores (all
    rows, in dataset order); ``ood_scores``: method -> OOD validation set -> scores."""
    table = {}
    for name, scores in validation_scores.items():
        id_side = scores if id_rows is None else scores[torch.as_tensor(list(id_rows), dtype=torch.long)]
        table[name] = validation_metrics(id_side, ood_scores[name])
    ranked = rank({name: table[name] for name in sorted(table)})  # ties: by name
    if not ranked:
        raise ValueError("no method has finite validation scores to rank")
    chosen = ranked[0]
    first = next(iter(ood_scores.values()))
    return {
        "method": chosen,
        "rule": SELECTION_RULE,
        "data": {"ood": data, "num_samples": {"id": int(len(id_rows) if id_rows is not None else
                                                        next(iter(validation_scores.values())).numel()),
                                              **{name: int(scores.numel()) for name, scores in first.items()}},
                 "read": read_clause(id_rows, data)},
        "validation": {name: table[name] for name in ranked},
    }


def read_clause(id_rows: Sequence[int] | None, data: str) -> str:
    """What the selection read, for its sentence: the ID validation subset alone (the OOD sets generated from one half
    of it, ``id_rows`` the other), or that subset and the ``--val-ood-dataset`` sets ``data`` names, each checked to be
    no test split before and after loading (:func:`selection_sets`)."""
    if id_rows is not None:
        return "test splits are never read"
    return (f"it read the ID validation subset and {data}, none of them an --ood-dataset or the ID test split (checked "
            "by path and by images)")


def sentence(record: Mapping[str, Any]) -> str:
    """The one sentence of ``results.md`` (and of the chosen detector's card) that states the choice and what it
    read (``data.read``)."""
    chosen = record["method"]
    entry = record["validation"][chosen]
    sets = ", ".join(entry["ood"])
    read = record["data"].get("read") or read_clause(None, record["data"]["ood"])
    return (f"{SELECTION_SENTENCE_START} **{chosen}** (mean validation AUROC {100 * entry['auroc']:.2f}%, "
            f"FPR95 (ID+) {100 * entry['fpr95']:.2f}% over {sets}; rule: {record['rule']}; {read}).")


def markdown_lines(record: Mapping[str, Any]) -> list[str]:
    """The validation table of ``results.md``: every method, best first (AUROC / FPR95 (ID+) / FPR95 (OOD+), %)."""
    from .json_files import table_lines

    sets = list(next(iter(record["validation"].values()))["ood"])
    rows = []
    for name, entry in record["validation"].items():
        cells = [f"{100 * entry['ood'][s]['auroc']:.2f} / {100 * entry['ood'][s]['fpr95']:.2f}" for s in sets]
        rows.append([f"**{name}**" if name == record["method"] else name, *cells,
                     f"{100 * entry['auroc']:.2f} / {100 * entry['fpr95']:.2f} / {100 * entry['fpr95_ood_positive']:.2f}"])
    sizes = record["data"]["num_samples"]
    return ["", f"{VALIDATION_RANKING_START}{record['data']['ood']}; ID {sizes['id']} rows; cells AUROC↑ / FPR95 (ID+)↓ in %, "
                f"mean also FPR95 (OOD+)↓):", "",
            *table_lines(["Method", *sets, "mean"], rows)]


__all__ = [
    "SELECTION_RULE",
    "VAL_OOD_PREFIX",
    "SelectionData",
    "markdown_lines",
    "read_clause",
    "selection_record",
    "selection_sets",
    "sentence",
]
