"""The figures of docs/demo_app.md: GSC's explanation maps on the ResNet and Swin reference models, and a screenshot
of the demo app (headless Chromium) on the ResNet one.

    python scripts/demo_app_figures.py            # writes docs/images/explanation_maps.png, docs/images/demo_app.png

Each reference model (hf_gsc/reference_models/) gets a GSC detector with the default settings, calibrated (tpr 0.95)
on the first --calibration images of Fashion-MNIST's validation split (never test); the maps are of the first ID test
image and the first image of each OOD split of the fmnist-ood benchmark. Needs the 'benchmarks' and 'demo' extras,
selenium, and Debian's chromium and chromium-driver for the screenshot (--no-screenshot skips it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def calibrated_detector(name: str, calibration: int):
    """GSC on reference model ``name``, calibrated on the first ``calibration`` Fashion-MNIST validation images."""
    from hf_gsc import GSCForImageClassification
    from hf_gsc.data.benchmarks import load_benchmark

    detector = GSCForImageClassification.from_pretrained(ROOT / "hf_gsc" / "reference_models" / name)
    validation = load_benchmark("fmnist-ood", ood_splits=[]).id_splits["validation"]
    detector.calibrate(validation.select(range(calibration)), tpr=0.95)
    return detector


def examples() -> list[tuple[str, object]]:
    """(caption, PIL image): the first ID test image and the first image of each OOD split."""
    from hf_gsc.data.benchmarks import load_benchmark

    benchmark = load_benchmark("fmnist-ood")
    chosen = [("ID: Fashion-MNIST test", benchmark.id_splits["test"][0]["image"])]
    chosen += [(f"OOD: {name}", split[0]["image"]) for name, split in benchmark.ood_splits.items()]
    return chosen


def explanation_maps(detectors: dict[str, object], chosen: list[tuple[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import transformers

    import hf_gsc  # noqa: F401  (registers the pipeline)
    from hf_gsc.app.demo import overlay

    figure, axes = plt.subplots(len(detectors), len(chosen), figsize=(2.3 * len(chosen), 2.7 * len(detectors)),
                                layout="constrained", squeeze=False)
    for row, (name, detector) in enumerate(detectors.items()):
        explain = transformers.pipeline("ood-image-classification", model=detector)
        for column, (caption, image) in enumerate(chosen):
            result = explain(image, explain=True)
            ax = axes[row, column]
            ax.imshow(overlay(image, result["explanation"]["image_map"]))
            ax.set_xticks([])
            ax.set_yticks([])
            verdict = "flagged" if result["is_ood"] else "in-dist."
            ax.set_title(f"{caption}\np = {result['p_value']:.3f} ({verdict})", fontsize=8)
            if column == 0:
                ax.set_ylabel(f"GSC on {name}", fontsize=9)
    figure.suptitle("What the short-circuit did to the predicted logit, per position (red: lowered it, blue: raised "
                    "it)", fontsize=10)
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def screenshot(detector, image, path: Path) -> None:
    from hf_gsc.app.browser import (
        chromium_missing,
        start_chromium,
        upload_and_read_verdict,
    )
    from hf_gsc.app.demo import build_app, launch

    if chromium_missing():
        raise SystemExit(f"no screenshot: {chromium_missing()}")
    with tempfile.TemporaryDirectory() as scratch:
        detector.save_pretrained(Path(scratch) / "gsc-resnet", save_base_model=True)
        app = build_app(str(Path(scratch) / "gsc-resnet"), title="GSC on the ResNet reference model (Fashion-MNIST)")
        launch(app, prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
        browser = start_chromium(Path(scratch) / "profile", window=(1280, 1250))
        try:
            image.save(Path(scratch) / "input.png")
            verdict = upload_and_read_verdict(browser, app.local_url, Path(scratch) / "input.png")
            browser.save_screenshot(str(path))
        finally:
            browser.quit()
            app.close()
    print(f"wrote {path} (verdict: {verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", type=int, default=2000, help="Fashion-MNIST validation images calibrated on")
    parser.add_argument("--output-dir", default=str(ROOT / "docs" / "images"))
    parser.add_argument("--no-screenshot", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    detectors = {name: calibrated_detector(name, args.calibration) for name in ("resnet", "swin")}
    chosen = examples()
    explanation_maps(detectors, chosen, output / "explanation_maps.png")
    if not args.no_screenshot:
        screenshot(detectors["resnet"], chosen[1][1], output / "demo_app.png")


if __name__ == "__main__":
    main()
