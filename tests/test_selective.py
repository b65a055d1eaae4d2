"""``selective``: recompute a unit but keep the outputs of its expensive ops.

What must hold: the profile's save-sets name only op calls whose outputs are kept by nothing else (not the unit's
output, not mutated later); training under selective plans is bit-identical to no plan (dropout, BatchNorm, Hugging
Face GPT-2 with its cache, ViT), for every save-set; the measured peak on the emulated device is the simulator's
prediction; and a save-set really keeps what it says (its recomputation skips those ops).
"""

import helpers.third_party as third
import pytest
import torch
import torch.nn as nn
from helpers.selective import _record

import memopt_nb as memopt
from memopt_nb import zoo
from memopt_nb.core.errors import PlanError
from memopt_nb.core.plan import SAVE_SETS, Decision, Plan
from memopt_nb.profiling.opsets import OpRecorder, mark_pareto, op_kind, propose_save_sets
from memopt_nb.runtime.recompute import checkpointed


# ====================================================================== what may be saved
class Mutates(nn.Module):
    """Its first matmul's output is changed in place; its second is its output; its third is interior."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h.mul_(2)
        h = torch.relu(self.c(h))
        return self.b(h)


def test_only_outputs_nothing_else_keeps_are_offered():
    torch.manual_seed(0)
    calls = _record(Mutates(), torch.randn(4, 8, requires_grad=True))
    mm = [c for c in calls if op_kind(c.name) == "matmul"]
    assert [c.index for c in mm] == [0, 1, 2]
    assert mm[0].mutated and not mm[0].safe  # h.mul_(2): torch would refuse the cached tensor
    assert not mm[1].mutated and not mm[1].escaped and mm[1].safe  # self.c: interior
    assert mm[2].escaped and not mm[2].safe  # self.b: the unit's output
    sets = propose_save_sets(calls)
    assert sets["matmuls"]["ops"] == [[mm[1].name, 1]]
    assert "attention" not in sets
    assert 0 < sets["matmuls"]["fraction"] < 1


def test_a_dead_outputs_address_reused_by_an_in_place_op_is_not_a_change_of_it():
    """The allocator may hand a dead output's address to a fresh tensor that is then written in place (dropout's mask
    drawn after the first matmul of an MLP died, under checkpointing). That is no change of the dead output: only an
    output still alive is marked. Where the address lands is the allocator's choice, so the dead output is stood in
    for by a recorded call whose storage is gone and whose address is the written tensor's."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from memopt_nb.profiling.opsets import OpCall

    gone = torch.empty(16)
    ref = StorageWeakRef(gone.untyped_storage())
    del gone
    assert ref.expired()
    rec = OpRecorder()
    with rec:
        rec.begin(0)
        fresh = torch.empty(16)
        ptr = fresh.data_ptr()
        rec.calls[0] += [OpCall("aten.dead.default", 0, 64, 0.0, refs={ptr: ref}),
                         OpCall("aten.alive.default", 0, 64, 0.0, refs={ptr: StorageWeakRef(fresh.untyped_storage())})]
        fresh.fill_(0.5)
        rec.end()
    dead, alive = (next(c for c in rec.calls[0] if c.name == n) for n in ("aten.dead.default", "aten.alive.default"))
    assert not dead.mutated
    assert alive.mutated


def test_op_kinds_and_pareto():
    assert op_kind("aten.addmm.default") == op_kind("aten.convolution.default") == "matmul"
    assert op_kind("aten._scaled_dot_product_flash_attention_for_cpu.default") == "attention"
    assert op_kind("aten.gelu.default") == ""
    sets = {"matmuls": {"ops": [["a", 0], ["a", 1]], "held_bytes": 10, "recompute_time": 1.0},
            "alternate": {"ops": [["a", 0]], "held_bytes": 5, "recompute_time": 2.0},
            "attention": {"ops": [["a", 0]], "held_bytes": 5, "recompute_time": 2.0}}
    mark_pareto(sets)
    assert [sets[k]["pareto"] for k in SAVE_SETS] == [True, True, False]  # attention: the same calls as alternate
    sets["alternate"]["held_bytes"] = 12  # now worse in both than matmuls
    mark_pareto(sets)
    assert not sets["alternate"]["pareto"] and sets["matmuls"]["pareto"]
    # the same calls under two names: the copy never hides the original, whatever noise says about their times
    same = {"matmuls": {"ops": [["a", 0]], "held_bytes": 5, "recompute_time": 2.0},
            "alternate": {"ops": [["a", 0]], "held_bytes": 5, "recompute_time": 1.9}}
    mark_pareto(same)
    assert same["matmuls"]["pareto"] and not same["alternate"]["pareto"]


