"""The plan space every planner shares: per unit its activation options and the state placements it may take, and
turning the chosen arrays into a :class:`~memopt_nb.core.plan.Plan` with the simulator's prediction.

This module depends on nothing else in :mod:`memopt_nb.planners`; the MILP (:mod:`.milp`) builds on it, and the budget
checks (which need the MILP's minimum peak) sit above both.

State placements are indices into :data:`~memopt_nb.core.plan.STATE_CHOICES` (0: everything resident). Which ones a plan
may use is :func:`memopt_nb.core.plan.state_choices` of the planner's ``offload_state=`` and ``step_in_backward=``
arguments; which ones a *unit* may use also depends on the simulator's :class:`StateTable` (the cost model of the
state part, ``Simulator.state_table()``): a placement that changes nothing for the unit (a unit without parameters, a
piece of state the unit does not have) is not offered, since all it could do is switch the whole step to the
unit-by-unit one. A simulator without ``state_table`` (no state model) offers only placement 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.device import DeviceSpec
from ..core.errors import BudgetError, MemoptError, PlanError
from ..core.plan import (
    DEFAULT_STRATEGIES,
    DISTANCES,
    STATE_CHOICES,
    STRATEGIES,
    WINDOWS,
    Decision,
    Plan,
    selective_decision,
    with_profile_facts,
)
from ..core.space import OffloadState, PlanSpace, allowed_strategies
from ..sim.simulator import KEEP, NAMES, RECOMPUTE, RECOMPUTE_OFFLOAD, SELECTIVE, SWAP, Simulator, save_set_of

__all__ = ["OffloadState", "Option", "PlanSpace", "allowed_strategies", "as_simulator", "check_save_sets",
           "evaluate_arrays", "make_plan", "plan_decisions", "state_table_of", "uniform_arrays", "unit_options",
           "unit_states"]

Option = tuple[int, int, int]  # (strategy code, offload window, prefetch distance)
_FETCH: Any = object()  # unit_states: fetch the state table from the simulator


def check_save_sets(sim: Simulator, strategies: Sequence[str]) -> None:
    """Refuse ``"selective"`` asked for on a profile without save-sets (every planner's options go through here).

    ``strategies`` asks for selective explicitly when it names it without being the whole of
    :data:`~memopt_nb.core.plan.STRATEGIES` (which stands for "everything this profile offers": with a profile made
    without ``selective=True`` it simply offers no selective option). Raises :class:`~memopt_nb.core.errors.PlanError`
    when it does and no unit of the profile has any save-set.
    """
    if "selective" not in strategies or set(strategies) >= set(STRATEGIES):
        return
    has = getattr(sim, "sel_has", None)
    if has is not None and np.any(has):
        return
    raise PlanError("strategies= asks for 'selective', but this profile has no save-sets: profile the model with "
                    "memopt.profile(..., selective=True), or leave 'selective' out of strategies=")


def unit_options(sim: Simulator, u: int, strategies: Sequence[str] = DEFAULT_STRATEGIES) -> list[Option]:
    """The distinct choices for unit ``u``: keep, recompute, and swap with each window and prefetch distance, then
    (only when ``strategies`` has them) recompute_offload with each of the same timings, and selective with each of
    the unit's Pareto save-sets (code ``SELECTIVE + j`` for ``SAVE_SETS[j]``; its timing, which nothing reads, is the
    default ``(1, 1)`` as for keep and recompute, so that a planner's decision equals a hand-made one).

    Recompute needs a recomputable unit; swap a swappable one on a device with a host link; recompute_offload both;
    selective a recomputable unit whose profile has save-sets (``profile(..., selective=True)``; see
    :func:`check_save_sets` for the error when none has). Timings that cannot differ in effect are collapsed (a
    prefetch distance past the last unit, a window that already reaches the end of the forward), so every option
    listed leads to a different plan.
    """
    for s in strategies:
        if s not in STRATEGIES:
            raise BudgetError(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    check_save_sets(sim, strategies)
    n = sim.n
    out: list[Option] = []
    if "keep" in strategies:
        out.append((KEEP, 1, 1))
    if "recompute" in strategies and sim.recomputable[u]:
        out.append((RECOMPUTE, 1, 1))
    timed = "swap" in strategies and sim.swappable[u]
    timed_ro = "recompute_offload" in strategies and sim.swappable[u] and sim.recomputable[u]
    if timed or timed_ro:
        seen_w, seen_d = set(), set()
        ws = []
        for w in WINDOWS:
            key = min(u + 1 + w, n)
            if key not in seen_w:
                seen_w.add(key)
                ws.append(w)
        ds = []
        for d in DISTANCES:
            key = min(u + d, n - 1)
            if key not in seen_d:
                seen_d.add(key)
                ds.append(d)
        if timed:
            out.extend((SWAP, w, d) for w in ws for d in ds)
        if timed_ro:
            out.extend((RECOMPUTE_OFFLOAD, w, d) for w in ws for d in ds)
    if "selective" in strategies and sim.recomputable[u]:
        pareto = getattr(sim, "sel_pareto", None)
        if pareto is not None:
            out.extend((SELECTIVE + int(j), 1, 1) for j in np.nonzero(pareto[u])[0])
    if not out:
        out.append((KEEP, 1, 1))
    return out


def as_simulator(profile: Any, device: DeviceSpec | str | None) -> Simulator:
    """``profile`` compiled for ``device`` (a :class:`Simulator` is returned as it is)."""
    return profile if isinstance(profile, Simulator) else Simulator(profile, device)


def state_table_of(sim: Simulator) -> Any | None:
    """The simulator's state cost model (``sim.state_table()``), checked against the contract; ``None`` if it has none.

    The table's shapes must be ``seg_delta (n, C, S)``, ``step_delta (n, C, K)``, ``step_base (K,)`` and
    ``time (n, C)`` with ``C = len(STATE_CHOICES)`` and ``choices == STATE_CHOICES``.
    """
    fn = getattr(sim, "state_table", None)
    if fn is None:
        return None
    table = fn()
    if table is None:
        return None
    n, S, C = sim.n, sim.S, len(STATE_CHOICES)
    K = np.shape(table.step_base)[0] if np.ndim(table.step_base) == 1 else -1
    problems = []
    if tuple(tuple(c) for c in table.choices) != STATE_CHOICES:
        problems.append("its choices are not plan.STATE_CHOICES")
    for name, want in (("seg_delta", (n, C, S)), ("step_delta", (n, C, K)), ("time", (n, C))):
        got = np.shape(getattr(table, name))
        if got != want:
            problems.append(f"{name} has shape {got}, expected {want}")
    if problems:
        raise MemoptError(f"the simulator's state table does not fit its profile ({n} units, {S} segments): "
                          f"{'; '.join(problems)}")
    return table


def unit_states(sim: Simulator, space: PlanSpace, table: Any = _FETCH) -> list[list[int]]:
    """Per unit the placements (indices into :data:`STATE_CHOICES`, 0 first) a planner may choose from.

    A placement other than 0 is offered only if the state table says it changes something for the unit (its memory
    at some segment or step point, or its time), and a streamed one only if it does better than moving the same
    state whole somewhere (lower memory at some segment or step point, or less time): otherwise the whole move is at
    least as good in every respect (a unit of one parameter, say). ``table``: the simulator's state table if already
    fetched.
    """
    allowed = space.placements
    if table is _FETCH:
        table = state_table_of(sim) if len(allowed) > 1 else None
    if table is None or len(allowed) == 1:
        return [[0] for _ in range(sim.n)]
    seg = np.asarray(table.seg_delta)
    step = np.asarray(table.step_delta)
    tm = np.asarray(table.time, dtype=float)
    whole = {c: STATE_CHOICES.index(("offload", *STATE_CHOICES[c][1:])) for c in allowed
             if STATE_CHOICES[c][0] == "stream"}
    allowed_rows = getattr(table, "allowed", None)

    def better_than_whole(u: int, c: int) -> bool:
        w = whole.get(c)
        if w is None or w not in allowed or (allowed_rows is not None and not allowed_rows[u, w]):
            return True
        return bool((seg[u, c] < seg[u, w]).any() or (step[u, c] < step[u, w]).any() or tm[u, c] < tm[u, w])

    out = []
    for u in range(sim.n):
        out.append([0] + [c for c in allowed[1:]
                          if (seg[u, c].any() or step[u, c].any() or tm[u, c] != 0.0) and better_than_whole(u, c)])
    return out


def evaluate_arrays(sim: Simulator, strategies: Any, windows: Any, distances: Any,
                    states: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """``sim.evaluate`` on ``(B, n)`` arrays; ``states`` (indices into STATE_CHOICES) are passed only when some unit
    moves state, so that a simulator without a state model still evaluates activation-only plans."""
    if states is not None and np.any(np.asarray(states)):
        return sim.evaluate(strategies, windows, distances, states=np.atleast_2d(np.asarray(states, dtype=np.int64)))
    return sim.evaluate(strategies, windows, distances)


def make_plan(sim: Simulator, strategies: Sequence[int], windows: Sequence[int], distances: Sequence[int], *,
              budget: int | None, method: str, seed: int | None = None, states: Sequence[int] | None = None,
              step_in_backward: bool = False, **meta: Any) -> Plan:
    """A Plan from arrays (strategy codes, windows, distances, state placements), with the simulator's prediction and
    feasibility filled in.

    ``plan.step_in_backward`` is set when asked or when some unit steps in backward; the optimizer fingerprint the
    profile recorded is carried when the plan moves state.
    """
    s = np.asarray(strategies, dtype=np.int64)[None]
    w = np.asarray(windows, dtype=np.int64)[None]
    d = np.asarray(distances, dtype=np.int64)[None]
    c = np.zeros_like(s) if states is None else np.asarray(states, dtype=np.int64)[None]
    peak, time = evaluate_arrays(sim, s, w, d, c)
    profile = sim.profile
    decisions = plan_decisions(profile, s[0].tolist(), w[0].tolist(), d[0].tolist(), c[0].tolist())
    moves = any(x.moves_state for x in decisions)
    stepped = any(x.grads == "step" for x in decisions)
    profile_meta = getattr(profile, "meta", None) or {}
    plan = Plan(
        decisions=decisions,
        fingerprint=profile.fingerprint,
        model_fingerprint=profile_meta.get("model_fingerprint"),
        budget_bytes=budget,
        device=sim.device.to_dict(),
        method=method,
        seed=seed,
        predicted_peak_bytes=int(round(float(peak[0]))),
        predicted_step_time=float(time[0]),
        feasible=None if budget is None else bool(peak[0] <= budget),
        meta=with_profile_facts(meta, profile),
        step_in_backward=bool(step_in_backward or stepped),
        optimizer_fingerprint=profile_meta.get("optimizer_fingerprint") if moves else None,
    )
    plan._model_ref = getattr(profile, "_model_ref", None)
    plan._optimizer_ref = getattr(profile, "_optimizer_ref", None)
    return plan


def plan_decisions(profile: Any, codes: Sequence[int], windows: Sequence[int], distances: Sequence[int],
                   states: Sequence[int] | None = None) -> tuple[Decision, ...]:
    """Decisions from plan arrays (strategy codes, windows, distances, state indices): a selective code becomes
    ``Decision(strategy="selective", save_set=..., save_ops=...)`` with the ops the profile's save-set lists, so the
    plan applies without the profile."""
    states = [0] * len(codes) if states is None else list(states)
    names = profile.unit_names
    out = []
    for u, (code, w, d, c) in enumerate(zip(codes, windows, distances, states, strict=True)):
        save_set = save_set_of(int(code))
        if save_set:
            out.append(selective_decision(profile.units[u], save_set, int(w), int(d), STATE_CHOICES[int(c)]))
        else:
            out.append(Decision(names[u], NAMES[int(code)], int(w), int(d), *STATE_CHOICES[int(c)]))
    return tuple(out)


def uniform_arrays(sim: Simulator, code: int, window: int = 1, distance: int = 1) -> tuple[list, list, list]:
    """The arrays of a plan that gives every unit ``code`` (units that cannot take it keep; a selective code needs
    the unit to offer that save-set)."""
    n = sim.n
    codes = []
    for u in range(n):
        if (code in (RECOMPUTE, RECOMPUTE_OFFLOAD) and not sim.recomputable[u]
                or code in (SWAP, RECOMPUTE_OFFLOAD) and not sim.swappable[u]
                or code >= SELECTIVE and not (sim.recomputable[u] and sim.sel_has[u, code - SELECTIVE])):
            codes.append(KEEP)
        else:
            codes.append(code)
    return codes, [window] * n, [distance] * n
