"""The plan options every planner shares (the MILP, the agents, the polish, the baselines): per unit the activation
options and the state placements it may take, how the options are numbered, and turning the chosen arrays into a
:class:`~memopt_nb.core.plan.Plan` with the simulator's prediction.

This module depends on nothing else in :mod:`memopt_nb.planners`; the MILP (:mod:`.milp`) builds on it, and the budget
checks (which need the MILP's minimum peak) sit above both. Which options exist follows the strategy registry
(:mod:`memopt_nb.core.strategies`): a strategy that ``recomputes`` needs a recomputable unit, one that ``offloads`` a
swappable one, a ``timed`` one comes with every distinct (offload window, prefetch distance) of :data:`TIMINGS`, one
with variants (selective's save-sets) with each variant the unit's profile offers.

**Option numbering** (the agents' actions and the polish's moves): the registry's strategies in order, each taking
consecutive indices: a timed one one per timing of :data:`TIMINGS` (``OPTION_BASE[code] + j`` for ``TIMINGS[j]``),
one with variants one per variant, any other one. So 0 keep, 1 recompute, ``2 + j`` swap, ``2 + len(TIMINGS) + j``
recompute_offload, :data:`SELECTIVE_BASE` ``+ j`` selective with ``SAVE_SETS[j]``; an option index means the same in
every task (a task leaves out the columns after the last strategy it offers). :func:`option_codes` and
:func:`code_options` convert.

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
from ..core.strategies import CODES, REGISTRY, Strategy, by_code
from ..sim.simulator import KEEP, NAMES, Simulator, save_set_of

__all__ = ["DEFAULT_TIMING", "N_OPTIONS", "OPTION_BASE", "OffloadState", "Option", "PlanSpace", "SELECTIVE_BASE",
           "TIMINGS", "allowed_strategies", "as_simulator", "check_save_sets", "code_options", "evaluate_arrays",
           "make_plan", "option_codes", "plan_decisions", "state_table_of", "uniform_arrays", "unit_options",
           "unit_ok", "unit_states"]

Option = tuple[int, int, int]  # (strategy code, offload window, prefetch distance)
_FETCH: Any = object()  # unit_states: fetch the state table from the simulator

#: Timing options of a timed strategy: (offload window, prefetch distance) pairs.
TIMINGS: tuple[tuple[int, int], ...] = tuple((w, d) for w in WINDOWS for d in DISTANCES)
#: The timing a swap gets when nobody chooses one (the timing agent's difference reward is measured against it).
DEFAULT_TIMING = TIMINGS.index((1, 1))


def _width(s: Strategy) -> int:
    return len(TIMINGS) if s.timed else max(1, len(s.variants))


#: Strategy code -> the index of its first option (see the module docstring).
OPTION_BASE: dict[int, int] = {s.code: sum(_width(r) for r in REGISTRY[:i]) for i, s in enumerate(REGISTRY)}
#: The options of the default strategies (keep, recompute, swap × timings): a task without opt-in strategies has
#: these columns (a task with more: ``task.n_options``).
N_OPTIONS = max(OPTION_BASE[s.code] + _width(s) for s in REGISTRY if s.default)
#: The first option index of the selective options, in a task that offers them (``SELECTIVE_BASE + j``: save-set
#: ``SAVE_SETS[j]``): after the strategies before it in the registry (recompute_offload's columns are there, not
#: allowed, when it is not in ``strategies``), so that an option index means the same in every such task.
SELECTIVE_BASE = OPTION_BASE[CODES["selective"]]
# option index -> strategy code, window, distance; strategy code -> its (first) option index; which codes are timed
_OPTION_ROWS = [row for s in REGISTRY for row in ([(s.code, w, d) for w, d in TIMINGS] if s.timed
                                                   else [(c, *s.timing) for c in s.codes])]
_OPTION_CODE, _OPTION_WINDOW, _OPTION_DISTANCE = (np.array(c, dtype=np.int64) for c in zip(*_OPTION_ROWS, strict=True))
_CODE_OPTION = np.array([OPTION_BASE[by_code(c)[0].code] + by_code(c)[1] for c in NAMES], dtype=np.int64)
_CODE_TIMED = np.array([by_code(c)[0].timed for c in NAMES])


def option_codes(opt_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Option indices as strategy codes, windows and distances: 0 keep, 1 recompute, ``2 + j`` swap and
    ``2 + len(TIMINGS) + j`` recompute_offload with ``TIMINGS[j]``, ``SELECTIVE_BASE + j`` selective with
    ``SAVE_SETS[j]`` (an untimed strategy carries its fixed timing, ``(1, 1)`` for those above)."""
    opt_idx = np.asarray(opt_idx)
    return _OPTION_CODE[opt_idx], _OPTION_WINDOW[opt_idx], _OPTION_DISTANCE[opt_idx]


def code_options(codes: np.ndarray, windows: np.ndarray, dists: np.ndarray) -> np.ndarray:
    """Strategy codes with their timings as option indices (the inverse of :func:`option_codes`)."""
    codes = np.asarray(codes)
    idx = _CODE_OPTION[codes]
    for u in np.flatnonzero(_CODE_TIMED[codes]):
        idx[u] += TIMINGS.index((int(windows[u]), int(dists[u])))
    return idx


def unit_ok(sim: Simulator, s: Strategy) -> np.ndarray:
    """Which units may take strategy ``s``: ``(n,)``, or ``(n, variants)`` for one with variants (selective: the
    unit's Pareto save-sets). A recomputing strategy needs a recomputable unit, an offloading one a swappable one."""
    ok = np.ones(sim.n, dtype=bool)
    if s.recomputes:
        ok = ok & sim.recomputable
    if s.offloads:
        ok = ok & sim.swappable
    if s.variants:
        pareto = getattr(sim, "sel_pareto", None)
        return ok[:, None] & (pareto if pareto is not None else np.zeros((sim.n, len(s.variants)), dtype=bool))
    return ok


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
    for s in REGISTRY:
        if s.name not in strategies:
            continue
        ok = unit_ok(sim, s)[u]
        if s.variants:
            out.extend((s.code + int(j), *s.timing) for j in np.nonzero(ok)[0])
        elif ok and s.timed:
            out.extend((s.code, w, d) for w in _distinct(WINDOWS, lambda w: min(u + 1 + w, n))
                       for d in _distinct(DISTANCES, lambda d: min(u + d, n - 1)))
        elif ok:
            out.append((s.code, *s.timing))
    if not out:
        out.append((KEEP, 1, 1))
    return out


def _distinct(values: Sequence[int], effect: Any) -> list[int]:
    """``values`` without those whose ``effect`` an earlier one already has."""
    seen, out = set(), []
    for v in values:
        if effect(v) not in seen:
            seen.add(effect(v))
            out.append(v)
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
    strategy, j = by_code(code)
    ok = np.ones(n, dtype=bool)
    if strategy.recomputes:
        ok &= sim.recomputable
    if strategy.offloads:
        ok &= sim.swappable
    if strategy.variants:
        ok &= sim.sel_has[:, j]
    codes = [code if ok[u] else KEEP for u in range(n)]
    return codes, [window] * n, [distance] * n
