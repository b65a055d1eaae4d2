"""The state part of the simulator's cost model: where each unit's optimizer state, gradients and parameters live
(plan schema 2), compiled into a :class:`StateTable` and scored for a batch of plans.

The rules are those of :mod:`memopt_nb.sim.simulator`'s docstring (written down once in
``memopt_nb/sim/COST_MODEL.md``); this module holds their compiled form, beside the simulator's activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.errors import PlanError
from ..core.plan import STATE_CHOICES

__all__ = ["StateTable", "compile_state", "state_part", "stream_peak"]


def _row_sums(values: np.ndarray, rows: np.ndarray, B: int, width: int) -> np.ndarray:
    """``(B, width)`` sums of the rows of ``values`` (``(k, width)``, integers) that ``rows`` (``(k,)``, ascending)
    assigns to each plan; zero for a plan with none."""
    out = np.zeros((B, width), dtype=values.dtype)
    if rows.size:
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        out[rows[starts]] = np.add.reduceat(values, starts, axis=0)
    return out


def stream_peak(unit: Any, with_grads: bool) -> int:
    """The most a streamed unit's step holds of its own state at once, its step's peak included: per parameter ``j``
    its state, the next parameter's on its way in, its gradient when ``with_grads`` (brought back for its step) and
    the step's own peak (``UnitProfile.param_steps``)."""
    rows = unit.param_steps
    return max(int(r["optimizer_bytes"]) + (int(rows[j + 1]["optimizer_bytes"]) if j + 1 < len(rows) else 0)
               + (int(r["grad_bytes"]) if with_grads else 0) + int(r["step_rel_peak"]) for j, r in enumerate(rows))


@dataclass(frozen=True)
class StateTable:
    """The state part of the cost model, in the separable form the planners use (one row per unit and placement).

    With ``c_u`` each unit's index into ``choices`` (:data:`~memopt_nb.core.plan.STATE_CHOICES`) and ``act_peak[s]`` the
    peak of segment ``s`` under the activation plan alone::

        peak = max( max_s (act_peak[s] + sum_u seg_delta[u, c_u, s]),
                    plain_step_peak                                   if every c_u == 0
                    max_k (step_base[k] + sum_u step_delta[u, c_u, k])  otherwise )
        time = activation time (plain step included) + sum_u time[u, c_u] + (chunked_step_extra if any c_u != 0)

    Attributes:
        choices: the placements, ``STATE_CHOICES`` (index 0: all resident).
        seg_delta: ``(n, C, S)`` change of segment ``s``'s peak when unit ``u`` takes choice ``c``. The plain step's
            segment (``step_segment``) gets ``-plain_step_peak`` for every choice that moves something, so that once
            any unit moves, the unit-by-unit step points (not the plain step) bound the step; rows of choice 0, and
            of units with no parameters, are zero.
        step_base: ``(K,)`` peak at each point of the unit-by-unit step with every unit resident (``K = n + 1``:
            point 0 steps the parameters outside units, point ``k + 1`` unit ``k``).
        step_delta: ``(n, C, K)`` change of step point ``k``'s peak when unit ``u`` takes choice ``c``.
        plain_step_peak: peak of the plain optimizer step (every unit resident).
        time: ``(n, C)`` seconds unit ``u``'s choice ``c`` adds to the step.
        chunked_step_extra: seconds the unit-by-unit step costs over the plain one.
        allowed: ``(n, C)`` whether unit ``u`` can take choice ``c`` at all (has parameters the optimizer steps; its
            parameters can be offloaded); planners also apply :func:`~memopt_nb.core.plan.state_choices`.
        step_segment: index of the plain step's segment (``-1``: the profile has none).
    """

    choices: tuple[tuple[str, str, str], ...]
    seg_delta: np.ndarray
    step_base: np.ndarray
    step_delta: np.ndarray
    plain_step_peak: int
    time: np.ndarray
    chunked_step_extra: float
    allowed: np.ndarray | None = None
    step_segment: int = -1


