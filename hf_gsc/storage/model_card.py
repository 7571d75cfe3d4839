"""The model card of a saved detector: metadata (library, licence, base model, tags, model-index) and a body naming
the method, its hyperparameters, the threshold and, with an evaluation's results, its numbers.

Rendered with ``huggingface_hub.ModelCard`` from the package data ``hf_gsc/model_cards/ood_detector.md``.
Part of the saved format, so :mod:`hf_gsc.storage.saving` writes it without any Hub access.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..settings.registry import detector_class
from .repo_ids import is_hub_id


TEMPLATE_NAME = "ood_detector.md"
#: The card template: package data inside ``hf_gsc`` (``hf_gsc/model_cards/``), read with ``importlib.resources`` so
#: that it is found the same way from a checkout, an installed wheel or a zipped package.
TEMPLATE = importlib.resources.files("hf_gsc") / "model_cards" / TEMPLATE_NAME
TASK_TYPE = "out-of-distribution-detection"
#: Licence of what hf_gsc writes (config, fitted state, card); the base model's weights keep their own licence.
DEFAULT_LICENSE = "apache-2.0"


#: How ``results.md`` (:mod:`hf_gsc.evaluation.selection`) opens the sentence naming the selected method and its
#: validation ranking (which marks the selected method): kept only in the card of the method selected.
SELECTION_SENTENCE_START = "Selected on validation data only:"
VALIDATION_RANKING_START = "Validation ranking ("

_METRIC_NAMES = {"fpr95": "FPR@95%TPR (ID positive)", "fpr95_ood_positive": "FPR@95%TPR (OOD positive, OpenOOD)"}


def eval_results_from(results: dict[str, Any], method: str) -> list[EvalResult]:
    """One model-index entry per OOD split and metric; the split goes in ``dataset_config`` so entries do not merge."""
    method_results = results.get("methods", {}).get(method)
    if method_results is None:
        return []
    benchmark = results.get("benchmark") or "custom"
    entries = []
    for split, metrics in sorted(method_results.get("ood", {}).items()):
        for metric in ("auroc", "fpr95", "fpr95_ood_positive", "aupr_in", "aupr_out"):
            if metric in metrics:
                entries.append(
                    EvalResult(
                        task_type=TASK_TYPE,
                        task_name="Out-of-distribution detection",
                        dataset_type=f"hf_gsc/{benchmark}",
                        dataset_name=f"{benchmark} ({split})",
                        dataset_config=split,
                        dataset_split="test",
                        metric_type=metric,
                        metric_name=_METRIC_NAMES.get(metric, metric.upper()),
                        metric_value=float(metrics[metric]),
                    )
                )
    return entries


def data_description(results: Mapping[str, Any]) -> str:
    """What the evaluation ran on, for the card: the registered benchmark, else the ID data and OOD sets given
    (``--id-dataset``, ``--ood-dataset NAME=SPEC``) as ``results.json`` records them."""
    if results.get("benchmark"):
        return f"benchmark `{results['benchmark']}`"
    parts = [f"ID data `{results['id_dataset']}`"] if results.get("id_dataset") else []
    ood = results.get("ood_datasets") or {}
    if ood:
        parts.append("OOD data " + ", ".join(f"`{name}` ({spec})" for name, spec in sorted(ood.items())))
    return "; ".join(parts) or "data the evaluation does not name"


def template_text() -> str:
    """The card template's text; a missing template (a broken install) is a ``FileNotFoundError`` naming it."""
    try:
        return TEMPLATE.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"model card template {TEMPLATE_NAME} not found at {TEMPLATE}; reinstall hf_gsc") from None


def method_description(method: str) -> str:
    """One line on what ``method`` computes: the first paragraph of its class docstring."""
    import re

    doc = (detector_class(method).__doc__ or method).strip().split("\n\n")[0]
    text = " ".join(line.strip() for line in doc.splitlines())
    # reStructuredText to Markdown: :func:`name` and ``code`` become `name` and `code`.
    return re.sub(r"``([^`]+)``", r"`\1`", re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text))


