"""``EvaluationArguments`` is one static dataclass: ``transformers.HfArgumentParser`` parses every flag of
``hf-gsc evaluate`` from it, Python values of their natural types are accepted (or refused naming the field), and a run
from it gives the command line's numbers."""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import pytest
from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)
from transformers import HfArgumentParser

import hf_gsc
from hf_gsc.evaluation import cli
from hf_gsc.evaluation.arguments import GSC_FLAGS, EvaluationArgumentParser, GSCArguments
from hf_gsc.evaluation.errors import InputError


def _every_flag(tmp_path: Path) -> list[str]:
    """A long, realistic command line giving every flag of ``hf-gsc evaluate`` (one source, --model)."""
    ood = tmp_path / "ood"
    ood.mkdir(exist_ok=True)
    val = tmp_path / "val_ood"  # validation data is never a test split (--ood-dataset)
    val.mkdir(exist_ok=True)
    return ["--model", "org/vit", "--revision", "main", "--id-dataset", str(tmp_path),
            "--ood-dataset", f"a={ood}", "--ood-dataset", f"b={ood}", "--near-ood-dataset", f"near={ood}",
            "--far-ood-dataset", f"far={ood}", "--val-ood-dataset", f"val={val}", "--label-map", "cat=0,dog=1",
            "--image-column", "img", "--label-column", "fine_label",
            "--max-samples", "50", "--max-fit-samples", "40", "--skip-unreadable-images",
            "--methods", "gsc,knn,odin", "--output-dir", str(tmp_path / "out"), "--batch-size", "8", "--seed", "3",
            "--tpr", "0.9", "--conformal-delta", "0.1", "--hyperparameter", "knn.k=3",
            "--hyperparameter", "odin.temperature=10", "--tune", "--overwrite", "--no-plots", "--save-detectors",
            "--mixed-precision", "no", "--num-workers", "0", "--image-backend", "pil",
            "--split-point", "penultimate", "--earlier-split-point", "vit.encoder.layer.0", "--mask-ratio", "0.1",
            "--mask-size", "fixed", "--selection", "gradient", "--operation", "perturb", "--alpha", "0.2",
            "--clip-bound", "2.0", "--beta", "0.4", "--approximation", "exact", "--gsc-score", "msp",
            "--gsc-temperature", "2.0", "--gsc-seed", "5", "--feature-shaping", "none", "--shaping-percentile", "90"]


def test_hf_argument_parser_parses_every_flag_of_the_command_line(tmp_path):
    argv = _every_flag(tmp_path)
    fields = [item for item in dataclasses.fields(hf_gsc.EvaluationArguments) if item.init]
    assert not [item.name for item in fields if not item.metadata.get("help")]
    # Every field except the other source (--detector) and the flags of other runs (--benchmark, --ood-splits,
    # --no-selection, --streaming, --labels-by-order: they contradict the ones given) is on the command line.
    given = {option[2:].replace("-", "_") for option in argv if option.startswith("--")}
    assert {item.name for item in fields} - given == {"detector", "benchmark", "ood_splits", "no_selection",
                                                     "streaming", "labels_by_order"}
    (parsed,) = HfArgumentParser((hf_gsc.EvaluationArguments,)).parse_args_into_dataclasses(argv)
    assert parsed == EvaluationArgumentParser().parse(argv)
    assert parsed.hyperparameter == ["knn.k=3", "odin.temperature=10"] and parsed.num_workers == 0
    assert parsed.method_hyperparameters["gsc"] == {
        "split_point": "penultimate", "earlier_split_point": "vit.encoder.layer.0", "mask_ratio": 0.1,
        "mask_size": "fixed", "selection": "gradient", "operation": "perturb", "alpha": 0.2, "clip_bound": 2.0,
        "beta": 0.4, "approximation": "exact", "score": "msp", "temperature": 2.0, "seed": 5,
        "feature_shaping": "none", "shaping_percentile": 90.0}
    assert parsed.named_ood_datasets == [("a", str(tmp_path / "ood")), ("b", str(tmp_path / "ood")),
                                         ("near", str(tmp_path / "ood")), ("far", str(tmp_path / "ood"))]
    assert parsed.ood_dataset_groups == {"near": ["near"], "far": ["far"]}
    # The other source and run kind, parsed the same way.
    other = ["--detector", "saved/knn", "--benchmark", "fmnist-ood", "--ood-splits", "mnist", "--no-selection",
             "--output-dir", str(tmp_path / "o2")]
    (parsed,) = HfArgumentParser((hf_gsc.EvaluationArguments,)).parse_args_into_dataclasses(other)
    assert parsed.detector == "saved/knn" and parsed.ood_split_names == ["mnist"] and parsed.no_selection


