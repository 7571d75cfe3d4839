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
    finally:
        _end_process_group()
    if results is not None:
        output_dir = Path(args.output_dir)
        print((output_dir / RESULTS_MD).read_text())
        print(f"wrote {output_dir / RESULTS_JSON} ({results['seconds']['total']:.1f}s)")
    return 0


def _end_process_group() -> None:
    """Destroy the process group of a several-process launch before the interpreter exits: left to the interpreter's
    shutdown, the group's C++ threads could be torn down while still running, and a process then aborted ("terminate
    called without an active exception", seen once on a loaded 2-core machine) after its work was done. Each process
    runs this after its own last collective; a single process has no group."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["main"]
