"""The evaluation as a library (``EvaluationArguments``, ``OODEvaluator``) and its run folder as one artifact: reruns
reuse what is valid and rebuild the rest, results and saved detectors never disagree, user stops end in one line."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from conftest import evaluate_argv
from test_evaluation import _launch_two_processes, tiny, unsupported_model  # noqa: F401  (the tiny model and data fixture)

from hf_gsc.detectors import DETECTORS
from hf_gsc.evaluation import cli, evaluator, fitting
from hf_gsc.evaluation.arguments import EvaluationArgumentParser, EvaluationArguments
from hf_gsc.evaluation.errors import InputError
from hf_gsc.evaluation.result import EverythingSkippedError


def _argv(tiny, output_dir: Path, methods: str, *extra: str) -> list[str]:  # noqa: F811
    return ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"noise={tiny['noise']}",
            "--methods", methods, "--output-dir", str(output_dir), "--batch-size", "8", "--no-plots",
            *(["--hyperparameter", "knn.k=3"] if "knn" in methods.split(",") else []), *extra]


# ------------------------------------------------------------------------------------------- the arguments
def test_every_option_is_a_documented_field_parsed_by_hf_argument_parser(tmp_path):
    from transformers import HfArgumentParser

    fields = [item for item in dataclasses.fields(EvaluationArguments) if item.init]
    undocumented = [item.name for item in fields if not item.metadata.get("help")]
    assert not undocumented, undocumented
    parser = EvaluationArgumentParser()
    assert isinstance(parser, HfArgumentParser)
    flags = {option for action in parser._actions for option in action.option_strings}
    assert {f"--{item.name.replace('_', '-')}" for item in fields} <= flags
    # Today's spellings: repeated --ood-dataset and --hyperparameter, store-true switches, a method's own flags.
    args = parser.parse(["--model", "m", "--id-dataset", str(tmp_path), "--ood-dataset", f"a={tmp_path}",
                         "--ood-dataset", f"b={tmp_path}", "--output-dir", str(tmp_path / "out"), "--tune",
                         "--no-plots", "--methods", "gsc,knn", "--hyperparameter", "knn.k=3",
                         "--hyperparameter", "gsc.mask_ratio=0.1", "--split-point", "penultimate"])
    assert args.named_ood_datasets == [("a", str(tmp_path)), ("b", str(tmp_path))]
    assert args.tune and args.no_plots and not args.save_detectors and args.batch_size == 64
    assert args.method_hyperparameters == {"gsc": {"split_point": "penultimate", "mask_ratio": 0.1}, "knn": {"k": 3}}
    assert args.tpr is None and args.target_tpr == 0.95  # the default is resolved without changing the field
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.tpr = 0.5
    # The same in Python, checked on construction.
    same = EvaluationArguments(model="m", id_dataset=str(tmp_path), ood_dataset=[f"a={tmp_path}", f"b={tmp_path}"],
                               output_dir=str(tmp_path / "out"), tune=True, no_plots=True, methods="gsc,knn",
                               hyperparameter=["knn.k=3", "gsc.mask_ratio=0.1"], split_point="penultimate")
    assert same == args
    with pytest.raises(InputError, match="--batch-size must be a positive integer"):
        EvaluationArguments(model="m", benchmark="fmnist-ood", output_dir=str(tmp_path), batch_size=0)


def test_list_methods_names_no_internal_class(capsys):
    with pytest.raises(SystemExit) as stop:
        EvaluationArgumentParser().parse(["--list-methods"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(DETECTORS)
    internal = [line for line in lines if any(cls.__name__ in line for cls in DETECTORS.values())
                or "Detector" in line or "Config" in line or "hf_gsc." in line or "(see " in line]
    assert not internal, internal


# --------------------------------------------------------------------------------------- the library example
def test_the_notebook_example_evaluates_a_model_object(tiny, tmp_path):  # noqa: F811
    """The example of docs/evaluation.md ("Python"), on the tiny model and data."""
    from transformers import AutoModelForImageClassification

    from hf_gsc import EvaluationArguments, OODEvaluator

    model = AutoModelForImageClassification.from_pretrained(tiny["model"])
    args = EvaluationArguments(id_dataset=tiny["id"], ood_dataset=[f"noise={tiny['noise']}"],
                               methods="msp,energy,knn", hyperparameter=["knn.k=3"], output_dir=str(tmp_path),
                               batch_size=8, no_plots=True)
    result = OODEvaluator(model, args).evaluate()
    assert result.selected_method in {"msp", "energy", "knn"}
    assert result.methods[result.selected_method]["ood"]["noise"]["auroc"] >= 0
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(result.to_dict()))
    assert set(result.seconds) >= {*evaluator.PHASES, "total"}
    # KNN's fit pass read the ID train split once, on the one process.
    fit_rows = json.loads((fitting.fit_dir(tmp_path, "knn") / fitting.FIT_INFO).read_text())["num_samples"]
    assert result.seconds["fit_images_per_process"] == [fit_rows] and fit_rows > 0


def test_a_parsed_command_line_and_the_loaded_model_it_names(tiny, tmp_path):  # noqa: F811
    """transformers' idiom: parse an ``hf-gsc evaluate`` command line (``--model`` included), load that model and
    pass both; the object is used and the path recorded. Another model, or a detector as --model, is refused naming
    both."""
    from transformers import AutoModelForImageClassification

    from hf_gsc import AutoOODDetector, OODEvaluator

    args = EvaluationArgumentParser().parse(_argv(tiny, tmp_path / "run", "msp"))
    model = AutoModelForImageClassification.from_pretrained(tiny["model"])
    run = OODEvaluator(model, args)
    assert run.model_source is model and run.model_name() == tiny["model"]
    # The same folder however it is spelled.
    relative = os.path.relpath(tiny["model"]) + "/"
    assert OODEvaluator(AutoModelForImageClassification.from_pretrained(relative), args).model_name() == tiny["model"]
    result = run.evaluate()
    assert json.loads((tmp_path / "run" / "results.json").read_text())["model"] == tiny["model"] == result.to_dict()["model"]

    other = tmp_path / "other"
    model.save_pretrained(other)
    with pytest.raises(InputError) as refused:
        OODEvaluator(AutoModelForImageClassification.from_pretrained(str(other)), args)
    assert f"'{other}'" in str(refused.value) and f"--model '{tiny['model']}'" in str(refused.value)
    detector = AutoOODDetector.from_pretrained(tiny["model"], method="msp")
    with pytest.raises(InputError, match="a loaded detector goes with --detector"):
        OODEvaluator(detector, args)


# ------------------------------------------------------------------------------------------------- reruns
def test_a_rerun_rebuilds_saved_detectors_from_cached_fits_and_scores(tiny, tmp_path):  # noqa: F811
    from hf_gsc import AutoOODDetector

    argv = _argv(tiny, tmp_path, "msp,knn,react", "--save-detectors")
    first = evaluate_argv(argv)
    again = evaluate_argv(argv)  # every score cached: the fits are loaded to save the detectors again
    # Beside the score files: the p-value of every ID test and OOD score against the ID validation scores.
    import torch
    from safetensors.torch import load_file

    from hf_gsc.utils.calibration import kept_scores
    from hf_gsc.utils.conformal import conformal_p_value

    p_values = load_file(tmp_path / "p_values" / "knn.safetensors")
    scores_dir = tmp_path / "scores" / "knn"
    validation = kept_scores(load_file(scores_dir / "id_validation.safetensors")["ood_score"])
    assert "id_test" in p_values and len(p_values) > 1
    for split, values in p_values.items():
        scores = load_file(scores_dir / f"{split}.safetensors")["ood_score"]
        assert torch.equal(values, conformal_p_value(scores, validation))
    assert again["methods"]["knn"]["threshold"] == first["methods"]["knn"]["threshold"]
    for name in ("msp", "knn", "react", "selected"):
        detector = AutoOODDetector.from_pretrained(tmp_path / "detectors" / name)
        assert detector.config.threshold is not None
        # It keeps the ID validation scores its threshold came from: p-values, and the same threshold again.
        threshold, calibration = detector.config.threshold, detector.config.calibration
        assert detector.calibration_scores is not None and detector.p_value_cut is not None
        assert detector.set_tpr(calibration["tpr"], calibration["delta"]) == threshold
        # The results a saved detector carries are the folder's, timings included.
        assert (tmp_path / "detectors" / name / "results.json").read_text() == (tmp_path / "results.json").read_text()


def test_a_run_that_saves_nothing_removes_a_stale_selected_detector(tiny, tmp_path):  # noqa: F811
    evaluate_argv(_argv(tiny, tmp_path, "msp,energy", "--save-detectors"))
    assert (tmp_path / "detectors" / "selected").is_dir()
    results = evaluate_argv(_argv(tiny, tmp_path, "msp,energy"))
    assert results["selection"]["method"] in {"msp", "energy"}
    assert not (tmp_path / "detectors" / "selected").exists()


def test_results_md_holds_no_timing(tiny, tmp_path):  # noqa: F811
    argv = _argv(tiny, tmp_path, "msp,energy")
    evaluate_argv(argv)
    first = (tmp_path / "results.md").read_text()
    for path in (tmp_path / "scores").rglob("*.safetensors"):  # scored again: other timings, the same report
        path.unlink()
    evaluate_argv(argv)
    assert (tmp_path / "results.md").read_text() == first
    assert " s)" not in first and "took" not in first


# ------------------------------------------------------------------------------------------------- exits
def test_ctrl_c_ends_in_one_line_and_the_same_command_resumes(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    argv = _argv(tiny, tmp_path, "msp,knn", "--save-detectors")
    real = evaluator.score_missing
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # after the test splits, while the selection is scored
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluator, "score_missing", interrupted)
    assert cli.main(argv, prog="hf-gsc evaluate") == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("hf-gsc evaluate: interrupted; run the same command again to resume (finished fits, score "
                       "files and the tuning search are kept)"), err
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "results.json").exists() and not (tmp_path / "detectors" / "selected").exists()
    monkeypatch.setattr(evaluator, "score_missing", real)
    assert cli.main(argv, prog="hf-gsc evaluate") == 0
    out = capsys.readouterr().out
    assert "score files: 4 to compute" in out  # only the two OOD validation sets of the two methods
    assert (tmp_path / "detectors" / "selected").is_dir()


def test_a_run_whose_every_method_is_skipped_ends_in_one_line(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    from hf_gsc.detectors.msp import MSPDetector

    def broken(self, batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(MSPDetector, "score_batch", broken)
    assert cli.main(_argv(tiny, tmp_path, "msp"), prog="hf-gsc evaluate") == 1
    err = capsys.readouterr().err
    assert "hf-gsc evaluate: error: every method was skipped: msp: scoring failed: RuntimeError: boom" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------------- what a run reads, builds
def test_a_saved_detector_is_evaluated_without_an_id_validation_split(tiny, tmp_path):  # noqa: F811
    import datasets

    from hf_gsc import AutoOODDetector

    evaluate_argv(_argv(tiny, tmp_path / "fit", "knn", "--save-detectors", "--no-selection"))
    folder = tmp_path / "fit" / "detectors" / "knn"
    ids = datasets.load_from_disk(tiny["id"])
    datasets.DatasetDict({"test": ids["test"]}).save_to_disk(tmp_path / "test_only")
    results = evaluate_argv(["--detector", str(folder), "--id-dataset", str(tmp_path / "test_only"),
                             "--ood-dataset", f"noise={tiny['noise']}", "--output-dir", str(tmp_path / "shipped"),
                             "--batch-size", "8", "--no-plots"])
    shipped = AutoOODDetector.from_pretrained(folder)
    assert results["methods"]["knn"]["threshold"] == pytest.approx(shipped.config.threshold)
    assert "id_validation" not in results["split_sizes"]
    # The same detector as an object (a notebook's), evaluated as it is: the same figures.
    from hf_gsc import OODEvaluator

    args = EvaluationArguments(id_dataset=str(tmp_path / "test_only"), ood_dataset=[f"noise={tiny['noise']}"],
                               output_dir=str(tmp_path / "object"), batch_size=8, no_plots=True)
    as_object = OODEvaluator(shipped, args).evaluate()
    assert as_object.methods["knn"]["ood"]["noise"] == pytest.approx(results["methods"]["knn"]["ood"]["noise"])
    assert as_object.selection is None and as_object.details["detector"]["method"] == "knn"


def test_a_method_that_cannot_be_built_is_skipped_naming_the_flag(tiny, tmp_path, monkeypatch):  # noqa: F811
    model = unsupported_model(tiny, tmp_path, monkeypatch)
    others = [name for name in DETECTORS if name not in ("gsc", "msp")]
    argv = _argv(tiny, tmp_path / "all", "all," + ",".join(f"-{name}" for name in others), "--no-selection")
    argv[argv.index("--model") + 1] = model
    results = evaluate_argv(argv)
    assert set(results["methods"]) == {"msp"}
    assert "cannot build this detector on this model" in results["skipped"]["gsc"]
    assert "--split-point penultimate" in results["skipped"]["gsc"]
    # Named in --methods: skipped the same way, the others run, and results.md says which and why.
    named = evaluate_argv([*argv[:argv.index("--methods") + 1], "gsc,msp", *argv[argv.index("--methods") + 2:]])
    assert set(named["methods"]) == {"msp"} and named["skipped"]["gsc"] == results["skipped"]["gsc"]
    report = (tmp_path / "all" / "results.md").read_text()
    assert "`gsc`: cannot build this detector on this model" in report and "--split-point penultimate" in report
    with pytest.raises(EverythingSkippedError, match=r"every method was skipped: gsc: cannot build .*--split-point"):
        evaluate_argv([*argv[:argv.index("--methods") + 1], "gsc", *argv[argv.index("--methods") + 2:]])


def test_own_ood_datasets_in_near_and_far_groups(tiny, tmp_path):  # noqa: F811
    argv = _argv(tiny, tmp_path, "msp", "--no-selection")
    argv[argv.index("--ood-dataset"):argv.index("--ood-dataset") + 2] = [
        "--near-ood-dataset", f"noise={tiny['noise']}", "--far-ood-dataset", f"flat={tiny['flat']}"]
    results = evaluate_argv(argv)
    assert results["ood_groups"] == {"near": ["noise"], "far": ["flat"]}
    assert set(results["methods"]["msp"]["average_by_group"]) == {"near", "far"}
    assert "near" in (tmp_path / "results.md").read_text().lower()


# ---------------------------------------------------------------------------------------------- 2 processes
def test_two_process_reruns_rebuild_detectors_and_drop_a_stale_choice(tiny, tmp_path):  # noqa: F811
    output_dir = tmp_path / "two"
    argv = _argv(tiny, output_dir, "msp,knn", "--save-detectors")
    for _ in range(2):  # the second run: every score cached, the saved detectors rebuilt from the fits
        launched = _launch_two_processes(tmp_path, argv, streaming=False)
        assert launched.returncode == 0, launched.stderr[-4000:]
        assert (output_dir / "detectors" / "selected").is_dir()
    launched = _launch_two_processes(tmp_path, [item for item in argv if item != "--save-detectors"], streaming=False)
    assert launched.returncode == 0, launched.stderr[-4000:]
    assert json.loads((output_dir / "results.json").read_text())["num_processes"] == 2
    assert not (output_dir / "detectors" / "selected").exists()


#: The evaluation's command line, interrupted on every process at the same point (the second scoring call, while the
#: selection is scored): what a Ctrl-C does, which reaches the launcher's whole process group.
INTERRUPTED_SCRIPT = """
import sys
from hf_gsc.evaluation import evaluator, main