# ====================================================================== the profile
@pytest.fixture(scope="module")
def zoo_gpt():
    z = zoo.gpt(batch_size=2, seq_len=32, d_model=64, n_layers=3, n_heads=2, vocab=64)
    opt = torch.optim.SGD(z.model.parameters(), lr=0.1)
    prof = memopt.profile(z.model, *z.inputs, loss_fn=z.loss_fn, optimizer=opt, repeats=1, selective=True)
    return z, opt, prof


def test_profile_measures_save_sets(zoo_gpt):
    z, _, prof = zoo_gpt
    assert prof.meta["selective"] == {"measured": True, "notes": []}
    for u in prof.units:
        assert set(u.save_sets) <= set(SAVE_SETS) and "matmuls" in u.save_sets, u.name
        for name, s in u.save_sets.items():
            assert s["ops"] and all(op_kind(op) for op, _ in s["ops"]), (u.name, name)
            assert 0 < s["held_bytes"] <= u.saved_bytes, (u.name, name)  # only what the unit's own ops made
            assert 0 <= s["recompute_time"] <= 2 * u.fwd_time  # measured against recompute, bounded
        assert any(s["pareto"] for s in u.save_sets.values())
        # saving fewer calls keeps fewer bytes (times are measured: no order asserted on a shared machine)
        if "alternate" in u.save_sets and u.save_sets["alternate"]["ops"] != u.save_sets["matmuls"]["ops"]:
            assert u.save_sets["alternate"]["held_bytes"] < u.save_sets["matmuls"]["held_bytes"]
    again = memopt.ModelProfile.from_json(prof.to_json())
    assert [u.save_sets for u in again.units] == [u.save_sets for u in prof.units]


def test_profile_without_selective_has_no_save_sets():
    z = zoo.mlp(batch_size=4, depth=2)
    prof = memopt.profile(z.model, *z.inputs, loss_fn=z.loss_fn, repeats=1)
    assert prof.meta["selective"] is None and all(u.save_sets == {} for u in prof.units)
    with pytest.raises(PlanError, match="selective=True"):
        Plan.from_strategies(prof, ["selective"] * prof.n_units)


def test_selective_time_is_scaled_by_what_recompute_adds():
    from memopt_nb.core.profile import Segment
    from memopt_nb.profiling.profile import _selective_time

    segs = [Segment(label="fwd 0", kind="fwd", unit=0, start_level=0, rel_peak=0, time=0.010),
            Segment(label="bwd 0", kind="bwd", unit=0, start_level=0, rel_peak=0, time=0.020)]
    rc = [0.010, 0.030]  # recompute adds 10 ms (the forward's time)
    assert _selective_time(0.5, segs, 0, 1, rc, [0.011, 0.022]) == pytest.approx(0.003)  # adds 3 of 10 ms
    assert _selective_time(0.5, segs, 0, 1, rc, [0.010, 0.050]) == pytest.approx(0.020)  # at most twice
    assert _selective_time(0.5, segs, 0, 1, rc, [0.009, 0.020]) == 0.0  # never negative
    assert _selective_time(0.5, segs, 0, 1, [0.010, 0.020], [0.011, 0.022]) == pytest.approx(0.005)  # estimate
    assert _selective_time(0.25, segs, 0, 1, None, None) == pytest.approx(0.0075)


