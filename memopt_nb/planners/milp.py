"""The exact optimum: a mixed-integer linear program over the simulator's own model, solved by HiGHS (SciPy).

The simulator's memory is *structural* (when a storage leaves and returns to the device depends only on the plan, not on
timing) and its time is a max-plus system with fixed queue orders, so both can be written exactly as linear
constraints:

* a binary per (unit, option) — keep, recompute, or swap (or recompute_offload, when allowed) with an offload window
  and a prefetch distance —, exactly one per unit;
* memory at every segment: the profiled level, plus each storage group's change (residency as an OR over the units that
  may hold it, offload intervals per owner option), plus the segment's own peak (kept or recomputed) ≤ budget;
* time: segment ready/start times, the device-to-host queue (jobs per eligibility boundary and release point, first in
  first out), the host-to-device queue (per owner, in the order backward needs them), and the stalls where the forward
  waits for a release or a backward for its prefetch;
* prefetch triggers are constrained to be monotone (a unit's prefetch never before that of a later swapped unit), which
  loses nothing: the runtime issues them in that order anyway.

With ``recompute_offload`` allowed the owner of a storage group depends on the plan (the last unit that hands it to the
swap engine: a saver, not a recomputing producer, or a recompute_offload unit taking it as input). For such a group
there is one offload indicator per (candidate owner, offloading option): the option is chosen, no later candidate hands
the group over, and no plain-recompute consumer pins it — a conjunction of binaries, written with its lower bound too,
so the indicator is exactly the simulator's. Groups no recompute_offload option can touch keep the static owner.

A ``selective`` option (one per Pareto save-set of a recomputable unit, when allowed) counts as recomputing for every
group rule above (and pins its inputs like plain recompute); its binary adds the save-set's ``held_bytes`` to every
segment after its forward through its backward, replaces the segment peaks of its forward and backward by the
save-set's, and adds the save-set's recompute time (instead of the forward's) to its backward — all linear in that
binary, so the program stays exact.

Where the optimizer state, gradients and parameters live is separable in the simulator's cost model (its
``StateTable``, see ``memopt_nb/sim/COST_MODEL.md``), so it enters exactly as well:

* a binary per (unit, allowed placement other than all-resident), at most one per unit, and one continuous indicator
  ``any`` that equals 1 exactly when some unit moves state;
* every segment's memory row gains ``seg_delta`` of the chosen placements;
* the optimizer step: the plain step's peak must fit when ``any = 0``; when ``any = 1`` the step runs unit by unit and
  each of its points (``step_base`` plus the chosen ``step_delta``) must fit (big-M rows, exact since no placement is
  chosen when ``any = 0``);
* the time gains ``time`` of the chosen placements and ``chunked_step_extra`` when ``any = 1``.

The objective is the simulated step time. The returned plan is re-evaluated by the simulator (both numbers are in
``plan.meta``), and the brute-force enumerator in the test suite checks that they agree with the true optimum.

:class:`Formulation` holds one program (variables, memory constraints, time objective, solve, read-back);
:func:`~memopt_nb.planners.optimal.optimal`, :func:`solve_min_peak` and :func:`place_states` use it; the budget check
every planner makes against the smallest reachable peak is :func:`~memopt_nb.planners.checks.check_budget`.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from ..core.device import DeviceSpec
from ..core.errors import BudgetError
from ..core.plan import DEFAULT_STRATEGIES, effective_triggers
from ..core.quiet import third_party_quiet
from ..core.space import PlanSpace
from ..core.strategies import by_code
from ..sim.simulator import NAMES, Simulator
from .heads import head_min_peak
from .options import (
    Option,
    as_simulator,
    evaluate_arrays,
    state_table_of,
    unit_options,
    unit_states,
)

__all__ = ["MIN_NODES", "NODE_FULL_NONZEROS", "NODE_LIMIT", "RANDOM_SEED", "Formulation", "cached_min_peak",
           "cached_min_peak_plan", "min_peak", "node_limit", "place_states", "solve_min_peak", "solve_min_peak_plan",
           "solver_options", "stopped_by"]

#: Branch-and-bound nodes HiGHS may solve per MILP of up to :data:`NODE_FULL_NONZEROS` nonzeros: the limit that ends a
#: solve which has not proven its optimum yet. A count of work, not seconds, so that the same program gives the same
#: plan however fast or loaded the machine is (HiGHS's search is deterministic for a given program and options; its
#: presolve and root node are work of their own, bounded by the program). The wall-clock ``time_limit`` each solve also
#: gets is only a safety net far above what these take; which limit ended a solve is :func:`stopped_by`
#: (``plan.meta["solver_stop"]``).
NODE_LIMIT = 2_000

#: Nonzeros of the constraint matrix up to which a MILP gets all :data:`NODE_LIMIT` nodes (the programs of up to about
#: 64 units); a larger one gets fewer, in proportion to the square of the ratio (a node's LP grows with the program,
#: and so do its presolve and root node, which no node limit bounds): see :func:`node_limit`.
NODE_FULL_NONZEROS = 400_000

#: The fewest nodes a MILP gets, however large.
MIN_NODES = 20

#: HiGHS's random seed, fixed (its default) so that the options, not the run, decide the search.
RANDOM_SEED = 0


def node_limit(nonzeros: int) -> int:
    """Branch-and-bound nodes for a program whose constraint matrix has ``nonzeros`` nonzeros: :data:`NODE_LIMIT` up
    to :data:`NODE_FULL_NONZEROS`, then fewer with the square of the size (at least :data:`MIN_NODES`)."""
    if nonzeros <= NODE_FULL_NONZEROS:
        return NODE_LIMIT
    return max(MIN_NODES, int(NODE_LIMIT * (NODE_FULL_NONZEROS / nonzeros) ** 2))


def solver_options(nonzeros: int) -> dict[str, Any]:
    """The limits a MILP of ``nonzeros`` nonzeros gets (SciPy ``milp`` options; HiGHS's own names pass through to
    it): counts of work, the same on every machine (no ``time_limit``: the caller adds its safety net)."""
    return {"node_limit": node_limit(nonzeros), "mip_rel_gap": 0.0, "random_seed": RANDOM_SEED}


Expr = dict[int, float]
_CUT_REACH = 8  # issue boundaries (4 units) a link-time cut looks back


def _rc_like(code: int) -> bool:
    """Recomputed in backward: recompute, recompute_offload, or selective with any save-set."""
    return by_code(code)[0].recomputes


def _pins(code: int) -> bool:
    """Recomputed with its inputs kept on the device by its checkpoint: recompute, or selective."""
    return by_code(code)[0].keeps_inputs


def _offloads(code: int) -> bool:
    """Offloads to the host, with the swap timing: swap or recompute_offload."""
    return by_code(code)[0].offloads


def _offloads_inputs(code: int) -> bool:
    """Recomputed with the inputs its checkpoint keeps offloaded: recompute_offload."""
    return _rc_like(code) and _offloads(code)


def _save_set(code: int) -> int:
    """The index of a selective code's save-set (its own peaks, held bytes and recompute time); -1 for other codes."""
    strategy, j = by_code(code)
    return j if strategy.variants else -1


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

    def solve(self, objective: Expr, time_limit: float, presolve: bool = True) -> Any:
        n = len(self.lb)
        cost = np.zeros(n)
        for j, a in objective.items():
            cost[j] += a
        a = coo_matrix((self.v, (self.r, self.c)), shape=(len(self.lo), n)).tocsr()
        t0 = time.perf_counter()

        def run(limit: float, presolve: bool) -> Any:
            with third_party_quiet():  # HiGHS prints debugging lines with C's printf, past sys.stdout
                with warnings.catch_warnings():  # SciPy warns that it passes HiGHS's own options on as they are
                    warnings.filterwarnings("ignore", message="Unrecognized options", category=RuntimeWarning)
                    res = milp(cost, constraints=LinearConstraint(a, self.lo, self.hi),
                               integrality=np.array(self.integer), bounds=Bounds(self.lb, self.ub),
                               options={**solver_options(a.nnz), "time_limit": limit, "presolve": presolve})
            if _NODE_LIMIT_STATUS in str(res.message):  # SciPy does not know this HiGHS status: a limit, as a time
                res.status = 1  # limit is (status 1), so callers treat both alike
            return res

        res = run(float(time_limit), presolve)
        if res.status == 4 and presolve:  # HiGHS's presolve fails on a few programs ("Solve error"): again without
            res = run(max(float(time_limit) - (time.perf_counter() - t0), 1.0), False)
        return res


