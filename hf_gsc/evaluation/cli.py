"""``main(argv, prog)``: the command line of ``hf-gsc evaluate`` (and ``scripts/evaluate_ood.py``, ``scripts/demo.py``):
:class:`~hf_gsc.evaluation.arguments.EvaluationArgumentParser` + :class:`~hf_gsc.evaluation.evaluator.OODEvaluator`.

Exits: 0 with ``results.md`` printed (main process); 2 with one line on bad input or an image that cannot be decoded
(without ``--skip-unreadable-images``); 1 with one line naming each reason when every method was skipped, or with one
line naming the output folder and what it keeps when the disk is full; 130 on Ctrl-C, with one line saying that the
same command resumes. No traceback for any of these.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .arguments import EvaluationArgumentParser
from .errors import DiskFullError, InputError


#: The exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """CLI entry point: parse, evaluate, print ``results.md`` on the main process; the status as described above."""
    parser = EvaluationArgumentParser(prog)
    try:
        args = parser.parse(argv)  # --help ends here: the evaluation (and torch) is imported below
    except InputError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    from ..data.decoding import UndecodableImageError
    from .evaluator import EverythingSkippedError, OODEvaluator
    from .report import RESULTS_JSON, RESULTS_MD

    try:
        try:
            result = OODEvaluator(args=args).evaluate()
        finally:
            _end_process_group()
    except (InputError, UndecodableImageError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except DiskFullError as error:
        print(f"{parser.prog}: error: {error.strerror}", file=sys.stderr)
        return 1
    except EverythingSkippedError as error:
        if _is_main_process():
            print(f"{parser.prog}: error: every method was skipped: "
                  + "; ".join(f"{name}: {reason}" for name, reason in error.reasons.items()), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if _is_main_process():
            print(f"{parser.prog}: interrupted; run the same command again to resume (finished fits, score files and "
                  "the tuning search are kept)", file=sys.stderr, flush=True)
        return INTERRUPTED
    if result is not None:
        output_dir = Path(args.output_dir)
        print((output_dir / RESULTS_MD).read_text())
        print(f"wrote {output_dir / RESULTS_JSON} ({result.seconds['total']:.1f}s)")
    return 0


def _is_main_process() -> bool:
    """Whether this is the launch's main process (``RANK`` 0 or no launcher), without touching a process group."""
    return os.environ.get("RANK", "0") == "0"


def _end_process_group() -> None:
    """Destroy the process group of a several-process launch before the interpreter exits: left to the interpreter's
    shutdown, the group's C++ threads could be torn down while still running, and a process then aborted ("terminate
    called without an active exception", seen once on a loaded 2-core machine) after its work was done. Each process
    runs this after its own last collective; a single process has no group."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["INTERRUPTED", "main"]
