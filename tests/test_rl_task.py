"""The RL task's tables, checked against what they are documented to be (written so that
tools/mutate.py's mutants of the task are caught).

``PlanningTask`` holds, per unit and option, which options exist and a *marginal model*: how the per-segment peaks
and the step time change when only that unit leaves "keep". Here every entry is checked against the independent
reference replay (``memopt_nb.sim.replay``) of the one-unit plan, and the option table against cases worked out by
hand, so that a wrong marginal, a wrong de-duplication of timings or a wrong summary (the suffix sums and cost
efficiencies the agents observe) fails a test, not only a planner's quality.
"""

import numpy as np
import pytest

from memopt_nb import solvers
from memopt_nb.core.device import DeviceSpec
from memopt_nb.core.plan import STRATEGIES
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners.options import N_OPTIONS, TIMINGS
from memopt_nb.planners.task import PlanningTask
from memopt_nb.sim.replay import replay

KEEP, RECOMPUTE = 0, 1

#: copies that take different times each way, so that a copy cost of the wrong direction shows
UNEVEN = DeviceSpec(name="uneven-link", kind="preset", capacity_bytes=16 * 2**30, h2d_bytes_per_s=12e9,
                    d2h_bytes_per_s=3e9, compute_flops=10e12, copy_overhead_s=3e-5)


def _profile(n=6, seed=1, device=None):
    """A chain in which unit 2 cannot be recomputed and unit 1 cannot be swapped."""
    prof = chain_profile(n, seed=seed, device=device)
    prof.units[2].recomputable = False
    prof.units[1].swappable = False
    return prof


def _task(prof):
    lo = solvers.min_peak(prof)
    return PlanningTask(prof, int(lo + 0.4 * (prof.peak_bytes - lo)))


def _enabled_timings(task, u):
    return [TIMINGS[j] for j in np.flatnonzero(task.option_ok[u, 2:])]


def test_option_table_worked_out_by_hand():
    """Keep always; recompute and swap where the unit allows them; of timings with the same effect only the first.

    A swap's timing acts through two units: the one before whose forward the copy is released (``u + 1 + w``, at
    most the end of the forward) and the one whose backward starts the prefetch (``u + d``, at most the last unit).
    """
    n = 6
    task = _task(_profile(n))
    assert task.option_ok.shape == (n, N_OPTIONS)
    assert task.option_ok[:, KEEP].all()
    assert task.option_ok[:, RECOMPUTE].tolist() == [True, True, False, True, True, True]
    assert not task.option_ok[1, 2:].any()  # not swappable: no timing at all
    assert _enabled_timings(task, 0) == list(TIMINGS)  # releases 1..3, triggers 0..3: all twelve differ
    # unit 3: a window of 2 releases at the end (6), distances 2 and 3 both trigger at the last unit (5)
    assert _enabled_timings(task, 3) == [(w, d) for w in (0, 1, 2) for d in (0, 1, 2)]
    # unit 4: windows 1 and 2 both release at the end, distances 1-3 all trigger at unit 5
    assert _enabled_timings(task, 4) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert _enabled_timings(task, 5) == [(0, 0)]  # the last unit: one timing, whatever is asked
    # every timing of a unit is a column of its own: disabling one never disables a neighbour's
    assert task.option_ok[:, 2:].sum() == 12 + 0 + 12 + 9 + 4 + 1


def test_no_host_link_means_no_swap_option():
    dev = UNEVEN.with_changes(name="no-link", h2d_bytes_per_s=0.0, d2h_bytes_per_s=0.0)
    task = _task(_profile(device=dev))
    assert task.option_ok[:, KEEP].all() and not task.option_ok[:, 2:].any()
    assert np.isinf(task.swap_eff).all()


