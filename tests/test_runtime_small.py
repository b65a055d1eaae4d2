"""The runtime on small zoo models, seconds per test (written so that tools/mutate.py's
mutants of the runtime are caught quickly).

The claims of ``test_runtime.py`` — a plan changes memory and time, never results — plus what a plan's *timing* must
do, which equal results cannot show: under every offload window and prefetch distance the measured peak is the peak
the simulator predicts (a copy released late, or a prefetch started early, moves it), every offloaded byte comes
back, and none on demand (the prefetch was started by its trigger). Small enough to run once per mutant.
"""


import pytest
import torch
from helpers.threads import memopt_threads

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.plan import DISTANCES, STRATEGIES, WINDOWS, Plan

SMALL = {"gpt": dict(n_layers=4, batch_size=2, seq_len=16, d_model=32, n_heads=2),  # dropout in every unit
         "resnet": dict(batch_size=4, widths=(8, 16, 32), blocks_per_stage=1)}  # BatchNorm
MIXED = ["swap", "recompute", "keep", "swap", "swap", "recompute"]


# every comparison here is between runs on the same thread count
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small():
    """Profiles of the small models: name -> ModelProfile."""
    out = {}
    for name, kw in SMALL.items():
        zm = memopt.zoo.build(name, **kw)
        opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
        out[name] = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
    return out


def train(name, plan, steps=3):
    """``steps`` of forward, backward and Adam under ``plan``: everything a plan must not change, and its stats."""
    zm = memopt.zoo.build(name, **SMALL[name])
    torch.manual_seed(1234)
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    applied = memopt.plan(plan, zm.model) if plan is not None else None
    if applied is not None:
        applied.apply()
    losses, grads = [], []
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = zm.loss_fn(zm.model(*zm.inputs))
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append([p.grad.clone() for p in zm.model.parameters()])
            opt.step()
        inside = dict(applied.stats) if applied is not None else {}
    finally:
        if applied is not None:
            applied.remove()
    if applied is not None:
        assert applied.stats == inside  # what the engine did stays readable after the block
        assert all("forward" not in m.__dict__ for m in zm.model.modules())
    result = {"loss": losses, "grad": grads, "buffer": [b.clone() for b in zm.model.buffers()],
              "param": [p.detach().clone() for p in zm.model.parameters()],
              "state": [v.clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]}
    return result, inside


def assert_same(ref, got, *what):
    for key in ref:
        flat_ref = [t for x in ref[key] for t in (x if isinstance(x, list) else [x])]
        flat_got = [t for x in got[key] for t in (x if isinstance(x, list) else [x])]
        assert len(flat_ref) == len(flat_got), (*what, key)
        for i, (a, b) in enumerate(zip(flat_ref, flat_got)):
            assert torch.equal(a, b), (*what, key, i)


def measured(name, plan):
    """memopt.measure of a fresh model under ``plan``: three real steps (warm-up, measured, timed) with Adam."""
    zm = memopt.zoo.build(name, **SMALL[name])
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    torch.manual_seed(1234)
    return memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, steps=1)


def check_timing(name, prof, plan, ref, *what):
    """Same losses step after step, the simulator's peak, and the swap engine's accounting of a swap plan."""
    m = measured(name, plan)
    assert m.losses == ref.losses, what  # bit-equal: the parameters after each Adam step are too
    assert m.peak_bytes == memopt.simulate(prof, plan).peak_bytes, what
    stats = m.swap_stats
    if "swap" in plan.strategies:
        assert stats["offloaded_bytes"] > 0 and stats["offloads"] > 0, what
        assert stats["prefetched_bytes"] == stats["offloaded_bytes"], what  # everything came back
        assert stats.get("on_demand", 0) == 0, what  # and its prefetch had been started by the trigger
        assert stats["pool_reuses"] > 0, what  # later steps reuse the host buffers of the first
    else:
        assert stats.get("offloaded_bytes", 0) == 0, what


