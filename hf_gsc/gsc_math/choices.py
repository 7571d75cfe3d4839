"""The names of GSC's choices (the values of ``GSCConfig``'s ``operation``, ``selection``, ``mask_size`` and
``approximation``), without torch: the config's checks and the command line read them at once, the math
(:mod:`hf_gsc.gsc_math.shortcircuit`, :mod:`hf_gsc.gsc_math.step`) branches on them.
"""

from __future__ import annotations

from typing import Literal, get_args


Operation = Literal["zero", "perturb", "project", "clip", "scale"]
Selection = Literal["gradient", "random", "reverse", "fisher"]
MaskSize = Literal["fixed", "adaptive"]
Approximation = Literal["first_order", "predicted_logit", "exact"]

OPERATIONS: tuple[str, ...] = get_args(Operation)
SELECTIONS: tuple[str, ...] = get_args(Selection)
MASK_SIZES: tuple[str, ...] = get_args(MaskSize)
APPROXIMATIONS: tuple[str, ...] = get_args(Approximation)
