"""``memopt.simulate``: a cost model of one training step under a plan — peak memory, step time and a timeline.

The step is the profiled sequence of *segments* (each unit's forward and backward and the code between them) on a
compute stream, plus two copy engines (device→host, host→device), each first-in-first-out at the device's bandwidth.

**Memory** is the profiled level at the start of each segment (every unit kept) corrected by what the plan changes for
every storage group (see :class:`~memopt_nb.profile.StorageGroup`), plus the segment's own peak above its start
(measured with the unit kept, or with the unit recomputed). For a group saved by units:

* it stays until the backward of the last holder in time: a unit that saves it (unless that unit is its producer and
  recomputes it — then the recomputation recreates it), or a recomputed unit that takes it as input (checkpointing
  keeps inputs);
* if its owner (the last unit to save it) swaps and no recomputed unit holds it, it becomes eligible at the boundary
  where nothing else refers to it; the copy to host starts there, its memory is gone from the boundary before unit
  ``j + w`` (``j`` the next unit to run, ``w`` the owner's window; or the end of the forward) until the backward of the
  owner's trigger unit, where the copy back allocates it again.

These rules are exactly what the runtime does, so memory is predicted from structure, not from timing.

**Time**: segment durations (scaled to the target device, see :meth:`DeviceSpec.time_factor`), plus a recomputed
unit's forward in its backward, plus the copies, priced by :meth:`DeviceSpec.copy_seconds` (bytes over the link plus
``copy_overhead_s`` per storage, each direction):

* with ``copy_overlap`` (GPU copy engines; the CPU when the copy threads have a spare core) the bytes term runs on two
  first-in-first-out copy queues beside compute and costs only stalls: the forward waits at a release point for its
  copies to finish, and a unit's backward waits for its prefetch (offloads queue in issue order, prefetches in the order
  backward needs them); the per-storage term, spent by the training thread, is added to the step;
* without it (the CPU when compute uses every core) the whole round trip of every offloaded storage group,
  ``copy_seconds(bytes, storages, "both")``, is added to the step.

The same model is written a second time, plainly and from the profile alone, in :mod:`memopt_nb.reference_sim`; the
tests hold this compiled one to it. :meth:`Simulator.run` takes its timeline and ``bytes_prefetched`` from that replay.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .budget import format_bytes
from .device import DeviceSpec
from .errors import PlanError
from .plan import Plan
from .reference_sim import Replay, replay

KEEP, RECOMPUTE, SWAP = 0, 1, 2
CODES = {"keep": KEEP, "recompute": RECOMPUTE, "swap": SWAP}
NAMES = {v: k for k, v in CODES.items()}


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

    def __repr__(self) -> str:
        fit = "" if self.feasible is None else (" fits" if self.feasible else " OVER BUDGET")
        return (f"SimResult(peak {format_bytes(self.peak_bytes)}, step {self.step_time * 1e3:.2f} ms, "
                f"stall {self.stall_time * 1e3:.2f} ms, recompute {self.recompute_time * 1e3:.2f} ms{fit})")

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


class Simulator:
    """A profile compiled for fast, vectorized plan evaluation (the planners' inner loop).

    ``Simulator(profile, device).evaluate(strategies, windows, distances)`` takes ``(B, n)`` integer arrays (strategy
    codes 0 keep, 1 recompute, 2 swap) and returns peak bytes and step seconds, each shape ``(B,)``.
    """

    def __init__(self, profile: Any, device: DeviceSpec | str | None = None) -> None:
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
        self.swappable = np.array([u.swappable for u in profile.units]) & self.device.has_host_link
        self.recomputable = np.array([u.recomputable for u in profile.units])
        self.bw_d2h = self.device.d2h_bytes_per_s or 1.0
        self.bw_h2d = self.device.h2d_bytes_per_s or 1.0
        self._compile_groups(profile.groups)

    def _compile_groups(self, groups: Sequence[Any]) -> None:
        def changes(g: Any) -> bool:  # groups no plan can move are left out
            if g.outside_saver:
                return g.outside_release is not None
            return bool(g.savers) or g.free_pos is not None

        gs = [g for g in groups if changes(g)]
        self.G = G = len(gs)
        ks = max([len(g.savers) for g in gs] + [1])
        kc = max([len(g.consumers) for g in gs] + [1])
        self.g_nb = np.array([g.nbytes for g in gs], dtype=np.float64)
        self.g_cnt = np.array([g.count for g in gs], dtype=np.float64)  # storages per group (per-copy cost)
        self.g_prod = np.array([g.producer for g in gs], dtype=np.int64)
        self.g_sav = np.full((G, ks), -1)
        self.g_con = np.full((G, kc), -1)
        for i, g in enumerate(gs):
            self.g_sav[i, : len(g.savers)] = g.savers
            self.g_con[i, : len(g.consumers)] = g.consumers
        self.g_has_sav = self.g_sav[:, 0] >= 0
        self.g_owner = np.where(self.g_has_sav, self.g_sav.max(axis=1), 0)
        self.g_free = np.array([g.free_pos if g.free_pos is not None else -1 for g in gs], dtype=np.int64)
        # forward liveness end when nothing else holds it: resident through segment free-1 (or the one after the end)
        fallback = np.where(self.g_free >= 0, self.g_free - 1, self.end)
        bwd_of = lambda idx: np.where(idx >= 0, self.bwd_seg[np.maximum(idx, 0)], -1)  # noqa: E731
        self.g_sav_bwd = bwd_of(self.g_sav)
        self.g_con_bwd = bwd_of(self.g_con)
        self.g_fallback = fallback
        # code outside units that saves a storage lets go of it in this segment's backward (-1: no such code)
        self.g_out_rel = np.array([g.outside_release if g.outside_saver else -1 for g in gs], dtype=np.int64)
        base = np.maximum(np.where(self.g_has_sav, self.g_sav_bwd.max(axis=1), -1), self.g_out_rel)
        self.g_base_end = np.where(base >= 0, base, fallback)
        outside = np.array([g.outside_saver for g in gs], dtype=bool)
        self.g_eligible = self.g_has_sav & (self.g_free >= 0) & ~outside
        self.g_next = np.where(self.g_free >= 0, self.next_unit[np.maximum(self.g_free, 0)], 0)
        self.g_owner_onehot = np.zeros((G, self.n))
        self.g_owner_onehot[np.arange(G), self.g_owner] = 1.0
        self.groups_at = {b: np.nonzero(self.g_eligible & (self.g_free == b))[0] for b in set(self.g_free.tolist())
                          if b >= 0}

    # ------------------------------------------------------------------ batched evaluation
    def evaluate(self, strategies: np.ndarray, windows: np.ndarray, distances: np.ndarray,
                 details: bool = False) -> tuple[np.ndarray, np.ndarray] | dict[str, np.ndarray]:
        """Peak bytes and step seconds for a batch of plans (arrays of shape ``(B, n)``)."""
        s = np.atleast_2d(np.asarray(strategies, dtype=np.int64))
        w = np.atleast_2d(np.asarray(windows, dtype=np.int64))
        d = np.atleast_2d(np.asarray(distances, dtype=np.int64))
        B, n, S, G = s.shape[0], self.n, self.S, self.G
        if s.shape[1] != n or w.shape != s.shape or d.shape != s.shape:
            raise PlanError(f"expected (B, {n}) arrays of strategies, windows and distances, got {s.shape}, "
                            f"{w.shape}, {d.shape}")
        rc = s == RECOMPUTE
        sw = s == SWAP
        rows = np.arange(B)[:, None]
        # effective prefetch triggers (descending scan)
        trig = np.full((B, n), -1)
        later = np.full(B, n - 1)
        for u in range(n - 1, -1, -1):
            t = np.minimum(np.minimum(u + d[:, u], n - 1), later)
            trig[:, u] = np.where(sw[:, u], t, -1)
            later = np.where(sw[:, u], t, later)
        # ---- storage groups
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
        plan_end = np.where(plan_end >= 0, plan_end, self.g_fallback[None])
        owner_sw = sw[:, self.g_owner]
        off = self.g_eligible[None] & owner_sw & ~con_rc.any(axis=2)
        r_unit = self.g_next[None] + w[:, self.g_owner]
        r_pos = np.where(r_unit < n, self.fwd_seg[np.minimum(r_unit, n - 1)], self.end)
        trig_g = trig[:, self.g_owner]
        t_pos = self.bwd_seg[np.maximum(trig_g, 0)]
        nb = self.g_nb[None]
        # difference array over segment index
        flat = (np.arange(B) * (S + 2))[:, None]
        idx = np.concatenate([plan_end + 1, np.broadcast_to(self.g_base_end + 1, (B, G)), r_pos, t_pos], axis=1)
        val = np.concatenate([-nb * np.ones((B, 1)), nb * np.ones((B, 1)), -nb * off, nb * off], axis=1)
        D = np.bincount((flat + np.clip(idx, 0, S + 1)).ravel(), weights=val.ravel(), minlength=B * (S + 2))
        delta = np.cumsum(D.reshape(B, S + 2), axis=1)[:, :S]
        unit_of = np.maximum(self.seg_unit, 0)
        seg_rc = (self.seg_unit >= 0)[None] & rc[:, unit_of]
        rel = np.where(seg_rc, self.rc_rel[None], self.rel[None])
        peaks = self.start_level[None] + delta + rel
        peak = peaks.max(axis=1)
        # ---- time
        off_nb = nb * off
        off_count = (self.g_cnt[None] * off).sum(axis=1)  # storages offloaded (and brought back)
        pf_bytes = off_nb @ self.g_owner_onehot  # (B, n) bytes each owner brings back
        recompute = (rc * self.fwd_time[None]).sum(axis=1)
        dev = self.device
        copy_time = dev.copy_seconds(off_nb.sum(axis=1), off_count, "both")
        if not dev.copy_overlap:
            # copies share the compute cores (CPU device, no spare core): their time adds to the step, nothing overlaps
            t = self.dur.sum() + recompute + copy_time
            if not details:
                return peak, t
            zero = np.zeros(B)
            return {"peak": peak, "time": t, "peaks": peaks, "fwd_stall": zero, "bwd_stall": zero,
                    "offloaded": off_nb.sum(axis=1), "recompute": recompute, "copy": copy_time,
                    "compute": self.dur.sum() + recompute + copy_time, "trig": trig, "off": off, "r_pos": r_pos,
                    "t_pos": t_pos, "storages": off_count}
        # the training thread's per-storage share of the copies; the bytes run on the copy queues below
        thread_copy = dev.copy_seconds(0.0, off_count, "both")
        t = np.zeros(B)
        d2h = np.zeros(B)
        h2d = np.zeros(B)
        wait_at = np.zeros((B, S + 2))
        pf_end = np.zeros((B, n))
        fwd_stall = np.zeros(B)
        bwd_stall = np.zeros(B)
        max_d = int(d.max()) if d.size else 0
        for k in range(S):
            groups = self.groups_at.get(k)
            if groups is not None and groups.size:
                rg = r_pos[:, groups]
                bg = off_nb[:, groups]
                for r in np.unique(rg[bg > 0]):
                    bytes_r = np.where(rg == r, bg, 0.0).sum(axis=1)
                    has = bytes_r > 0
                    d2h = np.where(has, np.maximum(d2h, t) + dev.copy_seconds(bytes_r, 0, "d2h"), d2h)
                    wait_at[:, r] = np.where(has, np.maximum(wait_at[:, r], d2h), wait_at[:, r])
            if self.next_unit[k] >= 0:
                nt = np.maximum(t, wait_at[:, k])
                fwd_stall += nt - t
                t = nt
            if self.kind[k] == 1:
                u = int(self.seg_unit[k])
                ready = t
                for o in range(u, max(-1, u - max_d - 1), -1):
                    m = (trig[:, o] == u) & (pf_bytes[:, o] > 0)
                    if m.any():
                        h2d = np.where(m, np.maximum(h2d, ready) + dev.copy_seconds(pf_bytes[:, o], 0, "h2d"), h2d)
                        pf_end[:, o] = np.where(m, h2d, pf_end[:, o])
                nt = np.where(pf_bytes[:, u] > 0, np.maximum(t, pf_end[:, u]), t)
                bwd_stall += nt - t
                t = nt
                t = t + self.dur[k] + np.where(rc[:, u], self.fwd_time[u], 0.0)
            else:
                t = t + self.dur[k]
        t = t + thread_copy
        if not details:
            return peak, t
        return {"peak": peak, "time": t, "peaks": peaks, "fwd_stall": fwd_stall, "bwd_stall": bwd_stall,
                "offloaded": off_nb.sum(axis=1), "recompute": recompute, "copy": copy_time,
                "compute": np.full(B, self.dur.sum()) + recompute + thread_copy, "trig": trig, "off": off,
                "r_pos": r_pos, "t_pos": t_pos, "storages": off_count}

    # ------------------------------------------------------------------ plans
    def encode(self, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A plan as the ``(1, n)`` arrays :meth:`evaluate` takes (after checking it fits the profile)."""
        plan.validate(self.profile)
        s = np.array([[CODES[x] for x in plan.strategies]])
        return s, np.array([plan.offload_windows]), np.array([plan.prefetch_distances])

    def run(self, plan: Plan, budget: int | None = None) -> SimResult:
        s, w, d = self.encode(plan)
        det = self.evaluate(s, w, d, details=True)
        # the timeline, and what the backward brings back, come from the independent replay of the same step
        rep = replay(self.profile, plan, device=self.device)
        budget = budget if budget is not None else plan.budget_bytes
        peak = int(round(float(det["peak"][0])))
        stall = float(det["fwd_stall"][0] + det["bwd_stall"][0])
        return SimResult(
            peak_bytes=peak, step_time=float(det["time"][0]), compute_time=float(det["compute"][0]),
            recompute_time=float(det["recompute"][0]), stall_time=stall, fwd_stall_time=float(det["fwd_stall"][0]),
            bwd_stall_time=float(det["bwd_stall"][0]), bytes_offloaded=int(det["offloaded"][0]),
            bytes_prefetched=rep.bytes_prefetched, budget_bytes=budget,
            feasible=None if budget is None else peak <= budget, device=self.device.name,
            segment_peaks=[int(round(x)) for x in det["peaks"][0]],
            timeline=self._timeline(rep),
            storages_offloaded=int(round(float(det["storages"][0]))), copy_time=float(det["copy"][0]),
        )

    def _timeline(self, rep: Replay) -> list[dict[str, Any]]:
        """Start level and peak of every segment on the simulated clock, for plotting (from the reference replay)."""
        return [dict(row) for row in rep.rows]


def simulate_reference(sim: Simulator | Any, strategies: Sequence[Any], windows: Sequence[int],
                       distances: Sequence[int], device: DeviceSpec | str | None = None) -> dict[str, Any]:
    """One plan through the independent reference (:func:`memopt_nb.reference_sim.replay`), as a dict.

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


def simulate(profile: Any, plan: Plan, device: DeviceSpec | str | None = None,
             budget: int | None = None) -> SimResult:
    """Predict peak memory, step time and a timeline of one training step of ``profile`` under ``plan``.

    ``device`` is the device to predict for (default: the profiled one); a preset name such as ``"a100-40gb"`` rescales
    compute times by the FLOP/s ratio (see :class:`~memopt_nb.device.DeviceSpec`). ``budget`` defaults to the plan's.
    """
    return Simulator(profile, device).run(plan, budget)