# ====================================================================== the runtime
def _zoo_train(build, plan_for, steps=2):
    torch.manual_seed(0)
    z = build()
    opt = torch.optim.SGD(z.model.parameters(), lr=0.1, momentum=0.9)
    ctx = memopt.plan(plan_for(z.model), z.model) if plan_for else None
    if ctx is not None:
        ctx.apply()
    losses = []
    try:
        torch.manual_seed(1)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = z.loss_fn(z.model(*z.inputs))
            loss.backward()
            losses.append(loss.detach().clone())
            opt.step()
    finally:
        if ctx is not None:
            ctx.remove()
    return losses, {n: p.detach().clone() for n, p in z.model.named_parameters()}, \
        {n: b.clone() for n, b in z.model.named_buffers()}


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_zoo_bit_identical_for_every_save_set(name):
    build = {"gpt": lambda: zoo.gpt(batch_size=2, seq_len=32, d_model=64, n_layers=3, n_heads=2, vocab=64),
             "resnet": lambda: zoo.resnet(batch_size=4, widths=(8, 16), blocks_per_stage=1)}[name]
    z = build()
    prof = memopt.profile(z.model, *z.inputs, loss_fn=z.loss_fn, repeats=1, selective=True)
    ref = _zoo_train(build, None)
    offered = sorted({k for u in prof.units for k in u.save_sets})
    assert offered, name
    for set_name in offered:
        strategies = [f"selective:{set_name}" if set_name in u.save_sets else "recompute" for u in prof.units]
        plan = Plan.from_strategies(prof, strategies)
        got = _zoo_train(build, lambda m, p=plan: p)
        for a, b in zip(ref[0], got[0], strict=True):
            assert torch.equal(a, b), (name, set_name)
        for i in (1, 2):
            assert all(torch.equal(ref[i][k], got[i][k]) for k in ref[i]), (name, set_name, i)


@pytest.mark.parametrize("units", ["auto", "fine"])
def test_hf_gpt2_bit_identical_with_its_cache(units):
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    step = third.gpt2_cache_step(ids)

    prof = memopt.profile(third.gpt2(transformers), loss_fn=lambda o: o.loss, units=units, repeats=1, input_ids=ids,
                          labels=ids, selective=True)
    assert any(u.save_sets for u in prof.units)
    ref = third.train(lambda: third.gpt2(transformers), step)
    mixed = ["selective", "keep", "recompute", "selective:alternate"]
    strategies = [mixed[i % 4] if u.save_sets and ("alternate" in u.save_sets or mixed[i % 4] != mixed[3])
                  else "recompute" for i, u in enumerate(prof.units)]
    for plan in (Plan.from_strategies(prof, [("selective" if u.save_sets else "recompute") for u in prof.units]),
                 Plan.from_strategies(prof, strategies)):
        got = third.train(lambda: third.gpt2(transformers), step, lambda m, p=plan: p)
        third.assert_same(ref, got, (units, plan.strategies))
        assert got["extras"] == ref["extras"]  # the returned cache is not extended twice


def test_hf_gpt2_every_output_kept_runs_as_keep_after_the_first_step(monkeypatch):
    """A save-set keeping every op output of GPT-2's blocks (their recomputation would redo nothing): the first step
    goes through the checkpoint, later steps' blocks run as keep units (the cache a new one each step, matched by
    what it holds) — bit-identical, the returned cache extended once."""
    transformers = pytest.importorskip("transformers")
    import memopt_nb.runtime.apply as apply_mod
    from memopt_nb.profiling.opsets import record_ops
    from memopt_nb.runtime.step import preserved_state

    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    step = third.gpt2_cache_step(ids)
    torch.manual_seed(0)
    model = third.gpt2(transformers)
    prof = memopt.profile(model, loss_fn=lambda o: o.loss, repeats=1, input_ids=ids, labels=ids)
    with preserved_state(model):
        calls = record_ops(model, (), {"input_ids": ids, "labels": ids}, prof.unit_names)
    every = [tuple((c.name, c.index) for c in calls[i] if c.nbytes) for i in range(len(prof.units))]
    plan = Plan(decisions=tuple(Decision(u.name, "selective", save_set="matmuls", save_ops=every[i])
                                for i, u in enumerate(prof.units)), fingerprint=prof.fingerprint)
    ref = third.train(lambda: third.gpt2(transformers), step)
    through: list[str] = []
    real = apply_mod.checkpointed
    monkeypatch.setattr(apply_mod, "checkpointed", lambda guard, *a, **k: (through.append(guard.name),
                                                                            real(guard, *a, **k))[1])
    got = third.train(lambda: third.gpt2(transformers), step, lambda m: plan)
    third.assert_same(ref, got, "every output kept")
    assert got["extras"] == ref["extras"]
    assert through == third.GPT2_BLOCKS  # the first step only


def test_hf_vit_bit_identical():
    transformers = pytest.importorskip("transformers")
    import helpers.fine_units as fine

    torch.manual_seed(0)
    prof = memopt.profile(fine.vit(transformers), loss_fn=lambda o: o.loss, units="fine", repeats=1,
                          pixel_values=fine.PIXELS, labels=fine.LABELS, selective=True)
    assert any(u.save_sets for u in prof.units)
    plan = Plan.from_strategies(prof, [("selective" if u.save_sets else "keep") for u in prof.units])
    ref = third.train(lambda: fine.vit(transformers), fine.vit_step)
    third.assert_same(ref, third.train(lambda: fine.vit(transformers), fine.vit_step, lambda m: plan), "vit")