real, calls = evaluator.score_missing, []


def interrupted(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
        raise KeyboardInterrupt
    return real(*args, **kwargs)


evaluator.score_missing = interrupted
sys.exit(main(sys.argv[1:], prog="hf-gsc evaluate"))
"""


def test_two_processes_after_ctrl_c_the_same_command_resumes(tiny, tmp_path):  # noqa: F811
    output_dir = tmp_path / "two"
    argv = _argv(tiny, output_dir, "msp,knn", "--save-detectors")
    stopped = _launch_two_processes(tmp_path, argv, streaming=False, script_text=INTERRUPTED_SCRIPT)
    assert stopped.returncode != 0
    assert stopped.stderr.count("hf-gsc evaluate: interrupted; run the same command again to resume") == 1, \
        stopped.stderr[-4000:]
    assert not (output_dir / "results.json").exists() and not (output_dir / "detectors" / "selected").exists()
    resumed = _launch_two_processes(tmp_path, argv, streaming=False)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "score files: 4 to compute" in resumed.stdout  # only the two OOD validation sets of the two methods
    assert json.loads((output_dir / "results.json").read_text())["num_processes"] == 2
    assert (output_dir / "detectors" / "selected").is_dir()


# ------------------------------------------------------------------------------------------- the phases
def test_a_phase_called_out_of_order_names_the_phase_it_needs(tiny, tmp_path):  # noqa: F811
    """The phases are public: each one says which phase comes first, instead of an AttributeError on a missing
    attribute; run in order by hand they give what ``evaluate()`` gives, through the declared state and context."""
    from hf_gsc.evaluation.context import EvaluationState, RunContext

    args = EvaluationArguments(model=tiny["model"], id_dataset=tiny["id"], ood_dataset=f"noise={tiny['noise']}",
                               methods="msp,knn", hyperparameter="knn.k=3", output_dir=str(tmp_path),
                               batch_size=8, no_plots=True, no_selection=True)
    run = evaluator.OODEvaluator(args=args)
    assert isinstance(run.state, EvaluationState) and run.context is None
    with pytest.raises(RuntimeError, match=r"OODEvaluator\.fit\(\) needs plan\(\) first: the phases run in the order "
                                           r"load, tune, plan, fit, score, select, collect, report, save"):
        run.fit()
    with pytest.raises(RuntimeError, match=r"OODEvaluator\.plan\(\) needs load\(\) first"):
        run.plan()
    run.load()
    assert isinstance(run.context, RunContext) and run.context.batch_size == 8 and run.context.seed == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.context.batch_size = 4
    with pytest.raises(RuntimeError, match=r"OODEvaluator\.score\(\) needs fit\(\) first"):
        run.score()
    for phase in ("tune", "plan", "fit", "score", "select"):
        getattr(run, phase)()
    result = run.collect()
    run.report(result)
    assert run.state.done == ["load", "tune", "plan", "fit", "score", "select", "collect", "report"]
    assert set(result.methods) == {"msp", "knn"} and (tmp_path / "results.json").is_file()