def compile_state(sim: Any) -> StateTable:
    """The :class:`StateTable` of simulator ``sim``: per unit and placement, bytes and seconds."""
    prof, n, S, C, ss = sim.profile, sim.n, sim.S, len(STATE_CHOICES), sim.step_segment
    units, segs = prof.units, prof.segments
    peak0 = sim.start_level + sim.rel  # every unit kept, every placement resident
    level_after = np.append(sim.start_level[1:], sim.start_level[-1] if S else 0)
    seg_delta = np.zeros((n, C, S), dtype=np.int64)
    step_delta = np.zeros((n, C, n + 1), dtype=np.int64)
    tcost = np.zeros((n, C))
    allowed = np.zeros((n, C), dtype=bool)
    allowed[:, 0] = True
    rel = [int(getattr(prof, "outside_step_rel_peak", 0))] + [int(getattr(u, "step_rel_peak", 0)) for u in units]
    base_level = int(segs[ss].start_level) if ss >= 0 else 0
    step_base = np.array([base_level + r for r in rel], dtype=np.int64)
    plain = int(peak0[ss]) if ss >= 0 else 0
    step_t = [float(getattr(prof, "outside_step_time", 0.0)) * sim.factor] + [
        float(getattr(u, "step_time", 0.0)) * sim.factor for u in units]
    seg_idx = np.arange(S)
    # what the runtime may move for this profile (memopt_nb.runtime.distributed.per_rank: nothing under FSDP2, no
    # gradients under DDP); a choice that moves anything else is left out (all-zero rows, not allowed)
    movable = prof.meta.get("state_movable")
    movable = None if movable is None else set(movable)
    for u, up in enumerate(units):
        P, G, Ost = int(up.param_bytes), int(getattr(up, "grad_bytes", 0)), int(getattr(up, "optimizer_bytes", 0))
        nP, nG, nO = (int(getattr(up, k, 0)) for k in ("param_storages", "grad_storages", "optimizer_storages"))
        if G == 0:
            continue  # nothing the optimizer steps: every choice is choice 0
        fs, bs = int(sim.fwd_seg[u]), int(sim.bwd_seg[u])
        fwd_from = int(sim.fwd_seg[u - 1]) if u > 0 else fs
        bwd_from = int(sim.bwd_seg[u + 1]) if u + 1 < n else bs
        p_here = ((seg_idx >= fwd_from) & (seg_idx <= fs)) | ((seg_idx >= bwd_from) & (seg_idx <= bs))
        after_bwd = seg_idx > bs
        for c, (o, g, p) in enumerate(STATE_CHOICES):
            if c == 0:
                continue
            if p == "offload" and not getattr(up, "params_offloadable", False):
                continue
            if o == "stream" and not up.param_steps:
                continue  # profiled without the per-parameter steps: it cannot stream
            if movable is not None and ((o != "resident" and "optimizer" not in movable)
                                        or (g != "resident" and "grads" not in movable)
                                        or (p == "offload" and "params" not in movable)):
                continue
            allowed[u, c] = True
            d = np.zeros(S, dtype=np.int64)
            k = np.zeros(n + 1, dtype=np.int64)
            mine = u + 1  # the step point of unit u; point u is the one before, while u's state comes in
            near = np.zeros(n + 1, dtype=bool)
            near[u:u + 2] = True
            if o != "resident":
                d -= Ost
                k -= np.where(near & (g != "step"), 0, Ost)
            if o == "stream" and g != "step":  # one parameter's state at a time (stream_peak)
                k[u] += int(up.param_steps[0]["optimizer_bytes"]) - Ost  # the previous part brings the first
                k[mine] += stream_peak(up, g == "offload") - Ost - (G if g == "offload" else 0) - rel[mine]
            if g in ("offload", "step"):
                d -= np.where(after_bwd, G, 0)
                k -= G
                if g == "offload":
                    k[mine] += G  # brought back for its step
                else:
                    k[mine] -= rel[mine]  # stepped in backward: nothing to step here
            if p == "offload":
                d -= np.where(p_here, 0, P)
                k -= np.where(near & (g != "step"), 0, P)
            if g == "step":  # the step at the end of its backward: the level there plus the step's own peak
                own = rel[mine] if o != "stream" else stream_peak(up, False) - Ost
                spike = int(level_after[bs]) + int(getattr(up, "grads_done_extra", 0)) + own
                d[bs] = max(int(peak0[bs]) + int(d[bs]), spike) - int(peak0[bs])
            if ss >= 0:
                d[ss] = -plain
            seg_delta[u, c] = d
            step_delta[u, c] = k
            tcost[u, c] = _state_seconds(sim, u, o, g, p, P, G, Ost, nP, nG, nO, step_t)
    extra = max(0.0, (float(getattr(prof, "chunked_step_time", 0.0)) - (segs[ss].time if ss >= 0 else 0.0))
                ) * sim.factor
    return StateTable(choices=STATE_CHOICES, seg_delta=seg_delta, step_base=step_base, step_delta=step_delta,
                      plain_step_peak=plain, time=tcost, chunked_step_extra=extra, allowed=allowed,
                      step_segment=ss)


