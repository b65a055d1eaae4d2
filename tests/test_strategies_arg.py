"""``search(strategies=)``: the agents, the polish and the budget check stay inside the activation strategies given."""

import json

import numpy as np
import pytest
import torch
from helpers.planning import play
from pettingzoo.test import parallel_api_test

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.errors import BudgetError, PlanError
from memopt_nb.core.plan import STRATEGIES
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners.options import allowed_strategies
from memopt_nb.planners.polish import polish
from memopt_nb.planners.rl.env import MemoryPlanningEnv
from memopt_nb.planners.task import PlanningTask
from memopt_nb.sim.simulator import KEEP, RECOMPUTE, SWAP

CHECKPOINTING = ("keep", "recompute")
SWAPPING = ("keep", "swap")


@pytest.fixture(scope="module")
def chain():
    """Eight synthetic units whose unrestricted plans at half the peak mix recompute and swap."""
    return chain_profile(8, seed=2)


@pytest.fixture(scope="module")
def gpt_profile():
    """A small zoo GPT (6 blocks) with Adam: a profile with a state table, so placements are searched too."""
    model, inputs, loss_fn, _ = memopt.zoo.gpt(batch_size=4, seq_len=64, d_model=64, n_layers=6, n_heads=2)
    opt = torch.optim.Adam(model.parameters())
    return memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)


def comparable(plan):
    """The plan's JSON without its wall-clock figures."""
    d = json.loads(plan.to_json())
    d["meta"].pop("search_seconds")
    d["meta"].pop("polish_heuristic_seconds", None)
    for row in d["meta"]["history"]:
        row.pop("seconds")
    return d


def test_default_space_is_the_whole_one_bit_for_bit(gpt_profile):
    default = memopt.search(gpt_profile, "50%", total_timesteps=400, seed=3)
    explicit = memopt.search(gpt_profile, "50%", total_timesteps=400, seed=3,
                             strategies=("swap", "keep", "recompute", "keep"))
    assert comparable(default) == comparable(explicit)
    assert default.meta["allowed_strategies"] == ["keep", "recompute", "swap"]


@pytest.mark.parametrize("value, canonical", [
    (("recompute", "keep"), CHECKPOINTING),
    (["swap", "keep", "swap"], SWAPPING),
    ("keep, Recompute", CHECKPOINTING),
    ({"swap"}, ("swap",)),
])
def test_order_duplicates_and_a_string_do_not_matter(value, canonical):
    assert allowed_strategies(value) == canonical


@pytest.mark.parametrize("value, message", [
    (("keep", "teleport"), "unknown 'teleport'"),
    ((), "none given"),
    ("", "unknown ''"),
    (3, "must be a set"),
])
def test_a_bad_space_is_a_plan_error_naming_the_allowed(chain, value, message):
    calls = []
    with pytest.raises(PlanError) as err:
        memopt.search(chain, "50%", total_timesteps=100, strategies=value, callback=calls.append)
    assert message in str(err.value) and "keep, recompute, swap" in str(err.value)
    assert calls == []


def random_codes(task, seed):
    """The strategies of one episode of random allowed actions, and whether the timing agent ever had a choice."""
    env = MemoryPlanningEnv(task)
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    timing_choice = False
    info = {}
    while env.agents:
        timing_choice |= int(obs["timing"]["action_mask"].sum()) > 1
        acts = {a: int(rng.choice(np.flatnonzero(obs[a]["action_mask"]))) for a in env.agents}
        obs, _, _, _, infos = env.step(acts)
        info = infos.get("strategy", info)
    return info["codes"], timing_choice


@pytest.mark.parametrize("strategies, absent", [(CHECKPOINTING, SWAP), (SWAPPING, RECOMPUTE), (None, None)])
def test_the_masks_leave_out_what_is_not_allowed(chain, strategies, absent):
    kw = {} if strategies is None else {"strategies": strategies}
    task = PlanningTask(chain, "60%", **kw)
    seen = set()
    timing = False
    for seed in range(30):
        codes, choice = random_codes(task, seed)
        seen |= set(codes.tolist())
        timing |= choice
    if absent is None:  # the whole space: random episodes do use all three
        assert seen == {KEEP, RECOMPUTE, SWAP} and timing
    else:
        assert absent not in seen and len(seen) == 2
        assert timing is (absent != SWAP)  # without swaps the timing agent only ever has its no-op


def plan_arrays(plan):
    return tuple(np.array(x, dtype=np.int64) for x in (
        [STRATEGIES.index(d.strategy) for d in plan.decisions], [d.offload_window for d in plan.decisions],
        [d.prefetch_distance for d in plan.decisions]))


