"""One planning problem — a profile, a budget, a device — prepared for the agents.

Besides the exact simulator (which scores every finished plan), a task holds a *marginal model*: for every unit and
option, how the per-segment peaks and the step time change when only that unit leaves "keep". Summing marginals is
a fast, close approximation of the simulator (exact for memory wherever storage groups are owned by one unit) that
the environment uses for observations and action masks, so that an environment step never needs a simulation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..device import DeviceSpec
from ..plan import DISTANCES, WINDOWS
from ..simulate import KEEP, RECOMPUTE, SWAP, Simulator
from ..solvers.common import as_simulator, check_budget

__all__ = ["PlanningTask", "TIMINGS", "DEFAULT_TIMING", "N_OPTIONS"]

#: Timing actions: (offload window, prefetch distance) pairs.
TIMINGS: tuple[tuple[int, int], ...] = tuple((w, d) for w in WINDOWS for d in DISTANCES)
#: The timing a swap gets when nobody chooses one (the timing agent's difference reward is measured against it).
DEFAULT_TIMING = TIMINGS.index((1, 1))
N_OPTIONS = 2 + len(TIMINGS)  # keep, recompute, swap × timings


class PlanningTask:
    """A (profile, budget, device) triple compiled for the environment and the search."""

    def __init__(self, profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> None:
        self.sim: Simulator = as_simulator(profile, device)
        self.profile = self.sim.profile
        self.budget = check_budget(self.sim, budget)
        self.n = n = self.sim.n
        self.S = self.sim.S
        keep = np.zeros((1, n), dtype=np.int64)
        base = self.sim.evaluate(keep, keep + 1, keep + 1, details=True)
        self.base_peaks = base["peaks"][0]
        self.base_peak = float(base["peak"][0])
        self.base_time = float(base["time"][0])
        # which options exist for each unit
        self.option_ok = np.zeros((n, N_OPTIONS), dtype=bool)
        self.option_ok[:, KEEP] = True
        self.option_ok[:, RECOMPUTE] = self.sim.recomputable
        self.option_ok[:, 2:] = self.sim.swappable[:, None]
        for u in range(n):  # timings with no distinct effect are disabled, keeping the first of each class
            seen = set()
            for j, (w, d) in enumerate(TIMINGS):
                key = (min(u + 1 + w, n), min(u + d, n - 1))
                if key in seen:
                    self.option_ok[u, 2 + j] = False
                seen.add(key)
        # marginal model: unit u alone on option o
        codes, windows, dists = [], [], []
        for u in range(n):
            for o in range(N_OPTIONS):
                c = np.zeros(n, dtype=np.int64)
                w = np.ones(n, dtype=np.int64)
                d = np.ones(n, dtype=np.int64)
                if o == RECOMPUTE:
                    c[u] = RECOMPUTE
                elif o >= 2:
                    c[u] = SWAP
                    w[u], d[u] = TIMINGS[o - 2]
                codes.append(c)
                windows.append(w)
                dists.append(d)
        det = self.sim.evaluate(np.array(codes), np.array(windows), np.array(dists), details=True)
        self.marg_peak = (det["peaks"] - self.base_peaks[None]).reshape(n, N_OPTIONS, self.S)
        self.marg_time = (det["time"] - self.base_time).reshape(n, N_OPTIONS)
        self.marg_peak[~self.option_ok] = 0.0
        self.marg_time[~self.option_ok] = 0.0
        big = np.where(self.option_ok[:, :, None], self.marg_peak, np.inf)
        self.min_marg = big.min(axis=1)  # (n, S): the most any option of the unit can take off each segment
        self.suffix_min = np.zeros((n + 1, self.S))
        for u in range(n - 1, -1, -1):
            self.suffix_min[u] = self.suffix_min[u + 1] + self.min_marg[u]
        # cost efficiency: seconds of overhead per byte taken off each unit's most loaded segment, cheapest option
        red = -self.marg_peak.min(axis=2)  # (n, options): the largest per-segment saving of each option
        with np.errstate(divide="ignore", invalid="ignore"):
            eff = np.where(self.option_ok & (red > 0), np.maximum(self.marg_time, 0.0) / red, np.inf)
        self.best_eff = eff.min(axis=1)  # (n,)
        self.rc_eff = eff[:, RECOMPUTE]
        self.swap_eff = eff[:, 2:].min(axis=1)
        self.max_red = red.max(axis=1)  # (n,)
        self.suffix_red = np.concatenate([np.cumsum(self.max_red[::-1])[::-1], [0.0]])
        # copy-engine load of swapping a unit, relative to its forward: its bytes plus the storages it owns, priced by
        # DeviceSpec.copy_seconds (the slower direction)
        sim, dev = self.sim, self.sim.device
        owned = np.zeros(n)
        np.add.at(owned, sim.g_owner[sim.g_eligible], sim.g_cnt[sim.g_eligible])
        swap_bytes = np.array([u.interior_bytes + u.input_bytes for u in self.profile.units], dtype=float)
        copy = np.maximum(dev.copy_seconds(swap_bytes, owned, "d2h"), dev.copy_seconds(swap_bytes, owned, "h2d"))
        self.copy_ratio = copy / np.maximum(sim.dur[sim.fwd_seg], 1e-9)

    def evaluate(self, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact peak and time of a batch of plans."""
        return self.sim.evaluate(codes, windows, dists)

    def overhead(self, time: np.ndarray) -> np.ndarray:
        """Step time relative to keeping everything, minus one."""
        return np.asarray(time) / self.base_time - 1.0

    def penalty(self, peak: np.ndarray) -> np.ndarray:
        """Zero within budget; a step of 1 plus 20× the relative excess above it."""
        excess = np.asarray(peak) / self.budget - 1.0
        return np.where(excess > 1e-9, 1.0 + 20.0 * excess, 0.0)
