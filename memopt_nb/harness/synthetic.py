"""Synthetic profiles of chain-like models, for planner tests and benchmarks at sizes no CPU zoo model reaches.

A synthetic chain has ``n`` units with random forward times (backward ≈ 2×), internal saved bytes and boundary
tensors; optionally some boundaries are also saved by the unit that produced them (as a ReLU saves its output). The
memory levels are computed from the same storage groups the simulator uses, so the profile is self-consistent.

``state_bytes > 0`` gives every unit parameters (random sizes around ``state_bytes``), gradients of the same size and
Adam-like optimizer state (2x), so that whole-step plans (placements of optimizer state, gradients and parameters) have
something to move: the levels then include the units' parameters and state throughout and each unit's gradients from
its backward on, and the last segment is the optimizer step. The default (0) gives the activation-only chains as
before (the same random draws, the same profile).

:func:`with_save_sets` adds synthetic save-sets (what ``profile(..., selective=True)`` measures) to any profile, so that
the planners' ``selective`` strategy can be tested and benchmarked at any size.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..core.device import DeviceSpec
from ..core.plan import SAVE_SETS
from ..core.profile import ModelProfile, Segment, StorageGroup, UnitProfile

__all__ = ["chain_profile", "with_save_sets", "SAVE_SET_SHARES"]

MiB = 2**20
#: What each synthetic save-set keeps (share of the unit's interior saved bytes) and leaves to recompute (share of its
#: forward time), each drawn within ±20 % per unit.
SAVE_SET_SHARES = {"matmuls": (0.45, 0.35), "alternate": (0.25, 0.6), "attention": (0.1, 0.85)}


def chain_profile(n: int, seed: int = 0, *, shared_boundaries: float = 0.3, device: DeviceSpec | None = None,
                  static_bytes: int = 64 * MiB, spread: float = 1.0, state_bytes: int = 0) -> ModelProfile:
    """A random ``n``-unit chain profile; ``spread`` scales how much units differ from each other; ``state_bytes``
    (mean parameter bytes per unit, 0: none) gives units parameters, gradients and optimizer state.

    It fills a profile field by field, as the profiler would (the segments' layout and the units in helpers).
    """
    rng = np.random.default_rng(seed)
    dev = device or DeviceSpec(name="synthetic-gpu", kind="preset", capacity_bytes=16 * 2**30,
                               h2d_bytes_per_s=12e9, d2h_bytes_per_s=12e9, compute_flops=10e12,
                               note="synthetic device for planner tests")
    var = lambda size: np.exp(rng.normal(0.0, 0.5 * spread, size))  # noqa: E731
    fwd = 2e-3 * var(n)
    bwd = fwd * (1.6 + 0.8 * rng.random(n))
    interior = (24 * MiB * var(n)).astype(np.int64)
    boundary = (4 * MiB * var(n + 1)).astype(np.int64)
    shared = rng.random(n) < shared_boundaries
    transient_f = (interior * (0.2 + 0.3 * rng.random(n))).astype(np.int64)
    transient_b = (interior * (0.3 + 0.3 * rng.random(n))).astype(np.int64)
    kinds, units, labels, times, fwd_seg, bwd_seg = _chain_layout(n, fwd, bwd)
    S = len(kinds)
    groups: list[StorageGroup] = []
    for u in range(n):
        groups.append(StorageGroup(nbytes=int(interior[u]), count=8, producer=u, savers=(u,), consumers=(),
                                   outside_saver=False, free_pos=fwd_seg[u] + 1))
        # the unit's input (the previous unit's output, or the embedding for unit 0)
        prod = u - 1
        savers = (u - 1, u) if (u > 0 and shared[u - 1]) else (u,)
        groups.append(StorageGroup(nbytes=int(boundary[u]), count=1, producer=prod, savers=savers, consumers=(u,),
                                   outside_saver=False, free_pos=fwd_seg[u] + 2 if u + 1 < n else None))
    # baseline level at each segment start, from group residency (kept: resident from birth to its last backward)
    level = np.full(S, float(static_bytes))
    for g in groups:
        birth = fwd_seg[g.producer] if g.producer >= 0 else 0
        end = max(bwd_seg[s] for s in g.savers)
        level[birth + 1: end + 1] += g.nbytes
    step_seg = -1
    pb = np.zeros(n, dtype=np.int64)
    step_t = np.zeros(n)
    if state_bytes > 0:  # drawn after everything above, so that state_bytes=0 keeps the old profiles
        pb = (state_bytes * var(n)).astype(np.int64) // 4 * 4
        step_t = pb * 4.0 / 200e9 + 2e-5  # an Adam step reads and writes about 4x the parameters
        level += int((pb + 2 * pb).sum())  # parameters and optimizer state, resident all step
        for u in range(n):
            level[bwd_seg[u] + 1:] += int(pb[u])  # its gradients, from its backward to the step
        step_seg = S - 1
        times[step_seg] = float(step_t.sum()) + 1e-4
    seg_list = []
    for k in range(S):
        u = units[k]
        if kinds[k] == "fwd":
            rel = float(transient_f[u] + interior[u])
        elif kinds[k] == "bwd":
            rel = float(transient_b[u])
        elif k == step_seg:
            rel = float(pb.max() // 2)  # the step's intermediates, one tensor at a time
        else:
            rel = 0.0
        seg_list.append(Segment(kinds[k], u, labels[k], float(times[k]), int(level[k]), int(rel)))
    unit_list = _chain_units(n, dev, fwd, bwd, interior, boundary, transient_f, transient_b, pb, step_t, fwd_seg,
                             bwd_seg)
    peak = int(max(s.start_level + s.rel_peak for s in seg_list))
    return ModelProfile(
        units=unit_list, segments=seg_list, groups=groups, device=dev, peak_bytes=peak, step_time=float(sum(times)),
        start_level=int(level[0]), param_bytes=static_bytes // 4 + int(pb.sum()),
        grad_bytes=static_bytes // 4 + int(pb.sum()), optimizer_state_bytes=static_bytes // 2 + int(2 * pb.sum()),
        buffer_bytes=0, input_bytes=0, unattributed_bytes=0, batch_size=None,
        fingerprint=tuple({"name": f"blocks.{u}", "type": "SyntheticBlock", "param_shapes": []} for u in range(n)),
        meta={"model_class": f"SyntheticChain{n}", "synthetic_seed": seed}, step_segment=step_seg,
        outside_step_time=1e-4 if state_bytes > 0 else 0.0,
    )


def _chain_layout(n: int, fwd: np.ndarray, bwd: np.ndarray
                  ) -> tuple[list[str], list[int], list[str], list[float], dict[int, int], dict[int, int]]:
    """The chain's segments (kinds, units, labels, seconds) and each unit's forward and backward segment."""
    # segment layout: pre, then (fwd u, gap) per unit, head, loss, then bwd per unit (descending), tail
    kinds, units, labels, times = ["other"], [-1], ["to fwd_start 0"], [1e-4]
    fwd_seg, bwd_seg = {}, {}
    for u in range(n):
        fwd_seg[u] = len(kinds)
        kinds += ["fwd", "other"]
        units += [u, -1]
        labels += [f"fwd {u}", f"to fwd_start {u + 1}" if u + 1 < n else "to forward_end"]
        times += [float(fwd[u]), 0.0]
    head = len(kinds) - 1
    times[head] = 3e-4
    kinds += ["other", "other"]
    units += [-1, -1]
    labels += ["to loss_end", f"to bwd_start {n - 1}"]
    times += [5e-5, 5e-4]
    for u in range(n - 1, -1, -1):
        bwd_seg[u] = len(kinds)
        kinds.append("bwd")
        units.append(u)
        labels.append(f"bwd {u}")
        times.append(float(bwd[u]))
    kinds.append("other")
    units.append(-1)
    labels.append("to step_end")
    times.append(1e-3)
    return kinds, units, labels, times, fwd_seg, bwd_seg


def _chain_units(n: int, dev: DeviceSpec, fwd: np.ndarray, bwd: np.ndarray, interior: np.ndarray, boundary: np.ndarray,
                 transient_f: np.ndarray, transient_b: np.ndarray, pb: np.ndarray, step_t: np.ndarray,
                 fwd_seg: dict[int, int], bwd_seg: dict[int, int]) -> list[UnitProfile]:
    """The chain's units, from the drawn sizes and times."""
    unit_list = []
    for u in range(n):
        unit_list.append(UnitProfile(
            name=f"blocks.{u}", index=u, type="SyntheticBlock", fwd_time=float(fwd[u]), bwd_time=float(bwd[u]),
            saved_bytes=int(interior[u] + boundary[u]), interior_bytes=int(interior[u]),
            input_bytes=int(boundary[u]), output_bytes=int(boundary[u + 1]), param_bytes=0, has_rng=False,
            has_running_stats=False, recomputable=True, swappable=dev.has_host_link, fwd_segment=fwd_seg[u],
            bwd_segment=bwd_seg[u], rc_fwd_rel_peak=int(transient_f[u]),
            rc_bwd_rel_peak=int(interior[u] + transient_b[u] + transient_f[u]),
            grad_bytes=int(pb[u]), optimizer_bytes=int(2 * pb[u]), param_storages=2 if pb[u] else 0,
            grad_storages=2 if pb[u] else 0, optimizer_storages=4 if pb[u] else 0, step_time=float(step_t[u]),
            step_rel_peak=int(pb[u] // 2), params_offloadable=bool(pb[u]), param_steps=_param_steps(int(pb[u]))))
        unit_list[-1].param_bytes = int(pb[u])
    return unit_list


def with_save_sets(prof: ModelProfile, seed: int = 0, offered: float = 0.8, pareto: float = 0.8) -> ModelProfile:
    """``prof`` with synthetic save-sets on its recomputable units: each unit offers each set of
    :data:`~memopt_nb.core.plan.SAVE_SETS` with probability ``offered`` (so some units offer none), each Pareto (a
    planner's option) with probability ``pareto``. A set holds a share of the unit's interior saved bytes and
    recomputes in a
    share of its forward time (:data:`SAVE_SET_SHARES`), so that selective is sometimes the best choice."""
    rng = np.random.default_rng(seed)
    units = []
    for u in prof.units:
        sets = {}
        if u.recomputable:
            fwd_time = prof.segments[u.fwd_segment].time
            kept_fwd = prof.segments[u.fwd_segment].rel_peak
            for name in SAVE_SETS:
                if rng.random() >= offered:
                    continue
                held_share, time_share = SAVE_SET_SHARES[name]
                held = int(u.interior_bytes * held_share * (0.8 + 0.4 * rng.random()))
                sets[name] = {
                    "ops": [["aten.mm.default", 0], ["aten.mm.default", 2]] if name != "attention"
                    else [["aten._scaled_dot_product_flash_attention.default", 0]],
                    "held_bytes": held,
                    "recompute_time": float(fwd_time * time_share * (0.8 + 0.4 * rng.random())),
                    "fwd_rel_peak": int(max(u.rc_fwd_rel_peak, min(kept_fwd, u.rc_fwd_rel_peak + held))),
                    "bwd_rel_peak": int(max(0, u.rc_bwd_rel_peak - held // 2)),
                    "pareto": bool(rng.random() < pareto),
                }
        units.append(dataclasses.replace(u, save_sets=sets))
    return dataclasses.replace(prof, units=units)


def _param_steps(nbytes: int) -> list[dict[str, float]]:
    """A unit's two parameters (a weight of 3/4 of its bytes and a bias) stepped one at a time, Adam-like: twice the
    parameter in state, a quarter more time per byte than the unit's step (``UnitProfile.param_steps``)."""
    if not nbytes:
        return []
    weight = 3 * nbytes // 4
    return [{"optimizer_bytes": 2 * b, "optimizer_storages": 2, "grad_bytes": b, "step_time": b * 5.0 / 200e9 + 2e-5,
             "step_rel_peak": b // 2} for b in (weight, nbytes - weight)]
