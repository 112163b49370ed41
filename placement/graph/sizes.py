"""Memory sizes: ``parse_bytes("2GiB")`` and ``format_bytes(1536)``, shared by every layer.

Example:
    >>> parse_bytes("512MiB"), format_bytes(1536)
    (536870912, '1.5 KiB')
"""

from __future__ import annotations

import math
import re

from placement.errors import PlanError

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(spec: int | float | str) -> int:
    """Parse a memory budget: an int (bytes) or ``"2GB"``, ``"512MiB"``, ``"1.5 GB"``.

    KB/MB/GB are powers of 1000, KiB/MiB/GiB powers of 1024 (as in accelerate).

    Raises:
        PlanError: the spec is malformed or negative.

    Example:
        >>> parse_bytes("1.5 GB"), parse_bytes("512MiB"), parse_bytes(1024)
        (1500000000, 536870912, 1024)
    """
    if isinstance(spec, bool):
        raise PlanError(f"not a memory size: {spec!r}")
    if isinstance(spec, (int, float)):
        if spec < 0 or (isinstance(spec, float) and not math.isfinite(spec)):
            raise PlanError(f"memory sizes must be non-negative, got {spec!r}")
        return int(spec)
    if isinstance(spec, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", spec)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise PlanError(f"bad memory size {spec!r}: use bytes or a string like '2GB', '512MiB'")


def format_bytes(n: float | None) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
