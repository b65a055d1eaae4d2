"""The budget check every planner makes: a budget below the smallest peak any plan in the space reaches is refused
with what bounds that floor and how to lower it (:mod:`.floor`). With no budget, a plan for the device the model is on
is made for the memory that device can still give the step (:mod:`memopt_nb.runtime.free`), not its whole capacity."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.budget import format_bytes, resolve_budget
from ..core.cuts import merge_units, outermost
from ..core.device import DeviceSpec
from ..core.errors import BudgetError, MemoptError
from ..core.plan import DEFAULT_STRATEGIES, STATE_CHOICES, Plan
from ..core.space import PlanSpace
from ..core.strategies import by_name
from ..runtime.free import FreeMemory, free_memory
from ..sim.simulator import Simulator
from .floor import explain_floor
from .milp import cached_min_peak
from .options import evaluate_arrays, state_table_of, uniform_arrays

__all__ = ["check_budget", "default_budget", "planning_for_free"]


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


def default_budget(profile: Any, device: DeviceSpec | str | None = None) -> FreeMemory:
    """What a plan for ``profile`` (a profile or a :class:`Simulator`) on ``device`` is made for when no budget is
    given: on the device the model was profiled on (``device`` ``None`` or that device), what it can still give the
    step now — its capacity (inside :func:`memopt_nb.limit_memory`, the limit) less what live tensors outside the step
    hold, the profiled model, optimizer and inputs counted as the step's (:func:`~memopt_nb.runtime.free.free_memory`);
    on a preset, its capacity."""
    if isinstance(profile, Simulator):
        profile, device = profile.profile, profile.device
    spec = DeviceSpec.resolve(device, profile.device)
    if spec != profile.device:
        return FreeMemory.capacity_of(spec)
    live = getattr(profile, "live_step", None)
    return free_memory(spec, live if isinstance(live, list) else [])


def planning_for_free(fn: Callable[..., Plan]) -> Callable[..., Plan]:
    """Make planner ``fn(profile, budget=None, device=None, ...)`` plan for :func:`default_budget` when no budget is
    given, and say so in ``plan.meta["budget_source"]`` (:meth:`~memopt_nb.runtime.free.FreeMemory.to_meta`, with its
    ``"line"``: ``planning for 207.00 MiB free of 258.00 MiB (51.00 MiB held by other tensors)``)."""

    @functools.wraps(fn)
    def planner(profile: Any, budget: Any = None, device: Any = None, *args: Any, **kwargs: Any) -> Plan:
        if budget is not None:
            return fn(profile, budget, device, *args, **kwargs)
        free = default_budget(profile, device)
        plan = fn(profile, free.free_bytes, device, *args, **kwargs)
        plan.meta = {**plan.meta, "budget_source": free.to_meta()}  # a new dict: no other plan shares it
        return plan

    return planner


def check_budget(sim: Simulator, budget: Any, space: PlanSpace) -> int:
    """Parse ``budget`` (bytes, ``"1.5GiB"``, ``"60%"`` of the unoptimized peak; ``None``: what the device can still
    give the step, :func:`default_budget`) and refuse one no plan in ``space`` can meet."""
    if budget is None:
        budget = default_budget(sim).free_bytes
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
