"""The documentation site's two build hooks (``mkdocs.yml``; ``make docs``), both reading the registered methods.

* :func:`on_page_markdown` (an mkdocs hook): the API reference's configs page lists every registered method's config
  class, read from the registry when the site is built, so adding a method (one file) adds its section.
* :class:`ConfigHelp` (a griffe extension): each field of a config class or of the evaluation's arguments documented
  by its help string and shown with its default, read from the imported class (the source declares them as
  ``setting(default, check, help)`` or with ``metadata={"help": ...}``);
  reStructuredText roles in docstrings shown as Markdown code.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from typing import Any

import griffe


MARKER = "<!-- method configs -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    import hf_gsc
    from hf_gsc import DETECTORS

    sections = []
    for method in sorted(DETECTORS):
        config_class = DETECTORS[method].config_class
        if config_class is hf_gsc.GSCConfig:
            continue  # DetectorConfig and GSCConfig have their own sections on the page
        # Settings declared on a shared base (ASHConfig for ash_p/b/s) are listed with each method's class.
        inherited = [spec.name for spec in dataclasses.fields(config_class)
                     if spec.name in config_class.setting_names() and spec.name not in vars(config_class)]
        sections.append(f"### `{method}`\n\n::: {config_class.__module__}.{config_class.__qualname__}\n"
                        f"    options:\n      heading_level: 4\n      inherited_members: {inherited}\n")
    return markdown.replace(MARKER, "\n".join(sections))


class ConfigHelp(griffe.Extension):
    """Every field of a :class:`hf_gsc.DetectorConfig` subclass shown with its help as its docstring and its default
    as its value (``k = 50``, not the ``setting(...)`` call that declares it), read from the imported class; and the
    docstrings' reStructuredText roles (``:class:`X```) as Markdown code, as :mod:`hf_gsc.method_table` writes them."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", obj.docstring.value)

    def on_class(self, *, cls: griffe.Class, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        runtime = getattr(importlib.import_module(cls.module.path), cls.name, None)
        # Config classes and the evaluation's arguments: dataclasses whose fields carry their help in their metadata.
        if not (isinstance(runtime, type) and dataclasses.is_dataclass(runtime)):
            return
        specs = {spec.name: spec for spec in dataclasses.fields(runtime) if "help" in spec.metadata}
        if not specs:
            return
        for name, spec in specs.items():
            member = cls.members.get(name)
            if member is None or member.is_alias:
                continue  # inherited: documented on the class that declares it
            default = _default_of(spec)
            if default is not dataclasses.MISSING:
                member.value = repr(default)
            member.docstring = griffe.Docstring(spec.metadata["help"], parent=member)
        init = cls.members.get("__init__")  # written by griffe's dataclass extension from the fields' source
        if isinstance(init, griffe.Function):
            for parameter in init.parameters:
                if parameter.name in specs and _default_of(specs[parameter.name]) is not dataclasses.MISSING:
                    parameter.default = repr(_default_of(specs[parameter.name]))


def _default_of(spec: dataclasses.Field) -> Any:
    if spec.default is not dataclasses.MISSING:
        return spec.default
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return dataclasses.MISSING
