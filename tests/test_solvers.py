import math

import numpy as np
import pytest

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.errors import BudgetError
from memopt_nb.reference_sim import replay
from memopt_nb.simulate import Simulator
from memopt_nb.synthetic import chain_profile

CASES = (
    [("keep-recompute", n, seed, frac) for n in (6, 9, 12) for seed in range(3) for frac in (0.15, 0.6)]
    + [("all", n, seed, frac) for n in (3, 4, 5) for seed in range(5) for frac in (0.1, 0.4, 0.8)]
    + [("all-cpu", 4, seed, frac) for seed in range(3) for frac in (0.2, 0.7)]
)


# small configurations (brute force enumerates up to 14 options per unit); unet with units picked by name, so that
# code between units (down.1, the bottleneck) saves storages units also save
SMALL_ZOO = {"gpt": (dict(n_layers=4, batch_size=4, seq_len=64, d_model=64), "auto"),
             "resnet": (dict(blocks_per_stage=1), "auto"),
             "unet": (dict(widths=(8, 16, 32), image=16, batch_size=4), ["down.0", "down.2", "up.0", "up.1"])}


@pytest.fixture(scope="module")
def small_zoo():
    import torch

    out = {}
    for name, (kw, units) in SMALL_ZOO.items():
        zm = memopt.zoo.build(name, **kw)
        opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
        out[name] = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1, units=units)
    return out


@pytest.mark.parametrize("kind,n,seed,frac", CASES)
def test_exact_solver_matches_brute_force(kind, n, seed, frac):
    device = None
    if kind == "all-cpu":
        device = memopt.DeviceSpec(name="cpu-like", kind="cpu", capacity_bytes=2**34, h2d_bytes_per_s=5e9,
                                   d2h_bytes_per_s=5e9, compute_flops=1e11, copy_overlap=False)
    prof = chain_profile(n, seed=seed, device=device)
    strategies = ("keep", "recompute") if kind == "keep-recompute" else ("keep", "recompute", "swap")
    lo = solvers.min_peak(prof, strategies=strategies)
    budget = int(lo + frac * (prof.peak_bytes - lo))
    exact = solvers.optimal(prof, budget, strategies=strategies)
    oracle = solvers.brute_force(prof, budget, strategies=strategies)
    assert exact.feasible and oracle.feasible
    assert exact.predicted_step_time == pytest.approx(oracle.predicted_step_time, rel=1e-9)
    assert exact.meta["milp_step_time"] == pytest.approx(exact.predicted_step_time, rel=1e-6)


def test_min_peak_is_the_true_minimum():
    prof = chain_profile(5, seed=11)
    lo = solvers.min_peak(prof)
    sim = Simulator(prof)
    import itertools

    from memopt_nb.solvers.common import unit_options
    opts = [unit_options(sim, u) for u in range(prof.n_units)]
    arr = np.array(list(itertools.product(*opts)))
    peaks, _ = sim.evaluate(arr[:, :, 0], arr[:, :, 1], arr[:, :, 2])
    assert lo == int(np.ceil(peaks.min()))


@pytest.mark.parametrize("name", list(solvers.BASELINES) + ["optimal"])
def test_baselines_report_feasibility_honestly(name, small_zoo):
    fn = solvers.optimal if name == "optimal" else solvers.BASELINES[name]
    for case in ("gpt", "resnet"):
        prof = small_zoo[case]
        lo = solvers.min_peak(prof)
        for frac in (0.05, 0.5, 0.95):
            budget = int(lo + frac * (prof.peak_bytes - lo))
            plan = fn(prof, budget)
            assert plan.method == name
            sim = memopt.simulate(prof, plan)
            assert plan.feasible == (sim.peak_bytes <= budget)
            assert plan.predicted_peak_bytes == sim.peak_bytes
            if name == "optimal":
                assert plan.feasible