@pytest.mark.parametrize("strategies, absent", [(CHECKPOINTING, SWAP), (SWAPPING, RECOMPUTE)])
def test_the_polish_never_brings_in_a_strategy_not_allowed(chain, strategies, absent):
    start = plan_arrays(solvers.optimal(chain, "60%", strategies=strategies))
    codes, *_ = polish(PlanningTask(chain, "60%", strategies=strategies), *start)
    assert absent not in codes
    if absent == SWAP:  # from the checkpointing optimum, the unrestricted polish does swap
        assert SWAP in polish(PlanningTask(chain, "60%"), *start)[0]


@pytest.mark.parametrize("strategies, absent", [(CHECKPOINTING, "swap"), (SWAPPING, "recompute")])
def test_search_plans_stay_in_the_space(chain, strategies, absent):
    full = memopt.search(chain, "50%", total_timesteps=400, seed=0)
    assert absent in full.strategies  # unrestricted, this budget uses it
    plan = memopt.search(chain, "50%", total_timesteps=400, seed=0, strategies=strategies)
    assert plan.feasible and absent not in plan.strategies
    assert plan.meta["allowed_strategies"] == list(strategies)
    code = {"recompute": RECOMPUTE, "swap": SWAP}[absent]
    assert all(min(o, 2) != code for o in plan.meta["agents_decisions"])  # the agents' own plan, before the polish
    again = memopt.search(chain, "50%", total_timesteps=400, seed=0, strategies=strategies[::-1])
    assert comparable(again) == comparable(plan)  # same seed, same plan


def test_a_budget_only_the_whole_space_meets_is_refused_for_a_smaller_one(chain):
    whole = solvers.min_peak(chain)
    checkpointing = solvers.min_peak(chain, strategies=CHECKPOINTING)
    assert whole < checkpointing
    budget = (whole + checkpointing) // 2
    assert memopt.search(chain, budget, total_timesteps=200).feasible
    calls = []
    with pytest.raises(BudgetError) as err:
        memopt.search(chain, budget, total_timesteps=200, strategies=CHECKPOINTING, callback=calls.append)
    msg = str(err.value)
    assert "using only keep, recompute" in msg and memopt.format_bytes(checkpointing) in msg
    assert str(checkpointing) in msg and calls == []
    assert "allow every activation strategy" in msg and memopt.format_bytes(whole) in msg


def test_only_keep_leaves_one_action_and_still_plans(gpt_profile):
    task = PlanningTask(gpt_profile, "100%", strategies=("keep",))
    env = MemoryPlanningEnv(task)
    obs, _ = env.reset(seed=0)
    mask = obs["strategy"]["action_mask"].reshape(3, task.C)
    assert not mask[RECOMPUTE].any() and not mask[SWAP].any() and mask[KEEP].any()
    floor = solvers.min_peak(gpt_profile, strategies=("keep",))
    assert floor < gpt_profile.peak_bytes  # only moving state brings keep-all under its peak
    plan = memopt.search(gpt_profile, floor, total_timesteps=300, seed=1, strategies="keep")
    assert set(plan.strategies) == {"keep"} and plan.feasible and plan.predicted_peak_bytes <= floor


def test_without_keep_every_unit_takes_an_allowed_strategy(chain):
    plan = memopt.search(chain, "90%", total_timesteps=300, seed=0, strategies=("recompute",))
    sim = memopt.Simulator(chain)
    expect = ["recompute" if ok else "keep" for ok in sim.recomputable]
    assert plan.strategies == expect and plan.feasible


def test_the_exact_solvers_validate_the_space_alike(chain):
    with pytest.raises(PlanError, match="unknown 'teleport'"):
        solvers.optimal(chain, "60%", strategies=("keep", "teleport"))
    with pytest.raises(PlanError, match="none given"):
        solvers.min_peak(chain, strategies=())
    assert solvers.min_peak(chain, strategies="recompute,keep") == solvers.min_peak(chain, strategies=CHECKPOINTING)


