"""The planning side of ``selective`` (selective activation checkpointing): the cost model and its reference, the
plan space, the exact MILP against brute force, the op-SAC baseline and the errors.

Profiles made with ``selective=True`` carry measured save-sets; here they are filled synthetically
(:func:`add_save_sets`) on chains and on the saved zoo GPT profile, with costs chosen so that selective is sometimes
the best choice (a save-set holds less than the unit's interior saved bytes and recomputes in less than its forward).
"""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from helpers.planning import add_save_sets

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.device import DeviceSpec
from memopt_nb.core.plan import DEFAULT_STRATEGIES, SAVE_SETS, STRATEGIES, Decision, Plan
from memopt_nb.core.profile import ModelProfile
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.sim.replay import replay
from memopt_nb.sim.simulator import CODES, NAMES, RECOMPUTE, SELECTIVE, SWAP, Simulator, code_of, save_set_of

DATA = Path(__file__).parent / "data"
CPU_LIKE = DeviceSpec(name="cpu-like", kind="cpu", capacity_bytes=2**34, h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9,
                      compute_flops=1e11, copy_overlap=False)
SLOW_LINK = DeviceSpec.preset("a100-40gb").with_changes(name="a100-slow-link", h2d_bytes_per_s=2e9,
                                                        d2h_bytes_per_s=1e9)


def zoo_gpt():
    return ModelProfile.load(DATA / "zoo_gpt_profile.json")


def random_selective_arrays(sim, count, seed):
    """``count`` random plans over every code, selective codes only where the unit has that save-set."""
    rng = np.random.default_rng(seed)
    n = sim.n
    s = rng.integers(0, SELECTIVE + len(SAVE_SETS), (count, n))
    j = np.clip(s - SELECTIVE, 0, len(SAVE_SETS) - 1)
    bad = (s >= SELECTIVE) & ~sim.sel_has[np.arange(n)[None], j]
    s = np.where(bad, RECOMPUTE, s)
    w, d = rng.integers(0, 3, (count, n)), rng.integers(0, 4, (count, n))
    return s, w, d


def assert_fast_equals_reference(prof, device, count=40, seed=0):
    sim = Simulator(prof, device)
    s, w, d = random_selective_arrays(sim, count, seed)
    assert (s >= SELECTIVE).any(axis=1).mean() > 0.5
    det = sim.evaluate(s, w, d, details=True)
    for b in range(len(s)):
        ref = replay(prof, s[b], w[b], d[b], device=sim.device)
        where = (sim.device.name, s[b].tolist(), w[b].tolist(), d[b].tolist())
        assert det["peak"][b] == ref.peak_bytes, where
        assert det["peaks"][b].tolist() == ref.segment_peaks, where
        assert det["time"][b] == pytest.approx(ref.step_time, rel=1e-9), where
        assert det["recompute"][b] == pytest.approx(ref.recompute_time, rel=1e-9, abs=1e-15), where
        assert det["offloaded"][b] == ref.bytes_offloaded, where
        assert det["fwd_stall"][b] == pytest.approx(ref.fwd_stall_time, rel=1e-9, abs=1e-15), where
        assert det["bwd_stall"][b] == pytest.approx(ref.bwd_stall_time, rel=1e-9, abs=1e-15), where


# ---------------------------------------------------------------------- codes
def test_codes_name_every_save_set():
    assert CODES["selective"] == SELECTIVE == 4
    for j, name in enumerate(SAVE_SETS):
        assert code_of("selective", name) == SELECTIVE + j
        assert NAMES[SELECTIVE + j] == "selective"
        assert save_set_of(SELECTIVE + j) == name
    for name in ("keep", "recompute", "swap", "recompute_offload"):
        assert save_set_of(code_of(name)) == ""
        assert NAMES[code_of(name)] == name
    with pytest.raises(memopt.PlanError, match="save-set"):
        code_of("selective")
    with pytest.raises(memopt.PlanError, match="not a strategy"):
        save_set_of(len(NAMES))  # past the registry's last code


