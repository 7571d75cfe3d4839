"""Serving: the ``"ood-image-classification"`` transformers pipeline, registered when ``hf_gsc`` is imported.

    import hf_gsc, transformers
    ood = transformers.pipeline("ood-image-classification", model="user/gsc-detector")
    ood(["cat.png", pil_image, numpy_array], batch_size=8)
    # -> per image {"predictions": [{"label", "score"}, ...], "ood_score": float, "is_ood": bool | None,
    #               "p_value": float | None, "method": str}

``model`` is any saved detector (folder or Hub id, any method, base saved or referenced) or a loaded
:class:`~hf_gsc.OODDetector`. Images are prepared by the base model's image processor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import BatchFeature, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .auto import AutoOODDetector
from .detectors.interface import OODDetector
from .utils.image_processors import input_channels
from .utils.images import load_image, model_mode


if TYPE_CHECKING:
    from .gsc_math.explanation import GSCExplanation


TASK = "ood-image-classification"


#: The fields of :class:`~hf_gsc.gsc_math.explanation.GSCExplanation` that hold one row per image.
EXPLANATION_TENSORS = ("predicted_class", "score_before", "score_after", "logit_change", "coordinates",
                       "contributions", "total_contribution", "position_map")


class OODImageClassificationPipeline(Pipeline):
    """Top labels of the base classifier plus the detector's ``ood_score`` (higher = more in-distribution),
    ``is_ood`` (``None``, with a warning, while the detector has no calibrated threshold), ``p_value`` (the chance
    that an ID image scores this low, :mod:`hf_gsc.utils.conformal`; ``None`` while the detector keeps no calibration
    scores) and ``method``.

    Call arguments: ``top_k`` (labels per image, default 5), ``timeout`` (seconds to fetch an image URL),
    ``explain`` (GSC only: add ``"explanation"``, why the input scored as it did: the dict
    :meth:`hf_gsc.gsc_math.explanation.GSCExplanation.to_dict` of :meth:`hf_gsc.GSCForImageClassification.explain`,
    the same names and forms as its attributes, with ``image_map`` the map over positions resized to the image as
    given),
    ``map_size`` (with ``explain=True``: the ``(height, width)`` the map is resized to instead; a display of a large
    image needs no map at its full size).
    Construction argument ``compile_mode`` (``pipeline(..., compile_mode="reduce-overhead")``; default ``None``, the
    eager forward): the detector's forward compiled whole (:meth:`hf_gsc.OODDetector.compiled`, one of
    ``torch.compile``'s modes; ``"reduce-overhead"`` replays CUDA graphs on a GPU). The first call at each batch size
    compiles, so it pays where the same batch sizes come again and again.
    Each image is decoded by :func:`hf_gsc.utils.images.load_image`, as ``fit``, ``calibrate`` and ``hf-gsc evaluate``
    decode theirs (EXIF orientation, bit depth, alpha, the model's channels; docs/inputs.md). An image larger than
    ``HF_GSC_MAX_IMAGE_PIXELS`` pixels is refused before it is decoded
    (:class:`~hf_gsc.utils.image_limits.ImageTooLargeError`); an unreadable one is an
    :class:`~hf_gsc.utils.images.UnreadableImageError` naming it (path, URL and HTTP status).
    """

    # The detector carries its base model's image processor; a detector folder need not hold one. (The ignores:
    # transformers' Pipeline declares these ``= None``, so a type checker takes ``None`` for their type, though every
    # pipeline sets them to a bool; it declares ``model`` a ``PreTrainedModel``, though a registered task's model may be
    # any ``nn.Module``; and its ``preprocess`` / ``_forward`` / ``postprocess`` take ``**parameters: dict`` and return a
    # ``ModelOutput``, which none of its own pipelines does.)
    _load_image_processor = False  # type: ignore[assignment]
    _load_feature_extractor = False  # type: ignore[assignment]
    _load_tokenizer = False  # type: ignore[assignment]
    _load_processor = False  # type: ignore[assignment]
    model: OODDetector  # type: ignore[assignment]
    image_processor: Any  # checked in __init__: never None here

    def __init__(self, model: OODDetector, image_processor: Any = None, compile_mode: str | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(model, OODDetector):
            raise TypeError(
                f"{TASK}: model must be a saved OOD detector (folder or Hub id) or an hf_gsc.OODDetector, "
                f"got {type(model).__name__}"
            )
        image_processor = image_processor or model.image_processor
        if image_processor is None:
            raise ValueError(
                f"{TASK}: the detector's base model has no image processor; pass image_processor=... to pipeline()"
            )
        super().__init__(model=model, image_processor=image_processor, **kwargs)  # type: ignore[arg-type]
        # The PIL mode images are decoded to: the model's channels, or, where its config does not say (timm models),
        # those its processor normalises, so that a grey image reaches a 3-channel processor as RGB.
        self.image_mode = model_mode(input_channels(model.num_channels, image_processor))
        # Opt-in: the detector's forward compiled whole (hf_gsc.detectors.compiled; docs/efficiency.md says what the
        # first call costs). None: the eager forward.
        self.compiled = None if compile_mode is None else model.compiled(mode=compile_mode)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(inputs, (list, tuple)) and not inputs:
            raise ValueError(f"{TASK}: got an empty {type(inputs).__name__} of images; pass at least one image (a "
                             "path, URL, PIL image or NumPy array)")
        return super().__call__(inputs, *args, **kwargs)

    def _sanitize_parameters(self, top_k: int | None = None, timeout: float | None = None, explain: bool | None = None,
                             map_size: tuple[int, int] | None = None, **unknown: Any):
        if unknown:
            raise TypeError(f"{TASK}: unknown arguments {sorted(unknown)}; it takes top_k, timeout, explain, map_size "
                            "and batch_size")
        if explain is not None and not isinstance(explain, bool):
            raise ValueError(f"{TASK}: explain must be True or False, got {explain!r}")
        if explain and not hasattr(self.model, "explain"):
            raise ValueError(f"{TASK}: explain=True explains GSC's short-circuit; this detector's method is "
                             f"{self.model.method!r}, which has no explanation")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"{TASK}: top_k must be a positive int, got {top_k!r}")
        if map_size is not None:
            if not explain:
                raise ValueError(f"{TASK}: map_size sizes the explanation's map; pass it with explain=True")
            if (not isinstance(map_size, (tuple, list)) or len(map_size) != 2
                    or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in map_size)):
                raise ValueError(f"{TASK}: map_size must be (height, width), two positive ints, got {map_size!r}")
        preprocess = {} if timeout is None else {"timeout": timeout}
        postprocess: dict[str, Any] = {} if top_k is None else {"top_k": top_k}
        if map_size is not None:
            postprocess["map_size"] = tuple(map_size)
        forward = {} if explain is None else {"explain": explain}
        return preprocess, forward, postprocess

    def preprocess(self, image: Any, timeout: float | None = None) -> BatchFeature:  # type: ignore[override]
        if not isinstance(image, torch.Tensor):
            image = load_image(image, self.image_mode, timeout=timeout)
        inputs = self.image_processor(images=image, return_tensors="pt").to(self.model.dtype)
        # (H, W) of the image as given, for the explanation's map
        size = tuple(image.shape[-2:]) if isinstance(image, torch.Tensor) else (image.height, image.width)
        inputs["image_size"] = torch.tensor([size])
        return inputs

    def _forward(  # type: ignore[override]
        self, model_inputs: Mapping[str, torch.Tensor], explain: bool = False
    ) -> dict[str, Any]:
        pixel_values = model_inputs["pixel_values"]
        forward = self.model if self.compiled is None else self.compiled
        output = forward(pixel_values=pixel_values)
        outputs = {"logits": output.logits, "ood_score": output.ood_score, "is_ood": output.is_ood,
                   "p_value": output.p_value, "image_size": model_inputs["image_size"]}
        if explain:
            # a GSC detector's explain (checked in _sanitize_parameters)
            explanation: GSCExplanation = getattr(self.model, "explain")(pixel_values)
            # Each tensor field per image (a batched pipeline hands postprocess row [i] of each tensor and item [i]
            # of each list); postprocess rebuilds the one-image GSCExplanation and returns its to_dict().
            outputs.update({f"explanation_{name}": getattr(explanation, name) for name in EXPLANATION_TENSORS
                            if getattr(explanation, name) is not None},
                           explanation_head_reads=[explanation.head_reads] * len(pixel_values),
                           explanation_feature_shape=torch.tensor([explanation.feature_shape] * len(pixel_values)))
        return outputs

    def postprocess(  # type: ignore[override]
        self, model_outputs: dict[str, Any], top_k: int = 5, map_size: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        id2label = self.model.id2label
        probabilities = model_outputs["logits"][0].float().softmax(dim=-1)
        scores, classes = probabilities.topk(min(top_k, probabilities.numel()))
        is_ood, p_value = model_outputs["is_ood"], model_outputs["p_value"]
        return {
            "predictions": [
                {"label": id2label.get(int(c), str(int(c))), "score": float(s)} for s, c in zip(scores, classes)
            ],
            "ood_score": float(model_outputs["ood_score"][0]),
            "is_ood": None if is_ood is None else bool(is_ood[0]),
            "p_value": None if p_value is None else float(p_value[0]),
            "method": self.model.method,
            **({"explanation": self._explanation(model_outputs, id2label, map_size)}
               if "explanation_score_before" in model_outputs else {}),
        }

    @staticmethod
    def _explanation(model_outputs: dict[str, Any], id2label: dict[int, str],
                     map_size: tuple[int, int] | None = None) -> dict[str, Any]:
        """The explanation of one image: :meth:`hf_gsc.gsc_math.explanation.GSCExplanation.to_dict`, its
        ``image_map`` resized to ``map_size`` (default: the image as given)."""
        from .gsc_math.explanation import GSCExplanation

        head_reads = model_outputs["explanation_head_reads"]
        # one row of each tensor field; None for one the explanation left out (position_map of a head that does not
        # read F position by position)
        tensors: dict[str, Any] = {name: model_outputs.get(f"explanation_{name}") for name in EXPLANATION_TENSORS}
        explanation = GSCExplanation(
            **tensors,
            feature_shape=tuple(int(v) for v in model_outputs["explanation_feature_shape"][0]),
            head_reads=head_reads if isinstance(head_reads, str) else head_reads[0], image_map=None)
        height, width = (int(v) for v in model_outputs["image_size"][0])
        return explanation.to_dict(0, id2label, map_size or (height, width))


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=OODImageClassificationPipeline, pt_model=AutoOODDetector, type="image")
