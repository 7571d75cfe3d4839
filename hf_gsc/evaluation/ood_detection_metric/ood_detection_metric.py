"""`evaluate` metric module for OOD detection: FPR@95%TPR (ID positive, and OOD positive as OpenOOD counts it),
AUROC, AUPR-In, AUPR-Out.

It ships inside the installed package; load it from there, with no Hugging Face Hub access:

    from hf_gsc.evaluation.metrics import OOD_METRIC_PATH, load_ood_metric
    metric = load_ood_metric()                    # or: evaluate.load(str(OOD_METRIC_PATH))

``OOD_METRIC_PATH`` is this folder wherever ``hf_gsc`` is installed. ``evaluate.load`` copies
this script into its modules cache and imports it from there, so the script
must not use relative imports: it imports the installed ``hf_gsc`` package,
and all numbers come from ``hf_gsc.evaluation.metrics.ood_metrics``.
"""

import datasets
import evaluate
import numpy as np

from hf_gsc.evaluation.metrics import fpr_at_tpr_ood_positive, ood_metrics


_DESCRIPTION = """
Out-of-distribution (OOD) detection metrics with in-distribution (ID) as the positive class.
`predictions` are OOD scores where HIGHER means MORE in-distribution; `references` are 1 for
ID samples and 0 for OOD samples.

- fpr95: fraction of OOD samples with score >= t, where t is the largest threshold that keeps at
  least 95% of the ID samples (score >= t). Ties at t are never split: all tied ID samples are
  kept and all tied OOD samples count as false positives. This is the GSC paper's convention;
  OpenOOD's "FPR@95" instead treats OOD as positive (fraction of ID rejected when 95% of OOD is
  caught), so the numbers are not comparable: that one is fpr95_ood_positive.
- fpr95_ood_positive: fraction of ID samples rejected (score below t) at the threshold t that
  catches at least 95% of the OOD samples, with OOD as the positive class and the negated score as
  the detection score (OpenOOD v1.5's FPR@95).
- auroc: area under the ROC curve (sklearn.metrics.roc_auc_score).
- aupr_in: average precision with ID as positive (sklearn.metrics.average_precision_score).
- aupr_out: average precision with OOD as positive, on the negated scores.

All values are fractions in [0, 1]. Scores are kept as float64.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `float`): OOD score of each sample, higher = more in-distribution.
        Must be finite.
    references (`list` of `int`): 1 if the sample is in-distribution, 0 if it is OOD. Both
        classes must be present.

Returns:
    fpr95 (`float`): false-positive rate (OOD accepted) at 95% true-positive rate (ID kept).
    fpr95_ood_positive (`float`): fraction of ID rejected when 95% of OOD is caught (OpenOOD's FPR@95).
    auroc (`float`): area under the ROC curve.
    aupr_in (`float`): average precision, ID positive.
    aupr_out (`float`): average precision, OOD positive.

Examples:
    >>> from hf_gsc.evaluation.metrics import load_ood_metric
    >>> metric = load_ood_metric()
    >>> results = metric.compute(predictions=[0.9, 0.8, 0.2, 0.1], references=[1, 1, 0, 0])
    >>> results
    {'fpr95': 0.0, 'auroc': 1.0, 'aupr_in': 1.0, 'aupr_out': 1.0, 'fpr95_ood_positive': 0.0}
"""

_CITATION = """
@InProceedings{Gu_2025_ICCV,
    author    = {Gu, Jiawei and Qiao, Ziyue and Li, Zechao},
    title     = {Gradient Short-Circuit: Efficient Out-of-Distribution Detection via Feature Intervention},
    booktitle = {Proceedings of the IEEE/CVF International Conference on Computer Vision (ICCV)},
    year      = {2025},
    pages     = {457-466}
}
@inproceedings{hendrycks2017baseline,
    author    = {Hendrycks, Dan and Gimpel, Kevin},
    title     = {A Baseline for Detecting Misclassified and Out-of-Distribution Examples in Neural Networks},
    booktitle = {International Conference on Learning Representations (ICLR)},
    year      = {2017}
}
@inproceedings{liang2018enhancing,
    author    = {Liang, Shiyu and Li, Yixuan and Srikant, R.},
    title     = {Enhancing The Reliability of Out-of-distribution Image Detection in Neural Networks},
    booktitle = {International Conference on Learning Representations (ICLR)},
    year      = {2018}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class OODDetectionMetric(evaluate.Metric):
    """FPR@95%TPR, AUROC, AUPR-In and AUPR-Out of OOD scores against ID/OOD labels."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    # float64, not float32: float32 would merge nearby scores such as
                    # 1e8 + 1e-6 and 1e8 + 2e-6 into ties and change every metric.
                    "predictions": datasets.Value("float64"),
                    "references": datasets.Value("int32"),
                }
            ),
            # No format="numpy": datasets' numpy formatter casts floats to float32, which
            # loses exactly that precision. _compute gets Python lists and converts them.
            reference_urls=[
                "https://arxiv.org/abs/2507.01417",
                "https://scikit-learn.org/stable/modules/generated/sklearn.metrics.roc_curve.html",
                "https://scikit-learn.org/stable/modules/generated/sklearn.metrics.average_precision_score.html",
            ],
        )

    def _compute(self, predictions, references) -> dict:
        scores = np.asarray(predictions, dtype=np.float64)
        labels = np.asarray(references)
        # Check the evaluate-level arguments here so that errors name `predictions` and
        # `references`, not the id_scores/ood_scores that ood_metrics would report.
        if not np.isfinite(scores).all():
            raise ValueError("predictions must contain only finite OOD scores; got NaN or inf")
        if not np.isin(labels, (0, 1)).all():
            found = sorted(set(np.unique(labels).tolist()) - {0, 1})
            raise ValueError(f"references must be 1 (in-distribution) or 0 (OOD); got {found}")
        is_id = labels == 1
        if is_id.all() or not is_id.any():
            raise ValueError(
                "references must contain both classes (1 = in-distribution, 0 = OOD); "
                f"got {int(is_id.sum())} ID and {int((~is_id).sum())} OOD samples"
            )
        id_scores, ood_scores = scores[is_id], scores[~is_id]
        return {**ood_metrics(id_scores, ood_scores),
                "fpr95_ood_positive": fpr_at_tpr_ood_positive(id_scores, ood_scores, 0.95)}
