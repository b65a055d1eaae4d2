"""The search stops when it has its answer: ``patience`` (PPO iterations without a faster plan, deterministic) and
``time_limit`` (seconds, opt-in), recorded in ``plan.meta["stopped"]``; bad values are refused before training."""

from __future__ import annotations

import pytest

import memopt_nb as memopt
from memopt_nb.core.errors import PlanError
from memopt_nb.harness.synthetic import chain_profile


@pytest.fixture(scope="module")
def chain():
    return chain_profile(6, seed=3)


def test_patience_stops_each_agent_pair_once_its_best_plan_stops_improving(chain):
    rows = []
    p = memopt.search(chain, "60%", total_timesteps=40_000, seed=0, patience=3, restarts=1, polish_plan=False,
                      callback=rows.append)
    assert p.meta["stopped"] == "no better plan in the last 3 iterations"
    assert p.meta["timesteps_run"] < p.meta["total_timesteps"]
    best = [r["best_step_time"] for r in rows]
    # the last three iterations found nothing faster than the best of the iteration before them
    assert best[-1] == best[-4]
    again = memopt.search(chain, "60%", total_timesteps=40_000, seed=0, patience=3, restarts=1, polish_plan=False)
    assert again.decisions == p.decisions and again.meta["timesteps_run"] == p.meta["timesteps_run"]


@pytest.mark.slow
def test_without_patience_every_timestep_runs(chain):
    p = memopt.search(chain, "60%", total_timesteps=3_000, seed=0, patience=None, restarts=1, polish_plan=False)
    assert p.meta["stopped"] == "all timesteps run"
    assert p.meta["timesteps_run"] == p.meta["total_timesteps"]


def test_a_time_limit_stops_every_agent_pair_and_says_so(chain):
    rows = []
    p = memopt.search(chain, "60%", total_timesteps=40_000, seed=0, time_limit=1e-6, patience=None, restarts=2,
                      polish_plan=False, callback=rows.append)
    assert p.meta["stopped"] == "time limit"
    assert len(rows) == 1 and {r["restart"] for r in rows} == {0}  # one update, and no second agent pair
    assert p.feasible or p.meta.get("no_feasible_plan")


@pytest.mark.parametrize("kwargs", [{"time_limit": 0}, {"time_limit": -5.0}, {"patience": 0}, {"patience": 2.5},
                                    {"patience": True}])
def test_bad_stop_settings_are_refused_before_training(chain, kwargs):
    called = []
    with pytest.raises(PlanError):
        memopt.search(chain, "60%", total_timesteps=2_000, callback=called.append, **kwargs)
    assert called == []


def test_each_reason_to_stop_is_said_once_however_many_agent_pairs_stopped_for_it(chain):
    rows = []
    p = memopt.search(chain, "60%", total_timesteps=40_000, seed=0, patience=3, restarts=2, polish_plan=False,
                      callback=rows.append)
    per_pair = (40_000 // 2) // (16 * (chain.n_units + 1))  # PPO iterations an agent pair runs without a stop
    assert {r["restart"] for r in rows} == {0, 1}
    assert all(sum(r["restart"] == k for r in rows) < per_pair for k in (0, 1))  # each pair stopped early
    assert p.meta["stopped"] == "no better plan in the last 3 iterations"
