"""Why a profile's memory cannot go lower: the smallest peak any plan reaches, split into what holds it up.

A per-unit plan (keep, recompute or swap each unit's saved activations) lowers the activation memory of a training
step. It cannot touch what every step holds regardless of the plan, and it cannot split a unit. The smallest peak any
plan reaches (:func:`memopt_nb.planners.min_peak`, "the floor") is split at the place where the floor's plan (the
MILP's min-peak solution) peaks: a unit's forward or backward, the code between units, or the optimizer step. There it
is exactly the sum of

* the **parameters** (and buffers) and **optimizer state** on the device, and the **gradients made so far** (the
  units whose backward has ended; a unit's own gradients, made during its backward, are in its working set);
* the **activations the plan holds** at that moment (what it keeps, and the inputs recompute keeps);
* what is **held outside units**: the caller's input batch, the gradient passed between units, what code outside the
  units holds (and the gradients of parameters outside units);
* in a unit's backward, **its saved tensors** (what it saved in its forward and the plan kept) and **the gradient it
  receives** (the gradient of its output: its output's size, taken from what is held outside units);
* the segment's **working set**: its own peak above everything held when it starts (the gradients a backward makes,
  its temporaries, what a recomputed unit recreates).

From that split :func:`explain_floor` names what *bounds* the floor, one of three parts — **fixed state** (parameters,
optimizer state and gradients at the peak; with the optimizer step's own working set when the peak is in the step),
**the peak's unit** (its saved tensors, the gradient it receives and its working set, ``LARGEST_UNIT``), **kept
activations** (the rest) — with advice that would lower that part. Where no plan's peak is the given floor
(``floor_bytes=`` not the MILP's), the split is an estimate from the profile's totals: the whole state, the unit with
the largest working set, and the rest.

**Optimizer state, gradients and parameters.** With ``offload_state`` (see :func:`memopt_nb.core.plan.state_choices`) a
plan also decides, per unit, where its optimizer state, gradients and parameters live, so the fixed state shrinks to
what stays on the device: the parameters, gradients and state outside units (and buffers), the units left resident,
and the one or two units whose state is on the device at the peak. The floor is then the smallest peak a search over
strategies *and* placements finds with the simulator (:func:`state_floor`; a lower bound is the MILP's job). With
``offload_state=False`` (activations only) the fixed state stays on the device, and when it bounds the floor the
advice gives the floor the state placements would reach.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..core.budget import format_bytes
from ..core.plan import DEFAULT_STRATEGIES as every
from ..core.plan import SAVE_SETS, STATE_CHOICES, Plan, state_choices
from ..core.profile import ProfileLike
from ..core.strategies import NAMES, REGISTRY, by_code, by_name, save_set_of
from ..sim.simulator import Simulator
from .milp import cached_min_peak_plan, min_peak
from .options import PlanSpace, as_simulator, plan_decisions, unit_ok

__all__ = ["FIXED_STATE", "KEPT_ACTIVATIONS", "LARGEST_UNIT", "PEAK_PARTS", "UNIT_PARTS", "Advice", "BatchEstimate",
           "Floor", "estimate_batch", "explain_floor", "state_floor"]

#: Names of the three parts (the values of :attr:`Floor.bound`).
FIXED_STATE = "fixed state"
LARGEST_UNIT = "largest unit"
KEPT_ACTIVATIONS = "kept activations"
#: Names of the parts of the floor plan's peak (the keys of :attr:`Floor.peak_parts`), in the order they are written.
PEAK_PARTS = ("parameters", "optimizer state", "gradients made so far", "activations the plan holds",
              "held outside units", "its saved tensors", "the gradient it receives", "working set")
#: The parts of :data:`PEAK_PARTS` that belong to the unit whose backward holds the peak.
UNIT_PARTS = ("its saved tensors", "the gradient it receives", "working set")


class Advice(str):
    """One piece of advice, in Python spelling (the ``str``), with ``magic``: the same in the magics' spelling
    (``--step-in-backward`` for ``step_in_backward=True``), so an error can speak where the user is."""

    magic: str
    python: str

    def __new__(cls, python: str, magic: str | None = None) -> Advice:
        obj = super().__new__(cls, python)
        obj.python = python
        obj.magic = magic if magic is not None else python
        return obj


@dataclass
class Floor:
    """The smallest reachable peak and what it is made of (bytes).

    Attributes:
        floor_bytes: the smallest peak any plan reaches (:func:`memopt_nb.planners.min_peak`).
        fixed_bytes: parameters + optimizer state + buffers + the gradients made so far, on the device at the floor
            plan's peak (with the optimizer step's working set when the peak is in the step); without that plan (a
            given ``floor_bytes`` no plan peaks at) the whole state. Capped at the floor.
        largest_unit: the unit whose forward or backward holds the floor plan's peak (``None`` when the peak is in code
            outside units or the optimizer step); largest_unit_bytes: that segment's working set. Without the plan:
            the unit with the largest working set, and that (capped at what is left of the floor after the fixed
            state). With the plan, largest_unit_bytes is the unit's parts of the peak (:data:`UNIT_PARTS`).
        kept_bytes: the rest of the floor: activations the plan holds, what is held outside units, the working set of
            code outside units.
        head_bytes: when the floor plan peaks in the LM head and the loss (a profile that noted its head,
            ``meta["lm_head"]``), what they hold there (held outside units and their working set); else 0.
        peak_where / peak_phase: where the floor plan's peak is (e.g. ``"the backward of blocks.0.mlp.act"``,
            ``"backward"``); peak_parts: the peak split into :data:`PEAK_PARTS` (they add up to ``floor_bytes``
            exactly). ``None`` / empty where no plan's peak is the floor.
        bound: the largest of the three parts: ``"fixed state"``, ``"largest unit"`` or ``"kept activations"``.
        advice: what would lower the floor (only options that help with this bound), each an :class:`Advice`: a str in
            Python spelling with its magics' spelling as ``.magic``.
        offload_state: the placements allowed (``False``: activations only).
        moved_bytes: with placements, the state the floor's plan keeps off the device (outside the step's window).
        state_floor_bytes: the floor with placements allowed (``offload_state=True``), when the profile records per-unit
            state (``None`` otherwise); equal to ``floor_bytes`` when they were allowed.
        plan: the plan that reaches ``floor_bytes`` when it was searched here (placements allowed), else ``None``.
    """

    floor_bytes: int
    fixed_bytes: int
    largest_unit: str | None
    largest_unit_bytes: int
    kept_bytes: int
    bound: str
    advice: list[str] = field(default_factory=list)
    offload_state: Any = False
    moved_bytes: int = 0
    state_floor_bytes: int | None = None
    plan: Any = None
    peak_where: str | None = None
    peak_phase: str | None = None
    peak_parts: dict[str, int] = field(default_factory=dict)
    head_bytes: int = 0

    def parts(self) -> dict[str, int]:
        """``{part name: bytes}`` of the three parts, in the order they are explained."""
        return {FIXED_STATE: self.fixed_bytes, LARGEST_UNIT: self.largest_unit_bytes,
                KEPT_ACTIVATIONS: self.kept_bytes}

    def bound_text(self) -> str:
        """One sentence: what bounds the floor, with the part's size and share."""
        fb = format_bytes
        share = self.parts()[self.bound] / max(self.floor_bytes, 1)
        if self.bound == FIXED_STATE and self.offload_state is not False:
            what = (f"the state that stays on the device — parameters, gradients and optimizer state outside units or "
                    f"not movable, and the units whose state the step needs at the peak — {fb(self.fixed_bytes)} "
                    f"({share:.0%}; {fb(self.moved_bytes)} of state is off the device)")
        elif self.bound == FIXED_STATE and self.peak_parts:
            what = (f"the fixed state — parameters, optimizer state and the gradients made so far, on the device where "
                    f"the floor's plan peaks ({self.peak_where}) — {fb(self.fixed_bytes)} ({share:.0%})")
        elif self.bound == FIXED_STATE:
            what = (f"the fixed state — parameters, gradients and optimizer state, held through the whole step — "
                    f"{fb(self.fixed_bytes)} ({share:.0%})")
        elif self.bound == LARGEST_UNIT and self.peak_parts:
            what = (f"{self.peak_where}, where the floor's plan peaks (what {self.largest_unit} saved, the gradient "
                    f"it receives and its working set) — {fb(self.largest_unit_bytes)} ({share:.0%})")
        elif self.bound == LARGEST_UNIT:
            what = (f"the largest unit's working set ({self.largest_unit}: what it needs while recomputed and "
                    f"back-propagated) — {fb(self.largest_unit_bytes)} ({share:.0%})")
        elif self.peak_parts:
            what = (f"the kept activations — what the floor's plan holds where it peaks ({self.peak_where}): "
                    f"activations, what is held outside units, the working set of code outside units — "
                    f"{fb(self.kept_bytes)} ({share:.0%})")
        else:
            what = (f"the kept activations — unit inputs recompute needs and activations no plan frees — "
                    f"{fb(self.kept_bytes)} ({share:.0%})")
        head = ""
        if self.head_bytes:
            head = (f"The LM head's logits and the loss hold {fb(self.head_bytes)} of it "
                    f"({self.head_bytes / max(self.floor_bytes, 1):.0%}). ")
        return f"{head}The floor is bounded by {what}."

    def breakdown_text(self) -> str:
        """Where the floor's plan peaks and the parts of that peak in one line (parts of zero bytes left out, the
        parameters always named); without that plan the three estimated parts."""
        fb = format_bytes
        if self.peak_parts:
            names = {"working set": "its own working set" if self.largest_unit is None else "its working set"}
            parts = " + ".join(f"{names.get(k, k)} {fb(v)}" for k, v in self.peak_parts.items()
                               if v or k == "parameters")
            return f"peak in {self.peak_where}: {parts}"
        unit = f" ({self.largest_unit})" if self.largest_unit else ""
        return (f"fixed state {fb(self.fixed_bytes)} + largest unit{unit} {fb(self.largest_unit_bytes)} + kept "
                f"activations {fb(self.kept_bytes)}")

    def advice_text(self, spelling: str = "python") -> str:
        """The advice joined by ``; ``, spelt for ``"python"`` or for the magics (``"magic"``)."""
        return "; ".join(getattr(a, spelling, None) or str(a) for a in self.advice)

    def text(self, spelling: str = "python") -> str:
        """Floor, what bounds it, and what would lower it (spelt for ``"python"`` or ``"magic"``), as a short
        paragraph."""
        advice = " To lower it: " + self.advice_text(spelling) + "." if self.advice else ""
        return (f"Smallest reachable peak: {format_bytes(self.floor_bytes)} ({self.breakdown_text()}). "
                f"{self.bound_text()}{advice}")


