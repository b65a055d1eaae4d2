"""What every planner shares: the option space per unit, budget checks, and turning arrays into a Plan."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..budget import format_bytes, resolve_budget
from ..device import DeviceSpec
from ..errors import BudgetError
from ..plan import DISTANCES, STRATEGIES, WINDOWS, Plan, decisions_from
from ..simulate import KEEP, NAMES, RECOMPUTE, SWAP, Simulator

Option = tuple[int, int, int]  # (strategy code, offload window, prefetch distance)


def unit_options(sim: Simulator, u: int, strategies: Sequence[str] = STRATEGIES) -> list[Option]:
    """The distinct choices for unit ``u``: keep, recompute, and swap with each window and prefetch distance.

    Timings that cannot differ in effect are collapsed (a prefetch distance past the last unit, a window that already
    reaches the end of the forward), so every option listed leads to a different plan.
    """
    for s in strategies:
        if s not in STRATEGIES:
            raise BudgetError(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    n = sim.n
    out: list[Option] = []
    if "keep" in strategies:
        out.append((KEEP, 1, 1))
    if "recompute" in strategies and sim.recomputable[u]:
        out.append((RECOMPUTE, 1, 1))
    if "swap" in strategies and sim.swappable[u]:
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
        out.extend((SWAP, w, d) for w in ws for d in ds)
    if not out:
        out.append((KEEP, 1, 1))
    return out


def as_simulator(profile: Any, device: DeviceSpec | str | None) -> Simulator:
    return profile if isinstance(profile, Simulator) else Simulator(profile, device)


_MIN_PEAK: dict[tuple[int, str, tuple[str, ...]], tuple[weakref.ref, int]] = {}


def cached_min_peak(sim: Simulator, strategies: Sequence[str] = STRATEGIES) -> int:
    """:func:`memopt_nb.solvers.min_peak` for a compiled simulator, cached per profile, device and strategies."""
    from .milp import solve_min_peak

    key = (id(sim.profile), repr(sim.device), tuple(sorted(strategies)))
    hit = _MIN_PEAK.get(key)
    if hit is not None and hit[0]() is sim.profile:
        return hit[1]
    value = solve_min_peak(sim, strategies)
    _MIN_PEAK[key] = (weakref.ref(sim.profile), value)
    return value


def check_budget(sim: Simulator, budget: Any, strategies: Sequence[str] = STRATEGIES) -> int:
    """Parse ``budget`` (bytes, ``"1.5GiB"``, ``"60%"`` of the unoptimized peak) and refuse one no plan can meet."""
    if budget is None:
        budget = sim.device.capacity_bytes
    value = resolve_budget(budget, reference=sim.profile.peak_bytes)
    lowest = cached_min_peak(sim, strategies)
    if value < lowest:
        from ..floor import explain_floor

        using = "" if set(strategies) == set(STRATEGIES) else f" using only {', '.join(strategies)}"
        floor = explain_floor(sim.profile, sim.device, floor_bytes=lowest, strategies=strategies)
        raise BudgetError(
            f"budget {format_bytes(value)} ({value} bytes) is below the smallest peak any plan{using} reaches for this "
            f"profile on {sim.device.name}: {format_bytes(lowest)} ({lowest} bytes) = {floor.breakdown_text()}. "
            f"{floor.bound_text()} Ask for at least {format_bytes(lowest)}; to lower the floor: "
            f"{'; '.join(floor.advice)}."
        )
    return value


def make_plan(sim: Simulator, strategies: Sequence[int], windows: Sequence[int], distances: Sequence[int], *,
              budget: int | None, method: str, seed: int | None = None, **meta: Any) -> Plan:
    """A Plan from arrays, with the simulator's prediction and feasibility filled in."""
    s = np.asarray(strategies, dtype=np.int64)[None]
    w = np.asarray(windows, dtype=np.int64)[None]
    d = np.asarray(distances, dtype=np.int64)[None]
    peak, time = sim.evaluate(s, w, d)
    profile = sim.profile
    plan = Plan(
        decisions=decisions_from([NAMES[int(x)] for x in s[0]], profile.unit_names, w[0].tolist(), d[0].tolist()),
        fingerprint=profile.fingerprint,
        model_fingerprint=(getattr(profile, "meta", None) or {}).get("model_fingerprint"),
        budget_bytes=budget,
        device=sim.device.to_dict(),
        method=method,
        seed=seed,
        predicted_peak_bytes=int(round(float(peak[0]))),
        predicted_step_time=float(time[0]),
        feasible=None if budget is None else bool(peak[0] <= budget),
        meta=meta,
    )
    plan._model_ref = getattr(profile, "_model_ref", None)
    plan._optimizer_ref = getattr(profile, "_optimizer_ref", None)
    return plan


def uniform_arrays(sim: Simulator, code: int, window: int = 1, distance: int = 1) -> tuple[list, list, list]:
    n = sim.n
    codes = []
    for u in range(n):
        if code == RECOMPUTE and not sim.recomputable[u] or code == SWAP and not sim.swappable[u]:
            codes.append(KEEP)
        else:
            codes.append(code)
    return codes, [window] * n, [distance] * n
