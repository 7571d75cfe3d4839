"""The names of the scores computed from logits (:mod:`hf_gsc.utils.scores`), without torch: the config checks and
the command line read them at once."""

from __future__ import annotations

from typing import Literal, get_args


Score = Literal["energy", "msp", "max_logit"]
SCORES: tuple[Score, ...] = get_args(Score)
