"""The polish of ``memopt.search``: it makes the moves of plain best-improvement (every move simulated each round),
however few moves it simulates; its lower bound never exceeds a simulated time; and the heuristic starts."""

import importlib
import math

import numpy as np
import pytest
from helpers.planning import add_save_sets

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.plan import STRATEGIES
from memopt_nb.core.space import PlanSpace
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners.task import PlanningTask

search_mod = importlib.import_module("memopt_nb.planners.rl.search")
polish_mod = importlib.import_module("memopt_nb.planners.polish")


def reference_polish(task, codes, windows, dists, states=None, max_rounds=100):
    """The polish as it was before its moves were pruned: every allowed single-unit move simulated every round."""
    n = task.n
    cur = polish_mod.to_options(np.asarray(codes), np.asarray(windows), np.asarray(dists))
    cur_st = np.zeros(n, dtype=np.int64) if states is None else np.asarray(states, dtype=np.int64).copy()
    peak, t = task.evaluate(*[a[None] for a in polish_mod.option_arrays(cur)], cur_st[None])
    best_t = float(t[0]) if peak[0] <= task.budget else math.inf
    moves = 0
    last: dict = {}
    for _ in range(max_rounds):
        N = task.n_options
        cand = np.repeat(cur[None], n * N, axis=0)
        units = np.repeat(np.arange(n), N)
        opts = np.tile(np.arange(N), n)
        cand[np.arange(n * N), units] = opts
        cand = cand[task.option_ok[units, opts]]
        if task.C > 1:
            cand, cand_st = polish_mod._best_pairs(task, cur, cur_st, cand, last=last)
        else:
            cand_st = np.repeat(cur_st[None], cand.shape[0], axis=0)
        peak, t = task.evaluate(*polish_mod.option_arrays(cand), cand_st)
        t = np.where(peak <= task.budget, t, math.inf)
        i = int(np.argmin(t))
        if not t[i] < best_t * (1 - 1e-12):
            break
        cur, cur_st, best_t = cand[i], cand_st[i], float(t[i])
        moves += 1
    c, w, d = polish_mod.option_arrays(cur)
    return c, w, d, cur_st, moves


def _task(n, seed, device, share, strategies, save_sets=False, offload_state=False):
    prof = chain_profile(n, seed=seed, **({"state_bytes": 16 * 2**20} if offload_state else {}))
    if save_sets:
        prof = add_save_sets(prof, seed)
    lo = solvers.min_peak(prof, device, strategies, offload_state=offload_state)
    return PlanningTask(prof, int(lo + share * (prof.peak_bytes - lo)), device, offload_state=offload_state,
                        strategies=strategies)


