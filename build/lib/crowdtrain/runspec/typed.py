"""JSON values checked against dataclass field types, with errors that name the field.

Used wherever a process reads what another wrote or sent: the join information a volunteer
gets from a coordinator (``crowdtrain.swarm.join_info``), the files the auxiliary peer writes for
the web side (``crowdtrain.runspec.files``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing


def json_type(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)


def matches(value, hint) -> bool:
    """Whether a JSON value fits a dataclass field's type (the types our configs use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    if hint in (dict, list):
        return isinstance(value, hint)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(matches(v, args[0]) for v in value)
        return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    return True  # a type our configs do not use: left to the dataclass


def expected(hint) -> str:
    if hint is float:
        return "a finite number"
    if hint is int:
        return "an integer"
    if hint is bool:
        return "true or false"
    if hint is str:
        return "a string"
    if typing.get_origin(hint) is tuple or hint is list:
        return "a list"
    if hint is dict:
        return "an object"
    return str(hint)


def typed_config(cls, values, field: str):
    """``cls.from_dict(values)`` once every value has its field's JSON type; any error names ``field``."""
    if not isinstance(values, dict):
        raise ValueError(f"{field} must be an object, got a JSON {json_type(values)}")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in values and not matches(values[f.name], hints[f.name]):
            raise ValueError(f"{field}.{f.name} must be {expected(hints[f.name])}, got {values[f.name]!r}"[:300])
    try:
        return cls.from_dict(values)
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from e
