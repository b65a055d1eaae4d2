"""``optimizer="stream"``: optimizer state on the host, brought back one parameter at a time for the step.

The simulator (``Simulator.state_table``) and the replay (``replay._StateReplay``) implement the rules of
COST_MODEL.md sections 5 and 6 separately; here they are held to each other on every streamed placement of every unit
and on random mixes of all 18, with and without ``copy_overlap``, and both to the rules written out by hand from the
profile's ``param_steps``. The floor's split (``planners/floor.py``) is held to the simulator's table.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.core.errors import PlanError
from memopt_nb.core.plan import STATE_CHOICES
from memopt_nb.planners.floor import _moved_bytes, _state_off, explain_floor
from memopt_nb.sim.replay import copy_seconds, replay
from memopt_nb.sim.simulator import Simulator

STREAMED = [c for c, (o, _, _) in enumerate(STATE_CHOICES) if o == "stream"]
STREAM = STATE_CHOICES.index(("stream", "resident", "resident"))
OFFLOAD = STATE_CHOICES.index(("offload", "resident", "resident"))


class Stack(nn.Module):
    """Blocks of different sizes; the odd ones have several parameters (two Linear layers and a LayerNorm)."""

    def __init__(self, dims=(32, 96, 48, 128, 16)):
        super().__init__()
        blocks = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i % 2:
                blocks.append(nn.Sequential(nn.Linear(a, b), nn.LayerNorm(b), nn.Linear(b, b), nn.ReLU()))
            else:
                blocks.append(nn.Sequential(nn.Linear(a, b), nn.ReLU()))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, torch.randn(16, 32), loss_fn=lambda y: y.square().mean(), optimizer=opt, repeats=1)
    assert prof.n_units == 4 and all(len(u.param_steps) >= 2 for u in prof.units)
    return prof


def devices(prof):
    """One device that overlaps copies and one that does not; both pay per storage. The first's link is slow enough
    that the largest parameter's state takes twice the longest parameter step to come in (it cannot hide), while the
    small ones hide."""
    rows = [r for up in prof.units for r in up.param_steps]
    h2d = max(r["optimizer_bytes"] for r in rows) / (2 * max(r["step_time"] for r in rows))
    return {
        "overlap": prof.device.with_changes(copy_overlap=True, h2d_bytes_per_s=h2d, d2h_bytes_per_s=1.5 * h2d,
                                            copy_overhead_s=3e-6),
        "no overlap": prof.device.with_changes(copy_overlap=False, copy_overhead_s=3e-6),
    }


def edited(prof, unit, rows):
    """``prof`` with unit ``unit``'s ``param_steps`` replaced (through JSON, as an older or edited profile loads)."""
    d = json.loads(prof.to_json())
    d["units"][unit]["param_steps"] = rows
    return memopt.ModelProfile.from_dict(d)


def stream_peak(up, with_grads):
    """The rule, written out: per parameter its state, the next one's, its gradient if brought back, its step peak."""
    rows = up.param_steps
    return max(r["optimizer_bytes"] + (rows[j + 1]["optimizer_bytes"] if j + 1 < len(rows) else 0)
               + (r["grad_bytes"] if with_grads else 0) + r["step_rel_peak"] for j, r in enumerate(rows))


def both(prof, dev, s, w, d, c):
    """The simulator's (peak, time) and the replay, for one plan."""
    sim = Simulator(prof, dev)
    peak, time = sim.evaluate(np.array([s]), np.array([w]), np.array([d]), states=np.array([c]))
    rep = replay(prof, list(s), list(w), list(d), states=list(c), device=dev)
    return float(peak[0]), float(time[0]), rep


def assert_agree(prof, dev, s, w, d, c):
    peak, time, rep = both(prof, dev, s, w, d, c)
    assert peak == rep.peak_bytes, (s, c)
    assert time == pytest.approx(rep.step_time, rel=1e-12, abs=1e-15), (s, c)
    return rep