def _working_set(unit: Any) -> int:
    return int(max(unit.rc_fwd_rel_peak, unit.rc_bwd_rel_peak, unit.saved_bytes))


@dataclass
class _PeakSplit:
    peak: int
    phase: str
    where: str
    unit: str | None
    parts: dict[str, int]


def _stream_held(up: Any, with_grads: bool, with_peak: bool = True) -> tuple[int, int]:
    """A unit whose optimizer state streams, during its own part of the step (one parameter at a time): the
    (optimizer state, gradients) of it on the device — the stepping parameter's state and the next one's on its way
    in, and the stepping parameter's gradient when ``with_grads`` (brought back for its step) — at the parameter where
    that (``with_peak``: with the parameter's own step peak) is largest (``UnitProfile.param_steps``; COST_MODEL.md,
    section 5)."""
    rows = up.param_steps
    best = None
    for j, r in enumerate(rows):
        o = int(r["optimizer_bytes"]) + (int(rows[j + 1]["optimizer_bytes"]) if j + 1 < len(rows) else 0)
        g = int(r["grad_bytes"]) if with_grads else 0
        total = o + g + (int(r["step_rel_peak"]) if with_peak else 0)
        if best is None or total > best[0]:
            best = (total, o, g)
    return (best[1], best[2]) if best is not None else (0, 0)


