"""The exact optimum: a mixed-integer linear program over the simulator's own model, solved by HiGHS (SciPy).

The simulator's memory is *structural* (when a storage leaves and returns to the device depends only on the plan, not on
timing) and its time is a max-plus system with fixed queue orders, so both can be written exactly as linear
constraints:

* a binary per (unit, option) — keep, recompute, or swap with an offload window and a prefetch distance —,
  exactly one per unit;
* memory at every segment: the profiled level, plus each storage group's change (residency as an OR over the units that
  may hold it, offload intervals per owner option), plus the segment's own peak (kept or recomputed) ≤ budget;
* time: segment ready/start times, the device-to-host queue (jobs per eligibility boundary and release point, first in
  first out), the host-to-device queue (per owner, in the order backward needs them), and the stalls where the forward
  waits for a release or a backward for its prefetch;
* prefetch triggers are constrained to be monotone (a unit's prefetch never before that of a later swapped unit), which
  loses nothing: the runtime issues them in that order anyway.

The objective is the simulated step time. The returned plan is re-evaluated by the simulator (both numbers are in
``plan.meta``), and the brute-force enumerator in the test suite checks that they agree with the true optimum.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ..device import DeviceSpec
from ..errors import BudgetError
from ..plan import STRATEGIES, Plan
from ..simulate import RECOMPUTE, SWAP, Simulator
from .common import as_simulator, check_budget, make_plan, unit_options

Expr = dict[int, float]
_CUT_REACH = 8  # issue boundaries (4 units) a link-time cut looks back


class _Program:
    """A small builder for sparse MILPs."""

    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lo: list[float] = []
        self.hi: list[float] = []

    def var(self, lb: float = 0.0, ub: float = np.inf, integer: bool = False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.integer.append(1 if integer else 0)
        return len(self.lb) - 1

    def row(self, expr: Expr, lo: float = -np.inf, hi: float = np.inf) -> None:
        i = len(self.lo)
        for j, a in expr.items():
            if a != 0.0:
                self.r.append(i)
                self.c.append(j)
                self.v.append(a)
        self.lo.append(lo)
        self.hi.append(hi)

    def solve(self, objective: Expr, time_limit: float) -> Any:
        n = len(self.lb)
        cost = np.zeros(n)
        for j, a in objective.items():
            cost[j] += a
        a = coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lo), n)).tocsr()
        return milp(cost, constraints=LinearConstraint(a, self.lo, self.hi), integrality=np.array(self.integer),
                    bounds=Bounds(self.lb, self.ub),
                    options={"time_limit": float(time_limit), "mip_rel_gap": 0.0, "presolve": True})


def _add(expr: Expr, other: Expr, scale: float = 1.0) -> None:
    for j, a in other.items():
        expr[j] = expr.get(j, 0.0) + scale * a


class _Formulation:
    """Variables and memory expressions shared by the time-optimal and the peak-minimal programs."""

    def __init__(self, sim: Simulator, strategies: Sequence[str]) -> None:
        self.sim = sim
        self.p = p = _Program()
        n, S = sim.n, sim.S
        self.mem_scale = float(max(sim.start_level.max() + sim.rel.max(), 1.0))
        self.opts = [unit_options(sim, u, strategies) for u in range(n)]
        self.x: list[list[int]] = []
        for u in range(n):
            xs = [p.var(0, 1, True) for _ in self.opts[u]]
            self.x.append(xs)
            p.row({j: 1.0 for j in xs}, 1.0, 1.0)
        self.rc: list[Expr] = []
        self.sw: list[Expr] = []
        for u in range(n):
            self.rc.append({self.x[u][i]: 1.0 for i, o in enumerate(self.opts[u]) if o[0] == RECOMPUTE})
            self.sw.append({self.x[u][i]: 1.0 for i, o in enumerate(self.opts[u]) if o[0] == SWAP})
        # monotone prefetch triggers
        self.trig_of = lambda u, o: min(u + o[2], n - 1)
        dmax = max((o[2] for u in range(n) for o in self.opts[u] if o[0] == SWAP), default=0)
        for u in range(n):
            for v in range(u + 1, min(n, u + dmax + 1)):
                if not self.sw[u] or not self.sw[v]:
                    continue
                big = float(n)
                expr: Expr = {}
                for i, o in enumerate(self.opts[u]):
                    if o[0] == SWAP:
                        expr[self.x[u][i]] = expr.get(self.x[u][i], 0.0) + self.trig_of(u, o) + big
                for i, o in enumerate(self.opts[v]):
                    if o[0] == SWAP:
                        expr[self.x[v][i]] = expr.get(self.x[v][i], 0.0) - self.trig_of(v, o) + big
                p.row(expr, hi=2 * big)
        # memory per segment: constant + expression
        self.mem_const = np.array(sim.start_level + sim.rel, dtype=float)
        self.mem_expr: list[Expr] = [dict() for _ in range(S)]
        for k in range(S):
            u = int(sim.seg_unit[k])
            if u >= 0 and self.rc[u]:
                _add(self.mem_expr[k], self.rc[u], float(sim.rc_rel[k] - sim.rel[k]))
        # per (group, owner option) offload indicator, and the copy jobs they form
        self.off: dict[tuple[int, int], Expr] = {}
        self.d2h_jobs: dict[tuple[int, int], Expr] = defaultdict(dict)  # (eligibility boundary, release) -> bytes
        self.h2d_bytes: list[Expr] = [dict() for _ in range(n)]
        self.h2d_count: list[Expr] = [dict() for _ in range(n)]  # storages each owner offloads (per-copy cost)
        for g in range(sim.G):
            self._group(g)

    def _release(self, g: int, w: int) -> int:
        sim = self.sim
        r_unit = int(sim.g_next[g]) + w
        return int(sim.fwd_seg[r_unit]) if r_unit < sim.n else sim.end

    def _group(self, g: int) -> None:
        sim, p = self.sim, self.p
        S = sim.S
        nb = float(sim.g_nb[g])
        savers = [int(s) for s in sim.g_sav[g] if s >= 0]
        consumers = [int(c) for c in sim.g_con[g] if c >= 0]
        producer = int(sim.g_prod[g])
        base_end = int(sim.g_base_end[g])
        floor_end = max(int(sim.g_fallback[g]), int(sim.g_out_rel[g]))
        fixed = [int(sim.bwd_seg[s]) for s in savers if s != producer or not self.rc[s]]
        var_holders: list[tuple[int, Expr]] = []
        if producer in savers and self.rc[producer]:
            var_holders.append((int(sim.bwd_seg[producer]), {**{j: -1.0 for j in self.rc[producer]}, -1: 1.0}))
        for c in consumers:
            if self.rc[c] and c not in savers:
                var_holders.append((int(sim.bwd_seg[c]), dict(self.rc[c])))
        fixed_end = max(fixed + [floor_end])
        for k in range(S):
            base = 1.0 if k <= base_end else 0.0
            if k <= fixed_end:
                res: Expr = {-1: 1.0}
            else:
                cover = [e for end, e in var_holders if end >= k]
                if not cover:
                    res = {}
                elif len(cover) == 1:
                    res = cover[0]
                else:
                    y = p.var(0, 1)
                    for e in cover:
                        row = {y: 1.0}
                        _add(row, {j: -a for j, a in e.items() if j >= 0})
                        p.row(row, lo=e.get(-1, 0.0))
                    res = {y: 1.0}
            change = dict(res)
            change[-1] = change.get(-1, 0.0) - base
            const = change.pop(-1, 0.0)
            self.mem_const[k] += nb * const
            _add(self.mem_expr[k], change, nb)
        if not sim.g_eligible[g]:
            return
        owner = int(sim.g_owner[g])
        pin = [c for c in consumers if c != owner and self.rc[c]]
        e = int(sim.g_free[g])
        for i, o in enumerate(self.opts[owner]):
            if o[0] != SWAP:
                continue
            xi = self.x[owner][i]
            if pin:
                z = p.var(0, 1)
                p.row({z: 1.0, xi: -1.0}, hi=0.0)
                for c in pin:
                    row = {z: 1.0}
                    _add(row, self.rc[c])
                    p.row(row, hi=1.0)
                ind: Expr = {z: 1.0}
            else:
                ind = {xi: 1.0}
            self.off[(g, i)] = ind
            r = self._release(g, o[1])
            t = int(sim.bwd_seg[self.trig_of(owner, o)])
            for k in range(r, t):
                _add(self.mem_expr[k], ind, -nb)
            _add(self.d2h_jobs[(e, r)], ind, nb)
            _add(self.h2d_bytes[owner], ind, nb)
            _add(self.h2d_count[owner], ind, float(sim.g_cnt[g]))


def _solution_arrays(form: _Formulation, xval: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    codes, ws, ds = [], [], []
    for u in range(form.sim.n):
        vals = [xval[j] for j in form.x[u]]
        o = form.opts[u][int(np.argmax(vals))]
        codes.append(o[0])
        ws.append(o[1])
        ds.append(o[2])
    return codes, ws, ds


def solve_min_peak(sim: Simulator, strategies: Sequence[str] = STRATEGIES, time_limit: float = 60.0) -> int:
    """The smallest peak any plan reaches (bytes), by MILP, checked with the simulator."""
    form = _Formulation(sim, strategies)
    p = form.p
    peak = p.var(0, np.inf)
    scale = form.mem_scale
    for k in range(sim.S):
        row = {j: a / scale for j, a in form.mem_expr[k].items()}
        row[peak] = -1.0
        p.row(row, hi=-form.mem_const[k] / scale)
    res = p.solve({peak: 1.0}, time_limit)
    if res.x is None:  # pragma: no cover - solver failure
        raise BudgetError(f"could not compute the minimum peak: {res.message}")
    if res.status != 0:  # pragma: no cover - time limit: never refuse a budget some plan might meet
        return int(np.floor(float(res.mip_dual_bound) * scale))
    codes, ws, ds = _solution_arrays(form, res.x)
    value = sim.evaluate(np.array([codes]), np.array([ws]), np.array([ds]))[0][0]
    return int(np.ceil(value))


def optimal(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None,
            strategies: Sequence[str] = STRATEGIES, time_limit: float = 120.0) -> Plan:
    """The plan with the smallest simulated step time whose simulated peak fits ``budget``.

    Solved exactly (to HiGHS tolerances) as a MILP over the simulator's model; ``strategies`` restricts the options
    (e.g. ``("keep", "recompute")`` for checkpointing only). ``plan.meta`` has the solver status, the MILP objective,
    the simulated time of the plan, the solve time and whether optimality was proven within ``time_limit``.
    """
    sim = as_simulator(profile, device)
    b = check_budget(sim, budget, strategies)
    t0 = time.perf_counter()
    # The checkpointing-only optimum is quick to prove; when it fits, it bounds the full problem from above (a
    # cut-off that prunes the search) and is the answer of last resort if the full problem runs out of time.
    fallback = None
    if "swap" in strategies and "recompute" in strategies and sim.device.has_host_link:
        rc_only = tuple(x for x in strategies if x != "swap")
        try:
            fallback = optimal(sim, b, strategies=rc_only, time_limit=time_limit / 4)
        except BudgetError:
            fallback = None
    form = _Formulation(sim, strategies)
    p = form.p
    n, S = sim.n, sim.S
    mscale = form.mem_scale
    for k in range(S):
        p.row({j: a / mscale for j, a in form.mem_expr[k].items()}, hi=(b - form.mem_const[k]) / mscale)
    tscale = float(max(sim.dur.sum(), 1e-9))
    dur = sim.dur / tscale
    fwd = sim.fwd_time / tscale
    # DeviceSpec.copy_seconds is linear: its coefficients per byte (each direction) and per storage (round trip)
    dev = sim.device
    inv_d2h = float(dev.copy_seconds(1.0, 0, "d2h")) / tscale
    inv_h2d = float(dev.copy_seconds(1.0, 0, "h2d")) / tscale
    per_storage = float(dev.copy_seconds(0.0, 1, "both")) / tscale
    objective: Expr = {}
    for u in range(n):  # the training thread's per-storage share of every copy adds to the step on every device
        _add(objective, form.h2d_count[u], per_storage)
    if not dev.copy_overlap:
        for u in range(n):
            _add(objective, form.rc[u], float(fwd[u]))
        for u in range(n):
            _add(objective, form.h2d_bytes[u], inv_d2h + inv_h2d)
        const = float(dur.sum())
    else:
        total_copy = float(sim.g_nb.sum()) * (inv_d2h + inv_h2d)
        big = float(dur.sum() + fwd.sum() + 2 * total_copy + 1.0)
        rho = [p.var(0, big) for _ in range(S + 1)]
        sigma = [p.var(0, big) for _ in range(S)]
        p.row({rho[0]: 1.0}, 0.0, 0.0)
        for k in range(S):
            p.row({sigma[k]: 1.0, rho[k]: -1.0}, lo=0.0)
            row = {rho[k + 1]: 1.0, sigma[k]: -1.0}
            u = int(sim.seg_unit[k])
            if sim.kind[k] == 1:
                _add(row, form.rc[u], -float(fwd[u]))
            p.row(row, lo=float(dur[k]))
        # device-to-host queue: jobs by eligibility boundary, then release point
        q_prev = None
        for (e, r) in sorted(form.d2h_jobs):
            bytes_expr = form.d2h_jobs[(e, r)]
            q = p.var(0, big)
            row = {q: 1.0, rho[e]: -1.0}
            _add(row, bytes_expr, -inv_d2h)
            p.row(row, lo=0.0)
            if q_prev is not None:
                row = {q: 1.0, q_prev: -1.0}
                _add(row, bytes_expr, -inv_d2h)
                p.row(row, lo=0.0)
            has = p.var(0, 1)
            for j in bytes_expr:
                p.row({has: 1.0, j: -1.0}, lo=0.0)
            # the forward waits at the release point for this job, if it carries anything
            p.row({sigma[r]: 1.0, q: -1.0, has: -big}, lo=-big)
            q_prev = q
        # valid cuts (they strengthen the relaxation, not the model): everything issued at or after boundary e' that
        # is due by release point r must have crossed the link by then, whatever the queue order
        # (only for the few issue boundaries just before r: the far ones add size, not strength)
        releases = sorted({r for (_, r) in form.d2h_jobs})
        issues = sorted({e for (e, _) in form.d2h_jobs})
        for r in releases:
            near = [e0 for e0 in issues if e0 <= r][-_CUT_REACH:]
            for e0 in near:
                row: Expr = {}
                for (e, rr), bytes_expr in form.d2h_jobs.items():
                    if e >= e0 and rr <= r:
                        _add(row, bytes_expr, -inv_d2h)
                if row:
                    row[sigma[r]] = 1.0
                    row[rho[e0]] = row.get(rho[e0], 0.0) - 1.0
                    p.row(row, lo=0.0)
        # host-to-device queue: per owner, in backward order
        h_prev = None
        for u in range(n - 1, -1, -1):
            if not form.sw[u]:
                continue
            h = p.var(0, big)
            if h_prev is not None:
                row = {h: 1.0, h_prev: -1.0}
                _add(row, form.h2d_bytes[u], -inv_h2d)
                p.row(row, lo=0.0)
            for i, o in enumerate(form.opts[u]):
                if o[0] != SWAP:
                    continue
                t = int(sim.bwd_seg[form.trig_of(u, o)])
                row = {h: 1.0, rho[t]: -1.0, form.x[u][i]: -big}
                _add(row, form.h2d_bytes[u], -inv_h2d)
                p.row(row, lo=-big)
            p.row({sigma[int(sim.bwd_seg[u])]: 1.0, h: -1.0}, lo=0.0)
            h_prev = h
        # valid cuts: prefetches start no earlier than the first backward trigger, so all the bytes of owners >= u
        # are back only after that much link time
        first_bwd = int(min(sim.bwd_seg))
        acc: Expr = {}
        for u in range(n - 1, -1, -1):
            _add(acc, form.h2d_bytes[u], -inv_h2d)
            if acc and form.sw[u]:
                row = dict(acc)
                row[sigma[int(sim.bwd_seg[u])]] = 1.0
                row[rho[first_bwd]] = row.get(rho[first_bwd], 0.0) - 1.0
                p.row(row, lo=0.0)
        objective[rho[S]] = 1.0
        const = 0.0
    if fallback is not None and fallback.feasible:
        cutoff = fallback.predicted_step_time / tscale * (1 + 1e-7) - const
        p.row(dict(objective), hi=cutoff)
    res = p.solve(objective, max(time_limit - (time.perf_counter() - t0), 1.0))
    solve_time = time.perf_counter() - t0
    if res.x is None or (fallback is not None and fallback.feasible
                         and (float(res.fun) + const) * tscale >= fallback.predicted_step_time):
        if fallback is not None and fallback.feasible:
            proven = res.status in (0, 2)  # solved, or infeasible under the cut-off: nothing beats checkpointing
            return fallback.with_meta(method="optimal", meta={
                "solver": "highs-milp", "proven_optimal": proven, "solve_seconds": solve_time,
                "milp_step_time": fallback.predicted_step_time, "allowed_strategies": list(strategies),
                "mip_gap": 0.0 if proven else float("nan"), "note": "no plan with swaps beat the checkpointing-only "
                "optimum" + ("" if proven else " within the time limit")})
        raise BudgetError(f"the exact solver found no plan within {time_limit:.0f} s ({res.message}); raise "
                          f"time_limit or the budget")
    codes, ws, ds = _solution_arrays(form, res.x)
    milp_time = (float(res.fun) + const) * tscale
    plan = make_plan(sim, codes, ws, ds, budget=b, method="optimal", solver="highs-milp",
                     proven_optimal=bool(res.status == 0), milp_step_time=milp_time, solve_seconds=solve_time,
                     mip_gap=float(getattr(res, "mip_gap", 0.0) or 0.0), allowed_strategies=list(strategies))
    return plan
