#!/usr/bin/env python
"""The model cards of the reference detectors the project ships, in the top-level ``model_cards/``: GSC with its
default settings on each reference classifier in ``hf_gsc/reference_models/`` (``gsc-fmnist-ood-resnet.md``, ...),
rendered by the library's own card code (:func:`hf_gsc.storage.model_card.render_model_card`) as
``save_pretrained(..., save_base_model=True)`` would write them.

    python scripts/model_cards.py            # write model_cards/
    python scripts/model_cards.py --check    # exit 1 naming the cards that differ (tests/test_layout.py runs it)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "model_cards"
METHOD = "gsc"
BENCHMARKS = ("fmnist-ood", "fmnist-openset")


def reference_cards() -> dict[str, str]:
    """``{file name: card text}`` for every shipped reference classifier."""
    from hf_gsc import AutoOODDetector
    from hf_gsc.reference_models import ARCHS, reference_model_path
    from hf_gsc.storage.model_card import render_model_card

    cards = {}
    for benchmark in BENCHMARKS:
        for arch in ARCHS:
            try:
                path = reference_model_path(arch, benchmark)
            except FileNotFoundError:
                continue
            detector = AutoOODDetector.from_pretrained(str(path), method=METHOD)
            # The base travels with the detector (save_base_model=True): no machine's path in the card.
            values = {**detector.config.to_dict(), "base_model_name_or_path": None}
            name = f"{METHOD}-{benchmark}-{arch}"
            card = render_model_card(values, repo_id=None, base_in_repo=True, model_name=name)
            cards[f"{name}.md"] = str(card).rstrip("\n") + "\n"
    return cards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"the folder (default {OUTPUT})")
    args = parser.parse_args(argv)
    cards = reference_cards()
    if args.check:
        present = {path.name for path in args.output.glob("*.md")}
        stale = sorted(name for name, text in cards.items()
                       if not (args.output / name).is_file() or (args.output / name).read_text() != text)
        stale += sorted(present - set(cards))
        if stale:
            print(f"stale in {args.output}: {', '.join(stale)}; regenerate with python scripts/model_cards.py",
                  file=sys.stderr)
            return 1
        return 0
    args.output.mkdir(parents=True, exist_ok=True)
    for name, text in cards.items():
        (args.output / name).write_text(text)
    print(f"wrote {len(cards)} cards to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
