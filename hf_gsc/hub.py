"""Save, load and push detectors, their results and model cards (the Hub side; no GSC math here).

A saved detector folder holds, the PEFT way:

* ``gsc_config.json``: the ``GSCConfig`` with the reference to the base model (name or path, revision);
* ``detector_state.safetensors``: fitted tensors, when the detector has any (never pickle);
* ``README.md``: a model card rendered from ``model_cards/gsc_detector.md`` with ``huggingface_hub.ModelCard``;
* optionally the base model's own files (``config.json``, ``model.safetensors``, processor), and the
  evaluation outputs (``results.json``, ``results.md``, plots).

Tokens are read by ``huggingface_hub`` (``HF_TOKEN`` or the login cache) or passed explicitly; they are
never written to a file or a log line.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .config import CONFIG_NAME, STATE_FILE, GSCConfig

if TYPE_CHECKING:
    from .modeling import GSCForImageClassification

TEMPLATE_PATH = Path(__file__).resolve().parent.parent / "model_cards" / "gsc_detector.md"
RESULT_FILES = ("results.json", "results.md")
TASK_TYPE = "out-of-distribution-detection"


class HubError(RuntimeError):
    """A Hub operation failed; the message says why and that local files are intact."""


def _is_local(path: str) -> bool:
    return os.path.isdir(path)


# ----------------------------------------------------------------------------- model card
def eval_results_from(results: dict[str, Any], method: str = "gsc") -> list[EvalResult]:
    """One model-index entry per OOD split and metric; the split goes in ``dataset_config`` so entries do not merge."""
    method_results = results.get("methods", {}).get(method)
    if method_results is None:
        return []
    benchmark = results.get("benchmark") or "custom"
    entries = []
    for split, metrics in sorted(method_results.get("ood", {}).items()):
        for metric in ("auroc", "fpr95", "aupr_in", "aupr_out"):
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
                        metric_name=metric.upper() if metric != "fpr95" else "FPR@95%TPR (ID positive)",
                        metric_value=float(metrics[metric]),
                    )
                )
    return entries


def render_model_card(
    config: GSCConfig,
    repo_id: str | None = None,
    results: dict[str, Any] | None = None,
    results_table: str | None = None,
    plots: list[str] | tuple[str, ...] = (),
    method: str = "gsc",
) -> ModelCard:
    """Model card of a detector: metadata (library, base model, tags, model-index) and body."""
    name = repo_id or f"gsc-{(config.base_model_name_or_path or 'classifier').rstrip('/').split('/')[-1]}"
    eval_results = eval_results_from(results, method) if results else []
    base_model = config.base_model_name_or_path
    card_data = ModelCardData(
        library_name="hf_gsc",
        # Only Hub ids belong in base_model metadata; a local path would be rejected by the Hub.
        base_model=base_model if base_model and not os.path.isabs(base_model) and not base_model.startswith(".") else None,
        tags=["out-of-distribution-detection", "gradient-short-circuit", "image-classification"],
        model_name=name,
        eval_results=eval_results or None,
    )
    settings = [
        (key, value)
        for key, value in config.to_dict().items()
        if key not in ("calibration", "base_model_name_or_path", "base_model_revision")
    ]
    if not TEMPLATE_PATH.is_file():
        raise FileNotFoundError(f"model card template not found at {TEMPLATE_PATH}; reinstall hf_gsc from its repository")
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE_PATH),
        model_name=name,
        repo_id=repo_id or "path/to/detector",
        base_model=base_model,
        base_model_revision=config.base_model_revision,
        mask_ratio_percent=f"{config.mask_ratio:.0%}",
        approximation=config.approximation,
        score=config.score,
        settings=settings,
        calibration=config.calibration,
        threshold=config.threshold,
        benchmark=(results or {}).get("benchmark"),
        id_accuracy=(results or {}).get("id_accuracy"),
        results_table=results_table,
        plots=list(plots),
    )


def _copy_results(results_dir: str | os.PathLike, directory: Path) -> tuple[dict | None, str | None, list[str]]:
    """Copy results.json / results.md / plots from an evaluation output dir; return what the card needs."""
    source = Path(results_dir)
    if not (source / "results.json").is_file():
        raise FileNotFoundError(f"--results-dir {source} has no results.json; run scripts/evaluate_ood.py first")
    for name in RESULT_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, directory / name)
    plots = []
    for png in sorted(source.rglob("*.png")):
        relative = png.relative_to(source)
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(png, directory / relative)
        plots.append(relative.as_posix())
    results = json.loads((source / "results.json").read_text())
    table = (source / "results.md").read_text() if (source / "results.md").is_file() else None
    return results, table, plots


# ----------------------------------------------------------------------------- save / load
def save_detector(
    detector: "GSCForImageClassification",
    directory: str | os.PathLike,
    save_base_model: bool = False,
    results_dir: str | os.PathLike | None = None,
    repo_id: str | None = None,
) -> Path:
    """Write a detector folder (see module docstring); returns its path."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    detector.config.save_pretrained(directory)
    state = detector.state_dict_for_saving()
    if state:
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, directory / STATE_FILE)
    if save_base_model:
        detector.model.save_pretrained(directory)
        if detector.image_processor is not None:
            detector.image_processor.save_pretrained(directory)
    results = table = None
    plots: list[str] = []
    if results_dir is not None:
        results, table, plots = _copy_results(results_dir, directory)
    render_model_card(detector.config, repo_id, results, table, plots).save(directory / "README.md")
    return directory


