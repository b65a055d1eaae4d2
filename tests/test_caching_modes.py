"""The caching modes of ``selective`` units (``runtime.recompute.caching_modes``), which stand in for torch's
``create_selective_checkpoint_contexts`` at a fraction of its per-op cost (the runtime overhead of selective units).

What must hold: they keep exactly the listed op calls (counted per op as ``record_ops`` counts them) and the
recomputation runs every other call and none of those; gradients are bit-identical to torch's own selective
checkpointing with the same calls (dropout, tuple outputs, views); what is kept lives exactly as long as under torch's
modes; a kept tensor changed in place since runs its call again (torch refuses it), a second backward is refused as
torch refuses it; every call kept, dropout's mask included, trains as without a plan; dynamo's frame
evaluation is kept out of their ``__torch_dispatch__`` without torch's per-call wrapper.
"""

import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers.selective import _record as record_unit_ops
from torch.utils._python_dispatch import TorchDispatchMode

import memopt_nb as memopt
import memopt_nb.runtime.recompute as ck  # where checkpointed looks the caching modes up
import memopt_nb.runtime.selective as rec
from memopt_nb.core.plan import Plan
from memopt_nb.runtime.recompute import checkpointed
from memopt_nb.runtime.selective import caching_modes, save_policy


class Block(nn.Module):
    """Ops of every kind the modes meet: matmuls, a tuple-output op (``native_layer_norm``), views, dropout's
    in-place mask, an op called several times (``addmm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(self.norm(x))
        h = F.dropout(F.gelu(h), 0.2, training=True)
        h = h.view(4, 2, 32).transpose(0, 1).reshape(8, 32)
        return self.b(h) + x


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


class Watch(TorchDispatchMode):
    """Keeps a weak reference to the storage of every ``gelu`` output."""

    def __init__(self, refs: list) -> None:
        super().__init__()
        self.refs = refs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.gelu.default:
            self.refs.append(weakref.ref(out.untyped_storage()))
        return out


def _every_safe_call(module, x):
    """Every op call ``record_ops`` would offer (a new storage not changed in place later), as ``save_ops``."""
    return [(c.name, c.index) for c in record_unit_ops(module, x) if c.nbytes and not c.mutated]


def _run(module, x, save_ops, modes, seed=0):
    """Forward and backward of ``module`` under ``checkpointed`` with ``modes`` making the caching pair; returns the
    gradients and the op calls the recomputation made."""
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(seed)
    saved = ck.caching_modes
    ck.caching_modes = modes
    try:
        out = checkpointed(module, module.forward, (x,), {}, save_ops=save_ops)
    finally:
        ck.caching_modes = saved
    count = Count()
    with count:
        out.pow(2).sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
    return out.detach(), grads, count.seen


def _torch_modes(save_ops):
    return save_policy(save_ops)()


@pytest.mark.parametrize("which", ["all", "addmm 1", "none of the calls"])
def test_same_results_and_recomputation_as_torch_modes(which):
    torch.manual_seed(0)
    module, x = Block(), torch.randn(8, 16, requires_grad=True)
    every = _every_safe_call(module, x)
    assert ("aten.native_layer_norm.default", 0) in every and ("aten.addmm.default", 1) in every
    save_ops = {"all": every, "addmm 1": [("aten.addmm.default", 1)],
                "none of the calls": [("aten.mm.default", 7)]}[which]
    out_l, grads_l, seen_l = _run(module, x, save_ops, caching_modes)
    out_t, grads_t, seen_t = _run(module, x, save_ops, _torch_modes)
    assert torch.equal(out_l, out_t)
    assert all(torch.equal(a, b) for a, b in zip(grads_l, grads_t, strict=True))
    # the recomputation runs the same calls under both (kept ones not at all); dropout's mask is drawn again
    assert seen_l == seen_t
    assert "aten.bernoulli_.float" in seen_l
    # the second addmm's output is saved by nothing: without it kept the recomputation stops before it (early stop)
    recomputed = seen_l.count("aten.addmm.default")
    assert recomputed == {"all": 0, "addmm 1": 1, "none of the calls": 1}[which]
    if which == "all":
        assert "aten.native_layer_norm.default" not in seen_l and "aten.gelu.default" not in seen_l


def test_kept_calls_are_counted_per_op_and_taken_once():
    torch.manual_seed(0)
    module, x = Block(), torch.randn(8, 16, requires_grad=True)
    keep, replay = caching_modes([("aten.addmm.default", 1), ("aten.native_layer_norm.default", 0)])
    with keep:
        out = module(x)
    assert sorted((str(f), i) for f, i in keep.storage) == [("aten.addmm.default", 1),
                                                           ("aten.native_layer_norm.default", 0)]
    assert keep.storage is replay.storage
    torch.manual_seed(1)
    with replay:
        again = module(x)
    assert torch.equal(again, out)  # the kept addmm is the last op before the residual add: its value is used
    assert all(v is rec._TAKEN for v in replay.storage.values())
    with pytest.raises(RuntimeError, match="backward an extra time"), replay:
        module(x)


def test_kept_outputs_live_as_long_as_under_torch_modes():
    """A kept output is held from the forward until the recomputation takes it, and by nothing of the modes after."""
    for modes in (caching_modes, _torch_modes):
        torch.manual_seed(0)
        module, x = Block(), torch.randn(8, 16, requires_grad=True)
        keep, replay = modes([("aten.gelu.default", 0)])
        refs: list = []
        with Watch(refs), keep:
            out = module(x)
        del out
        assert refs and refs[0]() is not None, modes  # held by the modes' storage after the forward
        with replay:
            again = module(x)
        del again
        assert refs[0]() is None, modes  # taken by the recomputation, then dropped with its results


def test_a_kept_tensor_changed_in_place_runs_its_call_again():
    """torch's cached mode refuses a kept output changed in place after its forward; ours runs that call again in the
    recomputation (replayed from the same state, it reaches the same value), so the gradients are those without a plan.
    The GELU saves a tensor no save-set keeps, so the recomputation does run."""
    class ChangesIt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            h.mul_(2)
            return torch.nn.functional.gelu(h)

    torch.manual_seed(0)
    module, x = ChangesIt(), torch.randn(4, 8, requires_grad=True)
    module(x).sum().backward()
    want = [t.grad.clone() for t in (x, *module.parameters())]
    for modes in (caching_modes, _torch_modes):
        for t in (x, *module.parameters()):
            t.grad = None
        saved = ck.caching_modes
        ck.caching_modes = modes
        try:
            out = checkpointed(module, module.forward, (x,), {}, save_ops=[("aten.addmm.default", 0)])
        finally:
            ck.caching_modes = saved
        if modes is _torch_modes:
            with pytest.raises(RuntimeError, match="mutated"):
                out.sum().backward()
        else:
            out.sum().backward()
            assert all(torch.equal(t.grad, w) for t, w in zip((x, *module.parameters()), want, strict=True))


@pytest.mark.parametrize("direct", [True, False])
def test_every_call_kept_even_dropouts_mask_trains_as_without_a_plan(direct, monkeypatch):
    """Every call that makes a new tensor kept, dropout's mask too (drawn in place into a fresh tensor, then scaled in
    place): the unit's backward needs nothing else, so with direct saves it is not run again (no mask drawn twice);
    without them the recomputation draws the mask again where the kept one was changed. Bit-identical either way."""
    monkeypatch.setattr(ck, "DIRECT_SAVES", direct)
    torch.manual_seed(0)
    module, x = Block(), torch.randn(8, 16, requires_grad=True)
    calls = record_unit_ops(module, x)
    assert any(c.mutated for c in calls if c.nbytes)  # the mask's storage is written after it was made
    every = [(c.name, c.index) for c in calls if c.nbytes]
    torch.manual_seed(1)
    want = module(x)
    want.pow(2).sum().backward()
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in module.parameters()]
    out, grads, seen = _run(module, x, every, caching_modes, seed=1)
    assert torch.equal(out, want.detach())
    assert all(torch.equal(a, b) for a, b in zip(grads, want_grads, strict=True))
    assert ("aten.bernoulli_.float" in seen) is not direct


def test_dynamo_is_kept_out_without_the_per_call_wrapper():
    # TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._dynamo.disable unless told not to; the lean
    # modes are not wrapped (their code object is marked for dynamo to skip, with everything it calls, instead)
    if not rec._DYNAMO_SKIPS_CODE:
        pytest.skip("this torch has no per-code frame strategy: the modes keep torch's wrapper")
    for cls in (rec._KeepCalls, rec._ReplayCalls):
        assert cls.__torch_dispatch__ is cls.__dict__["__torch_dispatch__"]
        assert cls.__torch_dispatch__.__code__.co_filename == rec.__file__


# ====================================================================== a unit whose recomputation would redo nothing
class Linear2(nn.Module):
    """Two matmuls: every tensor its backward needs is its input, a parameter or the first matmul's output, which a
    ``matmuls`` save-set keeps — so its recomputation would recompute nothing."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(self.a(x))


