"""``memopt_nb.sim.replay``: the cost model (``memopt_nb/sim/COST_MODEL.md``) written a second time, as a plain
replay of one training step.

The planners use :class:`memopt_nb.sim.simulator.Simulator`, which compiles a profile into arrays to score thousands
of plans at once. This module states the same model once more, directly from the
:class:`~memopt_nb.core.profile.ModelProfile`
(its
segments, units and storage groups), the plan and the :class:`~memopt_nb.core.device.DeviceSpec`: it walks the step one
segment boundary at a time and keeps a ledger of what is on the device and what the two copy engines are doing. It
imports nothing from ``simulate.py``, so a slip in compiling the fast simulator's arrays cannot hide behind a reference
that reads the same arrays; the test suite checks the two agree on random plans, and both against measured peaks.

**The step.** Segment ``k`` starts at *boundary* ``k``. A unit's forward and backward are the segments of kind
``"fwd"`` / ``"bwd"`` with its index; everything else is code outside units. Boundaries just before a unit's forward
and just after it are *unit boundaries*; the *next unit* at a boundary is the first unit whose forward has not started.
The forward ends at the boundary right after the last unit's forward.

**Memory** in segment ``k`` is the profiled start level (every unit kept) plus, for every storage group, the bytes the
plan holds there minus the bytes the profiled run held, plus the segment's own peak above its start (the profiled one,
or the one measured with the unit recomputed, for that unit's forward and backward). For one group:

* *forward liveness*: it is referenced outside autograd until the boundary ``free_pos`` (so it is resident through
  segment ``free_pos - 1``); a group still referenced when the last unit's forward returns (``free_pos`` is ``None``) is
  resident through segment ``release_pos - 1`` when it is let go of later in the step (a model output the loss has
  done with, and the Hugging Face KV cache in it), else through the segment after the last unit's forward. A group
  that no unit saves and that is still referenced all step belongs to the caller (the batch) and no plan moves it;
  neither does one that code outside units saves and never lets go of.
* *freed partway*: when the profiled run freed a group partway through a segment (``death_seg``) whose peak came
  after, a plan that holds it past that segment (its last holder or liveness is later) adds the group's
  ``late_bytes`` to that segment's peak.
* *recomputed* units are those with ``recompute``, ``recompute_offload`` or ``selective``; *offloading* units those
  with ``swap`` or ``recompute_offload``. A ``selective`` unit counts as plain ``recompute`` below (its checkpoint
  keeps its inputs on the device); besides, the outputs its save-set keeps (the profile's ``held_bytes`` for that
  save-set) are on the device from the boundary after its forward to the boundary after its backward, and its
  forward and backward segments peak by the save-set's ``fwd_rel_peak`` / ``bwd_rel_peak``.
* *holders*: every unit that saves it holds it until its own backward, except its producer when the producer is
  recomputed (recomputation recreates it); a recomputed unit that takes it as input holds it until its backward
  (checkpointing keeps inputs; a tensor of a cache passed in is an input: the recomputation keeps a copy of the cache
  as it was); code outside units that saves it holds it until ``outside_release``. The group is freed
  after the later of its forward liveness and its last holder. The profiled run is the plan that keeps every unit.
* *offload*: the group's *owner* is the last unit, in forward order, that hands it to the swap engine: a unit that
  saves it (not its producer when the producer is recomputed) or a ``recompute_offload`` unit that takes it as input.
  A group with an owner, that code outside units does not save and whose forward liveness ends in the forward, is
  offloaded when its owner is an offloading unit and no unit with plain ``recompute`` takes it as input. At boundary
  ``free_pos`` its copy to host is issued; with ``j`` the next unit there and ``w`` the owner's offload window, the
  device copy is dropped at the unit boundary before unit ``j + w`` (or at the end of the forward if there is no such
  unit) and allocated again at the start of the backward of the owner's *trigger*.
* the *trigger* of an offloading unit ``i`` with prefetch distance ``d`` is the unit ``min(i + d, n - 1)``, moved
  down to the trigger of any later offloading unit when that one is smaller (prefetches are issued in the order
  backward needs them).

**Time**: every segment's profiled duration times the device's time factor, plus a recomputed unit's forward in its
backward (for a selective unit, its save-set's ``recompute_time``). Each copy *job* takes :func:`copy_seconds`.
Copy jobs to host are formed per (issue boundary, drop boundary), issued earliest drop first; copies back per owner,
issued at the start of the trigger's backward, highest owner first.
With ``copy_overlap`` (GPUs; the CPU when the copy threads have a spare core) each direction is one first-in-first-out
engine beside the compute stream that carries the bytes: the forward waits at a drop boundary until every copy due
there has finished, and a unit's backward waits until its own copy back has finished; the per-storage part
(:func:`thread_seconds`), spent by the training thread, is added to the step and moves no queue. Without it (the CPU
when compute uses every core) the copies run on the compute cores, one after another, where they are issued, and
nothing overlaps.

**Optimizer state, gradients and parameters** (plan placements). This part replays what
:class:`~memopt_nb.runtime.state.StateManager` does, event by event, keeping a ledger of which unit's state (``O``),
gradients (``G``) and parameters (``P``) are on the device, against the profiled run where every ``O`` and ``P`` is
there all step and each ``G`` from its unit's backward on. A unit whose optimizer steps nothing keeps everything.

* The forward pre-hook of every unit fetches its own offloaded parameters and those of the unit after it; the hook
  after its forward lets its own go. A hook that runs in the code between units is charged to the unit segment next to
  it (the one that holds the same bytes with a peak no lower). When backward reaches a unit, its parameters and those
  of the unit before it are fetched; when its gradients are complete, its own go (charged from the next segment on).
* Gradients of a unit with ``grads="offload"`` or ``"step"`` leave the device when its backward ends (they are made
  there, so it holds them). ``"step"`` then steps the unit: at that moment the device holds the level after its
  backward plus the step's own peak. Optimizer state that is offloaded or streamed is never on the device outside a
  step.
* The optimizer step: if the plan moves anything it runs in parts, the parameters outside units first, then unit
  0, 1, …; before part ``i`` steps, part ``i`` is on the device, the state sent back after part ``i - 1`` has left,
  and part ``i + 1``'s state and parameters are on their way in; part ``i``'s offloaded gradients are brought in for
  its step alone; after it, its parameters leave. Each part peaks at the level plus its own step peak.
* ``optimizer="stream"`` (the profile's ``param_steps``, one row per parameter the optimizer steps): as
  ``"offload"``, except that the unit's part steps one parameter at a time. The part before it brings only its first
  parameter's state; during its own part the unit holds, per parameter ``j``, ``j``'s state, the next parameter's on
  its way in, ``j``'s gradient when offloaded, and ``j``'s own step peak (the largest of these counts); after it,
  none of its state. Stepped in backward, the same walk replaces the unit's state and step peak at that moment. A
  unit profiled without ``param_steps`` cannot stream (:class:`~memopt_nb.core.errors.PlanError`).
* Time: every byte a placement moves is a copy job priced by :func:`copy_seconds`. Without ``copy_overlap`` all add
  to the step. With it the training thread's per-storage share adds, and a job that the runtime starts ahead (a
  fetch of the next unit's parameters or state) shows only where it outlasts the compute it runs beside: the previous
  unit's forward, the next unit's backward, the previous part of the step; a streamed parameter's state, the step of
  the parameter before it (its first, the previous part). Jobs the runtime waits for at once show in full. The parted
  step costs ``chunked_step_time`` instead of the plain step's time, when longer; a streamed unit's per-parameter
  steps replace its own step's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.device import DeviceSpec
from ..core.errors import PlanError, ProfileError
from ..core.plan import OFFLOADING, SAVE_SETS, STATE_CHOICES, STRATEGIES, Plan
from ..core.profile import ProfileLike
from ..core.strategies import by_code, by_name

__all__ = ["CopyJob", "Replay", "copy_seconds", "prefetch_triggers", "replay", "thread_seconds"]


@dataclass
class CopyJob:
    """One job on a copy engine.

    Attributes:
        direction: ``"d2h"`` (offload, device to host) or ``"h2d"`` (prefetch, host to device).
        boundary: the segment boundary at which it is issued.
        due: for an offload, the boundary where the forward waits for it and its memory is dropped; for a prefetch,
            the backward segment of its owner (which waits for it).
        owners: the units whose saved storages it carries.
        nbytes, storages: what it moves.
        seconds: its duration (:func:`copy_seconds`); start, end: on the step's clock.
    """

    direction: str
    boundary: int
    due: int
    owners: tuple[int, ...]
    nbytes: int
    storages: int
    seconds: float
    start: float = 0.0
    end: float = 0.0


@dataclass
class Replay:
    """What one replayed training step did.

    Attributes:
        peak_bytes: the highest segment peak. step_time: seconds of the step.
        segment_levels, segment_peaks: per segment, memory at its start and its peak.
        compute_time: segments plus recompute (plus copies where they share the compute cores); recompute_time: the
            part spent re-running forwards; copy_time: total duration of all copy jobs.
        fwd_stall_time / bwd_stall_time: waiting for offloads at drop boundaries / for prefetches in backward.
        bytes_offloaded / bytes_prefetched: bytes of the offload jobs / of the prefetch jobs the backward issued.
        triggers: per unit, the unit whose backward starts its prefetch (``None`` unless it offloads: ``swap`` or
            ``recompute_offload``).
        copies: every copy job in issue order. rows: the timeline ``{"time", "bytes", "phase", "unit", "event"}``,
            two rows per segment (its start level, then its peak at mid-segment); with a plan that moves state, the
            plain step's rows are replaced by one per part of the parted step.
        step_points: with a plan that moves state, ``(label, peak)`` per part of the parted step.
        state_time: seconds the placements add; moves_state: whether any placement moves anything.
    """

    peak_bytes: int
    step_time: float
    segment_levels: list[int]
    segment_peaks: list[int]
    compute_time: float
    recompute_time: float
    copy_time: float
    fwd_stall_time: float
    bwd_stall_time: float
    bytes_offloaded: int
    bytes_prefetched: int
    triggers: list[int | None]
    copies: list[CopyJob] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    step_points: list[tuple[str, int]] = field(default_factory=list)
    state_time: float = 0.0
    moves_state: bool = False

    @property
    def stall_time(self) -> float:
        return self.fwd_stall_time + self.bwd_stall_time


def copy_seconds(device: DeviceSpec, direction: str, nbytes: int, storages: int) -> float:
    """Seconds one copy job of ``nbytes`` in ``storages`` storages takes on ``device`` — the only copy cost there is.

    The bytes over the link bandwidth of that direction, which occupy that direction's copy engine, plus
    ``device.copy_overhead_s`` per storage, which the training thread spends (hooks, hand-off, host pool): see
    :func:`thread_seconds`.
    """
    bandwidth = device.d2h_bytes_per_s if direction == "d2h" else device.h2d_bytes_per_s
    return nbytes / bandwidth + thread_seconds(device, storages)


def thread_seconds(device: DeviceSpec, storages: int) -> float:
    """The part of a copy job the training thread spends itself: ``copy_overhead_s`` per storage."""
    return storages * device.copy_overhead_s


def prefetch_triggers(strategies: Sequence[str], distances: Sequence[int]) -> list[int | None]:
    """Per unit, the unit whose backward starts its prefetch (``None`` unless it offloads), from the definition.

    Offloading unit ``i`` (``swap`` or ``recompute_offload``) asks for ``min(i + d_i, n - 1)``; backward needs later
    units first, so the prefetch of ``i`` is also started no later than that of any later offloading unit: its trigger
    is the smallest request among offloading units ``j >= i``.
    """
    n = len(strategies)
    wanted = {j: min(j + int(distances[j]), n - 1) for j in range(n)
              if by_name(strategies[j]).offloads}
    return [min(t for j, t in wanted.items() if j >= i) if i in wanted else None for i in range(n)]


def _decode(profile: ProfileLike, plan: Plan | Sequence[Any], windows: Sequence[int] | None,
            distances: Sequence[int] | None) -> tuple[list[str], list[int], list[int], list[str]]:
    """Strategies, windows, distances and save-sets (``""`` for units that are not selective), from a Plan or from
    lists; a strategy is a name (``"selective:<save-set>"`` for selective) or a code."""
    n = len(profile.units)
    if isinstance(plan, Plan):
        plan.validate(profile)
        return plan.strategies, plan.offload_windows, plan.prefetch_distances, [d.save_set for d in plan.decisions]
    if windows is None or distances is None:
        raise PlanError("replay(profile, strategies, windows, distances): give windows and distances with a list of "
                        "strategies, or pass a Plan")
    strategies, save_sets = [], []
    for s in plan:
        save_set = ""
        if isinstance(s, str):
            name, _, save_set = s.partition(":")
            if name == "selective" and save_set not in SAVE_SETS:
                raise PlanError(f"a selective unit is given as 'selective:<save-set>' with a save-set among "
                                f"{', '.join(SAVE_SETS)}; got {s!r}")
        else:
            strategy, j = by_code(s)  # PlanError naming every code
            name, save_set = strategy.name, (strategy.variants[j] if strategy.variants else "")
        if name not in STRATEGIES or (save_set and name != "selective"):
            raise PlanError(f"strategy must be one of {', '.join(STRATEGIES)}, got {s!r}")
        strategies.append(name)
        save_sets.append(save_set)
    ws, ds = [int(x) for x in windows], [int(x) for x in distances]
    if not len(strategies) == len(ws) == len(ds) == n:
        raise PlanError(f"expected {n} strategies, windows and distances (one per unit), got {len(strategies)}, "
                        f"{len(ws)}, {len(ds)}")
    return strategies, ws, ds, save_sets


def _save_set_costs(units: Sequence[Any], save_sets: Sequence[str]) -> list[dict[str, Any] | None]:
    """Per unit the profile's entry for the save-set the plan gives it (``None`` when it is not selective)."""
    out: list[dict[str, Any] | None] = []
    for up, name in zip(units, save_sets, strict=True):
        if not name:
            out.append(None)
            continue
        entry = (getattr(up, "save_sets", None) or {}).get(name)
        if entry is None:
            offered = ", ".join(getattr(up, "save_sets", None) or {}) or "none"
            raise PlanError(f"unit {up.index} ({up.name}): selective with save-set {name!r}, which its profile does "
                            f"not offer (it offers: {offered}); profile the model with memopt.profile(..., "
                            "selective=True) or choose another strategy")
        out.append(entry)
    return out


