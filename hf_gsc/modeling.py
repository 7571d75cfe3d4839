"""``GSCForImageClassification``: any ``transformers`` image classifier with Gradient Short-Circuit.

Data flow (paper Algorithm 1)::

    pixel_values -> backbone up to the split point (no gradient) -> F -> head(F) = logits y
    g = d y_c / dF                  one backward through the head only, c = argmax y
    mask = top-k |g|, F' = S(F, g)  (hf_gsc.shortcircuit)
    gsc_logits = y + J(F' - F) | y_c + g.(F' - F) | head(F')
    ood_score = score(gsc_logits)   higher = more in-distribution; is_ood = ood_score < threshold
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn
from transformers import AutoModelForImageClassification, PreTrainedModel
from transformers.utils import ModelOutput

from .config import CONFIG_NAME, STATE_FILE, GSCConfig
from .scores import ood_score
from .aot_update import UpdatePackage, UpdateSettings, load_or_compile_package, package_key
from .fused_update import UpdateOutput, gsc_update, updated_logits
from .shortcircuit import (
    _as_fraction,
    diagonal_fisher_sum,
    mask_size,
    num_masked,
    num_masked_adaptive,
    short_circuit,
    short_circuit_mask,
)
from .head_derivatives import LinearizedHead, Pool, pool, pool_adjoint
from .split_points import (
    SplitPoint,
    linearize_with_autograd,
    resolve_block_chain,
    resolve_split_point,
    submodule,
)


@dataclass
class GSCOutput(ModelOutput):
    """Output of :class:`GSCForImageClassification`.

    Attributes:
        logits: ``(B, K)`` the base model's logits, unchanged.
        gsc_logits: ``(B, K)`` logits after the short-circuit.
        ood_score: ``(B,)`` score of ``gsc_logits``; higher = more in-distribution.
        is_ood: ``(B,)`` bool, ``ood_score < threshold``; ``None`` while no threshold is set.
        predicted_class: ``(B,)`` ``argmax logits``, the class whose gradient selects the mask.
        features: ``(B, *feature_shape)`` ``F`` (only with ``output_short_circuit=True``).
        gradient: ``(B, *feature_shape)`` ``g = d y_c / dF`` (only with ``output_short_circuit=True``).
        mask: ``(B, *feature_shape)`` bool, short-circuited coordinates (only with ``output_short_circuit=True``).
    """

    logits: torch.Tensor | None = None
    gsc_logits: torch.Tensor | None = None
    ood_score: torch.Tensor | None = None
    is_ood: torch.Tensor | None = None
    predicted_class: torch.Tensor | None = None
    features: torch.Tensor | None = None
    gradient: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # ModelOutput.__post_init__ re-validates the class and re-registers it as a pytree node on every
        # instance (50 µs, 1% of a batch of 16 on the reference ViT). Registration happens once per class
        # (ModelOutput.__init_subclass__), and __setattr__ below has already made every field that is set an
        # item of the mapping, in field order, as the dataclass __init__ assigned them.
        pass

    def __setattr__(self, name: str, value: Any) -> None:
        # ModelOutput.__setattr__, with the field names computed once instead of on every assignment.
        if name in _GSC_OUTPUT_FIELDS and value is not None:
            OrderedDict.__setitem__(self, name, value)
        object.__setattr__(self, name, value)


_GSC_OUTPUT_FIELDS = frozenset(field.name for field in dataclasses.fields(GSCOutput))


@dataclass
class _PerClassTables:
    """``gradient`` ``(K, d)`` and ``mask`` ``(K, d)`` bool of every class, valid while ``key`` matches."""

    key: tuple
    gradient: torch.Tensor
    mask: torch.Tensor


def _split_overrides(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Separate ``GSCConfig`` fields from the keyword arguments meant for the base model loader."""
    names = GSCConfig.field_names()
    return {k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names}


