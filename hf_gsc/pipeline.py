"""Serving: the ``"ood-image-classification"`` transformers pipeline, registered when ``hf_gsc`` is imported.

    import hf_gsc, transformers
    ood = transformers.pipeline("ood-image-classification", model="user/gsc-detector")
    ood(["cat.png", pil_image, numpy_array], batch_size=8)
    # -> per image {"predictions": [{"label", "score"}, ...], "ood_score": float, "is_ood": bool | None}

``model`` is any saved detector (folder or Hub id, any method, base saved or referenced) or a loaded
:class:`~hf_gsc.OODDetector`. Images are prepared by the base model's image processor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import Pipeline
from transformers.pipelines import PIPELINE_REGISTRY
from transformers.image_utils import load_image

from .inputs import array_to_image, model_mode

from .auto import AutoOODDetector
from .detector import OODDetector
from .image_limits import open_image

TASK = "ood-image-classification"


class OODImageClassificationPipeline(Pipeline):
    """Top labels of the base classifier plus the detector's ``ood_score`` (higher = more in-distribution),
    ``is_ood`` (``None``, with a warning, while the detector has no calibrated threshold) and ``method``.

    Call arguments: ``top_k`` (labels per image, default 5), ``timeout`` (seconds to fetch an image URL).
    An image larger than ``HF_GSC_MAX_IMAGE_PIXELS`` pixels is refused before it is decoded
    (:class:`~hf_gsc.image_limits.ImageTooLargeError`, see :mod:`hf_gsc.image_limits`).
    """

    # The detector carries its base model's image processor; a detector folder need not hold one.
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = False
    _load_processor = False

    def __init__(self, model: OODDetector, image_processor: Any = None, **kwargs: Any) -> None:
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
        super().__init__(model=model, image_processor=image_processor, **kwargs)

    def _sanitize_parameters(self, top_k: int | None = None, timeout: float | None = None, **unknown: Any):
        if unknown:
            raise TypeError(f"{TASK}: unknown arguments {sorted(unknown)}; it takes top_k, timeout and batch_size")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"{TASK}: top_k must be a positive int, got {top_k!r}")
        preprocess = {} if timeout is None else {"timeout": timeout}
        postprocess = {} if top_k is None else {"top_k": top_k}
        return preprocess, {}, postprocess

    def preprocess(self, image: Any, timeout: float | None = None) -> dict[str, torch.Tensor]:
        if isinstance(image, np.ndarray):  # H x W, H x W x 3 or H x W x 4, uint8 or float in [0, 1]
            image = model_mode(array_to_image(image), getattr(self.model.model.config, "num_channels", None))
        elif not isinstance(image, torch.Tensor):
            # Opened lazily and its size checked from the header before load_image decodes it.
            image = load_image(open_image(image, timeout), timeout=timeout)
        return self.image_processor(images=image, return_tensors="pt").to(self.model.dtype)

    def _forward(self, model_inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
        output = self.model(pixel_values=model_inputs["pixel_values"])
        return {"logits": output.logits, "ood_score": output.ood_score, "is_ood": output.is_ood}

    def postprocess(self, model_outputs: dict[str, torch.Tensor | None], top_k: int = 5) -> dict[str, Any]:
        id2label = self.model.model.config.id2label
        probabilities = model_outputs["logits"][0].float().softmax(dim=-1)
        scores, classes = probabilities.topk(min(top_k, probabilities.numel()))
        is_ood = model_outputs["is_ood"]
        return {
            "predictions": [
                {"label": id2label.get(int(c), str(int(c))), "score": float(s)} for s, c in zip(scores, classes)
            ],
            "ood_score": float(model_outputs["ood_score"][0]),
            "is_ood": None if is_ood is None else bool(is_ood[0]),
            "method": self.model.method,
        }


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=OODImageClassificationPipeline, pt_model=AutoOODDetector, type="image")