def _state_off(up: Any, u: int, n: int, choice: tuple[str, str, str], sim: Simulator, k: int,
               step_point: bool) -> tuple[int, int, int]:
    """(parameters, optimizer state, gradients) of unit ``u`` that its placement keeps off the device at segment ``k``
    (or, ``step_point``, at point ``k`` of the unit-by-unit step), by :class:`~memopt_nb.sim.state_cost.StateTable`'s
    rules; gradients not yet made count as on the device here (the caller counts only those made). Streamed optimizer
    state is off like offloaded state, except in the step: the point before the unit's has its first parameter's
    state, the unit's own point the state and gradient of the parameter its stream peaks at (the rest of that peak is
    the point's working set)."""
    o, g, p = choice
    P, G, Ost = int(up.param_bytes), int(getattr(up, "grad_bytes", 0)), int(getattr(up, "optimizer_bytes", 0))
    if step_point:  # point u steps what comes before unit u, point u + 1 unit u: its state is back there
        back = k in (u, u + 1) and g != "step"
        if o == "stream" and back:
            if k == u:  # the previous part brings its first parameter's state (its parameters whole)
                return 0, Ost - int(up.param_steps[0]["optimizer_bytes"]), G if g != "resident" else 0
            o_on, g_on = _stream_held(up, g == "offload")
            return 0, Ost - o_on, G - g_on if g == "offload" else 0
        return (P if p == "offload" and not back else 0, Ost if o != "resident" and not back else 0,
                G if g != "resident" and not (g == "offload" and k == u + 1) else 0)
    fs, bs = int(sim.fwd_seg[u]), int(sim.bwd_seg[u])
    fwd_from = int(sim.fwd_seg[u - 1]) if u > 0 else fs
    bwd_from = int(sim.bwd_seg[u + 1]) if u + 1 < n else bs
    here = fwd_from <= k <= fs or bwd_from <= k <= bs
    return (P if p == "offload" and not here else 0, Ost if o != "resident" else 0,
            G if g != "resident" and k > bs else 0)


