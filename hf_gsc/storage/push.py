"""Pushing a detector to the Hub: save it as :mod:`hf_gsc.storage.saving` writes it, into a temporary folder, and upload
that folder (``huggingface_hub``). Tokens are read by ``huggingface_hub`` (``HF_TOKEN`` or the login cache) or
passed explicitly; they are never written to a file or a log line.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any, ClassVar

from .eval_results import write_eval_results
from .model_card import DEFAULT_LICENSE
from .repo_ids import is_hub_id
from .results import public_results, read_results
from .saving import check_savable, save_detector


if TYPE_CHECKING:
    from .savable import SavableDetector


class HubError(RuntimeError):
    """A Hub operation failed; the message says why and what is left where."""


def _hub_error(action: str, error: BaseException, kept: str) -> HubError:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return HubError(f"{action}: HF_HUB_OFFLINE=1 is set, so the Hub cannot be reached. {kept}")
    return HubError(f"{action} at {constants.ENDPOINT}: {type(error).__name__}: {error}. {kept}")


# ----------------------------------------------------------------------------- push
def upload_folder_to_hub(
    folder: str | os.PathLike[str],
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    commit_message: str = "Upload with hf_gsc",
    kept: str | None = None,
    create: bool = True,
) -> str:
    """``create_repo`` (exist_ok) + optional branch + ``upload_folder``; returns the commit URL.

    ``kept``: what the error message says is left intact (default: the local ``folder``). ``create=False``: the
    repo and branch were made already (:func:`create_hub_repo`).
    """
    from huggingface_hub import HfApi

    kept = kept or f"Local files in {folder} are intact."
    if create:
        create_hub_repo(repo_id, private, revision, token, kept)
    try:
        commit = HfApi(token=token).upload_folder(repo_id=repo_id, folder_path=str(folder), revision=revision,
                                                  commit_message=commit_message)
    except Exception as error:  # noqa: BLE001 - rewrapped with the cause attached
        raise _hub_error(f"could not push to {repo_id!r}", error, kept) from error
    return str(getattr(commit, "commit_url", commit))


def create_hub_repo(repo_id: str, private: bool = False, revision: str | None = None, token: str | bool | None = None,
                    kept: str = "Nothing was written.") -> None:
    """``create_repo`` (exist_ok) and the ``revision`` branch: the first request of a push, so that an offline or
    unreachable Hub (or a refused token) fails before anything is written locally. Raises :class:`HubError`."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
    except Exception as error:  # noqa: BLE001 - rewrapped with the cause attached
        raise _hub_error(f"could not push to {repo_id!r}", error, kept) from error


class HubPush:
    """``push_to_hub`` of every detector (mixed into :class:`hf_gsc.OODDetector`)."""

    # Attributes of the detector it is mixed into.
    config: Any
    method: ClassVar[str]

    def push_to_hub(
        self: SavableDetector,
        repo_id: str,
        private: bool = False,
        revision: str | None = None,
        token: str | bool | None = None,
        save_base_model: bool = False,
        results_dir: str | os.PathLike[str] | None = None,
        commit_message: str | None = None,
        license: str = DEFAULT_LICENSE,
    ) -> str:
        """Save the detector (as ``save_pretrained`` writes it) to a temporary folder and upload it to ``repo_id``;
        returns the commit URL.

        With ``save_base_model`` the pushed config refers to ``repo_id`` itself as the base model (its weights are
        there); no local path reaches a pushed file.

        Raises:
            ValueError: the base model is only a local folder (nobody else could load the detector) and
                ``save_base_model`` is False, or ``results_dir`` holds another model's or other settings' results,
                or a link leading out of it (:class:`~hf_gsc.utils.confined_files.LinkError`).
        """
        base = self.config.base_model_name_or_path
        if not save_base_model and not is_hub_id(base):
            raise ValueError(
                f"push_to_hub: the base model {base!r} is not a Hub repo id, so nobody could load {repo_id!r}. "
                "Pass save_base_model=True to upload the base weights with the detector, or set "
                "detector.config.base_model_name_or_path to the base model's Hub id"
            )
        check_savable(self, results_dir)
        kept = "The detector in memory is unchanged; save_pretrained(folder) keeps a local copy."
        # The Hub is reached first: offline, nothing (not the base model's shards) is written before the error.
        create_hub_repo(repo_id, private, revision, token, kept)
        with tempfile.TemporaryDirectory() as folder:
            save_detector(self, folder, save_base_model=save_base_model, results_dir=results_dir, repo_id=repo_id,
                          license=license)
            if results_dir is not None:  # the Hub's own results format, beside the card's model-index
                write_eval_results(folder, public_results(read_results(results_dir)[0], None)[0], self.method,
                                   repo_id, revision)
            return upload_folder_to_hub(
                folder, repo_id, private, revision, token, commit_message or f"Upload {self.method} detector", kept,
                create=False,
            )


__all__ = ["HubError", "HubPush", "create_hub_repo", "upload_folder_to_hub"]
