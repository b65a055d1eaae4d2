"""Whole-step plans on timm's own ResNet-18, ConvNeXt-Atto and ViT-Tiny (``timm.create_model``, random init; see
``real_timm``), Adam, default options: the floor is at most half the unplanned peak (a third with step in backward),
and a plan searched at 50 % trains three steps bit for bit — parameters, buffers, optimizer state, losses — with the
emulated device's measured peak within the budget.

What makes it reach that: units are split by state where one unit holds much of the model's parameters (timm's last
ResNet stage, ConvNeXt's widest stages), and in-place activations (``ReLU(inplace=True)``) stay in their block's code
between units instead of breaking the recompute of a unit whose input they change.
"""

import gc

import pytest
import real_timm
import torch
from helpers import tolerances
from helpers.does_not_fit import train

import memopt_nb as memopt
from memopt_nb.planners.floor import explain_floor

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: the goals: floor / unplanned peak, without and with step in backward
FLOOR, FLOOR_SIB = 0.5, 0.35
MODELS = {"resnet18": dict(batch=8, image=64), "convnext_atto": dict(batch=4, image=64),
          "vit_tiny": dict(batch=4, image=96)}


def build(name, device="cpu"):
    model, inputs, loss_fn = getattr(real_timm, name)(**MODELS[name], device=device)
    return model, inputs, loss_fn, torch.optim.Adam(model.parameters(), lr=1e-3)


def snapshot(model, opt):
    return ([t.detach().clone() for t in model.parameters()], [b.clone() for b in model.buffers()],
            [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()])


@pytest.mark.parametrize("name", list(MODELS))
def test_timm_model_floor_and_a_plan_at_half_the_peak(name, device="cpu"):
    model, inputs, loss_fn, opt = build(name, device)
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
    peak = prof.peak_bytes
    for sib, goal in ((False, FLOOR), (True, FLOOR_SIB)):
        f = explain_floor(prof, offload_state=True, step_in_backward=sib)
        floor = f.state_floor_bytes if f.state_floor_bytes is not None else f.floor_bytes
        assert floor <= goal * peak, (name, sib, floor / peak, f.breakdown_text())

    plan = memopt.search(prof, budget="50%", total_timesteps=1024)
    budget = plan.budget_bytes
    assert budget <= 0.5 * peak + 1 and plan.predicted_peak_bytes <= budget
    torch.manual_seed(1)
    # the limit inside the plan: leaving the plan brings all the state back to the device, which holds it whole
    with memopt.plan(plan), memopt.limit_memory(budget) as lim:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        losses = train(model, inputs, loss_fn, opt, 3)
        # on CUDA what the allocator held at most, which may round the budget's tensor bytes up (tolerances.CUDA_REL)
        peak_bytes = lim.peak_bytes if device != "cuda" else (
            torch.cuda.max_memory_allocated() / (1 + tolerances.CUDA_REL))
    assert peak_bytes <= budget, (name, peak_bytes / budget)
    got = snapshot(model, opt)
    del model, opt, prof
    gc.collect()

    ref_model, ref_inputs, ref_loss_fn, ref_opt = build(name, device)
    torch.manual_seed(1)
    assert train(ref_model, ref_inputs, ref_loss_fn, ref_opt, 3) == losses
    want = snapshot(ref_model, ref_opt)
    for a, b in zip(want, got, strict=True):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            if isinstance(x, dict):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
            else:
                assert torch.equal(x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(MODELS))
def test_cuda_timm_model_floor_and_a_plan_at_half_the_peak(name):  # pragma: no cover - needs a GPU
    """The same on CUDA (units split by state, state on the side streams; ``benchmarks/cuda_check.py --pytest``)."""
    test_timm_model_floor_and_a_plan_at_half_the_peak(name, device="cuda")


