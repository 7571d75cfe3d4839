"""RankFeat: rank-1 feature removal (Song, Sebe & Wang, NeurIPS 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..classifier.architectures import architecture_for, encoder_blocks
from ..classifier.heads import HeadSpec, ModuleHead
from ..classifier.split_point_names import split_point_name_list
from ..classifier.split_points import SplitPoint, resolve_split_point
from ..settings.config import MIN_TEMPERATURE, DetectorConfig, number_check, setting
from ..utils.precision import full_precision, parameter_dtype, step_dtype
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import BaselineDetector
from .interface import register_detector


def remove_rank_one(features: torch.Tensor) -> torch.Tensor:
    """Each sample's feature matrix minus its rank-1 component, ``X - s_1 u_1 v_1^T`` (the authors'
    ``feat - s[:, 0:1].unsqueeze(2) * u[:, :, 0:1].bmm(v[:, 0:1, :])`` after ``torch.linalg.svd``). The matrix is
    ``(C, H W)`` of a feature map ``(B, C, H, W)`` and ``(T, D)`` of tokens ``(B, T, D)``; the result has the input's
    shape.

    Computed from the top eigenvector of the Gram matrix of the smaller side instead of a full SVD: with ``v_1`` the
    top eigenvector of ``X^T X``, ``s_1 u_1 v_1^T = X v_1 v_1^T`` (with ``u_1`` that of ``X X^T``, ``u_1 u_1^T X``),
    the same matrix whatever the singular vectors' signs. The symmetric eigendecomposition of a ``min(rows, columns)``
    square matrix takes a half to a quarter of the SVD's time on the CPU (measured on batches of ViT tokens, 197 x 192
    and 197 x 768, and ResNet-50 maps, 2048 x 49 and 1024 x 196), and its top eigenvector is as accurate: the Gram
    matrix's rounding is about ``eps s_1^2`` against an eigenvalue gap ``s_1^2 - s_2^2``, a ratio no larger than the
    SVD's ``eps s_1 / (s_1 - s_2)``."""
    if features.dim() not in (3, 4):
        raise ValueError(f"rankfeat: a feature map (B, C, H, W) or tokens (B, T, D) expected, got shape "
                         f"{tuple(features.shape)}: a vector has no rank-1 component to remove")
    matrix = features.flatten(2)
    if matrix.shape[2] <= matrix.shape[1]:
        right = torch.linalg.eigh(matrix.mT @ matrix).eigenvectors[..., -1:]  # v_1 (B, columns, 1), eigenvalues ascend
        removed = matrix - (matrix @ right) @ right.mT
    else:
        left = torch.linalg.eigh(matrix @ matrix.mT).eigenvectors[..., -1:]  # u_1 (B, rows, 1)
        removed = matrix - left @ (left.mT @ matrix)
    return removed.view_as(features)


def pools_spatially(model: nn.Module) -> bool:
    """Whether the head averages a feature map's positions (a CNN: ResNet, ConvNeXt, RegNet, MobileNet, ...) rather
    than reading tokens: the form that decides the authors' split points (:class:`RankFeatConfig`)."""
    head = architecture_for(model).head
    if isinstance(head, HeadSpec):
        return head.pool == "mean_spatial"
    return isinstance(head, ModuleHead) and "@mean_spatial" in head.steps


def default_split_points(model: nn.Module) -> tuple[str, ...]:
    """The authors' split points for ``model``: a CNN's last two stages (block 4 and block 3 of OpenOOD's
    ResNet-50), a transformer's second-to-last block (``svd_block_index = 11`` of 12 in their ViT script); an encoder
    of one block has its final output only."""
    blocks = architecture_for(model).blocks
    if len(encoder_blocks(model, "rankfeat")) < 2:
        return ("final_encoder_output",)
    before_last = f"{blocks}.-2"
    return ("final_encoder_output", before_last) if pools_spatially(model) else (before_last,)


def _split_points(name: str, value: Any) -> Any:
    """``None`` or a non-empty list of split point names, held as a tuple (saved as a JSON list)."""
    points = split_point_name_list(name, value, "['final_encoder_output', 'resnet.encoder.stages.-2']")
    if points is None:
        return None
    if "penultimate" in points:
        raise ValueError(f"{name}: 'penultimate' is a vector per sample, which has no rank-1 component to remove; "
                         "name feature maps or token outputs (blocks of the encoder, 'final_encoder_output')")
    return points