def resolve_detector_dir(
    name_or_path: str, revision: str | None = None, token: str | bool | None = None
) -> str | None:
    """Local folder of a saved detector, downloading it from the Hub if needed; ``None`` for a plain classifier."""
    if _is_local(name_or_path):
        return name_or_path if os.path.isfile(os.path.join(name_or_path, CONFIG_NAME)) else None
    from huggingface_hub import file_exists, snapshot_download

    try:
        if not file_exists(name_or_path, CONFIG_NAME, revision=revision, token=token):
            return None
        return snapshot_download(name_or_path, revision=revision, token=token)
    except Exception as error:  # noqa: BLE001 - rewrapped with the cause attached
        raise _hub_error(f"could not load {name_or_path!r} from the Hub", error) from error


def _hub_error(action: str, error: BaseException, local_dir: str | os.PathLike | None = None) -> HubError:
    from huggingface_hub import constants

    kept = f" Local files in {local_dir} are intact." if local_dir else ""
    if constants.HF_HUB_OFFLINE:
        return HubError(f"{action}: HF_HUB_OFFLINE=1 is set, so the Hub cannot be reached.{kept}")
    return HubError(f"{action} at {constants.ENDPOINT}: {type(error).__name__}: {error}.{kept}")


# ----------------------------------------------------------------------------- push
def upload_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload with hf_gsc",
) -> str:
    """``create_repo`` (exist_ok) + optional branch + ``upload_folder``; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision, commit_message=commit_message)
    except Exception as error:  # noqa: BLE001 - rewrapped with the cause attached
        raise _hub_error(f"could not push to {repo_id!r}", error, folder) from error
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
) -> str:
    """Save the detector to a temporary folder and upload it; returns the commit URL."""
    with tempfile.TemporaryDirectory() as folder:
        save_detector(detector, folder, save_base_model=save_base_model, results_dir=results_dir, repo_id=repo_id)
        return upload_folder_to_hub(folder, repo_id, private, revision, token, commit_message)


def publish_results(
    results_dir: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    config: GSCConfig | None = None,
) -> str:
    """Upload an evaluation's results (JSON, table, plots) with a model card to ``repo_id``."""
    with tempfile.TemporaryDirectory() as folder:
        results, table, plots = _copy_results(results_dir, Path(folder))
        if config is None:
            gsc_settings = (results.get("config") or {}).get("gsc") or {}
            known = {k: v for k, v in gsc_settings.items() if k in GSCConfig.field_names()}
            config = GSCConfig(**known, base_model_name_or_path=str(results.get("model")))
        render_model_card(config, repo_id, results, table, plots).save(Path(folder) / "README.md")
        return upload_folder_to_hub(folder, repo_id, private, revision, token, "Upload hf_gsc evaluation results")
