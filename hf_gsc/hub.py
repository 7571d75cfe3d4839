"""The Hub side of detectors: model cards, uploads and published results (no GSC math, no file format here).

The saved-detector format itself lives in :mod:`hf_gsc.serialization`. Tokens are read by ``huggingface_hub``
(``HF_TOKEN`` or the login cache) or passed explicitly; they are never written to a file or a log line.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .config import GSCConfig
from .serialization import copy_results, is_hub_id, read_results, save_detector

if TYPE_CHECKING:
    from .modeling import GSCForImageClassification

TEMPLATE_NAME = "gsc_detector.md"
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


def render_model_card(
    config: GSCConfig,
    repo_id: str | None = None,
    results: dict[str, Any] | None = None,
    results_table: str | None = None,
    plots: list[str] | tuple[str, ...] = (),
    method: str = "gsc",
    license: str = DEFAULT_LICENSE,
) -> ModelCard:
    """Model card of a detector: metadata (library, licence, base model, tags, model-index) and body."""
    template = template_path()
    name = repo_id or f"gsc-{(config.base_model_name_or_path or 'classifier').rstrip('/').split('/')[-1]}"
    eval_results = eval_results_from(results, method) if results else []
    base_model = config.base_model_name_or_path
    card_data = ModelCardData(
        library_name="hf_gsc",
        license=license,
        # Only Hub ids belong in base_model metadata; the Hub rejects a local path.
        base_model=base_model if is_hub_id(base_model) else None,
        tags=["out-of-distribution-detection", "gradient-short-circuit", "image-classification"],
        model_name=name,
        eval_results=eval_results or None,
    )
    # The configuration table: every setting, then the fitted numbers (the calibration record has its own line).
    shown = GSCConfig.setting_names() + tuple(n for n in GSCConfig.fitted_names() if n != "calibration")
    return ModelCard.from_template(
        card_data,
        template_path=str(template),
        model_name=name,
        repo_id=repo_id or "path/to/detector",
        base_model=base_model,
        base_model_revision=config.base_model_revision,
        mask_ratio_percent=f"{config.mask_ratio:.0%}",
        approximation=config.approximation,
        score=config.score,
        settings=[(key, getattr(config, key)) for key in shown],
        calibration=config.calibration,
        threshold=config.threshold,
        benchmark=(results or {}).get("benchmark"),
        id_accuracy=(results or {}).get("id_accuracy"),
        results_table=results_table,
        plots=list(plots),
        hf_gsc_version=config.hf_gsc_version,
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
    detector: "GSCForImageClassification",
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    save_base_model: bool = False,
    results_dir: str | os.PathLike | None = None,
    commit_message: str = "Upload GSC detector",
    license: str = DEFAULT_LICENSE,
) -> str:
    """Save the detector to a temporary folder and upload it; returns the commit URL.

    Raises:
        ValueError: the base model is only a local folder (nobody else could load the detector) and
            ``save_base_model`` is False, or ``results_dir`` holds another model's or other settings' results.
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
    config: GSCConfig | None = None,
) -> str:
    """Upload an evaluation's results (JSON, table, plots) with a model card to ``repo_id``."""
    results, table, plots = read_results(results_dir)
    if config is None:
        gsc_settings = (results.get("config") or {}).get("gsc") or {}
        known = {k: v for k, v in gsc_settings.items() if k in GSCConfig.score_names()}
        config = GSCConfig(**known, base_model_name_or_path=str(results.get("model")))
    card = render_model_card(config, repo_id, results, table, [p.as_posix() for p in plots])
    with tempfile.TemporaryDirectory() as folder:
        copy_results(results_dir, Path(folder), plots)
        card.save(Path(folder) / "README.md")
        return upload_folder_to_hub(
            folder, repo_id, private, revision, token, "Upload hf_gsc evaluation results",
            kept=f"The results in {results_dir} are intact.",
        )
