"""Optimizer state streamed one parameter at a time (``optimizer="stream"``), applied: on transformer blocks of many
parameters the step holds two parameters' state instead of a whole block's, the peak is measured as predicted, and
the planners use it where it lowers the floor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memopt_nb as memopt
from memopt_nb.core.plan import Plan
from memopt_nb.planners.floor import explain_floor
from memopt_nb.sim.replay import replay


def _gpt():
    # 4 blocks of 12 parameters each, a small batch: the optimizer state, not the activations, sets the peak
    return memopt.zoo.gpt(batch_size=1, seq_len=8, vocab=64, d_model=64, n_layers=4, n_heads=2, dropout=0.0, seed=0)


@pytest.fixture(scope="module")
def gpt_blocks():
    zm = _gpt()
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, units="auto", repeats=1)
    return zm, opt, prof


def _placed(plan: Plan, placement: tuple[str, str, str]) -> Plan:
    o, g, p = placement
    decisions = tuple(dataclasses.replace(d, optimizer=o, grads=g, params=p) for d in plan.decisions)
    out = dataclasses.replace(plan, decisions=decisions, step_in_backward=g == "step")
    out._model_ref, out._optimizer_ref = plan._model_ref, plan._optimizer_ref
    return out


def test_the_profile_records_each_parameters_step(gpt_blocks):
    zm, opt, prof = gpt_blocks
    for u in prof.units:
        mod = zm.model.get_submodule(u.name)
        ps = [p for p in mod.parameters() if p.requires_grad]
        assert len(u.param_steps) == len(ps) > 2
        assert [r["grad_bytes"] for r in u.param_steps] == [p.nbytes for p in ps]  # param_groups order = module order
        assert sum(r["optimizer_bytes"] for r in u.param_steps) == u.optimizer_bytes
        assert all(r["step_time"] > 0 and r["step_rel_peak"] > 0 for r in u.param_steps)


@pytest.mark.parametrize("grads", ["resident", "offload", "step"])
def test_streamed_state_is_measured_as_predicted_and_lower_than_whole_units(gpt_blocks, grads):
    zm, opt, prof = gpt_blocks
    keep = Plan.uniform(prof, "keep")
    whole = _placed(keep, ("offload", grads, "resident"))
    streamed = _placed(keep, ("stream", grads, "resident"))
    got = {}
    for label, plan in (("whole", whole), ("streamed", streamed)):
        predicted = memopt.simulate(prof, plan).peak_bytes
        assert replay(prof, plan).peak_bytes == predicted, label
        measured = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan,
                                  steps=1).peak_bytes
        assert measured == predicted, (label, grads, predicted, measured)
        got[label] = predicted
    # the largest block's state is 2 x its parameters; streamed, two of its parameters' state at a time
    assert got["streamed"] < got["whole"], got


def test_the_floor_streams_where_a_units_state_bounds_it(gpt_blocks):
    zm, opt, prof = gpt_blocks
    fl = explain_floor(prof, offload_state=True)
    streams = [d.unit for d in fl.plan.decisions if d.optimizer == "stream"]
    assert streams, fl.plan.placements
    # the same plan with those units' state moved whole peaks higher: streaming is what lowers the floor
    whole = dataclasses.replace(fl.plan, decisions=tuple(
        dataclasses.replace(d, optimizer="offload") if d.optimizer == "stream" else d for d in fl.plan.decisions))
    assert memopt.simulate(prof, whole).peak_bytes > fl.floor_bytes == memopt.simulate(prof, fl.plan).peak_bytes
    measured = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=fl.plan,
                              steps=1).peak_bytes
    assert measured == fl.floor_bytes


def test_a_streamed_plan_trains_as_plain_training_with_every_kernel():
    from helpers.whole_step import _assert_same_training, train_loop

    for make in (lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
                 lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
                 lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=False)):
        runs = []
        for streamed in (False, True):
            zm = _gpt()
            opt = make(zm.model.parameters())
            plan = None
            if streamed:
                prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, units="auto",
                                      repeats=1)
                plan = _placed(Plan.uniform(prof, "keep"), ("stream", "offload", "offload"))
            runs.append(train_loop(zm.model, opt, plan, lambda m, zm=zm: zm.loss_fn(m(*zm.inputs)), steps=3))
        _assert_same_training(*runs)
        assert runs[1][2]["stats"]["state_h2d_bytes"] > 0


@pytest.mark.parametrize("grads", ["offload", "step"])
def test_streamed_state_with_weight_decay_groups_is_measured_as_predicted(grads):
    """transformers' habit: weights in one group (decayed), biases and norms in another, so ``param_groups`` order is
    not the module's: a streamed unit steps its parameters in the groups' order, in ``opt.step()`` and in backward."""
    zm = _gpt()
    named = list(zm.model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2]
    rest = [p for n, p in named if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, units="auto", repeats=1)
    plan = _placed(Plan.uniform(prof, "keep"), ("stream", grads, "resident"))
    predicted = memopt.simulate(prof, plan).peak_bytes
    measured = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, steps=1).peak_bytes
    assert measured == predicted, (grads, predicted, measured)


def _torch_optimizers():
    """Every optimizer torch ships that steps parameters one by one (LBFGS couples them and is refused; SparseAdam
    takes sparse gradients only), with each kernel it has on the CPU."""
    out = []
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD, torch.optim.RMSprop, torch.optim.Rprop,
                torch.optim.SGD):
        extra = {"momentum": 0.9} if cls in (torch.optim.SGD, torch.optim.RMSprop) else {}
        kernels = [{"foreach": False}, {"foreach": True}]
        if cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad):
            kernels.append({"fused": True})
        for k in kernels:
            label = f"{cls.__name__}-{'fused' if 'fused' in k else 'foreach' if k['foreach'] else 'single'}"
            out.append(pytest.param(cls, {**extra, **k}, id=label))
    return out


@pytest.mark.parametrize("placement", ["stream_all", "stream_step_params"])
@pytest.mark.parametrize(("cls", "kw"), _torch_optimizers())
def test_every_torch_optimizer_streamed_trains_as_plain_training(cls, kw, placement):
    from helpers.state_runtime import PLACEMENTS, _assert_same_training, _train

    def make(ps, _k=None):
        return cls(ps, lr=1e-2, **kw)

    ref = _train("adam", False, None, make_opt=make)
    got = _train("adam", False, PLACEMENTS[placement], make_opt=make)
    _assert_same_training(ref, got)
    stats = got[3].stats
    assert stats["state_h2d_bytes"] > 0 or not got[1].state_dict()["state"]  # moved, where the optimizer has state