class Gelu2(Linear2):
    """The same with a GELU between: the second matmul saves the GELU's output, which no save-set keeps."""

    def forward(self, x):
        return x + self.b(F.gelu(self.a(x)))


class Stack(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Linear2(d), Gelu2(d), Linear2(d), Gelu2(d)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _stack_run(plan_for=None, steps=2):
    torch.manual_seed(0)
    model = Stack()
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    forwards = [0] * len(model.blocks)
    for i, b in enumerate(model.blocks):
        # on a layer inside the block: the block's own forward hooks do not see its recomputation
        b.a.register_forward_hook(lambda m, a, o, i=i: forwards.__setitem__(i, forwards[i] + 1))
    ctx = memopt.plan(plan_for(model, x, y), model) if plan_for else None
    forwards[:] = [0] * len(model.blocks)  # the profile's runs aside
    losses = []
    try:
        if ctx is not None:
            ctx.apply()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.detach())
            opt.step()
    finally:
        if ctx is not None:
            ctx.remove()
    return losses, [p.detach().clone() for p in model.parameters()], forwards, model, x, y


def test_a_unit_whose_needs_are_all_kept_is_not_run_again_and_its_peak_is_predicted(monkeypatch):
    ref_losses, ref_params, ref_forwards, *_ = _stack_run()
    assert ref_forwards == [2, 2, 2, 2]
    profiles = {}

    def selective(model, x, y):
        prof = memopt.profile(model, x, loss_fn=lambda o: F.cross_entropy(o, y), repeats=1, selective=True,
                              units=[f"blocks.{i}" for i in range(4)])
        assert all("matmuls" in u.save_sets for u in prof.units)
        profiles["p"] = prof
        return Plan.from_strategies(prof, ["selective:matmuls"] * 4)

    losses, params, forwards, model, x, y = _stack_run(selective)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params, strict=True))
    # the plain matmul blocks ran once per step; the GELU blocks twice (their recomputation)
    assert forwards == [2, 4, 2, 4]
    prof = profiles["p"]
    plan = Plan.from_strategies(prof, ["selective:matmuls"] * 4)
    loss_fn = lambda o: F.cross_entropy(o, y)  # noqa: E731
    import memopt_nb.runtime.apply as apply_mod

    with monkeypatch.context() as mp:  # every step as the plan's first one (what the profile measures)
        mp.setattr(apply_mod, "COMPLETE_AS_KEEP", False)
        first = memopt.measure(model, x, loss_fn=loss_fn, plan=plan, steps=1)
    assert first.peak_bytes == memopt.simulate(prof, plan).peak_bytes
    # after its first step the two plain matmul blocks run as keep units (see the next test): their peak is keep's
    later = memopt.measure(model, x, loss_fn=loss_fn, plan=plan, steps=1)
    as_keep = Plan.from_strategies(prof, ["keep", "selective:matmuls", "keep", "selective:matmuls"])
    assert later.peak_bytes == memopt.simulate(prof, as_keep).peak_bytes < first.peak_bytes


