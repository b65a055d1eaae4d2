"""The cost model of whole-step plans: per-unit state in the profile, StateTable, the reference replay, and predicted
peaks against peaks measured under StateManager."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import tolerances

import memopt_nb as memopt
from memopt_nb.core.errors import PlanError
from memopt_nb.core.plan import STATE_CHOICES, Plan, optimizer_fingerprint
from memopt_nb.planners.floor import explain_floor
from memopt_nb.runtime.apply import AppliedPlan
from memopt_nb.runtime.memory import meter_for
from memopt_nb.runtime.step import preserved_state, training_step
from memopt_nb.sim.replay import replay
from memopt_nb.sim.simulator import Simulator, StateTable


def _small_mlp():
    z = memopt.zoo.mlp(batch_size=32, width=64, depth=3)
    opt = torch.optim.Adam(z.model.parameters(), lr=1e-3)
    prof = memopt.profile(z.model, *z.inputs, loss_fn=z.loss_fn, optimizer=opt, repeats=1)
    return z, opt, prof


@pytest.fixture(scope="module")
def mlp():
    return _small_mlp()


def with_placements(plan, placements):
    decisions = tuple(dataclasses.replace(d, optimizer=o, grads=g, params=p)
                      for d, (o, g, p) in zip(plan.decisions, placements, strict=True))
    out = dataclasses.replace(plan, decisions=decisions,
                              step_in_backward=any(g == "step" for _, g, _ in placements))
    out._model_ref, out._optimizer_ref = plan._model_ref, plan._optimizer_ref
    return out


def measure_state(model, inputs, loss_fn, optimizer, plan):
    """Peak of one step under the plan's strategies and placements, measured as memopt.measure does (1 warm-up)."""
    with preserved_state(model, optimizer):
        with AppliedPlan(plan, model, optimizer):  # activation strategies and the StateManager for the placements
            meter = meter_for(torch.device("cpu"))
            meter.track(model, optimizer, list(inputs))
            with meter:
                training_step(model, inputs, loss_fn, optimizer)
                meter.reset_peak()
                training_step(model, inputs, loss_fn, optimizer)
            return int(meter.peak)


# ---------------------------------------------------------------------- profile
def test_profile_records_state_per_unit(mlp):
    z, opt, prof = mlp
    for u in prof.units:
        mod = z.model.get_submodule(u.name)
        nbytes = sum(p.nbytes for p in mod.parameters())
        assert u.grad_bytes == nbytes == u.param_bytes
        assert u.optimizer_bytes == 2 * nbytes  # Adam: exp_avg and exp_avg_sq (the 0-dim step stays)
        assert u.optimizer_storages == 2 * len(list(mod.parameters()))
        assert u.step_rel_peak > 0 and u.step_time > 0 and u.params_offloadable
    assert prof.segments[prof.step_segment].label == "to optimizer_end"
    assert prof.meta["optimizer_fingerprint"] == optimizer_fingerprint(opt)
    assert prof._optimizer_ref() is opt
    plan = Plan.uniform(prof, "keep")
    assert plan.optimizer_fingerprint == prof.meta["optimizer_fingerprint"] and plan._optimizer_ref() is opt


def test_schema_1_profile_loads_with_resident_state(mlp):
    _, _, prof = mlp
    d = json.loads(prof.to_json())
    assert d["schema_version"] == 2
    d["schema_version"] = 1
    for k in ("step_segment", "outside_step_time", "outside_step_rel_peak", "chunked_step_time"):
        d.pop(k)
    for u in d["units"]:
        for k in ("grad_bytes", "optimizer_bytes", "param_storages", "grad_storages", "optimizer_storages",
                  "step_time", "step_rel_peak", "params_offloadable"):
            u.pop(k)
    old = memopt.ModelProfile.from_dict(d)
    assert old.step_segment == prof.step_segment  # found by its label
    tab = Simulator(old).state_table()
    assert not tab.seg_delta.any() and not tab.allowed[:, 1:].any()
    plan = Plan.uniform(old, "recompute")
    assert memopt.simulate(old, plan).peak_bytes == memopt.simulate(prof, plan).peak_bytes


