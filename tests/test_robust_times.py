"""Profile times on a busy machine (memopt_nb.profiling.timing): identical units pooled, stalls set aside, disturbed
repeats measured again, the spread and the busy warning recorded and shown. Deterministic: the stalls are injected
through the profile's clock and a fake reference, and nothing asserts how long anything took."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.core.plan import Plan
from memopt_nb.core.profile import ModelProfile, UnitProfile
from memopt_nb.profiling import timing, tracer

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = Path(__file__).parent / "data"


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(d_in, d_out), nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.fc(x)))


def chain() -> nn.Sequential:
    """Four identical blocks, then one whose parameters differ in shape and one whose input does."""
    torch.manual_seed(0)
    return nn.Sequential(Block(16, 16), Block(16, 16), Block(16, 16), Block(16, 16), Block(16, 24), Block(24, 24))


def profile(model: nn.Module, repeats: int = 3) -> ModelProfile:
    opt = torch.optim.Adam(model.parameters())
    return memopt.profile(model, torch.randn(8, 16), loss_fn=lambda y: y.square().mean(), optimizer=opt,
                          units=[str(i) for i in range(6)], repeats=repeats)


def test_identical_units_are_pooled_and_units_differing_in_shape_are_not():
    prof = profile(chain())
    assert prof.meta["timing"]["pooled"] == [["0", "1", "2", "3"]]
    same = prof.units[:4]
    for field in ("fwd_time", "bwd_time", "step_time"):
        assert len({getattr(u, field) for u in same}) == 1, field
    assert len({tuple(p["step_time"] for p in u.param_steps) for u in same}) == 1
    assert set(prof.meta["timing"]["units"]) == set(prof.unit_names)
    # the profile's times are its segments' (one source of truth), and the step is their sum
    assert all(u.fwd_time == prof.segments[u.fwd_segment].time for u in prof.units)
    assert prof.step_time == pytest.approx(sum(s.time for s in prof.segments))


def test_signature_tells_shapes_dtypes_and_classes_apart():
    a, b = Block(16, 16), Block(16, 16)
    io = ([[8, 16]], [[8, 16]])
    assert timing.unit_signature(a, *io) == timing.unit_signature(b, *io)
    assert timing.unit_signature(a, [[4, 16]], [[4, 16]]) != timing.unit_signature(b, *io)  # another input shape
    assert timing.unit_signature(Block(16, 24), [[8, 16]], [[8, 24]]) != timing.unit_signature(a, *io)
    assert timing.unit_signature(b.double(), *io) != timing.unit_signature(a, *io)  # another dtype
    other = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))  # the same parameters in another class
    assert timing.unit_signature(other, *io) != timing.unit_signature(a, *io)


def test_robust_estimate_sets_a_stall_aside():
    est, out, spread = timing.robust_estimate([0.010, 0.011, 0.5, 0.012, 0.0105])
    assert out == 1 and 0.010 <= est <= 0.012 and spread > 0
    assert timing.robust_estimate([0.01]) == (0.01, 0, 0.0)
    assert timing.robust_estimate([]) == (0.0, 0, 0.0)


class _StalledClock(tracer._Clock):
    """The profile's clock, with a one-second stall in unit 1's forward in the steps whose clocks are numbered in
    ``STALL`` (counted from the first clock made)."""

    made = 0
    STALL: set[int] = set()

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        _StalledClock.made += 1
        self.stall, self.offset = _StalledClock.made in _StalledClock.STALL, 0.0

    def mark(self, label) -> None:  # noqa: ANN001
        super().mark(label)
        label_, t = self.stamps[-1]
        self.stamps[-1] = (label_, t + self.offset)
        if self.stall and label == ("fwd_start", 1):
            self.offset = 1.0  # every later mark one second later: unit 1's forward took a second more


def test_profile_sets_an_injected_stall_aside(monkeypatch):
    # clocks: 1 the untimed step, 2-4 the three timed steps; unit 1 stalls in two of them, so its own median would be
    # the stall; the pooled estimate sets both stalls aside
    monkeypatch.setattr(_StalledClock, "made", 0)
    monkeypatch.setattr(_StalledClock, "STALL", {2, 3})
    monkeypatch.setattr(tracer, "_Clock", _StalledClock)
    monkeypatch.setattr(timing, "reference_op", lambda device: lambda: 1e-3)  # a steady machine otherwise
    prof = profile(chain())
    stalled = prof.units[1]
    assert stalled.fwd_time < 0.5 and stalled.fwd_time == prof.units[0].fwd_time
    assert prof.step_time < 0.5
    assert prof.meta["timing"]["outliers"] > 0
    assert prof.meta["timing"]["steps"] == 3 and prof.meta["timing"]["set_aside"] == 0


def _fake_steps(stall_at: set[int]):
    """A step function returning 10 ms per segment (a second in the steps numbered in ``stall_at``) and its calls."""
    calls = []

    def step():
        calls.append(len(calls))
        d = [1.0 if len(calls) - 1 in stall_at else 0.01] * 3
        return d, [x * 2 for x in d]

    return step, calls


def test_a_step_beside_a_slow_reference_is_measured_again():
    step, calls = _fake_steps({1})
    refs = iter([1e-3, 1e-3, 9e-3, 1e-3, 1e-3, 1e-3])  # slow between the second step and the third

    times, info = timing.timed_repeats(step, 3, torch.device("cpu"), reference=lambda: next(refs))
    # steps 2 and 3 ran next to the slow reference: both set aside, two more run
    assert len(calls) == 5 and len(times) == 3
    assert info["set_aside"] == 2 and info["disturbed"] == 0
    assert all(t == [0.01] * 3 for t in times)  # the stalled step is not among them
    assert info["wall_over_cpu"] == pytest.approx(2.0) and info["clock"] == "cpu"
    assert timing.time_warning({**info, "wall_over_cpu": 1.0, "outliers": 0.0, "step_spread": 0.0}) is None


def test_re_measuring_is_bounded_and_a_busy_machine_is_said_so():
    step, calls = _fake_steps(set())
    refs = iter([1e-3] + [9e-3] * 10)  # the reference is slow beside every step

    times, info = timing.timed_repeats(step, 3, torch.device("cpu"), reference=lambda: next(refs))
    assert len(calls) == 6 and len(times) == 3  # at most twice the repeats
    assert info["disturbed"] == 3
    warning = timing.time_warning({**info, "outliers": 0.4, "step_spread": 0.5, "threads": 2})
    assert "too busy" in warning and "3 of the timed steps" in warning and "40%" in warning
    assert "set_num_threads(1)" in warning
    busy = timing.time_warning({"wall_over_cpu": 3.0, "threads": 1})
    assert "3.0x the CPU time" in busy and "too busy" not in busy


def test_pooled_optimizer_steps_take_the_median():
    def unit(i: int, t: float) -> UnitProfile:
        return UnitProfile(name=str(i), index=i, type="Block", fwd_time=0, bwd_time=0, saved_bytes=0,
                           interior_bytes=0, input_bytes=0, output_bytes=0, param_bytes=0, has_rng=False,
                           has_running_stats=False, recomputable=True, swappable=True, fwd_segment=0, bwd_segment=0,
                           rc_fwd_rel_peak=0, rc_bwd_rel_peak=0, step_time=t,
                           param_steps=[{"step_time": t / 2}, {"step_time": t / 2}])

    units = [unit(0, 1.0), unit(1, 2.0), unit(2, 30.0), unit(3, 5.0)]
    timing.pool_step_times(units, [[0, 1, 2], [3]])
    assert [u.step_time for u in units] == [2.0, 2.0, 2.0, 5.0]
    assert units[2].param_steps == [{"step_time": 1.0}, {"step_time": 1.0}]


def test_timing_round_trips_through_json_and_shows_in_the_table(tmp_path):
    prof = profile(chain(), repeats=1)
    prof.meta["time_warning"] = "The machine was too busy while profiling to trust its times: a test."
    back = ModelProfile.load(prof.save(tmp_path / "p.json"))
    assert back.meta["timing"] == prof.meta["timing"] and back.meta["time_warning"] == prof.meta["time_warning"]
    plan = Plan.from_strategies(prof, ["recompute", "keep", "swap", "keep", "keep", "keep"])
    assert memopt.simulate(back, plan).step_time == memopt.simulate(prof, plan).step_time
    html = back._repr_html_()
    assert "Busy machine" in html and "a test." in html and "identical units" in html
    assert 'title="spread' in html


def test_an_older_profile_still_loads_and_shows():
    old = ModelProfile.load(DATA / "zoo_gpt_profile.json")  # made before the profile recorded its timing
    assert "timing" not in old.meta
    html = old._repr_html_()
    assert "<table>" in html and "Busy machine" not in html and 'title="spread' not in html
    assert memopt.simulate(old, Plan.uniform(old, "recompute")).step_time > 0
