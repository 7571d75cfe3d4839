"""Folders saved by hf_gsc before the config unification (``tests/fixtures/saved_today/``, written by
``tests/fixtures/make_saved_today.py`` from that version) keep loading, with their settings, their threshold and the
scores they gave when saved (float64 tiny ViT: equal within 1e-10)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from conftest import IMAGE_SIZE

from hf_gsc import AutoOODDetector


FIXTURES = Path(__file__).parent / "fixtures" / "saved_today"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())["cases"]


def _pixels(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_folder_saved_today_loads_and_scores_the_same(case):
    expected = EXPECTED[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unchanged load keeps its threshold without a word
        detector = AutoOODDetector.from_pretrained(str(FIXTURES / case))
    assert detector.method == expected["method"]
    # The saved settings as saved; a setting added since takes its default (the folder was written without it).
    defaults = type(detector.config)().hyperparameters
    assert dict(detector.hyperparameters) == {**defaults, **expected["hyperparameters"]}
    assert detector.config.threshold == expected["threshold"]
    scores = detector.score(_pixels(6, 3))
    torch.testing.assert_close(scores.double(), torch.tensor(expected["scores"], dtype=torch.float64),
                               rtol=0, atol=1e-10)
    assert detector(_pixels(6, 3)).is_ood is not None
