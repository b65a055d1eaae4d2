"""Planners with one interface, ``name(profile, budget, device=None) -> Plan``: the exact optimum and the baselines.

``budget`` is bytes, a string such as ``"1.5GiB"``, or a percentage of the unoptimized peak (``"60%"``); ``None``
means the device's capacity. A budget below :func:`min_peak` raises :class:`~memopt_nb.errors.BudgetError` naming the
smallest feasible peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..device import DeviceSpec
from .baselines import BASELINES, capuchin, none, recompute_all, sqrt_n, swap_all
from .brute import brute_force
from .common import as_simulator, cached_min_peak
from .milp import optimal


def min_peak(profile: Any, device: DeviceSpec | str | None = None,
             strategies: Sequence[str] = ("keep", "recompute", "swap")) -> int:
    """The smallest peak memory (bytes) any plan (using only ``strategies``) reaches for ``profile`` on ``device``."""
    return cached_min_peak(as_simulator(profile, device), strategies)


__all__ = ["BASELINES", "brute_force", "capuchin", "min_peak", "none", "optimal", "recompute_all", "sqrt_n",
           "swap_all"]