#: how SciPy's message names HiGHS's "solution limit" status, which is what the node limit ends a solve with
_NODE_LIMIT_STATUS = "HiGHS Status 16:"


def stopped_by(res: Any) -> str:
    """What ended a solve (SciPy's ``milp`` result): ``"optimal"``, ``"infeasible"``, ``"node_limit"``
    (:data:`NODE_LIMIT`, the same on every machine), ``"time_limit"`` (the wall-clock safety net: the plan then depends
    on the machine's speed) or ``"error"``."""
    message = str(getattr(res, "message", ""))
    if _NODE_LIMIT_STATUS in message:
        return "node_limit"
    if "Time limit" in message:
        return "time_limit"
    return {0: "optimal", 2: "infeasible"}.get(int(getattr(res, "status", 4)), "error")


def _add(expr: Expr, other: Expr, scale: float = 1.0) -> None:
    for j, a in other.items():
        expr[j] = expr.get(j, 0.0) + scale * a


class Formulation:
    """One MILP over a simulator's model: the plan's variables and memory, with a budget or a peak to minimize, and the
    step time as objective.

    Build it, then either :meth:`limit_memory` (a budget) and :meth:`time_objective`, or :meth:`minimize_peak`; then
    :meth:`solve` and :meth:`read_back`.

    Args:
        sim: the compiled profile.
        space: the activation strategies (ignored where ``options`` are given) and state placements allowed.
        options: per unit the activation options to choose from (default: :func:`unit_options`); one option per
            unit fixes the activations (:func:`place_states`).
    """

    def __init__(self, sim: Simulator, space: PlanSpace, *, options: Sequence[Sequence[Option]] | None = None) -> None:
        self.sim = sim
        self.p = _Program()
        self.mem_scale = float(max(sim.start_level.max() + sim.rel.max(), 1.0))
        self.opts = [list(o) for o in options] if options is not None else [
            unit_options(sim, u, space.strategies) for u in range(sim.n)]
        self.table = state_table_of(sim)
        self.states = unit_states(sim, space, table=self.table)
        self.time_offset = 0.0  # set by time_objective
        self._activation_variables()
        self._memory()
        self._state_variables()

    # ------------------------------------------------------------------ variables
    def _activation_variables(self) -> None:
        """One binary per (unit, option), exactly one per unit, and the monotone prefetch triggers."""
        p, n = self.p, self.sim.n
        self.x: list[list[int]] = []
        for u in range(n):
            xs = [p.var(0, 1, True) for _ in self.opts[u]]
            self.x.append(xs)
            p.row({j: 1.0 for j in xs}, 1.0, 1.0)
        self.rc: list[Expr] = []  # recomputed: recompute, recompute_offload or selective
        self.sw: list[Expr] = []  # offloading: swap or recompute_offload
        self.ro: list[Expr] = []  # recompute_offload
        self.plain_rc: list[Expr] = []  # recomputed, inputs kept by the checkpoint: recompute or selective
        self.redo: list[Expr] = []  # seconds (unscaled) the unit's backward spends recomputing, per option
        for u in range(n):
            self.rc.append({self.x[u][i]: 1.0 for i, o in enumerate(self.opts[u]) if _rc_like(o[0])})
            self.sw.append({self.x[u][i]: 1.0 for i, o in enumerate(self.opts[u]) if _offloads(o[0])})
            self.ro.append({self.x[u][i]: 1.0 for i, o in enumerate(self.opts[u]) if _offloads_inputs(o[0])})
            self.plain_rc.append({self.x[u][i]: 1.0 for i, o in enumerate(self.opts[u]) if _pins(o[0])})
            self.redo.append({self.x[u][i]: self._redo_seconds(u, o[0])
                              for i, o in enumerate(self.opts[u]) if _rc_like(o[0])})
        dmax = max((o[2] for u in range(n) for o in self.opts[u] if _offloads(o[0])), default=0)
        for u in range(n):
            for v in range(u + 1, min(n, u + dmax + 1)):
                if not self.sw[u] or not self.sw[v]:
                    continue
                big = float(n)
                expr: Expr = {}
                for i, o in enumerate(self.opts[u]):
                    if _offloads(o[0]):
                        expr[self.x[u][i]] = expr.get(self.x[u][i], 0.0) + self.trig_of(u, o) + big
                for i, o in enumerate(self.opts[v]):
                    if _offloads(o[0]):
                        expr[self.x[v][i]] = expr.get(self.x[v][i], 0.0) - self.trig_of(v, o) + big
                p.row(expr, hi=2 * big)

    def _redo_seconds(self, u: int, code: int) -> float:
        """What unit ``u``'s backward spends recomputing under ``code``: its forward, or a save-set's share."""
        sim = self.sim
        j = _save_set(code)
        return float(sim.sel_time[u, j]) if j >= 0 else float(sim.fwd_time[u])

    def trig_of(self, u: int, o: Option) -> int:
        """The unit whose backward starts unit ``u``'s prefetch under swap (or recompute_offload) option ``o``."""
        return min(u + o[2], self.sim.n - 1)

    def _state_variables(self) -> None:
        """A binary per (unit, placement other than 0), at most one per unit, and ``any_state`` (1 iff some is set)."""
        p = self.p
        self.y: list[dict[int, int]] = []
        for u in range(self.sim.n):
            ys = {c: p.var(0, 1, True) for c in self.states[u][1:]}
            if len(ys) > 1:
                p.row({j: 1.0 for j in ys.values()}, hi=1.0)
            self.y.append(ys)
        chosen = [j for ys in self.y for j in ys.values()]
        self.any_state: int | None = None
        if not chosen:
            return
        z = p.var(0, 1)  # continuous: the two rows below pin it to 0 or 1
        for ys in self.y:
            if ys:
                row = {z: 1.0}
                _add(row, {j: -1.0 for j in ys.values()})
                p.row(row, lo=0.0)
        row = {j: 1.0 for j in chosen}
        row[z] = -1.0
        p.row(row, lo=0.0)
        self.any_state = z
        seg = np.asarray(self.table.seg_delta, dtype=float)
        for u, ys in enumerate(self.y):
            for c, j in ys.items():
                for k in np.nonzero(seg[u, c])[0]:
                    _add(self.mem_expr[int(k)], {j: float(seg[u, c, k])})

    # ------------------------------------------------------------------ memory
    def _memory(self) -> None:
        """Memory per segment (a constant plus an expression), and the copy jobs the offloads form."""
        sim = self.sim
        n, S = sim.n, sim.S
        self.mem_const = np.array(sim.start_level + sim.rel, dtype=float)
        self.mem_expr: list[Expr] = [dict() for _ in range(S)]
        for k in range(S):
            u = int(sim.seg_unit[k])
            if u >= 0 and self.rc[u]:
                for i, o in enumerate(self.opts[u]):
                    j = _save_set(o[0])
                    if j >= 0:  # the save-set's own peak above the segment's start
                        own = sim.sel_fwd_rel[u, j] if k == sim.fwd_seg[u] else sim.sel_bwd_rel[u, j]
                        _add(self.mem_expr[k], {self.x[u][i]: 1.0}, float(own - sim.rel[k]))
                    elif _rc_like(o[0]):
                        _add(self.mem_expr[k], {self.x[u][i]: 1.0}, float(sim.rc_rel[k] - sim.rel[k]))
        # what a selective unit's save-set holds: after its forward, through its backward
        for u in range(n):
            for i, o in enumerate(self.opts[u]):
                if _save_set(o[0]) >= 0:
                    held = float(sim.sel_held[u, _save_set(o[0])])
                    for k in range(int(sim.fwd_seg[u]) + 1, int(sim.bwd_seg[u]) + 1):
                        _add(self.mem_expr[k], {self.x[u][i]: 1.0}, held)
        # per (group, owner option) offload indicator, and the copy jobs they form
        self.off: dict[tuple[int, int, int], Expr] = {}  # (group, owner, option) -> offload indicator
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
        death, late = int(sim.g_death[g]), float(sim.g_late[g])
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
            if late > 0 and death >= 0 and k == death + 1:  # held past where the profiled run freed it, partway
                self.mem_const[death] += late * res.get(-1, 0.0)
                _add(self.mem_expr[death], {j: a for j, a in res.items() if j >= 0}, late)
            change = dict(res)
            change[-1] = change.get(-1, 0.0) - base
            const = change.pop(-1, 0.0)
            self.mem_const[k] += nb * const
            _add(self.mem_expr[k], change, nb)
        if any(self.ro[c] for c in set(savers) | set(consumers)):
            self._offload_by_plan(g, savers, consumers, producer)
            return
        if not sim.g_eligible[g]:
            return
        owner = int(sim.g_owner[g])
        pin = [c for c in consumers if c != owner and self.rc[c]]
        for i, o in enumerate(self.opts[owner]):
            if not _offloads(o[0]):  # here (no option of the group's units offloads inputs): a swap
                continue
            xi = self.x[owner][i]
            if pin:
                z = p.var(0, 1)
                p.row({z: 1.0, xi: -1.0}, hi=0.0)
                low = {z: 1.0, xi: -1.0}
                for c in pin:
                    row = {z: 1.0}
                    _add(row, self.rc[c])
                    p.row(row, hi=1.0)
                    _add(low, self.rc[c])
                # and z >= x_i - (pins): offloaded whenever nothing pins it (else the solver could skip the copy)
                p.row(low, lo=0.0)
                ind: Expr = {z: 1.0}
            else:
                ind = {xi: 1.0}
            self._offload(g, owner, i, ind)

    def _offload(self, g: int, owner: int, i: int, ind: Expr) -> None:
        """Group ``g`` offloaded by ``owner``'s option ``i`` when ``ind`` is 1: its memory off the device from the
        release point to the trigger's backward, its bytes on both copy queues."""
        sim = self.sim
        nb = float(sim.g_nb[g])
        o = self.opts[owner][i]
        self.off[(g, owner, i)] = ind
        r = self._release(g, o[1])
        t = int(sim.bwd_seg[self.trig_of(owner, o)])
        for k in range(r, t):
            _add(self.mem_expr[k], ind, -nb)
        _add(self.d2h_jobs[(int(sim.g_free[g]), r)], ind, nb)
        _add(self.h2d_bytes[owner], ind, nb)
        _add(self.h2d_count[owner], ind, float(sim.g_cnt[g]))

    def _offload_by_plan(self, g: int, savers: list[int], consumers: list[int], producer: int) -> None:
        """Offload of a group whose owner depends on the plan (some saver or consumer may take recompute_offload).

        Candidate ``c`` hands the group to the swap engine under option ``o`` when it saves it (and is not its producer
        recomputing it) or takes it as input under recompute_offload. The group is offloaded by ``c``'s option ``i``
        iff ``i`` is chosen, offloads and hands it over, no later candidate hands it over, and no consumer recomputes
        plainly (its checkpoint would hold the group): an indicator pinned to that conjunction from both sides.
        """
        sim, p = self.sim, self.p
        if not (sim.g_eligible[g] or sim.g_ro_eligible[g]):
            return

        def hands(c: int, o: Option) -> bool:
            return ((c in savers and not (c == producer and _rc_like(o[0])))
                    or (c in consumers and _offloads_inputs(o[0])))

        members = sorted(set(savers) | set(consumers))
        role = {c: [i for i, o in enumerate(self.opts[c]) if hands(c, o)] for c in members}
        for c in members:
            later = [v for v in members if v > c and role[v]]
            if any(len(role[v]) == len(self.opts[v]) for v in later):
                continue  # a later unit hands it over under every option: c never owns it
            blockers = [{self.x[v][i]: 1.0 for i in role[v]} for v in later]
            blockers += [self.plain_rc[q] for q in consumers if q != c and self.plain_rc[q]]
            for i in role[c]:
                if not _offloads(self.opts[c][i][0]):
                    continue
                xi = self.x[c][i]
                if not blockers:
                    self._offload(g, c, i, {xi: 1.0})
                    continue
                z = p.var(0, 1)
                p.row({z: 1.0, xi: -1.0}, hi=0.0)  # z <= x_i
                low = {z: 1.0, xi: -1.0}  # z >= x_i - sum(blockers)
                for b in blockers:
                    row = {z: 1.0}
                    _add(row, b)
                    p.row(row, hi=1.0)  # z <= 1 - blocker
                    _add(low, b)
                p.row(low, lo=0.0)
                self._offload(g, c, i, {z: 1.0})

    def _step_points(self) -> list[tuple[float, Expr]]:
        """Per point of the unit-by-unit optimizer step: its peak with every unit resident, and the chosen change."""
        if self.table is None or self.any_state is None:
            return []
        base = np.asarray(self.table.step_base, dtype=float)
        delta = np.asarray(self.table.step_delta, dtype=float)
        out = []
        for k in range(base.shape[0]):
            expr: Expr = {}
            for u, ys in enumerate(self.y):
                for c, j in ys.items():
                    if delta[u, c, k] != 0.0:
                        expr[j] = float(delta[u, c, k])
            out.append((float(base[k]), expr))
        return out

    def limit_memory(self, budget: float) -> None:
        """Every segment, and the optimizer step (plain or unit by unit), within ``budget`` bytes."""
        p, ms = self.p, self.mem_scale
        for k in range(self.sim.S):
            p.row({j: a / ms for j, a in self.mem_expr[k].items()}, hi=(budget - self.mem_const[k]) / ms)
        if self.table is None:
            return
        plain = float(self.table.plain_step_peak)
        z = self.any_state
        if plain > budget:  # plain * (1 - any) <= budget
            if z is None:
                p.row({p.var(0, 0): 1.0}, hi=(budget - plain) / ms)  # infeasible: no unit can move state
            else:
                p.row({z: -plain / ms}, hi=(budget - plain) / ms)
        for base, expr in self._step_points():  # base + expr <= budget + M * (1 - any)
            big = max(base - budget, 0.0)
            row = {j: a / ms for j, a in expr.items()}
            row[z] = row.get(z, 0.0) + big / ms
            p.row(row, hi=(budget + big - base) / ms)

    def minimize_peak(self) -> Expr:
        """A variable bounding every segment's and the step's memory from above; returns the objective (that peak)."""
        p, ms = self.p, self.mem_scale
        peak = p.var(0, np.inf)
        for k in range(self.sim.S):
            row = {j: a / ms for j, a in self.mem_expr[k].items()}
            row[peak] = -1.0
            p.row(row, hi=-self.mem_const[k] / ms)
        if self.table is not None:
            plain = float(self.table.plain_step_peak)
            z = self.any_state
            row = {peak: -1.0}
            if z is not None:
                row[z] = -plain / ms
            p.row(row, hi=-plain / ms)  # plain * (1 - any) <= peak
            for base, expr in self._step_points():  # base + expr - M * (1 - any) <= peak
                big = max(base, 0.0)
                row = {j: a / ms for j, a in expr.items()}
                row[z] = row.get(z, 0.0) + big / ms
                row[peak] = -1.0
                p.row(row, hi=(big - base) / ms)
        return {peak: 1.0}

    # ------------------------------------------------------------------ time
    def time_objective(self) -> tuple[Expr, float, float]:
        """The step time: ``(objective, constant, scale)``; seconds = (objective · x + constant) · scale
        + :attr:`time_offset` (the plain optimizer step, which no decision changes: kept out of the program so that
        with state fixed the program is the activation-only one, number for number)."""
        sim = self.sim
        n, S = sim.n, sim.S
        tscale = float(max(sim.dur.sum(), 1e-9))
        dur = sim.dur / tscale
        # the most each backward may recompute (a save-set's time, if more than the forward's)
        most = [max(e.values(), default=0.0) for e in self.redo]
        fwd = np.maximum(sim.fwd_time, np.array(most, dtype=float)) / tscale
        # DeviceSpec.copy_seconds is linear: its coefficients per byte (each direction) and per storage (round trip)
        dev = sim.device
        inv_d2h = float(dev.copy_seconds(1.0, 0, "d2h")) / tscale
        inv_h2d = float(dev.copy_seconds(1.0, 0, "h2d")) / tscale
        per_storage = float(dev.copy_seconds(0.0, 1, "both")) / tscale
        redo = [{j: a / tscale for j, a in e.items()} for e in self.redo]  # recompute seconds, scaled
        objective: Expr = {}
        for u in range(n):  # the training thread's per-storage share of every copy adds to the step on every device
            _add(objective, self.h2d_count[u], per_storage)
        if not dev.copy_overlap:
            for u in range(n):
                _add(objective, redo[u])
            for u in range(n):
                _add(objective, self.h2d_bytes[u], inv_d2h + inv_h2d)
            const = float(dur.sum())
        else:
            total_copy = float(sim.g_nb.sum()) * (inv_d2h + inv_h2d)
            big = float(dur.sum() + fwd.sum() + 2 * total_copy + 1.0)
            rho = self._schedule(dur, redo, big, inv_d2h, inv_h2d)
            objective[rho[S]] = 1.0
            const = 0.0
        if self.table is not None:
            self.time_offset = self._state_time(objective, tscale)
        return objective, const, tscale

    def _schedule(self, dur: np.ndarray, redo: list[Expr], big: float, inv_d2h: float, inv_h2d: float) -> list[int]:
        """Segment ready/start times with the two copy queues (copies beside compute); returns the ready times.
        ``redo``: per unit its recompute time (scaled) per chosen option."""
        sim, p = self.sim, self.p
        n, S = sim.n, sim.S
        rho = [p.var(0, big) for _ in range(S + 1)]
        sigma = [p.var(0, big) for _ in range(S)]
        p.row({rho[0]: 1.0}, 0.0, 0.0)
        for k in range(S):
            p.row({sigma[k]: 1.0, rho[k]: -1.0}, lo=0.0)
            row = {rho[k + 1]: 1.0, sigma[k]: -1.0}
            u = int(sim.seg_unit[k])
            if sim.kind[k] == 1:
                _add(row, redo[u], -1.0)
            p.row(row, lo=float(dur[k]))
        # device-to-host queue: jobs by eligibility boundary, then release point
        q_prev = None
        for (e, r) in sorted(self.d2h_jobs):
            bytes_expr = self.d2h_jobs[(e, r)]
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
        releases = sorted({r for (_, r) in self.d2h_jobs})
        issues = sorted({e for (e, _) in self.d2h_jobs})
        for r in releases:
            near = [e0 for e0 in issues if e0 <= r][-_CUT_REACH:]
            for e0 in near:
                row: Expr = {}
                for (e, rr), bytes_expr in self.d2h_jobs.items():
                    if e >= e0 and rr <= r:
                        _add(row, bytes_expr, -inv_d2h)
                if row:
                    row[sigma[r]] = 1.0
                    row[rho[e0]] = row.get(rho[e0], 0.0) - 1.0
                    p.row(row, lo=0.0)
        # host-to-device queue: per owner, in backward order
        h_prev = None
        for u in range(n - 1, -1, -1):
            if not self.sw[u]:
                continue
            h = p.var(0, big)
            if h_prev is not None:
                row = {h: 1.0, h_prev: -1.0}
                _add(row, self.h2d_bytes[u], -inv_h2d)
                p.row(row, lo=0.0)
            for i, o in enumerate(self.opts[u]):
                if not _offloads(o[0]):
                    continue
                t = int(sim.bwd_seg[self.trig_of(u, o)])
                row = {h: 1.0, rho[t]: -1.0, self.x[u][i]: -big}
                _add(row, self.h2d_bytes[u], -inv_h2d)
                p.row(row, lo=-big)
            p.row({sigma[int(sim.bwd_seg[u])]: 1.0, h: -1.0}, lo=0.0)
            h_prev = h
        # valid cuts: prefetches start no earlier than the first backward trigger, so all the bytes of owners >= u
        # are back only after that much link time
        first_bwd = int(min(sim.bwd_seg))
        acc: Expr = {}
        for u in range(n - 1, -1, -1):
            _add(acc, self.h2d_bytes[u], -inv_h2d)
            if acc and self.sw[u]:
                row = dict(acc)
                row[sigma[int(sim.bwd_seg[u])]] = 1.0
                row[rho[first_bwd]] = row.get(rho[first_bwd], 0.0) - 1.0
                p.row(row, lo=0.0)
        return rho

    def _state_time(self, objective: Expr, tscale: float) -> float:
        """Add the placements' time and the unit-by-unit step's extra to ``objective``; return the seconds by which
        the simulator's time of an all-resident plan exceeds the activation model's (the plain step)."""
        tm = np.asarray(self.table.time, dtype=float)
        for u, ys in enumerate(self.y):
            for c, j in ys.items():
                _add(objective, {j: float(tm[u, c]) / tscale})
        if self.any_state is not None:
            _add(objective, {self.any_state: float(self.table.chunked_step_extra) / tscale})
        sim = self.sim
        n = sim.n
        keep = np.zeros((1, n), dtype=np.int64)
        _, t = evaluate_arrays(sim, keep, np.ones((1, n), dtype=np.int64), np.ones((1, n), dtype=np.int64))
        return float(t[0]) - float(sim.dur.sum())

    # ------------------------------------------------------------------ solve
    def cap(self, objective: Expr, hi: float) -> None:
        """Only solutions whose objective is at most ``hi`` (a cut-off from a known plan)."""
        self.p.row(dict(objective), hi=hi)

    def solve(self, objective: Expr, time_limit: float) -> Any:
        """HiGHS on the program (SciPy's ``milp`` result). Programs with recompute_offload options are solved without
        HiGHS's presolve, which returned a suboptimal solution as optimal on some of them (zoo GPT, A100 preset)."""
        return self.p.solve(objective, time_limit, presolve=not any(self.ro))

    def read_back(self, xval: np.ndarray) -> tuple[list[int], list[int], list[int], list[int]]:
        """The solution as plan arrays: strategy codes, windows, distances and state placements."""
        codes, ws, ds, states = [], [], [], []
        for u in range(self.sim.n):
            vals = [xval[j] for j in self.x[u]]
            o = self.opts[u][int(np.argmax(vals))]
            codes.append(o[0])
            ws.append(o[1])
            ds.append(o[2])
            chosen = [c for c, j in self.y[u].items() if xval[j] > 0.5]
            states.append(chosen[0] if chosen else 0)
        return codes, ws, ds, states