CASES = {
    "a100-wide-selective": (16, 1, "a100-40gb", 0.6, STRATEGIES, True),
    "a100-wide-tight": (16, 2, "a100-40gb", 0.3, STRATEGIES, True),
    "a100-default": (20, 3, "a100-40gb", 0.5, ("keep", "recompute", "swap"), False),
    "cpu-wide": (14, 4, None, 0.5, STRATEGIES, True),
    "h100-checkpointing": (18, 5, "h100-80gb", 0.4, ("keep", "recompute"), False),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def task(request):
    return _task(*CASES[request.param])


def _starts(task, count=4, seed=0):
    """Random allowed options per unit (feasible or not), keep-all's plainest options and recompute where allowed."""
    rng = np.random.default_rng(seed)
    n = task.n
    out = [task.plain_options(), np.where(task.option_ok[:, 1], 1, task.plain_options())]
    out += [np.array([rng.choice(np.flatnonzero(task.option_ok[u])) for u in range(n)]) for _ in range(count)]
    return [polish_mod.option_arrays(o) for o in out]


@pytest.mark.parametrize("block", [None, 3], ids=["default-block", "small-blocks"])
def test_polish_makes_the_moves_of_simulating_every_move(task, block, monkeypatch):
    if block:  # small first batches: the bound decides which moves are simulated at all
        monkeypatch.setattr(polish_mod, "MOVE_BLOCK", block)
    moved = 0
    for c, w, d in _starts(task):
        got = polish_mod.polish(task, c, w, d)
        want = reference_polish(task, c, w, d)
        assert got[4] == want[4]
        for a, b in zip(got[:4], want[:4], strict=True):
            assert np.array_equal(a, b)
        moved += got[4]
    assert moved > 0  # the cases exercise moves, not only starts where nothing helps


def test_polish_with_placements_is_unchanged():
    task = _task(10, 4, "a100-40gb", 0.4, ("keep", "recompute", "swap"), offload_state=True)
    assert task.C > 1
    for c, w, d in _starts(task, count=2):
        got, want = polish_mod.polish(task, c, w, d), reference_polish(task, c, w, d)
        assert got[4] == want[4] and all(np.array_equal(a, b) for a, b in zip(got[:4], want[:4], strict=True))


def test_time_floor_never_exceeds_the_simulated_time(task):
    rng = np.random.default_rng(5)
    opts = np.array([[rng.choice(np.flatnonzero(task.option_ok[u])) for u in range(task.n)] for _ in range(300)])
    floor = task.time_floor(opts)
    assert floor is not None
    _, t = task.evaluate(*polish_mod.option_arrays(opts), np.zeros_like(opts))
    assert (floor <= t).all()
    assert (floor > 0.5 * t).any()  # a bound, not zero


@pytest.fixture(scope="module")
def wide_chain():
    return add_save_sets(chain_profile(12, seed=7), 7)


def _decisions(plan):
    return [(d.strategy, d.save_set, d.offload_window, d.prefetch_distance, d.placement) for d in plan.decisions]


def test_heuristic_starts_never_make_the_plan_worse_and_are_recorded(wide_chain, monkeypatch):
    kw = {"total_timesteps": 300, "seed": 3, "strategies": STRATEGIES, "device": "a100-40gb"}
    plan = memopt.search(wide_chain, "40%", **kw)
    meta = plan.meta
    assert plan.feasible and meta["polish"] == "ran"
    assert meta["polish_heuristic_starts"] and meta["polish_heuristic_skipped"] == []
    assert set(meta["polish_heuristic_starts"]) <= set(polish_mod.HEURISTIC_STARTS)
    assert meta["polish_start"] in {"agents", *meta["polish_heuristic_starts"]}
    monkeypatch.setattr(polish_mod, "HEURISTIC_STARTS", ())
    alone = memopt.search(wide_chain, "40%", **kw)
    assert alone.meta["polish_heuristic_starts"] == [] and alone.meta["polish_start"] == "agents"
    assert plan.predicted_step_time <= alone.predicted_step_time
    if meta["polish_start"] == "agents":
        assert _decisions(plan) == _decisions(alone)
    else:
        assert plan.predicted_step_time < alone.predicted_step_time


def test_a_heuristic_start_that_wins_gives_the_plan(monkeypatch):
    """With the agents stopped early (64 timesteps), a baseline's polished plan beats theirs on this chain."""
    prof = add_save_sets(chain_profile(12, seed=0), 0)
    wide = ("keep", "recompute", "swap", "recompute_offload", "selective")  # the space this chain shows it in
    lo = solvers.min_peak(prof, "a100-40gb", wide)
    budget = int(lo + 0.2 * (prof.peak_bytes - lo))
    kw = {"total_timesteps": 64, "seed": 0, "strategies": wide, "device": "a100-40gb"}
    plan = memopt.search(prof, budget, **kw)
    name = plan.meta["polish_start"]
    assert name in plan.meta["polish_heuristic_starts"]
    monkeypatch.setattr(polish_mod, "HEURISTIC_STARTS", (name,))
    again = memopt.search(prof, budget, **kw)
    assert again.meta["polish_start"] == name and _decisions(again) == _decisions(plan)
    monkeypatch.setattr(polish_mod, "HEURISTIC_STARTS", ())
    alone = memopt.search(prof, budget, **kw)
    assert alone.meta["polish_start"] == "agents" and alone.predicted_step_time > plan.predicted_step_time


def test_heuristic_starts_stay_in_the_space(wide_chain):
    plan = memopt.search(wide_chain, "50%", total_timesteps=300, seed=1, strategies=("keep", "recompute"))
    used = plan.meta["polish_heuristic_starts"]
    assert not {"swap_all", "op_sac", "recompute_offload_all"} & set(used)
    assert set(plan.strategies) <= {"keep", "recompute"}


def test_same_seed_same_plan_with_heuristic_starts(wide_chain):
    kw = {"total_timesteps": 300, "seed": 5, "strategies": STRATEGIES, "device": "a100-40gb"}
    a, b = memopt.search(wide_chain, "45%", **kw), memopt.search(wide_chain, "45%", **kw)
    assert _decisions(a) == _decisions(b)
    assert a.meta["polish_start"] == b.meta["polish_start"]
    assert a.meta["polish_heuristic_starts"] == b.meta["polish_heuristic_starts"]


def test_no_rounds_left_skips_the_heuristic_starts_and_says_so(wide_chain, monkeypatch):
    kw = {"total_timesteps": 300, "seed": 3, "strategies": STRATEGIES, "device": "a100-40gb"}
    monkeypatch.setattr(polish_mod, "HEURISTIC_STARTS", ())
    alone = memopt.search(wide_chain, "40%", **kw)
    monkeypatch.setattr(polish_mod, "HEURISTIC_STARTS", ("recompute_all", "swap_all"))
    monkeypatch.setattr(polish_mod, "HEURISTIC_ROUNDS", 0)
    plan = memopt.search(wide_chain, "40%", **kw)
    assert plan.meta["polish_heuristic_starts"] == [] and plan.meta["polish_start"] == "agents"
    assert plan.meta["polish_heuristic_skipped"] == ["recompute_all", "swap_all"]
    assert _decisions(plan) == _decisions(alone)


def test_exact_placements_follow_the_activations_the_polish_moved_to():
    """Where the polish changes activations and placements together, the placement is solved exactly again for the
    activations it reached, and polished again, until that stops helping: the result beats the agents' activations
    placed and keep-all placed (each polished) — the starts before this — and placing its own activations again
    gains nothing."""
    from memopt_nb.planners.milp import place_states

    task = _task(8, 3, "a100-40gb", 0.6, ("keep", "recompute", "swap"), offload_state=True)
    c, w, d = _starts(task)[0]
    zeros = np.zeros(task.n, dtype=np.int64)
    current = polish_mod.polish(task, c, w, d, zeros)
    info = {}
    got = polish_mod.polish_exact_placements(task, current[:4], (c, w, d, zeros), current[4], info)
    got_t = polish_mod._time_of(task, *got[:4])
    before = polish_mod._time_of(task, *current[:4])
    for start in ((c, w, d), polish_mod.option_arrays(task.plain_options())):
        st = place_states(task.sim, task.budget, *start, PlanSpace.of(offload_state=True))
        polished = polish_mod.polish(task, *start, np.asarray(st, dtype=np.int64))
        before = min(before, polish_mod._time_of(task, *polished[:4]))
    assert got_t < before * (1 - 1e-6)
    assert info["polish_start"] == "polished_placed" or info["polish_start"].endswith("_again")
    st = place_states(task.sim, task.budget, *got[:3], PlanSpace.of(offload_state=True))
    again = polish_mod.polish(task, *got[:3], np.asarray(st, dtype=np.int64))
    assert polish_mod._time_of(task, *again[:4]) >= got_t * (1 - 1e-12)


def test_where_the_agents_find_no_plan_the_closest_one_is_repaired_into_the_budget():
    """48 units, a budget 2 % of the way from the floor to the peak, 256 timesteps: no episode of the agents fits, so
    the search repairs the plan they came closest with (one unit at a time down the peak), then polishes it."""
    prof = chain_profile(48, seed=48)
    lo = solvers.min_peak(prof, "a100-40gb", offload_state=False)
    budget = int(lo + 0.02 * (prof.peak_bytes - lo))
    plan = memopt.search(prof, budget, "a100-40gb", offload_state=False, total_timesteps=256, seed=0)
    assert plan.meta["agents_found_no_plan"] and plan.meta["repair_moves"] >= 1
    assert plan.meta["agents_step_time"] is None and not plan.meta.get("no_feasible_plan")
    assert plan.feasible and memopt.simulate(prof, plan, "a100-40gb").peak_bytes <= budget
    raw = memopt.search(prof, budget, "a100-40gb", offload_state=False, total_timesteps=256, seed=0,
                        polish_plan=False)  # the agents' own answer: flagged, not repaired
    assert raw.meta["no_feasible_plan"] and "agents_found_no_plan" not in raw.meta


def test_repair_moves_down_the_peak_until_the_plan_fits():
    prof = chain_profile(24, seed=3)
    lo = solvers.min_peak(prof, "a100-40gb", offload_state=False)
    task = PlanningTask(prof, int(lo + 0.01 * (prof.peak_bytes - lo)), "a100-40gb", offload_state=False)
    keep = np.zeros(task.n, dtype=np.int64)
    c, w, d, st, moves, fits = polish_mod.repair(task, keep, keep + 1, keep + 1)
    peak, _ = task.evaluate(c[None], w[None], d[None], st[None])
    assert fits and moves >= 1 and peak[0] <= task.budget
    c2, *_, moves2, fits2 = polish_mod.repair(task, keep, keep + 1, keep + 1, max_rounds=1)
    assert moves2 == 1 and fits2 == (moves == 1)


@pytest.mark.slow
def test_at_depth_a_round_stacks_moves_and_the_polish_still_ends_where_no_single_move_helps():
    """From STACK_FROM_UNITS units up a round takes its best move and the other improving moves that still help on top
    of it: never slower than the round's best single move, fewer rounds than one move each, and the polish still stops
    only where no single move is faster."""
    strategies = ("keep", "recompute", "swap", "recompute_offload")
    task = _task(polish_mod.STACK_FROM_UNITS + 8, 7, "a100-40gb", 0.3, strategies)
    c, w, d = polish_mod.option_arrays(np.where(task.option_ok[:, 1], 1, task.plain_options()))  # recompute all
    one = reference_polish(task, c, w, d, max_rounds=1)
    units, opts = np.nonzero(task.option_ok)
    cur = polish_mod.to_options(c, w, d)
    cand = np.repeat(cur[None], units.size, axis=0)
    cand[np.arange(units.size), units] = opts
    zero = np.zeros(task.n, dtype=np.int64)
    stacked, t = polish_mod._stacked_moves(task, cur, zero, units, opts, cand, polish_mod._time_of(task, c, w, d, zero))
    assert stacked is not None and t <= polish_mod._time_of(task, *one[:4]) * (1 + 1e-12)
    assert (stacked != cur).sum() > 1  # more than one unit moved in the round

    got = polish_mod.polish(task, c, w, d)
    want = reference_polish(task, c, w, d)
    assert 0 < got[4] < want[4]
    got_t = polish_mod._time_of(task, *got[:4])
    assert math.isfinite(got_t)
    again = reference_polish(task, *got[:4], max_rounds=1)  # no single move improves the result
    assert again[4] == 0


@pytest.mark.slow
def test_at_depth_rounds_with_placements_stack_too_and_the_polish_still_ends_at_a_local_optimum():
    """With state placements (the pairs of option and placement moves), from STACK_FROM_UNITS units up: in the same
    number of rounds the stacked polish gets at least as far as one move a round, and where it stops by itself no
    single (paired) move is faster."""
    task = _task(polish_mod.STACK_FROM_UNITS, 5, "a100-40gb", 0.3, ("keep", "recompute", "swap"), offload_state=True)
    assert task.C > 1
    starts = polish_mod._heuristic_starts(task)  # baselines' plans that fit: the slowest, with the most to gain
    _, opts, st, _ = starts[-1]
    c, w, d = polish_mod.option_arrays(opts)
    got = polish_mod.polish(task, c, w, d, st, max_rounds=40)
    want = reference_polish(task, c, w, d, st, max_rounds=40)
    got_t, want_t = polish_mod._time_of(task, *got[:4]), polish_mod._time_of(task, *want[:4])
    assert math.isfinite(got_t) and got_t < want_t  # one move a round is still far from done after 40
    if got[4] < 40:  # it stopped by itself: no single move improves its plan
        assert reference_polish(task, *got[:4], max_rounds=1)[4] == 0


@pytest.mark.parametrize("n", [100, 50])
def test_at_depth_the_heuristic_starts_stop_after_two_in_a_row_that_do_not_win(monkeypatch, n):
    """From STACK_FROM_UNITS units, polishing the baselines' plans (fastest first) stops once HEURISTIC_PATIENCE in a
    row did not beat the best plan: each costs hundreds of rounds there. Below it every start is polished."""
    polish_mod = importlib.import_module("memopt_nb.planners.polish")
    assert polish_mod.HEURISTIC_PATIENCE == 2 and 50 < polish_mod.STACK_FROM_UNITS <= 100
    names = ["a", "b", "c", "d", "e"]
    # start k: options all k (so none is a duplicate), polished to the time below (e would win, if polished)
    times = {0: 1.0, 1: 0.9, 2: 0.95, 3: 0.92, 4: 0.91, 5: 0.5}
    starts = [(nm, np.full(n, k + 1), np.zeros(n, dtype=np.int64), float(k)) for k, nm in enumerate(names)]
    monkeypatch.setattr(polish_mod, "_heuristic_starts", lambda task, deadline=None: starts)
    monkeypatch.setattr(polish_mod, "polish", lambda task, c, w, d, st, **_: (c, w, d, st, 0))
    monkeypatch.setattr(polish_mod, "option_arrays", lambda opts: (opts, opts, opts))
    monkeypatch.setattr(polish_mod, "to_options", lambda c, w, d: np.asarray(c))
    monkeypatch.setattr(polish_mod, "_time_of", lambda task, c, w, d, st: times[int(np.asarray(c)[0])])

    class Task:
        pass

    task = Task()
    task.n = n
    current = (np.zeros(n, dtype=np.int64),) * 3 + (np.zeros(n, dtype=np.int64), 0)
    info: dict = {}
    best = polish_mod.polish_heuristic_starts(task, current, info)
    if n >= polish_mod.STACK_FROM_UNITS:
        # a wins (0.9 < 1.0); b and c do not: d and e are left out, though e would have won
        assert info["polish_heuristic_starts"] == ["a", "b", "c"] and info["polish_heuristic_skipped"] == ["d", "e"]
        assert info["polish_start"] == "a" and int(best[0][0]) == 1
    else:
        assert info["polish_heuristic_starts"] == names and info["polish_heuristic_skipped"] == []
        assert info["polish_start"] == "e" and int(best[0][0]) == 5


def test_the_first_m_by_time_are_those_a_full_stable_sort_gives():
    """polish._smallest partitions instead of sorting millions of pair moves: it must give the same first m, ties
    broken by the lower index."""
    polish_mod = importlib.import_module("memopt_nb.planners.polish")
    rng = np.random.default_rng(0)
    for trial in range(200):
        size = int(rng.integers(1, 2000))
        tc = rng.random(size) if trial % 3 == 0 else rng.integers(0, int(rng.integers(1, 40)), size).astype(float)
        cand = np.sort(rng.choice(10 * size, size, replace=False))
        full = cand[np.argsort(tc, kind="stable")]
        for m in (1, 7, 256, size - 1, size, size + 3):
            if m >= 1:
                assert np.array_equal(polish_mod._smallest(tc, cand, m), full[:m]), (trial, m)