def _peak_split(sim: Simulator, codes: Sequence[int], windows: Sequence[int], distances: Sequence[int],
                states: Sequence[int]) -> _PeakSplit:
    """Where a plan (as arrays) peaks, and that peak split into :data:`PEAK_PARTS` (exact: the working set is what the
    segment adds above everything else held when it starts, so the parts add up to the simulator's peak)."""
    prof, n = sim.profile, sim.n
    C = np.array([list(states)], dtype=np.int64)
    det = sim.evaluate(np.array([list(codes)]), np.array([list(windows)]), np.array([list(distances)]), states=C,
                       details=True)
    peak = int(np.ceil(float(det["peak"][0])))
    peaks, step_peak, moved = det["peaks"][0], float(det["step_peak"][0]), bool(det["moved"][0])
    phase, _ = sim._where(peaks, step_peak, moved)
    ss = sim.step_segment
    tab = sim.state_table() if moved else None
    point = -1
    if moved and phase == "optimizer step" and tab is not None:  # a point of the unit-by-unit step
        vals = tab.step_base + sum(tab.step_delta[u, c] for u, c in enumerate(states) if c)
        point, k = int(np.argmax(vals)), ss
    else:
        seg_peaks = peaks.copy()
        if moved and ss >= 0:
            seg_peaks[ss] = -np.inf
        k = int(np.argmax(seg_peaks))
    # what the plan's storage groups hold at k, and what every unit kept would (the profiled level's share)
    births = []
    for g in sim.g_list:
        firsts = [int(sim.fwd_seg[u]) for u in (*g.savers, *g.consumers)]
        births.append(int(sim.fwd_seg[g.producer]) + 1 if g.producer >= 0 else min(firsts, default=0))
    birth = np.array(births, dtype=np.int64)
    off = det["off"][0].astype(bool) & (det["r_pos"][0] <= k) & (k < det["t_pos"][0])
    in_plan = (birth <= k) & (k <= det["plan_end"][0]) & ~off
    in_base = (birth <= k) & (k <= sim.g_base_end)
    # made outside the units and referred to after the forward: the caller's (its input batch); no plan frees it
    caller = np.array([g.producer < 0 and g.free_pos is None and g.release_pos is None for g in sim.g_list], dtype=bool)
    nb = sim.g_nb.astype(np.int64)
    seg = prof.segments[k]
    u_bwd = seg.unit if seg.kind == "bwd" and point < 0 else -1
    own = np.array([u_bwd in g.savers for g in sim.g_list], dtype=bool) & in_plan & ~caller
    acts = int(nb[in_plan & ~caller & ~own].sum())
    for u, c in enumerate(codes):  # a selective unit's save-set holds its outputs from its forward to its backward
        save_set = save_set_of(c)
        if save_set and sim.fwd_seg[u] < k <= sim.bwd_seg[u]:
            acts += int(sim.sel_held[u, SAVE_SETS.index(save_set)])
    made = sum(int(getattr(up, "grad_bytes", 0)) for up in prof.units if up.bwd_segment < k)
    params, optim = int(prof.param_bytes + prof.buffer_bytes), int(prof.optimizer_state_bytes)
    outside = (int(prof.segments[k].start_level) - params - optim - made - int(nb[in_base].sum())
               + int(nb[in_plan & caller].sum()))
    for u, (up, c) in enumerate(zip(prof.units, states, strict=True)):
        if c and getattr(up, "grad_bytes", 0) > 0 and (tab is None or tab.allowed[u, c]):
            p_off, o_off, g_off = _state_off(up, u, n, STATE_CHOICES[c], sim, point if point >= 0 else k, point >= 0)
            params, optim, made = params - p_off, optim - o_off, made - g_off
    # a backward starts holding the gradient of its unit's output (its size, as long as that much is held outside)
    incoming = min(int(prof.units[u_bwd].output_bytes), max(outside, 0)) if u_bwd >= 0 else 0
    parts = {"parameters": params, "optimizer state": optim, "gradients made so far": made,
             "activations the plan holds": acts, "held outside units": outside - incoming,
             "its saved tensors": int(nb[own].sum()), "the gradient it receives": incoming}
    parts["working set"] = peak - sum(parts.values())
    if point >= 0:
        what = prof.units[point - 1].name if point > 0 else "the parameters outside units"
        return _PeakSplit(peak, phase, f"the optimizer step of {what}", None, parts)
    if seg.unit >= 0 and seg.kind in ("fwd", "bwd"):
        unit = prof.units[seg.unit].name
        return _PeakSplit(peak, phase, f"the {'forward' if seg.kind == 'fwd' else 'backward'} of {unit}", unit, parts)
    if k == sim.step_segment:
        return _PeakSplit(peak, phase, f"the optimizer step (segment {seg.label!r})", None, parts)
    head = (prof.meta or {}).get("lm_head")
    if head and n and sim.fwd_seg[n - 1] < k < sim.bwd_seg[n - 1]:  # between the last unit's forward and backward
        return _PeakSplit(peak, phase, f"the LM head ({head['module']}) and the loss (segment {seg.label!r})", None,
                          parts)
    return _PeakSplit(peak, phase, f"code outside units in the {phase} (segment {seg.label!r})", None, parts)


