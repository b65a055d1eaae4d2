"""Plans that mix depths: a fine profile measures what each split block costs recomputed as one checkpoint,
``merge_units`` makes the profile of any cut (whole blocks here, units there) from it, and ``search_depths`` plans the
fine units, the whole blocks and mixed cuts. A merged block is an ordinary unit for the simulator, the planners and
the runtime: predicted = measured to the byte, training bit for bit."""

import dataclasses
import random

import pytest
import torch
from helpers import tolerances
from helpers.depth import train
from helpers.whole_step import _assert_same_training, train_loop

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.cuts import merge_units, mergeable, outermost, profile_for
from memopt_nb.core.errors import BudgetError, ProfileError
from memopt_nb.core.plan import Plan
from memopt_nb.core.profile import ModelProfile
from memopt_nb.planners import depths

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

transformers = pytest.importorskip("transformers")

BLOCKS = ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
CUTS = {"fine": [], "one block": ["transformer.h.1"], "one mlp": ["transformer.h.0.mlp"],
        "mixed": ["transformer.h.0", "transformer.h.2.mlp"], "blocks": BLOCKS}


def gpt2(optimizer=torch.optim.Adam, n_layer=3):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=64, n_head=4, n_positions=64, vocab_size=500)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 500, (4, 64))
    return model, {"input_ids": ids, "labels": ids}, optimizer(model.parameters(), lr=1e-3)


def loss_fn(out):
    return out.loss


@pytest.fixture(scope="module")
def fine():
    model, inputs, opt = gpt2()
    prof = memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    return model, inputs, opt, prof


def _random_plan(prof, rng, placements):
    base = Plan.uniform(prof, "keep")
    decisions = []
    for d, u in zip(base.decisions, prof.units, strict=True):
        kw = {"strategy": rng.choice(["keep", "recompute", "swap", "recompute_offload"])}
        if placements and u.grad_bytes:
            places = ["resident", "offload", "stream"] if u.param_steps else ["resident", "offload"]
            kw["optimizer"] = rng.choice(places)
            kw["grads"] = rng.choice(["resident", "offload"])
        decisions.append(dataclasses.replace(d, **kw))
    return base.with_meta(decisions=tuple(decisions))


def test_a_fine_profile_measures_every_split_block_and_each_is_one_unit_of_its_cut(fine):
    _, _, _, prof = fine
    assert mergeable(prof) == BLOCKS + [f"{b}.mlp" for b in BLOCKS]
    assert prof.meta["merge_why"] == {}
    for name, blocks in CUTS.items():
        cut = merge_units(prof, blocks)
        outer = outermost(blocks)
        for b in outer:
            u = cut.unit(b)
            first, last = prof.merges[b]["units"]
            kids = prof.units[first:last + 1]
            assert u.fwd_time == pytest.approx(sum(s.time for s in prof.segments[kids[0].fwd_segment:
                                                                                    kids[-1].fwd_segment + 1]))
            assert u.param_bytes == sum(k.param_bytes for k in kids) and u.save_sets == {}
            assert [r["order"] for r in u.param_steps] == sorted(r["order"] for k in kids for r in k.param_steps)
        assert cut.n_units == prof.n_units - sum(prof.merges[b]["units"][1] - prof.merges[b]["units"][0]
                                                 for b in outer), name
        # keep-all is the reference run at any cut: the same peak and time
        assert memopt.simulate(cut, Plan.uniform(cut, "keep")).peak_bytes == prof.peak_bytes