def test_a_unit_whose_needs_are_all_kept_runs_as_a_keep_unit_after_its_first_forward(monkeypatch):
    """Once a selective unit's forward shows that its save-set keeps everything its backward needs, calls made the
    same way run without the checkpoint and the caching modes (what costs time on a CPU); a call made differently
    (another batch size) goes through the checkpoint again. Bit-identical throughout."""
    import memopt_nb.runtime.apply as apply_mod

    ref_losses, ref_params, *_ = _stack_run(steps=3)
    calls: list[str] = []
    real = apply_mod.checkpointed

    def counted(guard, *args, **kwargs):
        calls.append(guard.name)
        return real(guard, *args, **kwargs)

    monkeypatch.setattr(apply_mod, "checkpointed", counted)

    def selective(model, x, y):
        prof = memopt.profile(model, x, loss_fn=lambda o: F.cross_entropy(o, y), repeats=1, selective=True,
                              units=[f"blocks.{i}" for i in range(4)])
        calls.clear()  # the profile's own runs aside
        return Plan.from_strategies(prof, ["selective:matmuls"] * 4)

    losses, params, *_ , model, x, y = _stack_run(selective, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref_params, params, strict=True))
    # blocks 0 and 2 went through the checkpoint in the first step only, 1 and 3 (GELU: recomputed) every step
    assert sorted(calls) == sorted(["blocks.0", "blocks.2"] + ["blocks.1", "blocks.3"] * 3)

    with memopt.plan(Plan.from_strategies(memopt.profile(model, x, loss_fn=lambda o: F.cross_entropy(o, y),
                                                         repeats=1, selective=True,
                                                         units=[f"blocks.{i}" for i in range(4)]),
                                          ["selective:matmuls"] * 4), model):
        calls.clear()
        fwd = [model.blocks[i].forward for i in range(4)]
        for batch in (32, 32, 16, 16):
            F.cross_entropy(model(x[:batch]), y[:batch]).backward()
        assert [f.complete is not None for f in fwd] == [True, False, True, False]
    assert calls.count("blocks.0") == calls.count("blocks.2") == 2  # the first call at each batch size
    assert calls.count("blocks.1") == calls.count("blocks.3") == 4