def _state_seconds(sim: Any, u: int, o: str, g: str, p: str, P: int, G: int, Ost: int, nP: int, nG: int, nO: int,
                   step_t: list[float]) -> float:
    """Seconds unit ``u``'s placement adds: its copies, less what hides behind the compute beside them."""
    dev = sim.device
    cost = lambda nbytes, count, direction: dev.copy_seconds(nbytes, count, direction)  # noqa: E731
    up_steps = sim.profile.units[u].param_steps
    # streaming steps the unit one parameter at a time: their seconds replace the unit's step
    t0 = (sum(float(r["step_time"]) for r in up_steps) * sim.factor - step_t[u + 1]) if o == "stream" else 0.0
    if not dev.copy_overlap:
        t = t0
        if o != "resident":
            t += cost(Ost, nO, "both")
        if g == "offload":
            t += cost(G, nG, "both")
        if p == "offload":
            t += 2 * cost(P, nP, "h2d") + cost(P, nP, "both" if g != "step" else "d2h")
        return float(t)
    n = sim.n
    t = t0
    hidden = lambda nbytes, direction, window: max(0.0, dev.copy_seconds(nbytes, 0, direction) - window)  # noqa
    if o != "resident":
        t += cost(0, nO, "both") + dev.copy_seconds(Ost, 0, "d2h")
    if o == "offload":
        t += hidden(Ost, "h2d", step_t[u]) if g != "step" else dev.copy_seconds(Ost, 0, "h2d")
    if o == "stream":  # each parameter's state comes in beside the step before it (the previous part's first)
        windows = [step_t[u]] + [float(r["step_time"]) * sim.factor for r in up_steps[:-1]]
        for r, w in zip(up_steps, windows, strict=True):
            nbytes = int(r["optimizer_bytes"])
            t += hidden(nbytes, "h2d", w) if g != "step" else dev.copy_seconds(nbytes, 0, "h2d")
    if g == "offload":
        t += cost(G, nG, "both")
    if p == "offload":
        prev_fwd = float(sim.fwd_time[u - 1]) if u > 0 else 0.0
        next_bwd = float(sim.dur[sim.bwd_seg[u + 1]]) if u + 1 < n else 0.0
        t += cost(0, nP, "h2d") * 2 + hidden(P, "h2d", prev_fwd) + hidden(P, "h2d", next_bwd)
        t += cost(P, nP, "d2h")
        if g != "step":
            t += cost(0, nP, "h2d") + hidden(P, "h2d", step_t[u])
    return float(t)


def state_part(sim: Any, states: np.ndarray | None, B: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For ``(B, n)`` choice indices: per plan the segment deltas ``(B, S)``, the step peak, the added seconds and
    whether the plan moves anything."""
    n, S = sim.n, sim.S
    if states is None:
        return np.zeros((B, S)), np.zeros(B), np.zeros(B), np.zeros(B, dtype=bool)
    c = np.atleast_2d(np.asarray(states, dtype=np.int64))
    if c.shape != (B, n) or (c.size and (c.min() < 0 or c.max() >= len(STATE_CHOICES))):
        raise PlanError(f"states must be a (B, {n}) array of indices into STATE_CHOICES "
                        f"(0..{len(STATE_CHOICES) - 1}), got shape {c.shape}")
    tab = sim.state_table()
    cols = np.arange(n)[None, :]
    # choice 0 (all resident) has all-zero rows: only the units that move something add to the integer sums
    # (exact in any order), so plans that move little cost little
    rows, units = np.nonzero(c)
    moved = np.zeros(B, dtype=bool)
    moved[rows] = True
    seg = _row_sums(tab.seg_delta[units, c[rows, units]], rows, B, S).astype(np.float64)  # (B, S)
    K = tab.step_base.size
    chunked = (tab.step_base[None, :] + _row_sums(tab.step_delta[units, c[rows, units]], rows, B, K)).max(axis=1)
    step = np.where(moved, chunked, tab.plain_step_peak).astype(np.float64)
    t = tab.time[cols, c].sum(axis=1) + np.where(moved, tab.chunked_step_extra, 0.0)
    return seg, step, t, moved