@pytest.mark.parametrize("cut", list(CUTS))
def test_predicted_peak_equals_measured_at_every_cut(fine, cut):
    """Uniform strategies and random plans of every activation strategy, with and without state placements (stream
    included), on cuts that merge blocks, a nested MLP, or both at once: the simulator's peak is the measured one."""
    model, inputs, opt, prof = fine
    profile = merge_units(prof, CUTS[cut])
    rng = random.Random(len(cut))
    plans = [Plan.uniform(profile, s) for s in ("recompute", "swap", "recompute_offload")]
    plans += [_random_plan(profile, rng, placements=k % 2 == 1) for k in range(4)]
    for plan in plans:
        predicted = memopt.simulate(profile, plan).peak_bytes
        measured = memopt.measure(model, **inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1).peak_bytes
        assert predicted == measured, (cut, [d.strategy for d in plan.decisions], predicted - measured)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_independent_replay_agrees_with_the_simulator_at_every_cut(fine, overlap):
    """The replay (``sim/replay.py``, written apart from the simulator) reads a merged block as any unit: the same
    peak and step time on every cut, for 30 random plans each with placements, copies overlapping compute or not."""
    from memopt_nb.core.device import DeviceSpec
    from memopt_nb.sim.replay import replay

    _, _, _, prof = fine
    device = DeviceSpec.from_dict({**prof.device.to_dict(), "copy_overlap": overlap})
    rng = random.Random(int(overlap))
    for name, blocks in CUTS.items():
        cut = merge_units(prof, blocks)
        for k in range(30):
            plan = _random_plan(cut, rng, placements=k % 3 > 0)
            sim = memopt.simulate(cut, plan, device=device)
            rep = replay(cut, plan, device=device)
            assert rep.peak_bytes == sim.peak_bytes, (name, k)
            assert rep.step_time == pytest.approx(sim.step_time, rel=1e-9), (name, k)


def test_a_recomputed_block_holds_less_than_its_units_recomputed_one_by_one(fine):
    """The reason to merge: recomputing unit by unit pins every unit's input until its backward; the block's
    checkpoint pins its own input only."""
    _, _, _, prof = fine
    blocks = merge_units(prof, BLOCKS)
    by_units = memopt.simulate(prof, Plan.uniform(prof, "recompute")).peak_bytes
    by_blocks = memopt.simulate(blocks, Plan.uniform(blocks, "recompute")).peak_bytes
    assert by_blocks < by_units
    strategies = ("keep", "recompute")
    assert (solvers.min_peak(blocks, None, strategies, offload_state=False)
            < solvers.min_peak(prof, None, strategies, offload_state=False))


def test_merging_nothing_changes_nothing_and_merges_survive_json(fine, tmp_path):
    _, _, _, prof = fine
    same = merge_units(prof, [])
    assert same.to_dict() == prof.to_dict()
    loaded = ModelProfile.load(prof.save(tmp_path / "p.json"))
    assert loaded.merges == prof.merges
    a, b = merge_units(prof, CUTS["mixed"]), merge_units(loaded, CUTS["mixed"])
    plan = Plan.uniform(a, "recompute")
    assert memopt.simulate(a, plan).peak_bytes == memopt.simulate(b, plan).peak_bytes


def test_an_unknown_block_is_refused_naming_those_that_can_be_merged(fine):
    _, _, _, prof = fine
    with pytest.raises(ProfileError, match=r"cannot merge 'transformer\.h\.9'.*transformer\.h\.0"):
        merge_units(prof, ["transformer.h.9"])
    auto = ModelProfile.from_dict({**prof.to_dict(), "merges": {}})
    with pytest.raises(ProfileError, match="has none"):
        merge_units(auto, ["transformer.h.0"])


def test_simulate_reads_a_mixed_plan_against_the_fine_profile(fine):
    _, _, _, prof = fine
    cut = merge_units(prof, CUTS["mixed"])
    plan = Plan.uniform(cut, "recompute").with_meta(meta={"merged": CUTS["mixed"]})
    assert profile_for(prof, plan).unit_names == cut.unit_names
    assert memopt.simulate(prof, plan).peak_bytes == memopt.simulate(cut, plan).peak_bytes


def test_the_blocks_a_plan_treats_alike_are_merged_and_the_others_split(fine):
    _, _, _, prof = fine
    plan = Plan.uniform(prof, "keep")
    first, last = prof.merges["transformer.h.1"]["units"]
    decisions = list(plan.decisions)
    for k in range(first, last + 1):
        decisions[k] = dataclasses.replace(decisions[k], strategy="recompute")
    first, last = prof.merges["transformer.h.2.mlp"]["units"]
    for k in range(first, last + 1):
        decisions[k] = dataclasses.replace(decisions[k], strategy="swap")
    plan = plan.with_meta(decisions=tuple(decisions))
    assert depths._alike(plan, prof) == ["transformer.h.1", "transformer.h.2.mlp"]
    # a block plan mapped onto a cut that splits its kept blocks: the units take their block's decision
    blocks = merge_units(prof, BLOCKS)
    whole = Plan.uniform(blocks, "keep")
    whole = whole.with_meta(decisions=(dataclasses.replace(whole.decisions[0], strategy="recompute"),
                                       *whole.decisions[1:]))
    cut = merge_units(prof, ["transformer.h.0"])
    codes = depths._arrays(whole, cut)[0]
    assert codes[0] == depths.code_of("recompute", "") and set(codes[1:].tolist()) == {depths.code_of("keep", "")}


