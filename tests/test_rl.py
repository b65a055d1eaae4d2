import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pettingzoo.test import parallel_api_test

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.errors import BudgetError
from memopt_nb.plan import STRATEGIES, Plan
from memopt_nb.rl.env import MemoryPlanningEnv
from memopt_nb.rl.task import TIMINGS, PlanningTask
from memopt_nb.synthetic import chain_profile

ROOT = Path(__file__).resolve().parents[1]


def task_for(n=8, seed=0, frac=0.4, device=None):
    prof = chain_profile(n, seed=seed, device=device)
    lo = solvers.min_peak(prof)
    return PlanningTask(prof, int(lo + frac * (prof.peak_bytes - lo)))


def test_pettingzoo_parallel_api():
    parallel_api_test(MemoryPlanningEnv(task_for()), num_cycles=200)


def test_spaces_are_cached_and_masks_valid():
    env = MemoryPlanningEnv(task_for())
    assert env.observation_space("strategy") is env.observation_space("strategy")
    assert env.action_space("timing") is env.action_space("timing")
    obs, _ = env.reset(seed=0)
    for a in env.agents:
        m = obs[a]["action_mask"]
        assert m.dtype == np.int8 and m.ndim == 1 and m.any()
        assert env.observation_space(a).contains(obs[a])


def rollout(env, seed, steps_seed):
    rng = np.random.default_rng(steps_seed)
    obs, _ = env.reset(seed=seed)
    trace = []
    while env.agents:
        acts = {a: int(rng.choice(np.flatnonzero(obs[a]["action_mask"]))) for a in env.agents}
        obs, rew, term, trunc, info = env.step(acts)
        trace.append(({a: obs[a]["observation"].copy() for a in obs}, dict(rew)))
    return trace, info


def test_multi_step_determinism():
    task = task_for(10, seed=3)
    a, ia = rollout(MemoryPlanningEnv(task), 5, 9)
    b, ib = rollout(MemoryPlanningEnv(task), 5, 9)
    assert len(a) == len(b) == task.n + 1
    for (oa, ra), (ob, rb) in zip(a, b):
        assert ra == rb
        for k in oa:
            assert np.array_equal(oa[k], ob[k])
    assert ia["strategy"]["time"] == ib["strategy"]["time"]


def play(env, prof, seed):
    """One episode with random allowed actions. Returns the plan those actions make (built here from the actions, not
    from the environment's report), the plan with the same strategies at default timings, and each agent's return."""
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    strategies = [None] * env.task.n
    windows, dists = [1] * env.task.n, [1] * env.task.n
    total = {"strategy": 0.0, "timing": 0.0}
    t = 0
    while env.agents:
        acts = {a: int(rng.choice(np.flatnonzero(obs[a]["action_mask"]))) for a in env.agents}
        if t < env.task.n:
            strategies[t] = STRATEGIES[acts["strategy"]]
        if t >= 1 and strategies[t - 1] == "swap":
            windows[t - 1], dists[t - 1] = TIMINGS[acts["timing"]]
        obs, rew, term, trunc, info = env.step(acts)
        for a in total:
            total[a] += rew[a]
        t += 1
    plan = Plan.from_strategies(prof, strategies, offload_window=windows, prefetch_distance=dists)
    default = Plan.from_strategies(prof, strategies)  # a Decision's default timing: window 1, distance 1
    return plan, default, total, info["strategy"]


def test_returns_rank_plans_as_the_simulator_does():
    """Returns judged against memopt.simulate of the plan the actions made (not the environment's own figures).

    A plan over budget must earn less than any plan within it (its penalty starts at 1). Within budget the strategy
    agent earns the overhead of the better of its plan and the same strategies at default timings (step time ÷ keep-all
    step time − 1, scaled), and the timing agent what its timings changed; timings that put a plan over budget earn
    less than the defaults that fit, and the other way round.
    """
    prof = chain_profile(8, seed=1)
    lo = solvers.min_peak(prof)
    budget = int(lo + 0.2 * (prof.peak_bytes - lo))
    env = MemoryPlanningEnv(PlanningTask(prof, budget))
    scale = env.reward_scale
    keep_time = memopt.simulate(prof, Plan.uniform(prof, "keep")).step_time
    fits, misses = [], []
    for seed in range(40):
        plan, default, ret, info = play(env, prof, seed)
        p, q = memopt.simulate(prof, plan, budget=budget), memopt.simulate(prof, default, budget=budget)
        assert info["feasible"] == p.feasible and info["peak"] == p.peak_bytes  # the env reports the plan it was given
        over = {True: p.step_time / keep_time - 1, False: q.step_time / keep_time - 1}  # overhead: plan, default
        if p.feasible or q.feasible:
            best = min(o for o, ok in ((over[True], p.feasible), (over[False], q.feasible)) if ok)
            assert ret["strategy"] == pytest.approx(-scale * best, rel=1e-9, abs=1e-12), seed
            fits.append(ret["strategy"])
        else:  # the penalty jumps to 1 at the budget, on top of the overhead
            assert ret["strategy"] <= -scale * (1 + min(over.values())) + 1e-9, seed
            misses.append(ret["strategy"])
        if p.feasible and q.feasible:
            assert ret["timing"] == pytest.approx(-scale * (over[True] - over[False]), rel=1e-9, abs=1e-12), seed
        elif p.feasible != q.feasible:  # timings that make the plan fit are worth more than any time they cost
            assert (ret["timing"] > 0) == p.feasible, seed
    assert len(fits) >= 5 and len(misses) >= 5
    assert max(misses) < min(fits)  # over budget earns less than any plan within it