# ---------------------------------------------------------------------- the cost model
@pytest.mark.parametrize("n,seed,shared", [(5, 0, 0.8), (7, 2, 0.3), (12, 3, 0.3)])
def test_fast_simulator_equals_reference_with_selective_on_chains(n, seed, shared):
    prof = add_save_sets(chain_profile(n, seed=seed, shared_boundaries=shared), seed)
    for device in (CPU_LIKE, None, SLOW_LINK):
        assert_fast_equals_reference(prof, device, seed=seed)


def test_fast_simulator_equals_reference_with_selective_on_the_zoo_gpt():
    prof = add_save_sets(zoo_gpt(), 1, offered=0.9)
    for device in (None, "a100-40gb", SLOW_LINK):
        assert_fast_equals_reference(prof, device, count=60, seed=2)


def test_a_selective_unit_holds_its_save_set_and_recomputes_the_rest():
    """Against recompute: the segments between its forward and its backward (inclusive) hold exactly the save-set's
    bytes more, its own segments use the save-set's peaks, and the step recomputes the save-set's time instead of the
    forward; nothing else changes."""
    prof = add_save_sets(chain_profile(5, seed=1, shared_boundaries=0.0), 1, offered=1.0)
    sim = Simulator(prof, SLOW_LINK)
    n, u = prof.n_units, 2
    up = prof.units[u]
    ones = np.ones((1, n), dtype=np.int64)
    rc = sim.evaluate(ones, ones, ones, details=True)
    for j, name in enumerate(SAVE_SETS):
        s = ones.copy()
        s[0, u] = SELECTIVE + j
        sel = sim.evaluate(s, ones, ones, details=True)
        entry = up.save_sets[name]
        diff = sel["peaks"][0] - rc["peaks"][0]
        for k in range(sim.S):
            want = entry["held_bytes"] if up.fwd_segment < k <= up.bwd_segment else 0
            if k == up.fwd_segment:
                want = entry["fwd_rel_peak"] - up.rc_fwd_rel_peak
            elif k == up.bwd_segment:
                want += entry["bwd_rel_peak"] - up.rc_bwd_rel_peak
            assert diff[k] == want, (name, k)
        fwd_time = prof.segments[up.fwd_segment].time
        want_time = (entry["recompute_time"] - fwd_time) * sim.factor
        assert sel["recompute"][0] - rc["recompute"][0] == pytest.approx(want_time)


def test_plans_without_selective_evaluate_as_before():
    """A batch with a selective plan in it gives the other plans exactly what they get alone, and a profile with
    save-sets scores default-space plans exactly as the same profile without them."""
    bare = chain_profile(7, seed=2, shared_boundaries=0.6)
    prof = add_save_sets(bare, 2)
    n = prof.n_units
    rng = np.random.default_rng(3)
    s, w, d = rng.integers(0, 4, (30, n)), rng.integers(0, 3, (30, n)), rng.integers(0, 4, (30, n))
    for device in (None, SLOW_LINK, CPU_LIKE):
        sim = Simulator(prof, device)
        alone = sim.evaluate(s, w, d, details=True)
        before = Simulator(bare, device).evaluate(s, w, d, details=True)
        sel, _, _ = random_selective_arrays(sim, 1, 0)
        mixed = sim.evaluate(np.vstack([s, sel]), np.vstack([w, w[:1]]), np.vstack([d, d[:1]]), details=True)
        for key in ("peak", "time", "peaks", "offloaded", "fwd_stall", "bwd_stall", "recompute"):
            assert np.array_equal(alone[key], mixed[key][:-1]), (key, device)
            assert np.array_equal(alone[key], before[key]), (key, device)


