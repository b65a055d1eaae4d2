import json

import pytest
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.core.errors import PlanError
from memopt_nb.core.plan import DEFAULT_STRATEGIES, STRATEGIES, Decision, Plan, effective_triggers


def small_plan(profile):
    return Plan.from_strategies(profile, ["swap", "recompute", "keep", "swap", "keep", "recompute"],
                                offload_window=[2, 1, 1, 0, 1, 1], prefetch_distance=[3, 1, 1, 0, 1, 1])


def test_json_roundtrip(zoo_profiles, tmp_path):
    _, _, prof = zoo_profiles["gpt"]
    p = small_plan(prof).with_meta(seed=7, meta={"note": "x"})
    path = p.save(tmp_path / "p.json")
    q = Plan.load(path)
    assert q == p and q.seed == 7 and q.meta["note"] == "x"
    assert q.strategies == p.strategies and q.offload_windows == p.offload_windows


def test_corrupt_and_newer_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.load(bad)
    bad.write_text(json.dumps({"format": "memopt_nb.plan", "schema_version": 99, "decisions": []}))
    with pytest.raises(PlanError, match="newer memopt_nb"):
        Plan.load(bad)
    bad.write_text(json.dumps({"format": "memopt_nb.plan", "schema_version": 1, "decisions": [{"unit": "a",
                                                                                                 "strategy": "fly"}]}))
    with pytest.raises(PlanError, match="strategy must be one of"):
        Plan.load(bad)
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(PlanError, match="not a memopt_nb plan"):
        Plan.load(bad)
    with pytest.raises(PlanError, match="no plan file"):
        Plan.load(tmp_path / "missing.json")


def test_validate_names_mismatching_units(zoo_profiles):
    _, _, prof = zoo_profiles["gpt"]
    other = memopt.zoo.build("gpt", d_model=64).model
    with pytest.raises(PlanError, match="blocks.0") as err:
        small_plan(prof).validate(other)
    assert "made for another model" in str(err.value)
    with pytest.raises(PlanError, match="no such module"):
        Plan(decisions=(Decision("nope"),)).validate(nn.Linear(2, 2))


def test_unknown_unit_names(zoo_profiles):
    _, _, prof = zoo_profiles["gpt"]
    with pytest.raises(PlanError, match="unknown unit names"):
        Plan.from_strategies(prof, {"blocks.99": "recompute"})


def test_bad_decisions():
    with pytest.raises(PlanError):
        Decision("a", "keep", offload_window=-1)
    with pytest.raises(PlanError, match="repeated"):
        Plan(decisions=(Decision("a"), Decision("a")))


def test_effective_triggers_are_monotone():
    s = ["swap", "swap", "keep", "swap"]
    assert effective_triggers(s, [3, 0, 1, 2]) == [1, 1, None, 3]
    assert effective_triggers(["swap"] * 3, [0, 0, 0]) == [0, 1, 2]


def test_recompute_offload_is_a_strategy_timed_like_swap(tmp_path):
    """recompute_offload is a plan strategy (not in the planners' default space), takes the swap timing knobs, counts
    as swapped for prefetch triggers and round-trips through JSON; a timing outside the range is refused for it too."""
    assert "recompute_offload" in STRATEGIES
    assert "recompute_offload" not in DEFAULT_STRATEGIES
    s = ["recompute_offload", "swap", "keep", "recompute_offload"]
    assert effective_triggers(s, [3, 0, 1, 2]) == [1, 1, None, 3]
    assert effective_triggers(["recompute_offload", "recompute"], [0, 0]) == [0, None]
    with pytest.raises(PlanError, match="offload_window"):
        Decision("a", "recompute_offload", offload_window=-1)
    plan = Plan(decisions=(Decision("a", "recompute_offload", 2, 3), Decision("b", "recompute")))
    q = Plan.load(plan.save(tmp_path / "ro.json"))
    assert q == plan and q.strategies == ["recompute_offload", "recompute"] and q.offload_windows[0] == 2
    assert q.counts()["recompute_offload"] == 1 and "recompute_offload 1" in q.summary()
    assert "recompute_offload 0" not in Plan(decisions=(Decision("a", "swap"),)).summary()
    # timings count for it as for swap, not for recompute
    other = Plan(decisions=(Decision("a", "recompute_offload", 0, 3), Decision("b", "recompute", 0, 0)))
    assert not plan.same_decisions(other)
    assert Plan(decisions=(Decision("a", "recompute_offload", 2, 3), Decision("b", "recompute", 0, 0))).same_decisions(
        plan)