def _floor_split(sim: Simulator, space: Any, floor: int, plan: Any) -> _PeakSplit | None:
    """The split of a plan that peaks at ``floor``: the MILP's min-peak solution, else ``plan`` (the state search's);
    ``None`` if neither does (a ``floor_bytes`` given that is not the floor of this space)."""
    arrays = [cached_min_peak_plan(sim, space)[1]]
    if plan is not None:
        s, w, d = sim.encode(plan)
        arrays.append((list(s[0]), list(w[0]), list(d[0]), list(plan.state_indices)))
    for a in arrays:
        if a is not None:
            split = _peak_split(sim, *a)
            if split.peak == floor:
                return split
    return None


def _has_state(profile: ProfileLike) -> bool:
    return any(getattr(u, "grad_bytes", 0) > 0 for u in profile.units) and getattr(profile, "step_segment", -1) >= 0


def state_floor(profile: ProfileLike, device: Any = None, strategies: Sequence[str] = ("keep", "recompute", "swap"),
                offload_state: Any = True, step_in_backward: bool = False, passes: int = 3) -> tuple[int, Any]:
    """The smallest peak found over activation strategies and state placements, and a plan that reaches it.

    A search with the simulator, not a proof: every uniform plan (each strategy with each allowed placement), then
    unit-by-unit improvement (``passes`` sweeps, each trying every strategy and placement of one unit at a time).
    The exact minimum over the enlarged space is the MILP's (:func:`memopt_nb.planners.min_peak` with
    ``offload_state=``); this is an upper bound on it, and a plan that reaches it.
    """
    sim = Simulator(profile, device)
    tab = sim.state_table()
    n = sim.n
    allowed_choices = [STATE_CHOICES.index(c) for c in state_choices(offload_state, step_in_backward=step_in_backward)]
    codes = [c for s in strategies for c in by_name(s).codes]
    ok_s = np.ones((n, len(NAMES)), dtype=bool)  # per unit and code, as the planners offer them
    for s in REGISTRY:
        ok_s[:, s.codes] = unit_ok(sim, s).reshape(n, -1)
    opts = [[(s, c) for s in codes if ok_s[u, s] for c in allowed_choices if tab.allowed[u, c]] for u in range(n)]

    timing = np.array([by_code(c)[0].timing for c in NAMES], dtype=np.int64)  # (1, 1) for every timed strategy

    def peaks(S: np.ndarray, C: np.ndarray) -> np.ndarray:
        return sim.evaluate(S, timing[S, 0], timing[S, 1], states=C)[0]

    cands = []
    for s in codes:
        for c in allowed_choices:
            S = np.array([[s if ok_s[u, s] else 0 for u in range(n)]])
            C = np.array([[c if tab.allowed[u, c] else 0 for u in range(n)]])
            cands.append((S, C))
    vals = peaks(np.concatenate([a for a, _ in cands]), np.concatenate([b for _, b in cands]))
    best = int(np.argmin(vals))
    S, C, val = cands[best][0].copy(), cands[best][1].copy(), float(vals[best])
    for _ in range(passes):
        improved = False
        for u in range(n):
            trial_S = np.repeat(S, len(opts[u]), axis=0)
            trial_C = np.repeat(C, len(opts[u]), axis=0)
            for i, (s, c) in enumerate(opts[u]):
                trial_S[i, u], trial_C[i, u] = s, c
            v = peaks(trial_S, trial_C)
            i = int(np.argmin(v))
            if v[i] < val:
                S, C, val, improved = trial_S[i:i + 1].copy(), trial_C[i:i + 1].copy(), float(v[i]), True
        if not improved:
            break
    decisions = plan_decisions(profile, [int(x) for x in S[0]], timing[S[0], 0].tolist(), timing[S[0], 1].tolist(),
                               [int(x) for x in C[0]])
    base = Plan.from_strategies(profile, ["keep"] * n, method="state_floor")
    plan = replace(base, decisions=decisions,
                               step_in_backward=any(STATE_CHOICES[int(x)][1] == "step" for x in C[0]))
    plan._model_ref, plan._optimizer_ref = base._model_ref, base._optimizer_ref
    return int(round(val)), plan


