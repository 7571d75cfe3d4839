"""Saving a detector folder (:mod:`hf_gsc.storage.saved_format` describes it): the base-model reference it is saved with, the
checks made before the first file is written, and the writing."""

from __future__ import annotations

import fnmatch
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from ..settings.config import CONFIG_NAME, LEGACY_GSC_CONFIG_NAME, STATE_FILE
from ..utils import confined_files, whole_folders
from .repo_ids import is_hub_id, stored_reference
from .results import RESULT_FILES, check_results_match, copy_results, public_results, read_results
from .saved_format import CALIBRATION_SCORES_KEY, public_config, save_state, write_config


if TYPE_CHECKING:
    from .savable import SavableDetector


def saved_base_reference(
    detector: SavableDetector, save_base_model: bool, repo_id: str | None
) -> tuple[str | None, str | None]:
    """The base-model reference written to a saved detector. A detector saved with its base weights refers to itself
    when pushed (``repo_id``); saved locally with its weights it keeps a Hub id but never a local path (the folder is
    the base). Without the weights it keeps its reference, a local folder as its absolute path (the saved folder then
    loads from any working directory)."""
    config = detector.config
    if not save_base_model:
        return stored_reference(config.base_model_name_or_path), config.base_model_revision
    if repo_id is not None:
        return repo_id, None
    if is_hub_id(config.base_model_name_or_path):
        return config.base_model_name_or_path, config.base_model_revision
    return None, None


def check_savable(detector: SavableDetector, results_dir: str | os.PathLike[str] | None = None) -> None:
    """Refuse to save (or push) a detector that needs a fit and has none (it would be saved without its state and
    fail only when loaded), or with a ``results_dir`` that is not this detector's or links outside itself: the local
    checks a push makes before it reaches the Hub. First the detector is brought in line with its config
    (:meth:`hf_gsc.OODDetector.check_config`), so that what is saved is what it scores with."""
    detector.check_config()
    if detector.needs_fit and not detector.fitted:
        raise ValueError(f"the {detector.method!r} detector is not fitted, so it cannot be saved: call "
                         f".fit(id_{detector.fit_split}_batches) first")
    if results_dir is not None:
        check_results_match(read_results(results_dir)[0], detector, results_dir)


def save_detector(
    detector: SavableDetector,
    directory: str | os.PathLike[str],
    save_base_model: bool = False,
    results_dir: str | os.PathLike[str] | None = None,
    repo_id: str | None = None,
    license: str | None = None,
) -> Path:
    """Write a detector folder (its layout: :mod:`hf_gsc.storage.saved_format`); returns its path.

    Everything that can fail (the card template, results that do not belong to this detector) is checked
    before the first file is written; the folder is then written whole (:mod:`hf_gsc.utils.whole_folders`): a save
    that fails or is killed at any point leaves the old folder or the new one, never a mix. What an earlier save wrote
    and this one does not (another base's weights, another run's results) is gone; other files are kept.
    """
    from .model_card import DEFAULT_LICENSE, render_model_card

    check_savable(detector)
    results = table = None
    plots: list[Path] = []
    if results_dir is not None:
        results, table, plots = read_results(results_dir)
        check_results_match(results, detector, results_dir)
        if repo_id is not None:  # pushed: no local path reaches the card or the copied results
            results, table = public_results(results, table)
    base = saved_base_reference(detector, save_base_model, repo_id)
    if base[0] is None and not save_base_model:
        warnings.warn(f"the {detector.method!r} detector's base model has no name or path (config._name_or_path, "
                      f"base_model_name_or_path), so {directory} will load only with from_pretrained(..., model=<the "
                      "classifier>); save it with save_pretrained(..., save_base_model=True) to make the folder its "
                      "own base", UserWarning, stacklevel=3)
    # One calibration, saved as one unit: its threshold and record in the config's saved form, its kept scores beside
    # the fitted tensors (hf_gsc.utils.calibration).
    calibration = detector.calibration
    values = detector.config.to_dict(base)
    if repo_id is not None:  # pushed: no local path (a calibration folder's) reaches the Hub
        values = public_config(values)
    card = render_model_card(values, repo_id, results, table, [p.as_posix() for p in plots],
                             license=license or DEFAULT_LICENSE, base_in_repo=save_base_model,
                             p_value_cut=None if calibration is None else calibration.p_value_cut)
    # Written whole (hf_gsc.utils.whole_folders): a kill at any point leaves the old folder or the new one.
    with whole_folders.written_whole(directory, keep=lambda name: not written_by_a_save(name)) as staged:
        write_config(values, staged)
        state = dict(detector.fitted_state())
        if calibration is not None and calibration.scores is not None:
            state[CALIBRATION_SCORES_KEY] = calibration.scores
        if state:
            save_state(state, staged / STATE_FILE)
        save_base_config = getattr(getattr(detector.model, "config", None), "save_pretrained", None)
        if callable(save_base_config):
            save_base_config(staged)
        if save_base_model:
            save_model = getattr(detector.model, "save_pretrained", None)
            if not callable(save_model):
                raise ValueError(f"save_base_model=True: the base model ({type(detector.model).__name__}) has no "
                                 "save_pretrained (a transformers model has); save the detector without its base")
            save_model(staged)
            if detector.image_processor is not None:
                detector.image_processor.save_pretrained(staged)
        if results_dir is not None:
            copy_results(results_dir, staged, plots, public=repo_id is not None)
        confined_files.atomic_write_text(staged / "README.md", str(card))
    return Path(directory)


#: What a save writes, or an earlier save wrote that this one may not (another base's weights and processor, another
#: run's results and plots): never carried from the old folder into the new. Anything else (a run's ``fit.json``,
#: the user's own files) is.
WRITTEN_BY_A_SAVE = (CONFIG_NAME, LEGACY_GSC_CONFIG_NAME, STATE_FILE, "README.md", "config.json", "preprocessor_config.json",
                     *RESULT_FILES, "plots", "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
                     "*.png")


def written_by_a_save(name: str) -> bool:
    """Whether ``name`` in a detector folder is one of :data:`WRITTEN_BY_A_SAVE`."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in WRITTEN_BY_A_SAVE)