def test_a_save_set_really_skips_its_ops_in_the_recomputation():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.GELU())
    x = torch.randn(4, 8, requires_grad=True)
    seen: list[str] = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    for save, expected in (([], 2), ([("aten.addmm.default", 0)], 1),
                           ([("aten.addmm.default", 0), ("aten.addmm.default", 1)], 0)):
        out = checkpointed(module, module.forward, (x,), {}, save_ops=save)
        seen.clear()
        with Count():
            out.sum().backward()
        assert seen.count("aten.addmm.default") == expected, save  # the recomputation's addmm calls


def test_decision_validation_and_json():
    d = Decision("h.0", "selective", save_set="alternate", save_ops=[["aten.mm.default", 0]])
    plan = Plan(decisions=(d, Decision("h.1", "keep")), method="manual")
    back = Plan.from_json(plan.to_json())
    assert back.decisions == plan.decisions
    assert "save_ops" not in plan.to_dict()["decisions"][1]  # plans without selective units read as before
    for bad in ({"save_set": "nope", "save_ops": [["aten.mm.default", 0]]}, {"save_set": "matmuls"},
                {"save_set": "matmuls", "save_ops": [["aten.mm.default", -1]]}):
        with pytest.raises(PlanError, match="save"):
            Decision("h.0", "selective", **bad)
    with pytest.raises(PlanError, match="for strategy .selective. only"):
        Decision("h.0", "recompute", save_set="matmuls")


# ====================================================================== measured = predicted
def _peaks(z, opt, prof, plan):
    m = memopt.measure(z.model, *z.inputs, loss_fn=z.loss_fn, optimizer=opt, plan=plan, steps=1)
    return m.peak_bytes, memopt.simulate(prof, plan).peak_bytes


def test_measured_peak_is_predicted_for_every_save_set(zoo_gpt):
    z, opt, prof = zoo_gpt
    n = prof.n_units
    for set_name in SAVE_SETS:
        if not any(set_name in u.save_sets for u in prof.units):
            continue
        plan = Plan.from_strategies(prof, [f"selective:{set_name}" if set_name in u.save_sets else "recompute"
                                           for u in prof.units])
        measured, predicted = _peaks(z, opt, prof, plan)
        assert measured == predicted, (set_name, measured, predicted)
    # mixed with the other strategies: the kept outputs sit beside kept, recomputed and swapped units
    cycle = ["selective:alternate", "keep", "selective:matmuls", "swap", "recompute", "selective:attention"]
    strategies = [cycle[i % len(cycle)] for i in range(n)]
    strategies = [s if not s.startswith("selective") or s.split(":")[1] in u.save_sets else "recompute"
                  for s, u in zip(strategies, prof.units)]
    plan = Plan.from_strategies(prof, strategies, offload_window=1, prefetch_distance=1)
    measured, predicted = _peaks(z, opt, prof, plan)
    assert measured == predicted, (strategies, measured, predicted)
    keep, rc = (memopt.simulate(prof, Plan.uniform(prof, s)).peak_bytes for s in ("keep", "recompute"))
    sel = memopt.simulate(prof, Plan.from_strategies(prof, ["selective:matmuls"] * n)).peak_bytes
    assert rc <= sel < keep  # keeps some of what recompute frees, not all of it


def test_hf_gpt2_measured_peak_is_predicted():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    net = third.gpt2(transformers)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    prof = memopt.profile(net, loss_fn=lambda o: o.loss, optimizer=opt, repeats=1, input_ids=ids, labels=ids,
                          selective=True)
    for strategies in ([("selective" if u.save_sets else "recompute") for u in prof.units],
                       [("selective:alternate" if "alternate" in u.save_sets and i % 2 else "keep")
                        for i, u in enumerate(prof.units)]):
        plan = Plan.from_strategies(prof, strategies)
        m = memopt.measure(net, loss_fn=lambda o: o.loss, optimizer=opt, plan=plan, steps=1, input_ids=ids,
                           labels=ids)
        assert m.peak_bytes == memopt.simulate(prof, plan).peak_bytes, strategies