def _reference_marginals(task):
    """Per (unit, option): segment peaks and step time of the one-unit plan minus keep-all's (reference replay)."""
    prof, n = task.profile, task.n
    keep = replay(prof, ["keep"] * n, [1] * n, [1] * n, device=task.sim.device)
    peaks = np.zeros((n, N_OPTIONS, len(keep.segment_peaks)))
    times = np.zeros((n, N_OPTIONS))
    for u in range(n):
        for o in range(N_OPTIONS):
            if not task.option_ok[u, o]:
                continue
            strategies, windows, dists = ["keep"] * n, [1] * n, [1] * n
            strategies[u] = STRATEGIES[min(o, 2)]
            if o >= 2:
                windows[u], dists[u] = TIMINGS[o - 2]
            rep = replay(prof, strategies, windows, dists, device=task.sim.device)
            peaks[u, o] = np.array(rep.segment_peaks) - np.array(keep.segment_peaks)
            times[u, o] = rep.step_time - keep.step_time
    return peaks, times, keep


@pytest.mark.parametrize("device", [None, UNEVEN])
def test_marginal_model_is_the_one_unit_plans_effect(device):
    """Every marginal is the reference replay of the plan where only that unit changes; options a unit does not have
    change nothing; the summaries the environment reads are what their names say, from those replays."""
    task = _task(_profile(device=device))
    n = task.n
    peaks, times, keep = _reference_marginals(task)
    assert task.base_peak == keep.peak_bytes
    assert task.base_time == pytest.approx(keep.step_time, rel=1e-9)
    assert task.marg_peak.shape == peaks.shape
    assert np.array_equal(task.marg_peak, peaks)  # zero where the option does not exist
    assert np.allclose(task.marg_time, times, rtol=1e-9, atol=1e-15)
    assert (task.marg_time[~task.option_ok] == 0).all()

    ok = task.option_ok
    # the most each unit's options can take off each segment (keep: nothing), and those summed over units u..n-1
    frugal = np.where(ok[:, :, None], peaks, np.inf).min(axis=1)
    assert np.array_equal(task.min_marg, frugal)
    assert np.array_equal(task.suffix_min[n], np.zeros(task.S))
    for u in range(n):
        assert np.allclose(task.suffix_min[u], frugal[u:].sum(axis=0))
    assert (task.suffix_min[0] <= 0).all() and (task.suffix_min[0] < 0).any()

    # saving of an option: the most it takes off any one segment; the largest per unit, and summed over units u..
    saving = np.where(ok, -peaks.min(axis=2), -np.inf)
    largest = np.maximum(saving.max(axis=1), 0.0)
    assert task.max_red.shape == (n,)
    assert np.allclose(task.max_red, largest)
    assert (task.max_red > 0).all()  # recompute or swap saves something on every unit here
    assert np.allclose(task.suffix_red, [largest[u:].sum() for u in range(n + 1)])

    # cost efficiency: extra seconds per byte saved (about 1e-9: compared relatively), the cheapest option;
    # recompute's and the cheapest swap's alone
    eff = np.full((n, N_OPTIONS), np.inf)
    for u in range(n):
        for o in range(1, N_OPTIONS):
            if ok[u, o] and saving[u, o] > 0:
                eff[u, o] = max(times[u, o], 0.0) / saving[u, o]
    assert np.allclose(task.rc_eff, eff[:, RECOMPUTE], rtol=1e-9, atol=0)
    assert np.allclose(task.swap_eff, eff[:, 2:].min(axis=1), rtol=1e-9, atol=0)
    assert np.allclose(task.best_eff, eff.min(axis=1), rtol=1e-9, atol=0)
    assert np.isinf(task.rc_eff[2]) and np.isinf(task.swap_eff[1])  # options the unit does not have
    assert (np.isfinite(task.best_eff) & (task.best_eff >= 0)).all()


def test_copy_ratio_is_the_slower_direction_over_the_forward():
    """A swap's copy load relative to the unit's forward: its bytes and the storages it owns, priced by
    ``DeviceSpec.copy_seconds`` in the slower direction (here device-to-host, four times slower than back)."""
    task = _task(_profile(device=UNEVEN))
    prof = task.profile
    for u, unit in enumerate(prof.units):
        strategies = ["keep"] * task.n
        strategies[u] = "swap"
        if not unit.swappable:
            continue
        rep = replay(prof, strategies, [0] * task.n, [0] * task.n)  # what a swap of this unit alone moves to the host
        storages = sum(job.storages for job in rep.copies if job.direction == "d2h")
        nbytes = unit.interior_bytes + unit.input_bytes
        d2h = UNEVEN.copy_seconds(nbytes, storages, "d2h")
        assert d2h > UNEVEN.copy_seconds(nbytes, storages, "h2d")
        fwd = prof.segments[unit.fwd_segment].time
        assert task.copy_ratio[u] == pytest.approx(d2h / fwd, rel=1e-9)


