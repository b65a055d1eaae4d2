"""``memopt.search``: the dual-agent PPO search for a plan (MemOpt's method), with an optional polish."""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..device import DeviceSpec
from ..errors import MemoptError
from ..plan import DEFAULT_STRATEGIES, STATE_CHOICES, Plan
from ..simulate import RECOMPUTE_OFFLOAD
from ..solvers.baselines import BASELINES
from ..solvers.common import make_plan
from ..solvers.space import plan_decisions
from .env import STRATEGY, TIMING, MemoryPlanningEnv, decision_order
from .ppo import PPOConfig, train
from .task import PlanningTask, code_options, option_codes

__all__ = ["search", "polish", "plan_from_arrays", "SearchTracker", "default_timesteps", "default_restarts",
           "default_update_epochs", "default_risk_quantile", "RISK_QUANTILE", "METHOD"]

METHOD = "memopt-ppo"


def default_timesteps(n_units: int, states: bool = False) -> int:
    """The default PPO budget: about 1,500 episodes' worth of steps, between 30k (45k where state may move,
    ``states=True``) and 100k.

    Where state may move the strategy agent learns risk-seeking (:func:`default_risk_quantile`); the extra steps on
    small problems took the agents alone over 64 runs of benchmarks/RESULTS.md's whole-step instances from 1.0085 /
    1.0956 of the optimum (median / worst) to 1.0054 / 1.0646, for about 10 s more search on the smallest models
    (ResNet-18's 8 units: 20 → 30 s on 2 cores, 2026-12-05). From 29 units up the budget is the same either way.
    """
    return int(min(100_000, max(45_000 if states else 30_000, 1500 * (n_units + 1))))


#: The share of each rollout's episodes the strategy agent learns from where state may move (see
#: :func:`default_risk_quantile`).
RISK_QUANTILE = 0.25


def default_risk_quantile(task: PlanningTask) -> float | None:
    """Where state may move (``task.C > 1``): :data:`RISK_QUANTILE` — the strategy agent learns only from the best
    quarter of each rollout's episodes (:attr:`~memopt_nb.rl.ppo.PPOConfig.risk_quantile`, the risk-seeking policy
    gradient of Petersen et al. 2021); elsewhere ``None`` (ordinary PPO, as before).

    The search returns the best plan the agents ever sampled, so it is their best episodes that should improve, not
    their average one, which ordinary PPO optimizes and then settles on (by about update 17 of 233 on ConvNeXt-Atto).
    Measured on the 16 whole-step instances of benchmarks/RESULTS.md over seeds 0–3 (64 runs), the agents alone ÷
    the MILP's plan, median / worst / runs above 1.05: ordinary PPO 1.0207 / 1.0851 / 11; risk-seeking 1.0085 /
    1.0956 / 5 (the worst is ViT-Tiny at 60 %: identical blocks, many near-equal plans); with the 45k-step floor of
    :func:`default_timesteps` too, 1.0054 / 1.0646 / 1. Over the activation-only spaces (issue 12's figures) the
    agents are unchanged: ordinary PPO, as before.
    """
    return RISK_QUANTILE if task.C > 1 else None


def default_restarts(n_units: int) -> int:
    """Independent agent pairs sharing the budget: two for small problems, where one pair settles early."""
    return 2 if n_units <= 24 else 1


def default_update_epochs(task: PlanningTask) -> int:
    """PPO epochs over each rollout: CleanRL's 4, and 8 where the strategy agent may also choose
    ``recompute_offload`` or a selective save-set (``strategies=``).

    Measured on the transformers cases of ``benchmarks/planner_quality.py --wide --hf vit,gpt2`` (RESULTS.md,
    2026-12-05): with those strategies twice the epochs took the agents alone on ViT at 64 fine units from 0.97–1.10
    of the MILP's plan over four seeds to 0.96–1.00, where twice the steps, a larger learning rate or more entropy did
    not; over the whole-step space with keep / recompute / swap they moved as many cases up as down.
    """
    return 8 if RECOMPUTE_OFFLOAD in task.timed_codes or task.selective else 4