# ---------------------------------------------------------------------- the floor and budget checks
def solve_min_peak(sim: Simulator, space: PlanSpace, time_limit: float = 600.0) -> int:
    """The smallest peak any plan in ``space`` reaches (bytes), by MILP, checked with the simulator."""
    return solve_min_peak_plan(sim, space, time_limit)[0]


#: a plan as arrays: strategy codes, windows, distances and state placements (what :meth:`Formulation.read_back` gives)
PlanArrays = tuple[list[int], list[int], list[int], list[int]]


def solve_min_peak_plan(sim: Simulator, space: PlanSpace, time_limit: float = 600.0) -> tuple[int, PlanArrays | None]:
    """:func:`solve_min_peak` and a plan that reaches it (``None`` when the solve hit a limit, :data:`NODE_LIMIT` or
    the ``time_limit`` safety net: the value is then the solver's lower bound, which no plan it found reaches)."""
    form = Formulation(sim, space)
    objective = form.minimize_peak()
    res = form.solve(objective, time_limit)
    if res.status != 0 and (res.status == 1 or res.x is not None):  # a limit: never refuse a budget some plan
        # might meet; the proven bound is a floor (at a few hundred units HiGHS may not find a plan within its limits)
        bound = getattr(res, "mip_dual_bound", None)
        return (int(np.floor(float(bound) * form.mem_scale)) if bound is not None and np.isfinite(bound) else 0), None
    if res.x is None:  # pragma: no cover - solver failure
        raise BudgetError(f"could not compute the minimum peak: {res.message}")
    codes, ws, ds, states = form.read_back(res.x)
    value = evaluate_arrays(sim, np.array([codes]), np.array([ws]), np.array([ds]), np.array([states]))[0][0]
    return int(np.ceil(value)), (codes, ws, ds, states)


