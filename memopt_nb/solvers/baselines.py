"""The classic heuristics, each ``name(profile, budget, device=None) -> Plan`` with ``plan.method == name``.

* ``none`` — keep everything (plain training).
* ``recompute_all`` — checkpoint every unit.
* ``sqrt_n`` — Chen et al. (2016) √n checkpointing, at unit granularity: units are split into ⌈√n⌉ contiguous
  segments; the last unit of each segment is kept, the others recomputed. It ignores the budget.
* ``swap_all`` — offload every unit and bring it back on demand, synchronously both ways: what
  ``torch.autograd.graph.save_on_cpu`` does (offload window 0, prefetch distance 0).
* ``capuchin`` — a Capuchin-style greedy (Peng et al., ASPLOS 2020): until the budget holds, first swap the units whose
  copies the surrounding compute hides (largest first, with the shortest timing that hides them), then recompute in
  order of memory saved per second of recompute.

A plan that misses its budget is returned with ``feasible=False`` — never silently presented as fitting.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..device import DeviceSpec
from ..plan import DISTANCES, WINDOWS, Plan
from ..simulate import KEEP, RECOMPUTE, SWAP
from .common import as_simulator, check_budget, make_plan, uniform_arrays


def none(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Plain training: keep every unit."""
    sim = as_simulator(profile, device)
    b = check_budget(sim, budget)
    return make_plan(sim, *uniform_arrays(sim, KEEP), budget=b, method="none")


def recompute_all(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Activation checkpointing of every unit."""
    sim = as_simulator(profile, device)
    b = check_budget(sim, budget)
    return make_plan(sim, *uniform_arrays(sim, RECOMPUTE), budget=b, method="recompute_all")


def sqrt_n(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Chen et al. √n rule over units (keeps every ⌈n/⌈√n⌉⌉-th unit, recomputes the rest)."""
    sim = as_simulator(profile, device)
    b = check_budget(sim, budget)
    n = sim.n
    segments = max(1, math.ceil(math.sqrt(n)))
    size = math.ceil(n / segments)
    codes = [KEEP if (u + 1) % size == 0 or u == n - 1 else RECOMPUTE for u in range(n)]
    codes = [c if (c != RECOMPUTE or sim.recomputable[u]) else KEEP for u, c in enumerate(codes)]
    return make_plan(sim, codes, [1] * n, [1] * n, budget=b, method="sqrt_n")


def swap_all(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Offload every unit, reload on demand (like ``save_on_cpu``)."""
    sim = as_simulator(profile, device)
    b = check_budget(sim, budget)
    return make_plan(sim, *uniform_arrays(sim, SWAP, window=0, distance=0), budget=b, method="swap_all")


def capuchin(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Capuchin-style greedy: hidden swaps first, then recompute by memory saved per second."""
    sim = as_simulator(profile, device)
    b = check_budget(sim, budget)
    n = sim.n
    prof = sim.profile
    codes, windows, dists = [KEEP] * n, [1] * n, [1] * n

    def peak_of(c: list[int], w: list[int], d: list[int]) -> float:
        return float(sim.evaluate(np.array([c]), np.array([w]), np.array([d]))[0][0])

    swap_bytes = np.array([u.interior_bytes + u.input_bytes for u in prof.units], dtype=float)
    fwd = np.array([sim.dur[s] for s in sim.fwd_seg])
    bwd = np.array([sim.dur[s] for s in sim.bwd_seg])
    order = np.argsort(-swap_bytes, kind="stable")
    if peak_of(codes, windows, dists) > b and sim.device.has_host_link:
        for u in order:
            if not sim.swappable[u]:
                continue
            if not sim.device.copy_overlap:
                continue  # copies cost compute time on this device: never hidden
            # what the copy engine spends on the unit's bytes, the slower way (DeviceSpec.copy_seconds); the
            # per-storage part is the training thread's and is never hidden, so it plays no part in choosing a timing
            copy = max(sim.device.copy_seconds(swap_bytes[u], 0, d) for d in ("d2h", "h2d"))
            hidden = None
            for w in WINDOWS[1:]:
                if fwd[u + 1: u + 1 + w].sum() >= copy:
                    for d in DISTANCES[1:]:
                        if bwd[u + 1: u + 1 + d].sum() >= copy:
                            hidden = (w, d)
                            break
                if hidden:
                    break
            if hidden is None:
                continue
            codes[u], windows[u], dists[u] = SWAP, hidden[0], hidden[1]
            if peak_of(codes, windows, dists) <= b:
                break
    if peak_of(codes, windows, dists) > b:
        interior = np.array([u.interior_bytes for u in prof.units], dtype=float)
        msps = interior / np.maximum(fwd, 1e-9)
        for u in np.argsort(-msps, kind="stable"):
            if codes[u] != KEEP or not sim.recomputable[u]:
                continue
            codes[u] = RECOMPUTE
            if peak_of(codes, windows, dists) <= b:
                break
    return make_plan(sim, codes, windows, dists, budget=b, method="capuchin")


BASELINES = {"none": none, "recompute_all": recompute_all, "sqrt_n": sqrt_n, "swap_all": swap_all,
             "capuchin": capuchin}
