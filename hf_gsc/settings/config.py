"""The settings of every detector: one config hierarchy, like PEFT's ``PeftConfigMixin`` -> ``PeftConfig`` ->
``LoraConfig``.

:class:`DetectorConfig` is the base: the type field ``method`` (a class attribute of each method's config class,
like PEFT's ``peft_type``), the fitted ``threshold`` with its ``calibration`` record, and a *reference* to the base
model (name or path and revision) instead of the base model's own config. Each method has its own subclass whose
dataclass fields are its settings, written in the method's own file (``KNNConfig`` in :mod:`hf_gsc.detectors.knn`), so that a method stays one file; GSC's, ``GSCConfig``, is in
:mod:`hf_gsc.settings.gsc`, without torch, so that the command line generates its flags at once. Each setting is
declared with :func:`setting`: a type, a default, a check and a help string that names the authors' default and its
source (``metadata["help"]``, collected into the class docstring, so ``help(KNNConfig)`` lists them). Every field is
validated on every assignment by its check (``metadata["check"]``) and has one *kind* (its ``metadata["kind"]``):

* ``setting``: chosen by the user, part of what makes two detectors the same method (CLI options,
  cache fingerprints, the card's configuration table, GSC + ASH, the ablation variants);
* ``fitted``: computed from ID data by ``calibrate`` / ``calibrate_gradient_mass`` (``threshold``,
  ``calibration``, GSC's ``gradient_mass``);
* ``provenance``: where the detector came from (base model reference and revision, hf_gsc version).

Every list of fields elsewhere is derived from these kinds (:meth:`DetectorConfig.names`), never written by hand.

A config is passive: assigning a field only checks and stores the value. The detector that holds it compares its
config with what it was built with before it scores or saves (:meth:`hf_gsc.OODDetector.check_ready`), and
rebuilds, refuses or drops a threshold that no longer applies there. :meth:`DetectorConfig.from_kwargs` is the one
path from keyword arguments to a config (every detector's constructor and ``from_pretrained`` go through it);
:meth:`DetectorConfig.to_dict` / :meth:`DetectorConfig.from_dict` are the one saved form (``detector_config.json``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, NoReturn

from ..classifier.split_point_names import validate_split_point_name
from ..utils.feature_shapings import feature_shaping
from ..utils.version import __version__


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
    """A field check: one of ``choices`` (kept as the check's ``choices`` attribute, which the command line shows)."""
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"{name} must be one of {choices}, got {value!r}")
        return value

    setattr(check, "choices", choices)
    return check