def test_gsc_flags_are_generated_from_gscs_settings_with_their_type_help_and_default():
    from hf_gsc.detectors.gsc import GSCConfig
    from hf_gsc.evaluation.options import plain_text

    specs, defaults = {spec.name: spec for spec in dataclasses.fields(GSCConfig)}, GSCConfig()
    hints, config_hints = typing.get_type_hints(GSCArguments), typing.get_type_hints(GSCConfig)
    assert sorted(GSC_FLAGS.values()) == sorted(GSCConfig.setting_names())  # every setting has a flag, and no more
    for item in dataclasses.fields(GSCArguments):
        setting = GSC_FLAGS[item.name]
        assert item.default is None  # unset unless given: the saved detector's config or GSCConfig's default applies
        assert item.metadata["help"] == (f"{plain_text(specs[setting].metadata['help'])} "
                                         f"(default: {getattr(defaults, setting)!r})").replace("%", "%%")
        # The setting's type, or None; a choice of names (a Literal) is parsed as a string, which its check refuses
        # or keeps.
        kind = str if typing.get_origin(config_hints[setting]) is typing.Literal else config_hints[setting]
        assert hints[item.name] == typing.Optional[kind], item.name
    help_text = EvaluationArgumentParser().format_help()
    assert "--gsc-score {energy,msp,max_logit}" in help_text and "the paper's 5 %)" in help_text
    # A setting added to the config is a flag, with no other line written; a flag taking another option's name is
    # refused when the flags are built.
    from hf_gsc.evaluation.setting_flags import setting_flags
    from hf_gsc.settings.config import integer_check, setting

    @dataclasses.dataclass
    class WiderConfig(GSCConfig):
        window: int = setting(3, integer_check(1), "Positions pooled; 3: this test's.")

    arguments, flags = setting_flags(WiderConfig, "WiderArguments", prefix="gsc_", prefixed=("seed",))
    assert flags["window"] == "window" and flags["gsc_seed"] == "seed" and "seed" not in flags
    (parsed,) = HfArgumentParser((arguments,)).parse_args_into_dataclasses(["--window", "5", "--gsc-seed", "2"])
    assert (parsed.window, parsed.gsc_seed, parsed.mask_ratio) == (5, 2, None)
    with pytest.raises(ValueError, match=r"WiderConfig.seed: its flag --seed is another option's"):
        setting_flags(WiderConfig, "WiderArguments", reserved=("seed",))


def test_python_values_of_their_natural_types_are_accepted_or_refused_naming_the_field(tmp_path):
    ood = tmp_path / "photos"
    ood.mkdir()
    common = {"model": "m", "id_dataset": str(tmp_path), "output_dir": str(tmp_path / "out")}
    one = hf_gsc.EvaluationArguments(**common, ood_dataset=f"photos={ood}", methods=["energy", "gsc"],
                                     hyperparameter="gsc.mask_ratio=0.1")
    listed = hf_gsc.EvaluationArguments(**common, ood_dataset=[f"photos={ood}"], methods="energy,gsc",
                                        hyperparameter=("gsc.mask_ratio=0.1",))
    assert one == listed
    assert one.named_ood_datasets == [("photos", str(ood))] and one.method_names == ["energy", "gsc"]
    assert one.method_hyperparameters == {"energy": {}, "gsc": {"mask_ratio": 0.1}}
    with pytest.raises(InputError, match=r"ood_dataset \(--ood-dataset\) must be a string or a list of strings"):
        hf_gsc.EvaluationArguments(**common, ood_dataset=[ood])  # a Path, not a string
    with pytest.raises(InputError, match=r"methods \(--methods\) must be a comma-separated string or a list"):
        hf_gsc.EvaluationArguments(**common, ood_dataset=f"photos={ood}", methods=3)
    with pytest.raises(InputError, match=r"id_dataset \(--id-dataset\) must be a string"):
        hf_gsc.EvaluationArguments(**{**common, "id_dataset": tmp_path}, ood_dataset=f"photos={ood}")


