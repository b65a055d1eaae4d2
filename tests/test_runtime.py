"""Plans change memory and time, never results: losses, gradients, parameters, optimizer state and BatchNorm
statistics are bit-identical after a real training loop (forward, backward, Adam)."""


import pytest
import torch
from helpers.threads import memopt_threads

import memopt_nb as memopt
from memopt_nb.core.errors import PlanError
from memopt_nb.core.plan import Plan

MIXED = ["swap", "recompute", "keep", "swap", "swap", "recompute", "keep", "swap", "recompute"]


def run(zm, plan, steps=3):
    """``steps`` of the real loop (forward, backward, Adam step) under ``plan``; everything a plan must not change."""
    torch.manual_seed(1234)
    losses, grads = [], []
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    ctx = memopt.plan(plan, zm.model) if plan is not None else None
    if ctx:
        ctx.apply()
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = zm.loss_fn(zm.model(*zm.inputs))
            loss.backward()
            losses.append(loss.detach().clone())
            grads.append({n: p.grad.clone() for n, p in zm.model.named_parameters()})
            opt.step()
    finally:
        if ctx:
            ctx.remove()
    bufs = {n: b.clone() for n, b in zm.model.named_buffers()}
    params = {n: p.detach().clone() for n, p in zm.model.named_parameters()}
    state = [{k: v.clone() for k, v in st.items()} for st in opt.state.values()]
    return losses, grads, bufs, params, state