def _moved_bytes(profile: ProfileLike, plan: Any) -> int:
    """State the plan keeps off the device, less the largest amount its schedule brings back at once (a unit's
    state, gradients and parameters with the next unit's state and parameters on their way in; a unit whose state
    streams brings back at most a parameter's state and gradient with the next parameter's state, and the part before
    it only its first parameter's state)."""
    per = []
    for u, (o, g, p) in zip(profile.units, plan.placements, strict=True):
        params = u.param_bytes if p == "offload" else 0
        if o == "stream" and g != "step":
            o_on, g_on = _stream_held(u, g == "offload", with_peak=False)
            own, ahead = params + o_on + g_on, params + int(u.param_steps[0]["optimizer_bytes"])
        else:
            ahead = (u.optimizer_bytes if o == "offload" and g != "step" else 0) + params
            own = ahead + (u.grad_bytes if g == "offload" else 0)
        per.append((own, ahead,
                    (u.optimizer_bytes if o != "resident" else 0) + (u.grad_bytes if g != "resident" else 0)
                    + params))
    moved = sum(total for _, _, total in per)
    window = max([per[i][0] + (per[i + 1][1] if i + 1 < len(per) else 0) for i in range(len(per))] + [0])
    return max(moved - window, 0)


def _grads_may_move(offload_state: Any) -> bool:
    return any(g != "resident" for _, g, _ in state_choices(offload_state))


def _floor_parts(profile: ProfileLike, split: Any, floor: int, moved: int) -> tuple[int, str | None, int]:
    """The floor's fixed state, its largest unit and that unit's working set: from the floor plan's peak where it is
    known (``split``), else estimated from the profile's totals."""
    if split is not None:  # the parts of the floor plan's peak, where it is
        fixed = split.parts["parameters"] + split.parts["optimizer state"] + split.parts["gradients made so far"]
        if split.phase == "optimizer step":  # the step's own working set is the state's (it grows with it)
            fixed += split.parts["working set"]
        fixed = min(max(fixed, 0), floor)
        name = split.unit
        own = sum(split.parts[k] for k in UNIT_PARTS)
        work = min(max(own, 0), floor - fixed) if name is not None else 0
    else:  # an estimate from the profile's totals
        fixed = int(profile.param_bytes + profile.grad_bytes + profile.optimizer_state_bytes + profile.buffer_bytes)
        fixed = min(max(fixed - moved, 0), floor)
        units = list(profile.units)
        if units:
            big = max(units, key=_working_set)
            name, work = big.name, min(_working_set(big), floor - fixed)
        else:
            name, work = None, 0
    return fixed, name, work


