"""`Table`, the base of every config table, and `convert`: raw TOML values into tables.

`convert(value, type, prefix)` decodes with msgspec (the units of units.py included) and turns a
failure into a `ConfigError` whose message starts with the key ("delivery.port: expected int,
got str"); `kind(value)` names a value's TOML type, for such messages.
"""

import math
import re
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from .errors import ConfigError
from .units import Duration, FreeSpace, Size, duration, parse_free_space, size


def kind(value: object) -> str:
    """A value's type in TOML words, for messages."""
    return {dict: "table", list: "array"}.get(type(value), type(value).__name__)


# Unit type -> (numbers it takes as is, from a number, from text, what it is for messages).
_UNITS: dict[type, tuple[tuple[type, ...], Callable[[Any], Any], Callable[[str], Any], str]] = {
    Duration: ((int, float), Duration, duration, "a duration"),
    Size: ((int,), Size, size, "a size"),
    FreeSpace: ((int,), lambda n: FreeSpace(nbytes=n), parse_free_space, "a size or percentage"),
}


def _dec_hook(type_: type, value: Any) -> Any:
    """Decode the unit types; a ValueError here becomes a ValidationError with the key path."""
    if type_ not in _UNITS:
        raise NotImplementedError
    numbers, from_number, from_text, what = _UNITS[type_]
    if isinstance(value, str):
        return from_text(value)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and isinstance(value, numbers) and 0 <= value < math.inf:
        return from_number(value)
    raise ValueError(f"expected {what}, got {repr(value) if is_number else kind(value)}")


class Table(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every table: immutable, and a misspelt key is refused rather than ignored."""


_VALIDATION_RE = re.compile(r"(.*) - at `\$(.*)`", re.DOTALL)


def _explain(message: str, type_: Any, prefix: str) -> str:
    """Rewrite a msgspec message ("Expected `int`, got `str` - at `$.delivery.port`") as
    "delivery.port: expected int, got str"."""
    m = _VALIDATION_RE.fullmatch(message)
    problem, where = (m[1], m[2]) if m else (message, "")
    path = prefix + where
    if unknown := re.fullmatch(r"Object contains unknown field `(.*)`", problem):
        path, problem = f"{path}.{unknown[1]}", "unknown key"
    elif missing := re.fullmatch(r"Object missing required field `(.*)`", problem):
        path, problem = f"{path}.{missing[1]}", "required"
    elif enum := re.fullmatch(r"Invalid enum value (.*)", problem):
        for name in where.split(".")[1:]:
            type_ = {f.name: f.type for f in msgspec.structs.fields(type_)}[name]
        problem = f"invalid value {enum[1]} (expected one of {', '.join(typing.get_args(type_))})"
    else:
        problem = problem.replace("`object`", "table").replace("`", "")
        problem = problem[:1].lower() + problem[1:]
    return f"{path.lstrip('.')}: {problem}"


def convert(value: Any, type_: Any, prefix: str = "") -> Any:
    try:
        return msgspec.convert(value, type_, dec_hook=_dec_hook)
    except msgspec.ValidationError as e:
        raise ConfigError(_explain(str(e), type_, prefix)) from None