class _StateReplay:
    """The placements' part of the replay (module docstring): ledger changes, backward steps, the parted step."""

    def __init__(self, profile: ProfileLike, placements: Sequence[tuple[str, str, str]], dev: DeviceSpec,
                 factor: float) -> None:
        units, segs = profile.units, profile.segments
        n = len(units)
        self.n = n
        self.units = units
        self.segs = segs
        self.place = [tuple(pl) if units[u].grad_bytes > 0 else ("resident", "resident", "resident")
                      for u, pl in enumerate(placements)]
        for u, pl in enumerate(self.place):
            if pl[2] == "offload" and not units[u].params_offloadable:
                raise PlanError(f"unit {u} ({units[u].name}): its parameters cannot be offloaded (shared with another "
                                "module, a view or not resizable); keep params='resident' for it")
            if pl[0] == "stream" and not getattr(units[u], "param_steps", None):
                raise PlanError(f"unit {u} ({units[u].name}): its optimizer state cannot stream: the profile has no "
                                "per-parameter steps for it (made without an optimizer, or by an older version); "
                                "re-profile with memopt.profile(..., optimizer=opt), or use optimizer='offload'")
        self.moves = any(pl != ("resident", "resident", "resident") for pl in self.place)
        self.step_seg = next((k for k, sg in enumerate(segs) if sg.label == "to optimizer_end"), -1)
        self.dev, self.factor = dev, factor
        self.outside_time = 0.0

    def on_device(self, k: int) -> dict[tuple[str, int], bool]:
        """Which offloadable items are on the device during segment ``k`` (outside the step), by the hook rules."""
        out: dict[tuple[str, int], bool] = {}
        units, n = self.units, self.n
        for u in range(n):
            o, g, p = self.place[u]
            fwd, bwd = units[u].fwd_segment, units[u].bwd_segment
            out[("O", u)] = o == "resident"
            made = k >= bwd  # the profiled run holds G from its unit's backward on
            out[("G", u)] = made and (g == "resident" or k == bwd)
            if p == "resident":
                out[("P", u)] = True
            else:
                ahead_f = units[u - 1].fwd_segment if u > 0 else fwd  # the pre-hook of u - 1 fetches u
                ahead_b = units[u + 1].bwd_segment if u + 1 < n else bwd  # backward reaching u + 1 fetches u
                out[("P", u)] = ahead_f <= k <= fwd or ahead_b <= k <= bwd
        return out

    def size(self, item: tuple[str, int]) -> int:
        kind, u = item
        up = self.units[u]
        return {"O": up.optimizer_bytes, "G": up.grad_bytes, "P": up.param_bytes}[kind]

    def streamed(self, u: int) -> bool:
        return self.place[u][0] == "stream"

    def stream_moments(self, u: int, grads_brought: bool) -> list[int]:
        """Unit ``u`` streaming its step: per parameter ``j``, what the unit holds of its own while ``j`` steps —
        ``j``'s state, the next parameter's state on its way in (the last one has none), ``j``'s gradient when it is
        brought back for the step, and that step's own peak."""
        rows = self.units[u].param_steps
        out = []
        for j, row in enumerate(rows):
            held = int(row["optimizer_bytes"]) + int(row["step_rel_peak"])
            if j + 1 < len(rows):
                held += int(rows[j + 1]["optimizer_bytes"])
            if grads_brought:
                held += int(row["grad_bytes"])
            out.append(held)
        return out

    def first_state(self, u: int) -> int:
        """What of unit ``u``'s optimizer state the part before its own brings in: all of it, or, streaming, its
        first parameter's."""
        return int(self.units[u].param_steps[0]["optimizer_bytes"]) if self.streamed(u) else self.size(("O", u))

    def profiled(self, item: tuple[str, int], k: int) -> bool:
        kind, u = item
        return k >= self.units[u].bwd_segment if kind == "G" else True

    def extra(self, k: int) -> int:
        """The plan's state bytes minus the profiled run's, in segment ``k``."""
        return sum((self.size(it) if here else 0) - (self.size(it) if self.profiled(it, k) else 0)
                   for it, here in self.on_device(k).items())

    def backward_step_gap(self, k: int) -> int:
        """For the backward segment of a unit stepped in backward: how far that step rises above the segment's peak.

        Measured against the profiled segment (every unit kept, every other unit's placement as profiled): at the
        step, the level after the backward with this unit's state, gradients and parameters all on the device, plus
        what the backward still holds when its last gradient is accumulated (``grads_done_extra``), plus the step's
        own peak; the segment without it, the profiled peak less this unit's offloaded state. Everything
        else (the activation plan, other units' placements) moves both alike.
        """
        seg = self.segs[k]
        if seg.kind != "bwd" or self.place[seg.unit][1] != "step":
            return 0
        u = seg.unit
        after = self.segs[k + 1].start_level if k + 1 < len(self.segs) else seg.start_level
        if self.streamed(u):  # its state comes in one parameter at a time: the reference level holds all of it
            own = max(self.stream_moments(u, False)) - self.size(("O", u))
        else:
            own = self.units[u].step_rel_peak
        moment = after + getattr(self.units[u], "grads_done_extra", 0) + own
        without = seg.start_level + seg.rel_peak + sum(
            (self.size(it) if here else 0) - (self.size(it) if self.profiled(it, k) else 0)
            for it, here in self.on_device(k).items() if it[1] == u)
        return max(0, moment - without)

    def parted_step(self, base: int, outside_rel: int) -> list[tuple[str, int]]:
        """Walk the parted step: ``(label, peak)`` per part."""
        units, n = self.units, self.n
        here: dict[tuple[str, int], int] = {}  # item -> its bytes on the device now (start of the step: after backward)
        for u in range(n):
            o, g, p = self.place[u]
            here[("O", u)] = self.size(("O", u)) if o == "resident" else 0
            here[("G", u)] = self.size(("G", u)) if g == "resident" else 0
            here[("P", u)] = self.size(("P", u)) if p == "resident" else 0

        def level() -> int:
            return base + sum(nbytes - self.size(it) for it, nbytes in here.items())  # profiled: all there

        def stepped(u: int) -> bool:
            return self.place[u][1] == "step"

        def bring(part: int) -> None:  # part 0: outside units; part i: unit i - 1
            u = part - 1
            if 0 <= u < n and not stepped(u):
                if self.place[u][0] != "resident":  # brought in (streaming: its first parameter's state only)
                    here[("O", u)] = self.first_state(u)
                here[("P", u)] = self.size(("P", u))

        points = []
        bring(0)
        for part in range(n + 1):
            u = part - 1
            bring(part)
            if u >= 1:  # the state sent back after the previous part has left
                v = u - 1
                if self.place[v][0] != "resident":
                    here[("O", v)] = 0
            bring(part + 1)
            if u < 0:
                points.append(("step outside units", level() + outside_rel))
                continue
            if stepped(u):
                points.append((f"step of {units[u].name} (in backward)", level()))
                continue
            if self.streamed(u):
                # one parameter at a time: the unit's state on the device is the stream's moments (each parameter's
                # offloaded gradient comes in with it); once the last has stepped, nothing of it is left
                here[("O", u)] = 0
                own = max(self.stream_moments(u, self.place[u][1] == "offload"))
                points.append((f"step of {units[u].name} (streamed)", level() + own))
            else:
                if self.place[u][1] == "offload":
                    here[("G", u)] = self.size(("G", u))
                points.append((f"step of {units[u].name}", level() + units[u].step_rel_peak))
                if self.place[u][1] == "offload":
                    here[("G", u)] = 0
            if self.place[u][2] == "offload":
                here[("P", u)] = 0
        return points

    def seconds(self) -> float:
        """What the placements add to the step (see the module docstring)."""
        dev, units, n, f = self.dev, self.units, self.n, self.factor

        def job(direction: str, nbytes: int, storages: int, beside: float | None) -> float:
            if not dev.copy_overlap:
                return copy_seconds(dev, direction, nbytes, storages)
            wire = copy_seconds(dev, direction, nbytes, 0)
            shown = wire if beside is None else max(0.0, wire - beside)
            return thread_seconds(dev, storages) + shown

        part_time = [self.outside_time] + [u.step_time * f for u in units]
        t = 0.0
        for u, up in enumerate(units):
            o, g, p = self.place[u]
            if o == "offload":
                t += job("h2d", up.optimizer_bytes, up.optimizer_storages, part_time[u] if g != "step" else None)
                t += job("d2h", up.optimizer_bytes, up.optimizer_storages, None)
            if o == "stream":
                rows = up.param_steps
                t += sum(float(r["step_time"]) for r in rows) * f - up.step_time * f  # its step, parameter by parameter
                t += job("d2h", up.optimizer_bytes, up.optimizer_storages, None)
                if not dev.copy_overlap:
                    t += job("h2d", up.optimizer_bytes, up.optimizer_storages, None)
                else:  # parameter j's state comes in beside the step before it: the previous part's, then j - 1's
                    t += thread_seconds(dev, up.optimizer_storages)
                    beside = [part_time[u]] + [float(r["step_time"]) * f for r in rows[:-1]]
                    for r, window in zip(rows, beside, strict=True):
                        t += job("h2d", int(r["optimizer_bytes"]), 0, window if g != "step" else None)
            if g == "offload":
                t += job("d2h", up.grad_bytes, up.grad_storages, None)
                t += job("h2d", up.grad_bytes, up.grad_storages, None)
            if p == "offload":
                prev_fwd = self.segs[units[u - 1].fwd_segment].time * f if u > 0 else 0.0
                next_bwd = self.segs[units[u + 1].bwd_segment].time * f if u + 1 < n else 0.0
                t += job("h2d", up.param_bytes, up.param_storages, prev_fwd)
                t += job("h2d", up.param_bytes, up.param_storages, next_bwd)
                if g != "step":
                    t += job("h2d", up.param_bytes, up.param_storages, part_time[u])
                t += job("d2h", up.param_bytes, up.param_storages, None)
        return t


