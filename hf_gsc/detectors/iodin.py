"""i-ODIN: ODIN with the input step on one element (OpenOOD v1.5's ``iodin_postprocessor.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .interface import register_detector
from .odin import ODINConfig, ODINDetector


@dataclass
class IODINConfig(ODINConfig):
    """Settings of i-ODIN (:class:`IODINDetector`): ODIN's, with the defaults of OpenOOD iodin.yml
    ``postprocessor_args`` (temperature 1000, noise 0.0014), which are ODIN's."""

    method: ClassVar[str] = "iodin"


@register_detector
class IODINDetector(ODINDetector):
    """MSP at temperature ``T`` of the input stepped, as ODIN's, on the one element (channel and pixel) of each sample
    with the largest ``|grad|`` only (:func:`~hf_gsc.detectors.odin.odin_perturb` with ``single_element``).

    The reference is OpenOOD v1.5's ``openood/postprocessors/iodin_postprocessor.py`` with
    ``configs/postprocessors/iodin.yml`` (no paper of its is cited there): ODIN's postprocess, the step masked by
    ``get_mask`` (``argmax`` of ``|grad|`` over every channel and pixel, one element per sample). Its loss is the
    batch-mean cross-entropy, ODIN's here the sum: the same signs and the same largest element (a per-sample gradient
    divided by the batch size). OpenOOD runs it with ``APS_mode: True`` (temperature and noise chosen on its OOD
    validation set); here the defaults are its ``postprocessor_args`` and ``--tune`` searches its grid on ID
    validation data with generated OOD validation sets only (the ID-only mode). ``image_std`` as ODIN's (the image
    processor's std, where OpenOOD reads its dataset's).

    Settings: :class:`IODINConfig`.
    """

    config_class = IODINConfig
    in_default_table = False
    search_space = {"temperature": (1.0, 10.0, 100.0, 1000.0), "epsilon": (0.0014, 0.0028)}
    search_space_source = "OpenOOD iodin.yml postprocessor_sweep: temperature [1, 10, 100, 1000] x noise [0.0014, 0.0028]"
    single_element = True