@dataclass
class RankFeatConfig(DetectorConfig):
    """Settings of rank-1 feature removal (:class:`RankFeatDetector`)."""

    method: ClassVar[str] = "rankfeat"
    temperature: float = setting(1.0, number_check(MIN_TEMPERATURE, math.inf),
                                 "``T`` of the energy; 1: OpenOOD rankfeat.yml and the authors' scripts.")
    split_points: tuple[str, ...] | None = setting(
        None, _split_points,
        "Where the rank-1 component is removed; the logits of each (the rest of the model run after it) are "
        "averaged. ``None``: the authors' choice for the architecture (:func:`default_split_points`): the last two "
        "stages of a CNN (OpenOOD's ``rankfeat_postprocessor.py`` on ResNet-50: block 4, and block 3 followed by "
        "block 4), the output of the second-to-last block of a transformer (the authors' ``test_ood_vit.py``).")


@register_detector
class RankFeatDetector(BaselineDetector):
    """Energy of the logits averaged over the split points, each computed from the feature with its rank-1 component
    removed (:func:`remove_rank_one`) and the rest of the model run after it.

    Song, Sebe, Wang, "RankFeat: Rank-1 Feature Removal for Out-of-distribution Detection", NeurIPS 2022. The
    references are OpenOOD v1.5's ``openood/postprocessors/rankfeat_postprocessor.py`` with
    ``configs/postprocessors/rankfeat.yml`` (ResNet-50: the feature map of block 4, rank 1 removed, pooled and
    classified; that of block 3, rank 1 removed, through block 4, pooled and classified; the two logits averaged;
    the energy at ``temperature``) and the authors' ``test_ood_vit.py`` (github.com/KingJamesSong/RankFeat,
    ``iterate_data_rankfeat``: the ``(tokens, width)`` matrix after the 11th of 12 blocks, rank 1 removed, the last
    block, the final LayerNorm, the CLS token, the head; one split point, no average). No fitting.

    Left out: the power iteration both codes offer instead of the SVD (OpenOOD's ``accelerate``, off in its yml;
    commented out in the authors' ViT script): its start is drawn at random each batch, so its scores are an
    approximation that changes from run to run. The rank-1 removal runs in float32 or wider with autocast off.

    Cost: one symmetric eigendecomposition per sample and split point (:func:`remove_rank_one`: the SVD's rank-1
    component from the Gram matrix of the smaller side), and the rest of the model after each split point except the final
    encoder output (the second-to-last block's removal runs the last block again; where the encoder's blocks need
    more than the hidden states, Swin's, the model is replayed with that block's output replaced).

    Settings: :class:`RankFeatConfig`.
    """

    config_class = RankFeatConfig
    search_space_source = "OpenOOD rankfeat.yml has no sweep (APS_mode False; temperature 1)"

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self.splits = tuple(resolve_split_point(self.model, point) for point in self.hyperparameters["split_points"])

    def __getstate__(self) -> dict[str, Any]:
        # A split point inside the encoder holds a closure (the blocks after it): rebuilt on unpickling (pickle,
        # copy.deepcopy) instead of pickled, as GSC's backend.
        state = super().__getstate__()
        state["splits"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.splits = tuple(resolve_split_point(self.model, point) for point in self.hyperparameters["split_points"])

    def resolve_defaults(self, model: nn.Module, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        if hyperparameters["split_points"] is None:
            hyperparameters["split_points"] = default_split_points(model)
        return hyperparameters

    def feature_splits(self) -> tuple[SplitPoint, ...]:
        return self.splits

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """The rank-1 removals and the energy in float32 or wider with autocast off (:mod:`hf_gsc.utils.precision`); the rest of
        the model in its own dtype."""
        logits = []
        for split in self.splits:
            features = batch.features(split)
            with full_precision(features.device), torch.no_grad():
                removed = remove_rank_one(features.to(step_dtype(features.dtype)))
                logits.append(split.head(removed.to(parameter_dtype(self.model)), batch.pixel_values)
                              .to(removed.dtype))
        with full_precision(logits[0].device):
            return energy_score(torch.stack(logits).mean(dim=0), self.hyperparameters["temperature"])
