"""A detector's calibration as one value: the threshold, the record of what it was calibrated on, and the kept ID
calibration scores, bound to each other.

:class:`Calibration` is made one way from ID validation scores (:meth:`Calibration.from_scores`: ``calibrate``, the
evaluation), moved to another ``tpr`` without a forward (:meth:`Calibration.with_tpr`: ``set_tpr``), set by hand
(:meth:`Calibration.by_hand`: ``threshold=...``, no scores), saved and read as one unit (:meth:`Calibration.to_dict`
and :attr:`Calibration.scores` -> :meth:`Calibration.from_dict`). It says itself why it no longer applies to a
detector (:meth:`Calibration.why_stale`, one wording).

**Bound.** The threshold is always the cut of the kept scores for the record's ``tpr`` (and ``delta``)
(:func:`hf_gsc.utils.thresholds.threshold_for`), so ``is_ood == (p_value <= p_value_cut)`` holds for every score
(:mod:`hf_gsc.utils.conformal`). The record keeps the number of kept scores and their digest
(``calibration_scores: {"count", "digest"}``); :meth:`Calibration.from_dict` checks all three (count, digest, cut)
and raises :class:`UnboundCalibration` naming what disagrees (the loader then drops the calibration with one warning).
Kept scores are float64 by format: another dtype is refused.

**A bounded sample.** At most :data:`MAX_KEPT_SCORES` scores are kept. From ``n`` larger than that, the ``m`` kept
are evenly spaced order statistics of the ``n`` sorted scores (the ``floor((i + 1/2) n / m)``-th, ``i < m``), and the
threshold is the cut of the kept ones: the record says both ``num_samples`` (``n``, what was read) and
``calibration_scores.count`` (``m``). A p-value is then a multiple of ``1 / (m + 1)`` and differs from the one the
``n`` scores would give by at most about ``1 / m`` (``1e-5`` at ``m = 100,000``); the threshold's quantile moves by
as much. Loading, p-values and plots stay fast whatever ``n`` was.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .conformal import conformal_p_value, p_value_cut
from .thresholds import as_scores, calibration_record, check_tpr, threshold_for


#: The most ID calibration scores a calibration keeps (a sorted sample beyond; see the module docstring).
MAX_KEPT_SCORES = 100_000
#: The record's key for the kept scores' count and digest.
SCORES_RECORD = "calibration_scores"


class UnboundCalibration(ValueError):
    """Saved calibration scores that do not belong to the saved threshold and record (the message says what
    disagrees)."""


def kept_scores(scores: Any, limit: int = MAX_KEPT_SCORES) -> torch.Tensor:
    """The ``(m,)`` scores a calibration keeps of ``scores`` ``(n,)``: all of them when ``n <= limit``, else ``limit``
    evenly spaced order statistics; 1-D, finite, float64, ascending, on the CPU (any other input is a
    ``ValueError`` naming ``calibration_scores``)."""
    ordered = torch.from_numpy(as_scores(scores, "calibration_scores")).sort().values
    n = ordered.numel()
    if n <= limit:
        return ordered
    picks = ((torch.arange(limit, dtype=torch.float64) + 0.5) * n / limit).floor().long()
    return ordered[picks]


def scores_digest(scores: torch.Tensor) -> str:
    """``"sha256:<hex>"`` of kept scores (float64 bytes, in order): the identity the record keeps."""
    return "sha256:" + hashlib.sha256(scores.contiguous().numpy().tobytes()).hexdigest()


def fitted_state_digest(state: Mapping[str, torch.Tensor]) -> str | None:
    """``"sha256:<hex>"`` of fitted tensors (names, dtypes, shapes and bytes, in name order), the identity a
    calibration record keeps as ``fitted_state``; ``None`` when nothing is fitted. The same on every device."""
    if not state:
        return None
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return f"sha256:{digest.hexdigest()}"


def changed_settings(recorded: Any, current: Mapping[str, Any]) -> str:
    """``""`` when ``recorded`` (a calibration record's ``settings``) equals ``current``; else the differing
    settings, ``"k (50 -> 5)"``."""
    recorded = recorded if isinstance(recorded, dict) else {}
    names = sorted(name for name in set(recorded) | set(current) if recorded.get(name) != current.get(name))
    return ", ".join(f"{name} ({recorded.get(name)!r} -> {current.get(name)!r})" for name in names)


def _plain(record: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A copy of ``record`` as JSON stores it (nothing shared with the caller)."""
    return None if record is None else json.loads(json.dumps(dict(record)))


_UNCHECKED = object()


@dataclass(frozen=True, eq=False)
class Calibration:
    """A detector's threshold with its record and the kept ID calibration scores (module docstring).

    Attributes:
        threshold: ``is_ood = not ood_score >= threshold``.
        record: what the threshold was calibrated on and depends on (``source``, ``split``, ``num_samples``, ``tpr``,
            ``method``, ``delta``, ``calibration_scores``: count and digest, ``settings``, ``fitted_state``);
            ``None`` for a threshold set by hand.
        scores: ``(m,)`` float64 ascending kept scores on the CPU; ``None`` when none are kept.
        missing_scores: why ``scores`` is ``None`` (said where p-values are asked for).
    """

    threshold: float
    record: dict[str, Any] | None = None
    scores: torch.Tensor | None = None
    missing_scores: str | None = None
    _on_device: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ made
    @classmethod
    def from_scores(cls, scores: Any, tpr: float = 0.95, delta: float | None = None, split: str | None = None,
                    source: str | None = None, depends_on: Mapping[str, Any] | None = None,
                    limit: int = MAX_KEPT_SCORES) -> Calibration:
        """The calibration of ID validation ``scores`` at ``tpr`` (``delta``: the split-conformal threshold,
        :func:`hf_gsc.utils.thresholds.threshold_for`), keeping at most ``limit`` of them; ``split``, ``source`` and
        ``depends_on`` (``settings``, ``fitted_state``) go into the record."""
        tpr = check_tpr(tpr)
        kept = kept_scores(scores, limit)
        num_samples = len(scores) if not isinstance(scores, torch.Tensor) else scores.numel()
        record = calibration_record(split, num_samples, tpr, delta, **({} if source is None else {"source": source}),
                                    **{SCORES_RECORD: {"count": kept.numel(), "digest": scores_digest(kept)}},
                                    **dict(depends_on or {}))
        return cls(threshold_for(kept, tpr, delta), _plain(record), kept)

    @classmethod
    def by_hand(cls, threshold: float, record: Mapping[str, Any] | None = None,
                why: str = "the threshold was set by hand, without ID calibration scores") -> Calibration:
        """A threshold without kept scores: p-values are unavailable, ``why`` says why."""
        return cls(float(threshold), _plain(record), None,
                   f"{why}; call .calibrate(id_validation_data) to keep the ID calibration scores")

    def with_tpr(self, tpr: float, delta: float | None = None) -> Calibration:
        """This calibration moved to keep a fraction ``tpr`` of ID data (no new forward): the threshold
        :meth:`from_scores` gives on the same scores at ``tpr`` / ``delta``; the record says the new ``tpr``."""
        tpr = check_tpr(tpr)
        if self.scores is None:
            raise RuntimeError(f"no ID calibration scores are kept: {self.missing_scores}")
        record = dict(self.record or {})
        record.update(tpr=tpr, delta=None if delta is None else float(delta),
                      method="quantile" if delta is None else "conformal")
        return Calibration(threshold_for(self.scores, tpr, delta), _plain(record), self.scores)

    # ------------------------------------------------------------------ read
    def p_value(self, ood_score: torch.Tensor) -> torch.Tensor | None:
        """``(B,)`` float64 conformal p-values of ``ood_score`` against the kept scores
        (:func:`hf_gsc.utils.conformal.conformal_p_value`); ``None`` when none are kept. A copy of the scores per
        device is kept, so that a forward on a GPU copies nothing from the host (none inside a compiled graph)."""
        if self.scores is None:
            return None
        if torch.compiler.is_compiling():
            return conformal_p_value(ood_score, self.scores.to(ood_score.device))
        on_device = self._on_device.get(ood_score.device)
        if on_device is None:
            on_device = self._on_device[ood_score.device] = self.scores.to(ood_score.device)
        return conformal_p_value(ood_score, on_device)

    @property
    def p_value_cut(self) -> float | None:
        """The p-value at and below which an input is flagged (``is_ood == (p_value <= p_value_cut)``); ``None``
        without kept scores."""
        return None if self.scores is None else p_value_cut(self.scores, self.threshold)

    def why_stale(self, settings: Mapping[str, Any] | None = None, fitted_state: Any = _UNCHECKED,
                  saved_settings: Mapping[str, Any] | None = None, refitted: bool = False) -> str | None:
        """Why this calibration no longer applies to a detector, or ``None`` while it does: the one check at load,
        before each score or save, and after a refit.

        Args:
            settings: the detector's settings now (what a record keeps as ``settings``); ``None``: not compared. A
                record written without them is compared, on the settings in ``saved_settings`` only, with
                ``saved_settings`` when given (at load: the saved values of the settings given again).
            fitted_state: the digest of the detector's fitted state now; left out: not compared. A record without
                one is kept unverified unless ``refitted``: after a fit it vouches for nothing.
            refitted: the detector was fitted since the record was written.
        """
        record = self.record or {}
        differ = ""
        if settings is not None and "settings" in record:
            differ = changed_settings(record["settings"], settings)
        elif settings is not None and saved_settings is not None:
            differ = changed_settings(saved_settings, {name: settings.get(name) for name in saved_settings})
        if differ:
            return f"{differ} changed since it was calibrated"
        if fitted_state is not _UNCHECKED:
            recorded = record.get("fitted_state")
            if refitted and recorded is None:
                return "the detector was fitted again since it was calibrated, with no fitted state recorded to compare"
            if "fitted_state" in record and recorded != fitted_state:
                return "the fitted state changed since it was calibrated"
        return None

    # ------------------------------------------------------------------ saved
    def to_dict(self) -> dict[str, Any]:
        """``threshold`` and ``calibration`` (the record) as ``detector_config.json`` stores them; the kept scores
        are saved beside them as a tensor (:attr:`scores`)."""
        return {"threshold": self.threshold, "calibration": _plain(self.record)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], scores: torch.Tensor | None = None,
                  source: str = "the saved calibration", missing_scores: str | None = None) -> Calibration | None:
        """The calibration saved as ``values`` (:meth:`to_dict`) with its kept ``scores``; ``None`` without a
        threshold.

        Raises:
            ValueError: ``scores`` that are not a 1-D, finite, ascending float64 tensor (naming ``source``).
            UnboundCalibration: scores that do not belong to the threshold and record: a count or digest other
                than the record's, a threshold that is not their cut for the record's ``tpr`` and ``delta``, or
                scores without a threshold.
        """
        threshold, record = values.get("threshold"), values.get("calibration")
        if scores is None:
            return None if threshold is None else cls.by_hand(threshold, record, missing_scores or f"{source} keeps no ID calibration scores")
        if not isinstance(scores, torch.Tensor) or scores.dtype != torch.float64 or scores.ndim != 1:
            raise ValueError(f"{source}: calibration_scores must be a 1-D float64 tensor (the saved format), got "
                             f"{getattr(scores, 'dtype', type(scores).__name__)} of shape "
                             f"{tuple(getattr(scores, 'shape', ()))}; calibrate the detector again and save it")
        if scores.numel() > MAX_KEPT_SCORES:
            raise ValueError(f"{source}: {scores.numel()} calibration scores, more than the {MAX_KEPT_SCORES} the "
                             "format keeps; calibrate the detector again and save it")
        if scores.numel() == 0 or not torch.isfinite(scores).all() or (scores[1:] < scores[:-1]).any():
            raise ValueError(f"{source}: calibration_scores must be non-empty, finite and ascending; calibrate the "
                             "detector again and save it")
        if threshold is None:
            raise UnboundCalibration(f"{source} holds {scores.numel()} calibration scores but no threshold")
        record = dict(record or {})
        kept = record.get(SCORES_RECORD) or {"count": record.get("num_samples")}
        disagree = []
        if kept.get("count") != scores.numel():
            disagree.append(f"{scores.numel()} calibration scores where the record says {kept.get('count')}")
        if "digest" in kept and kept["digest"] != scores_digest(scores):
            disagree.append("calibration scores other than the recorded ones (their digest differs)")
        try:
            # The record is read from a file: its tpr is checked here (a missing or non-number one is a disagreement).
            cut = threshold_for(scores, check_tpr(record.get("tpr")), record.get("delta"))
        except (TypeError, ValueError) as error:
            disagree.append(f"no cut of the scores for the record's tpr {record.get('tpr')!r} ({error})")
        else:
            if cut != float(threshold):
                disagree.append(f"threshold {float(threshold)!r}, where the scores' cut for tpr {record.get('tpr')!r} "
                                f"is {cut!r}")
        if disagree:
            raise UnboundCalibration(f"{source} does not hold one calibration: " + "; ".join(disagree))
        return cls(float(threshold), _plain(record), scores.contiguous())


__all__ = ["MAX_KEPT_SCORES", "SCORES_RECORD", "Calibration", "UnboundCalibration", "changed_settings",
           "fitted_state_digest", "kept_scores", "scores_digest"]
