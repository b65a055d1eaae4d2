"""The exact planner: the fastest plan under a budget, by MILP (:mod:`.milp`), with a smaller problem's optimum as
the cut-off and the answer of last resort."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.device import DeviceSpec
from ..core.errors import BudgetError
from ..core.plan import DEFAULT_STRATEGIES, OFFLOADING, STATE_CHOICES, Plan
from ..core.space import PlanSpace
from ..sim.simulator import Simulator
from .checks import check_budget, planning_for_free
from .heads import choosing_head
from .milp import Formulation, stopped_by
from .options import (
    OffloadState,
    as_simulator,
    make_plan,
    unit_states,
)

__all__ = ["optimal", "solve_optimal"]


def _fallback(sim: Simulator, b: int, space: PlanSpace, time_limit: float) -> tuple[Plan | None, str]:
    """A smaller problem's optimum that bounds the full one from above (a cut-off that prunes the search, and the
    answer of last resort if the full problem runs out of time), and what it means when nothing beats it.

    Where state may move, the activation-only optimum (when it fits); otherwise, or if it does not fit, the
    checkpointing-only optimum in the same state space (quick to prove)."""
    if any(len(c) > 1 for c in unit_states(sim, space)):
        try:
            return (solve_optimal(sim, b, space.replace(offload_state=False, step_in_backward=False), time_limit / 4),
                    "no plan moving state beat the activation-only optimum")
        except BudgetError:
            pass
    if "swap" in space.strategies and "recompute" in space.strategies and sim.device.has_host_link:
        rc_only = tuple(x for x in space.strategies if x not in OFFLOADING
                        and (x != "selective" or bool(np.any(sim.sel_has))))  # no selective it cannot offer
        try:
            return (solve_optimal(sim, b, space.replace(strategies=rc_only), time_limit / 4),
                    "no plan with swaps beat the checkpointing-only optimum")
        except BudgetError:
            pass
    return None, ""


@choosing_head()
@planning_for_free
def optimal(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None,
            strategies: Sequence[str] = DEFAULT_STRATEGIES, time_limit: float = 600.0, *,
            offload_state: OffloadState = True, step_in_backward: bool = False) -> Plan:
    """The plan with the smallest simulated step time whose simulated peak fits ``budget`` (``None``: on the profiled
    device what it can still give the step, its capacity less what live tensors outside the step hold, as
    ``plan.meta["budget_source"]`` says; on a preset its capacity).

    Solved exactly (to HiGHS tolerances) as a MILP over the simulator's model; ``strategies`` restricts the activation
    options (e.g. ``("keep", "recompute")`` for checkpointing only; a bad value raises
    :class:`~memopt_nb.core.errors.PlanError`). ``offload_state`` says which state may leave the
    device: ``True`` (optimizer state, gradients, parameters), ``False`` (activations only) or a set of
    ``"optimizer"``, ``"grads"``, ``"params"``; ``step_in_backward=True`` also allows stepping units inside backward
    (the plan then forbids gradient accumulation and clipping). ``plan.meta`` has the solver status, the MILP
    objective, the simulated time of the plan, the solve time, whether optimality was proven and ``solver_stop``: what
    ended the solve, ``"optimal"``, ``"infeasible"`` (nothing beats the cut-off), ``"node_limit"`` (HiGHS's
    branch-and-bound nodes, :func:`~memopt_nb.planners.milp.node_limit`: fewer the larger the program, a count of
    work, so the same plan on every machine) or ``"time_limit"``. ``time_limit`` (seconds) is only a safety net far
    above what those take; a solve it stops returns a plan that depends on the machine's speed and load.
    """
    space = PlanSpace.of(strategies, offload_state, step_in_backward)  # PlanError on a bad value
    return solve_optimal(as_simulator(profile, device), budget, space, time_limit)


def solve_optimal(sim: Simulator, budget: Any, space: PlanSpace, time_limit: float = 600.0) -> Plan:
    """:func:`optimal` on a compiled simulator over a parsed :class:`~memopt_nb.core.space.PlanSpace`."""
    strategies, step_in_backward = space.strategies, space.step_in_backward
    b = check_budget(sim, budget, space)
    allowed = [list(STATE_CHOICES[c]) for c in space.placements]
    t0 = time.perf_counter()
    fallback, note = _fallback(sim, b, space, time_limit)
    form = Formulation(sim, space)
    form.limit_memory(b)
    objective, const, tscale = form.time_objective()
    offset = form.time_offset
    if fallback is not None and fallback.feasible:
        form.cap(objective, (fallback.predicted_step_time - offset) / tscale * (1 + 1e-7) - const)
    res = form.solve(objective, max(time_limit - (time.perf_counter() - t0), 1.0))
    solve_time = time.perf_counter() - t0
    if res.x is None or (fallback is not None and fallback.feasible
                         and (float(res.fun) + const) * tscale + offset >= fallback.predicted_step_time):
        if fallback is not None and fallback.feasible:
            proven = res.status in (0, 2)  # solved, or infeasible under the cut-off: nothing beats checkpointing
            meta = {"solver": "highs-milp", "proven_optimal": proven, "solve_seconds": solve_time,
                    "milp_step_time": fallback.predicted_step_time, "allowed_strategies": list(strategies),
                    "allowed_placements": allowed, "mip_gap": 0.0 if proven else float("nan"),
                    "solver_stop": stopped_by(res),
                    "note": note + ("" if proven else " within the solver's node limit")}
            return fallback.with_meta(method="optimal", step_in_backward=fallback.step_in_backward or step_in_backward,
                                      meta=meta)
        raise BudgetError(f"the exact solver found no plan within its limits ({res.get('mip_node_count')} nodes of "
                          f"memopt.solvers.milp.node_limit, {time_limit:.0f} s; {res.message}); raise the budget, or "
                          f"memopt.solvers.milp.NODE_LIMIT or time_limit")
    codes, ws, ds, states = form.read_back(res.x)
    milp_time = (float(res.fun) + const) * tscale + offset
    return make_plan(sim, codes, ws, ds, budget=b, method="optimal", states=states,
                     step_in_backward=step_in_backward, solver="highs-milp",
                     proven_optimal=bool(res.status == 0), milp_step_time=milp_time, solve_seconds=solve_time,
                     solver_stop=stopped_by(res),
                     mip_gap=float(getattr(res, "mip_gap", 0.0) or 0.0), allowed_strategies=list(strategies),
                     allowed_placements=allowed)