def bool_check(name: str, value: Any) -> Any:
    """A field check: ``True`` or ``False`` (not 1, 0 or a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def split_point_check(optional: bool = False) -> Callable[[str, Any], Any]:
    """A field check: a split point name (:func:`hf_gsc.classifier.split_point_names.validate_split_point_name`; ``None`` too with
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


def _default_of(spec: Field[Any]) -> Any:
    # A field has a default or a default factory, never both (``dataclasses`` refuses that).
    return spec.default_factory() if spec.default_factory is not MISSING else spec.default


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
        declared = cls.__dict__.get(name)
        if not isinstance(declared, Field) or not {"kind", "check", "help"} <= set(declared.metadata):
            raise TypeError(f"{cls.__name__}.{name}: declare each config field with setting(default, check, help) "
                            "(hf_gsc.settings.config), so that it is checked on assignment and documented")
        entries[name] = (name, kind, _default_of(declared), declared.metadata["help"])
    return list(entries.values())


@dataclass
class DetectorConfig:
    """The base of every method's settings (PEFT's ``PeftConfig``): the type field, the fitted threshold with its
    calibration record, and the base-model reference; each method's subclass adds its settings as fields, each
    declared with :func:`setting`.

    Class attributes:
        method: the registered method these settings configure (the saved format's type field); the detector class
            that names this config class as its ``config_class`` takes its ``method`` from here.
        structural_names: settings that decide what a detector built or fitted: when one is assigned on a
            detector's config, the detector rebuilds itself or refuses (undoing the assignment) before it next scores
            or saves (:meth:`hf_gsc.OODDetector.check_ready`). ``None`` (the default): every setting.
    """

    method: ClassVar[str] = ""
    structural_names: ClassVar[tuple[str, ...] | None] = None
    #: How many assignments this config has taken (its construction's included; an instance's own count shadows
    #: this 0): a detector checks its config again only after it changed (:meth:`hf_gsc.OODDetector.check_config`).
    assignments: ClassVar[int] = 0

    threshold: float | None = fitted(None, _threshold, "``is_ood = not ood_score >= threshold``; set by ``calibrate`` "
                                                       "on ID validation data.")
    calibration: dict[str, Any] | None = fitted(None, _calibration, "What the threshold was calibrated on and what "
                                                "it depends on (``source``, ``split``, ``num_samples``, ``tpr``, "
                                                "``delta``, ``settings``, ``fitted_state``).")
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
        object.__setattr__(self, name, value)
        self.__dict__["assignments"] = self.assignments + 1

    @property
    def hyperparameters(self) -> ReadOnlyDict:
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

    @classmethod
    def keyword_names(cls) -> tuple[str, ...]:
        """The keyword arguments :meth:`from_kwargs` takes: every field but ``hf_gsc_version`` (written by the
        library, never chosen): the settings, the fitted values (``threshold``, ``calibration``, GSC's
        ``gradient_mass``) and the base-model reference."""
        return tuple(name for name in cls.names(SETTING, FITTED, PROVENANCE) if name != "hf_gsc_version")

    @classmethod
    def from_kwargs(cls, config: DetectorConfig | None = None, **kwargs: Any) -> DetectorConfig:
        """The one path from keyword arguments to a config: a copy of ``config`` (defaults when ``None``) with
        ``kwargs`` replacing its fields. Every detector's constructor and ``from_pretrained`` build their config
        here, so the same mistakes raise the same exceptions for every method.

        Raises:
            TypeError: ``config`` is not exactly this class, or a keyword is none of :meth:`keyword_names` (the
                message names the nearest one).
            ValueError: a value fails its field's check (the message names the field and what it takes).
        """
        if config is None:
            config = cls()
        elif type(config) is not cls:
            raise TypeError(f"config must be a {cls.__name__} (the settings of method {cls.method!r}), got "
                            f"{type(config).__name__}")
        known = cls.keyword_names()
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            from .registry import suggest_names

            raise TypeError(f"unknown hyperparameters {unknown} for detector {cls.method!r}"
                            f"{suggest_names(unknown, known)}; known: {sorted(known)}")
        return dataclasses.replace(config, **kwargs)

    def score_hyperparameters(self) -> dict[str, Any]:
        """``{name: value}`` of every field that changes ``ood_score`` (:meth:`score_names`)."""
        return {name: getattr(self, name) for name in self.score_names()}

    @classmethod
    def saved_keys(cls) -> tuple[str, ...]:
        """The top-level keys of the saved form (:meth:`to_dict`): the type field, the settings as one object, and
        the common fitted and provenance fields of :class:`DetectorConfig`."""
        return ("method", "hyperparameters", *DetectorConfig.names(FITTED, PROVENANCE))

    def to_dict(self, base: tuple[str | None, str | None] | None = None) -> dict[str, Any]:
        """The saved form, ``detector_config.json`` (PEFT's ``to_dict``): ``method``, ``hyperparameters`` (every
        setting), ``threshold``, ``calibration``, the base-model reference (``base``, ``(name_or_path, revision)``,
        replaces the config's: the repo itself when the base weights are pushed with it) and this hf_gsc's version
        (the one that writes it). A method's own fitted values besides these (GSC's ``gradient_mass``) are saved
        with the fitted tensors, not here."""
        name, revision = base if base is not None else (self.base_model_name_or_path, self.base_model_revision)
        common = {key: getattr(self, key) for key in DetectorConfig.names(FITTED)}
        return {"method": self.method, "hyperparameters": dict(self.hyperparameters), **common,
                "base_model_name_or_path": name, "base_model_revision": revision, "hf_gsc_version": __version__}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str | None = None) -> DetectorConfig:
        """The config a saved form (:meth:`to_dict`) describes, of the class its ``method`` names (on
        :class:`DetectorConfig`, any registered method; on a method's class, that method only). Keys unknown to this
        version are an error, unless a newer hf_gsc wrote them: then they are dropped with a warning naming both
        versions (as PEFT does)."""
        from .registry import detector_class

        source = source or cls.__name__
        method = values.get("method")
        if not isinstance(method, str):
            raise ValueError(f"{source}: 'method' must name a registered detector method, got {method!r}")
        try:
            config_class = detector_class(method).config_class
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None
        if not issubclass(config_class, cls):
            raise ValueError(f"{source} holds {method!r} settings, not {cls.__name__}")
        version = values.get("hf_gsc_version")
        values = drop_unknown(values, cls.saved_keys(), version, source, "keys")
        hyperparameters = values.get("hyperparameters") or {}
        if not isinstance(hyperparameters, Mapping):
            raise ValueError(f"{source}: 'hyperparameters' must be a JSON object, got {type(hyperparameters).__name__}")
        common = {key: values[key] for key in cls.saved_keys()[2:] if key in values}
        try:
            # Hyperparameters a newer hf_gsc wrote are dropped with a warning; other unknown ones are an error.
            hyperparameters = drop_unknown(hyperparameters, config_class.setting_names(), version, source,
                                           f"{method} hyperparameters")
            return config_class(**hyperparameters, **common)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> DetectorConfig:
        """A config saved as a flat JSON object of fields (GSC's ``gsc_config.json``, the format before every
        method shared ``detector_config.json``); still read."""
        values = read_json_object(path, f"{cls.__name__} fields")
        values.pop("method", None)
        kept = drop_unknown(values, cls.field_names(), values.get("hf_gsc_version"), str(path), f"{cls.__name__} fields")
        return cls(**kept)


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