def test_a_save_set_the_profile_lacks_is_refused():
    prof = add_save_sets(chain_profile(4, seed=0), 0, offered=1.0)
    units = list(prof.units)
    units[1] = dataclasses.replace(units[1], save_sets={k: v for k, v in units[1].save_sets.items() if k != "matmuls"})
    prof = dataclasses.replace(prof, units=units)
    sim = Simulator(prof)
    s = np.zeros((1, 4), dtype=np.int64)
    s[0, 1] = code_of("selective", "matmuls")
    with pytest.raises(memopt.PlanError, match="does not offer"):
        sim.evaluate(s, s, s)
    with pytest.raises(memopt.PlanError, match="does not offer"):
        replay(prof, s[0], s[0], s[0])
    with pytest.raises(memopt.PlanError, match="selective:<save-set>"):
        replay(prof, ["selective"] * 4, [1] * 4, [1] * 4)


def test_a_selective_plan_simulates_from_its_decisions():
    """simulate() of a Plan with selective decisions (save_set on the Decision) equals the arrays and the reference
    given names as 'selective:<set>'."""
    prof = add_save_sets(chain_profile(5, seed=4), 4, offered=1.0)
    names = [u.name for u in prof.units]
    decisions = [Decision(names[0], "keep"), Decision(names[1], "selective", save_set="alternate",
                                                      save_ops=prof.units[1].save_sets["alternate"]["ops"]),
                 Decision(names[2], "swap", 0, 1), Decision(names[3], "selective", save_set="matmuls",
                                                            save_ops=[["aten.mm.default", 0]]),
                 Decision(names[4], "recompute")]
    plan = Plan(decisions=tuple(decisions), fingerprint=prof.fingerprint)
    res = memopt.simulate(prof, plan, device=SLOW_LINK)
    codes = [0, code_of("selective", "alternate"), SWAP, code_of("selective", "matmuls"), RECOMPUTE]
    peak, t = Simulator(prof, SLOW_LINK).evaluate(np.array([codes]), np.array([[1, 1, 0, 1, 1]]),
                                                  np.ones((1, 5), dtype=np.int64))
    assert res.peak_bytes == int(peak[0]) and res.step_time == pytest.approx(float(t[0]), rel=1e-12)
    ref = replay(prof, ["keep", "selective:alternate", "swap", "selective:matmuls", "recompute"], [1, 1, 0, 1, 1],
                 [1] * 5, device=SLOW_LINK)
    assert ref.peak_bytes == res.peak_bytes
    assert plan.counts()["selective"] == 2
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json()).decisions[1].save_ops == tuple(
        tuple(x) for x in prof.units[1].save_sets["alternate"]["ops"])
    other = dataclasses.replace(plan, decisions=(decisions[0], dataclasses.replace(
        decisions[1], save_set="matmuls", save_ops=prof.units[1].save_sets["matmuls"]["ops"]), *decisions[2:]))
    assert plan.same_decisions(plan) and not plan.same_decisions(other)


# ---------------------------------------------------------------------- the plan space and the exact MILP
SEL_CASES = [(n, seed, strategies, device) for n, seed in ((3, 0), (4, 1), (4, 2))
             for strategies in (("keep", "recompute", "swap", "selective"), STRATEGIES)
             for device in (None, CPU_LIKE)] + [
    (6, seed, ("keep", "recompute", "selective"), None) for seed in range(3)]


@pytest.mark.parametrize("n,seed,strategies,device", SEL_CASES)
def test_exact_solver_matches_brute_force_with_selective(n, seed, strategies, device):
    if len(strategies) == len(STRATEGIES) and n > 3:
        n = 3  # every option of every strategy: keep brute force small
    from helpers.planning import assert_exact_equals_brute_force

    prof = add_save_sets(chain_profile(n, seed=seed, shared_boundaries=0.5, device=device), seed, pareto=0.7)
    space = {"strategies": strategies, "offload_state": False}
    without = tuple(s for s in strategies if s != "selective")
    assert solvers.min_peak(prof, **space) <= solvers.min_peak(prof, strategies=without, offload_state=False)
    assert_exact_equals_brute_force(prof, space, (0.0, 0.15, 0.5), abs_tol=0.0)