def assert_same(ref, got, *what):
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0], strict=True)), (*what, "loss")
    for ga, gb in zip(ref[1], got[1], strict=True):
        for k in ga:
            assert torch.equal(ga[k], gb[k]), (*what, "grad", k)
    for i, label in ((2, "buffer"), (3, "parameter")):
        assert ref[i].keys() == got[i].keys()
        for k in ref[i]:
            assert torch.equal(ref[i][k], got[i][k]), (*what, label, k)
    for sa, sb in zip(ref[4], got[4], strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (*what, "optimizer state", k)


def plans_for(prof):
    n = prof.n_units
    mixed = (MIXED * 3)[:n]
    return {
        "keep": Plan.uniform(prof, "keep"),
        "recompute": Plan.uniform(prof, "recompute"),
        "swap": Plan.uniform(prof, "swap", offload_window=1, prefetch_distance=1),
        "mixed": Plan.from_strategies(prof, mixed, offload_window=[i % 3 for i in range(n)],
                                      prefetch_distance=[(2 * i) % 4 for i in range(n)]),
    }


@pytest.mark.parametrize("name", memopt.zoo.MODELS)
def test_plans_do_not_change_results(name, zoo_profiles):
    zm0, _, prof = zoo_profiles[name]
    for label, plan in plans_for(prof).items():
        fresh = [memopt.zoo.build(name) for _ in range(2)]
        ref = run(fresh[0], None)
        got = run(fresh[1], plan)
        assert_same(ref, got, name, label)


@pytest.mark.slow
def test_every_swap_timing_trains_identically(zoo_profiles):
    """Every offload window (0-2) and prefetch distance (0-3) the planners use, swap-all and mixed, 3 Adam steps."""
    name = "mlp"
    _, _, prof = zoo_profiles[name]
    n = prof.n_units
    ref = run(memopt.zoo.build(name), None)
    for w in (0, 1, 2):
        for d in (0, 1, 2, 3):
            for label, strategies in (("swap", ["swap"] * n), ("mixed", (MIXED * 3)[:n])):
                plan = Plan.from_strategies(prof, strategies, offload_window=w, prefetch_distance=d)
                assert_same(ref, run(memopt.zoo.build(name), plan), label, f"window {w}", f"distance {d}")


def test_dropout_is_on_and_batchnorm_updates_once(zoo_profiles):
    zm, _, prof = zoo_profiles["resnet"]
    assert any(u.has_running_stats for u in prof.units)
    g, _, gp = zoo_profiles["gpt"]
    assert all(u.has_rng for u in gp.units)
    # a plain torch checkpoint would update running statistics twice: ours must match no-plan
    fresh = memopt.zoo.build("resnet")
    before = {n: b.clone() for n, b in fresh.model.named_buffers() if "num_batches" in n}
    with memopt.plan(Plan.uniform(prof, "recompute"), fresh.model):
        fresh.loss_fn(fresh.model(*fresh.inputs)).backward()
    for n, b in fresh.model.named_buffers():
        if "num_batches" in n:
            assert b.item() == before[n].item() + 1


def _snapshot(model):
    return {name: (dict(m.__dict__).get("forward"), dict(m._forward_hooks), dict(m._forward_pre_hooks),
                   dict(m._backward_hooks)) for name, m in model.named_modules()}


def test_exact_restore_also_on_error(zoo_profiles):
    zm, _, prof = zoo_profiles["gpt"]
    model = zm.model
    before = _snapshot(model)
    plan = plans_for(prof)["mixed"]
    with memopt.plan(plan, model):
        assert "forward" in model.blocks[0].__dict__
    assert _snapshot(model) == before
    with pytest.raises(RuntimeError, match="boom"):
        with memopt.plan(plan, model):
            zm.loss_fn(model(*zm.inputs)).backward()
            raise RuntimeError("boom")
    assert _snapshot(model) == before
    with pytest.raises(KeyboardInterrupt):
        with memopt.plan(plan, model):
            raise KeyboardInterrupt
    assert _snapshot(model) == before


def test_nested_application_is_refused(zoo_profiles):
    zm, _, prof = zoo_profiles["mlp"]
    p = Plan.uniform(prof, "recompute")
    before = _snapshot(zm.model)
    with memopt.plan(p, zm.model):
        with pytest.raises(PlanError, match="already applied"):
            with memopt.plan(p, zm.model):
                pass
    assert _snapshot(zm.model) == before


@pytest.mark.slow
def test_inference_and_accumulation_inside_block(zoo_profiles):
    name = "vit"
    _, _, prof = zoo_profiles[name]
    plan = plans_for(prof)["mixed"]
    ref, got = memopt.zoo.build(name), memopt.zoo.build(name)
    torch.manual_seed(0)
    for _ in range(3):  # gradient accumulation: three forward/backward passes, one optimizer step
        ref.loss_fn(ref.model(*ref.inputs)).backward()
    torch.manual_seed(0)
    with memopt.plan(plan, got.model) as applied:
        for _ in range(3):
            got.loss_fn(got.model(*got.inputs)).backward()
        got.model.eval()
        with torch.no_grad():
            out = got.model(*got.inputs)
        got.model.train()
        assert applied.stats["offloaded_bytes"] > 0
    with torch.no_grad():
        ref.model.eval()
        assert torch.equal(out, ref.model(*ref.inputs))
    for a, b in zip(ref.model.parameters(), got.model.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_plan_needs_a_model_after_json(zoo_profiles, tmp_path):
    _, _, prof = zoo_profiles["mlp"]
    p = Plan.load(Plan.uniform(prof, "recompute").save(tmp_path / "p.json"))
    with pytest.raises(PlanError, match="pass the model"):
        memopt.plan(p)
    with pytest.raises(PlanError, match="takes a Plan"):
        memopt.plan("not a plan")


def test_plan_for_other_model_is_refused_unchanged(zoo_profiles):
    _, _, prof = zoo_profiles["gpt"]
    other = memopt.zoo.build("mlp").model
    before = _snapshot(other)
    with pytest.raises(PlanError, match="another model"):
        with memopt.plan(Plan.uniform(prof, "recompute"), other):
            pass
    assert _snapshot(other) == before


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_failure_mid_step_restores_everything(zoo_profiles, where):
    """An error inside a unit's forward, or inside backward, while copies are in flight: the model is as before."""
    _, _, prof = zoo_profiles["gpt"]
    zm = memopt.zoo.build("gpt")
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

    handle = failing.register_forward_hook(hook)
    before = _snapshot(model)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    others = frozenset(memopt_threads())  # another test's parked plan, if any: not this one's
    applied = memopt.plan(plan, model)
    with pytest.raises(RuntimeError, match="boom"):
        with applied:
            zm.loss_fn(model(*zm.inputs)).backward()
    assert seen["stats"]["offloads"] > 0  # copies had been started when it failed
    if where == "backward":
        assert seen["stats"]["prefetched_bytes"] > 0
    assert _snapshot(model) == before  # forwards and hooks (ours is still there, and only ours)
    assert not applied.active and applied.engine is None
    assert memopt_threads(others) == []
    for eng in seen["engine"]._copy.values():
        assert eng.closed and not any(eng.pool._free.values())  # host pool emptied
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
    handle.remove()
    assert all(not m._forward_hooks for m in model.modules())