def _is_newer(version: Any) -> bool:
    """Whether ``version`` is a valid version string newer than the installed hf_gsc."""
    from packaging.version import InvalidVersion, Version

    try:
        return isinstance(version, str) and Version(version) > Version(__version__)
    except InvalidVersion:
        return False


#: The largest JSON file hf_gsc reads as a config or results (a detector's config is a few KB, results a few MB).
MAX_JSON_BYTES = 64 * 2**20


def read_json_object(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The JSON object in ``path``; anything else (not JSON, not an object, nested too deeply, larger than
    :data:`MAX_JSON_BYTES`) is a ``ValueError`` naming the file."""
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path} is {size} bytes, more than the {MAX_JSON_BYTES} a file of {what} may be")
    with open(path, "rb") as handle:
        return parse_json_object(handle.read(), path, what)


def parse_json_object(text: str | bytes, source: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The JSON object in ``text`` (read from ``source``); anything else is a ``ValueError`` naming ``source``."""
    try:
        values = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{source} is not valid JSON: {error}") from None
    except RecursionError:
        raise ValueError(f"{source} is nested too deeply to be {what}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{source} must hold a JSON object of {what}")
    return values


class ReadOnlyDict(dict[str, Any]):
    """A dict whose items cannot change after construction (a detector was built from them). Unlike
    ``types.MappingProxyType`` it copies and pickles (``copy.deepcopy(detector)``, ``torch.save``)."""

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("a detector's hyperparameters are read-only; build a new detector with other values")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __reduce__(self) -> tuple[type[ReadOnlyDict], tuple[dict[str, Any]]]:
        return type(self), (dict(self),)
