"""Byte quantities as people write them: ``"1.5GiB"``, ``"800MB"``, ``2_000_000``, ``"60%"``."""

from __future__ import annotations

import math
import re

from .errors import BudgetError

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
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str) -> int:
    """Turn ``1.5GiB``, ``"800MB"``, ``"123"`` or an int of bytes into an int of bytes.

    Decimal units (kB, MB, GB) are powers of 1000, binary units (KiB, MiB, GiB) and the bare letters K, M, G are
    powers of 1024. Raises :class:`BudgetError` for anything else, naming the accepted forms.
    """
    if isinstance(value, bool):
        raise BudgetError(f"a byte quantity must be a number or a string like '1.5GiB', not {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise BudgetError(f"a byte quantity must be a positive number of bytes, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise BudgetError(f"a byte quantity must be a number or a string like '1.5GiB', not {type(value).__name__}")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise BudgetError(
            f"cannot read {value!r} as a byte quantity; write e.g. '1.5GiB', '800MB', '512MiB' or a number of bytes"
        )
    amount = float(match.group(1)) * _UNITS[unit]
    if amount <= 0:
        raise BudgetError(f"a byte quantity must be positive, got {value!r}")
    return int(amount)


def resolve_budget(value: int | float | str, reference: int | None = None) -> int:
    """Parse a budget; ``"60%"`` means 60% of ``reference`` (the unoptimized peak of a profile)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        if reference is None:
            raise BudgetError(f"budget {value!r} is a percentage, but there is no unoptimized peak to take it of")
        try:
            pct = float(value.strip()[:-1])
        except ValueError:
            raise BudgetError(f"cannot read {value!r} as a percentage; write e.g. '60%'") from None
        if not 0 < pct <= 1000:
            raise BudgetError(f"a percentage budget must be between 0% and 1000%, got {value!r}")
        return int(reference * pct / 100)
    return parse_bytes(value)


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(1536) == '1.50 KiB'``."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
