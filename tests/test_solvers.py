import numpy as np
import pytest

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.errors import BudgetError
from memopt_nb.simulate import Simulator
from memopt_nb.synthetic import chain_profile

CASES = (
    [("keep-recompute", n, seed, frac) for n in (6, 9, 12) for seed in range(3) for frac in (0.15, 0.6)]
    + [("all", n, seed, frac) for n in (3, 4, 5) for seed in range(5) for frac in (0.1, 0.4, 0.8)]
    + [("all-cpu", 4, seed, frac) for seed in range(3) for frac in (0.2, 0.7)]
)


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
def test_baselines_report_feasibility_honestly(name, zoo_profiles):
    fn = solvers.optimal if name == "optimal" else solvers.BASELINES[name]
    for case in ("gpt", "resnet"):
        _, _, prof = zoo_profiles[case]
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


def test_budget_below_min_peak_is_refused(zoo_profiles):
    _, _, prof = zoo_profiles["gpt"]
    lo = solvers.min_peak(prof)
    for fn in [solvers.optimal, *solvers.BASELINES.values()]:
        with pytest.raises(BudgetError, match="smallest peak") as err:
            fn(prof, lo - 1)
        assert memopt.format_bytes(lo) in str(err.value)
    with pytest.raises(BudgetError, match="cannot read"):
        solvers.optimal(prof, "lots")
    plan = solvers.optimal(prof, "60%")
    assert plan.budget_bytes == int(0.6 * prof.peak_bytes)