def test_selective_is_chosen_where_it_wins_and_its_plan_carries_the_ops():
    """Near the floor of the checkpointing space, selective (which holds a part of the interior and recomputes less)
    gives a faster plan than keep/recompute alone; the plan's selective decisions carry the profile's ops, survive
    JSON, and simulate to the solver's prediction without the save-sets' profile entries being looked up again."""
    prof = add_save_sets(chain_profile(6, seed=5, shared_boundaries=0.3), 5, offered=1.0, pareto=1.0)
    ckpt = ("keep", "recompute")
    lo = solvers.min_peak(prof, strategies=ckpt, offload_state=False)
    budget = int(lo + 0.2 * (prof.peak_bytes - lo))
    wide = solvers.optimal(prof, budget, strategies=ckpt + ("selective",), offload_state=False)
    narrow = solvers.optimal(prof, budget, strategies=ckpt, offload_state=False)
    assert "selective" in wide.strategies
    assert wide.predicted_step_time < narrow.predicted_step_time
    for u, d in enumerate(wide.decisions):
        if d.strategy == "selective":
            assert d.save_set in prof.units[u].save_sets
            assert [list(x) for x in d.save_ops] == prof.units[u].save_sets[d.save_set]["ops"]
    again = Plan.from_json(wide.to_json())
    assert again == wide and again.counts()["selective"] == wide.counts()["selective"] > 0
    assert memopt.simulate(prof, again).step_time == pytest.approx(wide.predicted_step_time, rel=1e-12)


def test_unit_options_offer_the_pareto_save_sets_of_recomputable_units_only_when_asked():
    from memopt_nb.planners.options import unit_options

    prof = add_save_sets(chain_profile(5, seed=6), 6, offered=0.7, pareto=0.6)
    units = list(prof.units)
    units[0] = dataclasses.replace(units[0], recomputable=False)
    prof = dataclasses.replace(prof, units=units)
    sim = Simulator(prof)
    for u in range(sim.n):
        assert all(o[0] < SELECTIVE for o in unit_options(sim, u))  # opt-in
        sel = [o for o in unit_options(sim, u, ("keep", "selective")) if o[0] >= SELECTIVE]
        want = [] if u == 0 else [SELECTIVE + j for j, name in enumerate(SAVE_SETS)
                                  if prof.units[u].save_sets.get(name, {}).get("pareto")]
        assert [o[0] for o in sel] == want
        assert all(o[1:] == (1, 1) for o in sel)  # the default timing: nothing reads it
    assert any(not e["pareto"] for up in prof.units for e in up.save_sets.values())


def test_selective_without_save_sets_is_refused_by_name():
    """A profile made without selective=True: asking for selective raises PlanError saying how to profile; the whole
    of plan.STRATEGIES ("everything") just offers no selective option there."""
    prof = chain_profile(4, seed=0)
    for call in (lambda: solvers.optimal(prof, "70%", strategies=("keep", "recompute", "selective")),
                 lambda: solvers.min_peak(prof, strategies="keep,selective"),
                 lambda: solvers.brute_force(prof, "70%", strategies=("keep", "selective"), offload_state=False),
                 lambda: solvers.op_sac(prof)):
        with pytest.raises(memopt.PlanError, match=r"no save-sets: profile the model with memopt.profile\(\.\.\., "
                                                   r"selective=True\)"):
            call()
    plan = solvers.optimal(prof, "70%", strategies=STRATEGIES, offload_state=False)
    assert "selective" not in plan.strategies
    assert plan.meta["allowed_strategies"] == list(STRATEGIES)


def test_default_space_plans_are_unchanged_by_save_sets():
    """Save-sets in a profile change nothing for a planner that is not asked for selective: the same plans, number
    for number."""
    bare = chain_profile(6, seed=7, shared_boundaries=0.4)
    prof = add_save_sets(bare, 7)
    for strategies in (DEFAULT_STRATEGIES, ("keep", "recompute", "swap", "recompute_offload")):
        assert solvers.min_peak(prof, strategies=strategies, offload_state=False) == solvers.min_peak(
            bare, strategies=strategies, offload_state=False)
        a = solvers.optimal(prof, "60%", strategies=strategies, offload_state=False)
        b = solvers.optimal(bare, "60%", strategies=strategies, offload_state=False)
        assert a.decisions == b.decisions and a.predicted_step_time == b.predicted_step_time


