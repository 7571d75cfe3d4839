"""Every method's settings are a config class written in the method's own file (PEFT's ``LoraConfig``): typed
fields, each with a default, a check and a help string; ``help()`` shows them, and the checks run on the config."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import re
import sys
import typing

import pytest

from hf_gsc import DETECTORS, DetectorConfig
from hf_gsc.detectors.knn import KNNConfig


def _module_source(cls: type) -> str:
    return inspect.getsource(sys.modules[cls.__module__])


@pytest.mark.parametrize("method", sorted(DETECTORS))
def test_every_method_has_a_hand_written_config_class_in_its_file(method):
    detector = DETECTORS[method]
    config_class = detector.config_class
    # Written as a class statement (a class made by make_dataclass has none in any file) ...
    assert re.search(rf"^class {config_class.__name__}\(", _module_source(config_class), re.M), config_class
    # ... in the method's own file; GSC's in hf_gsc.settings.gsc, which imports no torch, so that `hf-gsc evaluate
    # --help` generates GSC's flags from its fields at once (tests/test_records.py checks that no torch is imported).
    own_file = "hf_gsc.settings.gsc" if method == "gsc" else detector.__module__
    assert config_class.__module__ == own_file
    assert issubclass(config_class, DetectorConfig) and config_class.method == method == detector.method


@pytest.mark.parametrize("method", sorted(DETECTORS))
def test_every_field_is_typed_and_has_a_help_string(method):
    config_class = DETECTORS[method].config_class
    hints = typing.get_type_hints(config_class)
    for spec in dataclasses.fields(config_class):
        assert hints[spec.name] is not typing.Any, (method, spec.name)
        assert isinstance(spec.metadata.get("help"), str) and len(spec.metadata["help"]) > 10, (method, spec.name)
        assert callable(spec.metadata["check"]), (method, spec.name)


def test_help_shows_typed_fields_with_their_help():
    text = pydoc.render_doc(KNNConfig, renderer=pydoc.plaintext)
    assert "k: 'int' = 50" in text  # the dataclass signature, typed
    help_text = dataclasses.fields(KNNConfig)[-1].metadata["help"]
    assert f"k (int): {help_text}" in " ".join(text.split())


def test_range_checks_live_on_the_config_and_run_on_every_assignment():
    with pytest.raises(ValueError, match=r"^KNNConfig\.k must be an integer >= 1, got 0"):
        KNNConfig(k=0)
    config = KNNConfig(k=3)
    with pytest.raises(ValueError, match=r"^KNNConfig\.k must be an integer >= 1"):
        config.k = 2.5
    assert config.k == 3
    odin = DETECTORS["odin"].config_class(image_std=(0.5, 1))
    assert odin.image_std == [0.5, 1.0]  # a JSON value, as saved
    with pytest.raises(ValueError, match="image_std must be a positive number"):
        odin.image_std = [0.5, -1]


def test_the_defaults_are_the_config_class_defaults():
    for method, detector in DETECTORS.items():
        if hasattr(detector, "defaults"):
            assert dict(detector.defaults) == detector.config_class().hyperparameters, method


def test_a_field_without_check_and_help_is_refused_when_the_class_is_written():
    with pytest.raises(TypeError, match=r"MyConfig\.k: declare each config field with setting\(default, check, help\)"):
        @dataclasses.dataclass
        class MyConfig(DetectorConfig):
            method: typing.ClassVar[str] = "mine"
            k: int = 5
