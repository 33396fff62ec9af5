"""Validation helpers for config dataclasses: one clear ValueError naming field, value, allowed."""

from __future__ import annotations

from collections.abc import Iterable


def require(ok: bool, field: str, value: object, allowed: str) -> None:
    """Raise ``ValueError("<field>=<value> is invalid: must be <allowed>")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{field}={value!r} is invalid: must be {allowed}")


def positive(field: str, value: float) -> None:
    require(value > 0, field, value, "> 0")


def non_negative(field: str, value: float) -> None:
    require(value >= 0, field, value, ">= 0")


def fraction(field: str, value: float) -> None:
    require(0 < value <= 1, field, value, "in (0, 1]")


def one_of(field: str, value: object, allowed: Iterable[object]) -> None:
    options = list(allowed)
    require(value in options, field, value, "one of " + ", ".join(repr(o) for o in options))
