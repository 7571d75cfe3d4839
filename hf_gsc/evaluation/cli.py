"""``main(argv, prog)``: the command line of ``scripts/evaluate_ood.py`` / ``scripts/demo.py`` (and ``hf-gsc evaluate``).

Parses the options (:mod:`.options`), runs :func:`~hf_gsc.evaluation.runner.run_evaluation` and prints
``results.md`` on the main process. Bad input, and an image that cannot be decoded (without
``--skip-unreadable-images``), exit with status 2 and one line on stderr, no traceback.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..data.decoding import UndecodableImageError
from .options import InputError, build_parser
from .report import RESULTS_JSON, RESULTS_MD
from .runner import run_evaluation


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """CLI entry point: run, print ``results.md`` on the main process; bad input exits with status 2."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        results = run_evaluation(args)
    except (InputError, UndecodableImageError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if results is not None:
        output_dir = Path(args.output_dir)
        print((output_dir / RESULTS_MD).read_text())
        print(f"wrote {output_dir / RESULTS_JSON} ({results['seconds']['total']:.1f}s)")
    return 0


__all__ = ["main"]
