"""``GSCForImageClassification``: any ``transformers`` image classifier with Gradient Short-Circuit.

Data flow (paper Algorithm 1)::

    pixel_values -> backbone up to the split point (no gradient) -> F -> head(F) = logits y
    g = d y_c / dF                  through the head only, c = argmax y
    mask = top-k |g|, F' = S(F, g)  (hf_gsc.shortcircuit)
    gsc_logits = y + J(F' - F) | y_c + g.(F' - F) | head(F')
    ood_score = score(gsc_logits)   higher = more in-distribution; is_ood = ood_score < threshold

How ``F`` is taken and the head linearised is the backend's job (:mod:`hf_gsc.backends`, chosen once at
construction); everything after that is :func:`hf_gsc.gsc_step.gsc_step`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .backends import Backend, Linearization, select_backend
from .config import CONFIG_NAME, STATE_FILE, GSCConfig
from .gsc_step import gsc_step, ranking_gradient
from .inputs import batches, check_pixel_values
from .shortcircuit import diagonal_fisher_sum, gradient_mass_for_mean_ratio
from .split_points import SplitPoint


@dataclass
class GSCOutput(ModelOutput):
    """Output of :class:`GSCForImageClassification`.

    Attributes:
        loss: ``()`` cross-entropy of ``logits`` against ``labels`` when labels are given (what ``Trainer.predict``
            expects of a classifier; GSC itself has no loss).
        logits: ``(B, K)`` the base model's logits, unchanged (in float32 for a bf16 / fp16 model, as every output:
            the step after the backbone runs in float32, see :mod:`hf_gsc.gsc_step`).
        gsc_logits: ``(B, K)`` logits after the short-circuit.
        ood_score: ``(B,)`` score of ``gsc_logits``; higher = more in-distribution.
        is_ood: ``(B,)`` bool, ``ood_score < threshold``; ``None`` while no threshold is set.
        predicted_class: ``(B,)`` ``argmax logits``, the class whose gradient selects the mask.
        features: ``(B, *feature_shape)`` ``F`` (only with ``output_short_circuit=True``).
        gradient: ``(B, *feature_shape)`` ``g = d y_c / dF`` (only with ``output_short_circuit=True``).
        mask: ``(B, *feature_shape)`` bool, short-circuited coordinates (only with ``output_short_circuit=True``).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    gsc_logits: torch.Tensor | None = None
    ood_score: torch.Tensor | None = None
    is_ood: torch.Tensor | None = None
    predicted_class: torch.Tensor | None = None
    features: torch.Tensor | None = None
    gradient: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class GSCForImageClassification(nn.Module):
    """Wraps (and owns) a base image classifier; adds GSC logits and OOD scores to its forward.

    The base model is kept in eval mode, its parameters are frozen (``requires_grad=False``) and never
    receive ``.grad``; gradients are taken with respect to ``F`` only, through the head only. One detector may
    be called from several threads at once: a forward registers nothing on the model and keeps no state.

    Args:
        model: a ``*ForImageClassification`` model returning ``.logits``.
        config: the GSC settings; ``None`` means defaults.
        **overrides: ``GSCConfig`` fields replacing those of ``config`` (e.g. ``mask_ratio=0.1``).
    """

    def __init__(self, model: PreTrainedModel, config: GSCConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module image classifier, got {type(model).__name__}")
        config = config or GSCConfig()
        if overrides:
            config = dataclasses.replace(config, **overrides)
        if config.base_model_name_or_path is None:
            config.base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", None) or None
        self.model = model
        self.config = config
        # Set by from_pretrained when the base model ships one; saved along with base weights.
        self.image_processor: Any = None
        # (d,) diagonal Fisher of the feature, fitted on ID training data for selection="fisher".
        self.fisher_diagonal: torch.Tensor | None = None
        self.model.eval()
        self.model.requires_grad_(False)
        base_config = getattr(model, "config", None)
        self._expected_channels: int | None = getattr(base_config, "num_channels", None)
        image_size = getattr(base_config, "image_size", None)
        self._expected_size: tuple[int, int] | None = (
            None if image_size is None
            else tuple(image_size) if isinstance(image_size, (list, tuple)) else (image_size, image_size)
        )
        # How F is taken and the head linearised, for this split point (hf_gsc.backends).
        self.backend: Backend = select_backend(model, config)

    @property
    def split_point(self) -> SplitPoint:
        """The resolved split point where ``F`` is taken."""
        return self.backend.split_point

    # ------------------------------------------------------------------ loading and saving (hf_gsc.serialization)
    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        config: GSCConfig | None = None,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> "GSCForImageClassification":
        """Load a saved detector (folder or Hub repo with ``gsc_config.json``) or wrap any image classifier.

        Args:
            pretrained_model_name_or_path: a detector folder or Hub repo, or an image classifier's.
            config: wrap the classifier with these settings instead of looking for a saved detector.
            model: an already loaded base model (any dtype, ``device_map``, quantised) to attach the saved
                detector to, as ``PeftModel.from_pretrained(model, id)`` does; the base reference is then not loaded.
            **kwargs: ``GSCConfig`` fields (``mask_ratio=0.05``, ``base_model_name_or_path=...``) override the saved
                config; ``revision``, ``token``, ``cache_dir``, ``local_files_only``, ``force_download`` locate the
                detector, its base model and image processor (offline from the cache as transformers does); the
                rest (``dtype``, ``device_map``, ...) go to ``AutoModelForImageClassification.from_pretrained``.

        A detector's base model comes from the detector folder when it was saved with its weights,
        otherwise from the base-model reference (and revision) in ``gsc_config.json``.
        """
        from .serialization import load_detector

        return load_detector(cls, pretrained_model_name_or_path, config=config, model=model, **kwargs)

    def state_dict_for_saving(self) -> dict[str, torch.Tensor]:
        """Fitted tensors of the detector (``fisher_diagonal``, ``gradient_mass`` when set), saved as safetensors."""
        from .serialization import detector_state

        return detector_state(self)

    def load_state_dict_from_dir(self, directory: str | os.PathLike) -> None:
        """Counterpart of :meth:`state_dict_for_saving`; the tensors are checked (shape, finite, sign)."""
        from .serialization import apply_state, read_state

        path = os.path.join(directory, STATE_FILE)
        if os.path.isfile(path):
            apply_state(self, read_state(path), path)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        save_base_model: bool = False,
        results_dir: str | os.PathLike | None = None,
        license: str | None = None,
    ) -> str:
        """Write ``gsc_config.json``, fitted state, a model card, and optionally the base weights and results
        (``results_dir``: this detector's own evaluation output, checked against its model and settings)."""
        from .serialization import save_detector

        return str(save_detector(self, save_directory, save_base_model, results_dir, license=license))

    def push_to_hub(
        self,
        repo_id: str,
        private: bool = False,
        revision: str | None = None,
        token: str | bool | None = None,
        save_base_model: bool = False,
        results_dir: str | os.PathLike | None = None,
        commit_message: str = "Upload GSC detector",
        license: str = "apache-2.0",
    ) -> str:
        """Upload the detector (as :meth:`save_pretrained` writes it) to ``repo_id``; returns the commit URL.

        A base model that is only a local folder is refused unless ``save_base_model=True``."""
        from .hub import push_detector

        return push_detector(
            self, repo_id, private, revision, token, save_base_model, results_dir, commit_message, license
        )

    @property
    def device(self) -> torch.device:
        """The device of the base model's parameters (what ``pixel_values`` are moved to by pipelines)."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the base model's first parameter; ``pixel_values`` are cast to it."""
        return next(self.model.parameters()).dtype

    def train(self, mode: bool = True) -> "GSCForImageClassification":
        """The wrapper may be put in train mode; the base model always stays in eval mode."""
        super().train(mode)
        self.model.eval()
        return self

    # ------------------------------------------------------------------ inference
    def _check_pixel_values(self, pixel_values: Any) -> torch.Tensor:
        """Checked ``pixel_values`` on the model's device, in its dtype (what ``forward``, ``calibrate`` and the fits run)."""
        checked = check_pixel_values(pixel_values, self._expected_channels, self._expected_size, self.dtype)
        return checked.to(self.device)

    def _linearize(self, pixel_values: torch.Tensor) -> Linearization:
        """``F`` and the head linearised on the part of ``F`` it reads. Random selection linearises on all of ``F``:
        it draws one number per coordinate of ``F``, and a seeded ablation must draw the same numbers whatever
        the head reads. Only the first-order update needs ``J t``; otherwise autograd frees the head's graph."""
        config = self.config
        return self.backend.linearize(
            pixel_values, whole_feature=config.selection == "random", keep_graph=config.approximation == "first_order"
        )

    def forward(
        self,
        pixel_values: torch.Tensor,
        output_short_circuit: bool = False,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
    ) -> GSCOutput:
        """Score a batch.

        Args:
            pixel_values: ``(B, C, H, W)`` from the base model's image processor.
            output_short_circuit: also return ``features``, ``gradient`` and ``mask``.
            labels: ``(B,)`` class indices; only set ``loss``, the base classifier's cross-entropy, so that
                ``Trainer.predict`` keeps them, as with any ``*ForImageClassification`` model.
            return_dict: accepted and ignored (the output is always a :class:`GSCOutput`).
        Returns:
            :class:`GSCOutput`. Works inside ``torch.no_grad()`` and ``torch.inference_mode()``.
        """
        pixel_values = self._check_pixel_values(pixel_values)
        config = self.config
        if config.selection == "fisher" and self.fisher_diagonal is None:
            raise RuntimeError("selection='fisher' needs a fitted diagonal Fisher: call fit_fisher(id_train_batches)")
        if config.mask_size == "adaptive" and config.gradient_mass is None:
            raise RuntimeError(
                "mask_size='adaptive' needs gradient_mass: call calibrate_gradient_mass(id_validation_batches)"
            )
        linearization = self._linearize(pixel_values)  # backbone up to F, head linearised at F
        step = gsc_step(  # g, mask, F' = S(F, g), updated logits, score
            linearization.head,
            linearization.read_part,
            config,
            fisher_diagonal=linearization.restrict(self.fisher_diagonal),
            layer_sizes=linearization.layer_sizes,
        )
        threshold = config.threshold
        extra = {}
        if output_short_circuit:
            extra = dict(
                features=linearization.features,
                gradient=linearization.spread(step.gradient),
                mask=linearization.spread(step.mask),
            )
        return GSCOutput(
            loss=_classifier_loss(step.logits, labels),
            logits=step.logits,
            gsc_logits=step.gsc_logits,
            ood_score=step.ood_score,
            is_ood=None if threshold is None else step.ood_score < threshold,
            predicted_class=step.predicted_class,
            **extra,
        )

    def _feature_gradient(
        self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[Linearization, torch.Tensor]:
        """The linearisation of a batch and its per-sample gradient w.r.t. ``F``, ``(B, *feature_shape)``.

        Without ``labels`` the gradient is ``g = d y_c / dF`` for the predicted class ``c``; with labels it is
        the gradient of the cross-entropy loss, ``softmax(y) - onehot(label)`` pulled back (what the diagonal
        Fisher is made of). Heads are batch-separable, so one product for the whole batch gives every
        per-sample gradient.
        """
        linearization = self._linearize(pixel_values)
        head = linearization.head
        logits = head.logits
        if labels is None:
            gradient = head.class_gradient(logits.argmax(dim=-1))
        else:
            target = nn.functional.one_hot(labels.to(logits.device).long(), logits.shape[-1]).to(logits.dtype)
            gradient = head.vjp(logits.softmax(dim=-1) - target)
        return linearization, linearization.spread(gradient.flatten(1))

    # ------------------------------------------------------------------ calibration and fitting
    def calibrate(
        self,
        id_validation_data: torch.Tensor | Iterable[Any],
        tpr: float = 0.95,
        split: str = "validation",
    ) -> float:
        """Set ``config.threshold`` so that a fraction ``tpr`` of ID validation data is accepted as ID.

        Use ID *validation* data only, never the test split or OOD data. ``config.calibration`` records
        ``split``, ``num_samples`` and ``tpr``.

        Args:
            id_validation_data: a ``(N, C, H, W)`` tensor, or an iterable of batches that are tensors,
                ``(pixel_values, labels)`` tuples or mappings with a ``"pixel_values"`` key.
            tpr: fraction of ID samples to keep, in ``(0, 1]``.
            split: name of the data, recorded in the calibration record.
        Returns:
            The threshold.
        """
        from .evaluation.calibration import calibrate_threshold, calibration_record

        scores = []
        for pixel_values, _ in batches(id_validation_data, "id_validation_data"):
            with torch.no_grad():
                scores.append(self(pixel_values).ood_score.double().cpu())
        all_scores = torch.cat(scores)
        self.config.threshold = calibrate_threshold(all_scores, tpr)
        self.config.calibration = calibration_record(split, all_scores.numel(), tpr)
        return self.config.threshold

    def calibrate_gradient_mass(self, id_validation_data: torch.Tensor | Iterable[Any]) -> float:
        """For ``mask_size="adaptive"``: choose ``gradient_mass`` so that the mean mask ratio ``k/n`` on ID
        validation data equals ``config.mask_ratio`` (bisection; the mean ratio grows with the mass).

        Use ID validation data only. Returns the mass and stores it in ``config.gradient_mass``.
        """
        gradients = []
        for pixel_values, _ in batches(id_validation_data, "id_validation_data"):
            linearization, gradient = self._feature_gradient(self._check_pixel_values(pixel_values))
            gradients.append(ranking_gradient(gradient.flatten(1), linearization.layer_sizes))
        self.config.gradient_mass = gradient_mass_for_mean_ratio(torch.cat(gradients), self.config.mask_ratio)
        return self.config.gradient_mass

    def fit_fisher(self, id_train_data: Iterable[Any]) -> torch.Tensor:
        """Fit the diagonal Fisher ``lambda_i = E[(d CE(y, label) / dF_i)^2]`` on ID *training* data.

        Args:
            id_train_data: batches of ``(pixel_values, labels)`` (or mappings with ``pixel_values`` and
                ``labels``/``label``), streamed: only the running sum is kept.
        Returns:
            ``(d,)`` float64 ``lambda``, also stored for ``selection="fisher"`` and saved with the detector.
        """
        total, count = None, 0
        for pixel_values, labels in batches(id_train_data, "id_train_data"):
            if labels is None:
                raise ValueError("fit_fisher needs labels: pass (pixel_values, labels) batches of ID training data")
            gradient = self._feature_gradient(self._check_pixel_values(pixel_values), labels)[1]
            batch_sum = diagonal_fisher_sum(gradient.flatten(1))
            total = batch_sum if total is None else total + batch_sum
            count += gradient.shape[0]
        if count < 2:
            raise ValueError(f"fit_fisher needs at least 2 ID training samples, got {count}")
        self.fisher_diagonal = total / count
        return self.fisher_diagonal


def _classifier_loss(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """Cross-entropy of the base logits ``(B, K)`` against ``labels`` ``(B,)``; ``None`` without labels."""
    if labels is None:
        return None
    return nn.functional.cross_entropy(logits.detach(), labels.to(logits.device).long())