def _placements(profile: ProfileLike, plan: Plan | Sequence[Any], states: Sequence[Any] | None
                ) -> list[tuple[str, str, str]]:
    """The plan's ``(optimizer, grads, params)`` placement per unit."""
    if isinstance(plan, Plan):
        placements = plan.placements
    elif states is None:
        placements = [STATE_CHOICES[0]] * len(profile.units)
    else:
        placements = [STATE_CHOICES[int(c)] if not isinstance(c, (tuple, list)) else tuple(c) for c in states]
    if len(placements) != len(profile.units):
        raise PlanError(f"expected {len(profile.units)} placements (one per unit), got {len(placements)}")
    return placements


class _Structure:
    """The step's structure, read from the profile's segments: each unit's forward and backward segment, the
    boundaries next to units' forwards, where offloaded memory is dropped."""

    def __init__(self, profile: ProfileLike) -> None:
        units, n = profile.units, len(profile.units)
        self.n = n
        self.fwd_at: dict[int, int] = {}
        self.bwd_at: dict[int, int] = {}
        for k, seg in enumerate(profile.segments):
            table = self.fwd_at if seg.kind == "fwd" else self.bwd_at if seg.kind == "bwd" else None
            if table is not None:
                if seg.unit in table or not 0 <= seg.unit < n:
                    raise ProfileError(f"segment {k} is a {seg.kind} of unit {seg.unit}, which has one already or "
                                       f"does not exist")
                table[seg.unit] = k
        for u, up in enumerate(units):
            if (self.fwd_at.get(u), self.bwd_at.get(u)) != (up.fwd_segment, up.bwd_segment):
                raise ProfileError(f"unit {u} ({up.name}): its segments say forward {self.fwd_at.get(u)}, backward "
                                   f"{self.bwd_at.get(u)}; the unit says {up.fwd_segment}, {up.bwd_segment}")
        self.forward_end = self.fwd_at[n - 1] + 1  # the boundary right after the last unit's forward
        self.unit_boundaries = {self.fwd_at[u] for u in range(n)} | {self.fwd_at[u] + 1 for u in range(n)}

    def next_unit(self, boundary: int) -> int:
        return min([u for u in range(self.n) if self.fwd_at[u] >= boundary], default=self.n)

    def drop_boundary(self, unit: int) -> int:
        """The unit boundary before unit ``unit``'s forward, or the end of the forward."""
        return self.fwd_at[unit] if unit < self.n else self.forward_end