# ---------------------------------------------------------------------- (a) simulator and replay agree
@pytest.mark.parametrize("dev", ["overlap", "no overlap"])
def test_every_stream_choice_on_every_unit_agrees(stack, dev):
    prof = stack
    device = devices(prof)[dev]
    n = prof.n_units
    tab = Simulator(prof, device).state_table()
    assert tab.allowed[:, STREAMED].all()
    for strategy in (0, 1, 2):
        for u in range(n):
            for c in STREAMED:
                states = [0] * n
                states[u] = c
                rep = assert_agree(prof, device, [strategy] * n, [1] * n, [1] * n, states)
                assert rep.moves_state
        for c in STREAMED:  # every unit streams
            assert_agree(prof, device, [strategy] * n, [1] * n, [1] * n, [c] * n)


@pytest.mark.parametrize("dev", ["overlap", "no overlap"])
def test_random_mixes_of_all_18_choices_agree(stack, dev):
    prof = stack
    device = devices(prof)[dev]
    n = prof.n_units
    rng = np.random.default_rng(11)
    streamed = 0
    for _ in range(300):
        s, w, d = rng.integers(0, 4, n), rng.integers(0, 3, n), rng.integers(0, 4, n)
        c = rng.integers(0, len(STATE_CHOICES), n)
        assert_agree(prof, device, s, w, d, c)
        streamed += any(int(x) in STREAMED for x in c)
    assert streamed > 200


# ---------------------------------------------------------------------- the rules, written out by hand
@pytest.mark.parametrize("dev", ["overlap", "no overlap"])
def test_stream_is_offload_outside_the_step_and_its_seconds_follow_the_rule(stack, dev):
    prof = stack
    device = devices(prof)[dev]
    n, f = prof.n_units, device.time_factor(prof.device)
    ss = prof.step_segment
    keep = [0] * n
    for u, up in enumerate(prof.units):
        for g in ("resident", "offload"):
            states_s, states_o = [0] * n, [0] * n
            states_s[u] = STATE_CHOICES.index(("stream", g, "resident"))
            states_o[u] = STATE_CHOICES.index(("offload", g, "resident"))
            rs = replay(prof, keep, keep, keep, states=states_s, device=device)
            ro = replay(prof, keep, keep, keep, states=states_o, device=device)
            assert [p for k, p in enumerate(rs.segment_peaks) if k != ss] == \
                [p for k, p in enumerate(ro.segment_peaks) if k != ss]
        # seconds of (stream, resident, resident) alone: its step parameter by parameter, its state's copies
        states = [0] * n
        states[u] = STREAM
        rep = replay(prof, keep, keep, keep, states=states, device=device)
        rows = up.param_steps
        want = (sum(r["step_time"] for r in rows) - up.step_time) * f
        if not device.copy_overlap:
            want += (copy_seconds(device, "d2h", up.optimizer_bytes, up.optimizer_storages)
                     + copy_seconds(device, "h2d", up.optimizer_bytes, up.optimizer_storages))
        else:
            prev = prof.outside_step_time if u == 0 else prof.units[u - 1].step_time
            windows = [prev * f] + [r["step_time"] * f for r in rows[:-1]]
            want += 2 * up.optimizer_storages * device.copy_overhead_s + up.optimizer_bytes / device.d2h_bytes_per_s
            want += sum(max(0.0, r["optimizer_bytes"] / device.h2d_bytes_per_s - w)
                        for r, w in zip(rows, windows, strict=True))
        assert rep.state_time == pytest.approx(want, rel=1e-12, abs=1e-15)
    if device.copy_overlap:  # the link is slow enough that some parameter's state does not hide, some does
        wire = [r["optimizer_bytes"] / device.h2d_bytes_per_s for up in prof.units for r in up.param_steps]
        beside = [r["step_time"] * f for up in prof.units for r in up.param_steps]
        assert max(wire) > min(beside) and min(wire) < min(beside)


