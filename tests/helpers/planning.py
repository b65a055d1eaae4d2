"""Planning fixtures: save-sets added to a profile, the exact solver checked against brute force, and a plan played
through the environment step by step."""

from __future__ import annotations

import pytest

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.harness.synthetic import with_save_sets


def add_save_sets(prof, seed=0, offered=0.8, pareto=0.8):
    """``prof`` with synthetic save-sets (:func:`memopt_nb.harness.synthetic.with_save_sets`), at least one unit
    offering."""
    out = with_save_sets(prof, seed, offered, pareto)
    assert any(u.save_sets for u in out.units)
    return out


def assert_exact_equals_brute_force(prof, space, fracs, abs_tol=1e-6):
    """On the GPU preset and the profiled device, at budgets ``fracs`` of the way from the floor to the peak: the MILP's
    plan is as fast as the enumeration's and fits (times within ``abs_tol``: by default HiGHS's absolute MIP gap,
    1e-6 s)."""
    for device in ("a100-40gb", None):
        lo = solvers.min_peak(prof, device=device, **space)
        for frac in fracs:
            budget = int(lo + frac * (prof.peak_bytes - lo))
            exact = solvers.optimal(prof, budget, device=device, **space)
            oracle = solvers.brute_force(prof, budget, device=device, **space)
            assert exact.feasible and oracle.feasible
            assert exact.predicted_step_time == pytest.approx(oracle.predicted_step_time, rel=1e-9, abs=abs_tol)
            assert memopt.simulate(prof, exact, device=device).peak_bytes <= budget


def play(env, plan, actions):
    """Play ``plan`` through ``env`` with the strategy agent's ``actions`` (one per unit) and the plan's timings;
    every action must be allowed by the masks. Returns the last step's infos."""
    from memopt_nb.planners.options import TIMINGS

    obs, _ = env.reset(seed=0)
    for t in range(env.task.n + 1):
        a = {}
        if t < env.task.n:
            a["strategy"] = actions[t]
            assert obs["strategy"]["action_mask"][a["strategy"]], (plan.decisions, t)
        if t >= 1 and plan.strategies[t - 1] in ("swap", "recompute_offload"):
            a["timing"] = TIMINGS.index((plan.offload_windows[t - 1], plan.prefetch_distances[t - 1]))
            assert obs["timing"]["action_mask"][a["timing"]], (plan.decisions, t)
        obs, rew, term, trunc, info = env.step(a)
    return info