def test_the_evaluator_on_parsed_arguments_gives_the_command_lines_numbers(tiny, tmp_path):  # noqa: F811
    def argv(output_dir: Path) -> list[str]:
        return ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"noise={tiny['noise']}",
                "--methods", "msp,energy,knn", "--hyperparameter", "knn.k=3", "--output-dir", str(output_dir),
                "--batch-size", "8", "--no-plots"]

    assert cli.main(argv(tmp_path / "cli")) == 0
    (args,) = HfArgumentParser((hf_gsc.EvaluationArguments,)).parse_args_into_dataclasses(argv(tmp_path / "py"))
    hf_gsc.OODEvaluator(args=args).evaluate()
    by_cli, by_python = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("cli", "py"))
    assert by_python["methods"].keys() == by_cli["methods"].keys() == {"msp", "energy", "knn"}
    for name, entry in by_cli["methods"].items():  # the same process and threads: equal up to float rounding
        assert by_python["methods"][name]["threshold"] == pytest.approx(entry["threshold"], rel=1e-9, abs=1e-12)
        assert by_python["methods"][name]["ood"]["noise"] == pytest.approx(entry["ood"]["noise"], rel=1e-9)
    assert by_python["selection"]["method"] == by_cli["selection"]["method"]
    assert by_python["id_accuracy"] == by_cli["id_accuracy"]


def test_a_local_looking_path_that_does_not_exist_fails_at_once_naming_it(tmp_path, monkeypatch):
    """``--id-dataset data/photo`` (a typo, with a folder ``data`` here), ``--model ./x``, ``a/b/c``: one line naming
    the path, on construction (no Hub call: the Hub is unreachable here, and the check needs no network). A Hub id
    ``user/name`` still goes to the Hub."""
    from hf_gsc import EvaluationArguments
    from hf_gsc.evaluation.errors import InputError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "data").mkdir()
    common = {"output_dir": str(tmp_path / "out")}
    hub_ood = {"ood_dataset": ["noise=user/noise:test"]}
    cases = [({"model": "m", "id_dataset": "data/photo", **hub_ood}, "--id-dataset 'data/photo': no such folder"),
             ({"model": "./x", "benchmark": "fmnist-ood"}, "--model './x': no such folder './x'"),
             ({"model": "a/b/c", "benchmark": "fmnist-ood"}, "--model 'a/b/c': no such folder"),
             ({"model": "data/vit", "benchmark": "fmnist-ood"}, "--model 'data/vit': no such folder"),
             ({"model": "~/nothing-here-vit", "benchmark": "fmnist-ood"}, "--model '~/nothing-here-vit'"),
             ({"detector": "./gone", "benchmark": "fmnist-ood"}, "--detector './gone': no such folder")]
    for kwargs, message in cases:
        with pytest.raises(InputError, match=message.replace("(", r"\(").replace(".", r"\.")):
            EvaluationArguments(**common, **kwargs)
    # Hub ids, and folders that exist, pass the check.
    EvaluationArguments(model="user/vit", benchmark="fmnist-ood", **common)
    EvaluationArguments(model="user/vit", id_dataset="user/photos:cfg", **hub_ood, **common)
    (tmp_path / "data" / "vit").mkdir()
    EvaluationArguments(model="data/vit", benchmark="fmnist-ood", **common)
