"""No plan depends on the clock: HiGHS is stopped by counts of work, not by seconds, and ``time_limit=`` of the
search caps it whole and says when it cut.

Every MILP the planners solve gets HiGHS's node limit (:func:`~memopt_nb.planners.milp.node_limit`, fewer nodes for a
larger program) and a fixed seed; its wall-clock limit is only a safety net far above them, and
``plan.meta["solver_stop"]`` says which one ended a solve. These tests capture the options SciPy receives, stop a solve
by its node limit on purpose, cut a search's polish by its time limit, and plan the zoo GPT and a transformers GPT-2
at a few dozen and at 168 fine units on a quiet machine and again with two processes competing for the CPU (which
slows HiGHS itself, unlike a slowed Python clock): the plans must be the same.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import memopt_nb as memopt
from memopt_nb.harness.load import cpu_burners
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners import heads, polish
from memopt_nb.planners import milp as milp_mod

MiB = 2**20


@pytest.fixture
def captured(monkeypatch):
    """The ``options`` of every SciPy ``milp`` call the planners make."""
    calls: list[dict] = []
    real = milp_mod.milp

    def spy(*args, **kwargs):
        calls.append({**(kwargs.get("options") or {}), "nonzeros": kwargs["constraints"].A.nnz})
        return real(*args, **kwargs)

    monkeypatch.setattr(milp_mod, "milp", spy)
    return calls


def _state_chain():
    # a chain with state to place whose last solve branches (tens of nodes): the node limit can end it
    return chain_profile(8, seed=0, state_bytes=4 * MiB)


def test_every_solve_gets_a_node_limit_and_a_clock_only_as_a_safety_net(captured):
    plan = memopt.solvers.optimal(_state_chain(), "50%", device="a100-40gb")
    assert len(captured) >= 2  # the floor, the cut-off's smaller problems and the full one
    for options in captured:
        assert options["node_limit"] == milp_mod.node_limit(options["nonzeros"]) == milp_mod.NODE_LIMIT
        assert options["random_seed"] == milp_mod.RANDOM_SEED
        assert options["time_limit"] >= 60.0  # far above what these solves take
        assert options["mip_rel_gap"] == 0.0
    assert plan.meta["solver_stop"] == "optimal" and plan.meta["proven_optimal"]
    # the planners' own wall-clock limits are safety nets of the same size
    assert polish.PLACEMENT_SOLVE_SECONDS >= 60.0 and heads.CHOOSE_TIME_LIMIT >= 60.0


def test_the_polish_placement_solves_get_the_node_limit_and_say_what_ended_them(captured):
    plan = memopt.search(_state_chain(), "60%", device="a100-40gb", total_timesteps=300, seed=4)
    stops = plan.meta["polish_placement_stops"]
    assert stops and set(stops) <= {"optimal", "node_limit", "infeasible"}
    assert captured and all(o["node_limit"] == milp_mod.NODE_LIMIT for o in captured)


def test_a_larger_program_gets_fewer_nodes_down_to_a_floor():
    full, floor = milp_mod.NODE_FULL_NONZEROS, milp_mod.MIN_NODES
    sizes = [1, full, full + 1, 2 * full, 5 * full, 10**9]
    nodes = [milp_mod.node_limit(s) for s in sizes]
    assert nodes[:2] == [milp_mod.NODE_LIMIT] * 2 and nodes[-1] == floor
    assert all(a >= b for a, b in zip(nodes, nodes[1:], strict=False)) and nodes[3] < nodes[1]
    assert milp_mod.node_limit(2 * full) == milp_mod.NODE_LIMIT // 4


def test_at_depth_the_polish_places_no_state_by_milp(monkeypatch):
    """Above PLACEMENT_MAX_UNITS units the exact-placement starts are skipped (their MILP has millions of nonzeros
    there), and say so; below it they are solved."""
    from memopt_nb.planners.task import PlanningTask

    calls = []
    monkeypatch.setattr(polish, "place_states", lambda *a, **k: calls.append(1) or [0] * len(a[2]))
    for n, solved in ((polish.PLACEMENT_MAX_UNITS + 1, False), (8, True)):
        task = PlanningTask(chain_profile(n, seed=1, state_bytes=4 * MiB), "70%", "a100-40gb")
        keep = polish.option_arrays(task.plain_options())
        current = (*keep, np.zeros(n, dtype=np.int64))
        info: dict = {}
        calls.clear()
        polish.polish_exact_placements(task, current, current, 0, info)
        assert bool(calls) == solved and (info["polish_placement_skipped"] == 0) == solved


def test_a_solve_the_node_limit_ends_says_so_and_gives_the_same_plan_under_load(monkeypatch):
    """With a node limit so small that it ends the full problem's solve, the plan is whatever HiGHS had after that
    many nodes: the same with two processes competing for the CPU (a time limit would end it at another point)."""
    monkeypatch.setattr(milp_mod, "NODE_LIMIT", 3)
    prof = _state_chain()
    quiet = memopt.solvers.optimal(prof, "50%", device="a100-40gb")
    assert quiet.meta["solver_stop"] == "node_limit" and not quiet.meta["proven_optimal"]
    with cpu_burners():
        loaded = memopt.solvers.optimal(prof, "50%", device="a100-40gb")
    assert loaded.meta["solver_stop"] == "node_limit"
    assert loaded == quiet and loaded.predicted_step_time == quiet.predicted_step_time


def test_stopped_by_names_each_end():
    from types import SimpleNamespace as R

    assert milp_mod.stopped_by(R(status=0, message="Optimization terminated successfully.")) == "optimal"
    assert milp_mod.stopped_by(R(status=2, message="The problem is infeasible.")) == "infeasible"
    assert milp_mod.stopped_by(R(status=1, message="Time limit reached. (HiGHS Status 13: ...)")) == "time_limit"
    assert milp_mod.stopped_by(R(status=1, message="(HiGHS Status 16: Solution limit reached)")) == "node_limit"


# ---------------------------------------------------------------------- the time limit of the search
def test_a_time_limit_that_passes_before_the_polish_cuts_it_and_the_plan_says_so():
    """``time_limit=`` caps the whole search: passed once the agents have trained one update, it stops the polish
    too (no round, no placement solve, no baseline start), and the plan says that the clock cut it."""
    prof = _state_chain()
    cut = memopt.search(prof, "60%", device="a100-40gb", total_timesteps=2_000, seed=0, time_limit=1e-6)
    assert cut.meta["cut_by_time_limit"] and cut.meta["stopped"] == "time limit"
    assert cut.meta["polish"] == "cut by the time limit"
    assert cut.meta["polish_moves"] == 0 and cut.meta["polish_heuristic_starts"] == []
    assert cut.meta["polish_placement_stops"] == []  # no solve was begun
    assert cut.feasible and cut.predicted_step_time == cut.meta["agents_step_time"]  # the agents' plan, as found
    full = memopt.search(prof, "60%", device="a100-40gb", total_timesteps=2_000, seed=0)
    assert not full.meta["cut_by_time_limit"] and full.meta["polish"] == "ran"
    assert full.predicted_step_time <= cut.predicted_step_time


# ---------------------------------------------------------------------- real models, quiet and loaded
def _zoo_gpt(layers: int):
    m = memopt.zoo.gpt(batch_size=2, seq_len=32, vocab=128, d_model=64, n_layers=layers, n_heads=4)
    return m.model, m.inputs, m.loss_fn


def _hf_gpt2(layers: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_layer=layers, n_embd=64, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, (ids,), lambda out: out.logits.float().logsumexp(-1).mean()


#: (model, layers) -> fine units: the zoo GPT splits a block into 4 units, GPT-2 into 7
CASES = {"zoo_gpt-24": (_zoo_gpt, 6), "hf_gpt2-28": (_hf_gpt2, 4),
         "zoo_gpt-168": (_zoo_gpt, 42), "hf_gpt2-168": (_hf_gpt2, 24)}


#: the cases CI runs; the others (minutes each on 2 cores) with MEMOPT_NB_ALL_SOLVER_CASES=1, and their table in
#: ``benchmarks/solver_determinism.py``
IN_CI = ("zoo_gpt-24",)


def _fine_profile(name: str):
    if name not in IN_CI and not os.environ.get("MEMOPT_NB_ALL_SOLVER_CASES"):
        pytest.skip(f"{name}: minutes on 2 cores; MEMOPT_NB_ALL_SOLVER_CASES=1 runs it "
                    "(benchmarks/solver_determinism.py "
                    "prints every case)")
    build, layers = CASES[name]
    model, inputs, loss_fn = build(layers)
    opt = torch.optim.Adam(model.parameters())
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    assert prof.n_units == int(name.rsplit("-", 1)[1])
    return prof


def _quiet_and_loaded(prof, plan_fn):
    quiet = plan_fn(prof)
    with cpu_burners():
        loaded = plan_fn(prof)
    return quiet, loaded


def _default_search(prof):
    return memopt.search(prof, "50%", seed=0)  # every default: state placements, timesteps, patience, polish


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_the_default_search_gives_the_same_plan_quiet_and_with_two_processes_competing(name):
    quiet, loaded = _quiet_and_loaded(_fine_profile(name), _default_search)
    for plan in (quiet, loaded):
        assert plan.feasible and plan.meta["polish"] == "ran" and not plan.meta["cut_by_time_limit"]
        assert "time_limit" not in plan.meta["polish_placement_stops"]
    assert loaded == quiet and loaded.predicted_step_time == quiet.predicted_step_time
    assert loaded.meta["timesteps_run"] == quiet.meta["timesteps_run"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zoo_gpt-24", "hf_gpt2-28"])
def test_the_exact_planner_gives_the_same_plan_quiet_and_with_two_processes_competing(name):
    def exact(prof):
        return memopt.solvers.optimal(prof, "50%")

    quiet, loaded = _quiet_and_loaded(_fine_profile(name), exact)
    assert quiet.meta["solver_stop"] != "time_limit" and loaded.meta["solver_stop"] != "time_limit"
    assert loaded == quiet and loaded.predicted_step_time == quiet.predicted_step_time