def test_recompute_offload_is_a_fourth_strategy_for_the_agents(chain):
    """With recompute_offload allowed the strategy agent has four strategies (timed by the timing agent like swap),
    random allowed episodes use it, and the option tables map it to its code and timings both ways."""
    from memopt_nb.planners.options import TIMINGS
    from memopt_nb.planners.polish import option_arrays as _option_arrays
    from memopt_nb.planners.polish import to_options as _to_options
    from memopt_nb.sim.simulator import RECOMPUTE_OFFLOAD

    task = PlanningTask(chain, "60%", strategies=("keep", "recompute", "swap", "recompute_offload"))
    assert task.n_strategies == 4 and task.n_options == 2 + 2 * len(TIMINGS)
    env = MemoryPlanningEnv(task)
    assert env.action_space("strategy").n == 4 * task.C
    parallel_api_test(MemoryPlanningEnv(task), num_cycles=50)
    seen, timing = set(), False
    for seed in range(30):
        codes, choice = random_codes(task, seed)
        seen |= set(codes.tolist())
        timing |= choice
    assert seen == {KEEP, RECOMPUTE, SWAP, RECOMPUTE_OFFLOAD} and timing
    only = PlanningTask(chain, "60%", strategies=("keep", "recompute_offload"))
    seen = set()
    for seed in range(10):
        seen |= set(random_codes(only, seed)[0].tolist())
    assert seen == {KEEP, RECOMPUTE_OFFLOAD}
    opts = np.arange(task.n_options)
    codes, w, d = _option_arrays(opts)
    assert list(codes[:2]) == [KEEP, RECOMPUTE] and set(codes[2:2 + len(TIMINGS)]) == {SWAP}
    assert set(codes[2 + len(TIMINGS):]) == {RECOMPUTE_OFFLOAD}
    assert [(int(a), int(b)) for a, b in zip(w[2 + len(TIMINGS):], d[2 + len(TIMINGS):])] == list(TIMINGS)
    assert list(_to_options(codes, w, d)) == list(opts)
    # the marginal model is the simulator, option by option
    n = task.n
    for u in range(n):
        for o in np.flatnonzero(task.option_ok[u]):
            c, ww, dd = (np.where(np.arange(n) == u, x[o], y) for x, y in zip((codes, w, d), (KEEP, 1, 1)))
            peak, t = task.sim.evaluate(c[None], ww[None], dd[None])
            assert t[0] - task.base_time == pytest.approx(task.marg_time[u, o], rel=1e-9, abs=1e-15)


def test_masks_keep_the_recompute_offload_optimum_reachable():
    """Played through the environment, the enumeration's optimum with recompute_offload allowed is reachable: every
    action it takes is allowed by the masks (the marginal model is exact for memory where every group depends on one
    unit: no shared boundaries), and the episode's exact time is the optimum's."""

    used = set()
    for seed, frac in ((1, 0.0), (2, 0.1), (4, 0.05)):
        prof = chain_profile(4, seed=seed, shared_boundaries=0.0)
        space = {"strategies": STRATEGIES, "offload_state": False}
        lo = solvers.min_peak(prof, **space)
        budget = int(lo + frac * (prof.peak_bytes - lo))
        best = solvers.brute_force(prof, budget, **space)
        used |= set(best.strategies)
        env = MemoryPlanningEnv(PlanningTask(prof, budget, offload_state=False, strategies=STRATEGIES))
        info = play(env, best, [STRATEGIES.index(s) for s in best.strategies])
        assert info["strategy"]["feasible"]
        assert info["strategy"]["time"] == pytest.approx(best.predicted_step_time, rel=1e-12)
    assert "recompute_offload" in used


def test_search_with_recompute_offload_stays_in_its_space(chain):
    plan = memopt.search(chain, "50%", total_timesteps=400, seed=0, strategies=("keep", "recompute_offload"))
    assert plan.feasible and set(plan.strategies) <= {"keep", "recompute_offload"}
    assert "recompute_offload" in plan.strategies
    assert plan.meta["allowed_strategies"] == ["keep", "recompute_offload"]
    assert memopt.simulate(chain, plan).peak_bytes <= plan.budget_bytes
    wide = memopt.search(chain, "50%", total_timesteps=400, seed=0, strategies=STRATEGIES)
    assert wide.feasible and wide.meta["allowed_strategies"] == list(STRATEGIES)
    again = memopt.search(chain, "50%", total_timesteps=400, seed=0, strategies=STRATEGIES[::-1])
    assert comparable(again) == comparable(wide)  # same seed, same plan


def test_the_wide_space_gets_more_ppo_epochs_unless_the_config_says(chain, monkeypatch):
    """default_update_epochs: 8 epochs where recompute_offload or a save-set may be chosen, 4 otherwise; a config
    the caller passes keeps its own."""
    import importlib

    from memopt_nb.planners.rl.ppo import PPOConfig
    from memopt_nb.planners.rl.search import default_update_epochs

    assert default_update_epochs(PlanningTask(chain, "50%")) == 4
    assert default_update_epochs(PlanningTask(chain, "50%", strategies=("keep", "recompute_offload"))) == 8
    search_mod = importlib.import_module("memopt_nb.planners.rl.search")  # the module, not the function
    seen = []
    real = search_mod.train

    def spy(make_env, config, **kw):
        seen.append(config.update_epochs)
        return real(make_env, config, **kw)

    monkeypatch.setattr(search_mod, "train", spy)
    memopt.search(chain, "50%", total_timesteps=200, seed=0, restarts=1)
    memopt.search(chain, "50%", total_timesteps=200, seed=0, restarts=1, strategies=STRATEGIES)
    memopt.search(chain, "50%", total_timesteps=200, seed=0, restarts=1, strategies=STRATEGIES,
                  config=PPOConfig(update_epochs=3))
    assert seen == [4, 8, 3]
