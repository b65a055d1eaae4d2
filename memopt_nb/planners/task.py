"""One planning problem — a profile, a budget, a device, the state placements allowed — prepared for the agents
(:mod:`.rl`) and the polish (:mod:`.polish`), over the options of :mod:`.options` (numbered as it numbers them).

Besides the exact simulator (which scores every finished plan), a task holds a *marginal model*: for every unit and
option, how the per-segment peaks and the step time change when only that unit leaves "keep". Summing marginals is
a fast, close approximation of the simulator (exact for memory wherever storage groups are owned by one unit) that
the environment uses for observations and action masks, so that an environment step never needs a simulation.

Where each unit's optimizer state, gradients and parameters live (``offload_state=``) comes from the simulator's
``StateTable`` (see ``memopt_nb/sim/COST_MODEL.md``), whose form is separable by construction: a placement changes each
segment's peak by ``seg_delta[u, c]``, each point of the unit-by-unit optimizer step by ``step_delta[u, c]`` (the plain
step's peak ``plain_step_peak`` applies while every unit is resident) and the step time by ``time[u, c]``, plus
``chunked_step_extra`` once any unit moves. The marginal model adds exactly these, so for the state part it is exact.
:func:`state_model_for` is the one place the task gets that table from.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..core.budget import format_bytes, resolve_budget
from ..core.device import DeviceSpec
from ..core.errors import BudgetError, PlanError
from ..core.plan import DEFAULT_STRATEGIES, STATE_CHOICES
from ..core.profile import ProfileLike
from ..core.space import PlanSpace
from ..core.strategies import REGISTRY
from ..sim.simulator import KEEP, RECOMPUTE, SWAP, Simulator
from .checks import check_budget, default_budget
from .floor import Advice
from .options import (
    OPTION_BASE,
    TIMINGS,
    as_simulator,
    check_save_sets,
    code_options,
    option_codes,
    unit_ok,
    unit_states,
)

__all__ = ["PlanningTask", "StateModel", "state_model_for", "COMPLETION_FROM_UNITS"]

#: From this many units up (activations only) the environment's masks assume a plan that fits for the units still
#: undecided (:meth:`PlanningTask.completion_options`) rather than each unit's best case per segment. The best case
#: keeps every plan reachable (the optimum included), but summed over a hundred units or more it is so far from any
#: one plan that most episodes miss a tight budget; the completion keeps them within it and may mask a plan that
#: needed a mix the uniform completion does not have.
COMPLETION_FROM_UNITS = 96


class StateModel:
    """The state part of the cost model: a ``StateTable`` (``memopt_nb/sim/COST_MODEL.md``) and how to score with it.

    ``native=True``: the simulator takes ``states=`` itself (``Simulator.evaluate(..., states=)``). ``native=False``:
    the table is combined with the simulator's activation-only figures by the contract's formula
    ``peak = max(max_s(peaks[s] + Σ_u seg_delta[u, c_u, s]), plain_step_peak if every c_u == 0 else
    max_k(step_base[k] + Σ_u step_delta[u, c_u, k]))`` and ``time = time + Σ_u time[u, c_u] + chunked_step_extra``
    (the latter once any unit moves) — for a table that is not the simulator's own (tests, what-if studies).
    """

    def __init__(self, sim: Simulator, table: Any, native: bool) -> None:
        n = sim.n
        self.sim = sim
        self.table = table
        self.native = native
        if tuple(map(tuple, table.choices)) != STATE_CHOICES:
            raise PlanError("the simulator's state table lists other placements than memopt_nb.core.plan.STATE_CHOICES")
        C = len(STATE_CHOICES)
        self.seg_delta = np.asarray(table.seg_delta, dtype=np.float64).reshape(n, C, sim.S)
        self.step_base = np.asarray(table.step_base, dtype=np.float64).reshape(-1)
        self.K = self.step_base.size
        self.step_delta = np.asarray(table.step_delta, dtype=np.float64).reshape(n, C, self.K)
        self.time = np.asarray(table.time, dtype=np.float64).reshape(n, C)
        self.plain_step_peak = float(table.plain_step_peak)
        self.chunked_step_extra = float(table.chunked_step_extra)

    def evaluate(self, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray,
                 states: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Exact peak and time of a batch of plans with placements ``states`` (``(B, n)`` indices, ``None``: all 0)."""
        if self.native:
            return self.sim.evaluate(codes, windows, dists, states=states)
        det = self.sim.evaluate(codes, windows, dists, details=True)
        B, n = det["peaks"].shape[0], self.sim.n
        c = np.zeros((B, n), dtype=np.int64) if states is None else np.atleast_2d(np.asarray(states, dtype=np.int64))
        units = np.arange(n)[None]
        seg = det["peaks"] + self.seg_delta[units, c].sum(axis=1)
        moved = (c != 0).any(axis=1)
        if self.K:
            chunked = (self.step_base[None] + self.step_delta[units, c].sum(axis=1)).max(axis=1)
        else:
            chunked = np.full(B, -np.inf)
        peak = np.maximum(seg.max(axis=1), np.where(moved, chunked, self.plain_step_peak))
        time = det["time"] + self.time[units, c].sum(axis=1) + np.where(moved, self.chunked_step_extra, 0.0)
        return peak, time