def test_budget_below_min_peak_is_refused(small_zoo):
    prof = small_zoo["gpt"]
    lo = solvers.min_peak(prof)
    for fn in [solvers.optimal, *solvers.BASELINES.values()]:
        with pytest.raises(BudgetError, match="smallest peak") as err:
            fn(prof, lo - 1)
        assert memopt.format_bytes(lo) in str(err.value)
    with pytest.raises(BudgetError, match="cannot read"):
        solvers.optimal(prof, "lots")
    plan = solvers.optimal(prof, "60%")
    assert plan.budget_bytes == int(0.6 * prof.peak_bytes)


# ---------------------------------------------------------------------- baselines against their definitions
def _codes(plan):
    return list(plan.strategies)


@pytest.mark.parametrize("n", list(range(1, 18)) + [24, 25, 26])
def test_sqrt_n_keeps_the_last_unit_of_ceil_sqrt_n_segments(n):
    prof = chain_profile(n, seed=n)
    plan = solvers.sqrt_n(prof, budget=prof.peak_bytes)
    s = _codes(plan)
    assert set(s) <= {"keep", "recompute"} and s[-1] == "keep"
    ends = [u for u in range(n) if s[u] == "keep"]  # each segment ends with its kept unit
    sizes = [b - a for a, b in zip([-1] + ends, ends)]
    assert len(sizes) == math.ceil(math.sqrt(n)), (n, s)
    size = math.ceil(n / math.ceil(math.sqrt(n)))
    assert sizes[:-1] == [size] * (len(sizes) - 1) and 1 <= sizes[-1] <= size, (n, sizes)


def test_sqrt_n_keeps_units_that_cannot_be_recomputed_and_ignores_the_budget():
    prof = chain_profile(9, seed=2)
    for u in (0, 4):
        prof.units[u].recomputable = False
    plan = solvers.sqrt_n(prof, budget=solvers.min_peak(prof))
    # three segments of three; units 0 and 4 would be recomputed but cannot be
    assert _codes(plan) == ["keep", "recompute", "keep", "recompute", "keep", "keep", "recompute", "recompute",
                            "keep"]
    assert plan.feasible is False and plan.predicted_peak_bytes > plan.budget_bytes


def test_swap_all_is_save_on_cpu(small_zoo):
    """Every swappable unit offloaded synchronously (window 0) and brought back on demand (distance 0)."""
    prof = small_zoo["unet"]
    plan = solvers.swap_all(prof, budget=prof.peak_bytes, device="a100-40gb")
    assert _codes(plan) == ["swap"] * prof.n_units
    assert plan.offload_windows == [0] * prof.n_units and plan.prefetch_distances == [0] * prof.n_units
    rep = replay(prof, plan, device="a100-40gb")
    fwd = [u.fwd_segment for u in prof.units] + [prof.units[-1].fwd_segment + 1]
    for job in rep.copies:
        if job.direction == "d2h":  # dropped before the very next unit runs: the forward waits for the copy
            assert job.due == min(b for b in fwd if b >= job.boundary)
        else:  # brought back when its own backward starts, not before
            assert job.boundary == job.due == prof.units[job.owners[0]].bwd_segment
    # units that cannot be swapped are kept; without a host link nothing is swapped
    chain = chain_profile(6, seed=1)
    chain.units[2].swappable = False
    assert _codes(solvers.swap_all(chain, budget=chain.peak_bytes)) == ["swap", "swap", "keep", "swap", "swap", "swap"]
    no_link = chain.device.with_changes(h2d_bytes_per_s=0.0, d2h_bytes_per_s=0.0)
    assert _codes(solvers.swap_all(chain, budget=chain.peak_bytes, device=no_link)) == ["keep"] * 6


