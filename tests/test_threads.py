"""Bit-identical training at two intra-op threads, not only at one.

The suite runs one thread per pytest worker, where every kernel sums in one order. With two threads torch splits its
reductions (matmul, convolution, the optimizers' foreach kernels) across them, so a plan that recomputed or moved
something with a different split would show here and not at one thread. The thread count is restored after each test.
"""

from __future__ import annotations

import pytest
import torch
from helpers.whole_step import MIXED, MIXED_STEP, OPTIMIZERS, SMALL, _assert_same_training, _whole, train_loop

import memopt_nb as memopt
from memopt_nb.core.plan import Plan


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _run(name: str, plan: Plan | None):
    zm = memopt.zoo.build(name, seed=0, **SMALL[name])
    opt = OPTIMIZERS["adam"](zm.model.parameters())
    return train_loop(zm.model, opt, plan, lambda m: zm.loss_fn(m(*zm.inputs)))


@pytest.mark.slow  # two threads beside the other pytest worker on two cores: a minute or more
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_plans_train_bit_identically_at_two_threads(name, two_threads):
    """Recompute, swap, a mix of both with state offloaded, and a step in backward: losses, gradients, parameters,
    buffers and optimizer state ``torch.equal`` to training without a plan, all at two threads."""
    assert torch.get_num_threads() == 2
    zm = memopt.zoo.build(name, seed=0, **SMALL[name])
    opt = OPTIMIZERS["adam"](zm.model.parameters())
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
    keep = Plan.uniform(prof, "keep")
    plans = {"recompute": Plan.uniform(prof, "recompute"), "swap": Plan.uniform(prof, "swap"),
             "mixed, state moved": _whole(keep, MIXED), "step in backward": _whole(keep, MIXED_STEP, True)}
    ref = _run(name, None)
    for label, plan in plans.items():
        got = _run(name, plan)
        assert torch.get_num_threads() == 2, label
        _assert_same_training(ref, got, stepped=plan.step_in_backward)