def _load_image_processor(name_or_path: str, model_kwargs: dict[str, Any]) -> Any:
    """The base model's image processor when it has one (PIL backend: no torchvision needed)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(
            name_or_path, revision=model_kwargs.get("revision"), token=model_kwargs.get("token")
        )
    except (OSError, ValueError):
        return None


class GSCForImageClassification(nn.Module):
    """Wraps (and owns) a base image classifier; adds GSC logits and OOD scores to its forward.

    The base model is kept in eval mode, its parameters are frozen (``requires_grad=False``) and never
    receive ``.grad``; gradients are taken with respect to ``F`` only, through the head only.

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
        # Per-class gradients and masks where the head is affine (see _per_class_tables).
        self._tables: _PerClassTables | None = None
        # torch.compile'd hf_gsc.fused_update.gsc_update, or an UpdatePackage, set by compile_update().
        self._compiled_update: Any = None
        self._warned_stale_package = False
        self.model.eval()
        self.model.requires_grad_(False)
        # Read once: transformers' config attribute access is slow enough to show in GSC's per-batch cost.
        base_config = getattr(model, "config", None)
        self._expected_channels: int | None = getattr(base_config, "num_channels", None)
        # pixel_values take the dtype of the first parameter (the embeddings'): its module and name are found
        # once; next(model.parameters()) walks the module tree on every batch.
        self._first_parameter: tuple[nn.Module, str] | None = next(
            ((module, name) for module in model.modules() for name, p in module._parameters.items() if p is not None),
            None,
        )
        image_size = getattr(base_config, "image_size", None)
        self._expected_size: tuple[int, int] | None = (
            None if image_size is None
            else tuple(image_size) if isinstance(image_size, (list, tuple)) else (image_size, image_size)
        )
        self.split_point: SplitPoint = resolve_split_point(model, config.split_point)
        # Multi-layer short-circuit: the earlier split point and the blocks from it to the final one.
        self.block_chain = (
            None if config.earlier_split_point is None
            else resolve_block_chain(model, config.earlier_split_point, config.split_point)
        )
        if (
            config.approximation == "first_order"
            and (config.split_point not in ("final_encoder_output", "penultimate") or self.block_chain is not None)
            and getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"
        ):
            # A head made of encoder blocks contains attention; J t there takes a double backward, which the
            # fused SDPA kernels lack. Eager attention computes the same function and has one.
            model.set_attn_implementation("eager")

    # ------------------------------------------------------------------ loading and saving
    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, config: GSCConfig | None = None, **kwargs: Any
    ) -> "GSCForImageClassification":
        """Load a saved detector (folder or Hub repo with ``gsc_config.json``) or wrap any image classifier.

        ``GSCConfig`` fields among ``kwargs`` (``mask_ratio=0.05``, ...) override the config; the rest
        (``revision``, ``token``, ``dtype``, ...) go to ``AutoModelForImageClassification.from_pretrained``.
        A detector's base model comes from the detector folder when it was saved with its weights,
        otherwise from the base-model reference (and revision) in ``gsc_config.json``.
        """
        from .hub import resolve_detector_dir

        overrides, model_kwargs = _split_overrides(kwargs)
        path = os.fspath(pretrained_model_name_or_path)
        detector_dir = None if config is not None else resolve_detector_dir(
            path, model_kwargs.get("revision"), model_kwargs.get("token")
        )
        if detector_dir is not None:
            config = GSCConfig.from_json_file(os.path.join(detector_dir, CONFIG_NAME))
            if os.path.isfile(os.path.join(detector_dir, "config.json")):
                base = detector_dir
                model_kwargs.pop("revision", None)
            else:
                base = config.base_model_name_or_path
                if base is None:
                    raise ValueError(f"{path}/{CONFIG_NAME} names no base model and {path} holds no base weights")
                model_kwargs["revision"] = config.base_model_revision
        else:
            base = path
            config = config or GSCConfig()
            overrides.setdefault("base_model_name_or_path", path)
            overrides.setdefault("base_model_revision", model_kwargs.get("revision"))
        model = AutoModelForImageClassification.from_pretrained(base, **model_kwargs)
        detector = cls(model, config, **overrides)
        detector.image_processor = _load_image_processor(base, model_kwargs)
        if detector_dir is not None:
            detector.load_state_dict_from_dir(detector_dir)
        return detector

    def state_dict_for_saving(self) -> dict[str, torch.Tensor]:
        """Fitted tensors of the detector (the diagonal Fisher when fitted), saved as safetensors."""
        return {} if self.fisher_diagonal is None else {"fisher_diagonal": self.fisher_diagonal}

    def load_state_dict_from_dir(self, directory: str | os.PathLike) -> None:
        """Counterpart of :meth:`state_dict_for_saving`."""
        from safetensors.torch import load_file

        path = os.path.join(directory, STATE_FILE)
        if os.path.isfile(path):
            self.fisher_diagonal = load_file(path).get("fisher_diagonal")

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        save_base_model: bool = False,
        results_dir: str | os.PathLike | None = None,
    ) -> str:
        """Write ``gsc_config.json``, fitted state, a model card, and optionally the base weights and results."""
        from .hub import save_detector

        return str(save_detector(self, save_directory, save_base_model=save_base_model, results_dir=results_dir))

    def push_to_hub(
        self,
        repo_id: str,
        private: bool = False,
        revision: str | None = None,
        token: str | bool | None = None,
        save_base_model: bool = False,
        results_dir: str | os.PathLike | None = None,
        commit_message: str = "Upload GSC detector",
    ) -> str:
        """Upload the detector (as :meth:`save_pretrained` writes it) to ``repo_id``; returns the commit URL."""
        from .hub import push_detector

        return push_detector(self, repo_id, private, revision, token, save_base_model, results_dir, commit_message)

    @property
    def device(self) -> torch.device:
        """The device of the base model's parameters (what ``pixel_values`` are moved to by pipelines)."""
        module, name = self._first_parameter
        return module._parameters[name].device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the base model's first parameter; ``pixel_values`` are cast to it."""
        module, name = self._first_parameter
        return module._parameters[name].dtype

    def train(self, mode: bool = True) -> "GSCForImageClassification":
        """The wrapper may be put in train mode; the base model always stays in eval mode."""
        super().train(mode)
        self.model.eval()
        return self

    # ------------------------------------------------------------------ inference
    def _check_pixel_values(self, pixel_values: Any) -> torch.Tensor:
        if not isinstance(pixel_values, torch.Tensor):
            raise TypeError(f"pixel_values must be a torch.Tensor of shape (B, C, H, W), got {type(pixel_values).__name__}")
        if pixel_values.ndim != 4:
            raise ValueError(f"pixel_values must have shape (B, C, H, W), got shape {tuple(pixel_values.shape)}")
        if pixel_values.shape[0] == 0:
            raise ValueError("pixel_values is an empty batch (B=0); pass at least one image")
        if not pixel_values.is_floating_point():
            raise ValueError(f"pixel_values must be floating point (the image processor's output), got {pixel_values.dtype}")
        channels, expected = self._expected_channels, self._expected_size
        if channels is not None and pixel_values.shape[1] != channels:
            raise ValueError(
                f"pixel_values has {pixel_values.shape[1]} channels but the base model expects {channels}; "
                "convert the images (e.g. grayscale to RGB) with the model's image processor"
            )
        if expected is not None and tuple(pixel_values.shape[2:]) != expected:
            raise ValueError(
                f"pixel_values has spatial size {tuple(pixel_values.shape[2:])} but the base model expects "
                f"{expected}; resize with the model's image processor"
            )
        # The sum of finite values is finite unless it overflows, so one reduction clears the common case.
        if not math.isfinite(pixel_values.sum().item()) and not torch.isfinite(pixel_values).all():
            bad = (~torch.isfinite(pixel_values)).flatten(1).any(dim=1).nonzero().flatten().tolist()
            raise ValueError(f"pixel_values contains NaN or infinite values in batch rows {bad}")
        if self._first_parameter is None:
            return pixel_values
        module, name = self._first_parameter
        return pixel_values.to(module._parameters[name].dtype)

    def _linearize(
        self, pixel_values: torch.Tensor, features: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Pool, LinearizedHead]:
        """``F`` (no gradient, backbone stopped at the split point), the pool ``read`` keeping the part of ``F``
        the head reads, and the head linearized as a function of that part, ``pool(F, read)``.

        ``read`` is ``first_token`` for ViT and DeiT at the final encoder output (only the first token reaches
        the classifier, so masks and updates run on ``(B, D)`` instead of ``(B, N, D)``) and ``identity``
        elsewhere. Random selection keeps ``identity``: it draws one number per coordinate of ``F``, and a
        seeded ablation must draw the same numbers whatever the head reads.

        With ``earlier_split_point`` the feature is the concatenation ``[F_earlier, F_final]`` flattened,
        ``(B, d_earlier + d_final)``, and ``H([F1, F2]) = head(blocks(F1) + F2 - F2_0)``: its gradient
        holds ``d y_c / dF1`` (through the blocks) and ``d y_c / dF2``, and moving both parts moves both layers.

        ``features``: ``F`` when the backbone already ran (single split point only).
        """
        split = self.split_point
        # Only the first-order update needs J t; otherwise autograd may free the head's graph after g.
        keep_graph = self.config.approximation == "first_order"
        if self.block_chain is None:
            features = split.features(pixel_values) if features is None else features
            read = split.read_pool if self.config.selection != "random" else "identity"
            if read != "identity":
                return features, read, split.linearize_read_part(pool(features, read))
            return features, read, split.linearize(features, pixel_values, keep_graph)

        earlier, run_blocks = self.block_chain
        earlier_features = earlier.features(pixel_values)
        with torch.no_grad():
            final_0 = run_blocks(earlier_features)
        shapes = [earlier_features.shape[1:], final_0.shape[1:]]
        self._layer_sizes = sizes = [earlier_features[0].numel(), final_0[0].numel()]

        def joint_head(joint: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
            f1, f2 = joint.split(sizes, dim=1)
            moved = run_blocks(f1.reshape(-1, *shapes[0])) + (f2.reshape(-1, *shapes[1]) - final_0)
            return split.head(moved, pixel_values)

        joint_features = torch.cat([earlier_features.flatten(1), final_0.flatten(1)], dim=1)
        return joint_features, "identity", linearize_with_autograd(joint_head, joint_features, pixel_values, keep_graph)

    def _feature_gradient(
        self, pixel_values: torch.Tensor, labels: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, LinearizedHead, torch.Tensor]:
        """``F``, the linearized head and the per-sample gradient w.r.t. ``F``, ``(B, *feature_shape)``.

        Without ``labels`` the gradient is ``g = d y_c / dF`` for the predicted class ``c``; with labels it is
        the gradient of the cross-entropy loss, ``softmax(y) - onehot(label)`` pulled back (what the diagonal
        Fisher is made of). Heads are batch-separable, so one product for the whole batch gives every
        per-sample gradient.
        """
        features, read, head = self._linearize(pixel_values)
        logits = head.logits
        if labels is None:
            gradient = head.class_gradient(logits.argmax(dim=-1))
        else:
            target = nn.functional.one_hot(labels.to(logits.device).long(), logits.shape[-1]).to(logits.dtype)
            gradient = head.vjp(logits.softmax(dim=-1) - target)
        return features, head, pool_adjoint(gradient, read, features.shape[1:])

    def _selection_gradient(self, gradient: torch.Tensor) -> torch.Tensor:
        """The gradient that ranks coordinates: per-layer RMS-normalised under a shared multi-layer budget
        (raw gradient scales differ between layers), the gradient itself otherwise. ``(B, d) -> (B, d)``."""
        if self.block_chain is None:
            return gradient
        parts = []
        for part in gradient.split(self._layer_sizes, dim=1):
            read = (part != 0).sum(dim=1, keepdim=True).clamp_min(1)
            rms = (part.pow(2).sum(dim=1, keepdim=True) / read).sqrt()
            parts.append(part / rms.clamp_min(torch.finfo(part.dtype).tiny))
        return torch.cat(parts, dim=1)

    def _mask(
        self, flat_gradient: torch.Tensor, read: Pool = "identity", feature_shape: torch.Size | None = None
    ) -> torch.Tensor:
        """The short-circuit mask ``(B, d)`` of the configured size and selection for gradients ``(B, d)``
        taken w.r.t. ``pool(F, read)`` (``F`` of shape ``(B, *feature_shape)``)."""
        config = self.config
        ranking = self._selection_gradient(flat_gradient)
        if config.mask_size == "adaptive":
            k = num_masked_adaptive(ranking, config.gradient_mass)
        else:
            k = num_masked(flat_gradient, config.mask_ratio)
        generator = torch.Generator().manual_seed(config.seed) if config.selection == "random" else None
        fisher = self.fisher_diagonal
        if fisher is not None and read != "identity":
            fisher = pool(fisher.view(1, *feature_shape), read).flatten()
        return short_circuit_mask(ranking, k, config.selection, fisher, generator)

    def _per_class_tables(
        self, head: LinearizedHead, read: Pool, feature_shape: torch.Size
    ) -> "_PerClassTables | None":
        """Gradient and mask of every class, where they depend on the class alone; ``None`` elsewhere.

        With an affine head (ResNet at the final encoder output, any ``penultimate`` split) ``g = d y_c / dF``
        is the classifier row ``W[c]`` pulled back through the pooling, whatever the input, so the mask is a
        function of ``c`` too: both are computed for all ``K`` classes once and looked up per sample. They
        are recomputed when the configuration, the fitted Fisher or the classifier weights change. Random
        selection draws per batch and is never tabulated.
        """
        split = self.split_point
        if self.block_chain is not None or not split.head_is_linear or split.head_spec is None:
            return None
        config = self.config
        if config.selection == "random":
            return None
        weight = submodule(self.model, split.head_spec.classifier).weight
        fisher = self.fisher_diagonal
        key = (
            read, tuple(feature_shape), weight.data_ptr(), weight._version, weight.dtype, weight.device,
            config.mask_ratio, config.mask_size, config.gradient_mass, config.selection,
            None if fisher is None else (fisher.data_ptr(), fisher._version),
        )
        if self._tables is None or self._tables.key != key:
            classes = torch.arange(weight.shape[0], device=weight.device)
            gradient = head.class_gradient(classes).flatten(1)
            self._tables = _PerClassTables(key, gradient, self._mask(gradient, read, feature_shape))
        return self._tables

    def compile_update(
        self,
        ahead_of_time: bool = False,
        package_path: str | os.PathLike | None = None,
        **compile_kwargs: Any,
    ) -> "GSCForImageClassification":
        """Run GSC's per-batch work after the backbone as compiled code instead of eager ops; returns ``self``.

        That work is 25-35 small ops (:func:`hf_gsc.fused_update.gsc_update`); next to a small backbone on a
        CPU their dispatch cost is most of GSC's overhead, and compiled they fuse into a few kernels. The
        results equal the eager path's to float rounding (tested); a batch with a tie across some sample's
        mask cut is recomputed eagerly, which fills ties in index order.

        Two ways to compile:

        * ``ahead_of_time=False`` (default): ``torch.compile``. The first call per batch shape and
          configuration compiles (about 10 s on a CPU), and ``torch.compile`` recompiles when they change;
          past ``torch._dynamo.config.recompile_limit`` (shared by every detector in the process) the same
          function runs eagerly. Each call pays dynamo's guard check and wrappers, which on the ViT reference
          head cost as much as the fusion saves.
        * ``ahead_of_time=True``: ``torch.export`` + AOTInductor, compiled here, now, for the current
          configuration, dtype and device, any batch size (:mod:`hf_gsc.aot_update`; 10-30 s on a CPU). Calls
          run the kernels from C++. ``package_path`` (a ``.pt2`` file) is reused when it was built for the same
          configuration and written otherwise. If the configuration, dtype or device changes afterwards,
          ``forward`` warns once and runs eagerly until ``compile_update`` is called again.

        Both need a C++ compiler for inductor's CPU backend.

        It applies where the head has a registered closed form and ``g`` varies over the coordinates it reads
        (``final_encoder_output`` of ViT, DeiT and Swin), with ``selection="gradient"`` and
        ``mask_size="fixed"``; with other settings, and with ``output_short_circuit=True``, ``forward`` runs
        eagerly. It does not apply where the head is affine (ResNet at ``final_encoder_output``, any
        ``penultimate``: gradients and masks are per-class lookups already), nor where the head averages
        positions before its LayerNorm (ConvNeXt): ``g`` is then equal over the positions of a channel, every
        sample's mask has ties across its cut, and the eager path fills them. The backbone is not compiled
        here (``detector.model.compile()`` does that).

        Args:
            ahead_of_time: compile with AOTInductor now instead of ``torch.compile`` on the first call.
            package_path: ahead of time only: the package file to reuse or write; ``None`` keeps it in memory.
            **compile_kwargs: ``torch.compile`` only (e.g. ``dynamic=False``, ``backend="aot_eager"``).
        Raises:
            ValueError: the head is not one of those, ``earlier_split_point`` is set, the settings are not
                covered (ahead of time), or arguments of the other way are given.
            RuntimeError: ahead of time, the compilation failed (e.g. no C++ compiler).
        """
        split, spec = self.split_point, self.split_point.head_spec
        if self.block_chain is not None:
            raise ValueError("compile_update does not support earlier_split_point; unset it or run eagerly")
        if spec is None:
            reason = "has no registered closed form"
        elif split.head_is_linear:
            reason = "is affine, so its gradients and masks are per-class lookups already"
        elif spec.pool != "first_token" and not spec.norm_before_pool:
            reason = "averages positions before its LayerNorm, so every mask has ties, which only the eager path fills"
        else:
            reason = None
        if reason is not None:
            raise ValueError(
                f"compile_update: the head at split_point={self.config.split_point!r} {reason}; it applies to "
                "split_point='final_encoder_output' of ViT, DeiT and Swin"
            )
        if not ahead_of_time:
            if package_path is not None:
                raise ValueError("compile_update: package_path needs ahead_of_time=True")
            self._compiled_update = torch.compile(gsc_update, **compile_kwargs)
            return self
        if compile_kwargs:
            raise ValueError(
                f"compile_update: {sorted(compile_kwargs)} are torch.compile arguments; they do not apply with "
                "ahead_of_time=True"
            )
        read_part = self._example_read_part()
        head = split.bound_head(on_read_part=True)
        settings = self._update_settings(read_part)
        if settings is None:
            raise ValueError(
                "compile_update(ahead_of_time=True) covers selection='gradient' and mask_size='fixed' with a "
                f"non-empty mask; got selection={self.config.selection!r}, mask_size={self.config.mask_size!r}, "
                f"mask_ratio={self.config.mask_ratio!r}"
            )
        self._compiled_update = load_or_compile_package(read_part, head, settings, package_path)
        self._warned_stale_package = False
        return self

    def _example_read_part(self) -> torch.Tensor:
        """``pool(F, read_pool)`` of two blank images, ``(2, *shape)``: what compiling ahead of time traces. The
        package depends on its shape, dtype and device only (two, not one: a batch of one would be specialised)."""
        module, name = self._first_parameter
        parameter = module._parameters[name]
        height, width = self._expected_size
        blank = parameter.new_zeros(2, self._expected_channels, height, width)
        return pool(self.split_point.features(blank), self.split_point.read_pool)

    def _update_settings(self, read_part: torch.Tensor) -> UpdateSettings | None:
        """The Python-valued arguments of ``gsc_update`` for the current configuration; ``None`` where the compiled
        update does not cover it (random or Fisher selection, adaptive mask size, an empty mask)."""
        config = self.config
        if config.selection != "gradient" or config.mask_size != "fixed":
            return None
        mask_ratio = _as_fraction(float(config.mask_ratio))
        k_bound = mask_size(math.prod(read_part.shape[1:]), *mask_ratio)
        if k_bound == 0:
            return None
        return UpdateSettings(
            mask_ratio, k_bound, config.operation, config.alpha, config.clip_bound, config.beta,
            config.approximation, config.score, config.temperature,
        )

    def _compiled_update_result(self, features: torch.Tensor) -> UpdateOutput | None:
        """The compiled update of ``F`` where it applies to the current configuration, else ``None``."""
        split = self.split_point
        read_part = pool(features, split.read_pool)
        settings = self._update_settings(read_part)
        if settings is None:
            return None
        head = split.bound_head(on_read_part=True)
        compiled = self._compiled_update
        if not isinstance(compiled, UpdatePackage):
            return compiled(read_part, head, *settings)
        if compiled.key != package_key(read_part, head, settings):
            if not self._warned_stale_package:
                warnings.warn(
                    "the update compiled ahead of time was built for another configuration, dtype or device; "
                    "running eagerly. Call compile_update(ahead_of_time=True) again to compile for the current one.",
                    stacklevel=3,
                )
                self._warned_stale_package = True
            return None
        return compiled(read_part, head)

    def _is_ood(self, scores: torch.Tensor) -> torch.Tensor | None:
        """``scores < threshold`` ``(B,)`` bool, or ``None`` while no threshold is set."""
        threshold = self.config.threshold
        return None if threshold is None else scores < threshold

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
            labels, return_dict: accepted and ignored, so that ``Trainer.predict`` and pipelines can call the
                detector like any ``*ForImageClassification`` model (GSC has no loss; the output is always a
                :class:`GSCOutput`).
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
        features = None
        if self._compiled_update is not None and not output_short_circuit:
            features = self.split_point.features(pixel_values)
            update = self._compiled_update_result(features)
            if update is not None and not update.tied:
                return GSCOutput(
                    logits=update.logits,
                    gsc_logits=update.gsc_logits,
                    ood_score=update.ood_score,
                    is_ood=self._is_ood(update.ood_score),
                    predicted_class=update.predicted_class,
                )
            # Settings the compiled update does not cover, or a tie across some sample's cut: the eager path
            # below fills ties in index order. The backbone does not run again.
        features, read, head = self._linearize(pixel_values, features)
        read_features = pool(features, read)
        logits = head.logits
        predicted_class = logits.argmax(dim=-1)
        flat_features = read_features.flatten(1)
        tables = self._per_class_tables(head, read, features.shape[1:])
        if tables is None:
            flat_gradient = head.class_gradient(predicted_class).flatten(1)
            mask = self._mask(flat_gradient, read, features.shape[1:])
        else:
            flat_gradient = tables.gradient.index_select(0, predicted_class)
            mask = tables.mask.index_select(0, predicted_class)
        shorted = short_circuit(
            flat_features, flat_gradient, mask, config.operation, config.alpha, config.clip_bound, config.beta
        )

        gsc_logits = updated_logits(
            head, config.approximation, predicted_class, flat_gradient, flat_features, shorted, read_features.shape
        )

        scores = ood_score(gsc_logits, config.score, config.temperature)
        is_ood = self._is_ood(scores)
        extra = {}
        if output_short_circuit:
            shape = features.shape[1:]
            extra = dict(
                features=features,
                gradient=pool_adjoint(flat_gradient.view_as(read_features), read, shape),
                mask=pool_adjoint(mask.view_as(read_features), read, shape),
            )
        return GSCOutput(
            logits=logits,
            gsc_logits=gsc_logits,
            ood_score=scores,
            is_ood=is_ood,
            predicted_class=predicted_class,
            **extra,
        )

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
        for pixel_values, _ in _batches(id_validation_data, "id_validation_data"):
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
        for pixel_values, _ in _batches(id_validation_data, "id_validation_data"):
            gradient = self._feature_gradient(self._check_pixel_values(pixel_values))[2]
            gradients.append(self._selection_gradient(gradient.flatten(1)))
        gradient = torch.cat(gradients)
        read = (gradient != 0).sum(dim=1).clamp_min(1).double()

        def mean_ratio(mass: float) -> float:
            return float((num_masked_adaptive(gradient, mass) / read).mean())

        low, high = 0.0, 1.0
        for _ in range(40):
            middle = (low + high) / 2
            low, high = (middle, high) if mean_ratio(middle) < self.config.mask_ratio else (low, middle)
        self.config.gradient_mass = high
        return high

    def fit_fisher(self, id_train_data: Iterable[Any]) -> torch.Tensor:
        """Fit the diagonal Fisher ``lambda_i = E[(d CE(y, label) / dF_i)^2]`` on ID *training* data.

        Args:
            id_train_data: batches of ``(pixel_values, labels)`` (or mappings with ``pixel_values`` and
                ``labels``/``label``), streamed: only the running sum is kept.
        Returns:
            ``(d,)`` float64 ``lambda``, also stored for ``selection="fisher"`` and saved with the detector.
        """
        total, count = None, 0
        for pixel_values, labels in _batches(id_train_data, "id_train_data"):
            if labels is None:
                raise ValueError("fit_fisher needs labels: pass (pixel_values, labels) batches of ID training data")
            gradient = self._feature_gradient(self._check_pixel_values(pixel_values), labels)[2]
            batch_sum = diagonal_fisher_sum(gradient.flatten(1))
            total = batch_sum if total is None else total + batch_sum
            count += gradient.shape[0]
        if count < 2:
            raise ValueError(f"fit_fisher needs at least 2 ID training samples, got {count}")
        self.fisher_diagonal = total / count
        return self.fisher_diagonal


def _batches(data: torch.Tensor | Iterable[Any], name: str) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
    """Normalise tensors, ``(pixel_values, labels)`` tuples and mappings into ``(pixel_values, labels)`` batches."""
    if data is None:
        raise TypeError(
            f"{name} is None; pass a (N, C, H, W) tensor of pixel_values or an iterable of batches "
            "(tensors, (pixel_values, labels) tuples or mappings with 'pixel_values')"
        )
    batches = [data] if isinstance(data, torch.Tensor) else data
    seen = False
    for index, batch in enumerate(batches):
        labels = None
        if isinstance(batch, Mapping):
            labels = batch.get("labels", batch.get("label"))
            batch = batch.get("pixel_values")
        elif isinstance(batch, (tuple, list)) and batch:
            batch, labels = batch[0], (batch[1] if len(batch) > 1 else None)
        if not isinstance(batch, torch.Tensor):
            raise TypeError(
                f"{name} batch {index} must be a tensor, a (pixel_values, labels) tuple or a "
                f"mapping with 'pixel_values'; got {type(batch).__name__}"
            )
        seen = True
        yield batch, labels
    if not seen:
        raise ValueError(f"{name} is empty; it must hold at least one batch of images")