@pytest.mark.slow
def test_every_timing_trains_bit_equal_at_the_predicted_peak(small):
    """Every offload window and prefetch distance, swap-all and mixed, on a 4-unit GPT with dropout."""
    name = "gpt"
    prof = small[name]
    n = prof.n_units
    ref = measured(name, None)
    for w in WINDOWS:
        for d in DISTANCES:
            for label, strategies in (("swap", ["swap"] * n), ("mixed", (MIXED * 2)[:n])):
                plan = Plan.from_strategies(prof, strategies, offload_window=w, prefetch_distance=d)
                check_timing(name, prof, plan, ref, label, w, d)


def test_plans_keep_results_exactly(small):
    """Keep, recompute and a mixed plan with per-unit timings on a model with BatchNorm (running statistics updated
    once per step) and on one with dropout (the recomputation draws the same masks): losses, gradients, parameters,
    buffers and Adam's state after 3 steps are bit-equal, and the measured peak is the predicted one."""
    for name in ("resnet", "gpt"):
        prof = small[name]
        n = prof.n_units
        ref, _ = train(name, None)
        ref_m = measured(name, None)
        plans = [Plan.uniform(prof, s) for s in ("keep", "recompute")]
        plans.append(Plan.from_strategies(prof, (MIXED[1:] * 2)[:n], offload_window=[u % 3 for u in range(n)],
                                          prefetch_distance=[(2 * u + 1) % 4 for u in range(n)]))
        for plan in plans:
            got, stats = train(name, plan)
            assert_same(ref, got, name, plan.strategies)
            assert (stats.get("offloaded_bytes", 0) > 0) == ("swap" in plan.strategies)
            check_timing(name, prof, plan, ref_m, name, plan.strategies)


def _snapshot(model):
    return {name: (dict(m.__dict__).get("forward"), dict(m._forward_hooks), dict(m._forward_pre_hooks),
                   dict(m._backward_hooks)) for name, m in model.named_modules()}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failure_mid_step_restores_and_training_goes_on_identically(small, where):
    """An error inside a unit's forward or inside backward while copies are in flight: forwards, hooks, threads and
    host pool are as before, the parameters unchanged, and the next steps without a plan train as they would have."""
    prof = small["gpt"]
    zm = memopt.zoo.build("gpt", **SMALL["gpt"])
    model = zm.model
    plan = Plan.uniform(prof, "swap", offload_window=2, prefetch_distance=3)
    failing = model.get_submodule(prof.units[-2].name)
    seen = {}

    def fail(grad=None):
        seen["engine"] = applied.engine
        seen["stats"] = dict(applied.engine.stats)
        raise RuntimeError("boom")

    def hook(module, args, out):
        if where == "forward":
            fail()
        out.register_hook(fail)

    before = _snapshot(model)
    others = frozenset(memopt_threads())  # another test's parked plan, if any: not this one's
    handle = failing.register_forward_hook(hook)
    params = [p.detach().clone() for p in model.parameters()]
    applied = memopt.plan(plan, model)
    with pytest.raises(RuntimeError, match="boom"):
        with applied:
            zm.loss_fn(model(*zm.inputs)).backward()
    handle.remove()
    assert seen["stats"]["offloads"] > 0
    if where == "backward":
        assert seen["stats"]["prefetched_bytes"] > 0
    assert _snapshot(model) == before  # forwards and hooks (ours removed above)
    assert not applied.active and applied.engine is None
    assert not memopt_threads(others)
    for eng in seen["engine"]._copy.values():
        assert eng.closed and not any(eng.pool._free.values())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    # the model trains on exactly as a fresh one (the failed step left no gradient behind that matters: zeroed)
    fresh = memopt.zoo.build("gpt", **SMALL["gpt"])
    for m in (model, fresh.model):
        torch.manual_seed(7)
        m.zero_grad(set_to_none=True)
        zm.loss_fn(m(*zm.inputs)).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), fresh.model.parameters()))


