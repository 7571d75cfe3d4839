"""``hf-gsc demo --detector PATH_OR_REPO``: a Gradio app that shows what a detector makes of an image.

Drop or paste an image: the app shows the base model's top labels, the verdict (flagged as OOD or not, or no decision
while the detector has no threshold), the score on a bar against the threshold and the ID calibration scores, the
p-value (:mod:`hf_gsc.utils.conformal`) and, for GSC, the map over the image of what the short-circuit took from the
predicted logit (:meth:`hf_gsc.GSCForImageClassification.explain`). The same function serves the browser and the
API (``gradio_client``: ``Client(url).predict(handle_file(path), api_name="/predict")``).

The upload reaches the library as a file and is decoded by :func:`hf_gsc.utils.images.load_image`, as the pipeline
decodes it (:class:`DemoModel`); uploads are limited to :data:`MAX_UPLOAD_SIZE` and Gradio's cache is cleaned
(:data:`DELETE_CACHE`); the page shows no local path.

Needs the ``demo`` extra (``pip install 'hf_gsc[demo]'``: gradio and matplotlib).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
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


#: The most ID calibration scores the app's histogram is drawn from (evenly spaced order statistics of the sorted
#: scores: the histogram of a quantile sample), computed once when the app starts.
HISTOGRAM_SAMPLE = 100_000
#: The largest upload the app accepts (Gradio's ``max_file_size``); a larger one is refused before it is stored.
MAX_UPLOAD_SIZE = "20mb"
#: Gradio's ``delete_cache`` (every hour, uploads and outputs older than an hour are deleted; all of them when the
#: server stops).
DELETE_CACHE = (3600, 3600)
#: The longer side of the overlay when the image processor does not say the model's input size.
DEFAULT_INPUT_SIDE = 224


@dataclass(frozen=True)
class CalibrationHistogram:
    """The histogram of the ID calibration scores the app draws: ``counts`` per bin between ``edges``, scaled to
    ``n`` scores (the whole set, of which at most :data:`HISTOGRAM_SAMPLE` were binned)."""

    counts: Any
    edges: Any
    n: int


def calibration_histogram(calibration_scores: Any, sample: int | None = None) -> CalibrationHistogram | None:
    """The histogram of ``calibration_scores`` (ascending, as a detector keeps them) from at most ``sample`` of them
    (default :data:`HISTOGRAM_SAMPLE`), evenly spaced in rank; ``None`` without scores."""
    import numpy as np

    if calibration_scores is None or len(calibration_scores) == 0:
        return None
    n, sample = len(calibration_scores), sample or HISTOGRAM_SAMPLE
    ranks = np.unique(np.linspace(0, n - 1, min(n, sample)).round().astype(np.int64))
    values = np.asarray(calibration_scores[ranks], dtype=np.float64)
    counts, edges = np.histogram(values, bins=min(40, max(5, n // 10)))
    return CalibrationHistogram(counts * (n / len(values)), edges, n)


def score_figure(score: float, threshold: float | None, histogram: CalibrationHistogram | None, method: str) -> Any:
    """The input's score on the score axis, against the threshold and the histogram of the ID calibration scores
    (:func:`calibration_histogram`, computed once)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 2.4), layout="constrained")
    axes = figure.add_subplot()
    if histogram is not None:
        axes.stairs(histogram.counts, histogram.edges, fill=True, color="0.75",
                    label=f"ID calibration scores (n = {histogram.n})")
    if threshold is not None:
        axes.axvline(threshold, color="black", linestyle="--", label=f"threshold {threshold:.4g}")
    flagged = threshold is not None and not score >= threshold
    axes.axvline(score, color="tab:red" if flagged else "tab:green", linewidth=3, label=f"this image {score:.4g}")
    axes.set_xlabel(f"ood_score ({method}; higher = more in-distribution)")
    axes.set_yticks([])
    figure.legend(loc="outside lower center", ncols=3, fontsize="small", frameon=False)
    return figure


def input_side(image_processor: Any) -> int:
    """The longer side of the model's input as ``image_processor`` prepares it (its crop, else its resize size; a
    dict or transformers' ``SizeDict``); :data:`DEFAULT_INPUT_SIDE` when it does not say."""
    size = getattr(image_processor, "crop_size", None) if getattr(image_processor, "do_center_crop", False) else None
    size = size or getattr(image_processor, "size", None)
    if isinstance(size, int):
        return size
    keys = ("height", "width", "shortest_edge", "longest_edge")
    read = [size.get(key) if isinstance(size, dict) else getattr(size, key, None) for key in keys]
    sides = [side for side in read if isinstance(side, int) and side > 0]
    return max(sides) if sides else DEFAULT_INPUT_SIDE


