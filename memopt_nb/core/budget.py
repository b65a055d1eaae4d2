"""Byte quantities as people write them: ``"1.5GiB"``, ``"800MB"``, ``2_000_000``, ``"60%"``."""

from __future__ import annotations

import math
import re
from typing import Any

from .errors import BudgetError

__all__ = ["MAX_BYTES", "MAX_FRACTION_LIKE", "MIN_TYPED_BYTES", "check_typed_budget", "format_bytes", "is_share",
           "parse_bytes", "resolve_budget"]

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


#: The largest byte quantity accepted (1 EiB): anything above is a typo, and must still fit an int64.
MAX_BYTES = 2**60
_HINT = ("write a size like '512MiB', '1.5GiB' or '800MB', a number of bytes, or a share of the unoptimized peak "
         "like '60%'")


def _checked(amount: float | int, value: Any) -> int:
    """``amount`` bytes as an int, refusing what is not finite, not positive, rounds to 0 bytes, or is absurdly big."""
    if isinstance(amount, float) and not math.isfinite(amount):
        raise BudgetError(f"a byte quantity must be a finite number of bytes, got {_show(value)}; {_HINT}")
    if amount <= 0:
        raise BudgetError(f"a byte quantity must be positive, got {_show(value)}; {_HINT}")
    if amount > MAX_BYTES:
        raise BudgetError(f"{_show(value)} is more than 1 EiB, which no device has; {_HINT}")
    n = int(amount)
    if n < 1:
        raise BudgetError(f"{value!r} is less than one byte; {_HINT}")
    return n


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _number(value: Any) -> float | int:
    """A bare number: an int or float, or a string holding one (no unit)."""
    if isinstance(value, (int, float)):
        return value
    match = _PATTERN.match(value)
    if match is None or match.group(2):
        raise ValueError(value)
    return float(match.group(1))


def parse_bytes(value: int | float | str) -> int:
    """Turn ``1.5GiB``, ``"800MB"``, ``"123"`` or an int of bytes into an int of bytes.

    Decimal units (kB, MB, GB) are powers of 1000, binary units (KiB, MiB, GiB) and the bare letters K, M, G are
    powers of 1024. Raises :class:`BudgetError` for anything else, naming the accepted forms: a quantity that is not
    finite, not positive, less than one byte (``0.6`` is refused: it is no size, and :func:`resolve_budget` reads it
    as a share) or more than 1 EiB.
    """
    if isinstance(value, bool):
        raise BudgetError(f"a byte quantity must be a number or a string like '1.5GiB', not {value!r}")
    if isinstance(value, int):
        return _checked(value, value)
    if isinstance(value, float):
        if math.isfinite(value) and 0 < value < 1:
            raise BudgetError(f"{value!r} is less than one byte; {_HINT}")
        return _checked(value, value)
    if not isinstance(value, str):
        raise BudgetError(f"a byte quantity must be a number or a string like '1.5GiB', not {type(value).__name__}")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise BudgetError(f"cannot read {value!r} as a byte quantity; {_HINT}")
    return _checked(float(match.group(1)) * _UNITS[unit], value)