def test_a_skipped_recomputation_refuses_a_saved_tensor_changed_in_place():
    torch.manual_seed(0)
    module, x = Linear2(8), torch.randn(4, 8, requires_grad=True)
    out = checkpointed(module, module.forward, (x,), {}, save_ops=[("aten.addmm.default", 0)])
    with torch.no_grad():
        x.mul_(2)  # the unit's input, which its first matmul saved for backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def _memory(run_unit, module):
    """Bytes held after a unit's forward and the peak over its forward and backward, as the emulated device counts."""
    from memopt_nb.runtime.memory import StorageTracker

    torch.manual_seed(0)
    module.zero_grad(set_to_none=True)
    x = torch.randn(64, 16, requires_grad=True)
    with StorageTracker() as meter:
        meter.track(x, module)  # what exists already is counted, as the profiler counts inputs and parameters
        out = run_unit(x)
        after_forward = meter.current
        out.pow(2).sum().backward()
        del out
    return after_forward, meter.peak


@pytest.mark.parametrize("block", [Gelu2, Linear2])
def test_direct_saves_hold_what_the_recomputation_would_or_less(block, monkeypatch):
    """Where the recomputation runs (GELU block) a selective unit holds and peaks exactly as without the direct saves
    (torch's way: everything through the recomputation); where it is skipped (linear block) never more."""
    torch.manual_seed(0)
    module = block(16)
    ops = [("aten.addmm.default", 0), ("aten.addmm.default", 1)]
    run = lambda x: checkpointed(module, module.forward, (x,), {}, save_ops=ops)  # noqa: E731
    ours = _memory(run, module)
    monkeypatch.setattr(ck, "DIRECT_SAVES", False)
    ref = _memory(run, module)
    if block is Gelu2:
        assert ours == ref
    else:
        assert ours[0] == ref[0] and ours[1] <= ref[1]