def test_penalty_steps_to_one_at_the_budget_and_overhead_is_relative():
    """Within budget no penalty; one byte over already costs 1 (so any plan over budget scores worse than any plan
    within it, whatever their times), and it keeps growing with the excess."""
    task = _task(_profile())
    b = task.budget
    pen = task.penalty(np.array([0, b // 2, b, b + 1, int(b * 1.05), 2 * b]))
    assert pen[:3].tolist() == [0.0, 0.0, 0.0]
    assert 1.0 <= pen[3] < 1.0 + 1e-6
    assert 1.0 < pen[4] < pen[5]
    assert task.overhead(np.array([task.base_time, 1.5 * task.base_time])) == pytest.approx([0.0, 0.5])
    peak, time = task.evaluate(np.zeros((1, task.n), dtype=int), np.ones((1, task.n), dtype=int),
                               np.ones((1, task.n), dtype=int))
    assert peak[0] == task.base_peak and time[0] == pytest.approx(task.base_time)


def test_the_completion_plan_fits_the_budget_and_is_none_where_no_uniform_plan_does():
    """The plan the environment's masks assume for the units still undecided: the lowest-peak uniform plan, which the
    simulator says fits; ``None`` at a budget only a mixed plan meets (the masks then keep their best case alone)."""
    from memopt_nb.planners.options import option_codes

    prof = chain_profile(24, seed=3)
    lo = solvers.min_peak(prof, "a100-40gb", offload_state=False)
    task = PlanningTask(prof, int(lo + 0.3 * (prof.peak_bytes - lo)), "a100-40gb", offload_state=False)
    assert task.completion is None  # below COMPLETION_FROM_UNITS the masks keep every plan reachable
    comp = task.completion_options()
    assert comp is not None and task.option_ok[np.arange(task.n), comp].all()
    c, w, d = option_codes(comp[None])
    peak, _ = task.evaluate(c, w, d, np.zeros((1, task.n), dtype=np.int64))
    assert peak[0] <= task.budget
    rows = []  # every uniform plan's peak: at the floor (below all of them, where mixed plans fit) there is none
    for o in range(1, task.n_options):
        if task.option_ok[:, o].all():
            c, w, d = option_codes(np.full((1, task.n), o))
            rows.append(task.evaluate(c, w, d, np.zeros((1, task.n), dtype=np.int64))[0][0])
    if lo < min(rows):
        assert PlanningTask(prof, lo, "a100-40gb", offload_state=False).completion_options() is None


def test_masks_with_the_completion_plan_keep_random_episodes_within_a_tight_budget_more_often():
    """At a budget 5 % of the way from the floor on 48 units, random masked episodes: the masks that assume the
    completion plan for the rest fit the budget more often than the masks that assume each unit's best case per
    segment (which no single plan reaches, so that episodes walk into a budget they can no longer meet)."""
    from memopt_nb.planners.rl.env import MemoryPlanningEnv

    prof = chain_profile(48, seed=48)
    lo = solvers.min_peak(prof, "a100-40gb", offload_state=False)
    budget = int(lo + 0.05 * (prof.peak_bytes - lo))
    fits = {}
    for comp in (True, False):
        task = PlanningTask(prof, budget, "a100-40gb", offload_state=False)
        task.completion = task.completion_options() if comp else None  # 48 units: below COMPLETION_FROM_UNITS
        assert comp == (task.completion is not None)
        env = MemoryPlanningEnv(task, order="forward")
        fits[comp] = 0
        for seed in range(20):
            rng = np.random.default_rng(seed)
            obs, _ = env.reset(seed=seed)
            info: dict = {}
            while env.agents:
                acts = {a: int(rng.choice(np.flatnonzero(obs[a]["action_mask"]))) for a in env.agents}
                obs, _, _, _, infos = env.step(acts)
                info = infos.get("strategy", info)
            fits[comp] += bool(info["feasible"])
    assert fits[True] > fits[False], fits
