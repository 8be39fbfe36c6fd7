"""Option checks shared by the strategy, the estimator and the monitor, so that one wrong value reads alike
everywhere: a value of the wrong type is a ``TypeError``, a value out of range a ``ValueError``."""

from __future__ import annotations

from typing import Any

__all__ = ["check_bool", "check_positive_int"]


def check_positive_int(option: str, value: Any, *, accepted: str = "a positive int") -> None:
    """Raises unless ``value`` is an int above 0 (a bool is not); ``accepted`` ends the message's
    "must be ..." where the option takes other values too (``"a positive int or None"``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"`{option}` must be {accepted}; got {value!r} of type {type(value).__name__}.")
    if value <= 0:
        raise ValueError(f"`{option}` must be {accepted}; got {value}.")


def check_bool(option: str, value: Any) -> None:
    """Raises ``TypeError`` unless ``value`` is a bool (not an int, nor the string ``"false"``)."""
    if not isinstance(value, bool):
        raise TypeError(f"`{option}` must be a bool; got {value!r} of type {type(value).__name__}.")
