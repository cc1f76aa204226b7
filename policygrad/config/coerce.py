"""Building a config section, or the whole tree, from a YAML mapping: :func:`build_dataclass`.

Each value is coerced to its field's annotated type (``1e3`` to an int, ``"1e-5"`` to a float, a
nested mapping to its section); an unknown key or a value of the wrong type is a
:class:`~policygrad.config.checks.ConfigError` naming the dotted field.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any

from policygrad.config.checks import ConfigError

__all__ = ["build_dataclass", "field_choices"]


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML value to the annotated type, or raise a ConfigError naming ``path``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping of its fields, got {value!r}")
        return build_dataclass(annotation, value, path)
    if origin in (typing.Union, getattr(types, "UnionType", typing.Union)):
        return _coerce_union(path, value, annotation, args)
    if annotation is Any:
        return value
    if annotation is bool:
        return _coerce_bool(path, value)
    if annotation is int:
        return _coerce_int(path, value)
    if annotation is float:
        return _coerce_float(path, value)
    if annotation is str:
        return _coerce_str(path, value)
    if origin in (list, tuple):
        return _coerce_sequence(path, value, origin, args)
    if origin is dict:
        return _coerce_mapping(path, value)
    return value


def _coerce_union(path: str, value: Any, annotation: Any, args: tuple) -> Any:
    """``value`` as the first member of the union ``annotation`` (members ``args``) that takes it."""
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(path, value, arg)
        except ConfigError as e:
            errors.append(str(e))
    raise ConfigError(f"{path}={value!r} has the wrong type ({annotation}): {'; '.join(errors)}")


def _coerce_bool(path: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(f"{path} must be true or false, got {value!r}")


def _coerce_int(path: str, value: Any) -> int:
    """An int; a float with an integer value (``1e3``) becomes one, a bool is refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path} must be an integer, got {value!r}")
    return value


def _coerce_float(path: str, value: Any) -> float:
    """A finite float; an int or a numeric string is converted, a bool is refused."""
    if isinstance(value, str):
        # YAML 1.1 reads a number without a dot in its mantissa (1e-5) as a string.
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{path} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite number, got {value!r}")
    return float(value)


def _coerce_str(path: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path} must be a string, got {value!r}")
    return value


def _coerce_sequence(path: str, value: Any, origin: Any, args: tuple) -> list | tuple:
    """A ``list[X]`` (each item coerced to X) or a ``tuple[X, Y, ...]`` (item i to the i-th type)."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{path} must be a list, got {value!r}")
    if origin is tuple:
        return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    return [_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]


def _coerce_mapping(path: str, value: Any) -> dict:
    """An option mapping: its values have no annotated type, only exponent strings become floats."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must be a mapping, got {value!r}")
    return {key: _yaml_number(item) for key, item in value.items()}


# A number in exponent form without a dot in its mantissa (3e-4), which YAML 1.1 reads as a string.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_number(value: Any) -> Any:
    """``"3e-4"`` -> 3e-4 inside option mappings (``loss.options``, ``advantage.options``), whose
    values have no annotated type to coerce to; every other value is returned unchanged."""
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def build_dataclass(cls, data: dict[str, Any], prefix: str = ""):
    """``cls`` (a config dataclass) from a mapping of its fields, each value coerced to its annotated
    type; ``prefix``: the dotted path of ``cls`` in the tree, named in every error."""
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        where = f"{prefix}." if prefix else ""
        # loss and advantage take the registered loss's or estimator's own options by name
        hint = (
            f" (an option of the chosen function goes in {where}options.{unknown[0]})"
            if "options" in types
            else ""
        )
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}; valid keys here: {', '.join(sorted(types))}{hint}"
        )
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        try:
            kwargs[name] = _coerce(path, value, types[name])
        except ConfigError:
            choices = field_choices(cls, name)
            if not choices:
                raise
            # a field that takes a few named values says those, not its Python annotation
            raise ConfigError(f"{path}={value!r} is not valid; choose {choices}") from None
    return cls(**kwargs)


def field_choices(cls, name: str) -> str:
    """The ``choices`` text of field ``name`` of config dataclass ``cls`` ("" when it has none)."""
    return next((f.metadata.get("choices", "") for f in dataclasses.fields(cls) if f.name == name), "")