# ---------------------------------------------------------------------- plan identity: the whole model
class _Blocks(nn.Module):
    """``n`` blocks of the same shape in a ModuleList, and a head."""

    def __init__(self, n: int, head: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(n))
        self.head = nn.Linear(16, head)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.fixture(scope="module")
def four_blocks():
    import torch

    torch.manual_seed(0)
    model = _Blocks(4)
    return model, memopt.profile(model, torch.randn(8, 16), repeats=1)


def _untouched(model):
    return all("forward" not in m.__dict__ for m in model.modules())


def test_a_plan_for_4_blocks_refuses_a_model_with_6(four_blocks):
    # before: applied silently; blocks 4-5 stayed unplanned
    import torch

    _, prof = four_blocks
    six = _Blocks(6)
    x = torch.randn(8, 16)
    before = six(x)
    for plan in (Plan.uniform(prof, "recompute"), memopt.solvers.recompute_all(prof)):
        with pytest.raises(PlanError) as err:
            with memopt.plan(plan, six):
                pass
        msg = str(err.value)
        assert "4 blocks in `layers` (layers.0–3)" in msg and "this model has 6 (layers.0–5)" in msg
        assert "Profile this model" in msg  # what would work
        assert _untouched(six) and torch.equal(six(x), before)
    with pytest.raises(PlanError, match="this model has 6"):  # and against the other model's profile
        Plan.uniform(prof, "recompute").validate(memopt.profile(six, x, repeats=1))


def test_a_plan_applies_to_another_instance_of_the_same_model(four_blocks):
    _, prof = four_blocks
    plan = Plan.uniform(prof, "recompute")
    with memopt.plan(plan, _Blocks(4)) as applied:
        assert applied.active


def test_a_plan_refuses_a_model_that_differs_outside_its_units(four_blocks):
    _, prof = four_blocks
    with pytest.raises(PlanError) as err:
        Plan.uniform(prof, "recompute").validate(_Blocks(4, head=5))
    assert "`head`" in str(err.value) and "module tree differs" in str(err.value)


def test_model_fingerprint_survives_json_and_old_plans_keep_the_unit_check(four_blocks, tmp_path):
    _, prof = four_blocks
    plan = Plan.uniform(prof, "recompute")
    loaded = Plan.load(plan.save(tmp_path / "p.json"))
    assert loaded.model_fingerprint == plan.model_fingerprint is not None
    with pytest.raises(PlanError, match="this model has 6"):
        loaded.validate(_Blocks(6))
    old = plan.to_dict()
    del old["model_fingerprint"]  # a plan saved before plans recorded the whole model
    legacy = Plan.from_dict(old)
    assert legacy.model_fingerprint is None
    legacy.validate(_Blocks(4))
    legacy.validate(_Blocks(6))  # the old check: its units exist and match
    with pytest.raises(PlanError, match="no such module"):
        legacy.validate(_Blocks(3))


# ---------------------------------------------------------------------- loading what is not a plan
def _plan_dict(**changes):
    base = {"format": "memopt_nb.plan", "schema_version": 1, "budget_bytes": 1000,
            "decisions": [{"unit": "layers.0", "strategy": "recompute"}],
            "fingerprint": [{"name": "layers.0", "type": "Sequential", "param_shapes": [[16, 16], [16]]}]}
    return {**base, **changes}