def test_host_pool_reports_what_it_holds():
    """The host pool behind ``AppliedPlan.stats``: buffers by power-of-two size class (4 KiB at least), reused once
    handed back, nothing kept after close."""
    from memopt_nb.runtime.swap import HostPool

    pool = HostPool(pin=False)
    assert pool.stats() == {"pool_bytes": 0, "pool_allocations": 0, "pool_reuses": 0}
    a = pool.get(5000)
    assert a.nbytes() == 8192
    b = pool.get(10)
    assert b.nbytes() == 4096
    assert pool.stats() == {"pool_bytes": 8192 + 4096, "pool_allocations": 2, "pool_reuses": 0}
    pool.put(a)
    assert pool.get(6000) is a  # same size class: the buffer handed back
    assert pool.stats() == {"pool_bytes": 8192 + 4096, "pool_allocations": 2, "pool_reuses": 1}
    pool.close()
    pool.put(b)
    assert pool.get(10) is not b  # a closed pool keeps nothing handed back
    assert pool.stats()["pool_allocations"] == 3


def test_plans_that_cannot_apply_are_refused_with_the_model_unchanged(small, tmp_path):
    """Nested units, a model that checkpoints itself, a plan with no model to go to, wrong argument types: each a
    PlanError saying what to do, and the model's modules as before."""
    from memopt_nb.core.errors import PlanError
    from memopt_nb.core.plan import Decision

    def named(names):
        return Plan(decisions=tuple(Decision(n, "recompute") for n in names), method="recompute_all")

    prof = small["gpt"]
    zm = memopt.zoo.build("gpt", **SMALL["gpt"])
    model = zm.model
    before = _snapshot(model)
    for names in (["blocks", "blocks.0"], ["blocks.1", ""], ["blocks.2", "blocks.2.attn"]):
        with pytest.raises(PlanError, match="are nested; units must not contain each other"):
            memopt.plan(named(names), model).apply()
        assert _snapshot(model) == before
    with memopt.plan(named(["blocks.0", "blocks.1"]), model):  # siblings whose names share a prefix are fine
        assert "forward" in model.blocks[0].__dict__ and "forward" in model.blocks[1].__dict__
    for owner, flag, shown in ((model.blocks[1], "gradient_checkpointing", "'blocks.1'"),
                               (model.blocks[0], "grad_checkpointing", "'blocks.0'"),
                               (model, "is_gradient_checkpointing", "gradient checkpointing is on")):
        setattr(owner, flag, True)
        with pytest.raises(PlanError, match=f"checkpoints its own blocks \\({shown}\\)"):
            memopt.plan(Plan.uniform(prof, "recompute"), model).apply()
        setattr(owner, flag, False)  # only True counts: a flag that is off is no reason to refuse
        memopt.plan(Plan.uniform(prof, "recompute"), model).apply().remove()
        delattr(owner, flag)
        assert _snapshot(model) == before
    loaded = Plan.load(Plan.uniform(prof, "recompute").save(tmp_path / "p.json"))
    with pytest.raises(PlanError, match="not tied to a live model.*pass the model"):
        memopt.plan(loaded)
    with pytest.raises(PlanError, match="takes a Plan, got str"):
        memopt.plan("plan.json", model)
    with pytest.raises(PlanError, match="must be a torch.nn.Module, got str"):
        memopt.plan(loaded, "model")
    assert _snapshot(model) == before


class _Box:
    """A plain object handed to a unit; the unit's forward replaces one of its attributes."""

    def __init__(self):
        self.count = 0


class _Boxed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, box):
        box.count = box.count + 1
        return torch.tanh(self.lin(x)) * box.count


class _BoxedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Boxed(), _Boxed()

    def forward(self, x, box):
        return self.b(self.a(x, box), box).sum()


def test_a_unit_that_sets_an_attribute_of_an_argument_is_not_recomputed():
    """Recomputing it would set the attribute a second time (the count would be off by the recomputations): the
    profile marks such a unit not recomputable, naming the argument, and a recompute plan given anyway is refused at
    its first forward instead of training differently."""
    from memopt_nb.core.errors import PlanError
    from memopt_nb.core.plan import Decision

    net, x = _BoxedNet(), torch.randn(4, 8)
    prof = memopt.profile(net, x, _Box(), units=["a", "b"], repeats=1)
    assert [u.recomputable for u in prof.units] == [False, False]
    assert "argument 1 (_Box)" in prof.units[0].not_recomputable_reason
    plan = Plan(decisions=(Decision("a", "recompute"), Decision("b", "recompute")), method="recompute_all")
    with pytest.raises(PlanError, match=r"unit 'a' changed argument 1 \(_Box\)"):
        with memopt.plan(plan, net):
            net(x, _Box()).backward()
    box = _Box()
    with memopt.plan(Plan.uniform(prof, "swap"), net):  # swap runs each forward once: fine
        net(x, box).backward()
    assert box.count == 2


