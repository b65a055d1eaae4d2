"""Plans at depth: a transformers GPT-2 deep enough that ``units="fine"`` gives more than
``STACK_FROM_UNITS`` units, searched at a budget between its fine and block floors with every activation strategy,
trains bit for bit inside that budget. The search there repairs the agents' closest plan where none of theirs fits and
its polish stacks moves; the runtime applies a searched plan of over a hundred units."""

import pytest
import torch
from helpers.depth import train

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.plan import STRATEGIES
from memopt_nb.planners import polish

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]

LAYERS = 16  # 7 fine units a layer: 112 units


def gpt2(transformers):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=64, n_head=4, n_positions=64, vocab_size=500)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 500, (4, 64))
    return model, {"input_ids": ids, "labels": ids}, torch.optim.SGD(model.parameters(), lr=1e-2)


def test_a_deep_gpt2_with_fine_units_trains_bit_for_bit_within_a_budget_between_its_floors():
    transformers = pytest.importorskip("transformers")
    strategies = tuple(s for s in STRATEGIES if s != "selective")
    model, inputs, opt = gpt2(transformers)
    fine = memopt.profile(model, **inputs, loss_fn=lambda o: o.loss, optimizer=opt, units="fine", repeats=1)
    block = memopt.profile(model, **inputs, loss_fn=lambda o: o.loss, optimizer=opt, units="auto", repeats=1)
    assert fine.n_units >= polish.STACK_FROM_UNITS > block.n_units
    lo = solvers.min_peak(fine, None, strategies, offload_state=False)
    hi = solvers.min_peak(block, None, offload_state=False)
    assert lo < hi
    budget = (lo + hi) // 2
    plan = memopt.search(fine, budget, strategies=strategies, offload_state=False, total_timesteps=4096, seed=0)
    assert plan.feasible and plan.predicted_peak_bytes <= budget
    used = {d.strategy for d in plan.decisions}
    # the plan saves memory; which ways (recompute, swap, recompute_offload, often several) follows the measured
    # times: a clean-clone CI run on a loaded machine got keep and swap only
    assert used - {"keep"}, used

    torch.manual_seed(1)
    with memopt.plan(plan), memopt.limit_memory(budget) as lim:
        got = train(model, inputs, opt)
    assert lim.peak_bytes <= budget
    ref, ref_inputs, ref_opt = gpt2(transformers)
    torch.manual_seed(1)
    assert train(ref, ref_inputs, ref_opt) == got
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