def capuchin_by_definition(prof, budget, device):
    """Capuchin as its docstring states it, with the reference simulator for peaks."""
    dev = memopt.DeviceSpec.resolve(device, prof.device)
    factor = dev.time_factor(prof.device)
    n = prof.n_units
    fwd = [prof.segments[u.fwd_segment].time * factor for u in prof.units]
    bwd = [prof.segments[u.bwd_segment].time * factor for u in prof.units]
    codes, ws, ds = ["keep"] * n, [1] * n, [1] * n

    def fits():
        return replay(prof, codes, ws, ds, device=dev).peak_bytes <= budget

    # 1. swaps the surrounding compute hides, largest first, each with the shortest window and distance that hide it
    if not fits() and dev.has_host_link and dev.copy_overlap:
        size = [u.interior_bytes + u.input_bytes for u in prof.units]
        for u in sorted(range(n), key=lambda u: (-size[u], u)):
            copy = size[u] / min(dev.d2h_bytes_per_s, dev.h2d_bytes_per_s)
            w = next((w for w in (1, 2) if sum(fwd[u + 1: u + 1 + w]) >= copy), None)
            d = next((d for d in (1, 2, 3) if sum(bwd[u + 1: u + 1 + d]) >= copy), None)
            if w is None or d is None or not prof.units[u].swappable:
                continue
            codes[u], ws[u], ds[u] = "swap", w, d
            if fits():
                break
    # 2. then recompute, most memory saved per second of recompute first
    if not fits():
        rate = [u.interior_bytes / max(f, 1e-9) for u, f in zip(prof.units, fwd, strict=True)]
        for u in sorted(range(n), key=lambda u: (-rate[u], u)):
            if codes[u] == "keep" and prof.units[u].recomputable:
                codes[u] = "recompute"
                if fits():
                    break
    return codes, ws, ds


@pytest.mark.parametrize("case", ["gpt", "resnet", "unet", "chain10"])
def test_capuchin_decides_in_its_stated_order(case, small_zoo):
    prof = chain_profile(10, seed=4) if case == "chain10" else small_zoo[case]
    swapped = 0
    # a link fast enough that the compute around every unit hides its copy: the swap phase always runs
    fast_link = memopt.DeviceSpec.preset("a100-40gb").with_changes(name="fast-link", h2d_bytes_per_s=1e15,
                                                                   d2h_bytes_per_s=1e15)
    lopsided = memopt.DeviceSpec.preset("a100-40gb").with_changes(name="lopsided", h2d_bytes_per_s=1e11,
                                                                  d2h_bytes_per_s=1e9)  # the slower way counts
    for device in ("a100-40gb", fast_link, lopsided, None):
        lo = solvers.min_peak(prof, device=device)
        for frac in (0.05, 0.3, 0.6, 0.9):
            budget = int(lo + frac * (prof.peak_bytes - lo))
            plan = solvers.capuchin(prof, budget, device=device)
            codes, ws, ds = capuchin_by_definition(prof, budget, device)
            assert _codes(plan) == codes, (case, device, frac)
            swaps = [u for u in range(prof.n_units) if codes[u] == "swap"]
            assert [plan.offload_windows[u] for u in swaps] == [ws[u] for u in swaps]
            assert [plan.prefetch_distances[u] for u in swaps] == [ds[u] for u in swaps]
            swapped += len(swaps)
    assert swapped > 0  # the first phase is exercised


# ---------------------------------------------------------------------- MILP vs brute force on real profiles
def fixed_times(prof):
    """A copy of ``prof`` whose segment times do not depend on how busy the machine was when it was profiled."""
    prof = type(prof).from_dict(prof.to_dict())
    for k, seg in enumerate(prof.segments):
        seg.time = 1e-3 * (1 + k % 3)
    for u in prof.units:
        u.fwd_time, u.bwd_time = prof.segments[u.fwd_segment].time, prof.segments[u.bwd_segment].time
    return prof


