"""The search's fast paths give exactly what the plain computations they replace give.

``MemoryPlanningEnv.step_many`` (PPO steps all copies of the environment at once, with one exact evaluation for the
episodes that end) against ``env.step`` on each copy; the polish's move scoring (``_best_pairs``, which rules pairs out
by a lower bound and computes exact peaks only in order of time) against scoring every pair, as it is documented: the
8 fastest within budget, ties to the earlier option, then the earlier placement.
"""

import importlib

import numpy as np
import pytest
from helpers.planning import add_save_sets

from memopt_nb import solvers
from memopt_nb.core.plan import STRATEGIES
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners.rl.env import MemoryPlanningEnv
from memopt_nb.planners.task import PlanningTask

search_mod = importlib.import_module("memopt_nb.planners.rl.search")
polish_mod = importlib.import_module("memopt_nb.planners.polish")


@pytest.fixture(scope="module", params=[(0.25, None), (0.6, None), (0.25, STRATEGIES), (0.25, "selective")],
                ids=["tight", "loose", "tight-recompute_offload", "tight-selective"])
def task(request):
    """Chains with state at two budgets; with recompute_offload the copies of ``step_many`` differ in which timed
    strategy (swap or recompute_offload) the timing agent is timing at the same step; with every strategy on a
    profile with save-sets, also in whether their unit takes an untimed selective action."""
    share, strategies = request.param
    prof = chain_profile(10, seed=4, state_bytes=16 * 2**20)
    if strategies == "selective":
        prof, strategies = add_save_sets(prof, 4), STRATEGIES
    lo = solvers.min_peak(prof, "a100-40gb", offload_state=True)
    kw = {} if strategies is None else {"strategies": strategies}
    task = PlanningTask(prof, int(lo + share * (prof.peak_bytes - lo)), "a100-40gb", offload_state=True, **kw)
    assert task.selective == (request.param[1] == "selective")
    return task


def _same(x, y):
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y))
    if isinstance(x, np.ndarray):
        return x.dtype == y.dtype and x.tobytes() == y.tobytes()
    return x == y


@pytest.mark.parametrize("order", ["forward", "state"])
def test_step_many_is_step_on_each_copy(task, order):
    plain = [MemoryPlanningEnv(task, order=order) for _ in range(4)]
    batched = [MemoryPlanningEnv(task, order=order) for _ in range(4)]
    assert (list(plain[0].order) == list(range(task.n))) == (order == "forward")
    obs = [env.reset(seed=i)[0] for i, env in enumerate(plain)]
    assert _same(obs, [env.reset(seed=i)[0] for i, env in enumerate(batched)])
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(3 * (task.n + 1)):
        acts = [{a: int(rng.integers(0, o[a]["action_mask"].size)) for a in o} for o in obs]
        one = [env.step(a) for env, a in zip(plain, acts)]
        many = MemoryPlanningEnv.step_many(batched, acts)
        assert _same(one, many)
        obs = [r[0] for r in one]
        for i, r in enumerate(one):
            if r[2]["strategy"]:
                ended += 1
                assert r[4]["strategy"]["time"] > 0
                obs[i] = plain[i].reset()[0]
                assert _same(obs[i], batched[i].reset()[0])
    assert ended == 3 * len(plain)


def _best_pairs_by_scoring_all(task, cur, cur_st, cand, keep=8):
    """Every (option move, placement move) pair scored: the reference ``_best_pairs`` must match."""
    n = task.n
    acts = np.concatenate([cur[None], cand])
    st_units, st_local = np.nonzero(task.state_ok)
    sts = np.repeat(cur_st[None], st_units.size + 1, axis=0)
    sts[np.arange(1, st_units.size + 1), st_units] = task.state_ids[st_local]
    local = np.searchsorted(task.state_ids, sts)
    units = np.arange(n)[None]
    seg = task.st_seg[units, local].sum(axis=1)
    moved = (sts != 0).any(axis=1)
    step_max = task.step_part_many(task.step_base[None] + task.st_step[units, local].sum(axis=1), moved)
    st_time = task.st_time[units, local].sum(axis=1) + np.where(moved, task.chunk_extra, 0.0)
    det = task.sim.evaluate(*polish_mod.option_arrays(acts), details=True)
    peak = np.maximum((det["peaks"][:, None, :] + seg[None]).max(axis=2), step_max[None])
    time = det["time"][:, None] + st_time[None]
    best = sorted((float(time[a, z]), a, z) for a, z in zip(*np.nonzero(peak <= task.budget)))[:keep]
    best = best or [(0.0, 0, 0)]
    out_a, out_s = acts[[a for _, a, _ in best]], sts[[z for _, _, z in best]]
    # two placements changed, options as they are: each pair's change to the current placements' totals
    ids = task.state_ids[st_local]
    loc = np.searchsorted(task.state_ids, cur_st)
    new_loc = np.searchsorted(task.state_ids, ids)
    d_seg = task.st_seg[st_units, new_loc] - task.st_seg[st_units, loc[st_units]]
    d_step = task.st_step[st_units, new_loc] - task.st_step[st_units, loc[st_units]]
    d_time = task.st_time[st_units, new_loc] - task.st_time[st_units, loc[st_units]]
    r = np.arange(n)
    seg0 = det["peaks"][0] + task.st_seg[r, loc].sum(axis=0)
    step0 = task.step_base + task.st_step[r, loc].sum(axis=0)
    time_base = float(det["time"][0]) + task.st_time[r, loc].sum()
    nz = int((cur_st != 0).sum())
    d_nz = (ids != 0).astype(int) - (cur_st[st_units] != 0).astype(int)
    pairs = []
    for i in range(st_units.size):
        for j in range(i + 1, st_units.size):
            if st_units[i] == st_units[j]:
                continue
            mv = nz + d_nz[i] + d_nz[j] > 0
            stp = task.step_part_many(((step0 + d_step[i]) + d_step[j])[None], np.array([mv]))[0]
            if max(((seg0 + d_seg[i]) + d_seg[j]).max(), stp) <= task.budget:
                t = time_base + d_time[i] + d_time[j] + (task.chunk_extra if mv else 0.0)
                st = cur_st.copy()
                st[st_units[i]], st[st_units[j]] = ids[i], ids[j]
                pairs.append((float(t), i, j, st))
    pairs.sort(key=lambda p: p[:3])
    if pairs:
        out_a = np.concatenate([out_a, np.repeat(cur[None], min(keep, len(pairs)), axis=0)])
        out_s = np.concatenate([out_s, np.array([p[3] for p in pairs[:keep]])])
    return out_a, out_s


def test_polish_moves_are_those_of_scoring_every_pair(task):
    rng = np.random.default_rng(1)
    n = task.n
    for _ in range(6):
        cur = np.array([rng.choice(np.flatnonzero(task.option_ok[u])) for u in range(n)])
        cur_st = np.array([task.state_ids[rng.choice(np.flatnonzero(task.state_ok[u]))] for u in range(n)])
        cur_st[rng.random(n) < 0.5] = 0
        N = task.n_options
        units = np.repeat(np.arange(n), N)
        opts = np.tile(np.arange(N), n)
        cand = np.repeat(cur[None], n * N, axis=0)
        cand[np.arange(n * N), units] = opts
        cand = cand[task.option_ok[units, opts]]
        got = polish_mod._best_pairs(task, cur, cur_st, cand)
        want = _best_pairs_by_scoring_all(task, cur, cur_st, cand)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
