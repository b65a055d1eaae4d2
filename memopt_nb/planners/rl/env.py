"""``MemoryPlanningEnv`` — a PettingZoo ``ParallelEnv`` in which two cooperating agents write a memory plan.

Agents: ``"strategy"`` picks keep / recompute / swap for each unit and, where the task allows state placements
(``offload_state=``), where the unit's optimizer state, gradients and parameters live: its action is
``strategy * C + j`` for the task's ``C`` allowed placements (``task.state_ids[j]`` indexes
:data:`~memopt_nb.core.plan.STATE_CHOICES`; ``C == 1`` — activations only — leaves three actions and no placement
features). With ``"recompute_offload"`` allowed (``strategies=``, opt-in) it is a fourth strategy (actions
``3 * C + j``), timed like a swap. With ``"selective"`` allowed (opt-in; a profile made with ``selective=True``) each
save-set of :data:`~memopt_nb.core.plan.SAVE_SETS` is one more strategy after those (``task.action_codes`` maps a
strategy action to its code), untimed, allowed only where the unit offers that save-set as a Pareto one. ``"timing"``
picks the offload window and prefetch distance of each swapped (or recompute_offload) unit (the timing of state
transfers is the runtime's). One episode walks the units in its decision order (``order=``, :func:`decision_order`: the
model's forward order for activations only; where state may move, the units with the largest state first), *pipelined*:
at step ``t`` the strategy agent decides the ``t``-th unit of that order while the timing agent times the one before,
whose strategy it already sees. So both agents act at every step (``n + 1`` steps; at the two ends one agent has
only a no-op), which is why this is a ParallelEnv rather than a turn-based AEC environment: no agent ever waits, and
PPO batches both agents' transitions alike.

Observations (``{"observation": float32 vector, "action_mask": int8 vector}``):

* the unit's normalized forward/backward time, internal saved bytes, copy-to-compute ratio, position;
* the memory state: how far the plan so far exceeds the budget if every remaining unit kept everything, and if every
  remaining unit took its most frugal option ("what the remaining units need at least"), which share of the saving
  still possible is needed, the recent load of the copy engine, and the overhead so far;
* per action, what it would take off the current peak and what it would cost in time (from the task's marginal model),
  and where the unit's cheapest way to save memory ranks among the units still ahead;
* a look-ahead window of the next units to decide; the device (copy overlap, link speed relative to compute via the
  ratio);
* with placements (``C > 1``): the unit's largest state saving and cheapest state time, and per look-ahead unit what
  its most frugal placement would take off the peak.

The memory estimate behind the observations and masks is the task's marginal model: per-segment levels, plus — when
the cost model has a state table — the optimizer step's share of the peak (the plain step while every unit is
resident, the unit-by-unit step's points once any unit moves state). The state part is exactly the contract's
separable form, so for placements the estimate is exact.

What each action is made of (:meth:`MemoryPlanningEnv.action_parts`): a strategy action is its activation strategy
plus where each state piece lives, a timing action its offload window plus its prefetch distance. The agents score
those parts (:class:`~memopt_nb.planners.rl.ppo.Agent`), so that what one action teaches carries over to the others
that share a part.

Action masks: only the activation strategies the task allows (``strategies=``; keep where none of them fits the unit),
recompute/swap where the unit allows it, a save-set where the unit offers it, swap only with a host link, a placement
only where the state table says it changes something (not for units without parameters), timings only for swapped units
and only where they differ in effect, and any action after which the budget is out of reach even if every remaining unit
takes its most frugal option (by the marginal model; for the unit decided at the same step by the other agent, its most
frugal allowed option is assumed). Activations only, on :data:`~memopt_nb.planners.task.COMPLETION_FROM_UNITS`
units or more, where the task knows a plan that fits (its *completion*, the lowest-peak uniform plan,
:meth:`~memopt_nb.planners.task.PlanningTask.completion_options`), the masks go further:
only the actions after which that plan for the units still undecided keeps the budget, or the ones closest to it where
none does. The per-segment best case of every unit at once is no plan at all, and on a hundred units or more it let
episodes walk into budgets they could no longer meet. An action outside the mask is replaced by the first allowed one.

Reward (cooperative, from the exact simulator at the end of the episode): the team objective is
``J = overhead + penalty`` with ``overhead = step_time / keep_all_time − 1`` and a penalty that jumps to 1 and grows
with how far the peak exceeds the budget. The timing agent earns a *difference reward*,
``J(same strategies, default timings) − J(plan)`` — what its timings added, which only its own choices move. The
strategy agent earns ``−min(J(plan), J(default timings))``: its strategies judged with the better of the timings tried,
so that neither the timing agent's exploration nor a fixed default timing (which would teach it that a swap only the
right timing hides is bad) counts against it. Both are paid densely: each step carries the marginal-model cost of
that step's choice (for a swap, the cheapest allowed timing; a placement's state time, plus the unit-by-unit step's
extra time for the first unit that moves state), and the last step carries the exact remainder, so every
agent's episode return is exactly its share (shaping that leaves the returns unchanged). Returns are scaled by
``reward_scale``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
from gymnasium import spaces
from gymnasium.utils import seeding
from pettingzoo import ParallelEnv

from ...core.errors import PlanError
from ...core.plan import STATE_CHOICES
from ...core.strategies import REGISTRY
from ...sim.simulator import KEEP, RECOMPUTE, SWAP
from ..options import DEFAULT_TIMING, TIMINGS
from ..task import PlanningTask
from .ppo import SyncVectorEnv

__all__ = ["MemoryPlanningEnv", "STRATEGY", "TIMING", "ORDERS", "decision_order"]

STRATEGY, TIMING = "strategy", "timing"
_N_COMMON = 8
_N_UNIT = 9
_N_LOOK = 7


_TIMED = tuple(s.code for s in REGISTRY if s.timed)  # strategies the timing agent times


#: The decision orders :func:`decision_order` knows by name.
ORDERS = ("state", "forward")


def decision_order(task: PlanningTask, order: str | Sequence[int] = "state") -> np.ndarray:
    """The units in the order an episode decides them.

    ``"state"`` (the default): where the task lets state move, the units with the largest state first, then smaller
    ones — by powers of two (what a unit's most frugal placement takes off a typical segment: 8–16 MiB before 4–8 MiB),
    in forward order within each power — so that the largest placements are decided while the memory still to find is
    open, not last. Walking forward, the agents met a ConvNeXt's largest states (its last blocks) after the blocks
    before them had taken the cheap options, and had to offload them, which the optimum avoids. Units without state
    come last. Without placements (activations only) it is the forward order. ``"forward"``: the model's order. A
    sequence: that permutation.

    The masks and observations hold in any order: the marginal model is separable, and what the units still to decide
    can take off is summed over them (:meth:`~memopt_nb.planners.task.PlanningTask.suffixes`). ``memopt.search``
    passes its ``order=`` here.
    """
    n = task.n
    if isinstance(order, str):
        if order not in ORDERS:
            raise PlanError(f"order={order!r}: expected one of {', '.join(ORDERS)} or a permutation of the units")
        if order == "forward" or task.C == 1:
            return np.arange(n)
        # a unit's state bytes: what its most frugal placement takes off a typical segment (the median: moving any
        # unit's state also switches the step to unit by unit, which takes the same off one segment for every unit)
        saving = np.median(np.where(task.state_ok[:, 1:, None], -task.st_seg[:, 1:], 0.0), axis=2).max(axis=1)
        power = np.where(saving >= 1.0, np.floor(np.log2(np.maximum(saving, 1.0))), -1.0)
        return np.argsort(-power, kind="stable").astype(np.int64)
    perm = np.asarray(order, dtype=np.int64)
    if perm.shape != (n,) or not np.array_equal(np.sort(perm), np.arange(n)):
        raise PlanError(f"order: expected a permutation of the {n} units, got {list(perm)[:8]}…")
    return perm


def _one_hot(labels: list) -> np.ndarray:
    """One column per distinct label (in order of first appearance), one row per label."""
    values = list(dict.fromkeys(labels))
    return (np.array([values.index(v) for v in labels])[:, None] == np.arange(len(values))[None]).astype(np.float32)


def _rowmax(x: np.ndarray) -> np.ndarray:
    """Max over the last axis; ``-inf`` where it is empty (no step points)."""
    return x.max(axis=-1) if x.shape[-1] else np.full(x.shape[:-1], -np.inf)


class MemoryPlanningEnv(ParallelEnv):
    """Two agents plan keep/recompute/swap with each unit's state placement, and swap timing, for the units of one
    profile under one budget.

    ``task``: the compiled problem; ``lookahead``: how many of the next units to decide each observation describes;
    ``reward_scale``: what the returns are multiplied by; ``order``: the order the units are decided in
    (:func:`decision_order`: ``"state"``, the default, ``"forward"`` or a permutation; a wrong one raises
    ``PlanError``)."""

    metadata = {"name": "memopt_planning_v0", "render_modes": []}

    def __init__(self, task: PlanningTask, lookahead: int = 4, reward_scale: float = 10.0,
                 order: str | Sequence[int] = "state") -> None:
        self.task = task
        #: the units in the order the episode decides them (``order=``, see :func:`decision_order`); ``_pos`` inverts it
        self.order = decision_order(task, order)
        self._pos = np.argsort(self.order)
        self._order_key = self.order.tobytes()  # copies that walk the units alike are observed together
        self._suffix_min, self._suffix_step, self._suffix_can_move, self._suffix_red = task.suffixes(self.order)
        #: what the task's completion plan (a plan known to fit) takes off each segment from position ``k`` of the
        #: order on, ``(n + 1, S)``; ``None`` without one
        self._suffix_comp = None
        if task.completion is not None:
            marg = task.marg_peak[self.order, task.completion[self.order]]
            self._suffix_comp = np.concatenate([np.cumsum(marg[::-1], axis=0)[::-1], np.zeros((1, task.S))])
        self.lookahead = lookahead
        self.reward_scale = reward_scale
        self.possible_agents = [STRATEGY, TIMING]
        self.agents: list[str] = []
        self.render_mode = None
        n = task.n
        self._t_unit = task.base_time / n
        self._b_unit = task.budget / n
        C = task.C
        self._states = C > 1  # placements to choose: a few more features (none when C == 1)
        self._n_look = _N_LOOK + (1 if self._states else 0)
        K = task.n_strategies  # 3, 4 with recompute_offload, + 3 save-sets with selective
        self._dims = {
            STRATEGY: _N_COMMON + _N_UNIT + (2 if self._states else 0) + 3 * K * C + lookahead * self._n_look,
            TIMING: _N_COMMON + _N_UNIT + K + 3 * len(TIMINGS),
        }
        self._actions = {STRATEGY: K * C, TIMING: len(TIMINGS)}
        self.np_random, _ = seeding.np_random(None)
        self._cache: dict[int, dict[str, Any]] = {}  # per unit: what its observations need that never changes

    # ------------------------------------------------------------------ spaces (cached: the API test checks identity)
    @functools.cache  # noqa: B019 - one env, two agents
    def observation_space(self, agent: str) -> spaces.Space:
        return spaces.Dict({
            "observation": spaces.Box(-np.inf, np.inf, (self._dims[agent],), np.float32),
            "action_mask": spaces.Box(0, 1, (self._actions[agent],), np.int8),
        })

    @functools.cache  # noqa: B019
    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(self._actions[agent])

    @functools.cache  # noqa: B019
    def action_parts(self, agent: str) -> np.ndarray:
        """What each of ``agent``'s actions is made of, as a 0/1 matrix (actions × parts) for a policy that scores parts
        (:class:`~memopt_nb.planners.rl.ppo.Agent`): a strategy action is its activation strategy and, with
        placements, where each state piece lives (one part per piece and place); a timing action is its offload window
        and its prefetch
        distance."""
        if agent == TIMING:
            return np.concatenate([_one_hot([w for w, _ in TIMINGS]), _one_hot([d for _, d in TIMINGS])], axis=1)
        task = self.task
        K, C = task.n_strategies, task.C
        cols = [_one_hot([s for s in range(K) for _ in range(C)])]
        if C > 1:
            places = [STATE_CHOICES[int(task.state_ids[j])] for _ in range(K) for j in range(C)]
            cols += [_one_hot([p[piece] for p in places]) for piece in range(len(places[0]))]
        return np.concatenate(cols, axis=1)

    # ------------------------------------------------------------------ episode
    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self.np_random, _ = seeding.np_random(seed)
        task = self.task
        n = task.n
        self.agents = list(self.possible_agents)
        self.t = 0
        self.codes = np.zeros(n, dtype=np.int64)
        self.windows = np.ones(n, dtype=np.int64)
        self.dists = np.ones(n, dtype=np.int64)
        self.level = task.base_peaks.copy()  # per-segment peak with every decided unit's marginal applied
        self.states = np.zeros(n, dtype=np.int64)  # placements, as indices into STATE_CHOICES
        self.step_level = task.step_base.copy()  # the unit-by-unit optimizer step's points, placements applied
        self.moved = False  # whether any decided unit moves state (then the step runs unit by unit)
        self.spent = 0.0  # marginal-model overhead of the decisions so far
        self.shaped = {STRATEGY: 0.0, TIMING: 0.0}
        self._obs, self._masks = self._observe()
        return self._obs, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        rewards, done = self._act(actions)
        return self._conclude(rewards, done, self.task.evaluate(*self._plans()) if done else None)

    @staticmethod
    def step_many(envs: list[MemoryPlanningEnv], actions: list[dict[str, Any]]) -> list[tuple[dict, ...]]:
        """``[env.step(a) for env, a in zip(envs, actions)]``, with one exact evaluation for all the episodes that end
        at this step (per task) and the observations of copies at the same unit computed together: PPO's copies of
        the environment walk the units in step."""
        acted = [env._act(a) for env, a in zip(envs, actions, strict=True)]
        settled: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        ending = [i for i, (_, done) in enumerate(acted) if done]
        for task in {id(envs[i].task): envs[i].task for i in ending}.values():
            mine = [i for i in ending if envs[i].task is task]
            plans = [envs[i]._plans() for i in mine]
            peak, time = task.evaluate(*(np.concatenate([p[k] for p in plans]) for k in range(4)))
            for r, i in enumerate(mine):
                settled[i] = (peak[2 * r: 2 * r + 2], time[2 * r: 2 * r + 2])
        observed: dict[int, tuple[dict, dict]] = {}
        groups: dict[tuple[int, bytes, int, int], list[int]] = {}
        for i, env in enumerate(envs):
            if env.t < env.task.n:
                groups.setdefault((id(env.task), env._order_key, env.t, env.lookahead), []).append(i)
        for mine in groups.values():
            observed.update(zip(mine, MemoryPlanningEnv._observe_many([envs[i] for i in mine])))
        return [env._conclude(rewards, done, settled.get(i), observed.get(i))
                for i, (env, (rewards, done)) in enumerate(zip(envs, acted))]

    @classmethod
    def vector(cls, task: PlanningTask, num_envs: int, **options: Any) -> PlanningVectorEnv:
        """``num_envs`` copies of this environment for :func:`~memopt_nb.planners.rl.ppo.train`."""
        return PlanningVectorEnv(task, num_envs, **options)

    def _act(self, actions: dict[str, Any]) -> tuple[dict[str, float], bool]:
        """Apply both agents' actions; the dense rewards and whether the episode ends."""
        task = self.task
        n, t = task.n, self.t
        rewards = {STRATEGY: 0.0, TIMING: 0.0}
        # timing for the unit decided at the previous step (its strategy was chosen then)
        p = int(self.order[t - 1]) if t >= 1 else -1
        if t >= 1 and self.codes[p] in _TIMED:
            j = self._allowed(TIMING, actions.get(TIMING, 0))
            b = task.timed_base[int(self.codes[p])]
            self.windows[p], self.dists[p] = TIMINGS[j]
            self.level += task.marg_peak[p, b + j]
            cost = task.marg_time[p, b + j] - task.marg_time[p, b + DEFAULT_TIMING]
            self.spent += task.marg_time[p, b + j]
            rewards[TIMING] = -cost / task.base_time * self.reward_scale
        # strategy for the unit at step t
        if t < n:
            u = int(self.order[t])
            s, j = divmod(self._allowed(STRATEGY, actions.get(STRATEGY, 0)), task.C)
            code = int(task.action_codes[s])
            self.codes[u] = code
            self.states[u] = task.state_ids[j]
            st_cost = 0.0
            if j:  # the placement's exact, separable part
                self.level += task.st_seg[u, j]
                self.step_level += task.st_step[u, j]
                st_cost = task.st_time[u, j] + (0.0 if self.moved else task.chunk_extra)
                self.moved = True
                self.spent += st_cost
            if code not in _TIMED:
                o = int(task.action_option[s])
                self.level += task.marg_peak[u, o]
                self.spent += task.marg_time[u, o]
                cost = task.marg_time[u, o] + st_cost
            else:  # optimistic: as if the timing agent picks the cheapest allowed timing
                cost = self._static(u)["timed_cost"][code] + st_cost
            rewards[STRATEGY] = -cost / task.base_time * self.reward_scale
        for a in rewards:
            self.shaped[a] += rewards[a]
        self.t = t + 1
        return rewards, self.t > n

    def _conclude(self, rewards: dict[str, float], done: bool, evaluated: tuple[np.ndarray, np.ndarray] | None,
                  observed: tuple[dict, dict] | None = None) -> tuple[dict, dict, dict, dict, dict]:
        """The rest of :meth:`step`, given the exact peaks and times of :meth:`_plans` where the episode ends (and the
        new observations, where they were computed with other copies')."""
        infos: dict[str, dict] = {a: {} for a in self.agents}
        if done:
            rewards, result = self._settle(rewards, *evaluated)
            infos = {a: dict(result) for a in self.agents}
        self._obs, self._masks = observed if observed is not None else self._observe()
        terms = {a: done for a in self.agents}
        truncs = {a: False for a in self.agents}
        obs = self._obs
        if done:
            self.agents = []
        return obs, rewards, terms, truncs, infos

    def _plans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The finished plan and the same strategies with default timings, as ``(2, n)`` arrays to evaluate."""
        codes = np.stack([self.codes, self.codes])
        dw, dd = TIMINGS[DEFAULT_TIMING]
        timed = np.isin(self.codes, _TIMED)
        windows = np.stack([self.windows, np.where(timed, dw, 1)])
        dists = np.stack([self.dists, np.where(timed, dd, 1)])
        return codes, windows, dists, np.stack([self.states, self.states])

    def _settle(self, rewards: dict[str, float], peak: np.ndarray,
                time: np.ndarray) -> tuple[dict[str, float], dict[str, Any]]:
        """The last step's rewards and the episode's result from the exact evaluation of :meth:`_plans`."""
        task = self.task
        j = task.overhead(time) + task.penalty(peak)
        share = {STRATEGY: -min(j[0], j[1]) * self.reward_scale, TIMING: -(j[0] - j[1]) * self.reward_scale}
        for a in rewards:
            # the last step pays what the dense rewards have not: episode return == the agent's exact share
            rewards[a] += share[a] - self.shaped[a]
        result = {"codes": self.codes.copy(), "windows": self.windows.copy(), "dists": self.dists.copy(),
                  "states": self.states.copy(),
                  "peak": float(peak[0]), "time": float(time[0]), "feasible": bool(peak[0] <= task.budget),
                  "objective": float(j[0]), "objective_default_timing": float(j[1]),
                  "return": {a: float(v) for a, v in share.items()}}
        return rewards, result

    def _allowed(self, agent: str, action: Any) -> int:
        a = int(action)
        mask = self._masks[agent]
        if 0 <= a < mask.size and mask[a]:
            return a
        return int(np.flatnonzero(mask)[0])

    def _static(self, u: int) -> dict[str, Any]:
        """What the observations of unit ``u`` need that no decision changes (computed once per unit and env)."""
        got = self._cache.get(u)
        if got is not None:
            return got
        got = self._cache[u] = _static_features(self, u)
        return got

    @staticmethod
    def _observe_many(envs: list[MemoryPlanningEnv]) -> list[tuple[dict, dict]]:
        """Both agents' observations and masks for copies at the same step ``t < n`` of one task and decision order,
        computed together on stacked arrays (one copy alone: :meth:`_observe`)."""
        c = _step_context(envs)
        s_feat, s_mask = _strategy_part(c)
        t_feat, t_mask = _timing_part(c, s_mask)
        out = []
        for e in range(c.E):
            obs = {STRATEGY: {"observation": s_feat[e], "action_mask": s_mask[e]},
                   TIMING: {"observation": t_feat[e], "action_mask": t_mask[e]}}
            out.append((obs, {STRATEGY: s_mask[e], TIMING: t_mask[e]}))
        return out

    # ------------------------------------------------------------------ observations and masks
    def _observe(self) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """Both agents' observations and masks at this step: :meth:`_observe_many` of this copy alone while a unit
        is still to be decided, :func:`_observe_end` after the last one."""
        if self.t < self.task.n:
            return MemoryPlanningEnv._observe_many([self])[0]
        return _observe_end(self)

    def _unit_features(self, u: int) -> np.ndarray:
        task = self.task
        unit = task.profile.units[u]
        later = task.best_eff[self.order[int(self._pos[u]) + 1:]]  # the units decided after this one
        rank = lambda e: float((later < e).mean()) if later.size else 0.0  # noqa: E731 - share of cheaper units ahead
        return np.array([
            rank(task.rc_eff[u]),
            rank(task.swap_eff[u]),
            u / task.n,
            task.sim.dur[task.sim.fwd_seg[u]] / self._t_unit,
            task.sim.dur[task.sim.bwd_seg[u]] / self._t_unit,
            unit.interior_bytes / self._b_unit,
            min(float(task.copy_ratio[u]), 10.0),
            float(task.option_ok[u, RECOMPUTE]),
            float(task.option_ok[u, task.timed_base[SWAP]:task.timed_base[SWAP] + len(TIMINGS)].any()),
        ])

    def render(self) -> None:
        """Nothing to render; the notebook dashboard shows the search instead."""

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- observations
# After the last decision (_observe_end); before it, MemoryPlanningEnv._observe_many in its parts: what the copies
# share at this step (_step_context), then each agent's part.
def _static_features(env: MemoryPlanningEnv, u: int) -> dict[str, Any]:
    """What the observations of unit ``u`` need that no decision changes (:meth:`MemoryPlanningEnv._static` keeps
    it)."""
    task = env.task
    n, C, S = task.n, task.C, task.S
    K, T = task.n_strategies, len(TIMINGS)
    unit = env._unit_features(u)
    choice, ok_s, costs = [], [], []
    # per timed strategy (keyed by its code): its most frugal allowed timing, what the timing agent sees
    timed_cost, pend_min, t_cost, t_unit = {}, {}, {}, {}
    for a, (code, o) in enumerate(zip(task.action_codes.tolist(), task.action_option.tolist(), strict=True)):
        if o >= 0:  # an untimed action: its one option
            choice.append(task.marg_peak[u, o])
            ok_s.append(bool(task.option_ok[u, o]))
            costs.append(task.marg_time[u, o])
            continue
        b = task.timed_base[code]
        opts = np.flatnonzero(task.option_ok[u, b:b + T])
        frugal_c = task.marg_peak[u, b + opts].min(axis=0) if opts.size else None
        choice.append(frugal_c if opts.size else np.zeros(S))
        ok_s.append(bool(opts.size))
        default = task.marg_time[u, b + DEFAULT_TIMING]
        costs.append(default)
        timed_cost[code] = task.marg_time[u, b + opts].min() if opts.size else None
        pend_min[code] = frugal_c
        t_cost[code] = (task.marg_time[u, b:b + T] - default) / env._t_unit
        t_unit[code] = np.concatenate([unit, np.eye(K)[a]])
    choice = np.stack(choice)
    ok_s = np.array(ok_s)
    costs = np.array(costs)
    cost_per = {}  # per whether a unit before moved state: (K, C) time of each action, relative
    for before in (False, True):
        moved = before | (np.arange(C) > 0)
        st_cost = task.st_time[u] + np.where(moved & ~before, task.chunk_extra, 0.0)
        cost_per[before] = (costs[:, None] + st_cost[None]) / env._t_unit
    if env._states:
        saving = max(float(-task.st_seg[u, j].min()) for j in range(C) if task.state_ok[u, j])
        times = [float(task.st_time[u, j]) for j in range(1, C) if task.state_ok[u, j]]
        unit_s = np.concatenate([unit, [saving / env._b_unit, min(times, default=0.0) / env._t_unit]])
    else:
        unit_s = unit
    # the timing agent's frugal strategy assumption: per action o * C + j, its segments and step points
    frugal = np.array([choice[o] if j == 0 else choice[o] + task.st_seg[u, j] for o in range(K) for j in range(C)])
    frugal_step = np.array([task.st_step[u, j] for o in range(K) for j in range(C)]).reshape(K * C, task.K)
    k = int(env._pos[u])
    look = [int(v) for v in env.order[k + 1:k + 1 + env.lookahead]]  # the next units this episode decides
    look_static = np.array([[1.0, task.sim.dur[task.sim.fwd_seg[v]] / env._t_unit,
                             task.profile.units[v].interior_bytes / env._b_unit,
                             task.marg_time[v, RECOMPUTE] / env._t_unit,
                             task.marg_time[v, task.timed_base[SWAP] + DEFAULT_TIMING] / env._t_unit]
                            for v in look]).reshape(-1, 5)
    got = {
        "choice": choice, "ok": (ok_s[:, None] & task.state_ok[u][None]).ravel(), "cost_per": cost_per,
        "unit": unit, "unit_s": unit_s, "frugal": frugal, "frugal_step": frugal_step,
        "timed_cost": timed_cost, "pend_min": pend_min, "t_cost": t_cost, "t_unit": t_unit,
        "look": np.array(look, dtype=np.int64), "look_static": look_static,
        "look_moved": np.array([bool(task.state_ok[v, 1:].any()) for v in look], dtype=bool),
        "load_den": max(sum(task.sim.fwd_time[v] for v in range(max(0, u - 3), min(u + 1, n))), 1e-12),
    }
    return got


def _observe_end(env: MemoryPlanningEnv) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """After the last unit's decision: the strategy agent may only keep (its action is ignored), the timing agent
    times the last decided unit if it is a timed one, with every unit's decision known."""
    task = env.task
    n, t = task.n, env.t
    p = int(env.order[t - 1]) if t == n else -1  # the unit decided last, its timing still open
    budget = task.budget
    tol = budget * (1 + 1e-9)
    level = env.level
    T = len(TIMINGS)
    pcode = int(env.codes[p]) if p >= 0 else -1
    pending = pcode in _TIMED
    if pending:
        level = level + env._static(p)["pend_min"][pcode]
    rest = env._suffix_min[n]
    rest_step = env._suffix_step[n]
    rest_move = bool(env._suffix_can_move[n])
    cur = task.bound(level, env.step_level, env.moved)
    need = max(cur - budget, 0.01 * budget)
    need_ratio = max(cur - budget, 0.0) / max(float(env._suffix_red[n]), 1.0)
    recent = range(max(0, n - 3), n)
    load = sum(task.copy_ratio[v] * task.sim.fwd_time[v] for v in recent if env.codes[v] == SWAP)
    load /= max(sum(task.sim.fwd_time[v] for v in recent), 1e-12)
    least = task.bound(level + env._suffix_min[n], env.step_level + env._suffix_step[n], env.moved,
                       bool(env._suffix_can_move[n]))
    common = np.array([t / n, (n - t) / n, (cur - budget) / budget, (least - budget) / budget,
                       env.spent / task.base_time, float(task.sim.device.copy_overlap), min(need_ratio, 5.0),
                       min(load, 10.0)], dtype=np.float64)
    s_mask = np.zeros(task.n_strategies * task.C, dtype=np.int8)
    s_mask[KEEP] = 1
    obs = {STRATEGY: {"observation": np.zeros(env._dims[STRATEGY], dtype=np.float32), "action_mask": s_mask}}
    masks = {STRATEGY: s_mask}
    t_mask = np.zeros(T, dtype=np.int8)
    t_feat = np.zeros(env._dims[TIMING])
    if pending:
        base = env.level + rest
        base_step = env.step_level + rest_step
        b = task.timed_base[pcode]
        ok = task.option_ok[p, b:b + T]
        peaks = task.bounds((base[None] + task.marg_peak[p, b:b + T]).max(axis=1), _rowmax(base_step[None]),
                            np.array([env.moved]), rest_move)
        t_mask[:] = ok & (peaks <= tol)
        if not t_mask.any():
            t_mask[:] = ok
        sp = env._static(p)
        ref = float(env.level.max())
        red = (ref - (env.level[None] + task.marg_peak[p, b:b + T]).max(axis=1)) / need
        per = np.stack([red, sp["t_cost"][pcode], t_mask.astype(np.float64)], axis=1).ravel()
        t_feat = np.concatenate([common, sp["t_unit"][pcode], per])
    else:
        t_mask[0] = 1
    obs[TIMING] = {"observation": t_feat.astype(np.float32), "action_mask": t_mask}
    masks[TIMING] = t_mask
    return obs, masks


def _bound(task: PlanningTask, seg: np.ndarray, step: np.ndarray, moved: np.ndarray, can_move: bool) -> np.ndarray:
    """The peak bound of segment levels ``seg`` and unit-by-unit step levels ``step`` (the segments' alone where the
    task has no step model)."""
    seg_max = seg.max(axis=-1)
    if not task.has_step:
        return seg_max
    return task.bounds(seg_max, _rowmax(step) if task.K else np.full(seg_max.shape, -np.inf), moved, can_move)


def _step_context(envs: list[MemoryPlanningEnv]) -> SimpleNamespace:
    """What both agents' observations share for copies at the same step: the units decided now (``u``) and before
    (``p``), the copies' levels (the pending timing at its best), the bounds and the common features."""
    first = envs[0]
    task, t = first.task, first.t
    u = int(first.order[t])  # the unit decided at this step; p, the one before (its timing still open)
    p = int(first.order[t - 1]) if t >= 1 else -1
    n, C, E = task.n, task.C, len(envs)
    budget = task.budget
    tol = budget * (1 + 1e-9)
    st = first._static(u)
    base_level = np.stack([env.level for env in envs])
    step_level = np.stack([env.step_level for env in envs])
    was_moved = np.array([env.moved for env in envs])
    pcode = np.array([env.codes[p] if t >= 1 else -1 for env in envs])  # timed: its timing still open
    pending = np.isin(pcode, _TIMED)
    level = base_level.copy()
    for code in np.unique(pcode[pending]):
        sel = pcode == code
        level[sel] = base_level[sel] + first._static(p)["pend_min"][int(code)]
    rest = first._suffix_min[t + 1]
    rest_step = first._suffix_step[t + 1]
    rest_move = bool(first._suffix_can_move[t + 1])
    cur = _bound(task, level, step_level, was_moved, False)
    need = np.maximum(cur - budget, 0.01 * budget)
    need_ratio = np.maximum(cur - budget, 0.0) / max(float(first._suffix_red[t]), 1.0)
    loads = []
    for env in envs:
        load = sum(task.copy_ratio[v] * task.sim.fwd_time[v] for v in range(max(0, u - 3), u)
                   if env.codes[v] == SWAP)
        loads.append(min(load / st["load_den"], 10.0))
    least = _bound(task, level + first._suffix_min[t], step_level + first._suffix_step[t], was_moved,
                   bool(first._suffix_can_move[t]))
    common = np.stack([np.full(E, t / n), np.full(E, (n - t) / n), (cur - budget) / budget,
                       (least - budget) / budget, np.array([env.spent for env in envs]) / task.base_time,
                       np.full(E, float(task.sim.device.copy_overlap)), np.minimum(need_ratio, 5.0),
                       np.array(loads)], axis=1)
    comp = first._suffix_comp
    return SimpleNamespace(first=first, task=task, t=t, u=u, p=p, n=n, C=C, E=E, budget=budget, tol=tol, st=st,
                           base_level=base_level, step_level=step_level, was_moved=was_moved, pcode=pcode,
                           pending=pending, rest=rest, rest_step=rest_step, rest_move=rest_move, cur=cur, need=need,
                           common=common, level=level, comp=comp)


def _strategy_part(c: SimpleNamespace) -> tuple[np.ndarray, np.ndarray]:
    """The strategy agent's observations and masks for unit ``c.u``, every copy at once."""
    first, task, t, u, C, E, st, tol = c.first, c.task, c.t, c.u, c.C, c.E, c.st, c.tol
    level, step_level, was_moved, cur, need, common = c.level, c.step_level, c.was_moved, c.cur, c.need, c.common
    rest, rest_step, rest_move = c.rest, c.rest_step, c.rest_move
    # strategy agent, unit u: every (strategy o, placement j) of every copy, (E, K, C, S) and (E, C, K)
    ok = st["ok"]
    seg = (level[:, None, :] + st["choice"][None])[:, :, None, :] + task.st_seg[u][None, None]
    step = step_level[:, None, :] + task.st_step[u][None]
    moved = was_moved[:, None] | (np.arange(C) > 0)[None]  # (E, C)
    rest_max = _rowmax(step + rest_step)[:, None] if task.K else np.full((E, 1, C), -np.inf)
    comp = c.comp
    # the rest at its best case per segment, or (comp) on the completion plan
    with_rest = (seg + (rest if comp is None else comp[t + 1])).max(axis=3)
    if task.has_step:
        with_rest = task.bounds(with_rest, rest_max, moved[:, None], rest_move)
    with_rest = with_rest.reshape(E, -1)
    if comp is None:  # the actions after which the budget stays in reach (all, where none does)
        s_mask = (ok[None] & (with_rest <= tol)).astype(np.int8)
        s_mask[~s_mask.any(axis=1)] = ok
    else:  # the actions that keep the budget with the completion plan for the rest (else the ones closest to it:
        # where an earlier choice of the other agent went over, back towards the budget)
        with_rest = np.where(ok[None], with_rest, np.inf)
        s_mask = (ok[None] & (with_rest <= np.maximum(tol, with_rest.min(axis=1, keepdims=True)))).astype(np.int8)
    step_max = _rowmax(step)[:, None] if task.K else np.full((E, 1, C), -np.inf)
    est = task.bounds(seg.max(axis=3), step_max, moved[:, None], False) if task.has_step else seg.max(axis=3)
    cost = np.stack([st["cost_per"][bool(m)] for m in was_moved])
    per = np.stack([(cur[:, None, None] - est) / need[:, None, None], cost,
                    s_mask.reshape(E, task.n_strategies, C).astype(np.float64)], axis=3).reshape(E, -1)
    vs = st["look"]
    look = np.zeros((E, first.lookahead, first._n_look))
    if vs.size:
        m = vs.size
        c_, n_ = cur[:, None], need[:, None]
        look[:, :m, :5] = st["look_static"][None]
        look[:, :m, 5] = (c_ - (level[:, None, :] + task.marg_peak[vs, RECOMPUTE][None]).max(axis=2)) / n_
        look[:, :m, 6] = (c_ - (level[:, None, :] + task.min_marg[vs][None]).max(axis=2)) / n_
        if first._states:
            st_est = (level[:, None, :] + task.st_min_seg[vs][None]).max(axis=2)
            if task.has_step:
                chunked = (_rowmax(step_level[:, None, :] + task.st_min_step[vs][None]) if task.K else
                           np.full((E, m), -np.inf))
                st_est = np.maximum(st_est, np.where(was_moved[:, None] | st["look_moved"][None], chunked,
                                                     task.plain_step))
            look[:, :m, 7] = (c_ - st_est) / n_
    s_feat = np.concatenate([common, np.broadcast_to(st["unit_s"], (E, st["unit_s"].size)), per,
                             look.reshape(E, -1)], axis=1).astype(np.float32)
    return s_feat, s_mask


def _timing_part(c: SimpleNamespace, s_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The timing agent's observations and masks for unit ``c.p`` (only where it is timed: per timed strategy, the
    copies that chose it)."""
    first, task, t, p, C, E, st, tol, comp = c.first, c.task, c.t, c.p, c.C, c.E, c.st, c.tol, c.comp
    base_level, step_level, was_moved, need, common = c.base_level, c.step_level, c.was_moved, c.need, c.common
    rest, rest_step, rest_move, pcode, pending = c.rest, c.rest_step, c.rest_move, c.pcode, c.pending
    # timing agent, unit p (only where it is timed: per timed strategy, the copies that chose it)
    T = len(TIMINGS)
    t_mask = np.zeros((E, T), dtype=np.int8)
    t_mask[:, 0] = 1
    t_feat = np.zeros((E, first._dims[TIMING]), dtype=np.float32)
    for code in (int(c) for c in np.unique(pcode[pending])):
        sp = first._static(p)
        k = np.flatnonzero(pcode == code)
        bo = task.timed_base[code]
        popt = task.option_ok[p, bo:bo + T]
        marg = task.marg_peak[p, bo:bo + T]
        if comp is None:  # unit u at its most frugal allowed action, the rest at their best case
            sel = s_mask[k].astype(bool)
            frugal = np.where(sel[:, :, None], st["frugal"][None], np.inf).min(axis=1)
            frugal_step = np.where(sel[:, :, None], st["frugal_step"][None], np.inf).min(axis=1)
            t_move = (sel & (np.arange(sel.shape[1]) % C > 0)[None]).any(axis=1)
            base = base_level[k] + frugal + rest
            base_step = step_level[k] + frugal_step + rest_step
            seg_max = (base[:, None, :] + marg[None]).max(axis=2)
            if task.has_step:
                bmax = _rowmax(base_step) if task.K else np.full(k.size, -np.inf)
                still = np.where(t_move | rest_move, np.minimum(task.plain_step, bmax), task.plain_step)
                peaks = np.maximum(seg_max, np.where(was_moved[k], bmax, still)[:, None])
            else:
                peaks = seg_max
            tm = (popt[None] & (peaks <= tol)).astype(np.int8)
            tm[~tm.any(axis=1)] = popt
        else:  # likewise with unit u and the rest on the completion plan
            cseg = ((base_level[k] + comp[t])[:, None, :] + marg[None]).max(axis=2)
            if task.has_step:
                cseg = np.maximum(cseg, np.where(was_moved[k], -np.inf, task.plain_step)[:, None])
            cseg = np.where(popt[None], cseg, np.inf)
            tm = (popt[None] & (cseg <= np.maximum(tol, cseg.min(axis=1, keepdims=True)))).astype(np.int8)
        t_mask[k] = tm
        ref = base_level[k].max(axis=1)
        red = (ref[:, None] - (base_level[k][:, None, :] + marg[None]).max(axis=2)) / need[k, None]
        per_t = np.stack([red, np.broadcast_to(sp["t_cost"][code], red.shape), tm.astype(np.float64)],
                         axis=2).reshape(k.size, -1)
        t_unit = sp["t_unit"][code]
        t_feat[k] = np.concatenate([common[k], np.broadcast_to(t_unit, (k.size, t_unit.size)), per_t],
                                   axis=1).astype(np.float32)
    return t_feat, t_mask


class PlanningVectorEnv(SyncVectorEnv):
    """Copies of :class:`MemoryPlanningEnv` stepped together: PPO's copies walk the units in step, so one exact
    evaluation serves every episode that ends at a step and the observations of copies at the same unit are computed
    together (:meth:`MemoryPlanningEnv.step_many`). Every episode is ``n + 1`` steps long."""

    def __init__(self, task: PlanningTask, num_envs: int, **options: Any) -> None:
        super().__init__(lambda: MemoryPlanningEnv(task, **options), num_envs, episode_steps=task.n + 1)

    def action_parts(self, agent: str) -> np.ndarray:
        return self.envs[0].action_parts(agent)

    def step(self, actions: list[dict[str, int]]) -> list[tuple[dict, ...]]:
        return MemoryPlanningEnv.step_many(self.envs, actions)