# ====================================================================== recompute_offload
def check_ro(name, prof, plan, ref, *what):
    """A recompute_offload plan: bit-equal losses, the predicted peak, and its inputs really left and came back."""
    m = measured(name, plan)
    assert m.losses == ref.losses, what
    assert m.peak_bytes == memopt.simulate(prof, plan).peak_bytes, what
    stats = m.swap_stats
    assert stats["offloaded_bytes"] > 0, what  # the inputs left
    assert stats["prefetched_bytes"] == stats["offloaded_bytes"], what  # and all came back
    assert stats.get("on_demand", 0) == 0, what  # started by their trigger, not by the recomputation asking


@pytest.mark.slow
def test_recompute_offload_every_timing_at_the_predicted_peak(small):
    name = "gpt"
    prof = small[name]
    n = prof.n_units
    ref = measured(name, None)
    mixed = ["recompute_offload", "keep", "swap", "recompute_offload", "recompute", "recompute_offload"]
    for w in WINDOWS:
        for d in DISTANCES:
            for label, strategies in (("all", ["recompute_offload"] * n), ("mixed", (mixed * 2)[:n])):
                plan = Plan.from_strategies(prof, strategies, offload_window=w, prefetch_distance=d)
                check_ro(name, prof, plan, ref, label, w, d)


def test_recompute_offload_exact_with_batchnorm_and_dropout(small):
    for name in ("resnet", "gpt"):
        prof = small[name]
        n = prof.n_units
        ref, _ = train(name, None)
        ref_m = measured(name, None)
        for strategies in (["recompute_offload"] * n, (["recompute_offload", "swap", "keep"] * n)[:n]):
            plan = Plan.from_strategies(prof, strategies, offload_window=1, prefetch_distance=1)
            got, stats = train(name, plan)
            assert_same(ref, got, name, strategies)
            check_ro(name, prof, plan, ref_m, name, strategies)


def test_recompute_offload_never_raises_the_floor(small):
    prof = small["gpt"]
    old = solvers.min_peak(prof, strategies=("keep", "recompute", "swap"), offload_state=False)
    new = solvers.min_peak(prof, strategies=STRATEGIES, offload_state=False)
    assert new <= old
    everything = solvers.recompute_offload_all(prof)
    assert everything.strategies == ["recompute_offload"] * prof.n_units
    assert everything.predicted_peak_bytes <= solvers.recompute_all(prof).predicted_peak_bytes


@pytest.mark.parametrize("copies", ["inline", "threaded"])
def test_copies_on_either_thread_train_bit_equal_at_the_predicted_peak(small, monkeypatch, copies):
    """The emulated copy engine moves a small job on the training thread and a large one on its worker threads
    (``ThreadCopyEngine.INLINE_BYTES``). Either way the bits, the measured peak (the host store is never counted) and
    the bytes moved are the same; the engine's job counts say which thread did it."""
    from memopt_nb.runtime.swap import ThreadCopyEngine

    monkeypatch.setattr(ThreadCopyEngine, "INLINE_BYTES", 1 << 40 if copies == "inline" else 0)
    name = "gpt"
    prof = small[name]
    n = prof.n_units
    ref_m = measured(name, None)
    ref, _ = train(name, None)
    mixed = ["recompute_offload", "keep", "swap", "recompute_offload", "recompute", "swap"]
    for w, d in ((1, 1), (WINDOWS[-1], DISTANCES[-1])):
        plan = Plan.from_strategies(prof, (mixed * 2)[:n], offload_window=w, prefetch_distance=d)
        got, stats = train(name, plan)
        assert_same(ref, got, copies, w, d)
        assert stats[f"copy_jobs_{copies}"] > 0
        assert stats.get(f"copy_jobs_{'threaded' if copies == 'inline' else 'inline'}", 0) == 0
        check_ro(name, prof, plan, ref_m, copies, w, d)