def _fixed_times(prof: ModelProfile) -> ModelProfile:
    """``prof`` with every unit's forward 1 ms, its backward 2 ms and the code between units 0.1 ms: which plan is
    fastest then depends on memory alone, not on how busy this machine was while profiling."""
    def seconds(seg):
        return {"fwd": 1e-3, "bwd": 2e-3}.get(seg.kind, 1e-4) if 0 <= seg.unit < prof.n_units else 1e-4
    out = dataclasses.replace(prof, segments=[dataclasses.replace(g, time=seconds(g)) for g in prof.segments])
    return out._adopt(prof)


def _exact(strategies):
    def planner(profile, budget, device):
        return solvers.optimal(profile, budget, device, strategies=strategies, offload_state=False)
    return planner


def test_a_mixed_plan_is_chosen_where_faster_and_trains_bit_for_bit_at_its_predicted_peak():
    """Checkpointing only, a 6-layer GPT-2 at a budget three quarters of the way from the whole blocks' floor to the
    fine units': no fine plan fits, and the search chooses a mixed plan (some blocks whole, the others split) strictly
    faster than the whole blocks' (unit times fixed, so the choice is memory's); it trains two steps as without a
    plan, inside the budget, its measured peak the predicted one."""
    model, inputs, opt = gpt2(torch.optim.SGD, n_layer=6)
    prof = _fixed_times(memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1))
    blocks = outermost(mergeable(prof))
    assert len(blocks) == 6
    strategies = ("keep", "recompute")
    lo = solvers.min_peak(merge_units(prof, blocks), None, strategies, offload_state=False)
    hi = solvers.min_peak(prof, None, strategies, offload_state=False)
    assert lo < hi
    budget = lo + 3 * (hi - lo) // 4
    with pytest.raises(BudgetError):
        solvers.optimal(prof, budget, strategies=strategies, offload_state=False)
    plan = memopt.search_depths(prof, budget, planner=_exact(strategies), strategies=strategies, offload_state=False)
    d = plan.meta["depths"]
    assert d["fine_step_time"] is None and plan.feasible
    # a mixed plan, strictly faster than the whole blocks' (a tie would go to the blocks): blocks merged, not all
    assert d["chosen"] == "mixed" and plan.predicted_step_time == d["mixed_step_time"] < d["blocks_step_time"]
    assert 0 < len(plan.meta["merged"]) < len(blocks) and set(plan.meta["merged"]) <= set(mergeable(prof))
    assert plan.units == merge_units(prof, plan.meta["merged"]).unit_names
    assert len(blocks) < len(plan.units) < prof.n_units

    torch.manual_seed(1)
    with memopt.plan(plan), memopt.limit_memory(budget) as lim:
        losses = train(model, inputs, opt)
    assert lim.peak_bytes <= budget
    ref, ref_inputs, ref_opt = gpt2(torch.optim.SGD, n_layer=6)
    torch.manual_seed(1)
    assert losses == train(ref, ref_inputs, ref_opt)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(model.buffers(), ref.buffers(), strict=True):
        assert torch.equal(a, b)
    measured = memopt.measure(model, **inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1).peak_bytes
    assert measured - plan.predicted_peak_bytes == tolerances.EXACT


def test_search_depths_refuses_a_budget_below_both_floors_naming_both(fine):
    _, _, _, prof = fine
    with pytest.raises(BudgetError, match="with whole blocks"):
        memopt.search_depths(prof, 1024, planner=_exact(("keep", "recompute")), strategies=("keep", "recompute"),
                             offload_state=False)
    with pytest.raises(memopt.PlanError, match="rounds"):
        memopt.search_depths(prof, "50%", rounds=-1)


