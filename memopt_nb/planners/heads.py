"""Planning with the LM head as an option: the head as written, or chunked (``profile(..., head="chunked")``).

A profile that measured its head chunked (:mod:`memopt_nb.core.heads`) offers one more decision than its units: run
the head as written, or in one of the measured numbers of chunks. :func:`choosing_head` wraps a planner so that it
decides it: each option is its own profile, planned like any other; the plan of the head as written is kept unless an
option is faster by more than :data:`HEAD_MARGIN` or it alone fits the budget (a chunked head is not bit-identical,
so it must pay). A percentage budget means a share of the head-as-written peak for every option. Where a planner is
costly (the agents), the option is chosen with the exact MILP first and the planner runs once, on that option.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ..core.budget import resolve_budget
from ..core.errors import BudgetError
from ..core.heads import head_options, with_head
from ..core.plan import Plan

__all__ = ["HEAD_MARGIN", "choosing_head", "head_min_peak"]

#: a chunked head is chosen over the head as written only when its plan is this much faster (or alone fits)
HEAD_MARGIN = 0.01
#: seconds the exact MILP may take per option when it chooses the option for the agents: a safety net far above what
#: its node limit (:func:`~memopt_nb.planners.milp.node_limit`, the same on every machine) takes on the models planned
#: here, so that the choice does not depend on the machine's load
CHOOSE_TIME_LIMIT = 600.0


def _candidates(profile: Any, head: bool) -> list[tuple[dict[str, Any] | None, Any]]:
    """``(head, profile)`` per option: the head as written first."""
    out: list[tuple[dict[str, Any] | None, Any]] = [(None, profile)]
    if head and not (getattr(profile, "meta", None) or {}).get("head"):
        for chunks in head_options(profile):
            option = profile.heads[str(chunks)]
            h = {"module": option["module"], "chunks": chunks}
            out.append((h, with_head(profile, h)))
    return out


def _better(plan: Plan, best: Plan | None) -> bool:
    if best is None:
        return True
    if not plan.feasible:
        return False
    if not best.feasible:
        return True
    return plan.predicted_step_time < best.predicted_step_time * (1 - (HEAD_MARGIN if plan.head else 0.0))


def _best(plans: list[Plan], errors: list[BudgetError]) -> Plan:
    best = None
    for p in plans:
        if _better(p, best):
            best = p
    if best is None:
        raise min(errors, key=lambda e: e.minimum_bytes or 0)
    return best


def _as_share_of(err: BudgetError, profile: Any) -> BudgetError:
    """``err`` (raised for one option) with its minimum as a share of the head-as-written peak."""
    if err.minimum_bytes is not None:
        err.peak_bytes = int(profile.peak_bytes)
        err.args = (err.reworded("python"),)
    return err


def _with_head(plan: Plan, head: dict[str, Any] | None, choice: dict[str, Any]) -> Plan:
    return plan.with_meta(head=head, meta={"head_choice": choice}) if head or choice else plan


def choosing_head(choose: Callable[..., Plan] | None = None) -> Callable[[Callable[..., Plan]], Callable[..., Plan]]:
    """Make planner ``fn(profile, budget=None, device=None, ...)`` choose the head option too (its ``head=`` keyword:
    ``True``, the default, uses the options the profile measured; ``False`` plans the head as written).

    ``choose``: a cheaper exact planner that picks the option first, called with the keyword arguments it takes from
    the planner's (``strategies``, ``offload_state``, ``step_in_backward``); ``None``: the planner runs on every
    option. ``plan.meta["head_choice"]`` gives each option's predicted step time (``None``: below its floor)."""

    def wrap(fn: Callable[..., Plan]) -> Callable[..., Plan]:
        @functools.wraps(fn)
        def planner(profile: Any, budget: Any = None, device: Any = None, *args: Any, head: bool = True,
                    **kwargs: Any) -> Plan:
            cands = _candidates(profile, head)
            if len(cands) == 1:
                return fn(profile, budget, device, *args, **kwargs)
            if budget is not None:  # a percentage is of the head-as-written peak, for every option
                budget = resolve_budget(budget, reference=profile.peak_bytes)
            run = fn
            if choose is not None:
                keys = ("strategies", "offload_state", "step_in_backward")
                run = functools.partial(getattr(choose, "__wrapped__", choose), time_limit=CHOOSE_TIME_LIMIT,
                                        **{k: kwargs[k] for k in keys if k in kwargs})
            plans, errors, choice = [], [], {}
            for h, prof in cands:
                key = "as written" if h is None else f"{h['chunks']} chunks"
                try:
                    p = run(prof, budget, device, *(args if run is fn else ()), **(kwargs if run is fn else {}))
                except BudgetError as exc:
                    errors.append(_as_share_of(exc, profile))
                    choice[key] = None
                    continue
                choice[key] = p.predicted_step_time if p.feasible else None
                plans.append(_with_head(p, h, {}))
            best = _best(plans, errors)
            if choose is not None:
                prof = profile if best.head is None else with_head(profile, best.head)
                best = _with_head(fn(prof, budget, device, *args, **kwargs), best.head, {})
            return _with_head(best, best.head, choice)

        planner.__doc__ = (fn.__doc__ or "") + _HEAD_DOC
        return planner

    return wrap


_HEAD_DOC = """
    With a profile made with ``head="chunked"``, the plan may also compute the LM head and its loss in chunks
    (``plan.head``; not bit-identical, so chosen only where it is faster by more than 1 % or alone fits the budget;
    ``head=False`` leaves the head as written): see :mod:`memopt_nb.planners.heads`.
"""


def head_min_peak(fn: Callable[..., int]) -> Callable[..., int]:
    """Make ``min_peak(profile, ...)`` the smallest over the head options too (``head=False``: as written)."""

    @functools.wraps(fn)
    def floor(profile: Any, *args: Any, head: bool = True, **kwargs: Any) -> int:
        return min(fn(prof, *args, **kwargs) for _, prof in _candidates(profile, head))

    floor.__doc__ = (fn.__doc__ or "") + _HEAD_DOC
    return floor
