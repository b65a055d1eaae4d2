"""Training habits of people who did not write this project, each compared with the same training without a plan.

Each habit either trains exactly as it does without a plan (losses, parameters, buffers, optimizer state bit for bit)
or is refused with a memopt error that says what to do, before anything changed. The habits: a graph built inside
``with memopt.plan(p):`` and backpropagated after it, with parameters offloaded; LoRA-style adapters (a frozen linear
layer inside an offloaded unit); an optimizer the profile did not see (``AdamW(fused=True)``, as
``transformers.Trainer`` builds by default); the first profile of a process and torch's global random stream; an
exception in the middle of a backward that steps units; an LR scheduler made after profiling; a loss function that
calls another model (a GAN's discriminator); a plan file edited by hand and a budget written as ``1.5``.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import test_whole_step_apply as ws
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb import device as device_module
from memopt_nb.errors import BudgetError, PlanError
from memopt_nb.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIMIZER_OFFLOADED = [("keep", "offload", "resident", "resident")]


def _mlp():
    return ws._build("mlp")


# ---------------------------------------------------------------------- 4: profile and the global random stream
def test_the_first_profile_of_a_process_leaves_the_global_random_stream_where_it_was(monkeypatch):
    """Device detection (the first profile's) draws random matrices; "profile, then train" must draw the same dropout
    masks as "train"."""
    monkeypatch.setattr(device_module, "_CPU_CACHE", {})  # as in a fresh process: the device is measured again
    zm = _mlp()
    torch.manual_seed(0)
    expected = torch.rand(8)
    torch.manual_seed(0)
    memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, repeats=1)
    assert torch.equal(torch.rand(8), expected)


# ---------------------------------------------------------------------- 6: a scheduler made after profiling
def _scheduled(planned: bool):
    zm = _mlp()
    model = zm.model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    plan = None
    if planned:
        prof = memopt.profile(model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
        plan = ws._whole(Plan.uniform(prof, "keep"), OPTIMIZER_OFFLOADED, opt=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # after profiling: adds initial_lr
    return ws.train_loop(model, opt, plan, lambda m: zm.loss_fn(m(*zm.inputs)), after_step=lambda m: sched.step())


def test_a_scheduler_made_after_profiling_is_accepted_and_trains_as_without_the_plan():
    ref, got = _scheduled(False), _scheduled(True)
    ws._assert_same_training(ref, got)
    assert got[2]["stats"]["state_d2h_bytes"] > 0
    assert got[1].param_groups[0]["lr"] == pytest.approx(1e-3 / 8)


def test_another_optimizer_is_still_refused_by_its_difference():
    zm = _mlp()
    opt = torch.optim.SGD(zm.model.parameters(), lr=1e-3, momentum=0.9)
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
    plan = ws._whole(Plan.uniform(prof, "keep"), OPTIMIZER_OFFLOADED, opt=opt)
    other = torch.optim.SGD(zm.model.parameters(), lr=1e-3, momentum=0.0)
    torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(PlanError, match="momentum 0.9 in the plan, 0.0 here"):
        memopt.plan(plan, zm.model, optimizer=other).apply()


# ---------------------------------------------------------------------- 7: a loss that calls another model
class _Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.fc(x)))))


def test_profiling_a_generator_judged_by_a_discriminator_leaves_the_discriminator_as_it_was():
    zm = _mlp()  # the generator: its output (10 features) is what the discriminator judges
    torch.manual_seed(0)
    disc = _Discriminator()
    disc.fc.weight.grad = torch.full_like(disc.fc.weight, 0.5)  # a gradient the loop has not cleared yet
    held = disc.fc.weight.grad
    disc.bn.eval()  # and a submodule in another mode than its parent
    before = {k: v.clone() for k, v in disc.state_dict().items()}
    memopt.profile(zm.model, *zm.inputs, loss_fn=lambda out: disc(out).mean(), repeats=1)
    after = disc.state_dict()
    assert list(before) == list(after)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed"
    assert disc.fc.weight.grad is held and torch.equal(held, torch.full_like(held, 0.5))
    assert all(p.grad is None for n, p in disc.named_parameters() if n != "fc.weight")
    assert disc.training and not disc.bn.training


# ---------------------------------------------------------------------- 8: a plan file edited by hand; budget 1.5
def test_a_plan_file_with_an_edited_unit_name_is_refused_naming_the_unit(tmp_path):
    prof = ws._profile("mlp")
    path = tmp_path / "plan.json"
    Plan.uniform(prof, "recompute").save(path)
    data = json.loads(path.read_text())
    data["decisions"][2]["unit"] = "blocks.9"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        Plan.load(path)
    assert "'blocks.9'" in str(err.value) and "'blocks.2'" in str(err.value) and "unit 2" in str(err.value)


@pytest.mark.parametrize(("budget", "meant"), [(1.5, "150%"), ("2.0", "200%"), (10.0, "1000%")])
def test_a_budget_written_as_a_share_above_one_is_refused_with_what_was_meant(budget, meant):
    prof = ws._profile("mlp")
    with pytest.raises(BudgetError) as err:
        memopt.search(prof, budget=budget)
    assert f"did you mean '{meant}'" in str(err.value)
    assert "floor" not in str(err.value)
    with pytest.raises(BudgetError, match="did you mean"):
        memopt.solvers.optimal(prof, budget=budget)


@contextlib.contextmanager
def _nothing():
    yield None