def test_load_refuses_a_directory_and_a_non_utf8_file(tmp_path):
    # before: IsADirectoryError and UnicodeDecodeError
    with pytest.raises(PlanError, match="is a directory; give the path of a plan's JSON file"):
        Plan.load(tmp_path)
    binary = tmp_path / "p.json"
    binary.write_bytes(b"\xff\xfe\x00{\x89PNG")
    with pytest.raises(PlanError, match="not UTF-8 text.*plan.save"):
        Plan.load(binary)
    assert binary.read_bytes() == b"\xff\xfe\x00{\x89PNG"  # nothing changed


@pytest.mark.parametrize("fingerprint", [
    [{"name": "layers.0", "type": "Sequential", "param_shapes": "big"}],
    [{"name": "layers.0", "type": 3, "param_shapes": []}],
    [{"name": "layers.0", "type": "Sequential", "param_shapes": [["16"]]}],
    ["layers.0"],
    {"layers.0": 1},
], ids=["shapes-str", "type-int", "dim-str", "entry-str", "not-list"])
def test_a_fingerprint_of_wrong_types_is_refused_at_load(tmp_path, fingerprint):
    # before: loaded, then validate raised TypeError/AttributeError (or compared garbage)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_plan_dict(fingerprint=fingerprint)))
    with pytest.raises(PlanError, match="corrupt plan: fingerprint"):
        Plan.load(path)


@pytest.mark.parametrize("field,value", [("budget_bytes", "lots"), ("budget_bytes", -5), ("budget_bytes", True),
                                         ("predicted_peak_bytes", "x"), ("predicted_step_time", "fast"),
                                         ("feasible", "yes"), ("method", 3), ("meta", [1]), ("seed", 1.5),
                                         ("model_fingerprint", {"class": "X"}), ("decisions", [{"unit": 3}])])
def test_fields_of_wrong_types_are_refused_at_load(field, value):
    # before: budget_bytes "lots" loaded, then repr(plan) raised TypeError
    with pytest.raises(PlanError) as err:
        Plan.from_json(json.dumps(_plan_dict(**{field: value})))
    assert "corrupt plan" in str(err.value) or "unit must be a module name" in str(err.value)
    good = Plan.from_json(json.dumps(_plan_dict()))
    assert "budget 1000 B" in repr(good)


def test_json_roundtrip_keeps_what_the_plan_was_made_for(tmp_path):
    """A file keeps more than the decisions (``==`` compares only those): the budget, device, method, seed, what the
    simulator predicted and whether the plan fits, each checked against figures computed here."""
    from memopt_nb import solvers
    from memopt_nb.core.device import DeviceSpec
    from memopt_nb.harness.synthetic import chain_profile

    prof = chain_profile(6, seed=3)
    budget = (solvers.min_peak(prof) + prof.peak_bytes) // 2
    fits = solvers.optimal(prof, budget).with_meta(seed=5)
    over = Plan.uniform(prof, "keep").with_meta(budget_bytes=budget, predicted_peak_bytes=prof.peak_bytes,
                                                 predicted_step_time=0.25, feasible=False)
    for p, feasible in ((fits, True), (over, False)):
        q = Plan.load(p.save(tmp_path / f"{p.method}.json"))
        assert q == p
        assert q.budget_bytes == budget and q.method == p.method and q.seed == p.seed
        assert DeviceSpec.from_dict(q.device) == prof.device
        assert q.feasible is feasible and q.predicted_peak_bytes == p.predicted_peak_bytes
        assert q.predicted_step_time == p.predicted_step_time
    q = Plan.load(tmp_path / "optimal.json")
    assert q.method == "optimal" and q.seed == 5
    sim = memopt.simulate(prof, q)  # the stored predictions are the simulator's for the stored decisions
    assert q.predicted_peak_bytes == sim.peak_bytes <= budget
    assert q.predicted_step_time == pytest.approx(sim.step_time, rel=1e-12)
    assert Plan.load(tmp_path / "keep_all.json").predicted_peak_bytes == prof.peak_bytes > budget


# ------------------------------------------------------------ schema 2: where each unit's state lives
def test_a_schema_1_plan_loads_with_every_unit_resident():
    old = Plan.from_dict(_plan_dict())
    assert old.placements == [("resident", "resident", "resident")]
    assert old.state_indices == [0] and not old.moves_state and not old.step_in_backward
    assert old.optimizer_fingerprint is None
    again = Plan.from_json(old.to_json())
    assert again.to_dict()["schema_version"] == 2 and again == old


