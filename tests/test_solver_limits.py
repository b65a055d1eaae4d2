"""No plan depends on the clock: HiGHS is stopped by a count of work, not by seconds.

Every MILP the planners solve gets HiGHS's node limit (:data:`~memopt_nb.planners.milp.NODE_LIMIT`); its wall-clock
limit is only a safety net far above it, and ``plan.meta["solver_stop"]`` says which one ended a solve. These tests
capture the options SciPy receives, stop a solve by its node limit on purpose, and plan the zoo GPT and a transformers
GPT-2 on a quiet machine and again with two processes competing for the CPU (which slows HiGHS itself, unlike a slowed
Python clock): the plans must be the same.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

import memopt_nb as memopt
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners import heads, polish
from memopt_nb.planners import milp as milp_mod

MiB = 2**20
# a loop that ends on its own, so that a burner the test could not kill does not outlive it by long
_BURN = "import time\nend = time.monotonic() + 300\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def cpu_burners(count: int = 2) -> Iterator[None]:
    """``count`` processes spinning on the CPU while the block runs; killed after it."""
    procs = [subprocess.Popen([sys.executable, "-c", _BURN]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


@pytest.fixture
def captured(monkeypatch):
    """The ``options`` of every SciPy ``milp`` call the planners make."""
    calls: list[dict] = []
    real = milp_mod.milp

    def spy(*args, **kwargs):
        calls.append(dict(kwargs.get("options") or {}))
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
        assert options["node_limit"] == milp_mod.NODE_LIMIT
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


# ---------------------------------------------------------------------- real models, quiet and loaded
def _zoo_gpt():
    m = memopt.zoo.gpt(batch_size=2, seq_len=32, vocab=128, d_model=64, n_layers=2, n_heads=4)
    return m.model, m.inputs, m.loss_fn


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_layer=2, n_embd=64, n_head=4,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, (ids,), lambda out: out.logits.float().logsumexp(-1).mean()


MODELS = {"zoo_gpt": _zoo_gpt, "hf_gpt2": _hf_gpt2}


@pytest.fixture(scope="module", params=list(MODELS))
def fine_profile(request):
    model, inputs, loss_fn = MODELS[request.param]()
    opt = torch.optim.Adam(model.parameters())
    return memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units="fine")


def _plans(prof):
    # the exact planner over activations only (its full space branches for minutes at 14 units on a loaded machine)
    lo = memopt.solvers.min_peak(prof, device="a100-40gb", offload_state=False)
    exact = memopt.solvers.optimal(prof, int(lo + 0.5 * (prof.peak_bytes - lo)), device="a100-40gb",
                                   offload_state=False)
    found = memopt.search(prof, "50%", device="a100-40gb", total_timesteps=256, seed=0)
    return exact, found


@pytest.mark.slow
def test_the_same_plans_on_a_quiet_machine_and_with_two_processes_competing(fine_profile):
    exact, found = _plans(fine_profile)
    with cpu_burners():
        exact_loaded, found_loaded = _plans(fine_profile)
    assert exact.meta["solver_stop"] != "time_limit" and exact_loaded.meta["solver_stop"] != "time_limit"
    assert exact_loaded == exact and exact_loaded.predicted_step_time == exact.predicted_step_time
    assert found_loaded == found and found_loaded.predicted_step_time == found.predicted_step_time
    assert found.meta["polish"] == "ran"