# ---------------------------------------------------------------------- (b) the step points
def test_stream_lowers_the_step_point_of_a_unit_with_several_parameters(stack):
    """At the part before unit u's, a streamed unit has its first parameter's state on the device (not all of it);
    at its own part, at most two parameters' state and one parameter's step peak: on blocks.1 (six parameters, two
    of them large) strictly less than its whole state and its whole step's peak."""
    prof = stack
    n = prof.n_units
    keep = [0] * n
    lowered = set()
    for u, up in enumerate(prof.units):
        for g in ("resident", "offload"):
            s_states, o_states = [0] * n, [0] * n
            s_states[u] = STATE_CHOICES.index(("stream", g, "resident"))
            o_states[u] = STATE_CHOICES.index(("offload", g, "resident"))
            sp = [p for _, p in replay(prof, keep, keep, keep, states=s_states).step_points]
            op = [p for _, p in replay(prof, keep, keep, keep, states=o_states).step_points]
            G = up.grad_bytes if g == "offload" else 0
            want = list(op)
            want[u] += up.param_steps[0]["optimizer_bytes"] - up.optimizer_bytes
            want[u + 1] += stream_peak(up, g == "offload") - (up.optimizer_bytes + G + up.step_rel_peak)
            assert sp == want, (u, g)
            # and the simulator's table says the same
            tab = Simulator(prof).state_table()
            diff = tab.step_delta[u, STATE_CHOICES.index(("stream", g, "resident"))] - \
                tab.step_delta[u, STATE_CHOICES.index(("offload", g, "resident"))]
            assert list(diff) == [a - b for a, b in zip(want, op, strict=True)]
            if sp[u + 1] < op[u + 1]:
                lowered.add((u, g))
    up = prof.units[1]
    assert len(up.param_steps) == 6
    assert stream_peak(up, False) < up.optimizer_bytes + up.step_rel_peak  # the rule lowers blocks.1's own point
    assert {(1, "resident"), (1, "offload")} <= lowered


def test_stream_can_raise_the_step_point_where_each_parameter_peaks_high(stack):
    """Not a free win: where each parameter's step alone peaks high (per-parameter kernels), the largest of them with
    two parameters' state can exceed the whole unit's state and step peak; both implementations then say so."""
    prof = stack
    u = 1
    up = prof.units[u]
    rows = [dict(r, step_rel_peak=3 * up.step_rel_peak) for r in up.param_steps]
    hot = edited(prof, u, rows)
    assert stream_peak(hot.units[u], False) > up.optimizer_bytes + up.step_rel_peak
    n = hot.n_units
    keep = [0] * n
    s_states, o_states = [0] * n, [0] * n
    s_states[u], o_states[u] = STREAM, OFFLOAD
    sp = replay(hot, keep, keep, keep, states=s_states).step_points
    op = replay(hot, keep, keep, keep, states=o_states).step_points
    assert sp[u + 1][1] > op[u + 1][1]
    assert sp[u + 1][1] - op[u + 1][1] == stream_peak(hot.units[u], False) - up.optimizer_bytes - up.step_rel_peak
    for dev in devices(hot).values():
        assert_agree(hot, dev, keep, keep, keep, s_states)


def test_stream_stepped_in_backward_peaks_by_the_rule(stack):
    """Stepped in backward, the unit's backward rises to the level after it plus grads_done_extra, less its whole
    state, plus the stream's largest moment (no gradient brought back: it is there)."""
    prof = stack
    n = prof.n_units
    keep = [0] * n
    for u, up in enumerate(prof.units):
        bs = up.bwd_segment
        without = [0] * n
        without[u] = STATE_CHOICES.index(("offload", "offload", "resident"))  # same bytes there, no step
        step = [0] * n
        step[u] = STATE_CHOICES.index(("stream", "step", "resident"))
        base = replay(prof, keep, keep, keep, states=without).segment_peaks[bs]
        moment = (prof.segments[bs + 1].start_level + up.grads_done_extra - up.optimizer_bytes
                  + stream_peak(up, False))
        rep = replay(prof, keep, keep, keep, states=step)
        assert rep.segment_peaks[bs] == max(base, moment)
        # in the parted step it is an offloaded unit stepped in backward: nothing of it comes back
        off_step = [0] * n
        off_step[u] = STATE_CHOICES.index(("offload", "step", "resident"))
        assert rep.step_points == replay(prof, keep, keep, keep, states=off_step).step_points
        for dev in devices(prof).values():
            assert_agree(prof, dev, keep, keep, keep, step)


