"""Byte counts as text and back: ``format_bytes(9.1 * 2**30) == "9.1 GiB"``, ``parse_bytes("80GiB")``."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_SIZE_FORMS = "a size like 80GiB, 80GB, 512MiB or 1.5TiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), or plain bytes"


def format_bytes(size: float) -> str:
    """``size`` in the largest binary unit that keeps it at or above 1 (``"9.1 GiB"``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} B"


def parse_bytes(value: int | str, *, option: str = "budget") -> int:
    """``"80GiB"``, ``"80GB"``, ``"512MiB"``, ``"1.5TiB"`` or plain bytes (``1073741824``) as an int.

    Raises:
        ValueError: ``value`` is none of those forms, or not positive.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
        raise ValueError(f"`{option}` must be positive: {_SIZE_FORMS}; got {value!r}.")
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    unit = match.group(2).lower() if match else ""
    if match is None or (unit and unit not in _UNITS):
        raise ValueError(f"`{option}` must be {_SIZE_FORMS}; got {value!r}.")
    size = int(float(match.group(1)) * _UNITS[unit or "b"])
    if size <= 0:
        raise ValueError(f"`{option}` must be positive: {_SIZE_FORMS}; got {value!r}.")
    return size