class _GroupLedger:
    """When the profiled run and the plan let go of each storage group, and what the plan offloads.

    ``change[b]``: the change of (plan's bytes − profiled bytes) from boundary ``b`` on; ``offloads[issue][drop]``:
    the groups copied to the host from boundary ``issue``, dropped at ``drop``; ``returns[owner]``: the groups its
    prefetch brings back; ``late_at[k]``: what groups the profiled run freed partway through segment ``k`` add to its
    peak where the plan holds them longer.
    """

    def __init__(self, profile: ProfileLike, where: _Structure, strategies: Sequence[str], windows: Sequence[int],
                 chosen: list[Any], triggers: Sequence[int]) -> None:
        n = len(profile.units)
        kinds = [by_name(s) for s in strategies]
        rc = [k.recomputes for k in kinds]  # recomputed
        ro = [k.recomputes and k.offloads for k in kinds]  # recomputed, inputs offloaded
        plain_rc = [k.keeps_inputs for k in kinds]  # recomputed, inputs kept
        offloading = [k.offloads for k in kinds]
        fwd_at, bwd_at = where.fwd_at, where.bwd_at
        self.change: dict[int, int] = {}
        self.offloads: dict[int, dict[int, list[Any]]] = {}
        self.returns: dict[int, list[Any]] = {}
        self.owner_of: dict[int, int] = {}  # id(group) -> its owner, for offloaded groups
        self.late_at: dict[int, int] = {}
        for u, entry in enumerate(chosen):  # a selective unit's save-set: held after its forward, through its backward
            if entry is not None:
                self._add(fwd_at[u] + 1, int(entry["held_bytes"]))
                self._add(bwd_at[u] + 1, -int(entry["held_bytes"]))
        for g in profile.groups:
            if g.outside_saver and g.outside_release is None:
                continue  # code outside units holds it all step
            if not g.savers and not g.outside_saver and g.free_pos is None and g.release_pos is None:
                continue  # the caller's (an input batch): nothing in the step lets go of it
            last_fwd = (g.free_pos - 1 if g.free_pos is not None else g.release_pos - 1 if g.release_pos is not None
                        else where.forward_end)
            outside = [g.outside_release] if g.outside_saver else []
            kept_holders = [bwd_at[s] for s in g.savers] + outside
            plan_holders = ([bwd_at[s] for s in g.savers if not (s == g.producer and rc[s])]
                            + [bwd_at[c] for c in g.consumers if rc[c]] + outside)
            self._add(max(kept_holders + [last_fwd]) + 1, g.nbytes)  # the profiled level drops here ...
            self._add(max(plan_holders + [last_fwd]) + 1, -g.nbytes)  # ... the plan's here
            death = getattr(g, "death_seg", None)
            if death is not None and max(plan_holders + [last_fwd]) > death:  # held past where the run freed it
                self.late_at[death] = self.late_at.get(death, 0) + getattr(g, "late_bytes", 0)
            handed = [s for s in g.savers if not (s == g.producer and rc[s])] + [c for c in g.consumers if ro[c]]
            if not handed or g.outside_saver or g.free_pos is None:
                continue
            owner = max(handed)
            if not offloading[owner] or any(plain_rc[c] for c in g.consumers):
                continue
            # the engines look at unit boundaries
            issue = min((b for b in where.unit_boundaries if b >= g.free_pos), default=None)
            if issue is None:
                continue
            drop = where.drop_boundary(min(where.next_unit(issue) + windows[owner], n))
            self._add(drop, -g.nbytes)
            self._add(bwd_at[triggers[owner]], g.nbytes)
            self.offloads.setdefault(issue, {}).setdefault(drop, []).append(g)
            self.returns.setdefault(owner, []).append(g)
            self.owner_of[id(g)] = owner

    def _add(self, boundary: int, nbytes: int) -> None:
        self.change[boundary] = self.change.get(boundary, 0) + nbytes


