"""``hf-gsc demo --detector PATH_OR_REPO``: a Gradio app that shows what a detector makes of an image.

Drop or paste an image: the app shows the base model's top labels, the verdict (flagged as OOD or not, or no decision
while the detector has no threshold), the score on a bar against the threshold and the ID calibration scores, the
p-value (:mod:`hf_gsc.utils.conformal`) and, for GSC, the map over the image of what the short-circuit took from the
predicted logit (:meth:`hf_gsc.GSCForImageClassification.explain`). The same function serves the browser and the
API (``gradio_client``: ``Client(url).predict(handle_file(path), api_name="/predict")``).

Needs the ``demo`` extra (``pip install 'hf_gsc[demo]'``: gradio and matplotlib).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

PROG = "hf-gsc demo"
#: The element ids the browser test reads (and a person never sees).
VERDICT_ID, SUMMARY_ID = "verdict", "summary"


def load_detector(detector: Any) -> Any:
    """A loaded :class:`~hf_gsc.OODDetector` from a folder or Hub id (or the detector itself), with its image
    processor (the app prepares images with it)."""
    from ..auto import AutoOODDetector
    from ..detectors.interface import OODDetector

    loaded = detector if isinstance(detector, OODDetector) else AutoOODDetector.from_pretrained(str(detector))
    if loaded.image_processor is None:
        raise ValueError(f"{PROG}: the detector's base model has no image processor, so the app cannot prepare images; "
                         "save the detector with its base model's image processor")
    return loaded


def verdict_text(result: dict[str, Any], p_value_cut: float | None) -> str:
    """One line: the decision, with the p-value and the cut where there are calibration scores."""
    p_value = result.get("p_value")
    p_text = "" if p_value is None else f" (p-value {p_value:.3g}"
    if p_text and p_value_cut is not None:
        p_text += f"; flagged at p <= {p_value_cut:.3g}"
    p_text += ")" if p_text else ""
    if result["is_ood"] is None:
        return "No decision: the detector has no threshold (calibrate it)" + p_text
    return ("Flagged as out-of-distribution" if result["is_ood"] else "In-distribution") + p_text


def score_figure(score: float, threshold: float | None, calibration_scores: Any, method: str) -> Any:
    """The input's score on the score axis, against the threshold and a histogram of the ID calibration scores."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 2.4), layout="constrained")
    axes = figure.add_subplot()
    if calibration_scores is not None:
        axes.hist(calibration_scores.numpy(), bins=min(40, max(5, len(calibration_scores) // 10)), color="0.75",
                  label=f"ID calibration scores (n = {len(calibration_scores)})")
    if threshold is not None:
        axes.axvline(threshold, color="black", linestyle="--", label=f"threshold {threshold:.4g}")
    flagged = threshold is not None and not score >= threshold
    axes.axvline(score, color="tab:red" if flagged else "tab:green", linewidth=3, label=f"this image {score:.4g}")
    axes.set_xlabel(f"ood_score ({method}; higher = more in-distribution)")
    axes.set_yticks([])
    figure.legend(loc="outside lower center", ncols=3, fontsize="small", frameon=False)
    return figure


def overlay(image: Any, contribution_map: Any, min_side: int = 256) -> Any:
    """``image`` (PIL) with the explanation's map (``(H, W)`` at the image's size) drawn over it: red where the
    short-circuit lowered the predicted logit, blue where it raised it, in proportion to the largest magnitude;
    enlarged (nearest neighbour) to at least ``min_side`` pixels on its longer side, so that a 28x28 image shows."""
    import numpy as np
    from matplotlib import colormaps
    from PIL import Image

    values = np.asarray(contribution_map, dtype=np.float64)
    scale = float(np.abs(values).max()) or 1.0
    colours = colormaps["RdBu"](0.5 + 0.5 * values / scale)[..., :3]  # -scale: red, 0: white, +scale: blue
    base = np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0
    blended = Image.fromarray(np.uint8(255 * (0.45 * base + 0.55 * colours)))
    factor = max(1, -(-min_side // max(blended.size)))
    return blended.resize((blended.width * factor, blended.height * factor), Image.Resampling.NEAREST)


def coordinate_rows(explanation: dict[str, Any]) -> list[list[Any]]:
    """The short-circuited coordinates as table rows: index in ``F``, contribution to the predicted logit."""
    return [[", ".join(str(i) for i in row["index"]), row["contribution"]] for row in explanation["coordinates"]]


class DemoModel:
    """What the app runs: the detector behind the ``ood-image-classification`` pipeline, and one call per image."""

    def __init__(self, detector: Any, top_k: int = 5) -> None:
        import transformers

        from .. import pipeline as _registers_the_task  # noqa: F401

        self.detector = load_detector(detector)
        self.top_k = top_k
        self.explains = hasattr(self.detector, "explain")
        self.pipeline = transformers.pipeline("ood-image-classification", model=self.detector)

    def __call__(self, image: Any) -> tuple[Any, ...]:
        """Top labels, verdict, score figure, summary (JSON), overlay (or ``None``) and coordinate rows of ``image``."""
        if image is None:
            raise ValueError("drop or paste an image first")
        result = self.pipeline(image, top_k=self.top_k, explain=self.explains)
        detector = self.detector
        labels = {row["label"]: row["score"] for row in result["predictions"]}
        figure = score_figure(result["ood_score"], detector.config.threshold, detector.calibration_scores,
                              detector.method)
        summary = {
            "method": detector.method,
            "ood_score": result["ood_score"],
            "threshold": detector.config.threshold,
            "is_ood": result["is_ood"],
            "p_value": result["p_value"],
            "p_value_cut": detector.p_value_cut,
            "p_value_unavailable": detector.p_value_unavailable if result["p_value"] is None else None,
            "top_label": result["predictions"][0]["label"],
        }
        explanation = result.get("explanation")
        shown, rows = None, []
        if explanation is not None:
            summary.update(score_before_short_circuit=explanation["score_before"],
                           score_after_short_circuit=explanation["score_after"], head_reads=explanation["head_reads"])
            if explanation["map"] is not None:
                shown = overlay(image, explanation["map"])
            rows = coordinate_rows(explanation)
        return labels, verdict_text(result, detector.p_value_cut), figure, summary, shown, rows


def _theme_where(function: Any) -> dict[str, Any]:
    """``{"theme": ...}`` when ``function`` takes the theme (``gr.Blocks`` up to Gradio 5, ``launch`` from Gradio 6),
    else ``{}``. System fonts: the page loads nothing from outside the app (a Space or a machine offline alike)."""
    import inspect

    import gradio as gr

    if "theme" not in inspect.signature(function).parameters:
        return {}
    return {"theme": gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                                       font_mono=["ui-monospace", "monospace"])}


def launch(app: Any, **kwargs: Any) -> Any:
    """``app.launch(**kwargs)`` with the app's theme (passed to ``launch`` from Gradio 6 on)."""
    return app.launch(**_theme_where(app.launch), **kwargs)


def build_app(detector: Any, title: str | None = None) -> Any:
    """The Gradio app (``gr.Blocks``) for ``detector`` (a folder, a Hub id or a loaded detector)."""
    import gradio as gr

    model = DemoModel(detector)
    source = detector if isinstance(detector, (str, os.PathLike)) else "a detector"
    title = title or f"{model.detector.method} OOD detector ({source})"
    with gr.Blocks(title=title, analytics_enabled=False, **_theme_where(gr.Blocks.__init__)) as app:
        gr.Markdown(f"# {title}\nDrop or paste an image. Higher `ood_score` = more in-distribution; the p-value is the "
                    "chance that an in-distribution image scores this low.")
        with gr.Row():
            with gr.Column():
                image = gr.Image(type="pil", sources=["upload", "clipboard"], label="image", height=300)
                labels = gr.Label(label="base model's top labels")
            with gr.Column():
                verdict = gr.Textbox(label="verdict", elem_id=VERDICT_ID, interactive=False)
                figure = gr.Plot(label="score against the threshold and the ID calibration scores")
                summary = gr.JSON(label="details", elem_id=SUMMARY_ID)
        with gr.Row(visible=model.explains):
            shown = gr.Image(label="what the short-circuit did to the predicted logit, per position (red: lowered "
                                   "it, blue: raised it)", interactive=False, height=300)
            rows = gr.Dataframe(headers=["coordinate of F", "contribution to the predicted logit"],
                                label="short-circuited coordinates, largest first", interactive=False)
        image.upload(model, inputs=image, outputs=[labels, verdict, figure, summary, shown, rows], api_name="predict")
    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--detector", required=True, help="a saved detector folder or Hub repo id (any method)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=7860, help="port to listen on")
    args = parser.parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    try:
        app = build_app(args.detector)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in ("gradio", "matplotlib"):
            raise
        print(f"{PROG} needs the 'demo' extra: pip install 'hf_gsc[demo]' ({error})", file=sys.stderr)
        return 1
    except (OSError, ValueError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    launch(app, server_name=args.host, server_port=args.port)
    return 0


__all__ = ["DemoModel", "build_app", "launch", "load_detector", "main", "overlay", "score_figure", "verdict_text"]
