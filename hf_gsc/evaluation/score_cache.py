"""The score cache: ``scores/{method}/{split}.safetensors`` under the output dir.

Written atomically (temporary file, then ``os.replace``, never through a link) by the main process as soon as a
split is done, and tagged with a fingerprint of everything the scores depend on, so a rerun reuses exactly the files
that are still valid and a crash loses only the split in progress. A file whose fingerprint matches but whose content
does not fit its split (rows, dtypes, finite scores, keys) is computed again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from ..utils.calibration import kept_scores
from ..utils.confined_files import save_file
from ..utils.conformal import conformal_p_value


logger = logging.getLogger(__name__)

#: Subfolder of the output dir holding ``{method}/{split}.safetensors``.
SCORES_DIR = "scores"
#: Key of the score tensor inside a score file.
SCORE_KEY = "ood_score"
FINGERPRINT_KEY = "fingerprint"
#: Key of the base model's predicted classes in its score file.
PREDICTIONS_KEY = "predictions"
#: Pseudo-method whose score file holds the base model's predictions on ID test (for ``id_accuracy``).
BASE_MODEL = "_base_model"
#: Key of the number of images left out as unreadable, in :func:`~hf_gsc.evaluation.loop.score_split`'s output and in
#: a score file.
NUM_SKIPPED_KEY = "num_skipped"
#: Subfolder of the output dir holding ``{method}.safetensors``: per split, the conformal p-value of each score
#: against the ID validation scores (beside the score cache, not in it: p-values depend on two splits' scores).
P_VALUES_DIR = "p_values"


class ScoreCache:
    """Per-method, per-split score files under ``{output_dir}/scores``.

    A file is used for a request only if its stored fingerprint equals the requested one *and* its content is
    what such a file holds (:func:`score_file_problem`: the keys, dtypes, finite scores and, where the split's
    size is known, one row per image of the split). Anything else (missing, other fingerprint, unreadable after a
    crash, inconsistent content) reads as "not cached" and is computed again.
    """

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.output_dir = Path(output_dir)
        self.root = self.output_dir / SCORES_DIR

    def path(self, method: str, split: str) -> Path:
        return self.root / method / f"{split}.safetensors"

    def load(
        self, method: str, split: str, expected_fingerprint: str, expected_rows: int | None = None
    ) -> dict[str, torch.Tensor] | None:
        """The tensors of a valid file, else ``None``; ``expected_rows``: the split's size, ``None`` if unknown
        (streamed)."""
        path = self.path(method, split)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get(FINGERPRINT_KEY) != expected_fingerprint:
                    logger.info("ignoring %s: computed with other settings", path)
                    return None
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        except Exception as error:  # a truncated or foreign file is recomputed, not fatal
            logger.warning("ignoring unreadable score file %s: %s", path, error)
            return None
        problem = score_file_problem(method, tensors, expected_rows)
        if problem is not None:
            logger.warning("ignoring score file %s, its fingerprint matches but %s; computing it again", path, problem)
            return None
        return tensors

    def is_cached(self, method: str, split: str, expected_fingerprint: str, expected_rows: int | None = None) -> bool:
        return self.load(method, split, expected_fingerprint, expected_rows) is not None

    def save(self, method: str, split: str, tensors: Mapping[str, torch.Tensor], fp: str) -> Path:
        """Write atomically and never through a link (:func:`hf_gsc.utils.confined_files.save_file`)."""
        return save_file(tensors, self.path(method, split), {FINGERPRINT_KEY: fp}, root=self.output_dir)

    def save_p_values(self, method: str, calibration_scores: torch.Tensor,
                      split_scores: Mapping[str, torch.Tensor]) -> Path:
        """``p_values/{method}.safetensors``: for each split of ``split_scores`` (split -> ``(N,)`` scores, in
        the order of its score file), the p-values ``(1 + #{calibration_scores <= s}) / (n + 1)``, float64
        (:mod:`hf_gsc.utils.conformal`), against the scores a saved detector keeps of them
        (:func:`hf_gsc.utils.calibration.kept_scores`); written again on every run, from that run's score files."""
        calibration = kept_scores(calibration_scores)
        tensors = {split: conformal_p_value(scores, calibration).contiguous() for split, scores in split_scores.items()}
        return save_file(tensors, self.output_dir / P_VALUES_DIR / f"{method}.safetensors",
                         {"calibration_scores": f"{calibration.numel()} of {calibration_scores.numel()} ID validation scores"}, root=self.output_dir)


def score_file_problem(method: str, tensors: Mapping[str, torch.Tensor], expected_rows: int | None) -> str | None:
    """What is wrong with the content of ``method``'s score file (``None``: nothing).

    A score file holds ``labels`` (int64, one per image scored), the method's output (``ood_score``: float64 and
    finite; the base model's ``predictions``: int64), one row per image, and optionally ``num_skipped`` (int64
    ``()``, images left out as unreadable); rows plus skipped images make the split's size ``expected_rows``.
    """
    output = PREDICTIONS_KEY if method == BASE_MODEL else SCORE_KEY
    required, allowed = {output, "labels"}, {output, "labels", NUM_SKIPPED_KEY}
    if not required <= set(tensors) <= allowed:
        return f"it holds {sorted(tensors)} instead of {sorted(required)} (and optionally {NUM_SKIPPED_KEY!r})"
    expected_dtypes = {output: torch.int64 if output == PREDICTIONS_KEY else torch.float64, "labels": torch.int64}
    for key, dtype in expected_dtypes.items():
        value = tensors[key]
        if value.dtype != dtype or value.ndim != 1:
            return f"{key!r} is {value.dtype} of shape {tuple(value.shape)} instead of a 1-D {dtype}"
    rows = tensors["labels"].shape[0]
    if tensors[output].shape[0] != rows:
        return f"it holds {tensors[output].shape[0]} {output!r} values for {rows} labels"
    if output == SCORE_KEY and not bool(torch.isfinite(tensors[output]).all()):
        return f"{output!r} holds NaN or infinite values"
    skipped = tensors.get(NUM_SKIPPED_KEY, torch.tensor(0))
    if skipped.dtype != torch.int64 or skipped.ndim != 0 or int(skipped) < 0:
        return f"{NUM_SKIPPED_KEY!r} is not a non-negative int64 number"
    if expected_rows is not None and rows + int(skipped) != expected_rows:
        return f"it holds {rows} rows (+{int(skipped)} skipped images) but the split has {expected_rows} images"
    return None


__all__ = [
    "BASE_MODEL",
    "FINGERPRINT_KEY",
    "NUM_SKIPPED_KEY",
    "PREDICTIONS_KEY",
    "P_VALUES_DIR",
    "SCORES_DIR",
    "SCORE_KEY",
    "ScoreCache",
    "score_file_problem",
]
