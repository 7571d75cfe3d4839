"""GEN: generalized entropy of the softmax (Liu, Lochman & Zach, CVPR 2023)."""

from __future__ import annotations

import torch

from ..backbone_pass import BackbonePass
from ..detector import register_detector
from .common import BaselineDetector


def gen_score(logits: torch.Tensor, gamma: float, top: int) -> torch.Tensor:
    """``-sum_{j in top M} p_j^gamma (1 - p_j)^gamma`` over the ``M`` largest softmax probabilities; ``(B, K) ->
    (B,)``, float64.

    ``1 - p`` of the largest probability is computed as the sum of the other probabilities: for a confident sample
    (a logit gap above ~17 in float32, ~37 in float64) ``1 - p`` rounds to 0 and the sample's ``(1 - p)^gamma``, the
    term that separates it, would be lost.
    """
    logits = logits.double()
    probabilities = torch.softmax(logits, dim=-1)
    top_p, top_index = probabilities.topk(min(top, logits.shape[-1]), dim=-1)
    complement = 1.0 - top_p  # exact for every probability but the largest (the others are at most 1/2)
    complement[:, 0] = probabilities.scatter(-1, top_index[:, :1], 0.0).sum(dim=-1)  # the others' mass
    return -(top_p.pow(gamma) * complement.pow(gamma)).sum(dim=-1)


@register_detector
class GENDetector(BaselineDetector):
    """Generalized entropy of the top-``M`` softmax probabilities, :func:`gen_score` (negated: higher = more ID).

    Liu, Lochman, Zach, "GEN: Pushing the Limits of Softmax-Based Out-of-Distribution Detection", CVPR 2023 (code:
    github.com/XixiLiu95/GEN; OpenOOD v1.5 ``gen_postprocessor.py``, the reference here). No fitting. The authors'
    code sorts the probabilities and sums ``p^gamma (1 - p)^gamma`` over the last ``M``; here ``1 - p`` of the
    largest probability is the sum of the others (the same number, without the float rounding to 0 for confident
    samples). ``M`` above the number of classes takes them all, as slicing does in the authors' code.

    Hyperparameters:
        gamma: ``0.1`` (OpenOOD gen.yml and the paper's ImageNet setting).
        top: ``M = 100`` (OpenOOD gen.yml ``M``; the paper's ImageNet setting).
    """

    method = "gen"
    defaults = {"gamma": 0.1, "top": 100}
    search_space = {"gamma": (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0), "top": (10, 50, 100, 200, 500, 1000)}
    search_space_source = "OpenOOD gen.yml: gamma_list [0.01, 0.1, 0.5, 1, 2, 5, 10] x M_list [10, 50, 100, 200, 500, 1000]"
    reads_logits = True

    def validate(self) -> None:
        self._number("gamma", 0.0, low_open=True)
        self._integer("top", 1)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return gen_score(batch.model_logits(), self.hyperparameters["gamma"], self.hyperparameters["top"])