class _Engines:
    """The step's clock and its two copy engines: with ``copy_overlap`` each direction is a first-in-first-out queue
    beside compute (the training thread pays the per-storage part); without it a copy runs on the compute cores."""

    def __init__(self, dev: DeviceSpec) -> None:
        self.dev = dev
        self.t = 0.0
        self.d2h_free = self.h2d_free = 0.0  # when each copy engine is next idle
        self.compute = self.copy_total = 0.0
        self.thread = 0.0  # the training thread's share of the copies (with overlap): added to the step
        self.copies: list[CopyJob] = []

    def run(self, job: CopyJob, free: float) -> float:
        """Run ``job`` on an engine idle from ``free``; returns when that engine is next idle."""
        self.copy_total += job.seconds
        if self.dev.copy_overlap:
            own = thread_seconds(self.dev, job.storages)
            self.thread += own
            job.start = max(free, self.t)
            job.end = job.start + job.seconds - own
            self.copies.append(job)
            return job.end
        job.start = self.t  # on the compute cores: the step waits for it here
        job.end = self.t = self.t + job.seconds
        self.compute += job.seconds
        self.copies.append(job)
        return free

    def job(self, direction: str, boundary: int, due: int, owners: tuple[int, ...], groups: list[Any]) -> CopyJob:
        nbytes = sum(g.nbytes for g in groups)
        storages = sum(g.count for g in groups)
        return CopyJob(direction, boundary, due, owners, nbytes, storages,
                       copy_seconds(self.dev, direction, nbytes, storages))