# ---------------------------------------------------------------------- the op-SAC baseline
def test_op_sac_is_torchtitans_op_level_sac():
    """Every recomputable unit selective with 'alternate' where its profile has it (Pareto or not), else 'matmuls',
    else recompute; a unit that cannot be recomputed keeps. An ecosystem baseline the bench accepts."""
    from memopt_nb.harness.evaluate import _RULES, ECOSYSTEM_METHODS, KNOWN_METHODS

    assert "op_sac" in solvers.BASELINES and "op_sac" not in solvers.CLASSIC_BASELINES
    assert "op_sac" in ECOSYSTEM_METHODS and "op_sac" in KNOWN_METHODS and "op_sac" in _RULES
    prof = add_save_sets(chain_profile(6, seed=8), 8, offered=1.0, pareto=0.5)
    units = list(prof.units)
    units[1] = dataclasses.replace(units[1], save_sets={k: v for k, v in units[1].save_sets.items()
                                                        if k != "alternate"})
    units[2] = dataclasses.replace(units[2], save_sets={"attention": units[2].save_sets["attention"]})
    units[3] = dataclasses.replace(units[3], recomputable=False)
    units[4] = dataclasses.replace(units[4], save_sets={
        "alternate": {**units[4].save_sets["alternate"], "pareto": False}})
    prof = dataclasses.replace(prof, units=units)
    plan = solvers.op_sac(prof)
    assert plan.method == "op_sac"
    assert plan.strategies == ["selective", "selective", "recompute", "keep", "selective", "selective"]
    assert [d.save_set for d in plan.decisions] == ["alternate", "matmuls", "", "", "alternate", "alternate"]
    assert plan.decisions[1].save_ops == tuple(tuple(x) for x in units[1].save_sets["matmuls"]["ops"])
    assert memopt.simulate(prof, plan).peak_bytes == plan.predicted_peak_bytes
    lo = solvers.min_peak(prof, strategies=STRATEGIES, offload_state=False)
    with pytest.raises(memopt.BudgetError, match="smallest peak"):
        solvers.op_sac(prof, lo - 1)
    tight = solvers.op_sac(prof, plan.predicted_peak_bytes - 1)
    assert tight.feasible is False and tight.decisions == plan.decisions