# ---------------------------------------------------------------------- in-place activations and fine units
def test_in_place_activations_are_never_units_and_fine_resnet18_trains_bit_for_bit():
    """timm's BasicBlock: ``act1``/``act2`` are ``ReLU(inplace=True)``; recomputing one would need the input it has
    overwritten (``units="fine"`` used to fail in profiling: "output 0 of Relu … modified by an inplace operation")."""
    model, inputs, loss_fn, opt = build("resnet18")
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    names = set(prof.unit_names)
    assert not any(n.endswith((".act1", ".act2")) for n in names)
    assert {"layer4.1.conv1", "layer4.1.bn2"} <= names  # split by state: the last stage holds most parameters
    assert "by state" in prof.meta["split_why"]["layer4.1"]
    for strategy in ("recompute", "swap"):
        plan = memopt.Plan.uniform(prof, strategy)
        predicted = memopt.simulate(prof, plan).peak_bytes
        torch.manual_seed(1)
        m = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1)
        assert m.peak_bytes == predicted, (strategy, m.peak_bytes - predicted)
    ref_model, ref_inputs, ref_loss_fn, ref_opt = build("resnet18")
    model, inputs, loss_fn, opt = build("resnet18")
    with memopt.plan(memopt.Plan.uniform(prof, "recompute"), model):
        got = train(model, inputs, loss_fn, opt, 2)
    assert train(ref_model, ref_inputs, ref_loss_fn, ref_opt, 2) == got
    for a, b in zip(snapshot(ref_model, ref_opt)[:2], snapshot(model, opt)[:2], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


class _ChangesItsInputLater(torch.nn.Module):
    """``a`` (a sigmoid: its backward needs its output only, so plain autograd does not mind) runs, then ``act``
    (``ReLU(inplace=True)``) overwrites ``a``'s input: recomputing ``a`` would read the overwritten input."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Sigmoid()
        self.act = torch.nn.ReLU(inplace=True)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = x * 2
        y = self.a(h)
        h = self.act(h)
        return self.b(y + h)


def test_a_module_whose_input_is_changed_in_place_is_refused_as_a_unit_with_the_reason():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), _ChangesItsInputLater(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    with pytest.raises(memopt.ProfileError, match="changed in place after it runs"):
        memopt.profile(model, x, units=["1.a"], repeats=1)
    with pytest.raises(memopt.ProfileError, match="changes its input in place"):
        memopt.profile(model, x, units=["1.act"], repeats=1)
    prof = memopt.profile(model, x, units=["1.b", "2"], repeats=1)  # the others are fine
    assert prof.unit_names == ["1.b", "2"]


# ---------------------------------------------------------------------- the zoo's models against timm's
def _shapes(model: torch.nn.Module, squeeze_1x1: bool = False) -> list[tuple[int, ...]]:
    shapes = [tuple(p.shape) for p in model.parameters()]
    if squeeze_1x1:  # a 1x1 convolution's weight (out, in, 1, 1) as the Linear weight (out, in) it equals
        shapes = [s[:2] if len(s) == 4 and s[2:] == (1, 1) else s for s in shapes]
    return sorted(shapes)


def test_the_zoo_models_have_timms_parameter_shapes():
    """``memopt.zoo``'s ``resnet18`` and ``vit_tiny`` (8 px patches) say they have those models' shapes: each
    parameter's shape is one of timm's, one for one. ``convnext_atto`` writes its MLP as ``Linear`` layers on a
    channels-last tensor where timm 1.0.31 uses 1×1 convolutions (``conv_mlp=True``): the same shapes once those are
    read as the matrices they are."""
    timm = real_timm.import_timm()
    pairs = [(memopt.zoo.resnet18(), timm.create_model("resnet18", pretrained=False), False),
             (memopt.zoo.vit_tiny(image=64, patch=8),
              timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=8), False),
             (memopt.zoo.convnext_atto(), timm.create_model("convnext_atto", pretrained=False), True)]
    for z, t, squeeze in pairs:
        assert _shapes(z.model) == _shapes(t, squeeze), z.name
    assert _shapes(pairs[2][0].model) != _shapes(pairs[2][1])  # the MLP differs as written