def _floor_advice(profile: ProfileLike, device: Any, split: Any, floor: int, bound: str, name: str | None,
                  activations: int, strategies: Sequence[str], offload_state: Any, step_in_backward: bool,
                  state_floor_bytes: int | None) -> tuple[list[Advice], int, int | None]:
    """What would lower the floor, given what bounds it; the LM head's share of the peak where the head is where it
    sits; the floor with state moved where that was worked out for the advice."""
    advice: list[Advice] = []
    head_bytes = 0
    if split is not None and split.where.startswith("the LM head"):
        head_bytes = split.parts["held outside units"] + split.parts["working set"]
        if not getattr(profile, "heads", None) and not profile.meta.get("head"):
            logits = profile.meta["lm_head"].get("logits_bytes", 0)
            what = (f"compute the LM head's logits ({format_bytes(logits)} a tensor) and the loss a chunk of tokens "
                    "at a time, never whole (not bit-identical: the gradients are summed in another order): ")
            advice.append(Advice(what + "memopt.profile(..., head='chunked'), then plan again",
                                 what + "%memopt_profile ... --head chunked, then plan again"))
    if not set(every) <= set(strategies):  # a restricted activation space: what the whole default one reaches
        wider = min_peak(profile, device, every, offload_state=offload_state, step_in_backward=step_in_backward)
        if wider < floor:
            advice.append(Advice(f"allow every activation strategy (strategies={every!r}): floor "
                                 f"{format_bytes(wider)}",
                                 f"allow every activation strategy (--strategies {','.join(every)}): floor "
                                 f"{format_bytes(wider)}"))
    if bound == FIXED_STATE and offload_state is False and _has_state(profile):
        state_floor_bytes, _ = state_floor(profile, device, strategies, True, False)
        if state_floor_bytes < floor:
            what = "let the plan move optimizer state, gradients and parameters off the device"
            advice.append(Advice(f"{what} (offload_state=True): floor about {format_bytes(state_floor_bytes)}",
                                 f"{what} (--offload-state all): floor about {format_bytes(state_floor_bytes)}"))
    if bound == FIXED_STATE and offload_state is not False and not step_in_backward and profile.grad_bytes > 0 \
            and profile.meta.get("optimizer") and _grads_may_move(offload_state):
        why = (": each unit's optimizer step runs in backward and frees its gradients at once (the loop may then "
               "neither accumulate gradients nor clip them)")
        advice.append(Advice("step_in_backward=True" + why, "--step-in-backward" + why))
    if bound == FIXED_STATE:
        advice.append(Advice("shard the state across devices (FSDP2, see memopt.distributed.per_rank and tutorial 04)"))
        if activations >= 0.1 * floor:
            advice.append(Advice(f"a smaller batch (activations are the other {format_bytes(activations)})"))
    elif bound == LARGEST_UNIT:
        if profile.meta.get("units_rule") != "fine":
            tail = f", which splits {name} and units like it into their submodules"
            advice.append(Advice(f"finer units: profile with units='fine'{tail}",
                                 f"finer units: profile with --units fine{tail}"))
        else:
            why = (f"finer units: units='fine' could not split {name} further (its submodules do not cover what it "
                   "saves; profile.meta['split_why'] says why)")
            advice.append(Advice(f"{why}; name smaller modules in units=[...]",
                                 f"{why}; name smaller modules in --units NAME,NAME,...".replace(
                                     "units='fine'", "--units fine")))
        advice.append(Advice("a smaller batch"))
    else:
        advice.append(Advice("a smaller batch (kept activations grow with it)"))
        if "recompute_offload" not in strategies:
            what = "recompute_offload, which offloads the unit inputs recompute keeps (opt-in: "
            advice.append(Advice(what + "strategies=memopt_nb.plan.STRATEGIES)",
                                 what + "--strategies keep,recompute,swap,recompute_offload)"))
    return advice, head_bytes, state_floor_bytes


def explain_floor(profile: ProfileLike, device: Any = None, *, floor_bytes: int | None = None,
                  strategies: Sequence[str] = ("keep", "recompute", "swap"), offload_state: Any = False,
                  step_in_backward: bool = False) -> Floor:
    """Split the smallest reachable peak of ``profile`` (on ``device``) where the floor's plan peaks (the parts of
    :data:`PEAK_PARTS`; grouped into fixed state, that unit's working set and kept activations), and say which bounds
    it and what would lower it.

    ``floor_bytes``: the floor if already known (else :func:`memopt_nb.planners.min_peak` computes it, or with
    ``offload_state`` :func:`state_floor`). ``offload_state`` / ``step_in_backward``: the state placements a plan may
    use (as in :func:`memopt_nb.core.plan.state_choices`; ``False``: activations only).
    """
    plan = None
    state_floor_bytes = None
    moved = 0
    sim = as_simulator(profile, device)
    with_state = offload_state is not False and _has_state(profile)
    space = (PlanSpace.of(strategies, offload_state, step_in_backward) if with_state
             else PlanSpace.of(strategies, False, False))
    if with_state:
        found, plan = state_floor(profile, device, strategies, offload_state, step_in_backward)
        if floor_bytes is None:  # the exact floor (the MILP's); the search above gives the plan reaching ~it
            floor_bytes = min(found, cached_min_peak_plan(sim, space)[0])
        state_floor_bytes = int(floor_bytes)
        moved = _moved_bytes(profile, plan)
    if floor_bytes is None:
        floor_bytes = cached_min_peak_plan(sim, space)[0]
    floor = int(floor_bytes)
    split = _floor_split(sim, space, floor, plan)
    fixed, name, work = _floor_parts(profile, split, floor, moved)
    kept = max(floor - fixed - work, 0)
    parts = {FIXED_STATE: fixed, LARGEST_UNIT: work, KEPT_ACTIVATIONS: kept}
    bound = max(parts, key=lambda k: parts[k])
    activations = work + kept
    advice, head_bytes, state_floor_bytes = _floor_advice(profile, device, split, floor, bound, name, activations,
                                                          strategies, offload_state, step_in_backward,
                                                          state_floor_bytes)
    return Floor(floor_bytes=floor, fixed_bytes=fixed, largest_unit=name, largest_unit_bytes=work, kept_bytes=kept,
                 bound=bound, advice=advice, offload_state=offload_state, moved_bytes=moved,
                 state_floor_bytes=state_floor_bytes, plan=plan, peak_where=split.where if split else None,
                 peak_phase=split.phase if split else None, peak_parts=split.parts if split else {},
                 head_bytes=head_bytes)


