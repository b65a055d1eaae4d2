"""``memopt.simulate``: a cost model of one training step under a plan — peak memory, step time and a timeline.

The model is written down once, in ``memopt_nb/sim/COST_MODEL.md``; this module and :mod:`.replay` implement it.

The step is the profiled sequence of *segments* (each unit's forward and backward and the code between them) on a
compute stream, plus two copy engines (device→host, host→device), each first-in-first-out at the device's bandwidth.

**Memory** is the profiled level at the start of each segment (every unit kept) corrected by what the plan changes for
every storage group (see :class:`~memopt_nb.core.profile.StorageGroup`), plus the segment's own peak above its start
(measured with the unit kept, or with the unit recomputed). For a group saved by units:

* it stays until the backward of the last holder in time: a unit that saves it (unless that unit is its producer and
  recomputes it — then the recomputation recreates it), or a recomputed unit (``recompute`` or ``recompute_offload``)
  that takes it as input (checkpointing keeps inputs);
* if its owner (the last unit to hand it to the swap engine: a unit that saves it, not a recomputing producer, or a
  ``recompute_offload`` unit that takes it as input) swaps or recomputes-and-offloads, and no plain ``recompute`` unit
  takes it as input, it becomes eligible at the boundary where nothing else refers to it; the copy to host starts
  there, its memory is gone from the boundary before unit ``j + w`` (``j`` the next unit to run, ``w`` the owner's
  window; or the end of the forward) until the backward of the owner's trigger unit, where the copy back allocates it
  again. Without ``recompute_offload`` in a plan the owner is simply the last unit that saves it.

A ``selective`` unit (selective checkpointing with one of its profiled save-sets, see
:data:`~memopt_nb.core.plan.SAVE_SETS`) is recomputed for every rule above, like plain ``recompute`` (it does not hold
what it produced, its checkpoint holds its inputs, which are therefore never offloaded); in addition the outputs its
save-set keeps, ``held_bytes``, are on the device in every segment after its forward up to and including its
backward, its forward and backward segments peak by the save-set's ``fwd_rel_peak`` / ``bwd_rel_peak``, and its
backward recomputes for the save-set's ``recompute_time`` instead of the whole forward.

A group the profiled run freed partway through a segment whose peak came after (a mask made outside the units that
the model's forward let go of before its head: ``StorageGroup.death_seg`` / ``late_bytes``) adds ``late_bytes`` to that
segment's peak when the plan holds it past the segment (its last holder's backward, or its liveness, is later).

These rules are exactly what the runtime does, so memory is predicted from structure, not from timing.

**Optimizer state, gradients and parameters** (plan schema 2; :class:`StateTable`). Each unit's placement
``(optimizer, grads, params)`` changes the level of every segment by what it moves, following
:class:`~memopt_nb.runtime.state.StateManager`'s fixed schedule (each unit's bytes depend on its own placement only, so
the model is a sum over units — what the MILP needs):

* ``optimizer="offload"``: its state bytes are off the device in every segment; ``grads="offload"``: its gradients
  are off the device after its backward (counted in full during its backward, where they are made and copied out);
  ``grads="step"``: likewise, and its backward also holds, where its last gradient is accumulated, the level after
  it plus what the backward still holds there (``UnitProfile.grads_done_extra``) plus its step's own peak;
* ``params="offload"``: its parameters are on the device from the forward of unit ``u - 1`` (fetched ahead) to its own
  forward, and from the backward of unit ``u + 1`` to its own backward; the hook-time fetches and frees inside the
  code between units are covered by the neighbouring unit segments, whose peaks are never lower;
* the optimizer step: with every placement resident it is the plain step (segment ``step_segment``); otherwise it runs
  unit by unit (parameters outside units first, then unit 0, 1, …): at the point where unit ``k`` steps, unit ``k`` and
  ``k + 1`` have their state and parameters on the device, unit ``k`` its gradients, and the peak is the level plus
  unit ``k``'s own step peak (``UnitProfile.step_rel_peak``). A unit stepped in backward adds nothing there.

Time of the state copies (the approximation: per unit, what cannot hide behind the compute the runtime puts beside
it, priced by :meth:`DeviceSpec.copy_seconds`): without ``copy_overlap`` every byte moved adds to the step (state:
in and out once; gradients: out in backward and in for the step; parameters: in for the forward, the backward and the
step, out after the step). With it, the per-storage term adds; a prefetch's bytes hide behind the neighbour's compute
it runs beside (the previous unit's forward, the next unit's backward, the previous unit's step) and the rest shows;
copies to host the runtime waits for (gradients at the end of their unit's backward, state and parameters after their
step) show in full. The unit-by-unit step costs ``chunked_step_extra`` over the plain one whenever any unit moves.

**Time**: segment durations (scaled to the target device, see :meth:`DeviceSpec.time_factor`), plus a recomputed
unit's forward in its backward (a selective unit's ``recompute_time``), plus the copies, priced by
:meth:`DeviceSpec.copy_seconds` (bytes over the link plus ``copy_overhead_s`` per storage, each direction):

* with ``copy_overlap`` (GPU copy engines; the CPU when the copy threads have a spare core) the bytes term runs on two
  first-in-first-out copy queues beside compute and costs only stalls: the forward waits at a release point for its
  copies to finish, and a unit's backward waits for its prefetch (offloads queue in issue order, prefetches in the order
  backward needs them); the per-storage term, spent by the training thread, is added to the step;
* without it (the CPU when compute uses every core) the whole round trip of every offloaded storage group,
  ``copy_seconds(bytes, storages, "both")``, is added to the step.

The same model is written a second time, plainly and from the profile alone, in :mod:`memopt_nb.sim.replay`; the
tests hold this compiled one to it. :meth:`Simulator.run` takes its timeline and ``bytes_prefetched`` from that replay.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.budget import format_bytes
from ..core.cuts import profile_for
from ..core.device import DeviceSpec
from ..core.errors import PlanError, ProfileError
from ..core.plan import SAVE_SETS, Plan
from ..core.profile import ProfileLike
from ..core.strategies import CODES, NAMES, by_code, code_of, save_set_of
from .replay import Replay, replay
from .state_cost import StateTable, compile_state, state_part

__all__ = ["CODES", "NAMES", "SimResult", "Simulator", "StateTable", "code_of", "save_set_of", "simulate",
           "simulate_reference"]

#: The codes the cost rules below name (every code and what it does comes from :mod:`memopt_nb.core.strategies`).
KEEP, RECOMPUTE, SWAP, RECOMPUTE_OFFLOAD, SELECTIVE = (CODES[s] for s in ("keep", "recompute", "swap",
                                                                    "recompute_offload", "selective"))
#: Per code: recomputed in backward; offloads to the host with the swap timing; recomputed with the inputs its
#: checkpoint keeps offloaded (the registry's flags, as arrays indexed by code).
_RECOMPUTES = np.array([by_code(c)[0].recomputes for c in NAMES])
_OFFLOADS = np.array([by_code(c)[0].offloads for c in NAMES])
_OFFLOADS_INPUTS = _RECOMPUTES & _OFFLOADS


@dataclass
class _Batch:
    """A batch of ``(B, n)`` plans as :meth:`Simulator.evaluate` reads them (codes, windows, distances, and what the
    codes mean per unit)."""

    s: np.ndarray
    w: np.ndarray
    d: np.ndarray
    sel: np.ndarray
    sel_j: np.ndarray
    ro: np.ndarray
    rc: np.ndarray
    sw: np.ndarray
    trig: np.ndarray
    rows: np.ndarray
    units: np.ndarray

    @property
    def any_sel(self) -> bool:
        return bool(self.sel.any())


@dataclass
class _Moves:
    """Per plan and storage group ``(B, G)``: the last segment holding it, whether it is offloaded, the segments where
    it leaves and comes back, and (with ``recompute_offload`` in the batch) its owner unit."""

    plan_end: np.ndarray
    off: np.ndarray
    r_pos: np.ndarray
    t_pos: np.ndarray
    owner: np.ndarray | None


@dataclass
class SimResult:
    """What the simulator predicts for one training step under a plan.

    Attributes:
        peak_bytes: peak device memory; step_time: seconds per step.
        compute_time: time of all segments without stalls (recompute included); recompute_time: the part spent
            re-running forwards; stall_time: waiting for copies (``fwd_stall_time`` + ``bwd_stall_time``).
        bytes_offloaded / bytes_prefetched: host traffic each way.
        budget_bytes / feasible: the budget checked against (the plan's, unless given) and whether the peak fits.
        segment_peaks: peak per segment; timeline: rows ``{"time", "bytes", "phase", "unit", "event"}``.
        storages_offloaded: storages moved to the host (and back); copy_time: what those copies cost by
            :meth:`DeviceSpec.copy_seconds` (both directions, bytes and per-storage terms, overlapped or not).
        peak_phase: where the peak sits: ``"forward"``, ``"backward"``, ``"optimizer step"`` or ``"after the step"``;
            peak_where: the segment label (or ``"step of <unit>"`` in the unit-by-unit step).
        step_peak: peak of the optimizer step (plain, or unit by unit when the plan moves state); state_time: the
            seconds the plan's state placements add (copies, and the unit-by-unit step).
    """

    peak_bytes: int
    step_time: float
    compute_time: float
    recompute_time: float
    stall_time: float
    fwd_stall_time: float
    bwd_stall_time: float
    bytes_offloaded: int
    bytes_prefetched: int
    budget_bytes: int | None
    feasible: bool | None
    device: str
    segment_peaks: list[int] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    storages_offloaded: int = 0
    copy_time: float = 0.0
    peak_phase: str = ""
    peak_where: str = ""
    step_peak: int = 0
    state_time: float = 0.0

    def __repr__(self) -> str:
        fit = "" if self.feasible is None else (" fits" if self.feasible else " OVER BUDGET")
        return (f"SimResult(peak {format_bytes(self.peak_bytes)}, step {self.step_time * 1e3:.2f} ms, "
                f"stall {self.stall_time * 1e3:.2f} ms, recompute {self.recompute_time * 1e3:.2f} ms{fit})")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


class Simulator:
    """A profile compiled for fast, vectorized plan evaluation (the planners' inner loop).

    ``Simulator(profile, device).evaluate(strategies, windows, distances)`` takes ``(B, n)`` integer arrays (strategy
    codes 0 keep, 1 recompute, 2 swap, 3 recompute_offload, ``SELECTIVE + j`` selective with save-set ``j`` of
    :data:`~memopt_nb.core.plan.SAVE_SETS`, see :func:`code_of`) and returns peak bytes and step seconds, each shape
    ``(B,)``. A selective code for a save-set the unit's profile does not have raises
    :class:`~memopt_nb.core.errors.PlanError`.
    """

    def __init__(self, profile: ProfileLike, device: DeviceSpec | str | None = None) -> None:
        self.profile = profile
        self.device = DeviceSpec.resolve(device, profile.device)
        self.factor = self.device.time_factor(profile.device)
        self.n = n = profile.n_units
        segs = profile.segments
        self.S = S = len(segs)
        self.kind = np.array([{"fwd": 0, "bwd": 1, "other": 2}[s.kind] for s in segs])
        self.seg_unit = np.array([s.unit for s in segs])
        self.dur = np.array([s.time for s in segs]) * self.factor
        self.start_level = np.array([s.start_level for s in segs], dtype=np.float64)
        self.rel = np.array([s.rel_peak for s in segs], dtype=np.float64)
        self.fwd_seg = np.array([u.fwd_segment for u in profile.units])
        self.bwd_seg = np.array([u.bwd_segment for u in profile.units])
        self.fwd_time = np.array([segs[u.fwd_segment].time for u in profile.units]) * self.factor
        self.rc_rel = np.array(self.rel)
        for u in profile.units:
            self.rc_rel[u.fwd_segment] = u.rc_fwd_rel_peak
            self.rc_rel[u.bwd_segment] = u.rc_bwd_rel_peak
        self.end = int(self.fwd_seg[n - 1] + 1)  # the boundary after the last unit's forward
        # next unit to run at a check-point boundary
        self.next_unit = np.full(S + 1, -1)
        for u in range(n):
            self.next_unit[self.fwd_seg[u]] = u
            self.next_unit[self.fwd_seg[u] + 1] = u + 1
        self._compile_save_sets(profile.units)
        self.swappable = np.array([u.swappable for u in profile.units]) & self.device.has_host_link
        self.recomputable = np.array([u.recomputable for u in profile.units])
        self.bw_d2h = self.device.d2h_bytes_per_s or 1.0
        self.bw_h2d = self.device.h2d_bytes_per_s or 1.0
        _compile_groups(self, profile.groups)
        self.step_segment = int(getattr(profile, "step_segment", -1))
        self._state: StateTable | None = None

    def _compile_save_sets(self, units: Sequence[Any]) -> None:
        """Per unit and save-set (``(n, len(SAVE_SETS))``): whether the profile has it and whether it is Pareto, and
        what it costs when the unit runs selective with it (bytes held from the end of its forward to its backward,
        seconds of recompute on this device, its forward and backward segments' peaks above their start)."""
        n, K = self.n, len(SAVE_SETS)
        self.sel_has = np.zeros((n, K), dtype=bool)
        self.sel_pareto = np.zeros((n, K), dtype=bool)
        self.sel_held = np.zeros((n, K))
        self.sel_time = np.zeros((n, K))
        self.sel_fwd_rel = np.zeros((n, K))
        self.sel_bwd_rel = np.zeros((n, K))
        for u, up in enumerate(units):
            for name, entry in (getattr(up, "save_sets", None) or {}).items():
                if name not in SAVE_SETS:
                    continue
                j = SAVE_SETS.index(name)
                missing = [k for k in ("held_bytes", "recompute_time", "fwd_rel_peak", "bwd_rel_peak")
                           if not isinstance(entry, dict) or k not in entry]
                if missing:
                    raise ProfileError(f"unit {u} ({up.name}): save-set {name!r} lacks {', '.join(missing)}; profile "
                                       "the model again with memopt.profile(..., selective=True)")
                self.sel_has[u, j] = True
                self.sel_pareto[u, j] = bool(entry.get("pareto", False))
                self.sel_held[u, j] = int(entry["held_bytes"])
                self.sel_time[u, j] = float(entry["recompute_time"]) * self.factor
                self.sel_fwd_rel[u, j] = int(entry["fwd_rel_peak"])
                self.sel_bwd_rel[u, j] = int(entry["bwd_rel_peak"])

    def _selective_of(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For ``(B, n)`` codes: which units run selective, and the index of their save-set (0 elsewhere); a code
        that names a save-set the profile does not have for its unit raises :class:`PlanError`."""
        K = len(SAVE_SETS)
        sel = (s >= SELECTIVE) & (s < SELECTIVE + K)
        j = np.where(sel, s - SELECTIVE, 0)
        if sel.any():
            bad = sel & ~self.sel_has[np.arange(self.n)[None], j]
            if bad.any():
                b, u = (int(x[0]) for x in np.nonzero(bad))
                what = f"save-set {SAVE_SETS[int(s[b, u]) - SELECTIVE]!r}"
                raise PlanError(f"unit {u} ({self.profile.units[u].name}): selective with {what}, which its profile "
                                f"does not offer (it offers: {', '.join(self.profile.units[u].save_sets) or 'none'}); "
                                "profile the model with memopt.profile(..., selective=True) or choose another "
                                "strategy")
        return sel, j

    # ------------------------------------------------------------------ optimizer state, gradients, parameters
    def state_table(self) -> StateTable:
        """The state part of the model (see :class:`StateTable`), compiled once per simulator."""
        if self._state is None:
            self._state = compile_state(self)
        return self._state

    # ------------------------------------------------------------------ batched evaluation
    def evaluate(self, strategies: np.ndarray, windows: np.ndarray, distances: np.ndarray,
                 states: np.ndarray | None = None,
                 details: bool = False) -> tuple[np.ndarray, np.ndarray] | dict[str, np.ndarray]:
        """Peak bytes and step seconds for a batch of plans (arrays of shape ``(B, n)``).

        ``states``: ``(B, n)`` indices into :data:`~memopt_nb.core.plan.STATE_CHOICES` (``None``: everything resident);
        the state part follows :class:`StateTable` exactly.

        The planners' inner loop, one vectorised pass in three steps: which storage groups move where
        (:meth:`_group_moves`), the memory of every segment (:meth:`_segment_peaks`), and the time, with the copy
        queues when the device overlaps copies (:func:`_copy_queues`).
        """
        b = self._batch(strategies, windows, distances)
        B, n = b.s.shape
        m = self._group_moves(b)
        peaks, peak, st_step, st_time, st_moved = self._segment_peaks(b, m, states)
        # ---- time
        off_nb = self.g_nb[None] * m.off
        off_count = (self.g_cnt[None] * m.off).sum(axis=1)  # storages offloaded (and brought back)
        if m.owner is not None:  # (B, n) bytes each owner brings back
            pf_bytes = np.bincount((b.rows * n + m.owner).ravel(), weights=off_nb.ravel(),
                                   minlength=B * n).reshape(B, n)
        else:
            pf_bytes = off_nb @ self.g_owner_onehot
        # seconds each unit's backward spends recomputing (a selective unit: what its save-set leaves to recompute)
        redo = np.where(b.rc, self.fwd_time[None], 0.0)
        if b.any_sel:
            redo = np.where(b.sel, self.sel_time[b.units, b.sel_j], redo)
        recompute = redo.sum(axis=1)
        dev = self.device
        copy_time = dev.copy_seconds(off_nb.sum(axis=1), off_count, "both")
        if not dev.copy_overlap:
            # copies share the compute cores (CPU device, no spare core): their time adds to the step, nothing overlaps
            t = self.dur.sum() + recompute + copy_time + st_time
            fwd_stall = bwd_stall = np.zeros(B)
            compute = self.dur.sum() + recompute + copy_time
        else:
            # the training thread's per-storage share of the copies; the bytes run on the copy queues
            thread_copy = dev.copy_seconds(0.0, off_count, "both")
            t, fwd_stall, bwd_stall = _copy_queues(self, b, m, off_nb, pf_bytes, redo)
            t = t + thread_copy + st_time
            compute = np.full(B, self.dur.sum()) + recompute + thread_copy
        if not details:
            return peak, t
        return {"peak": peak, "time": t, "peaks": peaks, "fwd_stall": fwd_stall, "bwd_stall": bwd_stall,
                "step_peak": st_step, "state_time": st_time, "moved": st_moved,
                "offloaded": off_nb.sum(axis=1), "recompute": recompute, "copy": copy_time,
                "compute": compute, "trig": b.trig, "off": m.off, "r_pos": m.r_pos,
                "t_pos": m.t_pos, "storages": off_count, "plan_end": m.plan_end}

    def _batch(self, strategies: np.ndarray, windows: np.ndarray, distances: np.ndarray) -> _Batch:
        """The ``(B, n)`` codes checked and read: what each unit recomputes, offloads, keeps selectively, and its
        effective prefetch trigger."""
        s = np.atleast_2d(np.asarray(strategies, dtype=np.int64))
        w = np.atleast_2d(np.asarray(windows, dtype=np.int64))
        d = np.atleast_2d(np.asarray(distances, dtype=np.int64))
        B, n = s.shape[0], self.n
        if s.shape[1] != n or w.shape != s.shape or d.shape != s.shape:
            raise PlanError(f"expected (B, {n}) arrays of strategies, windows and distances, got {s.shape}, "
                            f"{w.shape}, {d.shape}")
        if s.size and (s.min() < 0 or s.max() >= len(NAMES)):
            by_code(int(s.min() if s.min() < 0 else s.max()))  # PlanError naming the codes
        sel, sel_j = self._selective_of(s)
        sw = _OFFLOADS[s]  # offloads to the host, with the swap timing
        # effective prefetch triggers (descending scan)
        trig = np.full((B, n), -1)
        later = np.full(B, n - 1)
        for u in range(n - 1, -1, -1):
            t = np.minimum(np.minimum(u + d[:, u], n - 1), later)
            trig[:, u] = np.where(sw[:, u], t, -1)
            later = np.where(sw[:, u], t, later)
        return _Batch(s=s, w=w, d=d, sel=sel, sel_j=sel_j, ro=_OFFLOADS_INPUTS[s], rc=_RECOMPUTES[s], sw=sw,
                      trig=trig, rows=np.arange(B)[:, None], units=np.arange(n)[None])

    def _group_moves(self, b: _Batch) -> _Moves:
        """Per plan and storage group: the last segment that holds it, whether it is offloaded, and the boundaries
        where it leaves the device and comes back (see the module docstring's rules)."""
        n, rows, rc, sw, w, trig = self.n, b.rows, b.rc, b.sw, b.w, b.trig
        sav = self.g_sav[None]
        sav_ok = sav >= 0
        sav_rc = np.where(sav_ok, rc[rows[:, :, None], np.maximum(sav, 0)], False)
        producer_rc = sav_rc & (sav == self.g_prod[None, :, None])
        hold_sav = sav_ok & ~producer_rc
        con = self.g_con[None]
        con_ok = con >= 0
        con_rc = np.where(con_ok, rc[rows[:, :, None], np.maximum(con, 0)], False)
        end_sav = np.where(hold_sav, self.g_sav_bwd[None], -1).max(axis=2)
        end_con = np.where(con_rc, self.g_con_bwd[None], -1).max(axis=2)
        plan_end = np.maximum(np.maximum(end_sav, end_con), self.g_out_rel[None])
        plan_end = np.maximum(plan_end, self.g_fallback[None])
        owner = None
        if b.ro.any():
            # the owner is the last unit that hands the storage to the swap engine: a saver (not a recomputing
            # producer, whose saved tensors the recomputation recreates) or a recompute_offload unit taking it as input
            con_ro = np.where(con_ok, b.ro[rows[:, :, None], np.maximum(con, 0)], False)
            owner = np.maximum(np.where(hold_sav, sav, -1).max(axis=2), np.where(con_ro, con, -1).max(axis=2))
            has_owner = owner >= 0
            owner = np.maximum(owner, 0)
            owner_sw = np.take_along_axis(sw, owner, axis=1)
            # only a plain recompute consumer keeps it on the device (its checkpoint holds its inputs)
            con_plain = con_rc & ~con_ro
            off = (self.g_eligible | self.g_ro_eligible)[None] & has_owner & owner_sw & ~con_plain.any(axis=2)
            r_unit = self.g_next[None] + np.take_along_axis(w, owner, axis=1)
            trig_g = np.take_along_axis(trig, owner, axis=1)
        else:
            owner_sw = sw[:, self.g_owner]
            off = self.g_eligible[None] & owner_sw & ~con_rc.any(axis=2)
            r_unit = self.g_next[None] + w[:, self.g_owner]
            trig_g = trig[:, self.g_owner]
        r_pos = np.where(r_unit < n, self.fwd_seg[np.minimum(r_unit, n - 1)], self.end)
        t_pos = self.bwd_seg[np.maximum(trig_g, 0)]
        return _Moves(plan_end=plan_end, off=off, r_pos=r_pos, t_pos=t_pos, owner=owner)

    def _segment_peaks(self, b: _Batch, m: _Moves, states: np.ndarray | None
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per plan: every segment's peak ``(B, S)``, the step's peak, and the state part's step peak, seconds and
        whether it moves anything."""
        S, G, n = self.S, self.G, self.n
        B = b.s.shape[0]
        sel, sel_j, units, off, plan_end = b.sel, b.sel_j, b.units, m.off, m.plan_end
        any_sel = bool(sel.any())
        nb = self.g_nb[None]
        # difference array over segment index
        flat = (np.arange(B) * (S + 2))[:, None]
        idx = np.concatenate([plan_end + 1, np.broadcast_to(self.g_base_end + 1, (B, G)), m.r_pos, m.t_pos], axis=1)
        val = np.concatenate([-nb * np.ones((B, 1)), nb * np.ones((B, 1)), -nb * off, nb * off], axis=1)
        if any_sel:  # what a selective unit's save-set keeps: held after its forward, through its backward
            held = np.where(sel, self.sel_held[units, sel_j], 0.0)
            idx = np.concatenate([idx, np.broadcast_to(self.fwd_seg + 1, (B, n)),
                                  np.broadcast_to(self.bwd_seg + 1, (B, n))], axis=1)
            val = np.concatenate([val, held, -held], axis=1)
        D = np.bincount((flat + np.clip(idx, 0, S + 1)).ravel(), weights=val.ravel(), minlength=B * (S + 2))
        delta = np.cumsum(D.reshape(B, S + 2), axis=1)[:, :S]
        unit_of = np.maximum(self.seg_unit, 0)
        seg_rc = (self.seg_unit >= 0)[None] & b.rc[:, unit_of]
        rel = np.where(seg_rc, self.rc_rel[None], self.rel[None])
        if any_sel:
            rel[:, self.fwd_seg] = np.where(sel, self.sel_fwd_rel[units, sel_j], rel[:, self.fwd_seg])
            rel[:, self.bwd_seg] = np.where(sel, self.sel_bwd_rel[units, sel_j], rel[:, self.bwd_seg])
        st_seg, st_step, st_time, st_moved = state_part(self, states, B)
        peaks = self.start_level[None] + delta + rel + st_seg
        lg = self.late_groups
        if lg.size:  # held past the segment the profiled run freed them in, partway (StorageGroup.late_bytes)
            late = np.where(plan_end[:, lg] > self.g_death[lg][None], self.g_late[lg][None], 0.0)
            np.add.at(peaks, (slice(None), self.g_death[lg]), late)
        peak = np.maximum(peaks.max(axis=1), st_step) if states is not None else peaks.max(axis=1)
        return peaks, peak, st_step, st_time, st_moved

    # ------------------------------------------------------------------ plans
    def encode(self, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A plan as the ``(1, n)`` arrays :meth:`evaluate` takes (after checking it fits the profile)."""
        plan.validate(self.profile)
        s = np.array([[code_of(x.strategy, x.save_set) for x in plan.decisions]])
        return s, np.array([plan.offload_windows]), np.array([plan.prefetch_distances])

    def _where(self, peaks: np.ndarray, step_peak: float, moved: bool) -> tuple[str, str]:
        """The phase and place of the peak: a segment, or the unit-by-unit step."""
        ss = self.step_segment
        seg_peaks = peaks.copy()
        if moved and ss >= 0:
            seg_peaks[ss] = -np.inf
        k = int(np.argmax(seg_peaks))
        if moved and step_peak >= seg_peaks[k]:
            return "optimizer step", "unit-by-unit step"
        if k == ss:
            return "optimizer step", self.profile.segments[k].label
        phase = ("forward" if k <= self.end else "after the step" if 0 <= ss < k else "backward")
        return phase, self.profile.segments[k].label

    def run(self, plan: Plan, budget: int | None = None) -> SimResult:
        s, w, d = self.encode(plan)
        states = np.array([plan.state_indices])
        det = self.evaluate(s, w, d, states=states, details=True)
        # the timeline, and what the backward brings back, come from the independent replay of the same step
        rep = replay(self.profile, plan, device=self.device)
        budget = budget if budget is not None else plan.budget_bytes
        peak = int(round(float(det["peak"][0])))
        stall = float(det["fwd_stall"][0] + det["bwd_stall"][0])
        moved = bool(det["moved"][0])
        phase, where = self._where(det["peaks"][0], float(det["step_peak"][0]), moved)
        if moved and phase == "optimizer step" and rep.step_points:
            where = max(rep.step_points, key=lambda r: r[1])[0]
        return SimResult(
            peak_bytes=peak, step_time=float(det["time"][0]), compute_time=float(det["compute"][0]),
            recompute_time=float(det["recompute"][0]), stall_time=stall, fwd_stall_time=float(det["fwd_stall"][0]),
            bwd_stall_time=float(det["bwd_stall"][0]), bytes_offloaded=int(det["offloaded"][0]),
            bytes_prefetched=rep.bytes_prefetched, budget_bytes=budget,
            feasible=None if budget is None else peak <= budget, device=self.device.name,
            segment_peaks=[int(round(x)) for x in det["peaks"][0]],
            timeline=self._timeline(rep),
            storages_offloaded=int(round(float(det["storages"][0]))), copy_time=float(det["copy"][0]),
            peak_phase=phase, peak_where=where, step_peak=int(round(float(det["step_peak"][0]))),
            state_time=float(det["state_time"][0]),
        )

    def _timeline(self, rep: Replay) -> list[dict[str, Any]]:
        """Start level and peak of every segment on the simulated clock, for plotting (from the reference replay)."""
        return [dict(row) for row in rep.rows]


def _compile_groups(sim: Simulator, groups: Sequence[Any]) -> None:
    """The storage groups a plan can move, as arrays on ``sim`` (``g_*``, ``G``, ``groups_at``, ``late_groups``): who
    produces, saves and consumes each, where its liveness ends, when it may leave the device."""
    def changes(g: Any) -> bool:  # groups no plan can move are left out
        if g.outside_saver:
            return g.outside_release is not None
        return bool(g.savers) or g.free_pos is not None or getattr(g, "release_pos", None) is not None

    gs = [g for g in groups if changes(g)]
    sim.g_list = gs  # the groups the arrays below describe, in their order
    sim.G = G = len(gs)
    ks = max([len(g.savers) for g in gs] + [1])
    kc = max([len(g.consumers) for g in gs] + [1])
    sim.g_nb = np.array([g.nbytes for g in gs], dtype=np.float64)
    sim.g_cnt = np.array([g.count for g in gs], dtype=np.float64)  # storages per group (per-copy cost)
    sim.g_prod = np.array([g.producer for g in gs], dtype=np.int64)
    sim.g_sav = np.full((G, ks), -1)
    sim.g_con = np.full((G, kc), -1)
    for i, g in enumerate(gs):
        sim.g_sav[i, : len(g.savers)] = g.savers
        sim.g_con[i, : len(g.consumers)] = g.consumers
    sim.g_has_sav = sim.g_sav[:, 0] >= 0
    sim.g_owner = np.where(sim.g_has_sav, sim.g_sav.max(axis=1), 0)
    sim.g_free = np.array([g.free_pos if g.free_pos is not None else -1 for g in gs], dtype=np.int64)
    g_release = np.array([r if (r := getattr(g, "release_pos", None)) is not None else -1 for g in gs],
                         dtype=np.int64)
    # liveness outside autograd: resident through segment free-1, or release-1 for what is let go of after the
    # forward (a model output, a KV cache), or the segment after the forward
    fallback = np.where(sim.g_free >= 0, sim.g_free - 1, np.where(g_release >= 0, g_release - 1, sim.end))
    bwd_of = lambda idx: np.where(idx >= 0, sim.bwd_seg[np.maximum(idx, 0)], -1)  # noqa: E731
    sim.g_sav_bwd = bwd_of(sim.g_sav)
    sim.g_con_bwd = bwd_of(sim.g_con)
    sim.g_fallback = fallback
    # code outside units that saves a storage lets go of it in this segment's backward (-1: no such code)
    sim.g_out_rel = np.array([g.outside_release if g.outside_saver else -1 for g in gs], dtype=np.int64)
    base = np.maximum(np.where(sim.g_has_sav, sim.g_sav_bwd.max(axis=1), -1), sim.g_out_rel)
    sim.g_base_end = np.maximum(base, fallback)
    outside = np.array([g.outside_saver for g in gs], dtype=bool)
    sim.g_eligible = sim.g_has_sav & (sim.g_free >= 0) & ~outside
    # what a recompute_offload consumer may offload too: its liveness ends in the forward, no code outside units
    # saves it
    sim.g_ro_eligible = (sim.g_free >= 0) & ~outside & (sim.g_con[:, 0] >= 0)
    sim.g_next = np.where(sim.g_free >= 0, sim.next_unit[np.maximum(sim.g_free, 0)], 0)
    sim.g_owner_onehot = np.zeros((G, sim.n))
    sim.g_owner_onehot[np.arange(G), sim.g_owner] = 1.0
    sim.groups_at = {b: np.nonzero((sim.g_eligible | sim.g_ro_eligible) & (sim.g_free == b))[0]
                      for b in set(sim.g_free.tolist()) if b >= 0}
    # freed partway through a segment whose peak came later: held past it, they add to that peak
    sim.g_late = np.array([getattr(g, "late_bytes", 0) for g in gs], dtype=np.float64)
    sim.g_death = np.array([d if (d := getattr(g, "death_seg", None)) is not None else -1 for g in gs],
                            dtype=np.int64)
    sim.late_groups = np.nonzero((sim.g_late > 0) & (sim.g_death >= 0))[0]


def _copy_queues(sim: Simulator, b: _Batch, m: _Moves, off_nb: np.ndarray, pf_bytes: np.ndarray, redo: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step walked segment by segment beside the two first-in-first-out copy queues: per plan the compute
    stream's end time and its forward and backward stalls."""
    S, n, dev, trig, d = sim.S, sim.n, sim.device, b.trig, b.d
    B = b.s.shape[0]
    t = np.zeros(B)
    d2h = np.zeros(B)
    h2d = np.zeros(B)
    wait_at = np.zeros((B, S + 2))
    pf_end = np.zeros((B, n))
    fwd_stall = np.zeros(B)
    bwd_stall = np.zeros(B)
    max_d = int(d.max()) if d.size else 0
    for k in range(S):
        groups = sim.groups_at.get(k)
        if groups is not None and groups.size:
            rg = m.r_pos[:, groups]
            bg = off_nb[:, groups]
            for r in np.unique(rg[bg > 0]):
                bytes_r = np.where(rg == r, bg, 0.0).sum(axis=1)
                has = bytes_r > 0
                d2h = np.where(has, np.maximum(d2h, t) + dev.copy_seconds(bytes_r, 0, "d2h"), d2h)
                wait_at[:, r] = np.where(has, np.maximum(wait_at[:, r], d2h), wait_at[:, r])
        if sim.next_unit[k] >= 0:
            nt = np.maximum(t, wait_at[:, k])
            fwd_stall += nt - t
            t = nt
        if sim.kind[k] == 1:
            u = int(sim.seg_unit[k])
            ready = t
            for o in range(u, max(-1, u - max_d - 1), -1):
                mo = (trig[:, o] == u) & (pf_bytes[:, o] > 0)
                if mo.any():
                    h2d = np.where(mo, np.maximum(h2d, ready) + dev.copy_seconds(pf_bytes[:, o], 0, "h2d"), h2d)
                    pf_end[:, o] = np.where(mo, h2d, pf_end[:, o])
            nt = np.where(pf_bytes[:, u] > 0, np.maximum(t, pf_end[:, u]), t)
            bwd_stall += nt - t
            t = nt
            t = t + sim.dur[k] + redo[:, u]
        else:
            t = t + sim.dur[k]
    return t, fwd_stall, bwd_stall


def simulate_reference(sim: Simulator | Any, strategies: Sequence[Any], windows: Sequence[int],
                       distances: Sequence[int], device: DeviceSpec | str | None = None) -> dict[str, Any]:
    """One plan through the independent reference (:func:`memopt_nb.sim.replay.replay`), as a dict.

    ``sim`` is a :class:`Simulator` (its profile and device are used; nothing it compiled) or a ModelProfile.
    Keys: ``peak``, ``time``, ``peaks``, ``levels``, ``fwd_stall``, ``bwd_stall``, ``offloaded``, ``prefetched``,
    ``rows`` (the timeline) and ``copies`` (the copy jobs).
    """
    if isinstance(sim, Simulator):
        profile, device = sim.profile, (device if device is not None else sim.device)
    else:
        profile = sim
    rep = replay(profile, list(strategies), list(windows), list(distances), device=device)
    return {"peak": rep.peak_bytes, "time": rep.step_time, "peaks": rep.segment_peaks, "levels": rep.segment_levels,
            "fwd_stall": rep.fwd_stall_time, "bwd_stall": rep.bwd_stall_time, "offloaded": rep.bytes_offloaded,
            "prefetched": rep.bytes_prefetched, "rows": rep.rows, "copies": rep.copies}


def simulate(profile: ProfileLike, plan: Plan, device: DeviceSpec | str | None = None,
             budget: int | None = None) -> SimResult:
    """Predict peak memory, step time and a timeline of one training step of ``profile`` under ``plan``.

    The plan's per-unit placements of optimizer state, gradients and parameters count (``SimResult.peak_phase`` says
    whether the peak is in the forward, the backward or the optimizer step).

    ``device`` is the device to predict for (default: the profiled one); a preset name such as ``"a100-40gb"`` rescales
    compute times by the FLOP/s ratio (see :class:`~memopt_nb.core.device.DeviceSpec`). ``budget`` defaults to the
    plan's.
    """
    return Simulator(profile_for(profile, plan), device).run(plan, budget)
