"""The ``hf-gsc`` console command (also ``python -m hf_gsc``).

    hf-gsc evaluate --model hf_gsc/reference_models/resnet --benchmark fmnist-ood --output-dir runs/resnet
    hf-gsc publish --results-dir runs/resnet --repo-id user/gsc-fmnist-resnet
    hf-gsc docs

Each subcommand is a row of :data:`COMMANDS`: the function that runs it (``module`` or ``module:function``, ``main``
by default, called with the rest of the command line) and its line of help. The function's module is imported only
when its command runs, so ``hf-gsc --help``, ``hf-gsc --version``, ``hf-gsc docs`` and every subcommand's ``--help``
import no torch (the evaluation's flags, GSC's included, are static dataclass fields). Each subcommand
hands its arguments to the library's own entry point, so ``hf-gsc evaluate --help`` is the evaluation's own help.
``evaluate`` needs the ``evaluation`` extra, its figures the ``plots`` extra (or ``--no-plots``), the generated
benchmarks the ``benchmarks`` extra (``pip install 'hf_gsc[all]'``: all three).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from collections.abc import Callable, Sequence

from .utils.docs import DOCS_HELP
from .utils.version import __version__


#: Subcommand -> (the function that runs it, ``module`` or ``module:function``; its line of help). A function takes the
#: rest of the command line (and ``prog=``, where it accepts it) and returns the exit status.
COMMANDS: dict[str, tuple[str, str]] = {
    "evaluate": ("hf_gsc.evaluation.cli",
                 "OOD evaluation of GSC and baselines on an image classifier (results.json, results.md, plots)"),
    "publish": ("hf_gsc.cli:publish",
                "upload a saved detector (any method) or an evaluation's results, with a model card, to the Hub"),
    "docs": ("hf_gsc.utils.docs:docs_main", DOCS_HELP),
    "demo": ("hf_gsc.app.demo",
             "a Gradio app for a saved or Hub detector: drop an image, see the verdict, p-value and GSC's map"),
    "space": ("hf_gsc.app.space", "write a folder that runs the demo app as a Hugging Face Space"),
}
PROG = "hf-gsc"
#: Module -> the extra that installs it, for the modules of ``hf-gsc evaluate`` that a core install lacks.
EVALUATION_MODULES = {"datasets": "evaluation", "accelerate": "evaluation", "sklearn": "evaluation",
                      "evaluate": "evaluation", "tqdm": "evaluation", "matplotlib": "plots", "skimage": "benchmarks"}
#: What each extra is for, in the message that names it.
EXTRA_PURPOSE = {"evaluation": "hf-gsc evaluate needs", "plots": "the figures of hf-gsc evaluate need",
                 "benchmarks": "the generated benchmarks (fmnist-ood, fmnist-openset) need"}


def _usage() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = [f"usage: {PROG} {{{','.join(COMMANDS)}}} [options]", f"       {PROG} --version", "", "commands:"]
    lines += [f"  {name:<{width}}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", f"Run '{PROG} COMMAND --help' for the options of a command, '{PROG} docs' for the documentation "
              "installed with the package."]
    return "\n".join(lines)


def command_function(name: str) -> Callable[..., int]:
    """The function that runs the subcommand ``name`` (its module imported now)."""
    target = COMMANDS[name][0]
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function or "main")


def publish(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Publish to the Hub either a saved detector (--detector-dir: any method, e.g. one that hf-gsc evaluate
    --save-detectors wrote under OUTPUT_DIR/detectors/METHOD, with its results and model card) or an evaluation's
    results alone (--results-dir: results.json, results.md, plots, with a model card).

    The token comes from HF_TOKEN (or the huggingface_hub login cache) and the endpoint from HF_ENDPOINT;
    it is never printed or written.
    """
    parser = argparse.ArgumentParser(prog=prog, description=publish.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--detector-dir", help="a saved detector folder (save_pretrained or --save-detectors)")
    source.add_argument("--results-dir", help="an --output-dir of hf-gsc evaluate")
    parser.add_argument("--repo-id", required=True, help="Hub repo id, e.g. user/knn-fmnist-resnet")
    parser.add_argument("--save-base-model", action="store_true",
                        help="with --detector-dir: upload the base model's weights too (needed when the detector "
                             "refers to a local base model; the pushed detector then refers to the repo itself)")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    args = parser.parse_args(argv)
    from .storage.publish_results import HubError, publish_results  # after the parse: --help imports no torch

    try:
        if args.detector_dir is not None:
            url = _publish_detector(args)
        else:
            url = publish_results(args.results_dir, args.repo_id, private=args.private, revision=args.revision)
    except (HubError, FileNotFoundError, ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"published {args.detector_dir or args.results_dir} to {args.repo_id}: {url}")
    if args.detector_dir is None:
        print(_eval_results_line(args.results_dir))
    return 0


def _eval_results_line(results_dir: str) -> str:
    """What the publish wrote in the Hub's ``.eval_results`` format, or why nothing."""
    from .storage.eval_results import EVAL_RESULTS_DIR, benchmark_dataset_id, file_name
    from .storage.results import read_results

    results = read_results(results_dir)[0]
    dataset_id = benchmark_dataset_id(results)
    if dataset_id is None:
        return (f"no {EVAL_RESULTS_DIR}/ file: the ID data ({results.get('benchmark') or results.get('id_dataset')}) "
                "is no Hub dataset, which the Hub's evaluation results name; the card's model-index holds the results")
    return f"wrote {file_name(results, dataset_id)} (Hub dataset {dataset_id}) beside the card's model-index"


def _publish_detector(args: argparse.Namespace) -> str:
    """Load the saved detector (checked, as any load) and push it as ``push_to_hub`` does, with the results saved
    beside it."""
    from pathlib import Path

    from .auto import AutoOODDetector
    from .storage.loading import is_detector_dir
    from .storage.repo_ids import is_hub_id
    from .storage.results import RESULT_FILES

    folder = Path(args.detector_dir)
    if not folder.is_dir() or not is_detector_dir(folder):
        raise FileNotFoundError(f"--detector-dir {folder}: no saved detector there (no detector_config.json)")
    detector = AutoOODDetector.from_pretrained(str(folder))
    base = detector.config.base_model_name_or_path
    if not args.save_base_model and not is_hub_id(base):  # push_to_hub's own message names its Python argument
        raise ValueError(f"--detector-dir {folder}: its base model {base!r} is not a Hub repo id, so nobody could "
                         f"load {args.repo_id!r}; pass --save-base-model to upload the base weights with the detector")
    results_dir = folder if (folder / RESULT_FILES[0]).is_file() else None
    return detector.push_to_hub(args.repo_id, private=args.private, revision=args.revision,
                                save_base_model=args.save_base_model, results_dir=results_dir)


def missing_extra_message(error: ModuleNotFoundError) -> str | None:
    """The line naming the extra that installs the missing module (``None``: not a module of an extra)."""
    extra = EVALUATION_MODULES.get((error.name or "").split(".")[0])
    if extra is None:
        return None
    message = f"{PROG} evaluate: {EXTRA_PURPOSE[extra]} the {extra!r} extra: pip install 'hf_gsc[{extra}]' ({error})"
    return message + ("; or pass --no-plots" if extra == "plots" else "")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"{PROG} {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"{_usage()}\n\n{PROG}: error: unknown command {command!r}", file=sys.stderr)
        return 2
    try:
        function = command_function(command)
        if "prog" in inspect.signature(function).parameters:
            return function(rest, prog=f"{PROG} {command}")
        return function(rest)
    except ModuleNotFoundError as error:
        message = missing_extra_message(error) if command == "evaluate" else None
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