def _own_peak(seg: Any, units: Sequence[Any], rc: Sequence[bool], chosen: list[Any]) -> int:
    """A segment's peak above its start level: as profiled, or as measured with its unit recomputed."""
    own = seg.rel_peak
    if seg.kind in ("fwd", "bwd") and rc[seg.unit]:
        own = units[seg.unit].rc_fwd_rel_peak if seg.kind == "fwd" else units[seg.unit].rc_bwd_rel_peak
        entry = chosen[seg.unit]
        if entry is not None:
            own = int(entry["fwd_rel_peak"] if seg.kind == "fwd" else entry["bwd_rel_peak"])
    return own


def _offload_at(k: int, clock: _Engines, groups: _GroupLedger, held_at: dict[int, float]) -> float:
    """Queue the offloads possible at boundary ``k`` (earliest drop first); the seconds the forward waits there for
    the copies whose memory it drops at ``k``."""
    for drop in sorted(groups.offloads.get(k, {})):
        gs = groups.offloads[k][drop]
        job = clock.job("d2h", k, drop, tuple(sorted({groups.owner_of[id(g)] for g in gs})), gs)
        clock.d2h_free = clock.run(job, clock.d2h_free)
        held_at[drop] = max(held_at.get(drop, 0.0), job.end)
    if k not in held_at:
        return 0.0
    wait = max(0.0, held_at[k] - clock.t)
    clock.t += wait
    return wait