def selection_text(selection: Mapping[str, Any]) -> str:
    """Why the evaluation chose this detector: its validation figures, the runner-up's, the rule and the data."""
    ranked = list(selection["validation"])
    chosen = selection["validation"][selection["method"]]
    text = (f"Chosen among {len(ranked)} methods evaluated on the same model and data, on validation data only: mean "
            f"validation AUROC {100 * chosen['auroc']:.2f}%, FPR95 (ID+) {100 * chosen['fpr95']:.2f}% over "
            f"{', '.join(chosen['ood'])} ({selection['data']['ood']}).")
    if len(ranked) > 1:
        second = selection["validation"][ranked[1]]
        text += f" Runner-up: `{ranked[1]}` (AUROC {100 * second['auroc']:.2f}%, FPR95 {100 * second['fpr95']:.2f}%)."
    return text + f" Rule: {selection['rule']}."


def fit_text(results: Mapping[str, Any], method: str) -> str | None:
    """What the evaluation fitted ``method`` on (``results.json``'s ``split_sizes.fit``), or that it fits nothing;
    ``None`` without an evaluation's results."""
    if not results.get("methods") or method not in results["methods"]:
        return None
    sizes = (results.get("split_sizes") or {}).get("fit") or {}
    if method not in sizes:
        return ("Fitted on nothing: the method reads the base model's outputs (and the threshold below) only, so no "
                "image was fitted on.")
    skipped = ((results.get("num_skipped") or {}).get("fit") or {}).get(method) or 0
    left_out = f", {skipped} unreadable ones left out" if skipped else ""
    data = f"benchmark `{results['benchmark']}`" if results.get("benchmark") else f"`{results.get('id_dataset')}`"
    return (f"Fitted on {sizes[method]:,} images of the `{detector_class(method).fit_split}` split of the ID data "
            f"({data}){left_out}, never on test or OOD data.")


def without_selection(table: str) -> str:
    """``results.md`` without the selection's sentence and validation ranking: what the card of a method the
    evaluation did not select shows (it names no other method as the selected one)."""
    kept: list[str] = []
    lines = table.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith(SELECTION_SENTENCE_START):
            index += 1
            if index < len(lines) and not lines[index].strip():
                index += 1  # its blank line
            continue
        if line.startswith(VALIDATION_RANKING_START):
            index += 1
            while index < len(lines) and (not lines[index].strip() or lines[index].startswith("|")):
                if not lines[index].strip() and index + 1 < len(lines) and not lines[index + 1].startswith("|"):
                    break
                index += 1
            while kept and not kept[-1].strip():
                kept.pop()
            continue
        kept.append(line)
        index += 1
    return "\n".join(kept) + ("\n" if table.endswith("\n") else "")


def percent(value: float) -> str:
    """A fraction as ``results.md`` writes it: ``0.9666666666666667`` -> ``96.67%``."""
    return f"{100 * float(value):.2f}%"


def number(value: float) -> str:
    """A threshold or score as ``results.md``'s threshold table writes it (6 significant digits)."""
    return f"{float(value):.6g}"


def calibration_text(calibration: Mapping[str, Any] | None, threshold: float | None) -> str:
    """The card's sentence on the threshold, from the calibration record (read with ``.get``: records of every
    version). "Never on test or OOD data" is said only when the library chose the split itself (``split`` set);
    otherwise the record's ``source`` (what was read) is named as it is."""
    if not calibration:
        if threshold is None:
            return "No threshold is set: `is_ood` is `None` until `calibrate` runs on ID validation data."
        return f"The threshold `{number(threshold)}` was set by hand, not calibrated by hf_gsc."
    count = calibration.get("num_samples")
    samples = f"{count} samples" if count is not None else "samples"
    split, source = calibration.get("split"), calibration.get("source")
    if split is not None:
        where = f"{samples} of the ID `{split}` split" + (f" ({source})" if source else "")
    else:
        where = f"{samples} read from {source}" if source else f"{samples} given by the caller (source not recorded)"
    never = " (never on test or OOD data)" if split is not None else ""
    tpr, delta = calibration.get("tpr"), calibration.get("delta")
    kept = f"{100 * float(tpr):g}%" if tpr is not None else "the target fraction"  # as results.md's "target 95%"
    if calibration.get("method") == "conformal":
        rule = (f"with a split-conformal order statistic: on new ID data drawn like them, the threshold keeps at least "
                f"{kept} of the samples with probability at least 1 - {delta}")
    else:
        rule = f"to keep {kept} of them"
    text = f"The threshold `{number(threshold)}` was calibrated on {where} {rule}{never}." if threshold is not None \
        else f"Calibrated on {where} {rule}{never}, but no threshold is kept."
    return text