def overlay_size(image_size: tuple[int, int], side: int) -> tuple[int, int]:
    """``(height, width)`` of an image of ``image_size`` (PIL's ``(width, height)``) shrunk, its aspect kept, to fit
    ``side`` pixels on its longer side (a smaller image keeps its size)."""
    width, height = image_size
    scale = min(1.0, side / max(width, height))
    return max(1, round(height * scale)), max(1, round(width * scale))


def overlay(image: Any, contribution_map: Any, min_side: int = 256) -> Any:
    """``image`` (PIL) with the explanation's map (``(h, w)``) drawn over it: red where the short-circuit lowered the
    predicted logit, blue where it raised it, in proportion to the largest magnitude. The blend is computed at the
    map's size (the image is resized to it as 8-bit first: a large image costs no full-size float array), then
    enlarged (nearest neighbour, 8-bit) to at least ``min_side`` pixels on its longer side, so that a 28x28 image
    shows."""
    import numpy as np
    from matplotlib import colormaps
    from PIL import Image

    values = np.asarray(contribution_map, dtype=np.float32)
    height, width = values.shape
    scale = float(np.abs(values).max()) or 1.0
    colours = colormaps["RdBu"](0.5 + 0.5 * values / scale, bytes=True)[..., :3]  # -scale: red, 0: white, +: blue
    base = image.convert("RGB")
    if base.size != (width, height):
        base = base.resize((width, height), Image.Resampling.BILINEAR, reducing_gap=3.0)
    blended = Image.blend(base, Image.fromarray(np.ascontiguousarray(colours)), 0.55)
    factor = max(1, -(-min_side // max(blended.size)))
    return blended.resize((blended.width * factor, blended.height * factor), Image.Resampling.NEAREST)


def coordinate_rows(explanation: dict[str, Any]) -> list[list[Any]]:
    """The short-circuited coordinates as table rows: index in ``F``, contribution to the predicted logit."""
    from ..gsc_math.explanation import unravel

    return [[", ".join(str(i) for i in unravel(index, explanation["feature_shape"])), contribution]
            for index, contribution in zip(explanation["coordinates"], explanation["contributions"])]


def shown_name(source: Any) -> str:
    """How the page names a detector: a Hub id as it is, a folder by its name only (the browser is shown no local
    path), a loaded detector as "a detector"."""
    if not isinstance(source, (str, os.PathLike)):
        return "a detector"
    from ..storage.repo_ids import is_hub_id

    text = os.fspath(source)
    return text if is_hub_id(text) and not os.path.exists(text) else Path(text).resolve().name


class DemoModel:
    """What the app runs: the detector behind the ``ood-image-classification`` pipeline, and one call per image.

    An upload is a file path (Gradio's ``type="filepath"``: Gradio decodes nothing) decoded once by
    :func:`hf_gsc.utils.images.load_image`, the rule of the pipeline, ``fit``, ``calibrate`` and ``hf-gsc evaluate``:
    the pixel limit from the header before decoding, EXIF orientation, bit depth, alpha composited on white, the
    model's channels. The decoded image is what the pipeline scores."""

    def __init__(self, detector: Any, top_k: int = 5) -> None:
        import transformers

        from .. import pipeline as _registers_the_task  # noqa: F401
        from ..utils.images import model_mode

        self.detector = load_detector(detector)
        self.top_k = top_k
        self.explains = hasattr(self.detector, "explain")
        # transformers' overloads of pipeline() name only its built-in tasks, not a registered one
        self.pipeline = transformers.pipeline("ood-image-classification", model=self.detector)  # type: ignore[call-overload]
        self.mode = model_mode(self.detector.num_channels)
        self.side = input_side(self.detector.image_processor)
        # Drawn on every request from this, computed once: never from every kept score.
        self.histogram = calibration_histogram(self.detector.calibration_scores)
        self.p_value_cut = self.detector.p_value_cut

    def decode(self, upload: Any) -> Any:
        """The upload (a path, or anything :func:`~hf_gsc.utils.images.load_image` takes) as the 8-bit image the model
        is given; errors name the file by its name only (the server's folders are nobody's business)."""
        from ..utils.images import load_image

        if not isinstance(upload, (str, os.PathLike)):
            return load_image(upload, self.mode)
        path = os.fspath(upload)
        name = repr(Path(path).name)
        try:
            return load_image(path, self.mode, name=name)
        except ValueError as error:  # a reason from PIL may quote the whole path
            raise type(error)(str(error).replace(repr(path), name).replace(path, name)) from None

    def __call__(self, upload: Any) -> tuple[Any, ...]:
        """Top labels, verdict, score figure, summary (JSON), overlay (or ``None``) and coordinate rows of ``upload``."""
        if upload is None:
            raise ValueError("drop or paste an image first")
        image = self.decode(upload)
        detector = self.detector
        map_size = overlay_size(image.size, self.side)
        options = {"explain": True, "map_size": map_size} if self.explains else {}
        result = self.pipeline(image, top_k=self.top_k, **options)
        labels = {row["label"]: row["score"] for row in result["predictions"]}
        figure = score_figure(result["ood_score"], detector.config.threshold, self.histogram, detector.method)
        summary = {
            "method": detector.method,
            "ood_score": result["ood_score"],
            "threshold": detector.config.threshold,
            "is_ood": result["is_ood"],
            "p_value": result["p_value"],
            "p_value_cut": self.p_value_cut,
            "p_value_unavailable": detector.p_value_unavailable if result["p_value"] is None else None,
            "top_label": result["predictions"][0]["label"],
            "image": f"{image.width} x {image.height} {image.mode}",
        }
        explanation = result.get("explanation")
        shown, rows = None, []
        if explanation is not None:
            summary.update(score_before_short_circuit=explanation["score_before"],
                           score_after_short_circuit=explanation["score_after"],
                           head_reads=explanation["description"])
            if explanation["image_map"] is not None:
                shown = overlay(image, explanation["image_map"])
            rows = coordinate_rows(explanation)
        return labels, verdict_text(result, self.p_value_cut), figure, summary, shown, rows


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
    """``app.launch(**kwargs)`` with the app's theme (passed to ``launch`` from Gradio 6 on) and the upload limit
    :data:`MAX_UPLOAD_SIZE` (``max_file_size=`` in ``kwargs`` overrides it)."""
    kwargs.setdefault("max_file_size", MAX_UPLOAD_SIZE)
    return app.launch(**_theme_where(app.launch), **kwargs)


def build_app(detector: Any, title: str | None = None) -> Any:
    """The Gradio app (``gr.Blocks``) for ``detector`` (a folder, a Hub id or a loaded detector)."""
    import gradio as gr

    model = DemoModel(detector)
    title = title or f"{model.detector.method} OOD detector ({shown_name(detector)})"

    def predict(upload: Any) -> tuple[Any, ...]:
        try:
            return model(upload)
        except ValueError as error:  # an unreadable or too large image, or none: one line, shown on the page
            raise gr.Error(str(error)) from None

    with gr.Blocks(title=title, analytics_enabled=False, delete_cache=DELETE_CACHE,
                   **_theme_where(gr.Blocks.__init__)) as app:
        gr.Markdown(f"# {title}\nDrop or paste an image. Higher `ood_score` = more in-distribution; the p-value is the "
                    "chance that an in-distribution image scores this low.")
        with gr.Row():
            with gr.Column():
                # A path: Gradio reads the header only (image_mode=None), the library decodes (DemoModel.decode).
                image = gr.Image(type="filepath", image_mode=None, format="png", sources=["upload", "clipboard"],
                                 label="image", height=300)
                labels = gr.Label(label="base model's top labels")
            with gr.Column():
                verdict = gr.Textbox(label="verdict", elem_id=VERDICT_ID, interactive=False)
                figure = gr.Plot(label="score against the threshold and the ID calibration scores")
                summary = gr.JSON(label="details", elem_id=SUMMARY_ID)
        with gr.Row(visible=model.explains):
            shown = gr.Image(label="what the short-circuit did to the predicted logit, per position (red: lowered "
                                   "it, blue: raised it)", interactive=False, height=300, format="png")
            rows = gr.Dataframe(headers=["coordinate of F", "contribution to the predicted logit"],
                                label="short-circuited coordinates, largest first", interactive=False)
        image.upload(predict, inputs=image, outputs=[labels, verdict, figure, summary, shown, rows], api_name="predict")
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


__all__ = ["DELETE_CACHE", "HISTOGRAM_SAMPLE", "MAX_UPLOAD_SIZE", "CalibrationHistogram", "DemoModel", "build_app",
           "calibration_histogram", "input_side", "launch", "load_detector", "main", "overlay", "overlay_size",
           "score_figure", "shown_name", "verdict_text"]
