"""GEN: generalized entropy of the softmax (Liu, Lochman & Zach, CVPR 2023)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, integer_check, number_check, setting
from .backbone_pass import BackbonePass
from .common import BaselineDetector
from .interface import register_detector


def gen_score(logits: torch.Tensor, gamma: float, top: int) -> torch.Tensor:
    """``-sum_{j in top M} p_j^gamma (1 - p_j)^gamma`` over the ``M`` largest softmax probabilities ``p`` of
    ``logits``; ``(B, K) -> (B,)``, float64.

    Every term is ``exp(gamma (log p_j + log(1 - p_j)))``, from the logits, so that no factor rounds to 0 or 1:
    ``1 - p`` of the largest probability rounds to 0 from a logit gap of ~17 in float32 (~37 in float64), and then
    the term that tells confident samples apart, ``(1 - p_max)^gamma``, is lost; in float64 the small probabilities
    themselves underflow from a gap of ~745, yet ``p^gamma`` is still far from 0 for the swept ``gamma`` (0.01).
    ``log(1 - p_max)`` is the log of the other classes' mass, ``logsumexp(others) - logsumexp(all)``; for the
    others ``p <= 1/2`` and ``log1p(-p)`` is exact.
    """
    logits = logits.double()
    log_p = torch.log_softmax(logits, dim=-1)
    top_log_p, top_index = log_p.topk(min(top, logits.shape[-1]), dim=-1)
    log_complement = torch.log1p(-top_log_p.exp())
    others = logits.scatter(-1, top_index[:, :1], -torch.inf)
    log_complement[:, 0] = torch.logsumexp(others, dim=-1) - torch.logsumexp(logits, dim=-1)
    return -torch.exp(gamma * (top_log_p + log_complement)).sum(dim=-1)


@dataclass
class GENConfig(DetectorConfig):
    """Settings of generalised entropy (:class:`GENDetector`)."""

    method: ClassVar[str] = "gen"
    # gamma = 0 scores every sample alike (each term is 1); OpenOOD's smallest is 0.01.
    gamma: float = setting(0.1, number_check(0.0, math.inf, low_open=True),
                           "The exponent ``gamma`` of the entropy; 0.1: OpenOOD gen.yml ``gamma``, the authors' "
                           "``--gamma`` default and the paper's setting.")
    top: int = setting(100, integer_check(1),
                       "``M``, the number of largest probabilities scored; 100: OpenOOD gen.yml ``M``, the authors' "
                       "``--M`` default and the paper's ImageNet setting.")


@register_detector
class GENDetector(BaselineDetector):
    """Generalized entropy of the top-``M`` softmax probabilities, :func:`gen_score` (negated: higher = more ID).

    Liu, Lochman, Zach, "GEN: Pushing the Limits of Softmax-Based Out-of-Distribution Detection", CVPR 2023 (code:
    github.com/XixiLiu95/GEN ``benchmark.py`` ``generalized_gamma_entropy``; OpenOOD v1.5 ``gen_postprocessor.py``,
    the reference here, is the same function). No fitting. The authors' code sorts the softmax probabilities and
    sums ``p^gamma (1 - p)^gamma`` over the last ``M``; here each term is computed in log space from the logits
    (:func:`gen_score`): the same number, without ``1 - p`` rounding to 0 for confident samples. ``M`` above the
    number of classes takes them all, as the slice ``[:, -M:]`` does in the authors' code. Paper and code agree.

    Settings: :class:`GENConfig`.
    """

    config_class = GENConfig
    search_space = {"gamma": (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0), "top": (10, 50, 100, 200, 500, 1000)}
    search_space_source = ("OpenOOD gen.yml postprocessor_sweep: gamma_list [0.01, 0.1, 0.5, 1, 2, 5, 10] x "
                           "M_list [10, 50, 100, 200, 500, 1000]")
    reads_logits = True

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return gen_score(batch.model_logits(), self.hyperparameters["gamma"], self.hyperparameters["top"])
