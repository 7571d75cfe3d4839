"""The section of docs/baselines.md that places this library's methods beside OpenOOD v1.5's ImageNet-1K leaderboard:
every method it names is registered, every leaderboard row is placed, and the page holds the section as the script
writes it from the cited rows."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from hf_gsc.detectors import DETECTORS


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import baseline_tables  # noqa: E402


def rows() -> list[dict[str, str]]:
    with baseline_tables.LEADERBOARD.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_every_named_method_is_registered_and_every_row_is_placed():
    named = {method for method, _ in baseline_tables.LEADERBOARD_METHODS.values() if method is not None}
    assert named <= set(DETECTORS), named - set(DETECTORS)
    for row in rows():
        cell = baseline_tables.leaderboard_method(row["Training"], row["Postprocessor"])
        assert cell.startswith(("`", "not here: ")), (row, cell)
        assert cell != "not here: not implemented", f"{row['Postprocessor']} has no entry in LEADERBOARD_METHODS"
        assert row["Source"].split("@")[0] in {"Jingkang50/OpenOOD", "zjysteven/OpenOOD"}
        assert len(row["Source"].split("@")[1]) == 40


def test_the_page_holds_the_section_as_written():
    page = (REPO / "docs" / "baselines.md").read_text()
    assert "\n".join(baseline_tables.leaderboard_section()) in page
    assert len(rows()) == 97  # 87 at Jingkang50/OpenOOD@03db2d8, 10 more at zjysteven/OpenOOD@23c9113
