"""``GSCDetector`` (alias ``GSCForImageClassification``): any ``transformers`` image classifier with Gradient
Short-Circuit. Its settings, :class:`GSCConfig`, are declared in :mod:`hf_gsc.settings.gsc` (no torch there,
so that the command line reads them at once) and imported here.

Data flow (paper Algorithm 1)::

    pixel_values -> backbone up to the split point (no gradient) -> F -> head(F) = logits y
    g = d y_c / dF                  through the head only, c = argmax y
    mask = top-k |g|, F' = S(F, g)  (hf_gsc.gsc_math.shortcircuit)
    gsc_logits = y + J(F' - F) | y_c + g.(F' - F) | head(F')
    ood_score = score(gsc_logits)   higher = more in-distribution; is_ood = not ood_score >= threshold (NaN: OOD)

How ``F`` is taken and the head linearised is the backend's job (:mod:`hf_gsc.gsc_math.backends`, chosen once at
construction); everything after that is :func:`hf_gsc.gsc_math.step.gsc_step`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..classifier.split_points import SplitPoint
from ..gsc_math.backends import Backend, Linearization, select_backend
from ..gsc_math.backends.shaped import shaped_backend
from ..gsc_math.explanation import GSCExplanation, explain_short_circuit
from ..gsc_math.shortcircuit import diagonal_fisher_sum, gradient_mass_for_mean_ratio
from ..gsc_math.step import GSCStep, gsc_step, ranking_gradient
from ..settings.config import DetectorConfig
from ..settings.gsc import GSCConfig
from ..utils.feature_shapings import feature_shaping
from ..utils.inputs import fail_closed
from .backbone_pass import BackbonePass, FitShards
from .interface import OODDetector, OODDetectorOutput, check_state, classifier_loss, register_detector


@dataclass
class GSCOutput(OODDetectorOutput):
    """Output of :class:`GSCDetector`: every detector's fields (:class:`hf_gsc.OODDetectorOutput`) first, then
    GSC's own, so that ``Trainer.predict`` gives ``(logits, ood_score, is_ood, p_value, gsc_logits, predicted_class)``
    once calibrated (``(logits, ood_score, gsc_logits, predicted_class)`` before), the first fields in the positions
    of every method.

    Attributes:
        loss: ``()`` cross-entropy of ``logits`` against ``labels`` when labels are given (what ``Trainer.predict``
            expects of a classifier; GSC itself has no loss).
        logits: ``(B, K)`` the base model's logits, unchanged (in float32 for a bf16 / fp16 model, as every output:
            the step after the backbone runs in float32, see :mod:`hf_gsc.gsc_math.step`).
        ood_score: ``(B,)`` score of ``gsc_logits``; higher = more in-distribution.
        is_ood: ``(B,)`` bool, ``not ood_score >= threshold``; ``None`` while no threshold is set.
        p_value: ``(B,)`` float64 conformal p-value of ``ood_score`` (:attr:`hf_gsc.OODDetectorOutput.p_value`).
        gsc_logits: ``(B, K)`` logits after the short-circuit.
        predicted_class: ``(B,)`` ``argmax logits``, the class whose gradient selects the mask.
        features: ``(B, *feature_shape)`` ``F`` (only with ``output_short_circuit=True``).
        gradient: ``(B, *feature_shape)`` ``g = d y_c / dF`` (only with ``output_short_circuit=True``).
        mask: ``(B, *feature_shape)`` bool, short-circuited coordinates (only with ``output_short_circuit=True``).
    """

    gsc_logits: torch.Tensor | None = None
    predicted_class: torch.Tensor | None = None
    features: torch.Tensor | None = None
    gradient: torch.Tensor | None = None
    mask: torch.Tensor | None = None


class _PerInstance:
    """A read-only attribute computed from the instance, with a fixed value when read on the class."""

    def __init__(self, compute: Any, class_value: Any) -> None:
        self.compute, self.class_value = compute, class_value

    def __get__(self, instance: Any, owner: type) -> Any:
        return self.class_value if instance is None else self.compute(instance)

    def __set__(self, instance: Any, value: Any) -> None:
        raise AttributeError("needs_fit and fit_split of a GSC detector follow its settings")


@register_detector
class GSCDetector(OODDetector):
    """Gradient Short-Circuit (ICCV 2025, Algorithm 1): at the feature ``F`` of the split point, the coordinates with
    the largest ``|d y_c / dF|`` (a fraction ``mask_ratio`` of those the head reads) are short-circuited, the logits
    updated to first order and scored (energy by default).

    Wraps (and owns) a base image classifier; adds GSC logits and OOD scores to its forward.

    The base model is kept in eval mode, its parameters are frozen (``requires_grad=False``) and never
    receive ``.grad``; gradients are taken with respect to ``F`` only, through the head only. One detector may
    be called from several threads at once: a forward registers nothing on the model and keeps no state.

    Assigning a setting that decides what is built (``split_point``, ``earlier_split_point``, ``approximation``,
    ``selection``, ``feature_shaping``, ``shaping_percentile``) on ``config`` rebuilds the detector before it next
    scores or saves, so the detector in memory and the one it saves always score the same; a fitted diagonal Fisher
    belongs to its split point, so changing that is refused (and the assignment undone).

    ``GSCForImageClassification`` is the same class under the name of transformers' ``*ForImageClassification``
    models.

    Args:
        model: a ``*ForImageClassification`` model returning ``.logits``.
        config: the GSC settings; ``None`` means defaults.
        **overrides: ``GSCConfig`` fields replacing those of ``config`` (e.g. ``mask_ratio=0.1``).
    """

    search_space = {"mask_ratio": (0.01, 0.05, 0.1, 0.2)}
    search_space_source = "not in OpenOOD: the mask ratio around the paper's default 0.05"
    config_class = GSCConfig
    card_tags = ("gradient-short-circuit",)
    in_default_table = True
    state_names = ("fisher_diagonal",)

    def __init__(self, model: nn.Module, config: GSCConfig | None = None, **overrides: Any) -> None:
        super().__init__(model, config, **overrides)
        # (d,) diagonal Fisher of the feature, fitted on ID training data for selection="fisher".
        self.register_buffer("fisher_diagonal", None)
        self._requested_fit: str | None = None  # the kind fit_fisher / calibrate_gradient_mass run
        # How F is taken and the head linearised, for this split point (hf_gsc.gsc_math.backends).
        self.backend: Backend = self._build_backend(self.config)
        self._check_fit_options()

    def __getstate__(self) -> dict[str, Any]:
        # The backend is derived from the model and the config (and may hold closures, e.g. a feature shaping):
        # rebuilt on unpickling (pickle, copy.deepcopy) instead of pickled.
        state = super().__getstate__()
        state["backend"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.backend = self._build_backend(self.config)

    def complete_config(self, model: nn.Module, config: DetectorConfig) -> GSCConfig:
        """A shaping's percentile left ``None`` becomes its authors' value for the architecture (saved with the value
        it used)."""
        assert isinstance(config, GSCConfig)  # made by config_class.from_kwargs
        if config.feature_shaping != "none" and config.shaping_percentile is None:
            config.shaping_percentile = feature_shaping(config.feature_shaping).default_percentile(model)
        return config

    def _check_fit_options(self) -> None:
        if self.config.selection == "fisher" and self.config.mask_size == "adaptive" and self.config.gradient_mass is None:
            raise ValueError("selection='fisher' (fit on train) and mask_size='adaptive' (fit on validation) "
                             "cannot be fitted together; set gradient_mass explicitly for one of them")

    def rebuild(self, changed: dict[str, tuple[Any, Any]]) -> None:
        """Rebuild the backend for the structural settings assigned since it was built (an invalid value raises
        here, and :meth:`check_config` undoes the assignment)."""
        moved = sorted({"split_point", "earlier_split_point"} & set(changed))
        if moved and self.fisher_diagonal is not None:
            raise ValueError(
                f"{type(self).__name__}.config.{moved[0]}: the fitted fisher_diagonal belongs to the split point it "
                "was fitted at, so the assignment is undone; build a new detector with the new setting and fit it"
            )
        self.backend = self._build_backend(self.config)

    def _build_backend(self, config: GSCConfig) -> Backend:
        """How ``F`` is taken and the head linearised (:func:`hf_gsc.gsc_math.backends.select_backend`), with ``F`` shaped
        first when ``feature_shaping`` names a shaping."""
        if config.feature_shaping != "none" and config.earlier_split_point is not None:
            raise ValueError("feature_shaping shapes one feature: it cannot be combined with earlier_split_point")
        backend = select_backend(self.model, config)
        if config.feature_shaping == "none":
            return backend
        return shaped_backend(backend, self.model, config.feature_shaping, config.shaping_percentile)

    @property
    def split_point(self) -> SplitPoint:
        """The resolved split point where ``F`` is taken."""
        return self.backend.split_point

    def feature_splits(self) -> tuple[SplitPoint, ...]:
        return (self.backend.feature_split,)

    def check_ready(self) -> None:
        self.check_config()
        config = self.config
        if config.selection == "fisher" and self.fisher_diagonal is None:
            raise RuntimeError("selection='fisher' needs a fitted diagonal Fisher: call fit_fisher(id_train_batches)")
        if config.mask_size == "adaptive" and config.gradient_mass is None:
            raise RuntimeError(
                "mask_size='adaptive' needs gradient_mass: call calibrate_gradient_mass(id_validation_batches)"
            )

    # ------------------------------------------------------------------ fitted state
    def fitted_state(self) -> dict[str, torch.Tensor]:
        """Fitted tensors: ``fisher_diagonal`` ``(d,)`` and ``gradient_mass`` ``()`` when set."""
        state = {}
        if self.fisher_diagonal is not None:
            state["fisher_diagonal"] = self.fisher_diagonal
        if self.config.gradient_mass is not None:
            state["gradient_mass"] = torch.tensor(self.config.gradient_mass, dtype=torch.float64)
        return state

    def load_fitted_state(self, state: dict[str, torch.Tensor], source: str = "the saved state") -> None:
        """Put saved ``fisher_diagonal`` / ``gradient_mass`` in place after checking them (shape against this model's
        feature, finite, non-negative); a wrong one is a ``ValueError`` naming it and ``source``."""
        fisher = state.get("fisher_diagonal")
        if fisher is not None:
            check_state(self.method, {"fisher_diagonal": fisher}, {"fisher_diagonal": (None,)}, str(source))
            if (fisher < 0).any():
                raise ValueError(f"gsc: fitted tensor 'fisher_diagonal' in {source} holds negative values; a diagonal "
                                 "Fisher is a mean of squares, fit it again")
            expected = self.feature_size()
            if expected is not None and fisher.numel() != expected:
                raise ValueError(
                    f"gsc: fitted tensor 'fisher_diagonal' in {source} has shape {tuple(fisher.shape)}, expected "
                    f"({expected},): the feature at split_point={self.config.split_point!r} of this base model has "
                    f"{expected} coordinates; it was fitted for another model or split point"
                )
            per_position = self._feature_values_per_position() if expected is None else None
            if per_position is not None and fisher.numel() % per_position:
                raise ValueError(
                    f"gsc: fitted tensor 'fisher_diagonal' in {source} has shape {tuple(fisher.shape)}, but the feature "
                    f"at split_point={self.config.split_point!r} of this base model has {per_position} values per "
                    "spatial position, so its length must be a multiple of that; it was fitted for another model or "
                    "split point"
                )
            self.fisher_diagonal = fisher.to(self.device)
        if self.config.selection == "fisher" and fisher is None and self.fisher_diagonal is None:
            raise ValueError(f"gsc: fitted tensor 'fisher_diagonal' is missing from {source}; selection='fisher' needs "
                             "it: fit it with fit_fisher(id_train_batches) and save again")
        mass = state.get("gradient_mass")
        if mass is not None:
            if mass.numel() != 1:
                raise ValueError(f"gsc: fitted tensor 'gradient_mass' in {source} must be one number, got shape "
                                 f"{tuple(mass.shape)}")
            try:
                self.config.gradient_mass = float(mass)
            except ValueError as error:
                raise ValueError(f"gsc: fitted tensor 'gradient_mass' in {source}: {error}") from None
        self.fitted = True

    def feature_size(self) -> int | None:
        """Number of coordinates of ``F`` (what ``fisher_diagonal`` covers), from one backbone pass of two blank
        images at the base model's ``config.image_size``, else at the size its image processor makes (a ResNet's
        config fixes no size); ``None`` where neither fixes it."""
        size = self._expected_size or self._processor_size()
        if size is None:
            return None
        channels = self._expected_channels or 3
        blank = torch.zeros(2, channels, *size, dtype=self.dtype, device=self.device)
        return self.backend.features_of(self.backbone_pass(blank, logits=False))[0].numel()

    def _feature_values_per_position(self) -> int | None:
        """Where no input size is fixed (a ResNet saved without an image processor): the product of the dimensions of
        ``F`` that do not change with the input size (a convolutional map's channels), from passes of blank images at
        two sizes, so that a ``fisher_diagonal`` of another model can be refused at load; the exact length is checked
        at the first forward. ``None`` where the probe cannot run."""
        channels = self._expected_channels or 3
        shapes = []
        for side in (32, 64):
            blank = torch.zeros(2, channels, side, side, dtype=self.dtype, device=self.device)
            try:
                shapes.append(tuple(self.backend.features_of(self.backbone_pass(blank, logits=False))[0].shape))
            except Exception:  # noqa: BLE001 - a model that refuses these sizes leaves the check to the first forward
                return None
        if len(shapes[0]) != len(shapes[1]):
            return None
        return math.prod(a for a, b in zip(*shapes) if a == b)

    def _processor_size(self) -> tuple[int, int] | None:
        """``(H, W)`` of what the image processor makes of an image, or ``None`` without a (working) processor."""
        if self.image_processor is None:
            return None
        from PIL import Image

        try:
            pixel_values = self.image_processor(images=Image.new("RGB", (64, 64)), return_tensors="pt")["pixel_values"]
        except Exception:  # noqa: BLE001 - a processor that cannot say its size leaves the check to the first forward
            return None
        return tuple(pixel_values.shape[-2:])

    def _check_fisher(self, features: torch.Tensor) -> None:
        """``fisher_diagonal`` covers every coordinate of ``F`` ``(B, ...)``: a length-1 one would broadcast into
        wrong scores, another length fail deep in the step."""
        fisher = self.fisher_diagonal
        if fisher is not None and fisher.numel() != features[0].numel():
            raise ValueError(
                f"gsc: fitted tensor 'fisher_diagonal' has shape {tuple(fisher.shape)}, but the feature at "
                f"split_point={self.config.split_point!r} has {features[0].numel()} coordinates (shape "
                f"{tuple(features.shape[1:])}) for these inputs: it was fitted for another model, split point or input size; fit it "
                "again (fit_fisher(id_train_batches))"
            )

    # ------------------------------------------------------------------ inference
    def _linearize(self, batch: BackbonePass) -> Linearization:
        """``F`` of a backbone pass and the head linearised on the part of ``F`` it reads. Random selection
        linearises on all of ``F``: it draws one number per coordinate of ``F``, and a seeded ablation must draw the
        same numbers whatever the head reads. Only the first-order update needs ``J t``; otherwise autograd frees
        the head's graph."""
        config = self.config
        return self.backend.linearize(
            batch.pixel_values, features=self.backend.features_of(batch), whole_feature=config.selection == "random",
            keep_graph=config.approximation == "first_order",
        )

    def step(self, batch: BackbonePass) -> tuple[Linearization, GSCStep]:
        """The linearisation and the GSC step (``g``, mask, ``F'``, updated logits, score) of a backbone pass."""
        linearization = self._linearize(batch)  # head linearised at F
        self._check_fisher(linearization.features)
        step = gsc_step(  # g, mask, F' = S(F, g), updated logits, score
            linearization.head,
            linearization.read_part,
            self.config,
            fisher_diagonal=linearization.restrict(self.fisher_diagonal),
            layer_sizes=linearization.layer_sizes,
        )
        return linearization, step

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return self.step(batch)[1].ood_score

    def forward(
        self,
        pixel_values: torch.Tensor,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        output_short_circuit: bool = False,
    ) -> GSCOutput:
        """Score a batch; ``pixel_values, labels, return_dict`` in the positions of every detector's forward
        (:meth:`hf_gsc.OODDetector.forward`), so ``detector(x, y)`` means the same for every method.

        Args:
            pixel_values: ``(B, C, H, W)`` from the base model's image processor.
            labels: ``(B,)`` class indices; only set ``loss``, the base classifier's cross-entropy, so that
                ``Trainer.predict`` keeps them, as with any ``*ForImageClassification`` model.
            return_dict: accepted and ignored (the output is always a :class:`GSCOutput`).
            output_short_circuit: also return ``features``, ``gradient`` and ``mask``.
        Returns:
            :class:`GSCOutput`. Works inside ``torch.no_grad()`` and ``torch.inference_mode()``.
        """
        self.check_ready()
        pixel_values = self._check_pixel_values(pixel_values)
        # The backbone stops at F: the head's logits come from the linearisation.
        return self.output_of(self.backbone_pass(pixel_values, logits=False), labels, output_short_circuit)

    def backbone_pass(self, pixel_values: torch.Tensor, logits: bool = False) -> BackbonePass:
        """GSC reads ``F`` only: the head's logits come from the linearisation, so the backbone stops at ``F``."""
        return super().backbone_pass(pixel_values, logits=False)

    def output_of(
        self, batch: BackbonePass, labels: torch.Tensor | None = None, output_short_circuit: bool = False
    ) -> GSCOutput:
        linearization, step = self.step(batch)
        extra = {}
        if output_short_circuit:
            extra = {
                "features": linearization.features,
                "gradient": linearization.spread(step.gradient),
                "mask": linearization.spread(step.mask),
            }
        ood_score = fail_closed(step.ood_score, batch.nonfinite_marks()).to(self.score_dtype)
        return GSCOutput(
            loss=classifier_loss(step.logits, labels),
            logits=step.logits,
            gsc_logits=step.gsc_logits,
            ood_score=ood_score,
            is_ood=self.decide(ood_score),
            p_value=self.p_value(ood_score),
            predicted_class=step.predicted_class,
            **extra,
        )

    def _feature_gradient(
        self, batch: BackbonePass, labels: torch.Tensor | None = None
    ) -> tuple[Linearization, torch.Tensor]:
        """The linearisation of a batch and its per-sample gradient w.r.t. ``F``, ``(B, *feature_shape)``.

        Without ``labels`` the gradient is ``g = d y_c / dF`` for the predicted class ``c``; with labels it is
        the gradient of the cross-entropy loss, ``softmax(y) - onehot(label)`` pulled back (what the diagonal
        Fisher is made of). Heads are batch-separable, so one product for the whole batch gives every
        per-sample gradient.
        """
        linearization = self._linearize(batch)
        head = linearization.head
        logits = head.logits
        if labels is None:
            assert head.class_gradient is not None  # filled in by LinearizedHead.__post_init__
            gradient = head.class_gradient(logits.argmax(dim=-1))
        else:
            target = nn.functional.one_hot(labels.to(logits.device).long(), logits.shape[-1]).to(logits.dtype)
            gradient = head.vjp(logits.softmax(dim=-1) - target)
        return linearization, linearization.spread(gradient.flatten(1))

    # ------------------------------------------------------------------ fitting (Fisher or gradient mass)
    def _needs_fit(self) -> bool:
        """Plain GSC needs no fitting. ``selection="fisher"`` fits the diagonal Fisher on ID train data,
        ``mask_size="adaptive"`` (without a set ``gradient_mass``) its gradient mass on ID validation data."""
        config = self.config
        return config.selection == "fisher" or (config.mask_size == "adaptive" and config.gradient_mass is None)

    def _fit_split(self) -> str:
        adaptive = self.config.mask_size == "adaptive" and self.config.gradient_mass is None
        return "validation" if adaptive else "train"

    # On the class: plain GSC's values (the registry's view); on a detector: what its settings need.
    needs_fit = _PerInstance(_needs_fit, False)
    fit_split = _PerInstance(_fit_split, "train")

    def fit_begin(self) -> None:
        # fit_fisher / calibrate_gradient_mass ask for their kind whatever the settings; fit() follows the settings.
        self._fit_kind = self._requested_fit or ("fisher" if self.config.selection == "fisher" else "gradient_mass")
        self._fit_sum: torch.Tensor | None = None
        self._fit_count = 0
        self._fit_gradients: list[torch.Tensor] = []

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        if self._fit_kind == "fisher":
            if labels is None:
                raise ValueError("fit_fisher needs labels: pass (pixel_values, labels) batches of ID training data")
            gradient = self._feature_gradient(batch, labels)[1]
            batch_sum = diagonal_fisher_sum(gradient.flatten(1))
            self._fit_sum = batch_sum if self._fit_sum is None else self._fit_sum + batch_sum
            self._fit_count += gradient.shape[0]
        else:
            linearization, gradient = self._feature_gradient(batch)
            self._fit_gradients.append(ranking_gradient(gradient.flatten(1), linearization.layer_sizes))

    def fit_gather(self, shards: FitShards) -> None:
        # The Fisher's running float64 sum and count are reduced (a (d,) sum per process, not the per-sample
        # gradients); the gradient mass's per-sample ranking gradients are gathered in the order of the data.
        if self._fit_kind == "fisher":
            self._fit_sum = shards.sum(self._fit_sum)
            count = shards.sum(torch.tensor(self._fit_count, dtype=torch.long))
            assert count is not None  # every process gave a count
            self._fit_count = int(count)
        else:
            self._fit_gradients = shards.batches(self._fit_gradients)

    def fit_end(self) -> None:
        if self._fit_kind == "fisher":
            if self._fit_count < 2:
                raise ValueError(f"fit_fisher needs at least 2 ID training samples, got {self._fit_count}")
            assert self._fit_sum is not None  # set by the batches counted
            self.fisher_diagonal = self._fit_sum / self._fit_count
        else:
            self.config.gradient_mass = gradient_mass_for_mean_ratio(torch.cat(self._fit_gradients),
                                                                     self.config.mask_ratio)
        self._fit_sum, self._fit_gradients = None, []
        self.fitted = True

    def calibrate_gradient_mass(self, id_validation_data: torch.Tensor | Iterable[Any]) -> float:
        """For ``mask_size="adaptive"``: choose ``gradient_mass`` so that the mean mask ratio ``k/n`` on ID
        validation data equals ``config.mask_ratio`` (bisection; the mean ratio grows with the mass).

        Use ID validation data only. Returns the mass and stores it in ``config.gradient_mass``.
        """
        self._fit_directly("gradient_mass", id_validation_data, "id_validation_data")
        return self.config.gradient_mass

    def fit_fisher(self, id_train_data: Iterable[Any]) -> torch.Tensor:
        """Fit the diagonal Fisher ``lambda_i = E[(d CE(y, label) / dF_i)^2]`` on ID *training* data.

        Args:
            id_train_data: batches of ``(pixel_values, labels)`` (or mappings with ``pixel_values`` and
                ``labels``/``label``), streamed: only the running sum is kept.
        Returns:
            ``(d,)`` float64 ``lambda``, also stored for ``selection="fisher"`` and saved with the detector.
        """
        self._fit_directly("fisher", id_train_data, "id_train_data")
        return self.fisher_diagonal

    def _fit_directly(self, kind: str, data: Any, name: str) -> None:
        from .backbone_pass import fit_from_passes

        self._requested_fit = kind
        try:
            fit_from_passes([self], data, name)
        finally:
            self._requested_fit = None

    # ------------------------------------------------------------------ explanation
    def explain(self, pixel_values: torch.Tensor, top_k: int = 10) -> GSCExplanation:
        """Why each input scored as it did: the predicted class, the score before and after the short-circuit, the
        short-circuited coordinates with each one's contribution ``g_i (F'_i - F_i)`` to the predicted logit (largest
        ``|contribution|`` first, ``top_k`` of them), and, where the head reads ``F`` position by position (pooled
        convolutional maps, token means), a map over positions resized to the input
        (:func:`hf_gsc.gsc_math.explanation.explain_short_circuit`). A first-token head (ViT's CLS) has no map; the
        explanation says so (``head_reads``, ``description``)."""
        self.check_ready()
        pixel_values = self._check_pixel_values(pixel_values)
        linearization, step = self.step(self.backbone_pass(pixel_values))
        features = linearization.features
        spec = self.backend.split_point.head_spec
        if linearization.layer_sizes is not None or (spec is not None and spec.pool == "identity"):
            head_reads = "vector"
        elif spec is not None:
            head_reads = spec.pool
        else:
            head_reads = "map" if features.ndim == 4 else "vector"
        return explain_short_circuit(
            features, linearization.spread(step.gradient), linearization.spread(step.mask), step.logits,
            step.gsc_logits, self.config, head_reads, (pixel_values.shape[-2], pixel_values.shape[-1]), top_k,
        )

#: The name of transformers' ``*ForImageClassification`` models, kept: the same class as :class:`GSCDetector`.
GSCForImageClassification = GSCDetector
