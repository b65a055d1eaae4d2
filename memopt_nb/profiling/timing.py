"""Per-unit times that hold on a busy machine: the profile's clock, checked repeats, robust estimates, identical
units pooled.

A shared machine (a server with other work, a laptop with a browser open) only ever slows a measurement down, and
unevenly: a unit's forward waits while another program has the core, or stalls for many times its cost when a
parallel region waits for a thread that is not running; the next repeat runs at full speed. A plain median of a few
wall-clock repeats follows that noise, and a planner comparing units would follow it too. So the profile:

* **times with the CPU time of the step's thread on the CPU** (:class:`~memopt_nb.profiling.tracer._Clock`): what a
  stretch of the step costs while it has a core. Time the thread waits for a core is not in it, so the times hold
  while other programs run; the wall time is recorded beside it (``meta["timing"]["wall_over_cpu"]``). On a quiet
  machine the two agree. On CUDA: the device's events, as before.
* **checks its repeats**: a short fixed reference operation (a few small matrix products on the model's device,
  timed with the same clock) runs before every timed step and after the last. A step next to which the reference
  took more than :data:`REFERENCE_LIMIT` times its fastest run is set aside and measured again, at most ``repeats``
  more steps in all (a busy machine costs at most twice the timed steps).
* **estimates robustly**: each time (a segment of the step, or a pool of them) is the median of its samples after
  setting aside those more than :data:`OUTLIER` times the samples' lower quartile (a stall, not the unit's cost).
* **pools identical units**: units with the same :func:`unit_signature` (module class and structure, parameter and
  buffer shapes and dtypes, input and output shapes) do the same work, so their samples are pooled and each gets the
  pooled estimate: a transformer's blocks get one forward and one backward time from ``repeats`` times as many
  samples. Their unit-by-unit optimizer steps are pooled the same way.

What it found is ``profile.meta["timing"]`` (:func:`robust_times`): steps run and set aside, the reference's
slowdowns, the share of samples set aside, each unit's relative spread (interquartile range over median of its
samples), the step's, the wall time over the CPU time, and the pooled units. ``profile.meta["time_warning"]`` says
in plain words when the machine was too busy for the times to be trusted (:func:`time_warning`); the profile's table
shows it.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..core.profile import Segment, UnitProfile
from ..core.progress import advance
from ..runtime.limit import uncounted

__all__ = ["BUSY_OUTLIERS", "BUSY_SPREAD", "BUSY_WALL", "OUTLIER", "REFERENCE_LIMIT", "pool_step_times", "reference_op",
           "robust_estimate", "robust_times", "time_warning", "timed_repeats", "unit_signature"]

#: a timed step next to which the reference operation ran this many times slower than its fastest is re-measured
REFERENCE_LIMIT = 3.0
#: a sample more than this many times the fastest sample of its kind (plus :data:`SLACK`) is a burst of interference
OUTLIER = 2.0
#: seconds of timer jitter a sample may exceed the outlier bound by (segments of a few microseconds)
SLACK = 50e-6
#: the step's relative spread (interquartile range over median of its timed repeats) above which times are not trusted
BUSY_SPREAD = 0.25
#: the share of samples set aside as interference above which times are not trusted
BUSY_OUTLIERS = 0.25
#: on the CPU, wall time over CPU time of the timed steps above which the machine was busy (training runs slower)
BUSY_WALL = 2.0
#: side of the reference operation's square matrices, and how many products it runs (well under a millisecond alone)
_REF_N, _REF_PRODUCTS = 128, 8


def reference_op(device: torch.device) -> Callable[[], float]:
    """A short fixed operation on ``device`` and a function that runs it and returns its seconds on the profile's
    clock (CPU time of this thread on the CPU, wall time with the device synchronised elsewhere). Its inputs are
    constants (no random numbers drawn) made as host memory under :func:`memopt_nb.limit_memory`."""
    with uncounted():
        a = torch.full((_REF_N, _REF_N), 0.5, device=device)
        b = torch.full((_REF_N, _REF_N), 0.25, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter

    def run() -> float:
        with uncounted():
            sync()
            t0 = clock()
            for _ in range(_REF_PRODUCTS):
                torch.mm(a, b)
            sync()
            return clock() - t0

    run()  # the first run pays for lazy initialisation
    return run


def timed_repeats(step: Callable[[], tuple[list[float], list[float]]], repeats: int, device: torch.device,
                  reference: Callable[[], float] | None = None) -> tuple[list[list[float]], dict[str, Any]]:
    """``repeats`` timed steps (``step() -> (seconds per segment, wall seconds per segment)``) that ran beside an
    undisturbed reference, and what it took.

    ``reference`` (default :func:`reference_op` on ``device``) runs before every step and after the last; a step is
    disturbed where the slower of the reference runs around it took more than :data:`REFERENCE_LIMIT` times the
    fastest reference run so far. A disturbed step is set aside and another is run, until ``repeats`` undisturbed
    steps or ``2 * repeats`` steps in all; then the disturbed steps set aside fill the missing repeats (least disturbed
    first), so there are always ``repeats``.
    Returns the kept steps' seconds and ``{"steps": steps run, "set_aside": steps not kept, "disturbed": kept steps
    that were disturbed, "reference_s": fastest reference seconds, "slowdowns": each kept step's reference slowdown,
    "wall_over_cpu": the kept steps' wall time over their time (on the CPU: how much longer they took than the CPU
    time they got), "threads": torch's intra-op threads, "clock": "cpu" (CPU time), "cuda" (events) or "wall"}``.
    """
    reference = reference if reference is not None else reference_op(device)
    refs = [reference()]
    runs: list[tuple[list[float], list[float], float, float]] = []  # seconds, wall, reference before and after
    good = 0
    while good < repeats and len(runs) < 2 * repeats:
        durations, wall = step()
        refs.append(reference())
        runs.append((durations, wall, refs[-2], refs[-1]))
        if max(refs[-2], refs[-1]) <= REFERENCE_LIMIT * min(refs):
            good += 1
            advance()  # the profile's "timed steps" (a step set aside is measured again: not counted)
    best = min(refs)

    def slowdown(run: tuple[list[float], list[float], float, float]) -> float:
        return max(run[2], run[3]) / best if best > 0 else 1.0

    calm = [r for r in runs if slowdown(r) <= REFERENCE_LIMIT]
    rest = sorted((r for r in runs if slowdown(r) > REFERENCE_LIMIT), key=slowdown)
    kept = (calm + rest)[:repeats]
    busy = sum(sum(r[0]) for r in kept)
    return [r[0] for r in kept], {
        "steps": len(runs),
        "set_aside": len(runs) - len(kept),
        "disturbed": sum(slowdown(r) > REFERENCE_LIMIT for r in kept),
        "reference_s": best,
        "slowdowns": [round(slowdown(r), 2) for r in kept],
        "wall_over_cpu": round(sum(sum(r[1]) for r in kept) / busy, 2) if busy > 0 else 1.0,
        "threads": torch.get_num_threads(),
        "clock": device.type if device.type in ("cpu", "cuda") else "wall",
    }


def robust_estimate(samples: Sequence[float]) -> tuple[float, int, float]:
    """``(estimate, samples set aside, relative spread)`` of one time's samples: the median of the samples within
    :data:`OUTLIER` times their lower quartile (plus :data:`SLACK`), how many lay beyond, and the interquartile range
    of all the samples over their median (0 for fewer than two samples)."""
    if not samples:
        return 0.0, 0, 0.0
    low = statistics.quantiles(samples, n=4, method="inclusive")[0] if len(samples) > 1 else samples[0]
    bound = OUTLIER * max(0.0, low) + SLACK
    kept = [s for s in samples if s <= bound]
    return float(statistics.median(kept)), len(samples) - len(kept), _spread(samples)


def _spread(samples: Sequence[float]) -> float:
    if len(samples) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    mid = statistics.median(samples)
    return float((q3 - q1) / mid) if mid > 0 else 0.0


def unit_signature(module: nn.Module, input_shapes: Sequence[Sequence[int]],
                   output_shapes: Sequence[Sequence[int]]) -> str:
    """What makes two units do the same work: the module's class, its submodules' names and classes, its parameters'
    and buffers' names, shapes, dtypes (and whether a parameter trains), and its input and output shapes, hashed."""
    parts = [f"{type(module).__module__}.{type(module).__qualname__}"]
    parts += [f"m {n} {type(m).__qualname__}" for n, m in module.named_modules()]
    parts += [f"p {n} {tuple(p.shape)} {p.dtype} {p.requires_grad}" for n, p in module.named_parameters()]
    parts += [f"b {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    parts += [f"in {[list(s) for s in input_shapes]}", f"out {[list(s) for s in output_shapes]}"]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16]


def _pools(names: Sequence[str], signatures: Sequence[str]) -> list[list[int]]:
    """The units grouped by signature, in forward order; units alike to no other are groups of one."""
    groups: dict[str, list[int]] = {}
    for i, sig in enumerate(signatures):
        groups.setdefault(sig, []).append(i)
    return list(groups.values())


def robust_times(segments: list[Segment], timings: Sequence[Sequence[float]], fwd_seg: Mapping[int, int],
                 bwd_seg: Mapping[int, int], names: Sequence[str], signatures: Sequence[str],
                 info: dict[str, Any]) -> list[list[int]]:
    """Set every segment's ``time`` from the timed steps ``timings`` (one list of seconds per segment per step): a
    unit's forward and backward from the samples of every unit with its signature, every other segment from its own
    (:func:`robust_estimate`). Adds to ``info`` (what :func:`timed_repeats` returned, kept as ``meta["timing"]``)
    ``"outliers"`` (share of samples set aside), ``"step_spread"``, ``"units"`` (per unit ``[forward spread, backward
    spread]``) and ``"pooled"`` (the names of each group of two or more identical units). Returns the groups of unit
    indices (one per signature)."""
    pools = _pools(names, signatures)
    samples = [[t[i] for t in timings] for i in range(len(segments))]
    set_aside = 0
    spreads: dict[str, list[float]] = {}
    done: set[int] = set()
    for group in pools:
        pair = []
        for seg_of in (fwd_seg, bwd_seg):
            pooled = [s for u in group for s in samples[seg_of[u]]]
            est, out, spread = robust_estimate(pooled)
            set_aside += out
            pair.append(round(spread, 3))
            for u in group:
                segments[seg_of[u]].time = est
                done.add(seg_of[u])
        spreads.update({names[u]: pair for u in group})
    for i, seg in enumerate(segments):
        if i not in done:
            seg.time, out, _ = robust_estimate(samples[i])
            set_aside += out
    total = sum(len(s) for s in samples)
    info["outliers"] = round(set_aside / total, 3) if total else 0.0
    info["step_spread"] = round(_spread([sum(t) for t in timings]), 3)
    info["units"] = spreads
    info["pooled"] = [[names[u] for u in g] for g in pools if len(g) > 1]
    return pools


def pool_step_times(units: list[UnitProfile], pools: Sequence[Sequence[int]]) -> None:
    """Give identical units the median of their unit-by-unit optimizer step times (one sample each), whole and per
    parameter (:attr:`~memopt_nb.core.profile.UnitProfile.param_steps`, alike in order and shape)."""
    for group in pools:
        if len(group) < 2:
            continue
        step = statistics.median(units[u].step_time for u in group)
        rows = [units[u].param_steps for u in group]
        same = all(len(r) == len(rows[0]) for r in rows)
        per_param = [statistics.median(r[k]["step_time"] for r in rows) for k in range(len(rows[0]))] if same else []
        for u in group:
            units[u].step_time = step
            for row, t in zip(units[u].param_steps, per_param, strict=False):
                row["step_time"] = t


def time_warning(info: Mapping[str, Any]) -> str | None:
    """A plain-words warning when the machine was too busy for the profile's times to be trusted, else ``None``:
    steps kept although the reference ran slow beside them (no undisturbed step within the bound), too many samples
    set aside (:data:`BUSY_OUTLIERS`), the step's repeats too far apart (:data:`BUSY_SPREAD`), or (on the CPU) steps
    that took more than :data:`BUSY_WALL` times their CPU time in wall time."""
    why = []
    if info.get("disturbed"):
        why.append(f"{info['disturbed']} of the timed steps ran while a reference operation took more than "
                   f"{REFERENCE_LIMIT:g}x its best time, even after measuring again")
    if info.get("outliers", 0.0) > BUSY_OUTLIERS:
        why.append(f"{info['outliers']:.0%} of the time samples were stalls over {OUTLIER:g}x the usual and were set "
                   "aside")
    if info.get("step_spread", 0.0) > BUSY_SPREAD:
        why.append(f"the step's time varied by {info['step_spread']:.0%} (interquartile range over median) between "
                   "repeats")
    if not why and info.get("wall_over_cpu", 1.0) <= BUSY_WALL:
        return None
    text = ""
    if why:
        text = ("The machine was too busy while profiling to trust its times: " + "; ".join(why) + ". Memory figures "
                "are exact, but per-unit times (and plans that trade time for memory) may follow the load. Profile "
                "again when the machine is quieter, or with more repeats (profile(..., repeats=5)).")
    if info.get("wall_over_cpu", 1.0) > BUSY_WALL:
        text += (" " if text else "") + (
            f"Other programs held the cores: the timed steps took {info['wall_over_cpu']:.1f}x the CPU time they "
            "used. The times are what each part costs while it has a core, so plans hold, but training runs that "
            "much slower than predicted while the load lasts.")
    if info.get("threads", 1) > 1:
        text += (f" torch runs {info['threads']} threads here: a parallel region stalls whenever another program "
                 "takes one of their cores, so torch.set_num_threads(1) gives steadier times on a busy machine.")
    return text
