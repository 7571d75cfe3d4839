"""ODIN: temperature scaling + input perturbation (Liang et al., ICLR 2018)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..settings.config import MIN_TEMPERATURE, DetectorConfig, number_check, setting
from ..utils.image_processors import normalization_std
from ..utils.precision import full_precision, parameter_dtype, step_dtype
from ..utils.scores import msp_score
from .backbone_pass import BackbonePass
from .common import BaselineDetector
from .interface import register_detector


def odin_perturb(
    logits_function: Callable[[torch.Tensor], torch.Tensor],
    pixel_values: torch.Tensor,
    temperature: float,
    epsilon: float,
    image_std: torch.Tensor,
    single_element: bool = False,
) -> torch.Tensor:
    """``x~ = x - eps * sign(-grad_x log softmax_c(f(x) / T)) / std``, ``c = argmax f(x)``.

    As in the authors' code: the sign is taken with ``grad >= 0 -> +1`` (``torch.ge``), and the step is
    divided by the normalisation std per channel, so that ``eps`` is a step in ``[0, 1]`` pixel units
    while ``x`` is in normalised units. ``single_element`` (i-ODIN): only the element of each sample with the
    largest ``|grad|`` (over every channel and pixel; the first where several tie, ``torch.argmax``) is stepped.

    Args:
        logits_function: ``(B, C, H, W) -> (B, K)``, batch-separable (one backward of the summed loss
            gives every per-sample input gradient).
        pixel_values: ``(B, C, H, W)``.
        image_std: ``(C,)`` normalisation std of the image processor.
    Returns:
        ``(B, C, H, W)`` perturbed inputs (no gradient).
    """
    with torch.inference_mode(False), torch.enable_grad():
        # clone(): tensors made under inference mode cannot be saved for backward.
        inputs = pixel_values.clone().requires_grad_(True)
        logits = logits_function(inputs) / temperature
        predicted = logits.argmax(dim=-1)
        loss = -torch.log_softmax(logits, dim=-1).gather(1, predicted[:, None]).sum()
        (gradient,) = torch.autograd.grad(loss, inputs)
    sign = torch.where(gradient >= 0, 1.0, -1.0).to(pixel_values)
    std = image_std.to(device=pixel_values.device, dtype=pixel_values.dtype).view(1, -1, 1, 1)
    step = epsilon * sign / std
    if single_element:
        largest = gradient.abs().flatten(1).argmax(dim=1, keepdim=True)
        step = step * torch.zeros_like(step.flatten(1)).scatter_(1, largest, 1.0).view_as(step)
    return (pixel_values.detach() - step).detach()


def _image_std(name: str, value: Any) -> Any:
    """A positive number, or a non-empty list of them (one per channel), as floats."""
    values = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 for v in values):
        raise ValueError(f"{name} must be a positive number or a list of them, got {value!r}")
    return [float(v) for v in values] if isinstance(value, Sequence) else float(value)


@dataclass
class ODINConfig(DetectorConfig):
    """Settings of ODIN (:class:`ODINDetector`)."""

    method: ClassVar[str] = "odin"
    temperature: float = setting(1000.0, number_check(MIN_TEMPERATURE, math.inf),
                                 "``T`` of the softmax; 1000: the paper's setting.")
    epsilon: float = setting(0.0014, number_check(0.0, math.inf),
                             "Step of the input perturbation, in ``[0, 1]`` pixel units; 0.0014: the paper's "
                             "DenseNet/CIFAR setting.")
    image_std: float | list[float] = setting(
        1.0, _image_std,
        "The image processor's normalisation std (a number or one per channel). The ODIN code divides the "
        "perturbation by it (``63.0/255``, ``62.1/255``, ``66.7/255`` for CIFAR) so that ``epsilon`` is measured in "
        "pixel units; ``pixel_values`` do not carry the std, so the caller passes ``image_processor.image_std`` "
        "(``hf-gsc evaluate`` does, :meth:`ODINDetector.model_defaults`). The default 1.0 applies ``epsilon`` "
        "directly in normalised units.")


@register_detector
class ODINDetector(BaselineDetector):
    """MSP at temperature ``T`` of the input perturbed by :func:`odin_perturb`.

    Liang, Li, Srikant, "Enhancing The Reliability of Out-of-distribution Image Detection in Neural
    Networks", ICLR 2018 (code: github.com/facebookresearch/odin). No fitting.

    Settings: :class:`ODINConfig`.
    """

    config_class = ODINConfig
    in_default_table = True
    search_space = {"temperature": (1.0, 10.0, 100.0, 1000.0), "epsilon": (0.0, 0.0014, 0.0028)}
    search_space_source = ("OpenOOD odin.yml: temperature [1, 10, 100, 1000] x noise [0.0014, 0.0028]; epsilon 0 "
                           "(temperature scaling alone, the low end of the ODIN paper's grid) added")
    one_pass = False  # a forward, a backward and a second forward of its own per batch
    #: Step only the input element with the largest ``|grad|`` (i-ODIN, :mod:`hf_gsc.detectors.iodin`).
    single_element: ClassVar[bool] = False

    @classmethod
    def model_defaults(cls, image_processor: Any) -> dict[str, Any]:
        """``image_std``: the processor's normalisation std per channel (timm's too; ``[1.0]`` when it does not
        normalise), so that ``epsilon`` is a step in [0, 1] pixel units, as in the ODIN code."""
        std = normalization_std(image_processor)
        return {"image_std": [1.0] if std is None else std}

    @property
    def image_std(self) -> torch.Tensor:
        """``(C,)`` float64 (``(1,)`` for one number): the std the perturbation is divided by."""
        std = self.hyperparameters["image_std"]
        return torch.tensor(std if isinstance(std, list) else [std], dtype=torch.float64)

    def _logits_with_gradient(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values.to(parameter_dtype(self.model))).logits.to(pixel_values.dtype)

    def logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The logits of ``pixel_values`` fed to the model in its parameters' dtype."""
        return super().logits(pixel_values.to(parameter_dtype(self.model)))

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """Both forwards and the input step in float32 with autocast off (:mod:`hf_gsc.utils.precision`): under bf16
        autocast the step ``epsilon / std`` (about 0.004) is below bf16's resolution near 1, so the perturbed
        input would round back to the original one, and the logits divided by ``T = 1000`` differ in digits
        bf16 does not hold. A bf16 *model* gets float32 inputs cast back to bf16 and keeps that limit."""
        temperature = self.hyperparameters["temperature"]
        pixel_values = batch.pixel_values
        with full_precision(pixel_values.device):
            pixel_values = pixel_values.to(step_dtype(pixel_values.dtype))
            perturbed = odin_perturb(
                self._logits_with_gradient, pixel_values, temperature, self.hyperparameters["epsilon"], self.image_std,
                self.single_element,
            )
            return msp_score(self.logits(perturbed).to(pixel_values.dtype), temperature)