_MIN_PEAK: dict[tuple[Any, ...], tuple[weakref.ref, int, PlanArrays | None]] = {}


def cached_min_peak(sim: Simulator, space: PlanSpace) -> int:
    """:func:`min_peak` for a compiled simulator, cached per profile, device, simulator class and space."""
    return cached_min_peak_plan(sim, space)[0]


def cached_min_peak_plan(sim: Simulator, space: PlanSpace) -> tuple[int, PlanArrays | None]:
    """:func:`solve_min_peak_plan`, cached like :func:`cached_min_peak` (which shares its cache)."""
    key = (id(sim.profile), repr(sim.device), type(sim), space)
    hit = _MIN_PEAK.get(key)
    if hit is not None and hit[0]() is sim.profile:
        return hit[1], hit[2]
    value, arrays = solve_min_peak_plan(sim, space)
    _MIN_PEAK[key] = (weakref.ref(sim.profile), value, arrays)
    return value, arrays


def place_states(sim: Simulator, budget: float, codes: Sequence[int], windows: Sequence[int],
                 distances: Sequence[int], space: PlanSpace, *, time_limit: float = 600.0,
                 stops: list[str] | None = None) -> list[int]:
    """The fastest state placement per unit (indices into STATE_CHOICES) that fits ``budget`` with the activation
    decisions fixed (exact: the MILP with one option per unit); if none fits, the one with the smallest peak.

    Everything stays resident when ``space`` moves no state, or the simulator has no state model. ``stops`` receives
    what ended each solve (:func:`stopped_by`).
    """
    n = sim.n
    if not any(len(row) > 1 for row in unit_states(sim, space, table=state_table_of(sim))):
        return [0] * n  # nothing can move: no formulation to build (its memory rows take seconds at depth)
    trig = effective_triggers([NAMES[int(c)] for c in codes], list(distances))
    # a swap's distance as the trigger it really gets, so the MILP's monotone-trigger rows hold
    options = [[(int(c), int(w), int(t - u) if t is not None else int(d))]
               for u, (c, w, d, t) in enumerate(zip(codes, windows, distances, trig, strict=True))]
    form = Formulation(sim, space, options=options)
    if form.any_state is None:
        return [0] * n
    form.limit_memory(budget)
    objective, _, _ = form.time_objective()
    res = form.solve(objective, time_limit)
    if stops is not None:
        stops.append(stopped_by(res))
    if res.x is None:
        form = Formulation(sim, space, options=options)
        res = form.solve(form.minimize_peak(), time_limit)
        if stops is not None:
            stops.append(stopped_by(res))
        if res.x is None:  # pragma: no cover - solver failure
            return [0] * n
    return form.read_back(res.x)[3]


@head_min_peak
def min_peak(profile: Any, device: DeviceSpec | str | None = None,
             strategies: str | Sequence[str] = DEFAULT_STRATEGIES, *,
             offload_state: bool | str | Iterable[str] = True, step_in_backward: bool = False) -> int:
    """The smallest peak memory (bytes) any plan reaches for ``profile`` on ``device``, using only ``strategies`` for
    activations (a non-empty set of keep, recompute, swap, recompute_offload, selective, else
    :class:`~memopt_nb.core.errors.PlanError`; default keep, recompute, swap; selective needs a profile made with
    ``selective=True``) and moving only the state ``offload_state`` allows (``False``: activations only)."""
    return cached_min_peak(as_simulator(profile, device), PlanSpace.of(strategies, offload_state, step_in_backward))