def resolve_budget(value: int | float | str, reference: int | None = None) -> int:
    """Parse a budget into bytes: the one parser the API and the notebook magics share.

    Accepted: a number of bytes (``2_000_000``, ``"2000000"``), a size (``"1.5GiB"``, ``"800MB"``), a percentage of
    ``reference`` (``"60%"``), or a bare fraction strictly between 0 and 1 (``0.6`` or ``"0.6"``), also read as that
    share of ``reference``. ``reference`` is the unoptimized peak of a profile; without it a percentage or a fraction
    is refused, as is anything that comes to less than one byte, is not finite, or exceeds 1 EiB
    (:class:`BudgetError`, naming the forms that work).

    So a plain number is read one way everywhere: below 1 a share, else bytes; a number with a decimal point from 1 to
    :data:`MAX_FRACTION_LIKE` is refused (``1.5`` is 150% written without ``%``), and where a budget is typed (the
    magics) so is a plain number below :data:`MIN_TYPED_BYTES` (:func:`check_typed_budget`: ``60`` is 60% or 60 MiB,
    never 60 bytes).

    A budget counts the bytes of the step's tensors, as the simulator does. On CUDA the caching allocator adds its
    own: blocks rounded up to 512 bytes, and a cached block handed out whole when what is left of it would be under
    1 MiB, which adds a little to a step's peak (``benchmarks/cuda_check.py`` measures how much), depending on what
    earlier work left in the cache; leave a few percent of room below the memory you have.
    """
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1].strip()
        try:
            pct = float(text)
        except ValueError:
            raise BudgetError(f"cannot read {value!r} as a percentage; write e.g. '60%'") from None
        if not 0 < pct <= 1000:  # also refuses nan and inf
            raise BudgetError(f"a percentage budget must be between 0% and 1000%, got {value!r}")
        return _share(value, pct / 100, reference)
    if not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = _number(value)
        except ValueError:
            number = None
        if number is not None and 0 < number < 1:
            return _share(value, float(number), reference)
        if number is not None and _written_as_fraction(value) and 1 <= number <= MAX_FRACTION_LIKE:
            raise BudgetError(
                f"budget {_show(value)} would be {int(number)} byte(s), which no training step fits; a number with a "
                f"decimal point this small is most likely a share of the unoptimized peak: did you mean "
                f"'{number * 100:g}%'? (a share of 100% or more is written as a percentage, a size with its unit, "
                f"e.g. '{number:g}GiB')")
    return parse_bytes(value)


#: The largest number written with a decimal point (``1.5``, ``"2.0"``) that :func:`resolve_budget` refuses as a
#: byte count: it is a share of the peak written without ``%`` (``1.5`` for 150%), never a real budget of a few bytes.
MAX_FRACTION_LIKE = 10


def _written_as_fraction(value: Any) -> bool:
    """Whether a bare number was written as a fraction would be: a Python float, or a string with a decimal point or
    an exponent (``"1.5"``, ``"2e0"``); an int or ``"2"`` is a count of bytes."""
    if isinstance(value, float):
        return True
    return isinstance(value, str) and any(c in value.lower() for c in ".e")


def is_share(value: Any) -> bool:
    """Whether :func:`resolve_budget` reads ``value`` as a share of the unoptimized peak: a percentage (``"60%"``) or
    a bare number strictly between 0 and 1 (``0.6``, ``"0.6"``)."""
    if isinstance(value, str) and value.strip().endswith("%"):
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return False
    try:
        return 0 < _number(value) < 1
    except ValueError:
        return False


#: Where people type budgets (the magics' ``--budget``), a plain number (no unit, no ``%``) from 1 up to this is
#: refused: as bytes no training step fits it, and ``60`` may as well mean 60% or 60 MiB.
MIN_TYPED_BYTES = 1024


def check_typed_budget(text: str) -> None:
    """Refuse a budget typed as a plain number from 1 up to :data:`MIN_TYPED_BYTES` (``--budget 60``), naming the
    spellings that say what was meant: ``60%`` of the unoptimized peak, or a size with its unit, ``60MiB``. Anything
    else is left to :func:`resolve_budget`, which reads it as the Python API does (a number below 1 is a share, a
    larger plain number a count of bytes)."""
    try:
        number = _number(text)
    except ValueError:
        return
    if 1 <= number < MIN_TYPED_BYTES:
        shown = text.strip()
        raise BudgetError(f"budget {shown} is a plain number, read as {int(number)} byte(s), which no training step "
                          f"fits; write a share of the unoptimized peak with % ('{shown}%') or a size with its unit "
                          f"('{shown}MiB', '{shown}GB'); a plain number is a count of bytes only from "
                          f"{MIN_TYPED_BYTES} up")


def _share(value: Any, fraction: float, reference: int | None) -> int:
    pct = f"{fraction * 100:g}%"
    if reference is None:
        kind = "a percentage" if isinstance(value, str) and value.strip().endswith("%") else f"a fraction ({pct})"
        raise BudgetError(f"budget {value!r} is {kind} of the unoptimized peak, but there is no profile here to take "
                          "it of; give a size like '512MiB' or '1.5GiB'")
    n = int(reference * fraction)
    if n < 1:
        raise BudgetError(f"budget {value!r} ({pct} of {format_bytes(reference)}) is less than one byte; "
                          f"{_HINT}")
    return n


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