def test_same_seed_same_plan_and_history():
    prof = chain_profile(8, seed=2)
    a = memopt.search(prof, "70%", total_timesteps=3000, seed=11)
    b = memopt.search(prof, "70%", total_timesteps=3000, seed=11)
    assert a == b and a.same_decisions(b)
    assert [r["reward_strategy"] for r in a.meta["history"]] == [r["reward_strategy"] for r in b.meta["history"]]
    assert a.method == "memopt-ppo" and a.seed == 11


@pytest.mark.parametrize("n,seed,frac,dev", [(5, 0, 0.3, None), (6, 1, 0.6, None), (8, 2, 0.4, None),
                                             (10, 3, 0.5, None), (12, 4, 0.35, None), (8, 5, 0.5, "cpu")])
def test_agents_reach_the_optimum_on_small_cases(n, seed, frac, dev):
    device = None
    if dev == "cpu":
        device = memopt.DeviceSpec(name="cpu-like", kind="cpu", capacity_bytes=2**34, h2d_bytes_per_s=5e9,
                                   d2h_bytes_per_s=5e9, compute_flops=1e11, copy_overlap=False)
    prof = chain_profile(n, seed=seed, device=device)
    lo = solvers.min_peak(prof)
    budget = int(lo + frac * (prof.peak_bytes - lo))
    oracle = solvers.brute_force(prof, budget) if n <= 5 else solvers.optimal(prof, budget)
    plan = memopt.search(prof, budget, seed=0, polish_plan=False)  # the default budget: 30k timesteps here
    assert plan.feasible
    assert plan.meta["agents_step_time"] <= 1.02 * oracle.predicted_step_time


def test_callback_history_and_interrupt():
    prof = chain_profile(8, seed=4)
    rows = []

    def cb(row):
        rows.append(row)
        if len(rows) == 3:
            raise KeyboardInterrupt

    plan = memopt.search(prof, "70%", total_timesteps=20000, callback=cb)
    assert len(rows) == 3 and plan.meta["interrupted"] is True
    assert plan.feasible and plan.meta["history"] == rows
    for key in ("reward_strategy", "reward_timing", "best_step_time", "best_peak", "feasible_fraction"):
        assert key in rows[-1]


def test_budget_below_minimum_raises_before_training():
    prof = chain_profile(6, seed=0)
    calls = []
    with pytest.raises(BudgetError, match="smallest peak"):
        memopt.search(prof, solvers.min_peak(prof) - 1, callback=calls.append)
    assert calls == []


def test_search_on_a_zoo_profile_and_a_preset(zoo_profiles):
    _, _, prof = zoo_profiles["gpt"]
    plan = memopt.search(prof, "60%", device="a100-40gb", total_timesteps=4000)
    assert plan.feasible and plan.predicted_peak_bytes <= plan.budget_bytes
    assert memopt.simulate(prof, plan, device="a100-40gb").peak_bytes == plan.predicted_peak_bytes


def test_same_seed_same_plan_in_another_process(tmp_path):
    """A saved profile and a seed give the same plan in two fresh processes whose string hashing differs
    (PYTHONHASHSEED): nothing in the search may depend on set or dict order of hashed keys, or on the process."""
    path = chain_profile(8, seed=2).save(tmp_path / "profile.json")
    code = ("import json, sys\nimport memopt_nb as memopt\nfrom memopt_nb.profile import ModelProfile\n"
            "p = memopt.search(ModelProfile.load(sys.argv[1]), '70%', total_timesteps=1500, seed=11)\n"
            "print(json.dumps({'decisions': [d.to_dict() for d in p.decisions], 'rewards': "
            "[r['reward_strategy'] for r in p.meta['history']]}))\n")
    runs = []
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert len(runs[0]["rewards"]) > 1
    assert runs[0] == runs[1]


def test_reward_scale_reaches_the_environment_from_search():
    """``search(reward_scale=)`` scales what the agents are paid: the first iteration's rollout (the untrained
    policy, the same for both) reports returns in exact proportion to the scale."""
    prof = chain_profile(6, seed=1)
    a = memopt.search(prof, "70%", total_timesteps=600, seed=2, reward_scale=10.0)
    b = memopt.search(prof, "70%", total_timesteps=600, seed=2, reward_scale=2.5)
    ra, rb = a.meta["history"][0]["reward_strategy"], b.meta["history"][0]["reward_strategy"]
    assert ra != 0.0 and ra == pytest.approx(4.0 * rb, rel=1e-9)
