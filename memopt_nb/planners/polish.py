"""The polish: local search on the simulator's exact evaluation that finishes a plan the agents found.

It tries the best single and paired moves (a unit's activation option, its state placement), places the state of the
agents' plan exactly by MILP (:func:`~memopt_nb.planners.milp.place_states`, at most :data:`PLACEMENT_SOLVES` solves),
and also polishes the classic baselines that fit (:data:`HEURISTIC_STARTS`, :data:`HEURISTIC_ROUNDS` rounds of moves
in all); the fastest result wins. Its cost is bounded by counts of work, not by the clock, so that with the same inputs
it returns the same plan however loaded the machine is; the clock only reports what it took. (Each placement MILP
ends at HiGHS' work limits, :data:`~memopt_nb.planners.milp.NODE_LIMIT`, also counts; its wall-clock limit,
:data:`PLACEMENT_SOLVE_SECONDS`, is only a safety net far above what the solves take.) The one exception is a
:class:`Deadline` the caller sets (``search(time_limit=...)``): where it passes, the polish stops with the plan it has
and the deadline records that the clock cut it.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core.errors import MemoptError
from ..core.plan import STATE_CHOICES
from .baselines import BASELINES
from .milp import place_states
from .options import code_options, option_codes
from .task import PlanningTask

__all__ = ["Deadline", "HEURISTIC_PATIENCE", "HEURISTIC_ROUNDS", "HEURISTIC_STARTS", "PLACEMENT_MAX_UNITS",
           "PLACEMENT_SOLVES", "PLACEMENT_SOLVE_SECONDS", "option_arrays", "polish", "polish_exact_placements",
           "polish_heuristic_starts", "repair", "to_options"]


class Deadline:
    """A point in time (``time.perf_counter()``) after which work stops with what it has; ``seconds=None``: never.

    ``cut`` becomes ``True`` once the deadline has stopped something (a plan then depends on the machine's speed)."""

    def __init__(self, seconds: float | None, start: float | None = None) -> None:
        self.at = None if seconds is None else (time.perf_counter() if start is None else start) + float(seconds)
        self.cut = False

    def passed(self) -> bool:
        """Whether the deadline has passed (recorded in ``cut``: the caller stops on it)."""
        if self.at is not None and time.perf_counter() >= self.at:
            self.cut = True
        return self.cut

    def seconds_left(self, cap: float) -> float:
        """Seconds a solve may take: ``cap`` (its safety net), or less where the deadline comes first (at least 1)."""
        return cap if self.at is None else max(1.0, min(cap, self.at - time.perf_counter()))


NEVER = Deadline(None)


def option_arrays(opt_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Option indices (see :mod:`memopt_nb.planners.options`) as strategy codes, windows and
    distances."""
    return option_codes(opt_idx)


def to_options(codes: np.ndarray, windows: np.ndarray, dists: np.ndarray) -> np.ndarray:
    return code_options(codes, windows, dists)


#: Exact-placement MILPs (:func:`polish_exact_placements`) the polish may solve: a start beyond them is skipped
#: (``meta["polish_placement_skipped"]``). A count, not seconds, so that the plan does not depend on the machine's load.
PLACEMENT_SOLVES = 6

#: HiGHS' time limit on each exact-placement MILP: a safety net far above what the solves take (well under a second at
#: 12 units; they end at their node limit, :func:`~memopt_nb.planners.milp.node_limit`, or sooner); a solve that
#: reaches it returns the best placement found so far, which then depends on the machine
#: (``meta["polish_placement_stops"]`` says what ended each solve).
PLACEMENT_SOLVE_SECONDS = 600.0

#: Units above which the polish places no state exactly (its starts are skipped, ``meta["polish_placement_skipped"]``):
#: the placement MILP grows with the square of the units (over a million nonzeros at 168 units, where HiGHS's presolve
#: alone outweighs the rest of the polish); the polish's own placement moves still place the state there. A count, not
#: seconds, like the rest of the polish.
PLACEMENT_MAX_UNITS = 64


def _time_of(task: PlanningTask, c: np.ndarray, w: np.ndarray, d: np.ndarray, st: np.ndarray) -> float:
    """One plan's exact step time (codes, windows, distances, placements), ``inf`` where it misses the budget."""
    peak, t = task.evaluate(c[None], w[None], d[None], np.asarray(st, dtype=np.int64)[None])
    return float(t[0]) if peak[0] <= task.budget else math.inf


def polish_exact_placements(task: PlanningTask, current: tuple, agents: tuple, moves: int,
                             info: dict[str, Any] | None = None, deadline: Deadline = NEVER) -> tuple:
    """Where placements may move, more starts for the polish: the agents' activation decisions, keep-all (where keep
    is not allowed, each unit's plainest allowed option:
    :meth:`~memopt_nb.planners.task.PlanningTask.plain_options`) and the
    activations of ``current`` (the agents' plan polished), each with the fastest state placement that fits the budget
    for those activations (exact: the MILP with activations fixed, :func:`~memopt_nb.planners.place_states`), then
    polished. A start whose polished plan is the best so far changed activations and placements together: its
    activations are placed exactly and polished again (``"..._again"``), until that no longer helps. Returns the
    fastest feasible of the polished plans (``current`` first: ties keep it). Only for the cost model's own state
    table (a hand-made one is not the MILP's), and up to :data:`PLACEMENT_MAX_UNITS` units. At most
    :data:`PLACEMENT_SOLVES` MILPs are solved; ``info`` receives that budget, the number of starts skipped for lack
    of it and, where one of these starts wins, ``polish_start`` (``"agents_placed"``, ``"plain_placed"``,
    ``"polished_placed"``, or one of them with ``"_again"``). Once ``deadline`` passes, the starts left are skipped
    and the solve under way ends at its wall-clock limit."""
    if task.C == 1 or task.state_model is None or not task.state_model.native:
        return (*current, moves)

    best, best_t = (*current, moves), _time_of(task, *current)
    solves, skipped, stops = 0, 0, []
    starts = [("agents_placed", agents[:3]), ("plain_placed", option_arrays(task.plain_options())),
              ("polished_placed", current[:3])]
    seen: set[bytes] = set()
    while starts:
        label, (c, w, d) = starts.pop(0)
        key = to_options(c, w, d).tobytes()
        if key in seen:
            continue
        seen.add(key)
        if solves >= PLACEMENT_SOLVES or task.n > PLACEMENT_MAX_UNITS or deadline.passed():
            skipped += 1
            continue
        solves += 1
        st = place_states(task.sim, task.budget, c, w, d, task.space,
                          time_limit=deadline.seconds_left(PLACEMENT_SOLVE_SECONDS), stops=stops)
        if stops and stops[-1] == "time_limit" and deadline.at is not None:
            deadline.cut = True
        c2, w2, d2, st2, m = polish(task, c, w, d, np.asarray(st, dtype=np.int64), deadline=deadline)
        t = _time_of(task, c2, w2, d2, st2)
        if t < best_t * (1 - 1e-12):
            best, best_t = (c2, w2, d2, st2, moves + m + 1), t
            if info is not None:
                info["polish_start"] = label
            # the polish changed the activations too: place the state for those, exactly, and polish again
            starts.append((label.removesuffix("_again") + "_again", (c2, w2, d2)))
    if info is not None:
        info.update(polish_placement_budget_solves=PLACEMENT_SOLVES, polish_placement_skipped=skipped,
                    polish_placement_stops=stops)
    return best


#: Rounds of moves (each the best single or paired move, see :func:`polish`) the polish's heuristic starts
#: (:func:`polish_heuristic_starts`) may take together: a start is begun only while some are left
#: (``meta["polish_heuristic_skipped"]`` lists the others) and its polish stops when they run out
#: (``meta["polish_heuristic_cut"]``). A count, not seconds, so that a seed gives the same plan however loaded the
#: machine is; normally all of them run to the end.
HEURISTIC_ROUNDS = 300

#: At depth (from :data:`STACK_FROM_UNITS` units), the heuristic starts stop once this many in a row, polished, did not
#: beat the best plan so far (``meta["polish_heuristic_skipped"]`` lists the rest): a round there simulates every
#: unit's every option and placement pair, and the starts are taken fastest first, so the later ones rarely win.
HEURISTIC_PATIENCE = 2

#: The baselines (:data:`memopt_nb.planners.BASELINES`) whose plans the polish also starts from, where their plan fits
#: the budget and lies in the search's space.
HEURISTIC_STARTS = ("none", "recompute_all", "sqrt_n", "swap_all", "capuchin", "selective_layer", "op_sac",
                    "recompute_offload_all", "state_offload", "state_offload_recompute", "step_in_backward",
                    "step_in_backward_recompute")


#: The state baselines among :data:`HEURISTIC_STARTS` and the placement each gives every unit.
_STATE_STARTS = {"state_offload": ("offload", "offload", "resident"),
                 "state_offload_recompute": ("offload", "offload", "resident"),
                 "step_in_backward": ("resident", "step", "resident"),
                 "step_in_backward_recompute": ("resident", "step", "resident")}


def _heuristic_starts(task: PlanningTask, deadline: Deadline = NEVER
                      ) -> list[tuple[str, np.ndarray, np.ndarray, float]]:
    """The plans of :data:`HEURISTIC_STARTS` that fit the budget in the task's space, fastest first (ties: the order
    of the list), as (name, options, placements, step time).

    A baseline's plan is used as it is: activation decisions (the classic heuristics, all-resident) or its fixed
    placements (the state baselines); it is left out when it needs a strategy, timing or placement the task does not
    allow, refuses the budget, or misses it; those not yet built when ``deadline`` passes are left out."""
    n, found = task.n, []
    allowed = np.zeros((n, len(STATE_CHOICES)), dtype=bool)
    allowed[:, 0] = True
    allowed[:, task.state_ids] = task.state_ok
    # a baseline that gives every unit that can take it recompute_offload lies outside a space without it (or is
    # keep-all, "none", where no unit can take it): not built, which saves its budget check's floor over every strategy
    skip = set()
    if "recompute_offload" not in task.strategies and (task.sim.recomputable & task.sim.swappable).any():
        skip.add("recompute_offload_all")
    # a state baseline whose placement the task does not allow: not built either (its budget check solves a MILP over
    # its own space, tens of seconds at a few hundred units, for a plan that would be left out)
    for name, placement in _STATE_STARTS.items():
        if STATE_CHOICES.index(placement) not in task.state_ids:
            skip.add(name)
    for name in HEURISTIC_STARTS:
        if name in skip or deadline.passed():
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = BASELINES[name](task.sim, task.budget)
            c, w, d = (x[0] for x in task.sim.encode(plan))
        except MemoptError:  # outside its own space (no save-sets, a budget below its floor)
            continue
        opts = to_options(c, w, d)
        st = np.asarray(plan.state_indices, dtype=np.int64)
        inside = (opts < task.n_options) & task.option_ok[np.arange(n), np.minimum(opts, task.n_options - 1)]
        if not (inside.all() and allowed[np.arange(n), st].all()):
            continue
        peak, t = task.evaluate(c[None], w[None], d[None], st[None])
        if peak[0] <= task.budget:
            found.append((name, opts, st, float(t[0])))
    found.sort(key=lambda x: x[3])
    return found


def polish_heuristic_starts(task: PlanningTask, current: tuple, info: dict[str, Any],
                            deadline: Deadline = NEVER) -> tuple:
    """Polish from the baselines' plans too (:func:`_heuristic_starts`, fastest first, each one not already among the
    starts) while :data:`HEURISTIC_ROUNDS` last; returns the fastest feasible plan, ``current`` (codes, windows,
    distances, placements, moves) on ties. ``info`` receives ``polish_heuristic_starts`` (the baselines polished),
    ``polish_heuristic_skipped`` (left out for lack of rounds), ``polish_heuristic_cut`` (polished until the rounds ran
    out), ``polish_heuristic_budget_rounds``, ``polish_heuristic_seconds`` (what they took: reported, never read) and,
    where one of them wins, ``polish_start`` (its name). Once ``deadline`` passes, the starts left are skipped."""
    t0 = time.perf_counter()
    left = HEURISTIC_ROUNDS
    late: list[str] = []
    if left > 0 and not deadline.passed():
        starts = _heuristic_starts(task, deadline)
    else:
        starts, late = [], list(HEURISTIC_STARTS)
    best, best_t = current, _time_of(task, *current[:4])
    seen = {(to_options(*current[:3]).tobytes(), np.asarray(current[3], dtype=np.int64).tobytes())}
    used: list[str] = []
    cut: list[str] = []  # polished until the rounds ran out, perhaps short of where moves stop helping
    misses = 0  # starts in a row that did not beat the best plan
    for name, opts, st, _ in starts:
        if (opts.tobytes(), st.tobytes()) in seen:
            continue
        if left <= 0 or (task.n >= STACK_FROM_UNITS and misses >= HEURISTIC_PATIENCE) or deadline.passed():
            late.append(name)
            continue
        seen.add((opts.tobytes(), st.tobytes()))
        used.append(name)
        rounds = min(left, POLISH_ROUNDS)
        c, w, d, st2, m = polish(task, *option_arrays(opts), st, max_rounds=rounds, deadline=deadline)
        left -= min(m + 1, rounds)  # the moves made and the round that found none
        if m == rounds < POLISH_ROUNDS:
            cut.append(name)
        t = _time_of(task, c, w, d, st2)
        if t < best_t * (1 - 1e-12):
            best, best_t = (c, w, d, st2, m), t
            info["polish_start"] = name
            misses = 0
        else:
            misses += 1
    info.update(polish_heuristic_starts=used, polish_heuristic_skipped=late, polish_heuristic_cut=cut,
                polish_heuristic_budget_rounds=HEURISTIC_ROUNDS, polish_heuristic_seconds=time.perf_counter() - t0)
    return best


def polish(task: PlanningTask, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray,
           states: np.ndarray | None = None, max_rounds: int | None = None, deadline: Deadline = NEVER
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Best-improvement local search while the simulator says it helps; returns codes, windows, distances, placements
    (indices into STATE_CHOICES) and the number of moves made. At most ``max_rounds`` rounds (default
    :data:`POLISH_ROUNDS`; the plan so far is returned), and none once ``deadline`` has passed.

    A move changes one unit's option (strategy and timing). Each round takes the fastest move within budget (ties: the
    earlier unit, then the earlier option) if it is faster than the current plan. Where placements may be chosen, a
    move may also change one unit's placement, alone or together with one unit's option (so a faster activation option
    that needs a little more memory can be paid for by moving some state). Pairs are scored with the cost model's
    separable state part (``sim/COST_MODEL.md``) and the chosen move is checked with the exact evaluation before it is
    taken. Without placements, a move is simulated only where a lower bound on its time does not already rule it out
    (:func:`_best_move`): the same moves as simulating every one. From :data:`STACK_FROM_UNITS` units up a round takes
    its best move and then the others that still help on top of it (:func:`_stack`), so one "move" may change several
    units.
    """
    n = task.n
    cur = to_options(np.asarray(codes), np.asarray(windows), np.asarray(dists))
    cur_st = np.zeros(n, dtype=np.int64) if states is None else np.asarray(states, dtype=np.int64).copy()
    peak, t = task.evaluate(*[a[None] for a in option_arrays(cur)], cur_st[None])
    best_t = float(t[0]) if peak[0] <= task.budget else math.inf
    moves = 0
    last: dict = {}  # the option moves' simulation, while the options stay
    units, opts = np.nonzero(task.option_ok)  # every allowed (unit, option), unit-major
    rows = np.arange(units.size)
    simulated = 0  # moves the last round simulated
    for _ in range(POLISH_ROUNDS if max_rounds is None else max_rounds):
        if deadline.passed():
            break
        cand = np.repeat(cur[None], units.size, axis=0)
        cand[rows, units] = opts
        if task.C > 1:
            cand, cand_st = _best_pairs(task, cur, cur_st, cand, last=last)
            peak, t = task.evaluate(*option_arrays(cand), cand_st)
            t = np.where(peak <= task.budget, t, math.inf)
            i = int(np.argmin(t))
            found = float(t[i])
            if n >= STACK_FROM_UNITS and found < best_t * (1 - 1e-12):  # at depth: the round's moves, stacked
                ok = np.flatnonzero(t < best_t * (1 - 1e-12))
                ok = ok[np.lexsort((ok, t[ok]))]
                cur, cur_st, best_t = _stack(task, cur, cur_st, cand[ok], cand_st[ok], t[ok])
                moves += 1
                continue
        elif n >= STACK_FROM_UNITS:  # at depth: the round's improving moves, stacked
            stacked, found = _stacked_moves(task, cur, cur_st, units, opts, cand, best_t * (1 - 1e-12))
            if stacked is None:
                break
            cur, best_t = stacked, found
            moves += 1
            continue
        else:  # where the bound left most moves in the running last round, one batch of all (fewer simulator calls)
            i, found, simulated = _best_move(task, cand, cur_st, best_t * (1 - 1e-12),
                                             block=cand.shape[0] if simulated > 0.75 * cand.shape[0] else None)
            cand_st = np.repeat(cur_st[None], i + 1, axis=0)
        if not found < best_t * (1 - 1e-12):
            break
        cur, cur_st, best_t = cand[i], cand_st[i], found
        moves += 1
    c, w, d = option_arrays(cur)
    return c, w, d, cur_st, moves


def repair(task: PlanningTask, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray,
           states: np.ndarray | None = None, max_rounds: int | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, bool]:
    """From a plan above the budget, move one unit's option at a time down the peak until it fits: each round takes
    the fastest move that fits the budget if there is one, else the move with the lowest peak (ties: the faster) if it
    lowers the peak. Placements stay as given. Returns codes, windows, distances, placements, the moves made and
    whether the plan fits; at most ``max_rounds`` rounds (default: two per unit).

    The search's way out where its agents found nothing within the budget (at a tight budget on hundreds of units a
    random walk rarely lands inside it): the plan they got closest with, repaired, then polished like theirs."""
    n = task.n
    cur = to_options(np.asarray(codes), np.asarray(windows), np.asarray(dists))
    st = np.zeros(n, dtype=np.int64) if states is None else np.asarray(states, dtype=np.int64).copy()
    peak, _ = task.evaluate(*[a[None] for a in option_arrays(cur)], st[None])
    cur_peak = float(peak[0])
    units, opts = np.nonzero(task.option_ok)
    rows = np.arange(units.size)
    sts = np.repeat(st[None], units.size, axis=0)
    moves = 0
    for _ in range(2 * n if max_rounds is None else max_rounds):
        if cur_peak <= task.budget:
            break
        cand = np.repeat(cur[None], units.size, axis=0)
        cand[rows, units] = opts
        peak, t = task.evaluate(*option_arrays(cand), sts)
        fits = peak <= task.budget
        i = int(np.argmin(np.where(fits, t, math.inf))) if fits.any() else int(np.lexsort((t, peak))[0])
        if not (fits[i] or peak[i] < cur_peak):
            break
        cur, cur_peak = cand[i], float(peak[i])
        moves += 1
    c, w, d = option_arrays(cur)
    return c, w, d, st, moves, cur_peak <= task.budget


#: Rounds one :func:`polish` takes at most (each makes one move).
POLISH_ROUNDS = 100

#: From this many units up, a round of :func:`polish` takes several of its improving moves at once (:func:`_stack`): a
#: round simulates every unit's every option, so at depth one move per round would cost rounds in proportion to the
#: units and time in proportion to their square.
STACK_FROM_UNITS = 96

#: Batches of stacked plans :func:`_stack` tries per round (each drops the move that stopped the last one).
STACK_TRIES = 4

#: Improving moves :func:`_stack` stacks per batch at most.
STACK_MOVES = 32

#: Rows :func:`_best_move` simulates in its first batch (then 4x more each time): few enough that a bound that rules
#: most moves out saves most of the work, enough that the simulator's per-call overhead stays small.
MOVE_BLOCK = 128


def _best_move(task: PlanningTask, cand: np.ndarray, states: np.ndarray, below: float,
               block: int | None = None) -> tuple[int, float, int]:
    """Of the plans ``cand`` (option indices, all with placements ``states``), the fastest within budget if it is
    faster than ``below`` (ties: the first), as (row, time, rows simulated); else a row no faster than ``below``
    (row 0 and ``inf`` if none fits).

    The same answer as simulating every row, simulating fewer: the rows whose lower bound on the time
    (:meth:`~memopt_nb.planners.task.PlanningTask.time_floor`) is below ``below`` are simulated in order of their
    bound:
    the first ``block`` (default :data:`MOVE_BLOCK`), then at once every other row whose bound does not exceed the
    fastest time found, as the rest cannot be faster than it or tie with it.
    """
    block = block or MOVE_BLOCK
    floor = task.time_floor(cand) if not states.any() else None
    if floor is None:  # no bound: simulate every row
        floor = np.full(cand.shape[0], -math.inf)
        block = cand.shape[0]
    order = np.argsort(floor, kind="stable")
    all_st = np.repeat(states[None], cand.shape[0], axis=0)
    best_i, best, simulated = 0, math.inf, 0
    lo = 0
    while lo < order.size:
        idx = order[lo: lo + block]
        lo += block
        block = order.size  # then every row the fastest found so far leaves in the running, at once
        idx = idx[(floor[idx] <= best) & (floor[idx] < below)]
        if not idx.size:
            break  # the bounds ascend: every row left is slower than the fastest found, or no faster than ``below``
        simulated += idx.size
        c, w, d = option_arrays(cand[idx])
        peak, t = task.evaluate(c, w, d, all_st[: idx.size])
        t = np.where(peak <= task.budget, t, math.inf)
        m = float(t.min())
        at = int(idx[t == m].min())
        if m < best or (m == best and at < best_i):
            best_i, best = at, m
    return best_i, best, simulated


def _stacked_moves(task: PlanningTask, cur: np.ndarray, states: np.ndarray, units: np.ndarray, opts: np.ndarray,
                   cand: np.ndarray, below: float) -> tuple[np.ndarray | None, float]:
    """One round of the polish at depth, activations only: the plan (option indices) that takes this round's best move
    and as many of its other improving moves as help (:func:`_stack`), with its time; ``(None, inf)`` where no move is
    faster than ``below``.

    Every move (row of ``cand``: ``cur`` with unit ``units[r]`` set to ``opts[r]``) whose time bound is below ``below``
    is simulated; those within budget and faster than ``below`` are ranked fastest first (ties: the earlier row), one
    per unit."""
    floor = task.time_floor(cand) if not states.any() else None
    rows = np.arange(cand.shape[0]) if floor is None else np.flatnonzero(floor < below)
    if not rows.size:
        return None, math.inf
    sts = np.repeat(states[None], rows.size, axis=0)
    peak, t = task.evaluate(*option_arrays(cand[rows]), sts)
    good = (peak <= task.budget) & (t < below)
    if not good.any():
        return None, math.inf
    rows, t = rows[good], t[good]
    order = np.lexsort((rows, t))
    rows, t = rows[order], t[order]
    _, first = np.unique(units[rows], return_index=True)  # each unit's fastest move
    rows, t = rows[np.sort(first)], t[np.sort(first)]
    best, _, best_t = _stack(task, cur, states, cand[rows], np.repeat(states[None], rows.size, axis=0), t)
    return best, best_t


def _stack(task: PlanningTask, cur: np.ndarray, cur_st: np.ndarray, plans: np.ndarray, plan_st: np.ndarray,
           times: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Stack improving moves: ``plans`` / ``plan_st`` are moves from (``cur``, ``cur_st``) (options and placements),
    within budget, ranked fastest first with their ``times``. Starting from the first, the changes of the others are
    added in that order (a move that touches a unit already changed is skipped), each prefix simulated in one batch,
    and the fastest prefix within budget is kept; the move after it is dropped and the rest tried again,
    :data:`STACK_TRIES` batches of at most :data:`STACK_MOVES`. Returns options, placements and time: never slower
    than the first move, which is returned where nothing on top of it helps."""
    best, best_st, best_t = plans[0].copy(), plan_st[0].copy(), float(times[0])
    changes = [((p != cur), (s != cur_st)) for p, s in zip(plans, plan_st, strict=True)]
    queue = list(range(1, len(plans)))
    for _ in range(STACK_TRIES):
        taken = (best != cur) | (best_st != cur_st)
        queue = [k for k in queue if not ((changes[k][0] | changes[k][1]) & taken).any()]
        if not queue:
            break
        out, out_st, kept = [], [], []
        p, s = best.copy(), best_st.copy()
        for k in queue:
            if len(kept) == STACK_MOVES:
                break
            co, cs = changes[k]
            if ((co | cs) & taken).any():
                continue
            p, s = p.copy(), s.copy()
            p[co], s[cs] = plans[k][co], plan_st[k][cs]
            taken = taken | co | cs
            out.append(p)
            out_st.append(s)
            kept.append(k)
        peak, tt = task.evaluate(*option_arrays(np.array(out)), np.array(out_st))
        tt = np.where(peak <= task.budget, tt, math.inf)
        j = int(np.argmin(tt))
        if tt[j] < best_t * (1 - 1e-12):
            best, best_st, best_t = out[j], out_st[j], float(tt[j])
            drop = set(kept[: j + 2])  # the kept prefix, and the move after it that stopped it
        else:
            drop = {kept[0]}  # the next move does not help on top of the best: dropped
        queue = [k for k in queue if k not in drop]
    return best, best_st, best_t


def _best_pairs(task: PlanningTask, cur: np.ndarray, cur_st: np.ndarray, cand: np.ndarray,
                keep: int = 8, last: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ``keep`` fastest moves within budget among (one unit's option changed, or none) x (one unit's placement
    changed, or none), scored by the separable state part; as option and placement arrays for exact evaluation.

    Ties go to the earlier option, then the earlier placement. The time of every pair is cheap; the peak is exact only
    for the pairs a bound has not ruled out (:func:`_may_fit`), in order of time until ``keep`` fit
    (:func:`_first_feasible`). ``last`` keeps the simulation of the option moves for the next call: after a move that
    changed only placements, the options and so the option moves are the same.
    """
    n = task.n
    acts = np.concatenate([cur[None], cand])  # row 0: no option changed
    st_units, st_local = np.nonzero(task.state_ok)
    sts = np.repeat(cur_st[None], st_units.size + 1, axis=0)  # row 0: no placement changed
    sts[np.arange(1, st_units.size + 1), st_units] = task.state_ids[st_local]
    local = np.searchsorted(task.state_ids, sts)  # placements as local choices j
    units = np.arange(n)[None]
    # each row changes one unit's placement of the current ones: the current sum plus that unit's difference (the
    # rows are bytes, whole numbers, so this is the sum over every unit exactly, without a (Z, n, S) array)
    cur_local = local[0]
    seg0 = task.st_seg[units[0], cur_local].sum(axis=0)  # (S,) the current placements
    step0 = task.step_base + task.st_step[units[0], cur_local].sum(axis=0)  # (K,)
    d_seg = task.st_seg[st_units, st_local] - task.st_seg[st_units, cur_local[st_units]]  # one unit's change each
    d_step = task.st_step[st_units, st_local] - task.st_step[st_units, cur_local[st_units]]
    seg = np.concatenate([seg0[None], seg0[None] + d_seg])  # (Z, S)
    step = np.concatenate([step0[None], step0[None] + d_step])
    moved = (sts != 0).any(axis=1)
    step_max = task.step_part_many(step, moved)
    st_time = task.st_time[units, local].sum(axis=1) + np.where(moved, task.chunk_extra, 0.0)
    key = acts.tobytes()
    det = last.get(key) if last is not None else None
    if det is None:
        det = task.sim.evaluate(*option_arrays(acts), details=True)
        if last is not None:
            last.clear()
            last[key] = det
    peaks = det["peaks"]
    time = det["time"][:, None] + st_time[None]  # (A, Z)
    may = _may_fit(peaks, seg, task.budget) & (step_max <= task.budget)[None]

    def fits(flat: np.ndarray) -> np.ndarray:
        a, z = np.divmod(flat, time.shape[1])
        return np.maximum((peaks[a] + seg[z]).max(axis=1), step_max[z]) <= task.budget

    flat = _first_feasible(time.ravel(), np.flatnonzero(may), fits, keep)
    a, z = np.divmod(flat, time.shape[1])
    if not flat.size:
        a, z = np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
    out_a, out_s = acts[a], sts[z]
    # two units' placements changed at once, options unchanged (e.g. two units trading what they offload)
    pairs = _best_state_pairs(task, peaks[0] + seg0, step0, d_seg, d_step, float(det["time"][0]), cur_st, st_units,
                              st_local, keep)
    if pairs.size:
        out_a = np.concatenate([out_a, np.repeat(cur[None], pairs.shape[0], axis=0)])
        out_s = np.concatenate([out_s, pairs])
    return out_a, out_s


def _may_fit(rows: np.ndarray, cols: np.ndarray, budget: float) -> np.ndarray:
    """``(A, Z)``: False where ``max_s (rows[a, s] + cols[z, s])`` certainly exceeds ``budget``, judged by two of its
    own terms (never False where it does not). Rounding is monotone, so a row plus every column's smallest entry bounds
    that row's terms from below; the segment where this bound peaks is tried with every column, likewise per column."""
    A, Z = rows.shape[0], cols.shape[0]
    if not A or not Z:
        return np.zeros((A, Z), dtype=bool)
    s_a = (rows + cols.min(axis=0)[None]).argmax(axis=1)
    s_z = (rows.min(axis=0)[None] + cols).argmax(axis=1)
    by_row = rows[np.arange(A), s_a][:, None] + cols[:, s_a].T
    by_col = rows[:, s_z] + cols[np.arange(Z), s_z][None]
    return (by_row <= budget) & (by_col <= budget)


def _first_feasible(time: np.ndarray, cand: np.ndarray, fits: Callable[[np.ndarray], np.ndarray], keep: int,
                    block: int = 256) -> np.ndarray:
    """Of the flat indices ``cand`` (ascending), the ``keep`` with the smallest finite ``time`` (ties: the lower index)
    that ``fits``, checking them in that order a block at a time (blocks growing 4x), so most are never checked."""
    cand = cand[np.isfinite(time[cand])]
    tc = time[cand]
    found: list[np.ndarray] = []
    count, lo = 0, 0
    while count < keep and lo < cand.size:
        idx = _smallest(tc, cand, lo + block)[lo:]
        ok = idx[fits(idx)][: keep - count]
        found.append(ok)
        count += ok.size
        lo += block
        block *= 4
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def _smallest(tc: np.ndarray, cand: np.ndarray, m: int) -> np.ndarray:
    """The first ``m`` of ``cand`` (ascending) ordered by ``tc`` (ties: the lower index), as a stable sort of all of
    them would give, without sorting them all (a round at depth has millions)."""
    if m >= tc.size:
        return cand[np.argsort(tc, kind="stable")]
    kth = np.partition(tc, m - 1)[m - 1]
    sel = np.flatnonzero(tc <= kth)  # every one that can be among the first m, ties at the m-th included
    return cand[sel[np.lexsort((sel, tc[sel]))][:m]]


def _best_state_pairs(task: PlanningTask, seg0: np.ndarray, step0: np.ndarray, d_seg: np.ndarray, d_step: np.ndarray,
                      time0: float, cur_st: np.ndarray, units: np.ndarray, local: np.ndarray, keep: int) -> np.ndarray:
    """The ``keep`` fastest placements within budget that change two units' placements of ``cur_st`` (options fixed),
    scored by the separable state part (ties: the earlier pair). ``seg0`` / ``step0``: the per-segment peaks and the
    step points of the current plan, with its time ``time0``; single change ``i`` sets unit ``units[i]`` to local
    choice ``local[i]``, changing them by ``d_seg[i]`` / ``d_step[i]`` (as :func:`_best_pairs` computed them)."""
    n = task.n
    ids = task.state_ids[local]
    loc = np.searchsorted(task.state_ids, cur_st)
    d_time = task.st_time[units, local] - task.st_time[units, loc[units]]
    time_base = time0 + task.st_time[np.arange(n), loc].sum()
    nonzero = int((cur_st != 0).sum())
    d_nz = (ids != 0).astype(int) - (cur_st[units] != 0).astype(int)
    Z = units.size
    moved = nonzero + d_nz[:, None] + d_nz[None, :] > 0  # (Z, Z): pair (i, j)
    time = (time_base + d_time)[:, None] + d_time[None, :] + np.where(moved, task.chunk_extra, 0.0)
    pair = (units[:, None] != units[None, :]) & (np.arange(Z)[:, None] < np.arange(Z)[None, :])
    may = pair & _may_fit(seg0[None] + d_seg, d_seg, task.budget)
    if task.has_step and task.K:  # the step's points likewise once anything moves; the plain step is exact
        may &= np.where(moved, _may_fit(step0[None] + d_step, d_step, task.budget), task.plain_step <= task.budget)

    def fits(flat: np.ndarray) -> np.ndarray:
        i, j = np.divmod(flat, Z)
        seg = (seg0[None] + d_seg[i]) + d_seg[j]
        step = task.step_part_many((step0[None] + d_step[i]) + d_step[j], moved[i, j])
        return np.maximum(seg.max(axis=1), step) <= task.budget

    i, j = np.divmod(_first_feasible(time.ravel(), np.flatnonzero(may), fits, keep), Z)
    out = np.repeat(cur_st[None], i.size, axis=0)
    out[np.arange(i.size), units[i]] = ids[i]
    out[np.arange(i.size), units[j]] = ids[j]
    return out


