"""``memopt.search_depths``: plans that decide a whole block where that is enough and its units where the budget
needs them.

A fine profile (``units="fine"``) splits each transformer block into attention, norms and MLP layers. Recomputing a
block unit by unit holds every unit's input; recomputing it as one checkpoint holds the block's input only, for the
same recomputation. So where a plan recomputes (or keeps) all of a block, the block should be one unit, and the memory
that frees pays for keeping something elsewhere; where the budget needs a block's cheap parts recomputed and its
expensive ones kept, its units stay. :func:`search_depths` plans the fine units and the whole blocks, then merges,
from the fine plan, each block its plan treats alike and polishes the plan of that mixed cut; the fastest of the three
that fits is returned. Merged blocks are ordinary units of a profile made by
:func:`~memopt_nb.core.cuts.merge_units` (the same measurements, the blocks' own recomputation peaks measured by
the profiler), so the simulator, the replay, the MILP, the agents and the runtime read them as any other unit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from ..core.cuts import merge_units, mergeable, outermost
from ..core.device import DeviceSpec
from ..core.errors import BudgetError, PlanError
from ..core.plan import DEFAULT_STRATEGIES, Plan
from ..core.profile import ModelProfile
from ..core.strategies import REGISTRY
from ..sim.simulator import code_of
from .polish import polish
from .rl.search import plan_from_arrays, search
from .task import PlanningTask

__all__ = ["MERGE_STRATEGIES", "search_depths"]

#: A block whose units a plan all gives one of these strategies (with the same timing and placement) is merged in the
#: mixed cut: recomputed, its checkpoint holds its input only; swapped, its saved bytes move in fewer, larger copies.
#: Kept blocks are split: keeping their units costs the same, and the polish may then recompute their cheap ones.
#: Selective blocks too: a save-set names the ops of one unit. Today: recompute, swap, recompute_offload.
MERGE_STRATEGIES = tuple(s.name for s in REGISTRY if (s.recomputes or s.offloads) and not s.variants)


def _arrays(plan: Plan, profile: ModelProfile) -> tuple[np.ndarray, ...]:
    """The plan's decisions as arrays over ``profile``'s units (see :func:`_decision`)."""
    by_name = {d.unit: d for d in plan.decisions}
    rows = []
    for u in profile.units:
        d = _decision(by_name, u.name)
        rows.append((code_of(d.strategy, d.save_set), d.offload_window, d.prefetch_distance, d.state_index))
    return tuple(np.array(col, dtype=np.int64) for col in zip(*rows, strict=True))


def _decision(by_name: dict[str, Any], name: str) -> Any:
    """The decision for unit ``name``: its own, the block's that holds it, or (``name`` a block) its first unit's."""
    if name in by_name:
        return by_name[name]
    return next((d for n, d in by_name.items() if name.startswith(n + ".") or n.startswith(name + ".")), None)


def _alike(plan: Plan, profile: ModelProfile) -> list[str]:
    """The blocks of ``profile`` that ``plan`` treats as one: the block itself, or every one of its units, the same way
    with a strategy of :data:`MERGE_STRATEGIES` (outermost first)."""
    by_name = {d.unit: d for d in plan.decisions}
    out = []
    for block in mergeable(profile):
        first, last = profile.merges[block]["units"]
        ds = [_decision(by_name, profile.units[k].name) for k in range(first, last + 1)]
        if any(d is None for d in ds):
            continue
        alike = {(d.strategy, d.offload_window, d.prefetch_distance, d.placement) for d in ds}
        if len(alike) == 1 and ds[0].strategy in MERGE_STRATEGIES:
            out.append(block)
    return outermost(out)


def _fits(profile: ModelProfile, merged: list[str], plan: Plan, task_of: Callable[[ModelProfile], PlanningTask]
          ) -> tuple[PlanningTask, tuple[np.ndarray, ...]] | None:
    """The task of ``profile`` with ``merged`` merged and ``plan`` as its arrays there, if the plan fits it."""
    task = task_of(merge_units(profile, merged))
    arrays = _arrays(plan, task.profile)
    peak, _ = task.evaluate(*[a[None] for a in arrays])
    return (task, arrays) if peak[0] <= task.budget else None


def _mixed_from(start: Plan, profile: ModelProfile, task_of: Callable[[ModelProfile], PlanningTask],
                replan: Callable[[ModelProfile], Plan] | None, rounds: int, seed: int) -> Plan | None:
    """From ``start``: merge the blocks it treats as one (:func:`_alike`), split the others, and polish the plan there
    (and plan the cut anew with ``replan``); again from the result while it gains."""
    best, merged_now = None, None
    cur = start
    for _ in range(rounds):
        want = _alike(cur, profile)
        if want == merged_now:
            break
        found = _fits(profile, want, cur, task_of)
        if found is None:  # merged all at once it does not fit (a block's recomputation peaks higher): one at a time
            took: list[str] = []
            for b in want:
                if (more := _fits(profile, took + [b], cur, task_of)) is not None:
                    took, found = took + [b], more
            if found is None:
                break
            want = took
        task, (c, w, d, st) = found
        c, w, d, st, moves = polish(task, c, w, d, st)
        plans = [plan_from_arrays(task, c, w, d, st, seed=seed, polish="depths", polish_moves=moves)]
        if replan is not None:
            plans.append(replan(task.profile))
        plan = min((p for p in plans if p.feasible), key=lambda p: p.predicted_step_time, default=None)
        if plan is None or (best is not None and plan.predicted_step_time >= best.predicted_step_time * (1 - 1e-9)):
            break
        merged_now = want
        best = cur = plan.with_meta(meta={**plan.meta, "merged": sorted(want)})
    return best


def search_depths(profile: ModelProfile, budget: Any = None, device: DeviceSpec | str | None = None, *,
                  planner: Callable[[ModelProfile, Any, Any], Plan] | None = None, rounds: int = 2, seed: int = 0,
                  replan: bool = True, offload_state: bool | str | Iterable[str] = True,
                  step_in_backward: bool = False, strategies: str | Iterable[str] = DEFAULT_STRATEGIES,
                  **search_options: Any) -> Plan:
    """The fastest plan that fits ``budget`` with units at mixed depths: whole blocks where that is enough, their units
    where the budget needs them.

    ``profile`` is a fine profile (``memopt.profile(..., units="fine")``; ``profile.merges`` lists the blocks it can
    merge). Two plans are made by ``planner(profile, budget, device)`` (default:
    :func:`~memopt_nb.planners.rl.search.search` with ``seed``, the space options and ``search_options``): one of the
    fine units, one of the whole blocks. From each, the blocks it recomputes (or swaps) whole are merged and the others
    split into their units, and the plan, mapped onto that mixed cut, is polished there (a merged block's checkpoint
    holds only its input; split, a kept block's cheap units can be recomputed alone); with ``replan`` (the default)
    the cut is also planned anew by ``planner``. This repeats up to ``rounds`` times while it gains. The fastest plan
    that fits is returned (on ties the fine, then the block plan): never slower than either.

    The plan's units are its cut's: ``plan.meta["merged"]`` names the blocks merged, which :func:`memopt_nb.simulate`
    and the runtime read (``memopt.merge_units(profile, plan.meta["merged"])`` is its profile). ``meta["depths"]``
    holds each plan's predicted step time (``None`` where none fitted), which was chosen, and the seconds spent. A
    profile without mergeable blocks gets the planner's plan of its units.
    """
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise PlanError(f"rounds must be a non-negative int, not {rounds!r}")
    t0 = time.perf_counter()
    space = dict(offload_state=offload_state, step_in_backward=step_in_backward, strategies=strategies)
    if planner is None:
        def planner(p: ModelProfile, b: Any, d: Any) -> Plan:
            return search(p, b, d, seed=seed, **space, **search_options)

    blocks = outermost(mergeable(profile))
    if not blocks:
        return planner(profile, budget, device).with_meta(
            meta={"depths": {"note": "no block of this profile can be merged (profile with units=\"fine\")"}})
    made: dict[str, Plan] = {}
    errors: dict[str, BudgetError] = {}
    for key, cut in (("fine", profile), ("blocks", merge_units(profile, blocks))):
        try:  # each has its own floor: recomputing unit by unit pins every unit's input, a block only its own
            made[key] = planner(cut, budget, device).with_meta(
                meta={"merged": sorted(blocks) if key == "blocks" else []})
        except BudgetError as exc:
            errors[key] = exc
    if len(errors) == 2:
        raise BudgetError(f"{errors['fine']} (with whole blocks: {errors['blocks']})") from None
    results: dict[str, Plan | None] = {k: (p if (p := made.get(k)) is not None and p.feasible else None)
                                       for k in ("fine", "blocks")}

    def task_of(cut: ModelProfile) -> PlanningTask:
        return PlanningTask(cut, budget, device, **space)

    again = (lambda cut: planner(cut, budget, device)) if replan else None
    mixed = [p for k in ("fine", "blocks") if results[k] is not None
             and (p := _mixed_from(results[k], profile, task_of, again, rounds, seed)) is not None]
    results["mixed"] = min(mixed, key=lambda p: p.predicted_step_time, default=None)
    fits = {k: p for k, p in results.items() if p is not None}
    if not fits:  # neither planner's plan fits (flagged infeasible): the fine one as the planner returned it
        if "fine" in errors:
            raise errors["fine"]
        return made["fine"]
    chosen = min(fits, key=lambda k: (fits[k].predicted_step_time, ["fine", "blocks", "mixed"].index(k)))
    plan = fits[chosen]
    depths = {f"{k}_step_time": (p.predicted_step_time if p is not None else None) for k, p in results.items()}
    depths.update(chosen=chosen, merged_blocks=len(plan.meta.get("merged") or []),
                  seconds=round(time.perf_counter() - t0, 3))
    return plan.with_meta(meta={"merged": plan.meta.get("merged") or [], "depths": depths})