@pytest.mark.parametrize("name", list(SMALL_ZOO))
def test_exact_solver_matches_brute_force_on_real_profiles(name, small_zoo):
    profiled = small_zoo[name]
    assert 3 <= profiled.n_units <= 4
    used_swap = False
    # a link that hides every copy: there the optimum must swap, whatever the profiled times
    fast_link = memopt.DeviceSpec.preset("a100-40gb").with_changes(name="fast-link", h2d_bytes_per_s=1e15,
                                                                   d2h_bytes_per_s=1e15)
    # GPU preset (copies overlap), the profiled CPU (copies cost time), a link that hides them; there plans whose
    # steps differ by less than HiGHS's absolute MIP gap (1e-6, here seconds) are ties to the solver
    for device, prof, tol in (("a100-40gb", profiled, 0.0), (None, profiled, 0.0),
                              (fast_link, fixed_times(profiled), 1e-6)):
        lo = solvers.min_peak(prof, device=device)
        for frac in (0.1, 0.5):
            budget = int(lo + frac * (prof.peak_bytes - lo))
            exact = solvers.optimal(prof, budget, device=device)
            oracle = solvers.brute_force(prof, budget, device=device)
            assert exact.feasible and oracle.feasible
            assert exact.predicted_step_time == pytest.approx(oracle.predicted_step_time, rel=1e-9, abs=tol), (
                device, frac)
            assert memopt.simulate(prof, exact, device=device).peak_bytes <= budget
            used_swap |= "swap" in oracle.strategies
    assert used_swap, "no optimum used a swap: this case tests recompute only"


def test_exact_solver_falls_back_to_checkpointing_when_swaps_cannot_win(small_zoo):
    prof = fixed_times(small_zoo["gpt"])  # the case must not depend on how busy the machine was
    slow = memopt.DeviceSpec.preset("a100-40gb").with_changes(name="a100-slow", h2d_bytes_per_s=1e5,
                                                              d2h_bytes_per_s=1e5)
    lo = solvers.min_peak(prof, device=slow, strategies=("keep", "recompute"))
    for budget in (int(lo + 0.3 * (prof.peak_bytes - lo)), prof.peak_bytes):
        exact = solvers.optimal(prof, budget, device=slow)
        oracle = solvers.brute_force(prof, budget, device=slow)
        assert "no plan with swaps beat the checkpointing-only optimum" in exact.meta["note"]
        assert exact.meta["proven_optimal"] is True and exact.method == "optimal"
        assert "swap" not in exact.strategies
        assert exact.predicted_step_time == pytest.approx(oracle.predicted_step_time, rel=1e-9)
    assert exact.strategies == ["keep"] * prof.n_units  # the unoptimized peak fits: nothing to do


def test_unit_options_list_each_distinct_timing_once():
    """Windows reaching past the forward's end, or distances past the last unit, act alike: one option each."""
    from memopt_nb.plan import DISTANCES, WINDOWS
    from memopt_nb.solvers.common import unit_options

    for n in (1, 2, 3, 5):
        sim = Simulator(chain_profile(n, seed=n))
        for u in range(n):
            opts = unit_options(sim, u)
            assert opts[:2] == [(0, 1, 1), (1, 1, 1)]  # keep and recompute, with the default timings
            effect = {(min(u + 1 + w, n), min(u + d, n - 1)) for w in WINDOWS for d in DISTANCES}
            swaps = [(min(u + 1 + w, n), min(u + d, n - 1)) for c, w, d in opts if c == 2]
            assert len(swaps) == len(set(swaps)) and set(swaps) == effect, (n, u, opts)
            assert [o[1:] for o in opts[2:]] == sorted(o[1:] for o in opts[2:])  # shortest timings first


@pytest.mark.parametrize("name", list(solvers.BASELINES) + ["optimal", "brute_force"])
def test_planners_leave_default_timings_on_units_they_do_not_swap(name):
    """So that ``==`` (which compares timings too) sees a planner's plan as the plain plan with the same strategies."""
    fn = {"optimal": solvers.optimal, "brute_force": solvers.brute_force}.get(name) or solvers.BASELINES[name]
    prof = chain_profile(4, seed=2)
    lo = solvers.min_peak(prof)
    for frac in (0.1, 0.5):
        plan = fn(prof, int(lo + frac * (prof.peak_bytes - lo)))
        for dec in plan.decisions:
            if dec.strategy != "swap":
                assert (dec.offload_window, dec.prefetch_distance) == (1, 1), (name, plan.decisions)