def state_model_for(sim: Simulator) -> StateModel | None:
    """The state part of the cost model for ``sim``: its ``state_table()``, or ``None`` when it has none.

    The one place the planners' task gets the table from (tests point it at a hand-made table). Without a table no
    state placement can be priced, so the task plans activations only.
    """
    get = getattr(sim, "state_table", None)
    if get is None:
        return None
    native = "states" in inspect.signature(sim.evaluate).parameters
    return StateModel(sim, get(), native=native)


class PlanningTask:
    """A (profile, budget, device, allowed strategies and placements) compiled for the environment and the search.

    ``strategies`` (read by :func:`~memopt_nb.planners.options.allowed_strategies`) restricts the activation options:
    ``option_ok`` leaves out the strategies not allowed, and a unit none of the allowed ones fits keeps its
    activations (as in the MILP's :func:`~memopt_nb.planners.options.unit_options`). ``offload_state`` and
    ``step_in_backward`` are read by :func:`memopt_nb.core.plan.state_choices`; the allowed placements are ``state_ids``
    (indices into :data:`~memopt_nb.core.plan.STATE_CHOICES`, 0 first). Without a state model (:func:`state_model_for`
    returns ``None``) only 0 is allowed, whatever ``offload_state`` says.

    Options (the columns of ``option_ok``, ``marg_peak``, ``marg_time``) are numbered as :mod:`.options`
    numbers them (0 keep, 1 recompute, ``2 + j`` swap with ``TIMINGS[j]``, ...), up to the last strategy the task
    ``offered``: every default one, and each opt-in one ``strategies`` allows (one with variants, selective, only where
    some unit offers one: recomputable and a Pareto save-set, as :func:`~memopt_nb.planners.options.unit_options`
    offers them); ``n_options`` in all; ``timed_base`` maps a timed strategy's code to its first option;
    :func:`~memopt_nb.planners.options.option_codes` maps options to codes.

    The strategy agent's actions are ``action_codes``: per offered strategy in registry order, one (a timed one; the
    timing agent then picks its option) or one per code (its variants); ``n_strategies`` of them; ``action_option[s]``
    is the option of an untimed action (-1 for a timed one).
    """

    def __init__(self, profile: ProfileLike, budget: Any = None, device: DeviceSpec | str | None = None, *,
                 offload_state: bool | str | Iterable[str] = True, step_in_backward: bool = False,
                 strategies: str | Iterable[str] = DEFAULT_STRATEGIES) -> None:
        """Compiles every table the environment reads, in dependency order (one ``_compile_*`` step each)."""
        #: what the agents may decide, parsed once (PlanError on a bad value)
        self.space = PlanSpace.of(strategies, offload_state, step_in_backward)
        self.strategies = self.space.strategies
        self.sim: Simulator = as_simulator(profile, device)
        self.profile = self.sim.profile
        check_save_sets(self.sim, self.strategies)  # selective named for a profile without save-sets: PlanError
        #: per registry strategy, which units may take it (``(n,)``; ``(n, variants)`` for one with variants)
        fits = {s.code: unit_ok(self.sim, s) for s in REGISTRY}
        _compile_actions(self, fits)
        allowed = tuple(STATE_CHOICES[c] for c in self.space.placements)
        self.step_in_backward = step_in_backward
        self.n = n = self.sim.n
        self.S = self.sim.S
        self.state_model = state_model_for(self.sim)
        if self.state_model is None:
            allowed = allowed[:1]
        self.state_ids = np.array([STATE_CHOICES.index(c) for c in allowed], dtype=np.int64)
        self._compile_states()
        if self.C == 1:  # activations only: the exact floor (before anything else is computed)
            self.budget = check_budget(self.sim, budget, self.space.replace(offload_state=False))
        self._compile_base()
        _compile_option_ok(self, fits)
        _compile_marginals(self)
        #: what the units from position ``k`` of the forward order on can still do at most (:meth:`suffixes`)
        self.suffix_min, self.suffix_step, self.suffix_can_move, self.suffix_red = self.suffixes(np.arange(n))
        if self.C > 1:  # placements may lower the floor below the activation-only one: the enlarged space's floor
            self.budget = self._check_budget(budget)
        self._check_step_floor()
        _compile_copy_ratio(self)
        #: activations only, from :data:`COMPLETION_FROM_UNITS` units up: a plan known to fit the budget (option
        #: indices; ``None`` where none is known), whose options the environment's masks assume for the units still
        #: undecided (:meth:`completion_options`)
        self.completion = (self.completion_options() if self.C == 1 and n >= COMPLETION_FROM_UNITS else None)

    def _compile_base(self) -> None:
        """The plan that keeps everything: its segment peaks, peak and step time (what the marginals are against)."""
        n = self.n
        keep = np.zeros((1, n), dtype=np.int64)
        base = self.sim.evaluate(keep, keep + 1, keep + 1, details=True)
        self.base_peaks = base["peaks"][0]
        self.base_peak = float(base["peak"][0])
        if self.has_step:
            self.base_peak = max(self.base_peak, self.plain_step)
        self.base_time = float(self.evaluate(keep, keep + 1, keep + 1, keep)[1][0])

    def completion_options(self) -> np.ndarray | None:
        """Option indices of the lowest-peak plan that gives every unit one allowed timed or recompute option
        (each timing the same for every unit), if the simulator says it fits the budget; else ``None``.

        The environment masks an action unless, with this plan for the units still undecided, the marginal model keeps
        the budget (where some action passes that test): a real plan, not the per-segment best case of every unit at
        once, so that on hundreds of units an episode does not walk into a budget it can no longer meet."""
        n, T = self.n, len(TIMINGS)
        plain = self.plain_options()
        rows = []
        for lo, hi in [(RECOMPUTE, RECOMPUTE + 1)] + [(self.timed_base[c], self.timed_base[c] + T)
                                                     for c in self.timed_codes]:
            group = self.option_ok[:, lo:hi]
            # a unit without this option: the strategy's first timing it has (the same effect), else its plainest
            first = np.where(group.any(axis=1), lo + group.argmax(axis=1), plain)
            rows += [np.where(self.option_ok[:, o], o, first) for o in range(lo, hi)]
        rows = np.unique(np.array(rows, dtype=np.int64), axis=0)
        c, w, d = option_codes(rows)
        peak, _ = self.evaluate(c, w, d, np.zeros((rows.shape[0], n), dtype=np.int64))
        i = int(np.argmin(peak))
        return rows[i].copy() if peak[i] <= self.budget else None

    def _compile_states(self) -> None:
        """The allowed placements' rows of the state table, per unit and local choice ``j`` (``state_ids[j]``)."""
        n, S, ids = self.n, self.S, self.state_ids
        self.C = C = ids.size
        sm = self.state_model
        self.has_step = sm is not None  # whether the optimizer step's peak is known (it is part of the peak then)
        self.K = sm.K if sm is not None else 0
        if sm is None:
            self.st_seg = np.zeros((n, 1, S))
            self.st_step = np.zeros((n, 1, 0))
            self.st_time = np.zeros((n, 1))
            self.step_base = np.zeros(0)
            self.plain_step = -np.inf
            self.chunk_extra = 0.0
        else:
            self.st_seg = sm.seg_delta[:, ids]
            self.st_step = sm.step_delta[:, ids]
            self.st_time = sm.time[:, ids]
            self.step_base = sm.step_base.copy()
            self.plain_step = sm.plain_step_peak
            self.chunk_extra = sm.chunked_step_extra
        # a placement other than all-resident is offered only where it changes something (a unit without parameters
        # has all-zero rows: moving "its" state would only switch to the unit-by-unit step), and a streamed one only
        # where it beats moving the same state whole (planners.options.unit_states, the MILP's rule)
        self.state_ok = np.ones((n, C), dtype=bool)
        if C > 1:
            offered = unit_states(self.sim, self.space, table=sm)
            self.state_ok[:, 1:] = [[int(c) in offered[u] for c in ids[1:]] for u in range(n)]
            usable = np.concatenate([[True], self.state_ok[:, 1:].any(axis=0)])
            if not usable.all():  # placements no unit can take leave the action space (none: activations only)
                self.state_ids = ids[usable]
                return self._compile_states()
        seg = np.where(self.state_ok[:, :, None], self.st_seg, np.inf)
        self.st_min_seg = seg.min(axis=1)  # (n, S): includes all-resident (0), so never positive
        step = np.where(self.state_ok[:, :, None], self.st_step, np.inf)
        self.st_min_step = step.min(axis=1) if self.K else np.zeros((n, 0))

    def suffixes(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """What the units from position ``k`` of ``order`` (a permutation of the units) on can still do at most, for
        ``k = 0 .. n``: the most their options and placements take off each segment (``(n + 1, S)``, separable, so
        added) and each point of the unit-by-unit step (``(n + 1, K)``), whether any of them may move state, and the
        sum of their largest single-segment savings (``(n + 1,)``). The environment walks the units in an order of its
        own; the task's ``suffix_*`` attributes are these over the forward order."""
        n = self.n
        smin = np.zeros((n + 1, self.S))
        sstep = np.zeros((n + 1, self.K))
        smove = np.zeros(n + 1, dtype=bool)
        for k in range(n - 1, -1, -1):
            u = int(order[k])
            smin[k] = smin[k + 1] + (self.min_marg[u] + self.st_min_seg[u])
            sstep[k] = sstep[k + 1] + self.st_min_step[u]
            smove[k] = smove[k + 1] or bool(self.state_ok[u, 1:].any())
        sred = np.concatenate([np.cumsum(self.max_red[np.asarray(order)][::-1])[::-1], [0.0]])
        return smin, sstep, smove, sred

    def step_part(self, step: np.ndarray, moved: bool, can_move: bool = False) -> float:
        """The optimizer step's share of the peak: the plain step while nothing moved, else the unit-by-unit one.

        ``step``: step-point levels (``step_base`` plus placements' ``step_delta``); ``can_move``: whether units still
        undecided may move (then the lower of the two is a lower bound). ``-inf`` when the step is not modelled.
        """
        if not self.has_step:
            return -np.inf
        chunked = float(step.max()) if self.K else -np.inf
        if moved:
            return chunked
        return min(self.plain_step, chunked) if can_move else self.plain_step

    def step_part_many(self, step: np.ndarray, moved: np.ndarray) -> np.ndarray:
        """The optimizer step's share of the peak for finished plans: ``step`` (B, K) points, ``moved`` (B,)."""
        if not self.has_step:
            return np.full(step.shape[0], -np.inf)
        chunked = step.max(axis=1) if self.K else np.full(step.shape[0], -np.inf)
        return np.where(moved, chunked, self.plain_step)

    def bound(self, seg: np.ndarray, step: np.ndarray, moved: bool, can_move: bool = False) -> float:
        """The peak by the marginal model: segments and the optimizer step (see :meth:`step_part`)."""
        if not self.has_step:
            return float(seg.max())
        return max(float(seg.max()), self.step_part(step, moved, can_move))

    def bounds(self, seg_max: np.ndarray, step_max: np.ndarray, moved: np.ndarray, can_move: bool) -> np.ndarray:
        """:meth:`bound` for arrays of segment maxima and step-point maxima (broadcast together)."""
        if not self.has_step:
            return np.asarray(seg_max, dtype=np.float64)
        still = np.minimum(self.plain_step, step_max) if can_move else np.full(np.shape(step_max), self.plain_step)
        return np.maximum(seg_max, np.where(moved, step_max, still))

    def lower_bound(self) -> float:
        """The smallest peak any plan in this task's space reaches, by the marginal model."""
        return self.bound(self.base_peaks + self.suffix_min[0], self.step_base + self.suffix_step[0], False,
                          bool(self.suffix_can_move[0]))

    def _check_budget(self, budget: Any) -> int:
        """:func:`~memopt_nb.planners.checks.check_budget` over this task's space: exact (the MILP's floor with the
        placements allowed) for the simulator's own state table; for another table (tests, what-if studies), below the
        activation-only floor the marginal model's floor over the enlarged space decides."""
        if self.state_model is not None and self.state_model.native:
            return check_budget(self.sim, budget, self.space)
        try:
            return check_budget(self.sim, budget, self.space.replace(offload_state=False))
        except BudgetError:
            if self.C == 1:
                raise
        value = resolve_budget(default_budget(self.sim).free_bytes if budget is None else budget,
                               reference=self.sim.profile.peak_bytes)
        seg, step = self.base_peaks + self.suffix_min[0], self.step_base + self.suffix_step[0]
        can_move = bool(self.suffix_can_move[0])
        lowest = self.bound(seg, step, False, can_move)
        if value < lowest:
            part = ("the optimizer step (its unit-by-unit peak with every placement allowed)"
                    if self.step_part(step, False, can_move) >= float(seg.max()) else
                    "the activations and the state that stays resident at the peak segment")
            raise self._floor_error(
                int(lowest), value,
                f"Budget {format_bytes(value)} ({value} bytes) is below the smallest peak the planner's model finds "
                f"for this profile on {self.sim.device.name}{self._strategies_text()} even with state offload "
                f"({self._allowed_text()}): about {format_bytes(int(lowest))} ({int(lowest)} bytes), bounded by "
                f"{part}.")
        return value

    def _check_step_floor(self) -> None:
        """Refuse a budget the optimizer step alone exceeds whatever the plan does (its part of the model is exact)."""
        if not self.has_step:
            return
        step = self.step_part(self.step_base + self.suffix_step[0], False, bool(self.suffix_can_move[0]))
        if self.budget < step:
            value = self.budget
            raise self._floor_error(
                int(step), int(value),
                f"Budget {format_bytes(value)} ({value} bytes) is below what the optimizer step alone needs on "
                f"{self.sim.device.name} with the placements allowed ({self._allowed_text()}): at least "
                f"{format_bytes(int(step))} ({int(step)} bytes), whatever the plan does with activations.")

    def _floor_error(self, lowest: int, value: int, context: str) -> BudgetError:
        """A :class:`BudgetError` for a budget below ``lowest``, the actionable sentence first; the option to let
        more of the state move is spelt for Python and for the magics."""
        options = [] if self.C == len(STATE_CHOICES) else [Advice(
            "allow more of the state to move (offload_state=True" + (", step_in_backward=True" if not
                                                                     self.step_in_backward else "") + ")",
            "allow more of the state to move (--offload-state all" + (" --step-in-backward" if not
                                                                     self.step_in_backward else "") + ")")]
        err = BudgetError("", minimum_bytes=lowest, budget_bytes=int(value), options=options, context=context,
                          peak_bytes=int(self.sim.profile.peak_bytes))
        err.args = (err.reworded("python"),)
        return err

    def _strategies_text(self) -> str:
        return "" if self.strategies == DEFAULT_STRATEGIES else f" using only {', '.join(self.strategies)}"

    def plain_options(self) -> np.ndarray:
        """Per unit the plainest allowed option (an index into the options: keep, else recompute, else the first
        allowed swap timing): keep-all in the default space, where a search or polish starts from "change nothing"."""
        return self.option_ok.argmax(axis=1).astype(np.int64)

    def _allowed_text(self) -> str:
        return "; ".join("/".join(STATE_CHOICES[int(i)]) for i in self.state_ids[1:]) or "none"

    def evaluate(self, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray,
                 states: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Exact peak and time of a batch of plans; ``states``: ``(B, n)`` indices into STATE_CHOICES (None: all 0)."""
        if self.state_model is not None:
            return self.state_model.evaluate(codes, windows, dists, states)
        if states is not None and np.any(states):  # guard: this simulator cannot price a placement
            raise PlanError("this simulator has no state table; only all-resident placements can be evaluated")
        return self.sim.evaluate(codes, windows, dists)

    def time_floor(self, options: np.ndarray) -> np.ndarray | None:
        """A lower bound on the step time of ``(B, n)`` plans (option indices) with every placement resident: the
        time of keeping everything plus each unit's recomputation (the simulator replays both; stalls and copies only
        add to them), less a margin for rounding. ``None`` where the simulator's segments do not give every unit a
        backward (then no bound)."""
        if not self._floor_ok:
            return None
        floor = self.base_time + self.marg_recompute[np.arange(self.n)[None], np.atleast_2d(options)].sum(axis=1)
        return floor - 1e-9 * np.abs(floor)

    def overhead(self, time: np.ndarray) -> np.ndarray:
        """Step time relative to keeping everything, minus one."""
        return np.asarray(time) / self.base_time - 1.0

    def penalty(self, peak: np.ndarray) -> np.ndarray:
        """Zero within budget; a step of 1 plus 20× the relative excess above it."""
        excess = np.asarray(peak) / self.budget - 1.0
        return np.where(excess > 1e-9, 1.0 + 20.0 * excess, 0.0)


# ---------------------------------------------------------------------- the task's tables, compiled once
def _compile_actions(task: PlanningTask, fits: dict[int, np.ndarray]) -> None:
    """The strategies offered, the strategy agent's actions and the option numbering they map to.

    Options: those of every default strategy (keep, recompute, swap × TIMINGS) and, only when allowed and offered,
    those of the opt-in ones up to the last of them (so that the default space's tables, actions and observations
    stay what they were, and an option index means the same in every task)."""
    T = len(TIMINGS)
    #: the strategies the task offers, in registry order: the default ones, and the opt-in ones allowed (one with
    #: variants only if some unit offers one)
    task.offered = tuple(s for s in REGISTRY if s.default or (
        s.name in task.strategies and (not s.variants or bool(fits[s.code].any()))))
    #: the timed strategies the timing agent times
    task.timed_codes = tuple(s.code for s in task.offered if s.timed)
    task.selective = any(s.name == "selective" for s in task.offered)
    #: whether any opt-in strategy is offered
    task.opt_in = any(not s.default for s in task.offered)
    task.action_codes = np.array([c for s in task.offered for c in (s.codes if not s.timed else [s.code])],
                                 dtype=np.int64)
    task.n_strategies = len(task.action_codes)
    task.n_options = max(OPTION_BASE[s.code] + (T if s.timed else len(s.codes)) for s in task.offered)
    ones = np.ones_like(task.action_codes)
    task.action_option = np.where(np.isin(task.action_codes, task.timed_codes), -1,
                                  code_options(task.action_codes, ones, ones))
    #: first option index of each timed strategy (its timing j is option ``timed_base[code] + j``)
    task.timed_base = {s.code: OPTION_BASE[s.code] for s in REGISTRY if s.timed}


def _compile_option_ok(task: PlanningTask, fits: dict[int, np.ndarray]) -> None:
    """``option_ok``: which options each unit may take."""
    n, T = task.n, len(TIMINGS)
    # which options exist for each unit
    N = task.n_options
    task.option_ok = np.zeros((n, N), dtype=bool)
    for s in task.offered:
        b = OPTION_BASE[s.code]
        if s.name in task.strategies:
            task.option_ok[:, b:b + (T if s.timed else len(s.codes))] = (
                fits[s.code][:, None] if fits[s.code].ndim == 1 else fits[s.code])
    timed = [OPTION_BASE[c] for c in task.timed_codes]
    for u in range(n):  # timings with no distinct effect are disabled, keeping the first of each class
        seen = set()
        for j, (w, d) in enumerate(TIMINGS):
            key = (min(u + 1 + w, n), min(u + d, n - 1))
            if key in seen:
                task.option_ok[u, [b + j for b in timed]] = False
            seen.add(key)
    if "keep" not in task.strategies:  # kept only where nothing allowed fits the unit
        task.option_ok[:, KEEP] = ~task.option_ok[:, 1:].any(axis=1)


def _compile_marginals(task: PlanningTask) -> None:
    """The marginal model (each unit alone on each option: what it takes off every segment and adds in seconds)
    and the cost efficiencies the observations and the masks read."""
    n, N, T = task.n, task.n_options, len(TIMINGS)
    # marginal model: unit u alone on option o (a variant the unit does not have is scored as keep: not allowed)
    oc, ow, od = option_codes(np.arange(N))
    units = np.repeat(np.arange(n), N)
    opts = np.tile(np.arange(N), n)
    has = np.ones((n, N), dtype=bool)
    for s in REGISTRY:  # every strategy with variants whose columns the task has, offered or not
        if s.variants and OPTION_BASE[s.code] < N:
            has[:, OPTION_BASE[s.code]:OPTION_BASE[s.code] + len(s.codes)] = task.sim.sel_has
    mc = np.where(has[units, opts], oc[opts], KEEP)
    codes, windows, dists = (np.zeros((n * N, n), dtype=np.int64), np.ones((n * N, n), dtype=np.int64),
                             np.ones((n * N, n), dtype=np.int64))
    rows = np.arange(n * N)
    codes[rows, units] = mc
    windows[rows, units] = np.where(has[units, opts], ow[opts], 1)
    dists[rows, units] = np.where(has[units, opts], od[opts], 1)
    det = task.sim.evaluate(codes, windows, dists, details=True)
    task.marg_peak = (det["peaks"] - task.base_peaks[None]).reshape(n, N, task.S)
    task.marg_time = (det["time"] - task.base_time).reshape(n, N)
    #: seconds unit ``u``'s backward spends recomputing on option ``o`` (the simulator's ``recompute`` of the unit
    #: alone on it); :meth:`time_floor` adds them up
    task.marg_recompute = det["recompute"].reshape(n, N).copy()
    bwd_units = task.sim.seg_unit[task.sim.kind == 1]
    task._floor_ok = bool((np.bincount(bwd_units[bwd_units >= 0], minlength=n)[:n] >= 1).all())
    task.marg_peak[~task.option_ok] = 0.0
    task.marg_time[~task.option_ok] = 0.0
    big = np.where(task.option_ok[:, :, None], task.marg_peak, np.inf)
    task.min_marg = big.min(axis=1)  # (n, S): the most any option of the unit can take off each segment
    # cost efficiency: seconds of overhead per byte taken off each unit's most loaded segment, cheapest option
    red = -task.marg_peak.min(axis=2)  # (n, options): the largest per-segment saving of each option
    with np.errstate(divide="ignore", invalid="ignore"):
        eff = np.where(task.option_ok & (red > 0), np.maximum(task.marg_time, 0.0) / red, np.inf)
    task.best_eff = eff.min(axis=1)  # (n,)
    task.rc_eff = eff[:, RECOMPUTE]
    task.swap_eff = eff[:, task.timed_base[SWAP]:task.timed_base[SWAP] + T].min(axis=1)
    task.max_red = red.max(axis=1)  # (n,)
    if task.C > 1:  # the most a placement takes off a segment adds to it
        task.max_red = task.max_red + np.maximum(-task.st_seg.min(axis=2), 0.0).max(axis=1)


def _compile_copy_ratio(task: PlanningTask) -> None:
    """Per unit, the copy-engine load of swapping it relative to its forward."""
    n = task.n
    # copy-engine load of swapping a unit, relative to its forward: its bytes plus the storages it owns, priced by
    # DeviceSpec.copy_seconds (the slower direction)
    sim, dev = task.sim, task.sim.device
    owned = np.zeros(n)
    np.add.at(owned, sim.g_owner[sim.g_eligible], sim.g_cnt[sim.g_eligible])
    swap_bytes = np.array([u.interior_bytes + u.input_bytes for u in task.profile.units], dtype=float)
    copy = np.maximum(dev.copy_seconds(swap_bytes, owned, "d2h"), dev.copy_seconds(swap_bytes, owned, "h2d"))
    task.copy_ratio = copy / np.maximum(sim.dur[sim.fwd_seg], 1e-9)