# ---------------------------------------------------------------------- the table and the separable form
def test_state_table_shapes_and_choice_zero(mlp):
    _, _, prof = mlp
    sim = Simulator(prof)
    tab = sim.state_table()
    n, C, S = prof.n_units, len(STATE_CHOICES), len(prof.segments)
    assert isinstance(tab, StateTable) and tab.choices == STATE_CHOICES
    assert tab.seg_delta.shape == (n, C, S) and tab.seg_delta.dtype == np.int64
    assert tab.step_base.shape == (n + 1,) and tab.step_delta.shape == (n, C, n + 1)
    assert tab.time.shape == (n, C) and tab.allowed.shape == (n, C)
    assert not tab.seg_delta[:, 0].any() and not tab.step_delta[:, 0].any() and not tab.time[:, 0].any()
    assert tab.plain_step_peak == prof.segments[prof.step_segment].start_level + prof.segments[
        prof.step_segment].rel_peak
    # offloading optimizer state lowers every segment before the step by exactly that unit's state
    c = STATE_CHOICES.index(("offload", "resident", "resident"))
    for u, up in enumerate(prof.units):
        assert (tab.seg_delta[u, c, : prof.step_segment] == -up.optimizer_bytes).all()


def test_evaluate_follows_the_contract_formula(mlp):
    _, _, prof = mlp
    sim = Simulator(prof)
    tab = sim.state_table()
    rng = np.random.default_rng(3)
    n, B = prof.n_units, 64
    s = rng.integers(0, 3, (B, n))
    w = rng.integers(0, 3, (B, n))
    d = rng.integers(0, 4, (B, n))
    c = rng.integers(0, len(STATE_CHOICES), (B, n))
    c[:8] = 0
    act = sim.evaluate(s, w, d, details=True)
    peak, time = sim.evaluate(s, w, d, states=c)
    for b in range(B):
        seg = act["peaks"][b] + sum(tab.seg_delta[u, c[b, u]] for u in range(n))
        moved = (c[b] != 0).any()
        step = (tab.step_base + sum(tab.step_delta[u, c[b, u]] for u in range(n))).max() if moved \
            else tab.plain_step_peak
        assert peak[b] == max(seg.max(), step)
        want = act["time"][b] + sum(tab.time[u, c[b, u]] for u in range(n)) + (tab.chunked_step_extra if moved else 0)
        assert time[b] == pytest.approx(want)
    none = sim.evaluate(s, w, d)
    zero = sim.evaluate(s, w, d, states=np.zeros_like(s))
    assert np.array_equal(none[0], zero[0]) and np.allclose(none[1], zero[1])


@pytest.mark.parametrize("device", [None, "a100-40gb"])
def test_fast_simulator_equals_reference_on_random_placements(mlp, device):
    _, _, prof = mlp
    sim = Simulator(prof, device)
    rng = np.random.default_rng(7)
    n = prof.n_units
    for _ in range(150):
        s, w, d = rng.integers(0, 3, n), rng.integers(0, 3, n), rng.integers(0, 4, n)
        c = rng.integers(0, len(STATE_CHOICES), n)
        peak, time = sim.evaluate(s[None], w[None], d[None], states=c[None])
        rep = replay(prof, list(s), list(w), list(d), states=list(c), device=sim.device)
        assert peak[0] == rep.peak_bytes, (s, c)
        assert time[0] == pytest.approx(rep.step_time, rel=1e-12, abs=1e-15), (s, c)


def test_simulate_reads_the_plans_placements_and_says_where_the_peak_is(mlp):
    _, _, prof = mlp
    keep = Plan.uniform(prof, "keep")
    plain = memopt.simulate(prof, keep)
    off = memopt.simulate(prof, with_placements(keep, [("offload", "offload", "offload")] * prof.n_units))
    assert off.peak_bytes < plain.peak_bytes and off.state_time > 0 and plain.state_time == 0
    for r in (plain, off):
        assert r.peak_phase in ("forward", "backward", "optimizer step", "after the step")
    assert off.step_peak < plain.step_peak
    events = [row["event"] for row in off.timeline]
    assert any(e.startswith("step of") for e in events)  # the unit-by-unit step is in the timeline


