"""Publishing an evaluation's results (JSON, table, plots) with a model card on the Hub. Pushing a detector is
:mod:`hf_gsc.storage.push`; the card is :mod:`hf_gsc.storage.model_card`; the saved format is :mod:`hf_gsc.storage.saved_format`.
Tokens are read by ``huggingface_hub`` (``HF_TOKEN`` or the login cache) or passed explicitly; they are never
written to a file or a log line.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .eval_results import write_eval_results
from .model_card import render_model_card
from .push import HubError, upload_folder_to_hub
from .repo_ids import is_hub_id
from .results import copy_results, public_results, read_results


def publish_results(
    results_dir: str | os.PathLike[str],
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    method: str | None = None,
) -> str:
    """Upload an evaluation's results (JSON, table, plots) with a model card (of ``method``, by default the one the
    evaluation's selection chose, else GSC when it was evaluated) to ``repo_id``, and the method's results in the
    Hub's ``.eval_results/`` format when the ID data is a Hub dataset (:mod:`hf_gsc.storage.eval_results`).

    Raises:
        hf_gsc.utils.confined_files.LinkError: a file to upload is a link leading out of ``results_dir`` (nothing is uploaded).
    """
    results, table, plots = read_results(results_dir)
    results, table = public_results(results, table)  # no local path leaves this machine
    methods = results.get("methods") or {}
    chosen = (results.get("selection") or {}).get("method")
    if not method:
        method = (chosen if isinstance(chosen, str) and chosen in methods
                  else "gsc" if "gsc" in methods else str(next(iter(methods), "gsc")))
    model = str(results.get("model"))
    values = {"method": method, "hyperparameters": (methods.get(method) or {}).get("hyperparameters") or {},
              "base_model_name_or_path": model if is_hub_id(model) else None, "hf_gsc_version": results.get(
                  "versions", {}).get("hf_gsc")}
    card = render_model_card(values, repo_id, results, table, [p.as_posix() for p in plots])
    with tempfile.TemporaryDirectory() as folder:
        copy_results(results_dir, Path(folder), plots, public=True)
        card.save(Path(folder) / "README.md")
        write_eval_results(folder, results, method, repo_id, revision)  # the Hub's own format, beside model-index
        return upload_folder_to_hub(
            folder, repo_id, private, revision, token, "Upload hf_gsc evaluation results",
            kept=f"The results in {results_dir} are intact.",
        )


#: HubError: what a failed upload raises here, part of this module's interface.
__all__ = ["HubError", "publish_results"]
