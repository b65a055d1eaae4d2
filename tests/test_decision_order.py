"""The order in which an episode decides the units (``MemoryPlanningEnv(order=)``, :func:`decision_order`).

Where state may move, the environment decides the units with the largest state first. The masks stay exact in any
order (``test_rl.py``'s mask and marginal-model tests run over orders; ``test_rl_fast_paths.py`` checks the batched
steps). Here: what the order is, that a wrong one is refused, and what it is for — on a ConvNeXt-Atto whose two last
blocks hold most of the state, the agents alone, walking forward, offloaded those and ended 1.23× the optimum's step
time at 60 % of the way from the floor (benchmarks/RESULTS.md); deciding them first, they come close to it. And
``search(order=)`` passes its order to the environment and records it.
"""

from pathlib import Path

import numpy as np
import pytest

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.errors import PlanError
from memopt_nb.planners.rl.env import MemoryPlanningEnv, decision_order
from memopt_nb.planners.task import PlanningTask

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def convnext():
    """A profile of the zoo's ConvNeXt-Atto with Adam (saved, so that the figures do not move with the machine)."""
    return memopt.ModelProfile.load(DATA / "convnext_atto_adam_profile.json")


def test_the_largest_states_are_decided_first_and_activations_only_walk_forward(convnext):
    task = PlanningTask(convnext, "80%", "a100-40gb", offload_state=True)
    order = decision_order(task)
    names = [convnext.units[u].name for u in order]
    assert names[:2] == ["blocks.10", "blocks.11"]  # the last stage: 4x the state of any other block
    assert sorted(order) == list(range(task.n)) and list(order) != list(range(task.n))
    # within one power of two, forward order: the third stage's blocks follow in their own order
    third = [n for n in names if n.startswith("blocks.") and 4 <= int(n.split(".")[1]) <= 9]
    assert third == [f"blocks.{i}" for i in range(4, 10)]
    env = MemoryPlanningEnv(task)
    assert list(env.order) == list(order)
    assert list(MemoryPlanningEnv(task, order="forward").order) == list(range(task.n))
    assert list(MemoryPlanningEnv(task, order=order[::-1]).order) == list(order[::-1])
    lean = PlanningTask(convnext, "100%", "a100-40gb", offload_state=False)
    assert list(decision_order(lean)) == list(range(lean.n))  # no placements: the model's order


@pytest.mark.parametrize("order", ["backward", [0, 1, 1], list(range(3))])
def test_a_wrong_order_is_refused(convnext, order):
    task = PlanningTask(convnext, "80%", "a100-40gb", offload_state=True)
    with pytest.raises(PlanError, match="order"):
        MemoryPlanningEnv(task, order=order)


def test_search_takes_the_order_records_it_and_refuses_a_wrong_one_before_training(convnext):
    task = PlanningTask(convnext, "80%", "a100-40gb", offload_state=True)
    state, forward = [int(u) for u in decision_order(task)], list(range(task.n))
    rows = []
    with pytest.raises(PlanError, match="order"):
        memopt.search(convnext, "80%", "a100-40gb", total_timesteps=500, order="backward", callback=rows.append)
    assert rows == []  # refused before any PPO iteration
    kw = {"total_timesteps": 1000, "polish_plan": False, "restarts": 2}
    plans = {o: memopt.search(convnext, "80%", "a100-40gb", order=o, **kw) for o in ("state", "forward")}
    assert plans["state"].meta["decision_order"] == state and plans["forward"].meta["decision_order"] == forward
    assert memopt.search(convnext, "80%", "a100-40gb", **kw).meta["decision_order"] == state  # the default
    assert plans["state"].meta["best_restart"] in (0, 1)
    returns = [[r["reward_strategy"] for r in plan.meta["history"]] for plan in plans.values()]
    assert returns[0] != returns[1]  # the order reached the agents' environment
    mine = state[::-1]
    assert memopt.search(convnext, "80%", "a100-40gb", order=mine, **kw).meta["decision_order"] == mine


@pytest.mark.slow  # search quality
def test_deciding_the_largest_states_first_brings_the_agents_near_the_optimum(convnext):
    """The case the forward walk got 1.23x on: ConvNeXt-Atto, A100 preset, 60 % of the way from the whole-step floor
    to the unoptimized peak, agents alone (no polish) ÷ the MILP's optimum."""
    sim = memopt.Simulator(convnext, "a100-40gb")
    lo = solvers.min_peak(sim, offload_state=True)
    budget = int(lo + 0.6 * (convnext.peak_bytes - lo))
    best = solvers.optimal(sim, budget, time_limit=60, offload_state=True)
    plan = memopt.search(convnext, budget, "a100-40gb", seed=0, offload_state=True, polish_plan=False)
    ratio = plan.meta["agents_step_time"] / best.predicted_step_time
    assert np.isfinite(ratio) and ratio <= 1.10, ratio
    kept = {d.unit for d in plan.decisions if d.optimizer == "resident"}
    assert {"blocks.10", "blocks.11"} <= kept  # as the optimum: their optimizer state stays on the device