# ---------------------------------------------------------------------- the RL search
def test_the_agents_offer_selective_when_asked():
    """With selective allowed the strategy agent has one more strategy per save-set, masked where the unit does not
    offer it; the option tables map options to codes both ways; the marginal model of each selective option is the
    simulator's; the env passes PettingZoo's API test. Without it, or on a profile without save-sets under the whole
    of STRATEGIES, the task is what it was."""
    from pettingzoo.test import parallel_api_test

    from memopt_nb.planners.options import SELECTIVE_BASE, TIMINGS, code_options, option_codes
    from memopt_nb.planners.rl.env import MemoryPlanningEnv
    from memopt_nb.planners.task import PlanningTask

    bare = chain_profile(5, seed=3)
    prof = add_save_sets(bare, 3, offered=0.7, pareto=0.7)
    task = PlanningTask(prof, "60%", strategies=("keep", "recompute", "swap", "selective"), offload_state=False)
    assert task.n_strategies == 3 + len(SAVE_SETS) and task.n_options == SELECTIVE_BASE + len(SAVE_SETS)
    assert list(task.action_codes) == [0, 1, SWAP] + [SELECTIVE + j for j in range(len(SAVE_SETS))]
    sim = task.sim
    assert np.array_equal(task.option_ok[:, SELECTIVE_BASE:], sim.recomputable[:, None] & sim.sel_pareto)
    assert not task.option_ok[:, 2 + len(TIMINGS):SELECTIVE_BASE].any()  # recompute_offload: not asked for
    codes, w, d = option_codes(np.arange(task.n_options))
    assert list(codes[SELECTIVE_BASE:]) == [SELECTIVE + j for j in range(len(SAVE_SETS))]
    assert list(code_options(codes, w, d)) == list(range(task.n_options))
    n = task.n
    for u in range(n):
        for o in np.flatnonzero(task.option_ok[u, SELECTIVE_BASE:]) + SELECTIVE_BASE:
            c = np.where(np.arange(n) == u, codes[o], 0)[None]
            det = sim.evaluate(c, np.ones_like(c), np.ones_like(c), details=True)
            assert np.array_equal(det["peaks"][0] - task.base_peaks, task.marg_peak[u, o])
            assert det["time"][0] - task.base_time == pytest.approx(task.marg_time[u, o], rel=1e-9, abs=1e-15)
    env = MemoryPlanningEnv(task)
    assert env.action_space("strategy").n == task.n_strategies * task.C
    parallel_api_test(MemoryPlanningEnv(task), num_cycles=50)
    default = PlanningTask(prof, "60%")
    assert default.n_options == 2 + len(TIMINGS) and default.n_strategies == 3
    every = PlanningTask(bare, "60%", strategies=STRATEGIES)  # no save-sets: selective offers nothing
    without = PlanningTask(bare, "60%", strategies=[s for s in STRATEGIES if s != "selective"])
    assert not every.selective and every.n_strategies == without.n_strategies == len(STRATEGIES) - 1
    assert every.n_options == without.n_options and np.array_equal(every.option_ok, without.option_ok)
    with pytest.raises(memopt.PlanError, match="no save-sets"):
        memopt.search(bare, "70%", total_timesteps=64, strategies=("keep", "selective"))


def test_masks_keep_the_selective_optimum_reachable():
    """Played through the environment, brute force's optimum with selective allowed is reachable: every action it
    takes is allowed by the masks (no shared boundaries: the marginal model is exact for memory), and the episode's
    exact time is the optimum's."""
    from helpers.planning import play

    from memopt_nb.planners.rl.env import MemoryPlanningEnv
    from memopt_nb.planners.task import PlanningTask

    used = set()
    space = {"strategies": ("keep", "recompute", "swap", "selective"), "offload_state": False}
    for seed, frac in ((1, 0.0), (2, 0.1), (4, 0.05), (5, 0.3)):
        prof = add_save_sets(chain_profile(4, seed=seed, shared_boundaries=0.0), seed, pareto=0.8)
        lo = solvers.min_peak(prof, **space)
        budget = int(lo + frac * (prof.peak_bytes - lo))
        best = solvers.brute_force(prof, budget, **space)
        used |= set(best.strategies)
        task = PlanningTask(prof, budget, **space)
        actions = [int(np.flatnonzero(task.action_codes == code_of(d.strategy, d.save_set))[0])
                   for d in best.decisions]
        info = play(MemoryPlanningEnv(task), best, actions)
        assert info["strategy"]["feasible"]
        assert info["strategy"]["time"] == pytest.approx(best.predicted_step_time, rel=1e-12)
    assert "selective" in used


def test_search_with_selective_stays_in_its_space_and_carries_the_ops():
    prof = add_save_sets(chain_profile(6, seed=5, shared_boundaries=0.3), 5, offered=1.0, pareto=1.0)
    lo = solvers.min_peak(prof, strategies=("keep", "recompute"), offload_state=False)
    budget = int(lo + 0.2 * (prof.peak_bytes - lo))
    plan = memopt.search(prof, budget, total_timesteps=600, seed=0, strategies=("keep", "recompute", "selective"))
    assert plan.feasible and set(plan.strategies) <= {"keep", "recompute", "selective"}
    assert "selective" in plan.strategies
    assert plan.meta["allowed_strategies"] == ["keep", "recompute", "selective"]
    for u, d in enumerate(plan.decisions):
        if d.strategy == "selective":
            assert [list(x) for x in d.save_ops] == prof.units[u].save_sets[d.save_set]["ops"]
    assert memopt.simulate(prof, plan).peak_bytes == plan.predicted_peak_bytes <= budget
    exact = solvers.optimal(prof, budget, strategies=("keep", "recompute", "selective"))
    assert plan.predicted_step_time >= exact.predicted_step_time * (1 - 1e-9)