def test_placements_round_trip_and_change_equality(tmp_path):
    from memopt_nb.core.plan import STATE_CHOICES
    d = [Decision("a", "recompute", optimizer="offload", grads="offload"), Decision("b", params="offload"),
         Decision("c", "swap", 2, 0, grads="step")]
    p = Plan(tuple(d), step_in_backward=True, optimizer_fingerprint={"class": "AdamW", "groups": []})
    q = Plan.load(p.save(tmp_path / "p.json"))
    assert q == p and q.placements == p.placements and q.step_in_backward
    assert q.optimizer_fingerprint == {"class": "AdamW", "groups": []}
    assert [STATE_CHOICES[i] for i in q.state_indices] == q.placements
    assert q.state_counts() == {"optimizer": 1, "grads": 1, "step": 1, "params": 1}
    moved = Plan((Decision("a", "recompute", optimizer="offload"), *d[1:]), step_in_backward=True)
    assert moved != p and not moved.same_decisions(p) and p.same_decisions(q)
    assert "stepped in backward 1" in p.summary() and "params offloaded 1" in p.summary()
    assert "optimizer offload, grads offload" in p._repr_html_()


def test_step_in_backward_must_be_asked_for_and_wrong_places_are_refused():
    with pytest.raises(PlanError, match="grads='step'.*step_in_backward=True"):
        Plan((Decision("a", grads="step"),))
    with pytest.raises(PlanError, match="grads must be one of 'resident', 'offload', 'step'"):
        Decision("a", grads="host")
    with pytest.raises(PlanError, match="params must be one of"):
        Plan.from_dict(_plan_dict(schema_version=2, decisions=[{"unit": "layers.0", "params": "cpu"}]))
    with pytest.raises(PlanError, match="step_in_backward must be true or false"):
        Plan.from_dict(_plan_dict(schema_version=2, step_in_backward="yes"))


def test_state_choices_parses_offload_state():
    from memopt_nb.core.plan import STATE_CHOICES, state_choices
    assert state_choices(True) == tuple(c for c in STATE_CHOICES if c[1] != "step")
    assert state_choices(False) == (STATE_CHOICES[0],)
    assert state_choices({"optimizer"}) == (STATE_CHOICES[0], ("offload", "resident", "resident"),
                                            ("stream", "resident", "resident"))
    assert state_choices("grads, params") == state_choices({"grads", "params"})
    with_step = state_choices({"optimizer"}, step_in_backward=True)
    assert ("resident", "step", "resident") in with_step and ("offload", "step", "resident") in with_step
    assert len(state_choices(True, step_in_backward=True)) == len(STATE_CHOICES)
    with pytest.raises(PlanError, match="unknown pieces \\['weights'\\]; use any of optimizer, grads, params"):
        state_choices({"weights"})
    with pytest.raises(PlanError, match="offload_state must be True, False or a set"):
        state_choices(3)


def test_optimizer_fingerprint_names_what_differs_but_not_a_scheduled_lr():
    import torch

    from memopt_nb.core.plan import optimizer_differences, optimizer_fingerprint
    m = nn.Linear(3, 4)
    want = optimizer_fingerprint(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    assert optimizer_differences(want, optimizer_fingerprint(torch.optim.SGD(m.parameters(), lr=0.01,
                                                                                momentum=0.5))) == []
    assert optimizer_differences(want, optimizer_fingerprint(torch.optim.SGD(m.parameters(), lr=0.1))) == [
        "parameter group 0: momentum 0.9 in the plan, 0 here"]
    assert "this optimizer is Adam" in optimizer_differences(want, optimizer_fingerprint(
        torch.optim.Adam(m.parameters())))[0]
    other = optimizer_fingerprint(torch.optim.SGD(nn.Linear(3, 5).parameters(), lr=0.1, momentum=0.9))
    assert "holds other parameters" in optimizer_differences(want, other)[0]
