import json

import pytest
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.errors import PlanError
from memopt_nb.plan import Decision, Plan, effective_triggers


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


def test_json_roundtrip_keeps_what_the_plan_was_made_for(tmp_path):
    """A file keeps more than the decisions (``==`` compares only those): the budget, device, method, seed, what the
    simulator predicted and whether the plan fits, each checked against figures computed here."""
    from memopt_nb import solvers
    from memopt_nb.device import DeviceSpec
    from memopt_nb.synthetic import chain_profile

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