#: the largest batch :func:`estimate_batch` names (what grows with the batch may be next to nothing)
ESTIMATE_LIMIT = 1 << 20


@dataclass
class BatchEstimate:
    """How big a batch fits the profiled device, estimated from one profile (:func:`estimate_batch`).

    Attributes:
        capacity_bytes, device: the device's capacity and name.
        batch: the profiled batch; peak_bytes: plain training's peak there.
        plain_batch: the largest batch plain training fits (0: not even batch 1), estimated.
        plan_batch: the largest batch a plan reaches (its smallest peak within the capacity; 0: none), estimated.
        state_bytes, plan_state_bytes: what does not grow with the batch, unplanned (parameters, gradients,
            optimizer state, buffers) and under the floor's plan (the state it leaves on the device).
    """

    capacity_bytes: int
    device: str
    batch: int
    peak_bytes: int
    plain_batch: int
    plan_batch: int
    state_bytes: int
    plan_state_bytes: int

    def text(self, spelling: str = "python") -> str:
        """One line for the profile's summary, its advice spelt for ``"python"`` or the magics (``"magic"``)."""
        fb = format_bytes
        fits = "fits it" if self.peak_bytes <= self.capacity_bytes else "does not fit"
        check = ("%memopt_plan --max-batch BUILDER" if spelling == "magic" else "memopt.max_batch(builder)")
        return (f"On this device ({fb(self.capacity_bytes)}): plain training fits about "
                f"{_batch_text(self.plain_batch)} (batch {self.batch} peaks at {fb(self.peak_bytes)}: {fits}); "
                "a plan reaches about "
                f"{_batch_text(self.plan_batch)} (estimated: activations and inputs scale with the batch, the state "
                f"does not) — {check} checks it with profiles at other batches and a real step.")


def _batch_text(b: int) -> str:
    if b <= 0:
        return "no batch (not even 1)"
    return f"any batch (over {ESTIMATE_LIMIT:,})" if b >= ESTIMATE_LIMIT else f"batch {b:,}"


def _profiled_batch(profile: ProfileLike) -> int | None:
    if profile.batch_size:
        return int(profile.batch_size)
    if profile.units:  # the first unit's first input that has a batch and more
        shapes = [s for s in profile.units[0].input_shapes if len(s) >= 2]
        if shapes:
            return int(shapes[0][0]) or None
    return None


def _largest_batch(capacity: int, fixed: int, total: int, batch: int) -> int:
    """The largest ``b`` with ``fixed + (total - fixed) * b / batch <= capacity``."""
    if capacity < fixed:
        return 0
    per = max(total - fixed, 0) / batch
    if per <= 0:
        return ESTIMATE_LIMIT
    return min(ESTIMATE_LIMIT, int((capacity - fixed) / per))


def estimate_batch(profile: ProfileLike, floor: Floor | None = None) -> BatchEstimate | None:
    """How big a batch plain training and the best plan fit on the profiled device, from this profile alone.

    Plain training's peak and the floor (:func:`explain_floor`, placements allowed, or ``floor`` if given) are split
    into what does not grow with the batch (parameters, gradients, optimizer state and buffers; under the floor's plan
    the state it leaves on the device) and the rest (activations, inputs, temporaries), taken to grow in proportion
    to the batch. An estimate: :func:`memopt_nb.max_batch` answers with profiles at other batches and checks its
    answer with a real step. Plain training's estimate is close to that answer; a plan's tends to be high (the floor
    grows faster with the batch than its share of activations at the profiled batch says: at other batches its plan
    leaves other state on the device); how far, in benchmarks/RESULTS.md.
    ``None`` where the device's capacity is not known (the emulated device outside :func:`memopt_nb.limit_memory`)
    or the profiled batch is not (no input with a batch dimension).
    """
    spec = profile.device
    batch = _profiled_batch(profile)
    if not getattr(spec, "capacity_known", False) or not batch:
        return None
    if floor is None:
        floor = explain_floor(profile, offload_state=True)
    cap, peak = int(spec.capacity_bytes), int(profile.peak_bytes)
    state = min(int(profile.param_bytes + profile.grad_bytes + profile.optimizer_state_bytes + profile.buffer_bytes),
                peak)
    return BatchEstimate(capacity_bytes=cap, device=spec.name, batch=batch, peak_bytes=peak,
                         plain_batch=_largest_batch(cap, state, peak, batch),
                         plan_batch=_largest_batch(cap, floor.fixed_bytes, floor.floor_bytes, batch),
                         state_bytes=state, plan_state_bytes=int(floor.fixed_bytes))