def p_value_sentence(p_value_cut: float | None, record: Mapping[str, Any] | None) -> str | None:
    """What the threshold means as a p-value (:mod:`hf_gsc.utils.conformal`): ``p_value_cut`` of
    :attr:`hf_gsc.OODDetector.p_value_cut` over the scores the calibration ``record`` keeps (``calibration_scores``
    ``count``; a record written before it said so kept all ``num_samples``); ``None`` without a cut (calibration
    scores not kept)."""
    record = record or {}
    read = record.get("num_samples")
    kept = (record.get("calibration_scores") or {}).get("count", read)
    if p_value_cut is None or kept is None:
        return None
    n = int(kept)
    scores = f"{n} ID calibration images" if read == kept else f"{n} kept ID calibration scores (a sorted sample of {read})"
    at_or_below = round(p_value_cut * (n + 1)) - 1  # flagged iff at most this many calibration scores are <= the input's
    return (f"Every output carries a `p_value`: (1 + the number of the {scores} scoring at or "
            f"below the input) / {n + 1}, the chance that an ID image scores this low. An input is flagged when "
            f"its p-value is at most {p_value_cut:.4g}: when at most {at_or_below} of the {scores} "
            f"({at_or_below / n:.1%}) score at or below it. `detector.set_tpr(...)` moves the threshold without "
            "new scores.")


def render_model_card(
    values: Mapping[str, Any],
    repo_id: str | None = None,
    results: dict[str, Any] | None = None,
    results_table: str | None = None,
    plots: list[str] | tuple[str, ...] = (),
    license: str = DEFAULT_LICENSE,
    base_in_repo: bool = False,
    p_value_cut: float | None = None,
    model_name: str | None = None,
) -> ModelCard:
    """Model card of a detector from its saved config ``values`` (:meth:`hf_gsc.DetectorConfig.to_dict`):
    metadata (library, licence, base model, tags, model-index) and body naming the method, its hyperparameters,
    the threshold and, with ``results``, its evaluation. Its title is ``repo_id``, else ``model_name``, else
    ``METHOD-BASE``."""
    template = template_text()
    method = values["method"]
    base_model = values.get("base_model_name_or_path")
    base_name = (base_model or "classifier").rstrip("/").split("/")[-1]
    name = repo_id or model_name or f"{method}-{base_name}"
    eval_results = eval_results_from(results, method) if results else []
    card_data = ModelCardData(
        library_name="hf_gsc",
        license=license,
        # Only Hub ids belong in base_model metadata; the Hub rejects a local path.
        base_model=base_model if is_hub_id(base_model) else None,
        tags=["out-of-distribution-detection", f"ood-{method.replace('_', '-')}", "image-classification",
              *detector_class(method).card_tags],
        model_name=name,
        eval_results=eval_results or None,
    )
    hyperparameters = dict(values.get("hyperparameters") or {})
    selection = (results or {}).get("selection") or {}
    if results_table and selection.get("method") and selection.get("method") != method:
        results_table = without_selection(results_table)
    accuracy = (results or {}).get("id_accuracy")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=name,
        repo_id=repo_id,
        method=method,
        method_description=method_description(method),
        fit_text=fit_text(results or {}, method),
        base_model=base_model if is_hub_id(base_model) else None,
        base_model_revision=values.get("base_model_revision"),
        base_in_repo=base_in_repo,
        settings=sorted(hyperparameters.items()),
        calibration_text=calibration_text(values.get("calibration"), values.get("threshold")),
        p_value_sentence=p_value_sentence(p_value_cut, values.get("calibration")),
        data=data_description(results or {}),
        id_accuracy=None if accuracy is None else percent(accuracy),
        results_table=results_table,
        selection=selection_text(selection) if selection.get("method") == method else None,
        plots=list(plots),
        hf_gsc_version=values.get("hf_gsc_version"),
        license=license,
    )


