"""The rules of a configuration's numeric fields, checked before any other rule reads
them: every int field of a config dataclass has a ``Size`` in its ``SIZES`` (least value,
what it counts, what None means), every float field must hold a number. A wrong type or
range is a ConfigError naming the field and the value to pass instead."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from fxmeg.errors import ConfigError


class Size(NamedTuple):
    """The rule of one integer field: its least value, what it counts and, for a field
    typed ``int | None``, what None means (the words of the error messages)."""

    minimum: int
    what: str
    none: str = ""


def check_size(name: str, value: object, size: Size) -> None:
    """Refuse ``value`` for the integer field ``name`` unless it is an int of at least
    ``size.minimum`` (or None where the field allows it). bool, float and str are refused
    too: True is an int to Python, but not a size; '2' and 2.0 are near misses the
    message corrects."""
    if value is None and size.none:
        return
    unset = f", or None ({size.none})" if size.none else ""
    if type(value) is not int:
        raise ConfigError(
            f"{name}={value!r}: {size.what} must be an int, got {type(value).__name__} "
            f"{value!r}; pass {name}={_meant(value, size)}{unset}"
        )
    if value < size.minimum:
        rule = "a positive integer" if size.minimum == 1 else f"an integer >= {size.minimum}"
        raise ConfigError(
            f"{name}={value}: {size.what} must be {rule} (got {value}); "
            f"pass {name}={size.minimum} or more{unset}"
        )


def _meant(value: object, size: Size) -> int:
    """The int a mistyped size stands for ('2' -> 2, 2.0 -> 2), else the least valid one."""
    least = max(size.minimum, 1)
    if isinstance(value, bool):
        return least
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return least
    return int(number) if number.is_integer() and number >= size.minimum else least


def check_numbers(owner: object) -> None:
    """Check every int and float field of the dataclass ``owner`` before any rule reads
    it, so a wrong type is a ConfigError naming the field, not a TypeError later: ints
    by their ``Size`` in ``type(owner).SIZES`` (every int field has one), floats by type."""
    sizes = type(owner).SIZES
    for f in dataclasses.fields(owner):
        value, optional = getattr(owner, f.name), f.type.endswith(" | None")
        if f.type in ("int", "int | None"):
            size = sizes.get(f.name)
            assert size is not None, f"{type(owner).__name__}.{f.name} needs a Size in SIZES"
            assert optional == bool(size.none), f"{f.name}: say in its Size what None means"
            check_size(f.name, value, size)
        elif f.type in ("float", "float | None") and not _is_number(value, optional=optional):
            raise ConfigError(
                f"{f.name}={value!r} must be a number, got {type(value).__name__} {value!r}; "
                f"pass {f.name}={_meant_float(value, f.default)}"
            )


def _is_number(value: object, *, optional: bool) -> bool:
    """An int or a float (not a bool), or None where the field allows it."""
    if value is None:
        return optional
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _meant_float(value: object, default: object) -> object:
    """The float a mistyped number stands for ('0.5' -> 0.5), else the field's default."""
    try:
        return float(value) if isinstance(value, str) else default
    except ValueError:
        return default