def _prefetch_for(u: int, k: int, clock: _Engines, groups: _GroupLedger, where: _Structure,
                  triggers: Sequence[int | None], back_at: dict[int, float]) -> float:
    """Queue the prefetches unit ``u``'s backward (segment ``k``) triggers, latest owner first; the seconds it waits
    for its own."""
    for owner in sorted((o for o, tr in enumerate(triggers) if tr == u and o in groups.returns), reverse=True):
        job = clock.job("h2d", k, where.bwd_at[owner], (owner,), groups.returns[owner])
        clock.h2d_free = clock.run(job, clock.h2d_free)
        back_at[owner] = job.end
    if u not in back_at:
        return 0.0
    wait = max(0.0, back_at[u] - clock.t)
    clock.t += wait
    return wait


def _check_host_link(strategies: Sequence[str], dev: DeviceSpec) -> None:
    """A plan that offloads needs a device with a host link: :class:`PlanError` otherwise."""
    if any(s in OFFLOADING for s in strategies) and not dev.has_host_link:
        used = ", ".join(sorted(set(strategies) & set(OFFLOADING)))
        raise PlanError(f"the plan offloads units ({used}), but {dev.name} has no host link to copy over; recompute or "
                        "keep them")


def _phase(k: int, where: _Structure, state: _StateReplay) -> str:
    """The phase segment ``k`` belongs to, as the timeline names it."""
    if k == state.step_seg:
        return "optimizer step"
    if 0 <= state.step_seg < k:
        return "after the step"
    return "forward" if k < where.forward_end else "backward"