def test_offloading_an_unmovable_unit_is_refused():
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)])
            self.head = nn.Linear(16, 16)
            self.head.weight = self.blocks[0][0].weight  # tied: unit 0's weight is used outside it

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    model = Tied()
    opt = torch.optim.Adam(model.parameters())
    prof = memopt.profile(model, torch.randn(4, 16), optimizer=opt, repeats=1)
    assert not prof.units[0].params_offloadable and prof.units[1].params_offloadable
    plan = with_placements(Plan.uniform(prof, "keep"), [("resident", "resident", "offload")] * prof.n_units)
    with pytest.raises(PlanError, match="cannot be offloaded"):
        memopt.simulate(prof, plan)


# ---------------------------------------------------------------------- the acid test
PLACEMENTS = {
    "optimizer offload": ("offload", "resident", "resident"),
    "params offload": ("resident", "resident", "offload"),
    "all together": ("offload", "offload", "offload"),
    "grads offload": ("resident", "offload", "resident"),
    "step in backward": ("resident", "step", "resident"),
    "all + step in backward": ("offload", "step", "offload"),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["keep", "recompute"])
def test_predicted_peak_equals_measured_under_state_manager(mlp, strategy):
    """To the byte for every placement, except a step in backward under recompute: within the largest unit's output
    (``tolerances.step_in_backward_recompute``, the README's words)."""
    z, opt, prof = mlp
    base = Plan.uniform(prof, strategy)
    for label, pl in PLACEMENTS.items():
        plan = with_placements(base, [pl] * prof.n_units)
        predicted = memopt.simulate(prof, plan).peak_bytes
        measured = measure_state(z.model, z.inputs, z.loss_fn, opt, plan)
        if strategy == "recompute" and pl[1] == "step":
            assert abs(predicted - measured) <= tolerances.step_in_backward_recompute(prof), (label, strategy)
        else:
            assert predicted - measured == tolerances.EXACT, (label, strategy, predicted, measured)


# ---------------------------------------------------------------------- the floor
def test_floor_with_state_offload_is_lower_and_reached(mlp):
    _, _, prof = mlp
    plain = explain_floor(prof)
    moved = explain_floor(prof, offload_state=True)
    assert moved.floor_bytes < plain.floor_bytes
    assert moved.state_floor_bytes == moved.floor_bytes and moved.moved_bytes > 0
    assert memopt.simulate(prof, moved.plan).peak_bytes == moved.floor_bytes
    assert moved.fixed_bytes < plain.fixed_bytes
    sib = explain_floor(prof, offload_state=True, step_in_backward=True)
    assert sib.floor_bytes <= moved.floor_bytes


def test_floor_advice_names_state_offload_when_state_bounds_it():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(4)])
    x, y = torch.randn(8, 256), torch.randn(8, 256)
    opt = torch.optim.Adam(model.parameters())
    prof = memopt.profile(model, x, loss_fn=lambda out: F.mse_loss(out, y), optimizer=opt, repeats=1)
    fl = explain_floor(prof)
    assert fl.bound == "fixed state"
    assert any("offload_state=True" in a for a in fl.advice)


@pytest.mark.parametrize("strategy", ["keep", "recompute"])
def test_mixed_placements_measured_exactly(mlp, strategy):
    """Units placed differently: what is on the device depends on each unit's own placement only (StateManager's
    fixed-neighbour prefetch and fixed unit-by-unit step), so the sum over units is exact."""
    z, opt, prof = mlp
    r, o = "resident", "offload"
    mixes = [[(r, r, o), (r, r, r), (o, r, o)], [(o, r, r), (r, r, o), (r, r, r)]]
    for placements in mixes:
        plan = with_placements(Plan.uniform(prof, strategy), placements)
        assert memopt.simulate(prof, plan).peak_bytes == measure_state(z.model, z.inputs, z.loss_fn, opt, plan), \
            placements
