"""The same seed gives the same plan however loaded the machine is: no plan decision reads the clock.

The polish bounds its work by counts (:data:`~memopt_nb.planners.polish.HEURISTIC_ROUNDS`,
:data:`~memopt_nb.planners.polish.PLACEMENT_SOLVES`), not by seconds; these tests make every Python clock run slow (each
read 30 s after the last, as on a machine so loaded that any wall-clock deadline passes at once) and check the plan,
and run the same search in two processes at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import memopt_nb as memopt
from memopt_nb.harness.synthetic import chain_profile

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

# a chain with state to place, so the polish runs its exact-placement MILPs and its heuristic starts
SEARCH = {"budget": "60%", "device": "a100-40gb", "total_timesteps": 300, "seed": 4}


def _profile():
    return chain_profile(8, seed=3, state_bytes=4 * MiB)


def _search(prof):
    kw = dict(SEARCH)
    plan = memopt.search(prof, kw.pop("budget"), **kw)
    return plan


def _fingerprint(plan) -> dict:
    meta = plan.meta
    return {"decisions": [[d.strategy, d.save_set, d.offload_window, d.prefetch_distance, list(d.placement)]
                          for d in plan.decisions],
            "step_time": plan.predicted_step_time, "peak": plan.predicted_peak_bytes,
            "polish_start": meta.get("polish_start"), "heuristic_starts": meta.get("polish_heuristic_starts")}


class _SlowClock:
    """A clock each read of which is ``tick`` seconds after the last."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick, self.reads = 1e6, tick, 0

    def __call__(self) -> float:
        self.now += self.tick
        self.reads += 1
        return self.now


@pytest.fixture(scope="module")
def quiet_plan():
    return _search(_profile())


def test_same_seed_same_plan_with_a_clock_that_runs_slow(quiet_plan, monkeypatch):
    """Every Python clock the search could read runs slow: the plan, the polish's start and the baselines it polished
    are those of the normal run, and the polish skipped and cut nothing (a wall-clock deadline would have passed at
    the first read)."""
    clock = _SlowClock(30.0)
    for name in ("perf_counter", "monotonic", "time"):
        monkeypatch.setattr(time, name, clock)
    slow = _search(_profile())
    monkeypatch.undo()
    assert clock.reads > 0  # the search did read the clock, for its report
    assert _fingerprint(slow) == _fingerprint(quiet_plan)
    meta = slow.meta
    assert meta["polish"] == "ran" and meta["polish_heuristic_starts"]
    assert meta["polish_heuristic_skipped"] == [] and meta["polish_heuristic_cut"] == []
    assert meta["polish_placement_skipped"] == 0
    assert meta["search_seconds"] >= 30.0  # what it reports is the slow clock's


_CHILD = """
import json, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import test_determinism as t
print("PLAN " + json.dumps(t._fingerprint(t._search(t._profile()))))
"""


@pytest.mark.slow  # two processes, each importing torch
def test_same_seed_same_plan_in_two_processes_at_once(quiet_plan):
    """Two searches run at once (each slowing the other down on a small machine) give this process's plan."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = _CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"))
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=ROOT) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    want = json.loads(json.dumps(_fingerprint(quiet_plan)))  # as JSON gives it: tuples as lists
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
        (line,) = [ln for ln in out.splitlines() if ln.startswith("PLAN ")]
        assert json.loads(line[5:]) == want