# ---------------------------------------------------------------------- what shows a plan
def test_a_selective_plan_shows_its_save_sets():
    """The unit chart colours selective units with their own colour and names their save-set; the plan's summary
    and HTML count and name them; the demo's shorthand has a letter for them; the magic's --strategies takes it."""
    import matplotlib

    from memopt_nb.harness.demo import _short
    from memopt_nb.notebook import plots
    from memopt_nb.notebook.magics import _parse_strategies

    prof = add_save_sets(chain_profile(4, seed=9), 9, offered=1.0, pareto=1.0)
    lo = solvers.min_peak(prof, strategies=("keep", "recompute"), offload_state=False)
    plan = solvers.optimal(prof, int(lo + 0.2 * (prof.peak_bytes - lo)), strategies=("keep", "recompute", "selective"),
                           offload_state=False)
    picked = [i for i, d in enumerate(plan.decisions) if d.strategy == "selective"]
    assert picked
    fig = plots.unit_chart(prof, plan)
    bars = [p for p in fig.axes[0].patches if p.get_fill()][: prof.n_units]
    for i in picked:
        assert matplotlib.colors.to_rgb(bars[i].get_facecolor()) == pytest.approx(
            plots.STRATEGY_COLORS["selective"], abs=1e-6)
    assert sorted(t.get_text() for t in fig.axes[0].texts) == sorted(plan.decisions[i].save_set for i in picked)
    assert f"selective {len(picked)}" in plan.summary()
    assert plan.decisions[picked[0]].save_set in plan._repr_html_()
    assert _short(plan.decisions[picked[0]]) == "P"
    assert _parse_strategies("keep,selective") == ("keep", "selective")


def test_a_refused_budget_names_the_selective_space():
    """Below the floor of a space with selective (state allowed to move, so the floor's explanation searches the
    placements with selective among the strategies), the BudgetError names the space and the floor."""
    prof = add_save_sets(chain_profile(5, seed=2, state_bytes=8 * 2**20), 2, offered=1.0)
    space = ("keep", "recompute", "selective")
    lo = solvers.min_peak(prof, strategies=space)
    assert lo <= solvers.min_peak(prof, strategies=("keep", "recompute"))
    with pytest.raises(memopt.BudgetError, match="using only keep, recompute, selective") as err:
        solvers.optimal(prof, lo - 1, strategies=space)
    assert memopt.format_bytes(lo) in str(err.value)
    from memopt_nb.planners.floor import state_floor

    found, plan = state_floor(prof, None, space)
    assert found >= lo and memopt.simulate(prof, plan).peak_bytes == found
    found, plan = state_floor(prof, None, ("keep", "selective"))  # selective is the only way to save memory
    assert "selective" in plan.strategies and memopt.simulate(prof, plan).peak_bytes == found
    assert all(d.save_ops for d in plan.decisions if d.strategy == "selective")


def test_a_save_set_without_its_costs_is_a_profile_error():
    prof = add_save_sets(chain_profile(3, seed=0), 0, offered=1.0)
    units = list(prof.units)
    entry = {k: v for k, v in units[1].save_sets["matmuls"].items() if k != "held_bytes"}
    units[1] = dataclasses.replace(units[1], save_sets={**units[1].save_sets, "matmuls": entry})
    with pytest.raises(memopt.ProfileError, match="save-set 'matmuls' lacks held_bytes"):
        Simulator(dataclasses.replace(prof, units=units))