# ---------------------------------------------------------------------- (c) a profile without param_steps
def test_replay_refuses_to_stream_a_unit_without_param_steps(stack):
    prof = stack
    old = edited(prof, 2, [])
    n = old.n_units
    keep = [0] * n
    for c in STREAMED:
        states = [0] * n
        states[2] = c
        with pytest.raises(PlanError, match="re-profile"):
            replay(old, keep, keep, keep, states=states)
    tab = Simulator(old).state_table()
    assert not tab.allowed[2, STREAMED].any() and tab.allowed[2, OFFLOAD]
    assert tab.allowed[[0, 1, 3]][:, STREAMED].all()
    states = [STREAM, 0, OFFLOAD, STREAM]  # the other units still stream
    assert_agree(old, None, keep, keep, keep, states)


# ---------------------------------------------------------------------- the floor's split
def test_floor_state_off_follows_the_state_table(stack):
    """What _state_off says a placement keeps off the device is the simulator's row for it, up to the step's own
    peak (the working set) at the unit's own step point and the step-in-backward spike."""
    prof = stack
    sim = Simulator(prof)
    tab = sim.state_table()
    n, ss = prof.n_units, prof.step_segment
    for u, up in enumerate(prof.units):
        for c, (o, g, p) in enumerate(STATE_CHOICES):
            if c == 0 or not tab.allowed[u, c]:
                continue
            for k in range(n + 1):
                off = sum(_state_off(up, u, n, (o, g, p), sim, k, True))
                work = 0
                if k == u + 1 and g == "step":
                    work = -up.step_rel_peak
                elif k == u + 1 and o == "stream":
                    rows = up.param_steps
                    j = max(range(len(rows)), key=lambda j: rows[j]["optimizer_bytes"] + rows[j]["step_rel_peak"]
                            + (rows[j + 1]["optimizer_bytes"] if j + 1 < len(rows) else 0)
                            + (rows[j]["grad_bytes"] if g == "offload" else 0))
                    work = rows[j]["step_rel_peak"] - up.step_rel_peak
                assert -off + work == tab.step_delta[u, c, k], (u, (o, g, p), k)
            for k in range(len(prof.segments)):
                if k == ss or (g == "step" and k == up.bwd_segment):
                    continue
                assert -sum(_state_off(up, u, n, (o, g, p), sim, k, False)) == tab.seg_delta[u, c, k]


def test_moved_bytes_counts_what_a_stream_brings_back():
    """Units of parameters 1/4/2 MiB; unit 1 streams its state (8 MiB) as parameters of 6 and 2 MiB state; the most
    back at once is unit 1's first two parameters' state (8) with unit 2's first parameter's (3) on its way in."""
    MiB = 1 << 20
    units = [SimpleNamespace(param_bytes=p * MiB, grad_bytes=p * MiB, optimizer_bytes=2 * p * MiB,
                             param_steps=[{"optimizer_bytes": a * MiB, "grad_bytes": a * MiB // 2, "step_rel_peak": 0}
                                          for a in parts])
             for p, parts in ((1, (2,)), (4, (6, 2)), (2, (3, 1)))]
    stream_all = SimpleNamespace(placements=[("stream", "resident", "resident")] * 3)
    offload_all = SimpleNamespace(placements=[("offload", "resident", "resident")] * 3)
    # offloaded: 14 off, the most back at once unit 1 whole (8) with unit 2's state (4): 2
    assert _moved_bytes(SimpleNamespace(units=units), offload_all) == 2 * MiB
    # streamed: 14 off, the most back at once unit 1's two parameters' (8) and unit 2's first (3): 3
    assert _moved_bytes(SimpleNamespace(units=units), stream_all) == 3 * MiB
    # with gradients offloaded too (7 more off): unit 1's parameter 0 with its gradient and parameter 1's state
    # (6 + 3 + 2) and unit 2's first parameter's state (3): 21 - 14
    grads = SimpleNamespace(placements=[("stream", "offload", "resident")] * 3)
    assert _moved_bytes(SimpleNamespace(units=units), grads) == 7 * MiB


def test_floor_with_stream_allowed_is_no_higher_and_its_parts_add_up(stack):
    prof = stack
    with_stream = explain_floor(prof, offload_state=True)
    without = explain_floor(prof, offload_state={"grads", "params"})
    assert with_stream.floor_bytes <= without.floor_bytes
    if with_stream.peak_parts:
        assert sum(with_stream.peak_parts.values()) == with_stream.floor_bytes
        assert with_stream.peak_parts["optimizer state"] >= 0
