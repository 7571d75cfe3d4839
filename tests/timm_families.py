"""Tiny random timm models of the families hf_gsc is checked on, wrapped as the Hub loads them
(transformers' ``TimmWrapperForImageClassification`` on a local ``TimmWrapperConfig``; no weights, no Hub).

timm is the ``[timm]`` extra, not a dependency: :func:`import_timm` skips the calling test module where it is not
installed, and fails it where ``HF_GSC_REQUIRE_TIMM=1`` (``make test-timm``), so that a timm environment cannot pass
by skipping.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch


#: family -> (timm model name, extra ``timm.create_model`` arguments, image size). timm's own ``test_*`` models where
#: the registry has one; RegNet and Swin at their smallest registered variants, Swin made smaller still.
FAMILIES: dict[str, tuple[str, dict[str, Any], int]] = {
    "resnet": ("test_resnet", {}, 64),
    "efficientnet": ("test_efficientnet", {}, 64),
    "convnext": ("test_convnext", {}, 64),
    "vit": ("test_vit", {"img_size": 32}, 32),
    # Patch tokens averaged, then fc_norm: not a closed-form head, so timm's forward_head runs under autograd.
    "vit_avg_pool": ("test_vit", {"img_size": 32, "global_pool": "avg"}, 32),
    "regnet": ("regnetx_002", {}, 32),  # 1 x 1 at its last stage; ResNet, EfficientNet, ConvNeXt pool 2 x 2
    "swin": ("swin_tiny_patch4_window7_224",
             {"img_size": 32, "window_size": 4, "embed_dim": 16, "depths": (1, 1), "num_heads": (1, 2)}, 32),
}


def import_timm() -> Any:
    """``timm``; the calling module is skipped without it, unless ``HF_GSC_REQUIRE_TIMM=1`` makes that a failure."""
    if os.environ.get("HF_GSC_REQUIRE_TIMM") == "1":
        import timm  # an ImportError here fails the module: the timm environment must run these tests

        return timm
    return pytest.importorskip(
        "timm", reason="timm is not installed (pip install 'hf_gsc[timm]'; `make test-timm` runs these tests)"
    )


def make_timm_model(family: str, num_labels: int = 5, id2label: dict[int, str] | None = None,
                    dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """A random ``TimmWrapperForImageClassification`` of ``family`` in eval mode, its ``pretrained_cfg`` saying the
    image size it is built for (what its image processor reads)."""
    from transformers import TimmWrapperConfig, TimmWrapperForImageClassification

    name, arguments, size = FAMILIES[family]
    labels = {} if id2label is None else {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}}
    config = TimmWrapperConfig(
        architecture=name, num_labels=num_labels if id2label is None else len(id2label),
        model_args={**arguments, "pretrained_cfg_overlay": {"input_size": (3, size, size)}}, **labels,
    )
    torch.manual_seed(seed)
    model = TimmWrapperForImageClassification(config).to(dtype).eval()
    # As a timm checkpoint on the Hub has it: its config.json carries timm's pretrained_cfg, which is what
    # AutoImageProcessor builds TimmWrapperImageProcessor from.
    model.config.pretrained_cfg = dict(model.timm_model.pretrained_cfg)
    return model


def image_size(family: str) -> int:
    return FAMILIES[family][2]