# ---------------------------------------------------------------------- models this project did not write
@pytest.mark.slow
@pytest.mark.parametrize("name", ["vit_tiny", "convnext_atto"])
def test_timm_blocks_merged_predict_the_measured_peak_and_train_bit_for_bit(name):
    """timm's own ViT-Tiny (residual code and Identity placeholders between a block's units) and ConvNeXt-Atto
    (``timm.create_model``): every other block the fine profile can merge, merged, recomputed or swapped with the rest
    random (state placements too): predicted = measured; and a mixed plan trains three steps as without it, buffers
    and optimizer state included."""
    import real_timm

    build = getattr(real_timm, name)
    model, x, loss_fn = build(batch=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, *x, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    can = mergeable(prof)
    assert can, prof.meta["merge_why"]
    rng = random.Random(0)
    chosen = outermost(can)[::2]
    cut = merge_units(prof, chosen)
    for k in range(4):
        plan = _random_plan(cut, rng, placements=k % 2 == 1)
        first = {b: cut.unit_names.index(b) for b in chosen}
        plan = plan.with_meta(decisions=tuple(
            dataclasses.replace(d, strategy=("recompute", "swap")[k % 2]) if d.unit in first else d
            for d in plan.decisions))
        predicted = memopt.simulate(cut, plan).peak_bytes
        measured = memopt.measure(model, *x, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1).peak_bytes
        assert predicted == measured, (name, k, predicted - measured)
    ref = build(batch=2)
    got = build(batch=2)
    ref_opt = torch.optim.AdamW(ref[0].parameters(), lr=1e-3)
    got_opt = torch.optim.AdamW(got[0].parameters(), lr=1e-3)
    _assert_same_training(train_loop(ref[0], ref_opt, None, lambda m: ref[2](m(*ref[1]))),
                          train_loop(got[0], got_opt, plan, lambda m: got[2](m(*got[1]))))


def test_a_block_whose_own_code_after_its_units_saves_for_backward_is_not_merged():
    """timm's ResNet-18 BasicBlock ends in ``x += shortcut; x = self.act2(x)`` with an in-place ReLU, which is no unit
    and saves its output: checkpointed whole, the block's recomputation would start in that code's backward, before
    its units' backward, where no merged block's figure is measured. The profiler says so instead of merging."""
    import real_timm

    model, x, loss_fn = real_timm.resnet18(batch=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, *x, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    assert prof.meta["split"] and not prof.merges
    assert set(prof.meta["merge_why"]) == set(prof.meta["split"])
    assert all("before its units' backward" in why for why in prof.meta["merge_why"].values())


def test_an_extrapolated_fine_profile_merges_no_block_and_says_why():
    """A step that does not fit is profiled at smaller batches on the same units (a list of names, no splits): its
    blocks were not measured whole, so none is offered for merging, and ``meta["merge_why"]`` says so."""
    model, inputs, opt = gpt2(torch.optim.SGD)
    peak = memopt.measure(model, **inputs, loss_fn=loss_fn, optimizer=opt).peak_bytes
    with memopt.limit_memory(int(0.8 * peak)):
        prof = memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    assert prof.meta["method"] == "extrapolated" and prof.meta["split"]
    assert prof.merges == {} and prof.meta["merge_why"]
    assert all(why == "not measured in an extrapolated profile" for why in prof.meta["merge_why"].values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_llama_style_blocks_merged_are_predicted_at_or_above_the_measured_peak(name):
    """Llama and Qwen2 decoder layers merged whole (and their MLPs): the prediction is not exact as on GPT-2 but never
    below the measured peak, and above it by at most 32 KiB here (a 0.5 MB model), under recompute, swap and random
    plans (``tolerances.MERGED_LATE_BYTES``, as the README says). Known, not yet explained: a storage the attention
    frees partway through its backward (``late_bytes``) is counted in the merged block's backward where the block's own
    recomputation already holds less."""
    import helpers.transformers_models as tm

    build, inputs, _ = tm.MODELS[name]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1, **inputs)
    can = mergeable(prof)
    outer = outermost(can)
    assert outer and prof.meta["merge_why"] == {}
    rng = random.Random(0)
    for blocks in (outer, [b for b in can if b not in outer]):
        cut = merge_units(prof, blocks)
        plans = [Plan.uniform(cut, s) for s in ("recompute", "swap")] + [_random_plan(cut, rng, k) for k in (0, 1)]
        for plan in plans:
            predicted = memopt.simulate(cut, plan).peak_bytes
            measured = memopt.measure(model, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **inputs).peak_bytes
            assert 0 <= predicted - measured <= tolerances.MERGED_LATE_BYTES, (name, blocks, predicted - measured)
