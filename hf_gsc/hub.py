"""The Hub side of detectors: model cards, uploads and published results (no GSC math, no file format here).

The saved-detector format itself lives in :mod:`hf_gsc.serialization`. Tokens are read by ``huggingface_hub``
(``HF_TOKEN`` or the login cache) or passed explicitly; they are never written to a file or a log line.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .serialization import copy_results, is_hub_id, read_results, save_detector

if TYPE_CHECKING:
    from .detector import OODDetector

TEMPLATE_NAME = "ood_detector.md"
#: Where the card template is: inside the installed package (setup.py maps the top-level ``model_cards/``
#: there), or the top-level folder of a source checkout.
TEMPLATE_CANDIDATES = (
    Path(__file__).resolve().parent / "model_cards" / TEMPLATE_NAME,
    Path(__file__).resolve().parent.parent / "model_cards" / TEMPLATE_NAME,
)
TASK_TYPE = "out-of-distribution-detection"
#: Licence of what hf_gsc writes (config, fitted state, card); the base model's weights keep their own licence.
DEFAULT_LICENSE = "apache-2.0"


class HubError(RuntimeError):
    """A Hub operation failed; the message says why and what is left where."""


# ----------------------------------------------------------------------------- model card
#: Model-index names of the metrics whose key alone does not say the convention.
_METRIC_NAMES = {"fpr95": "FPR@95%TPR (ID positive)", "fpr95_ood_positive": "FPR@95%TPR (OOD positive, OpenOOD)"}


def eval_results_from(results: dict[str, Any], method: str = "gsc") -> list[EvalResult]:
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


def template_path() -> Path:
    for path in TEMPLATE_CANDIDATES:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model card template {TEMPLATE_NAME} not found at {' or '.join(map(str, TEMPLATE_CANDIDATES))}; "
        "reinstall hf_gsc"
    )


def method_description(method: str) -> str:
    """One line on what ``method`` computes: the first paragraph of its class docstring."""
    from .detector import detector_class

    doc = (detector_class(method).__doc__ or method).strip().split("\n\n")[0]
    return " ".join(line.strip() for line in doc.splitlines())


def render_model_card(
    values: Mapping[str, Any],
    repo_id: str | None = None,
    results: dict[str, Any] | None = None,
    results_table: str | None = None,
    plots: list[str] | tuple[str, ...] = (),
    license: str = DEFAULT_LICENSE,
) -> ModelCard:
    """Model card of a detector from its saved config ``values`` (:func:`hf_gsc.serialization.config_values`):
    metadata (library, licence, base model, tags, model-index) and body naming the method, its hyperparameters,
    the threshold and, with ``results``, its evaluation."""
    template = template_path()
    method = values["method"]
    base_model = values.get("base_model_name_or_path")
    base_name = (base_model or "classifier").rstrip("/").split("/")[-1]
    name = repo_id or f"{method}-{base_name}"
    eval_results = eval_results_from(results, method) if results else []
    card_data = ModelCardData(
        library_name="hf_gsc",
        license=license,
        # Only Hub ids belong in base_model metadata; the Hub rejects a local path.
        base_model=base_model if is_hub_id(base_model) else None,
        tags=["out-of-distribution-detection", f"ood-{method.replace('_', '-')}", "image-classification"]
        + (["gradient-short-circuit"] if method.startswith("gsc") else []),
        model_name=name,
        eval_results=eval_results or None,
    )
    hyperparameters = dict(values.get("hyperparameters") or {})
    return ModelCard.from_template(
        card_data,
        template_path=str(template),
        model_name=name,
        repo_id=repo_id,
        method=method,
        method_description=method_description(method),
        base_model=base_model if is_hub_id(base_model) else None,
        base_model_revision=values.get("base_model_revision"),
        settings=sorted(hyperparameters.items()),
        calibration=values.get("calibration"),
        threshold=values.get("threshold"),
        benchmark=(results or {}).get("benchmark"),
        id_accuracy=(results or {}).get("id_accuracy"),
        results_table=results_table,
        plots=list(plots),
        hf_gsc_version=values.get("hf_gsc_version"),
        license=license,
    )


def _hub_error(action: str, error: BaseException, kept: str) -> HubError:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return HubError(f"{action}: HF_HUB_OFFLINE=1 is set, so the Hub cannot be reached. {kept}")
    return HubError(f"{action} at {constants.ENDPOINT}: {type(error).__name__}: {error}. {kept}")


# ----------------------------------------------------------------------------- push
def upload_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload with hf_gsc",
    kept: str | None = None,
) -> str:
    """``create_repo`` (exist_ok) + optional branch + ``upload_folder``; returns the commit URL.

    ``kept``: what the error message says is left intact (default: the local ``folder``).
    """
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=commit_message)
    except Exception as error:  # noqa: BLE001 - rewrapped with the cause attached
        raise _hub_error(f"could not push to {repo_id!r}", error, kept or f"Local files in {folder} are intact.") from error
    return str(getattr(commit, "commit_url", commit))


def push_detector(
    detector: "OODDetector",
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    save_base_model: bool = False,
    results_dir: str | os.PathLike | None = None,
    commit_message: str = "Upload OOD detector",
    license: str = DEFAULT_LICENSE,
) -> str:
    """Save the detector to a temporary folder and upload it; returns the commit URL.

    With ``save_base_model`` the pushed config refers to ``repo_id`` itself as the base model (its weights are
    there); no local path reaches a pushed file.

    Raises:
        ValueError: the base model is only a local folder (nobody else could load the detector) and
            ``save_base_model`` is False, or ``results_dir`` holds another model's or other settings' results,
            or a link leading out of it (:class:`~hf_gsc.safe_files.LinkError`).
    """
    base = detector.config.base_model_name_or_path
    if not save_base_model and not is_hub_id(base):
        raise ValueError(
            f"push_to_hub: the base model {base!r} is not a Hub repo id, so nobody could load {repo_id!r}. "
            "Pass save_base_model=True to upload the base weights with the detector, or set "
            "detector.config.base_model_name_or_path to the base model's Hub id"
        )
    with tempfile.TemporaryDirectory() as folder:
        save_detector(detector, folder, save_base_model=save_base_model, results_dir=results_dir, repo_id=repo_id,
                      license=license)
        return upload_folder_to_hub(
            folder, repo_id, private, revision, token, commit_message,
            kept="The detector in memory is unchanged; save_pretrained(folder) keeps a local copy.",
        )


def publish_results(
    results_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    method: str | None = None,
) -> str:
    """Upload an evaluation's results (JSON, table, plots) with a model card (of ``method``, by default GSC when it
    was evaluated) to ``repo_id``.

    Raises:
        hf_gsc.safe_files.LinkError: a file to upload is a link leading out of ``results_dir`` (nothing is uploaded).
    """
    results, table, plots = read_results(results_dir)
    methods = results.get("methods") or {}
    method = method or ("gsc" if "gsc" in methods else next(iter(methods), "gsc"))
    model = str(results.get("model"))
    values = {"method": method, "hyperparameters": (methods.get(method) or {}).get("hyperparameters") or {},
              "base_model_name_or_path": model if is_hub_id(model) else None, "hf_gsc_version": results.get(
                  "versions", {}).get("hf_gsc")}
    card = render_model_card(values, repo_id, results, table, [p.as_posix() for p in plots])
    with tempfile.TemporaryDirectory() as folder:
        copy_results(results_dir, Path(folder), plots)
        card.save(Path(folder) / "README.md")
        return upload_folder_to_hub(
            folder, repo_id, private, revision, token, "Upload hf_gsc evaluation results",
            kept=f"The results in {results_dir} are intact.",
        )
