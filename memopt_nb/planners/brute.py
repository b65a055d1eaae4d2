"""Exhaustive search over every plan — the test oracle for small profiles (at most 12 units)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.device import DeviceSpec
from ..core.errors import MemoptError
from ..core.plan import DEFAULT_STRATEGIES, Plan
from ..core.space import PlanSpace
from .checks import check_budget
from .options import OffloadState, as_simulator, evaluate_arrays, make_plan, unit_options, unit_states

__all__ = ["MAX_PLANS", "MAX_UNITS", "brute_force"]

MAX_UNITS = 12
MAX_PLANS = 5_000_000


def brute_force(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None,
                strategies: Sequence[str] = DEFAULT_STRATEGIES, batch: int = 20000, *,
                offload_state: OffloadState = True, step_in_backward: bool = False) -> Plan:
    """Simulate every combination of unit options (activation option × state placement) and return the fastest plan
    that fits ``budget``; the space is the one :func:`~memopt_nb.planners.optimal` searches for the same arguments."""
    sim = as_simulator(profile, device)
    space = PlanSpace.of(strategies, offload_state, step_in_backward)
    b = check_budget(sim, budget, space)
    if sim.n > MAX_UNITS:
        raise MemoptError(f"brute force is for at most {MAX_UNITS} units, this profile has {sim.n}")
    places = unit_states(sim, space)
    opts = [[(*o, c) for c in places[u] for o in unit_options(sim, u, space.strategies)] for u in range(sim.n)]
    total = int(np.prod([len(o) for o in opts]))
    if total > MAX_PLANS:
        raise MemoptError(f"{total} plans are too many to enumerate (limit {MAX_PLANS}); restrict strategies= or "
                          "offload_state=")
    best = (np.inf, None)
    it = itertools.product(*opts)
    while True:
        chunk = list(itertools.islice(it, batch))
        if not chunk:
            break
        arr = np.array(chunk)  # (B, n, 4)
        peak, t = evaluate_arrays(sim, arr[:, :, 0], arr[:, :, 1], arr[:, :, 2], arr[:, :, 3])
        t = np.where(peak <= b, t, np.inf)
        i = int(np.argmin(t))
        if t[i] < best[0]:
            best = (float(t[i]), arr[i])
    if best[1] is None:  # pragma: no cover - check_budget guarantees a feasible plan exists
        raise MemoptError("no plan fits the budget")
    a = best[1]
    return make_plan(sim, a[:, 0], a[:, 1], a[:, 2], budget=b, method="brute_force", states=a[:, 3],
                     step_in_backward=step_in_backward, plans_enumerated=total)