def replay(profile: ProfileLike, plan: Plan | Sequence[Any], windows: Sequence[int] | None = None,
           distances: Sequence[int] | None = None, device: DeviceSpec | str | None = None,
           states: Sequence[Any] | None = None) -> Replay:
    """Replay one training step of ``profile`` under a plan on ``device`` (default: the profiled device).

    ``plan`` is a :class:`~memopt_nb.core.plan.Plan` (its placements count), or a list of strategies (names, with
    ``"selective:<save-set>"`` for selective, or codes 0 keep / 1 recompute / 2 swap / 3 recompute_offload /
    ``4 + j`` selective with ``SAVE_SETS[j]``) given with ``windows`` and ``distances``, and optionally
    ``states``: per unit an ``(optimizer, grads, params)`` placement or an index into
    :data:`~memopt_nb.core.plan.STATE_CHOICES`. See the module docstring for the rules.

    One walk over the segments; each one's bookkeeping is in the small classes and helpers above.
    """
    dev = DeviceSpec.resolve(device, profile.device)
    strategies, windows_, distances_, save_sets = _decode(profile, plan, windows, distances)
    placements = _placements(profile, plan, states)
    units, segments = profile.units, profile.segments
    rc = [by_name(s).recomputes for s in strategies]  # recomputed
    chosen = _save_set_costs(profile.units, save_sets)  # a selective unit's save-set costs
    _check_host_link(strategies, dev)
    where = _Structure(profile)
    triggers = prefetch_triggers(strategies, distances_)
    groups = _GroupLedger(profile, where, strategies, windows_, chosen, triggers)
    factor = dev.time_factor(profile.device)
    state = _StateReplay(profile, placements, dev, factor)
    state.outside_time = profile.outside_step_time * factor
    clock = _Engines(dev)
    held_at: dict[int, float] = {}  # drop boundary -> when its last offload ends
    back_at: dict[int, float] = {}  # owner -> when its prefetch ends
    fwd_stall = bwd_stall = recompute = 0.0
    levels: list[int] = []
    peaks: list[int] = []
    rows: list[dict[str, Any]] = []
    extra = 0
    for k, seg in enumerate(segments):
        extra += groups.change.get(k, 0)
        fwd_stall += _offload_at(k, clock, groups, held_at)
        dur = seg.time * factor
        if seg.kind == "bwd":
            u = seg.unit
            bwd_stall += _prefetch_for(u, k, clock, groups, where, triggers, back_at)
            if rc[u]:
                redo = (units[u].fwd_time if chosen[u] is None else float(chosen[u]["recompute_time"])) * factor
                recompute += redo
                dur += redo
        level = seg.start_level + extra + state.extra(k)
        peak = level + _own_peak(seg, units, rc, chosen) + groups.late_at.get(k, 0)
        peak += state.backward_step_gap(k)
        phase = _phase(k, where, state)
        t = clock.t
        if k == state.step_seg and state.moves:
            # the parted step replaces the plain one: one row per part
            step_points = state.parted_step(seg.start_level, profile.outside_step_rel_peak)
            levels.append(level)
            peaks.append(max(p for _, p in step_points))
            dur = max(dur, profile.chunked_step_time * factor)
            for i, (label, p) in enumerate(step_points):
                rows.append({"time": t + dur * i / len(step_points), "bytes": p, "phase": phase, "unit": -1,
                             "event": label})
        else:
            levels.append(level)
            peaks.append(peak)
            rows.append({"time": t, "bytes": level, "phase": phase, "unit": seg.unit, "event": seg.kind})
            rows.append({"time": t + dur / 2, "bytes": peak, "phase": phase, "unit": seg.unit, "event": "peak"})
        clock.compute += dur
        clock.t += dur
    state_time = state.seconds() if state.moves else 0.0
    clock.compute += clock.thread + state_time
    clock.t += clock.thread + state_time
    copies = clock.copies
    return Replay(
        peak_bytes=max(peaks), step_time=clock.t, segment_levels=levels, segment_peaks=peaks,
        compute_time=clock.compute, recompute_time=recompute, copy_time=clock.copy_total, fwd_stall_time=fwd_stall,
        bwd_stall_time=bwd_stall, bytes_offloaded=sum(j.nbytes for j in copies if j.direction == "d2h"),
        bytes_prefetched=sum(j.nbytes for j in copies if j.direction == "h2d"),
        triggers=triggers, copies=copies, rows=rows,
        step_points=state.parted_step(segments[state.step_seg].start_level, profile.outside_step_rel_peak)
        if state.moves and state.step_seg >= 0 else [],
        state_time=state_time, moves_state=state.moves,
    )