def _option_arrays(opt_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Option indices (see :class:`~memopt_nb.rl.task.PlanningTask`) as strategy codes, windows and distances."""
    return option_codes(opt_idx)


def _to_options(codes: np.ndarray, windows: np.ndarray, dists: np.ndarray) -> np.ndarray:
    return code_options(codes, windows, dists)


#: Seconds the polish's exact-placement MILPs (:func:`_polish_exact_placements`) may take together; each solve gets at
#: most 10 s of it, and a start left with under 1 s is skipped (``meta["polish_placement_skipped"]``).
PLACEMENT_SECONDS = 15.0


def _time_of(task: PlanningTask, c: np.ndarray, w: np.ndarray, d: np.ndarray, st: np.ndarray) -> float:
    """One plan's exact step time (codes, windows, distances, placements), ``inf`` where it misses the budget."""
    peak, t = task.evaluate(c[None], w[None], d[None], np.asarray(st, dtype=np.int64)[None])
    return float(t[0]) if peak[0] <= task.budget else math.inf


def _polish_exact_placements(task: PlanningTask, current: tuple, agents: tuple, moves: int,
                             info: dict[str, Any] | None = None) -> tuple:
    """Where placements may move, more starts for the polish: the agents' activation decisions, keep-all (where keep
    is not allowed, each unit's plainest allowed option: :meth:`~memopt_nb.rl.task.PlanningTask.plain_options`) and the
    activations of ``current`` (the agents' plan polished), each with the fastest state placement that fits the budget
    for those activations (exact: the MILP with activations fixed, :func:`~memopt_nb.solvers.place_states`), then
    polished. A start whose polished plan is the best so far changed activations and placements together: its
    activations are placed exactly and polished again (``"..._again"``), until that no longer helps. Returns the
    fastest feasible of the polished plans (``current`` first: ties keep it). Only for the cost model's own state table
    (a hand-made one is not the MILP's). The MILPs share :data:`PLACEMENT_SECONDS`; ``info`` receives that budget, the
    number of starts skipped for lack of it and, where one of these starts wins, ``polish_start``
    (``"agents_placed"``, ``"plain_placed"``, ``"polished_placed"``, or one of them with ``"_again"``)."""
    if task.C == 1 or task.state_model is None or not task.state_model.native:
        return (*current, moves)
    from ..solvers.common import place_states

    best, best_t = (*current, moves), _time_of(task, *current)
    spent, skipped = 0.0, 0
    starts = [("agents_placed", agents[:3]), ("plain_placed", _option_arrays(task.plain_options())),
              ("polished_placed", current[:3])]
    seen: set[bytes] = set()
    while starts:
        label, (c, w, d) = starts.pop(0)
        key = _to_options(c, w, d).tobytes()
        if key in seen:
            continue
        seen.add(key)
        left = PLACEMENT_SECONDS - spent
        if left < 1.0:
            skipped += 1
            continue
        t0 = time.perf_counter()
        st = place_states(task.sim, task.budget, c, w, d, offload_state=task.offload_state,
                          step_in_backward=task.step_in_backward, time_limit=min(10.0, left))
        spent += time.perf_counter() - t0
        c2, w2, d2, st2, m = polish(task, c, w, d, np.asarray(st, dtype=np.int64))
        t = _time_of(task, c2, w2, d2, st2)
        if t < best_t * (1 - 1e-12):
            best, best_t = (c2, w2, d2, st2, moves + m + 1), t
            if info is not None:
                info["polish_start"] = label
            # the polish changed the activations too: place the state for those, exactly, and polish again
            starts.append((label.removesuffix("_again") + "_again", (c2, w2, d2)))
    if info is not None:
        info.update(polish_placement_budget_s=PLACEMENT_SECONDS, polish_placement_skipped=skipped)
    return best


#: Seconds the polish's heuristic starts (:func:`_polish_heuristic_starts`) may take together, making their plans
#: included: a start is begun only while some of it is left (``meta["polish_heuristic_skipped"]`` lists the others)
#: and its polish stops when it runs out (``meta["polish_heuristic_cut"]``), so that the whole search stays within
#: about a minute at 48 units on 2 cores. Normally all of them run to the end; then a seed gives the same plan.
HEURISTIC_SECONDS = 10.0

#: The baselines (:data:`memopt_nb.solvers.BASELINES`) whose plans the polish also starts from, where their plan fits
#: the budget and lies in the search's space.
HEURISTIC_STARTS = ("none", "recompute_all", "sqrt_n", "swap_all", "capuchin", "selective_layer", "op_sac",
                    "recompute_offload_all", "state_offload", "state_offload_recompute", "step_in_backward",
                    "step_in_backward_recompute")


def _heuristic_starts(task: PlanningTask, deadline: float) -> tuple[list[tuple[str, np.ndarray, np.ndarray, float]],
                                                                     list[str]]:
    """The plans of :data:`HEURISTIC_STARTS` that fit the budget in the task's space, fastest first (ties: the order
    of the list), as (name, options, placements, step time); and the names left out for lack of time.

    A baseline's plan is used as it is: activation decisions (the classic heuristics, all-resident) or its fixed
    placements (the state baselines); it is left out when it needs a strategy, timing or placement the task does not
    allow, refuses the budget, or misses it."""
    n, found, late = task.n, [], []
    allowed = np.zeros((n, len(STATE_CHOICES)), dtype=bool)
    allowed[:, 0] = True
    allowed[:, task.state_ids] = task.state_ok
    for name in HEURISTIC_STARTS:
        if time.perf_counter() > deadline:
            late.append(name)
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan = BASELINES[name](task.sim, task.budget)
            c, w, d = (x[0] for x in task.sim.encode(plan))
        except MemoptError:  # outside its own space (no save-sets, a budget below its floor)
            continue
        opts = _to_options(c, w, d)
        st = np.asarray(plan.state_indices, dtype=np.int64)
        inside = (opts < task.n_options) & task.option_ok[np.arange(n), np.minimum(opts, task.n_options - 1)]
        if not (inside.all() and allowed[np.arange(n), st].all()):
            continue
        peak, t = task.evaluate(c[None], w[None], d[None], st[None])
        if peak[0] <= task.budget:
            found.append((name, opts, st, float(t[0])))
    found.sort(key=lambda x: x[3])
    return found, late


def _polish_heuristic_starts(task: PlanningTask, current: tuple, info: dict[str, Any]) -> tuple:
    """Polish from the baselines' plans too (:func:`_heuristic_starts`, fastest first, each one not already among the
    starts) while :data:`HEURISTIC_SECONDS` last; returns the fastest feasible plan, ``current`` (codes, windows,
    distances, placements, moves) on ties. ``info`` receives ``polish_heuristic_starts`` (the baselines polished),
    ``polish_heuristic_skipped`` (left out for lack of time), ``polish_heuristic_cut`` (polished until the time ran
    out), ``polish_heuristic_budget_s``, ``polish_heuristic_seconds`` (what they took) and, where one of them wins,
    ``polish_start`` (its name)."""
    t0 = time.perf_counter()
    deadline = t0 + HEURISTIC_SECONDS
    starts, late = _heuristic_starts(task, deadline)
    best, best_t = current, _time_of(task, *current[:4])
    seen = {(_to_options(*current[:3]).tobytes(), np.asarray(current[3], dtype=np.int64).tobytes())}
    used: list[str] = []
    cut: list[str] = []  # polished until the time ran out, perhaps short of where moves stop helping
    for name, opts, st, _ in starts:
        if (opts.tobytes(), st.tobytes()) in seen:
            continue
        if time.perf_counter() > deadline:
            late.append(name)
            continue
        seen.add((opts.tobytes(), st.tobytes()))
        used.append(name)
        c, w, d, st2, m = polish(task, *_option_arrays(opts), st, deadline=deadline)
        if time.perf_counter() > deadline:
            cut.append(name)
        t = _time_of(task, c, w, d, st2)
        if t < best_t * (1 - 1e-12):
            best, best_t = (c, w, d, st2, m), t
            info["polish_start"] = name
    info.update(polish_heuristic_starts=used, polish_heuristic_skipped=late, polish_heuristic_cut=cut,
                polish_heuristic_budget_s=HEURISTIC_SECONDS, polish_heuristic_seconds=time.perf_counter() - t0)
    return best


def polish(task: PlanningTask, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray,
           states: np.ndarray | None = None, max_rounds: int = 100, deadline: float | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Best-improvement local search while the simulator says it helps; returns codes, windows, distances, placements
    (indices into STATE_CHOICES) and the number of moves made. ``deadline`` (a ``time.perf_counter()`` value): no
    round starts after it (the plan so far is returned).

    A move changes one unit's option (strategy and timing). Each round takes the fastest move within budget (ties: the
    earlier unit, then the earlier option) if it is faster than the current plan. Where placements may be chosen, a
    move may also change one unit's placement, alone or together with one unit's option (so a faster activation option
    that needs a little more memory can be paid for by moving some state). Pairs are scored with the cost model's
    separable state part (``STATE_CONTRACT.md``) and the chosen move is checked with the exact evaluation before it is
    taken. Without placements, a move is simulated only where a lower bound on its time does not already rule it out
    (:func:`_best_move`): the same moves as simulating every one.
    """
    n = task.n
    cur = _to_options(np.asarray(codes), np.asarray(windows), np.asarray(dists))
    cur_st = np.zeros(n, dtype=np.int64) if states is None else np.asarray(states, dtype=np.int64).copy()
    peak, t = task.evaluate(*[a[None] for a in _option_arrays(cur)], cur_st[None])
    best_t = float(t[0]) if peak[0] <= task.budget else math.inf
    moves = 0
    last: dict = {}  # the option moves' simulation, while the options stay
    units, opts = np.nonzero(task.option_ok)  # every allowed (unit, option), unit-major
    rows = np.arange(units.size)
    simulated = 0  # moves the last round simulated
    for _ in range(max_rounds):
        if deadline is not None and time.perf_counter() > deadline:
            break
        cand = np.repeat(cur[None], units.size, axis=0)
        cand[rows, units] = opts
        if task.C > 1:
            cand, cand_st = _best_pairs(task, cur, cur_st, cand, last=last)
            peak, t = task.evaluate(*_option_arrays(cand), cand_st)
            t = np.where(peak <= task.budget, t, math.inf)
            i = int(np.argmin(t))
            found = float(t[i])
        else:  # where the bound left most moves in the running last round, one batch of all (fewer simulator calls)
            i, found, simulated = _best_move(task, cand, cur_st, best_t * (1 - 1e-12),
                                             block=cand.shape[0] if simulated > 0.75 * cand.shape[0] else None)
            cand_st = np.repeat(cur_st[None], i + 1, axis=0)
        if not found < best_t * (1 - 1e-12):
            break
        cur, cur_st, best_t = cand[i], cand_st[i], found
        moves += 1
    c, w, d = _option_arrays(cur)
    return c, w, d, cur_st, moves


#: Rows :func:`_best_move` simulates in its first batch (then 4x more each time): few enough that a bound that rules
#: most moves out saves most of the work, enough that the simulator's per-call overhead stays small.
MOVE_BLOCK = 128


def _best_move(task: PlanningTask, cand: np.ndarray, states: np.ndarray, below: float,
               block: int | None = None) -> tuple[int, float, int]:
    """Of the plans ``cand`` (option indices, all with placements ``states``), the fastest within budget if it is
    faster than ``below`` (ties: the first), as (row, time, rows simulated); else a row no faster than ``below``
    (row 0 and ``inf`` if none fits).

    The same answer as simulating every row, simulating fewer: the rows whose lower bound on the time
    (:meth:`~memopt_nb.rl.task.PlanningTask.time_floor`) is below ``below`` are simulated in order of their bound:
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
        c, w, d = _option_arrays(cand[idx])
        peak, t = task.evaluate(c, w, d, all_st[: idx.size])
        t = np.where(peak <= task.budget, t, math.inf)
        m = float(t.min())
        at = int(idx[t == m].min())
        if m < best or (m == best and at < best_i):
            best_i, best = at, m
    return best_i, best, simulated


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
    seg = task.st_seg[units, local].sum(axis=1)  # (Z, S)
    moved = (sts != 0).any(axis=1)
    step_max = task.step_part_many(task.step_base[None] + task.st_step[units, local].sum(axis=1), moved)
    st_time = task.st_time[units, local].sum(axis=1) + np.where(moved, task.chunk_extra, 0.0)
    key = acts.tobytes()
    det = last.get(key) if last is not None else None
    if det is None:
        det = task.sim.evaluate(*_option_arrays(acts), details=True)
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
    pairs = _best_state_pairs(task, peaks[0], float(det["time"][0]), cur_st, st_units, task.state_ids[st_local],
                              keep)
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
    order = cand[np.argsort(time[cand], kind="stable")]
    found: list[np.ndarray] = []
    count, lo = 0, 0
    while count < keep and lo < order.size:
        idx = order[lo: lo + block]
        ok = idx[fits(idx)][: keep - count]
        found.append(ok)
        count += ok.size
        lo += block
        block *= 4
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def _best_state_pairs(task: PlanningTask, peaks: np.ndarray, time0: float, cur_st: np.ndarray, units: np.ndarray,
                      ids: np.ndarray, keep: int) -> np.ndarray:
    """The ``keep`` fastest placements within budget that change two units' placements of ``cur_st`` (options fixed,
    their per-segment peaks ``peaks`` and time ``time0``), scored by the separable state part (ties: the earlier
    pair)."""
    n = task.n
    loc = np.searchsorted(task.state_ids, cur_st)
    new_loc = np.searchsorted(task.state_ids, ids)
    d_seg = task.st_seg[units, new_loc] - task.st_seg[units, loc[units]]  # (Z, S) each single change's difference
    d_step = task.st_step[units, new_loc] - task.st_step[units, loc[units]]
    d_time = task.st_time[units, new_loc] - task.st_time[units, loc[units]]
    r = np.arange(n)
    seg0 = peaks + task.st_seg[r, loc].sum(axis=0)
    step0 = task.step_base + task.st_step[r, loc].sum(axis=0)
    time_base = time0 + task.st_time[r, loc].sum()
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


def plan_from_arrays(task: PlanningTask, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray,
                     states: np.ndarray | None, *, seed: int | None, **meta: Any) -> Plan:
    """The plan of these arrays, with the task's prediction (placements and the optimizer step included).

    Without a state model and without ``step_in_backward`` this is exactly
    :func:`~memopt_nb.solvers.common.make_plan`; otherwise the decisions carry the placements, the predicted peak and
    step time come from the task's state-aware evaluation, and the plan records ``step_in_backward``.
    """
    plan = make_plan(task.sim, codes, windows, dists, budget=task.budget, method=METHOD, seed=seed, **meta)
    if task.state_model is None and not task.step_in_backward:
        return plan
    st = np.zeros(task.n, dtype=np.int64) if states is None else np.asarray(states, dtype=np.int64)
    peak, time_ = task.evaluate(np.asarray(codes)[None], np.asarray(windows)[None], np.asarray(dists)[None], st[None])
    decisions = plan_decisions(task.profile, [int(x) for x in codes], list(windows), list(dists), st.tolist())
    fingerprint = plan.optimizer_fingerprint or (getattr(task.profile, "meta", None) or {}).get(
        "optimizer_fingerprint")  # the optimizer the placements were made for (the runtime checks it)
    return plan.with_meta(decisions=decisions, predicted_peak_bytes=int(round(float(peak[0]))),
                          predicted_step_time=float(time_[0]), feasible=bool(peak[0] <= task.budget),
                          step_in_backward=task.step_in_backward, optimizer_fingerprint=fingerprint)


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """Leave the global torch (CPU and, if initialized, CUDA), NumPy and ``random`` RNG states as they were.

    The agents draw from their own seeded generators, but building their networks (``nn.Linear`` initialization)
    draws from torch's global one; a search must not shift the random numbers of the user's training afterwards.
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(np_state)
        random.setstate(py_state)


def _keeps_global_rng(fn: Callable[..., Plan]) -> Callable[..., Plan]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Plan:
        from ..runtime.limit import uncounted

        with _global_rng_kept(), uncounted():  # the agents' networks are host memory, not the planned device's
            return fn(*args, **kwargs)

    return wrapper


@_keeps_global_rng
def search(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None, *,
           total_timesteps: int | None = None, seed: int = 0, callback: Callable[[dict], None] | None = None,
           config: PPOConfig | None = None, polish_plan: bool = True, restarts: int | None = None,
           reward_scale: float = 10.0, offload_state: bool | str | Iterable[str] = True,
           step_in_backward: bool = False, strategies: str | Iterable[str] = DEFAULT_STRATEGIES,
           order: str | Sequence[int] = "state") -> Plan:
    """Search a plan with the two PPO agents; returns the best feasible plan the agents found (then polished).

    The plan decides per unit its activation strategy (keep, recompute, swap and the swap's timing) and where the
    unit's optimizer state, gradients and parameters live (:attr:`~memopt_nb.plan.Plan.placements`).

    Args:
        profile: a :class:`~memopt_nb.profile.ModelProfile`.
        budget: bytes, ``"1.5GiB"``, ``"60%"`` of the unoptimized peak, or ``None`` for the device's capacity. A budget
            below the minimum feasible peak raises :class:`~memopt_nb.errors.BudgetError` before any training.
        device: the device to plan for (default: the profiled one), e.g. ``"a100-40gb"``.
        total_timesteps: PPO environment steps (default :func:`default_timesteps`, more where state may move).
        seed: the same seed gives the same plan.
        callback: called with one history row per PPO iteration (for live widgets).
        config: a full :class:`~memopt_nb.rl.ppo.PPOConfig` (its ``total_timesteps``/``seed`` are overridden by the
            arguments above when given). Without one: ``PPOConfig()`` with :func:`default_update_epochs` and, for the
            strategy agent, :func:`default_risk_quantile`.
        polish_plan: run a local search on the agents' best plan (where state may move, also from their activation
            decisions and from keep-all, each with its exact best state placement), then from the plans of the
            classic baselines that fit the budget in this space (:data:`HEURISTIC_STARTS`, within
            :data:`HEURISTIC_SECONDS`); the fastest result wins, the agents' on ties. What it adds is reported
            separately.
        restarts: independent agent pairs trained one after the other, each on an equal share of the timesteps
            (default :func:`default_restarts`); the best plan of all of them is returned.
        offload_state: which state the plan may move off the device: ``True`` (optimizer state, gradients and
            parameters; the default), ``False`` (activations only: the plans of the activation-only search), or a set
            of ``"optimizer"``, ``"grads"``, ``"params"`` (also as a comma-separated string). Read by
            :func:`memopt_nb.plan.state_choices`; a bad value raises :class:`~memopt_nb.errors.PlanError`.
        step_in_backward: also allow ``grads="step"`` (the unit's optimizer step runs in backward, then its gradients
            are freed). Opt-in: under such a plan the loop may no longer accumulate gradients over several backwards
            or clip their global norm. The plan records it (:attr:`~memopt_nb.plan.Plan.step_in_backward`).
        strategies: the activation strategies the agents may choose from: a non-empty set of ``"keep"``,
            ``"recompute"``, ``"swap"`` (also as a comma-separated string; order and duplicates do not matter), e.g.
            ``("keep", "recompute")`` for checkpointing only. The other strategies are masked out of the strategy
            agent's actions, the polish never introduces them, and the budget is checked against the floor of this
            space (``solvers.min_peak(..., strategies)``). A unit none of them fits keeps its activations. A bad
            value raises :class:`~memopt_nb.errors.PlanError`; the default is all three. ``"recompute_offload"`` is
            opt-in: with it the strategy agent has a fourth strategy, timed by the timing agent like swap. So is
            ``"selective"`` (for a profile made with ``selective=True``): the strategy agent then has one more
            strategy per save-set (masked where the unit does not offer it), and the polish moves between them.
        reward_scale: the factor on both agents' returns (see :mod:`memopt_nb.rl.env`); it sets how large the rewards
            are next to PPO's fixed clipping and entropy coefficients.
        order: the order an episode decides the units in (:func:`~memopt_nb.rl.env.decision_order`): ``"state"``
            (the default: where state may move, the units with the largest state first; else the model's order),
            ``"forward"`` (the model's order) or a permutation of the units. Which suits a model varies: a ConvNeXt's
            two large last blocks must be decided first, while chains with the step in backward did better forward
            (benchmarks/RESULTS.md, 2026-12-05). A bad value raises :class:`~memopt_nb.errors.PlanError` before any
            training.

    The plan's ``meta`` holds ``history`` (per iteration: mean episodic return per agent, best step time and peak the
    agents found so far, feasible fraction; ``total_timesteps`` in a row is what PPO really runs — whole iterations —
    not the number asked for, which is ``meta["requested_timesteps"]``), ``timesteps_run``, ``agents_step_time`` and
    ``agents_peak`` (what the agents alone reached), ``decision_order`` (the units in the order the agents decided
    them), ``best_restart`` (the restart whose episode was the agents' best plan), ``polish`` (``"ran"``,
    ``"off"`` or ``"skipped: ..."``), ``polished_step_time`` (``None`` unless the polish ran), ``search_seconds``,
    ``interrupted`` (Ctrl-C returns the best plan so far), ``state_choices`` (the placements the agents could choose
    from; only all-resident when the cost model has no state table), ``allowed_strategies`` (the activation strategies
    searched, as ``optimal`` records them), ``agents_states`` (the agents' placements before the polish) and, where the
    polish started from exact placements, ``polish_placement_budget_s`` (the seconds their MILPs share,
    :data:`PLACEMENT_SECONDS`) and ``polish_placement_skipped`` (starts left out when it ran out; normally 0); where the
    polish ran, ``polish_heuristic_starts`` (the baselines it also started from), ``polish_heuristic_skipped`` and
    ``polish_heuristic_cut`` (those left out, or polished only until :data:`HEURISTIC_SECONDS` ran out; normally none),
    ``polish_heuristic_seconds`` and ``polish_start`` (the start whose polished plan was returned: ``"agents"``,
    ``"agents_placed"``, ``"plain_placed"``, ``"polished_placed"``, one of those three with ``"_again"`` (see
    :func:`_polish_exact_placements`) or a baseline's name). The plan's own ``predicted_peak_bytes`` /
    ``predicted_step_time`` are the final figures.

    The global torch, NumPy and ``random`` RNG states are left as the search found them.
    """
    t0 = time.perf_counter()
    task = PlanningTask(profile, budget, device, offload_state=offload_state, step_in_backward=step_in_backward,
                        strategies=strategies)
    cfg = config or PPOConfig(update_epochs=default_update_epochs(task), risk_quantile=default_risk_quantile(task),
                              risk_agents=(STRATEGY,))
    cfg = PPOConfig(**{**cfg.__dict__, "seed": seed,
                       "total_timesteps": total_timesteps or (config.total_timesteps if config else
                                                              default_timesteps(task.n, states=task.C > 1))})
    runs = max(1, int(restarts if restarts is not None else default_restarts(task.n)))
    units_order = decision_order(task, order)  # a bad order is refused here, before any training
    tracker = SearchTracker(task, cfg, runs, t0, callback, order=units_order)
    make_env = functools.partial(MemoryPlanningEnv, task, reward_scale=reward_scale, order=units_order)
    interrupted = False
    # The networks are tiny: one intra-op thread is fastest, immune to oversubscription, and the same on every
    # machine (so a seed gives the same plan everywhere). The user's setting is restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for k in range(runs):
            tracker.restart = k
            run_cfg = PPOConfig(**{**cfg.__dict__, "seed": seed * 7919 + k,
                                   "total_timesteps": cfg.total_timesteps // runs})
            agents = train(make_env, run_cfg, on_episode=tracker.on_episode, on_iteration=tracker.on_iteration)
            _greedy_rollout(make_env, agents, tracker.on_episode)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        torch.set_num_threads(threads)
    return _finish(task, tracker, seed=seed, interrupted=interrupted, polish_plan=polish_plan, t0=t0)


class SearchTracker:
    """What the search keeps while the agents train: the best feasible plan, the least infeasible one, the history.

    ``on_episode`` receives every finished episode's info from the environment; ``on_iteration`` receives PPO's stats
    after each update, turns them into a history row (numbered across restarts) and passes it to the user's callback.
    """

    def __init__(self, task: PlanningTask, cfg: PPOConfig, runs: int, t0: float,
                 callback: Callable[[dict], None] | None, order: Sequence[int] | None = None) -> None:
        self.task = task
        self.t0 = t0
        self.callback = callback
        self.best: dict[str, Any] = {"time": math.inf, "peak": math.inf, "plan": None, "episode": None,
                                     "restart": None}
        self.least_bad: dict[str, Any] = {"objective": math.inf, "plan": None, "peak": math.inf, "time": math.inf}
        self.history: list[dict[str, Any]] = []
        self.episodes = 0
        self.restart = 0
        #: the units in the order the agents decide them (default: the model's)
        self.order = [int(u) for u in (range(task.n) if order is None else order)]
        self._window = {"episodes": 0, "feasible": 0}  # episodes since the last history row
        self._offset = {"iterations": 0, "steps": 0}  # where the current agent pair's numbering starts
        # What PPO will really run: whole iterations of num_envs x num_steps per agent pair (the progress bar's 100%).
        batch = cfg.num_envs * (cfg.num_steps or task.n + 1)
        self.planned_steps = runs * max(1, (cfg.total_timesteps // runs) // batch) * batch
        self.requested_steps = cfg.total_timesteps
        self.runs = runs

    def on_episode(self, info: dict) -> None:
        self.episodes += 1
        self._window["episodes"] += 1
        plan = (info["codes"], info["windows"], info["dists"], info["states"])
        if info["feasible"]:
            self._window["feasible"] += 1
            if info["time"] < self.best["time"]:
                self.best.update(time=info["time"], peak=info["peak"], plan=plan, episode=self.episodes,
                                 restart=self.restart)
        elif info["objective"] < self.least_bad["objective"]:
            self.least_bad.update(objective=info["objective"], plan=plan, peak=info["peak"], time=info["time"])

    def on_iteration(self, stats: dict) -> None:
        history, best, task = self.history, self.best, self.task
        if stats["iteration"] == 1 and history:  # a new agent pair continues the numbering
            self._offset["iterations"] = history[-1]["iteration"]
            self._offset["steps"] = history[-1]["global_step"]
        row = {
            "iteration": stats["iteration"] + self._offset["iterations"],
            "restart": self.restart,
            "global_step": stats["global_step"] + self._offset["steps"],
            "total_timesteps": self.planned_steps,
            "seconds": time.perf_counter() - self.t0,
            "reward_strategy": stats[f"{STRATEGY}/episodic_return"],
            "reward_timing": stats[f"{TIMING}/episodic_return"],
            "entropy_strategy": stats[f"{STRATEGY}/entropy"],
            "entropy_timing": stats[f"{TIMING}/entropy"],
            "best_step_time": best["time"] if best["plan"] is not None else None,
            "best_peak": best["peak"] if best["plan"] is not None else None,
            "feasible_fraction": self._window["feasible"] / max(self._window["episodes"], 1),
            "budget": task.budget,
            "base_step_time": task.base_time,
            "base_peak": task.base_peak,
        }
        self._window.update(episodes=0, feasible=0)
        history.append(row)
        if self.callback is not None:
            self.callback(row)

    def meta(self, interrupted: bool) -> dict[str, Any]:
        """The search's record for the plan's ``meta``."""
        history = self.history
        return {"history": history, "search_seconds": time.perf_counter() - self.t0, "interrupted": interrupted,
                "total_timesteps": self.planned_steps, "requested_timesteps": self.requested_steps,
                "timesteps_run": history[-1]["global_step"] if history else 0, "restarts": self.runs,
                "episodes": self.episodes, "best_episode": self.best["episode"], "base_step_time": self.task.base_time,
                "state_choices": [list(STATE_CHOICES[int(i)]) for i in self.task.state_ids],
                "allowed_strategies": list(self.task.strategies), "decision_order": list(self.order),
                "best_restart": self.best["restart"]}


def _finish(task: PlanningTask, tracker: SearchTracker, *, seed: int, interrupted: bool, polish_plan: bool,
            t0: float) -> Plan:
    """The plan to return: the agents' best feasible one (polished), else the least infeasible one, flagged."""
    meta = tracker.meta(interrupted)
    best, least_bad = tracker.best, tracker.least_bad
    if best["plan"] is None:
        warnings.warn("the agents found no plan within the budget; returning the least infeasible one, flagged",
                      stacklevel=3)
        if least_bad["plan"] is None:
            least_bad["plan"] = (*_option_arrays(task.plain_options()), np.zeros(task.n, dtype=np.int64))
        c, w, d, st = least_bad["plan"]
        return plan_from_arrays(task, c, w, d, st, seed=seed, **meta, no_feasible_plan=True, agents_step_time=None,
                                polished_step_time=None, polish="skipped: no feasible plan")
    c, w, d, st = best["plan"]
    agents_time = best["time"]
    moves = 0
    placement: dict[str, Any] = {}  # what the exact-placement starts of the polish took
    if not polish_plan:
        polish_state = "off"
    elif interrupted:
        polish_state = "skipped: interrupted"
    else:
        c, w, d, st, moves = polish(task, c, w, d, st)
        polish_state = "ran"
        placement["polish_start"] = "agents"
        c, w, d, st, moves = _polish_exact_placements(task, (c, w, d, st), best["plan"], moves, placement)
        c, w, d, st, moves = _polish_heuristic_starts(task, (c, w, d, st, moves), placement)
    plan = plan_from_arrays(task, c, w, d, st, seed=seed, **meta,
                            agents_step_time=agents_time, agents_peak=best["peak"],
                            agents_decisions=[int(x) for x in _to_options(*best["plan"][:3])],
                            agents_states=[int(x) for x in best["plan"][3]],
                            polished=moves > 0, polish_moves=moves, polish=polish_state, **placement)
    # Only a polish that ran has a step time of its own; the plan's predictions are the one source of the final numbers.
    plan.meta["polished_step_time"] = plan.predicted_step_time if polish_state == "ran" else None
    plan.meta["search_seconds"] = time.perf_counter() - t0
    return plan


def _greedy_rollout(make_env: Callable[[], MemoryPlanningEnv], agents: dict,
                    on_episode: Callable[[dict], None]) -> None:
    """One deterministic episode with each agent's most likely action; its plan competes like any other."""
    env = make_env()
    obs, _ = env.reset()
    info: dict = {}
    while env.agents:
        acts = {}
        for a in env.agents:
            x = torch.as_tensor(obs[a]["observation"])[None]
            m = torch.as_tensor(obs[a]["action_mask"])[None]
            with torch.no_grad():
                acts[a] = int(agents[a].greedy(x, m)[0])
        obs, _, _, _, infos = env.step(acts)
        info = infos.get(STRATEGY, info)
    on_episode(info)
