"""What every config section shares: the checks of its numbers and choices, and the flag a field is set by
(pipeline/config.py's sections and pipeline/config_grpo.py's)."""

from __future__ import annotations

import dataclasses
import math
from functools import cache
from typing import Literal, get_args, get_origin, get_type_hints

from pipeline.errors import UserError


def require(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


@cache
def choices(cls: type) -> dict[str, tuple[str, ...]]:
    """The allowed values of each Literal-typed field of a config section, from its type hints."""
    hints = get_type_hints(cls)
    return {f.name: get_args(hints[f.name]) for f in dataclasses.fields(cls) if get_origin(hints[f.name]) is Literal}


@cache
def float_fields(cls: type) -> tuple[str, ...]:
    """The float-typed fields of a config section, from its type hints."""
    hints = get_type_hints(cls)
    return tuple(f.name for f in dataclasses.fields(cls) if hints[f.name] is float)


def in_range(value: float, low: float, high: float, name: str, low_open: bool = False) -> None:
    """A range check naming the flag: [low, high], or (low, high] with low_open."""
    ok = (value > low if low_open else value >= low) and value <= high
    require(ok, f"{flag(name)} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {value:g}")


class Section:
    """A config section: every float field finite and every Literal field's choice checked in one place, then the
    section's own checks (ranges that keep each number from overflowing where it is used)."""

    def __post_init__(self) -> None:
        for key in float_fields(type(self)):
            value = getattr(self, key)
            require(math.isfinite(value), f"{flag(key)} must be a finite number, got {value}")
        for key, allowed in choices(type(self)).items():
            value = getattr(self, key)
            require(value in allowed, f"{flag(key)} must be one of {', '.join(allowed)}, got {value!r}")
        self.check()

    def check(self) -> None:
        """Checks across fields, or of ranges: UserError naming the flag."""
