"""The settings of every detector: one config hierarchy, like PEFT's ``PeftConfigMixin`` -> ``PeftConfig`` ->
``LoraConfig``.

:class:`DetectorConfig` is the base: the type field ``method`` (a class attribute of each method's config class,
like PEFT's ``peft_type``), the fitted ``threshold`` with its ``calibration`` record, and a *reference* to the base
model (name or path and revision) instead of the base model's own config. Each method has its own subclass whose
dataclass fields are its settings: :class:`GSCConfig` for GSC, written here; every other method's class is written in
the method's own file (``KNNConfig`` in :mod:`hf_gsc.detectors.knn`), so that a method stays one file. Each setting is
declared with :func:`setting`: a type, a default, a check and a help string that names the authors' default and its
source (``metadata["help"]``, collected into the class docstring, so ``help(KNNConfig)`` lists them). Every field is
validated on every assignment by its check (``metadata["check"]``) and has one *kind* (its ``metadata["kind"]``):

* ``setting``: chosen by the user, part of what makes two detectors the same method (CLI options,
  cache fingerprints, the card's configuration table, GSC + ASH, the ablation variants);
* ``fitted``: computed from ID data by ``calibrate`` / ``calibrate_gradient_mass`` (``threshold``,
  ``calibration``, GSC's ``gradient_mass``);
* ``provenance``: where the detector came from (base model reference and revision, hf_gsc version).

Every list of fields elsewhere is derived from these kinds (:meth:`DetectorConfig.names`), never written by hand.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, Callable, ClassVar

from ..utils.version import __version__
from ..utils.feature_shapings import feature_shaping
from ..utils.scores import SCORES
from ..gsc_math.shortcircuit import APPROXIMATIONS, MASK_SIZES, OPERATIONS, SELECTIONS
from ..classifier.split_points import validate_split_point_name

#: The saved detector's settings, for every method (its ``method`` field says which); see :mod:`hf_gsc.storage.saved_format`.
CONFIG_NAME = "detector_config.json"
#: The settings file of GSC detectors saved before every method shared :data:`CONFIG_NAME`; still read.
LEGACY_GSC_CONFIG_NAME = "gsc_config.json"
# Fitted tensors of a detector (GSC options or baselines), next to its config; safetensors, never pickle.
STATE_FILE = "detector_state.safetensors"

SETTING, FITTED, PROVENANCE = "setting", "fitted", "provenance"
KINDS = (SETTING, FITTED, PROVENANCE)


def number_check(low: float, high: float, low_open: bool = False, optional: bool = False) -> Callable[[str, Any], Any]:
    """A field check: a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``; ``None`` too with
    ``optional``), returned as a float (1 and 1.0 are one setting)."""
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        if value < low or value > high or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value!r}")
        return float(value)  # 1 and 1.0 are one setting (saved, compared and fingerprinted alike)

    return check


def integer_check(low: int, optional: bool = False) -> Callable[[str, Any], Any]:
    """A field check: an ``int`` (not a bool) ``>= low`` (``None`` too with ``optional``)."""
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}{' or None' if optional else ''}, got {value!r}")
        return value

    return check


def choice_check(choices: tuple[str, ...]) -> Callable[[str, Any], Any]:
    """A field check: one of ``choices``."""
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value

    return check


def bool_check(name: str, value: Any) -> Any:
    """A field check: ``True`` or ``False`` (not 1, 0 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def split_point_check(optional: bool = False) -> Callable[[str, Any], Any]:
    """A field check: a split point name (:func:`hf_gsc.classifier.split_points.validate_split_point_name`; ``None`` too with
    ``optional``). Whether the model has it is checked when a detector is built on the model."""
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return None
        validate_split_point_name(value)
        return value

    return check


def feature_shaping_check(name: str, value: Any) -> Any:
    """A field check: ``"none"`` or a registered feature shaping (:mod:`hf_gsc.utils.feature_shapings`)."""
    if value != "none":
        try:
            feature_shaping(value)
        except ValueError as error:
            raise ValueError(f"{name}{str(error).removeprefix('feature_shaping')}") from None
    return value


def _optional_string(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{name} must be a string or None, got {value!r}")
    return value


def _threshold(name: str, value: Any) -> Any:
    return None if value is None else float(number_check(-math.inf, math.inf)(name, value))


def _seed(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _calibration(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or None, got {type(value).__name__}")
    return value


def _field(default: Any, kind: str, check: Callable[[str, Any], Any], help: str) -> Any:
    # A list default gets a fresh copy per config (a dataclass refuses a shared mutable default).
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"kind": kind, "check": check, "help": help})
    return field(default=default, metadata={"kind": kind, "check": check, "help": help})


def setting(default: Any, check: Callable[[str, Any], Any], help: str) -> Any:
    """A setting field of a method's config class (PEFT's ``field(default=..., metadata={"help": ...})``): its
    ``default``, the ``check`` run on every assignment (``check(name, value)`` returns the value to store or raises
    ``ValueError`` saying what was expected) and a ``help`` string that names the authors' default and its source."""
    return _field(default, SETTING, check, help)


def fitted(default: Any, check: Callable[[str, Any], Any], help: str) -> Any:
    """A field computed from ID data (a threshold, GSC's gradient mass), with its check and help."""
    return _field(default, FITTED, check, help)


def _with_attributes(doc: str | None, entries: Sequence[tuple[str, Any, Any, str]]) -> str:
    """``doc`` with an ``Attributes:`` section (Google style, read by ``help()`` and the API reference) of
    ``(name, type, default, help)`` entries, indented as the docstring's own lines."""
    doc = (doc or "").rstrip()
    if not entries:
        return doc
    body = [line for line in doc.splitlines()[1:] if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in body), default=0) * " "
    lines = [f"{indent}    {name} ({kind}): {help} Default: ``{default!r}``." for name, kind, default, help in entries]
    return f"{doc}\n\n{indent}Attributes:\n" + "\n".join(lines) + f"\n{indent}"


def _default_of(spec: Field) -> Any:
    return spec.default if spec.default is not MISSING else spec.default_factory()


def _documented_fields(cls: type) -> list[tuple[str, Any, Any, str]]:
    """``(name, type, default, help)`` of the fields a config class's docstring lists: its bases' fields beyond the
    common ones of :class:`DetectorConfig`, then its own (read before ``@dataclass`` runs: the class body's ``Field``
    objects; a field redeclared with another default keeps its place)."""
    common = {spec.name for spec in fields(DetectorConfig)}
    entries: dict[str, tuple[str, Any, Any, str]] = {}
    for base in cls.__mro__[:0:-1]:
        if is_dataclass(base):
            for spec in fields(base):
                if spec.name not in common:
                    entries[spec.name] = (spec.name, spec.type, _default_of(spec), spec.metadata["help"])
    annotations = cls.__dict__.get("__annotations__", {})
    for name, kind in annotations.items():
        if "ClassVar" in str(kind):
            continue
        spec = cls.__dict__.get(name)
        if not isinstance(spec, Field) or not {"kind", "check", "help"} <= set(spec.metadata):
            raise TypeError(f"{cls.__name__}.{name}: declare each config field with setting(default, check, help) "
                            "(hf_gsc.settings.config), so that it is checked on assignment and documented")
        entries[name] = (name, kind, _default_of(spec), spec.metadata["help"])
    return list(entries.values())


@dataclass
class DetectorConfig:
    """The base of every method's settings (PEFT's ``PeftConfig``): the type field, the fitted threshold with its
    calibration record, and the base-model reference; each method's subclass adds its settings as fields, each
    declared with :func:`setting`.

    Class attributes:
        method: the registered method these settings configure (the saved format's type field); the detector class
            that names this config class as its ``config_class`` takes its ``method`` from here.
        structural_names: settings that decide what a detector built or fitted: assigning one on a detector's config
            asks the detector first, which rebuilds itself or refuses (:func:`bind_config`). ``None`` (the default):
            every setting.
    """

    method: ClassVar[str] = ""
    structural_names: ClassVar[tuple[str, ...] | None] = None

    threshold: float | None = fitted(None, _threshold, "``is_ood = not ood_score >= threshold``; set by ``calibrate`` "
                                                       "on ID validation data.")
    calibration: dict[str, Any] | None = fitted(None, _calibration, "What the threshold was calibrated on "
                                                "(``split``, ``num_samples``, ``tpr``, ``delta``).")
    base_model_name_or_path: str | None = _field(None, PROVENANCE, _optional_string,
                                                 "The base classifier: a Hub id or a local path.")
    base_model_revision: str | None = _field(None, PROVENANCE, _optional_string,
                                             "The base classifier's revision on the Hub (a commit pins it).")
    hf_gsc_version: str = _field(__version__, PROVENANCE, _optional_string, "The hf_gsc version that wrote the config.")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # help(KNNConfig) and the API reference list each field with its type, default and help, written once.
        cls.__doc__ = _with_attributes(cls.__doc__, _documented_fields(cls))

    def __setattr__(self, name: str, value: Any) -> None:
        # The dataclass __init__ assigns through here too, so construction and later assignment
        # (``det.config.mask_ratio = 1.5``) are validated by the same check.
        if name == "method":
            raise AttributeError(f"{type(self).__name__}.method is the method these settings are for; build a "
                                 "detector of another method instead")
        check = _checks_of(type(self)).get(name)
        if check is not None:
            try:
                value = check(name, value)
            except ValueError as error:
                raise ValueError(f"{type(self).__name__}.{error}") from None
        _assign(self, name, value)

    @property
    def hyperparameters(self) -> "ReadOnlyDict":
        """The settings, ``{name: value}`` (read-only): what the saved format, the card and results.json call
        the method's hyperparameters."""
        return ReadOnlyDict({name: getattr(self, name) for name in self.setting_names()})

    @classmethod
    def names(cls, *kinds: str) -> tuple[str, ...]:
        """Field names of the given kinds (``"setting"``, ``"fitted"``, ``"provenance"``), in field order."""
        unknown = set(kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"config field kinds are {KINDS}, got {sorted(unknown)}")
        return tuple(f.name for f in fields(cls) if f.metadata["kind"] in kinds)

    @classmethod
    def setting_names(cls) -> tuple[str, ...]:
        return cls.names(SETTING)

    @classmethod
    def score_names(cls) -> tuple[str, ...]:
        """The fields that change ``ood_score``: the settings and fitted values other than ``threshold`` and
        ``calibration`` (which only change ``is_ood``; GSC's ``gradient_mass`` does change it). Score caches are
        fingerprinted on these."""
        return tuple(name for name in cls.names(SETTING, FITTED) if name not in ("threshold", "calibration"))

    @classmethod
    def structural_setting_names(cls) -> tuple[str, ...]:
        """:attr:`structural_names`, every setting where it is ``None``."""
        return cls.setting_names() if cls.structural_names is None else cls.structural_names

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def score_hyperparameters(self) -> dict[str, Any]:
        """``{name: value}`` of every field that changes ``ood_score`` (:meth:`score_names`)."""
        return {name: getattr(self, name) for name in self.score_names()}

    def settings(self) -> dict[str, Any]:
        """``{name: value}`` of the settings only."""
        return dict(self.hyperparameters)

    def to_dict(self) -> dict[str, Any]:
        """Every field and the type field, flat."""
        return {"method": self.method, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str | None = None) -> "DetectorConfig":
        """Build from saved values (fields, flat). Keys unknown to this version are an error, unless the values were
        written by a newer hf_gsc: then they are dropped with a warning naming both versions (as PEFT does)."""
        values = dict(values)
        values.pop("method", None)
        kept = drop_unknown(values, cls.field_names(), values.get("hf_gsc_version"), source or cls.__name__,
                            f"{cls.__name__} fields")
        return cls(**kept)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DetectorConfig":
        """A config saved as a flat JSON object of fields (GSC's ``gsc_config.json``, the format before every
        method shared ``detector_config.json``)."""
        return cls.from_dict(read_json_object(path, f"{cls.__name__} fields"), source=str(path))


DetectorConfig.__doc__ = _with_attributes(DetectorConfig.__doc__, [
    (spec.name, spec.type, _default_of(spec), spec.metadata["help"]) for spec in fields(DetectorConfig)])


_CHECKS: dict[type, dict[str, Callable[[str, Any], Any]]] = {}


def _checks_of(cls: type) -> dict[str, Callable[[str, Any], Any]]:
    """``field name -> check`` of a config class (built once per class)."""
    checks = _CHECKS.get(cls)
    if checks is None:
        checks = _CHECKS[cls] = {f.name: f.metadata["check"] for f in fields(cls)}
    return checks


def drop_unknown(values: Mapping[str, Any], known: set[str] | Sequence[str], version: Any, source: str,
                 what: str) -> dict[str, Any]:
    """``values`` without the keys this hf_gsc does not know. Unknown keys are an error naming them and the known
    ones, unless ``version`` (the hf_gsc that wrote them) is newer than this one: then they are dropped with a
    warning naming both versions (as PEFT does)."""
    unknown = sorted(set(values) - set(known))
    if not unknown:
        return dict(values)
    if not _is_newer(version):
        raise ValueError(f"{source}: unknown {what} {unknown} (written by hf_gsc {version}); known: {sorted(known)}")
    warnings.warn(
        f"{source} was written by hf_gsc {version}, newer than the installed hf_gsc {__version__}; ignoring the "
        f"{what} this version does not know: {unknown}. Upgrade hf_gsc to use them.",
        stacklevel=3,
    )
    return {key: value for key, value in values.items() if key not in unknown}


#: The smallest temperature any method accepts: ``logits / T`` overflows float32 (NaN or infinite scores) from about
#: ``T < 1e-37``; 1e-3 is far from that and below any temperature in use (already a hard max for ordinary logits).
MIN_TEMPERATURE = 1e-3


@dataclass
class GSCConfig(DetectorConfig):
    """Settings of Gradient Short-Circuit (paper Algorithm 1) and its fitted gradient mass, on the common fields of
    :class:`DetectorConfig` (threshold, calibration, base-model reference). The paper's values are the defaults;
    settings marked "beyond the paper" are this library's extensions (docs/gsc.md)."""

    split_point: str = setting(
        "final_encoder_output", split_point_check(),
        "Where ``F`` is taken: ``\"final_encoder_output\"`` (before the final LayerNorm / pooler; input-dependent "
        "gradients for ViT/Swin/ConvNeXt; the paper's feature), ``\"penultimate\"`` (input of the last "
        "``nn.Linear``; linear head, ``g = W[c]``), or a dotted module path in the base model.")
    earlier_split_point: str | None = setting(
        None, split_point_check(optional=True),
        "Multi-layer short-circuit (beyond the paper): an earlier encoder block (``\"vit.layers.-3\"``) "
        "short-circuited together with ``split_point`` under one shared budget "
        "``k = ceil(mask_ratio * (n_earlier + n_final))``, coordinates ranked by ``|g|`` normalised per layer.")
    mask_ratio: float = setting(
        0.05, number_check(0.0, 1.0),
        "Fraction of the coordinates the head reads (nonzero gradient) to short-circuit; ``k = ceil(mask_ratio * n)`` "
        "per sample (the paper's 5 %). With ``mask_size=\"adaptive\"`` it is the *mean* ratio on ID validation data "
        "that ``calibrate_gradient_mass`` targets.")
    mask_size: str = setting(
        "fixed", choice_check(MASK_SIZES),
        "``fixed`` (``k`` from ``mask_ratio``, the paper) or ``adaptive`` (per sample, the smallest ``k`` whose "
        "top-``k`` ``|g|`` hold ``gradient_mass`` of the total; beyond the paper).")
    gradient_mass: float | None = fitted(
        None, number_check(0.0, 1.0, optional=True),
        "The mass fraction of ``mask_size=\"adaptive\"``, set by ``calibrate_gradient_mass``.")
    selection: str = setting(
        "gradient", choice_check(SELECTIONS),
        "``gradient`` (largest ``|g|``, the paper), ``fisher`` (largest ``|g_i|/sqrt(lambda_i)``, diagonal Fisher "
        "fitted on ID training data by ``fit_fisher``; beyond the paper), ``random`` or ``reverse`` (ablation "
        "controls).")
    operation: str = setting(
        "zero", choice_check(OPERATIONS),
        "On the masked coordinates: ``zero`` (the paper) | ``perturb`` (``F - alpha*sign(g)``) | ``project`` (remove "
        "the component along ``g``) | ``clip`` (to ``[-clip_bound, clip_bound]``) | ``scale`` (``beta * F``).")
    alpha: float = setting(0.1, number_check(0.0, math.inf),
                           "Step of ``operation=\"perturb\"``; the paper's \"small scaling factor\" ``alpha`` has no "
                           "value given, 0.1 is this library's.")
    clip_bound: float = setting(1.0, number_check(0.0, math.inf),
                                "Bound of ``operation=\"clip\"`` (an ablation beyond the paper; 1.0 is this library's).")
    beta: float = setting(0.5, number_check(0.0, 1.0),
                          "Factor of ``operation=\"scale\"`` (the paper's partial scaling ``beta < 1``, Appendix "
                          "A.1.2, has no value given; 0.5 is this library's).")
    approximation: str = setting(
        "first_order", choice_check(APPROXIMATIONS),
        "``first_order`` (``y + J(F'-F)`` for all K logits, one Jacobian-vector product), ``predicted_logit`` (only "
        "``y_c`` moves by ``g.(F'-F)``, the paper's O(d) update) or ``exact`` (a second pass through the head only).")
    score: str = setting(
        "energy", choice_check(SCORES),
        "``energy`` (the paper) | ``msp`` | ``max_logit`` on the short-circuited logits; higher = more ID.")
    temperature: float = setting(1.0, number_check(MIN_TEMPERATURE, math.inf),
                                 "Softmax / energy temperature (the paper's 1).")
    seed: int = setting(0, _seed, "Random source of ``selection=\"random\"`` (an ablation control).")
    feature_shaping: str = setting(
        "none", feature_shaping_check,
        "``none`` (the paper), or a shaping of ``F`` before the gradient is taken, registered by the method that "
        "defines it: ``ash_p`` / ``ash_b`` / ``ash_s`` (ASH), ``scale`` (SCALE); the paper's \"GSC + ASH\" row is "
        "``ash_s`` at the penultimate feature (method ``gsc_ash``). Beyond the paper otherwise.")
    shaping_percentile: float | None = setting(
        None, number_check(0.0, 100.0, optional=True),
        "The shaping's percentile; ``None`` = its authors' value for the architecture.")

    #: Settings that decide what a detector builds (where ``F`` is taken, which backend linearises the head, the
    #: attention kernel): assigning one on a detector's config rebuilds the detector (see :func:`bind_config`).
    structural_names: ClassVar[tuple[str, ...]] = ("split_point", "earlier_split_point", "approximation", "selection",
                                                   "feature_shaping", "shaping_percentile")

    method: ClassVar[str] = "gsc"


def _is_newer(version: Any) -> bool:
    """Whether ``version`` is a valid version string newer than the installed hf_gsc."""
    from packaging.version import InvalidVersion, Version

    try:
        return isinstance(version, str) and Version(version) > Version(__version__)
    except InvalidVersion:
        return False


def read_json_object(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; anything else is a ``ValueError`` naming the file."""
    with open(path) as handle:
        try:
            values = json.load(handle)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} must hold a JSON object of {what}")
    return values


def _assign(config: Any, name: str, value: Any) -> None:
    """Set a checked field; a structural field of a config bound to a detector first asks the detector, which
    rebuilds what depends on it (or refuses, saying why) before the value takes effect."""
    owner = config.__dict__.get("_owner")
    if owner is not None and name in config.structural_setting_names() and name in config.__dict__:
        detector = owner()
        if detector is not None and getattr(config, name) != value:
            detector._rebuild_for(name, value)
    object.__setattr__(config, name, value)


def bind_config(config: Any, detector: Any) -> None:
    """Make ``detector`` rebuild itself when a structural field of ``config`` is assigned (weakly referenced, so the
    config does not keep the detector alive)."""
    import weakref

    object.__setattr__(config, "_owner", weakref.ref(detector))


class ReadOnlyDict(dict):
    """A dict whose items cannot change after construction (a detector was built from them). Unlike
    ``types.MappingProxyType`` it copies and pickles (``copy.deepcopy(detector)``, ``torch.save``)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a detector's hyperparameters are read-only; build a new detector with other values")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self) -> tuple:
        return type(self), (dict(self),)
