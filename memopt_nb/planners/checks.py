"""The budget check every planner makes: a budget below the smallest peak any plan in the space reaches is refused
with what bounds that floor and how to lower it (:mod:`.floor`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.budget import format_bytes, resolve_budget
from ..core.cuts import merge_units, outermost
from ..core.errors import BudgetError, MemoptError
from ..core.plan import DEFAULT_STRATEGIES, STATE_CHOICES
from ..core.space import PlanSpace
from ..core.strategies import by_name
from ..sim.simulator import Simulator
from .floor import explain_floor
from .milp import cached_min_peak
from .options import evaluate_arrays, state_table_of, uniform_arrays

__all__ = ["check_budget"]


def _space_text(sim: Simulator, space: PlanSpace) -> str:
    """How a refused budget's space was restricted, for the message ('' for the whole default space)."""
    parts = []
    if set(space.strategies) != set(DEFAULT_STRATEGIES):
        parts.append(f"using only {', '.join(space.strategies)}")
    allowed = space.placements
    if state_table_of(sim) is not None:
        moved = {piece for c in allowed for piece, place in zip(("optimizer state", "gradients", "parameters"),
                                                               STATE_CHOICES[c], strict=True) if place != "resident"}
        kept = [p for p in ("optimizer state", "gradients", "parameters") if p not in moved]
        if kept:
            parts.append(f"with {', '.join(kept)} resident")
    return (" " + " ".join(parts)) if parts else ""


def _blocks_text(sim: Simulator, space: PlanSpace, value: int) -> str:
    """For a fine profile whose whole blocks reach ``value`` where its units do not (recomputing unit by unit pins
    every unit's input): that, and how to plan them."""
    profile = sim.profile
    blocks = outermost(getattr(profile, "merges", {}))
    if not blocks:
        return ""
    try:  # a hint only: a space the whole blocks cannot take (selective: merged blocks have no save-sets) gets none
        whole = Simulator(merge_units(profile, blocks), sim.device)
        if not _a_uniform_plan_fits(whole, value, space) and value < cached_min_peak(whole, space):
            return ""
    except MemoptError:
        return ""
    return (" Its whole blocks fit this budget: memopt.search_depths(profile, budget) plans whole blocks where that "
            "is enough and their units where the budget needs them (%memopt_plan --mixed-depths).")


def _a_uniform_plan_fits(sim: Simulator, value: int, space: PlanSpace) -> bool:
    """Whether a plan giving every unit one activation strategy of ``space`` (copies as early as they go, state
    resident) fits ``value`` bytes: then the budget is feasible without the floor's MILP, which takes tens of seconds
    at a few hundred units. ``False`` says nothing (a mixed plan may still fit)."""
    kinds = [by_name(s) for s in space.strategies if not by_name(s).variants]
    rows = [uniform_arrays(sim, s.code, *((w, w) if s.timed else s.timing)) for s in kinds for w in (0, 1)]
    peaks, _ = evaluate_arrays(sim, *(np.array([r[i] for r in rows]) for i in range(3)))
    return bool(np.min(peaks) <= value)


def check_budget(sim: Simulator, budget: Any, space: PlanSpace) -> int:
    """Parse ``budget`` (bytes, ``"1.5GiB"``, ``"60%"`` of the unoptimized peak; ``None``: the device's capacity) and
    refuse one no plan in ``space`` can meet."""
    if budget is None:
        budget = sim.device.capacity_bytes
    value = resolve_budget(budget, reference=sim.profile.peak_bytes)
    if _a_uniform_plan_fits(sim, value, space):
        return value
    lowest = cached_min_peak(sim, space)
    if value < lowest:
        using = _space_text(sim, space)
        floor = explain_floor(sim.profile, sim.device, floor_bytes=lowest, strategies=space.strategies,
                              offload_state=space.offload_state, step_in_backward=space.step_in_backward)
        err = BudgetError(
            "", minimum_bytes=int(lowest), budget_bytes=int(value), options=floor.advice,
            peak_bytes=int(sim.profile.peak_bytes),
            context=(f"Budget {format_bytes(value)} ({value} bytes) is below the smallest peak any plan{using} reaches "
                     f"for this profile on {sim.device.name}: {format_bytes(lowest)} ({lowest} bytes)."),
            detail=f"That floor = {floor.breakdown_text()}. {floor.bound_text()}{_blocks_text(sim, space, value)}")
        err.args = (err.reworded("python"),)
        raise err
    return value


# ---------------------------------------------------------------------- planners
