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

OPERATIONS: tuple[Operation, ...] = get_args(Operation)
SELECTIONS: tuple[Selection, ...] = get_args(Selection)
MASK_SIZES: tuple[MaskSize, ...] = get_args(MaskSize)
APPROXIMATIONS: tuple[Approximation, ...] = get_args(Approximation)
