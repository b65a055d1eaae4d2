"""``memopt.search``: the dual-agent PPO search for a plan (MemOpt's method), with an optional polish."""

from __future__ import annotations

import contextlib
import functools
import math
import random
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ...core.device import DeviceSpec
from ...core.errors import PlanError
from ...core.plan import DEFAULT_STRATEGIES, STATE_CHOICES, Plan
from ...runtime.limit import uncounted
from ..checks import planning_for_free
from ..heads import choosing_head
from ..optimal import optimal
from ..options import make_plan, plan_decisions
from ..polish import (
    Deadline,
    option_arrays,
    polish,
    polish_exact_placements,
    polish_heuristic_starts,
    repair,
    to_options,
)
from ..task import PlanningTask
from .env import STRATEGY, TIMING, MemoryPlanningEnv, decision_order
from .ppo import PPOConfig, train

__all__ = ["search", "plan_from_arrays", "SearchTracker", "default_timesteps", "default_restarts",
           "default_update_epochs", "default_risk_quantile", "RISK_QUANTILE", "METHOD", "PATIENCE",
           "PATIENCE_TOLERANCE", "TIME_LIMIT"]

METHOD = "memopt-ppo"


def default_timesteps(n_units: int, states: bool = False) -> int:
    """The default PPO budget: about 1,500 episodes' worth of steps, between 30k (45k where state may move,
    ``states=True``) and 100k.

    Where state may move the strategy agent learns risk-seeking (:func:`default_risk_quantile`) and small problems
    get more steps: its best episodes keep improving after the average one has settled (figures in
    benchmarks/RESULTS.md, "planner quality"). From 29 units up the budget is the same either way.
    """
    return int(min(100_000, max(45_000 if states else 30_000, 1500 * (n_units + 1))))


#: The share of each rollout's episodes the strategy agent learns from where state may move (see
#: :func:`default_risk_quantile`).
RISK_QUANTILE = 0.25


def default_risk_quantile(task: PlanningTask) -> float | None:
    """Where state may move (``task.C > 1``): :data:`RISK_QUANTILE` — the strategy agent learns only from the best
    quarter of each rollout's episodes (:attr:`~memopt_nb.planners.rl.ppo.PPOConfig.risk_quantile`, the risk-seeking
    policy gradient of Petersen et al. 2021); activations only: ``None`` (ordinary PPO).

    The search returns the best plan the agents ever sampled, so it is their best episodes that should improve, not
    their average one, which ordinary PPO optimizes and then settles on early. The comparison over seeds is in
    benchmarks/RESULTS.md ("planner quality").
    """
    return RISK_QUANTILE if task.C > 1 else None


#: Seconds the search (agents and polish) may take by default: no limit, so that the same seed gives the same plan on
#: any machine (``time_limit=`` sets one, and the plan then says where it cut: ``meta["cut_by_time_limit"]``).
TIME_LIMIT: float | None = None
#: PPO iterations without a faster plan after which an agent pair stops, by default. Small problems settle within a
#: few dozen iterations but get at least 30k steps (hundreds of iterations); large ones run out of steps first.
PATIENCE: int | None = 50
#: The relative speed-up that counts as a faster plan for :data:`PATIENCE`.
PATIENCE_TOLERANCE = 1e-4


def default_restarts(n_units: int) -> int:
    """Independent agent pairs sharing the budget: two for small problems, where one pair settles early."""
    return 2 if n_units <= 24 else 1


def default_update_epochs(task: PlanningTask) -> int:
    """PPO epochs over each rollout: CleanRL's 4, and 8 where the strategy agent may also choose
    ``recompute_offload`` or a selective save-set (``strategies=``).

    Those actions' effects depend on the neighbouring units' choices, and the extra epochs let the strategy agent
    fit them where more steps, a larger learning rate or more entropy did not (``benchmarks/planner_quality.py
    --wide``); over the whole-step space with keep / recompute / swap they made no difference.
    """
    return 8 if task.opt_in else 4


def plan_from_arrays(task: PlanningTask, codes: np.ndarray, windows: np.ndarray, dists: np.ndarray,
                     states: np.ndarray | None, *, seed: int | None, **meta: Any) -> Plan:
    """The plan of these arrays, with the task's prediction (placements and the optimizer step included).

    Without a state model and without ``step_in_backward`` this is exactly
    :func:`~memopt_nb.planners.options.make_plan`; otherwise the decisions carry the placements, the predicted peak and
    step time come from the task's state-aware evaluation, and the plan records ``step_in_backward``.
    """
    plan = make_plan(task.sim, codes, windows, dists, budget=task.budget, method=METHOD, seed=seed, **meta)
    if task.state_model is None and not task.step_in_backward:
        return plan
    st = np.zeros(task.n, dtype=np.int64) if states is None else np.asarray(states, dtype=np.int64)
    peak, time_ = task.evaluate(np.asarray(codes)[None], np.asarray(windows)[None], np.asarray(dists)[None], st[None])
    decisions = plan_decisions(task.profile, [int(x) for x in codes], list(windows), list(dists), st.tolist())
    fingerprint = plan.optimizer_fingerprint or (getattr(task.profile, "meta", None) or {}).get(
        "optimizer_fingerprint")  # the optimizer the placements were made for (the runtime checks it)
    return plan.with_meta(decisions=decisions, predicted_peak_bytes=int(round(float(peak[0]))),
                          predicted_step_time=float(time_[0]), feasible=bool(peak[0] <= task.budget),
                          step_in_backward=task.step_in_backward, optimizer_fingerprint=fingerprint)


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """Leave the global torch (CPU and, if initialized, CUDA), NumPy and ``random`` RNG states as they were.

    The agents draw from their own seeded generators, but building their networks (``nn.Linear`` initialization)
    draws from torch's global one; a search must not shift the random numbers of the user's training afterwards.
    """
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    np_state = np.random.get_state()
    py_state = random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(np_state)
        random.setstate(py_state)


def _keeps_global_rng(fn: Callable[..., Plan]) -> Callable[..., Plan]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Plan:
        with _global_rng_kept(), uncounted():  # the agents' networks are host memory, not the planned device's
            return fn(*args, **kwargs)

    return wrapper


@choosing_head(optimal)
@planning_for_free
@_keeps_global_rng
def search(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None, *,
           total_timesteps: int | None = None, seed: int = 0, callback: Callable[[dict], None] | None = None,
           config: PPOConfig | None = None, polish_plan: bool = True, restarts: int | None = None,
           reward_scale: float = 10.0, offload_state: bool | str | Iterable[str] = True,
           step_in_backward: bool = False, strategies: str | Iterable[str] = DEFAULT_STRATEGIES,
           order: str | Sequence[int] = "state", time_limit: float | None = TIME_LIMIT,
           patience: int | None = PATIENCE) -> Plan:
    """Search a plan with the two PPO agents; returns the best feasible plan the agents found (then polished).

    The plan decides per unit its activation strategy (keep, recompute, swap and the swap's timing) and where the
    unit's optimizer state, gradients and parameters live (:attr:`~memopt_nb.core.plan.Plan.placements`).

    Args:
        profile: a :class:`~memopt_nb.core.profile.ModelProfile`.
        budget: bytes, ``"1.5GiB"``, ``"60%"`` of the unoptimized peak, or ``None``: on the profiled device, what it
            can still give the step (its capacity, or :func:`memopt_nb.limit_memory`'s limit, less what live tensors
            outside the step hold: another model, a copy of the parameters; ``plan.meta["budget_source"]`` says how
            much), on a preset its capacity. A budget below the minimum feasible peak raises
            :class:`~memopt_nb.core.errors.BudgetError` before any training.
        device: the device to plan for (default: the profiled one), e.g. ``"a100-40gb"``.
        total_timesteps: PPO environment steps (default :func:`default_timesteps`, more where state may move).
        seed: the same seed gives the same plan.
        callback: called with one history row per PPO iteration (for live widgets).
        config: a full :class:`~memopt_nb.planners.rl.ppo.PPOConfig` (its ``total_timesteps``/``seed`` are overridden
        by the
            arguments above when given). Without one: ``PPOConfig()`` with :func:`default_update_epochs` and, for the
            strategy agent, :func:`default_risk_quantile`.
        polish_plan: run a local search on the agents' best plan (where state may move, also from their activation
            decisions and from keep-all, each with its exact best state placement), then from the plans of the
            classic baselines that fit the budget in this space (:data:`~memopt_nb.planners.polish.HEURISTIC_STARTS`,
            :data:`~memopt_nb.planners.polish.HEURISTIC_ROUNDS` rounds of moves in all); the fastest result wins, the
            agents' on ties.
            What it adds is reported separately.
        restarts: independent agent pairs trained one after the other, each on an equal share of the timesteps
            (default :func:`default_restarts`); the best plan of all of them is returned.
        offload_state: which state the plan may move off the device: ``True`` (optimizer state, gradients and
            parameters; the default), ``False`` (activations only: the plans of the activation-only search), or a set
            of ``"optimizer"``, ``"grads"``, ``"params"`` (also as a comma-separated string). Read by
            :func:`memopt_nb.core.plan.state_choices`; a bad value raises :class:`~memopt_nb.core.errors.PlanError`.
        step_in_backward: also allow ``grads="step"`` (the unit's optimizer step runs in backward, then its gradients
            are freed). Opt-in: under such a plan the loop may no longer accumulate gradients over several backwards
            or clip their global norm. The plan records it (:attr:`~memopt_nb.core.plan.Plan.step_in_backward`).
        strategies: the activation strategies the agents may choose from: a non-empty set of ``"keep"``,
            ``"recompute"``, ``"swap"`` (also as a comma-separated string; order and duplicates do not matter), e.g.
            ``("keep", "recompute")`` for checkpointing only. The other strategies are masked out of the strategy
            agent's actions, the polish never introduces them, and the budget is checked against the floor of this
            space (``solvers.min_peak(..., strategies)``). A unit none of them fits keeps its activations. A bad
            value raises :class:`~memopt_nb.core.errors.PlanError`; the default is all three. ``"recompute_offload"`` is
            opt-in: with it the strategy agent has a fourth strategy, timed by the timing agent like swap. So is
            ``"selective"`` (for a profile made with ``selective=True``): the strategy agent then has one more
            strategy per save-set (masked where the unit does not offer it), and the polish moves between them.
        reward_scale: the factor on both agents' returns (see :mod:`memopt_nb.planners.rl.env`); it sets how large the
        rewards
            are next to PPO's fixed clipping and entropy coefficients.
        order: the order an episode decides the units in (:func:`~memopt_nb.planners.rl.env.decision_order`):
        ``"state"``
            (the default: where state may move, the units with the largest state first; else the model's order),
            ``"forward"`` (the model's order) or a permutation of the units. Which suits a model varies: a ConvNeXt's
            two large last blocks must be decided first, while chains with the step in backward did better forward
            (benchmarks/RESULTS.md). A bad value raises :class:`~memopt_nb.core.errors.PlanError` before any
            training.
        time_limit: seconds the whole search may take, from the call to the polish's end (default :data:`TIME_LIMIT`:
            no limit): the agents stop training, and the polish stops with the plan it has, once it passes. Only the
            work before the agents (the budget check and, on a profile with a chunked head, the choice of its option:
            MILPs bounded by HiGHS's work limits, :func:`~memopt_nb.planners.milp.node_limit`) and a solve under way
            (its wall-clock limit is set to the time left) may run past it. A search the limit cut depends on the
            machine's speed (a loaded machine trains fewer iterations and polishes less) and says so:
            ``meta["cut_by_time_limit"]`` is ``True``, ``meta["stopped"]`` says ``"time limit"`` where it stopped the
            agents and ``meta["polish"]`` ``"cut by the time limit"`` where it stopped the polish. Without a time limit
            nothing depends on the clock: the other stops and the polish count work, not seconds.
        patience: stop an agent pair once its best plan has not become faster by more than :data:`PATIENCE_TOLERANCE`
            in this many PPO iterations (default :data:`PATIENCE`; ``None``: run every timestep). The agents settle
            long before the default number of timesteps on most models, and the polish finishes the plan.

    The plan's ``meta`` holds ``history`` (per iteration: mean episodic return per agent, best step time and peak the
    agents found so far, feasible fraction; ``total_timesteps`` in a row is what PPO really runs — whole iterations —
    not the number asked for, which is ``meta["requested_timesteps"]``), ``timesteps_run``, ``agents_step_time`` and
    ``agents_peak`` (what the agents alone reached), ``decision_order`` (the units in the order the agents decided
    them), ``best_restart`` (the restart whose episode was the agents' best plan), ``polish`` (``"ran"``,
    ``"off"`` or ``"skipped: ..."``), ``polished_step_time`` (``None`` unless the polish ran), ``search_seconds``,
    ``interrupted`` (Ctrl-C returns the best plan so far), ``state_choices`` (the placements the agents could choose
    from; only all-resident when the cost model has no state table), ``allowed_strategies`` (the activation strategies
    searched, as ``optimal`` records them), ``agents_states`` (the agents' placements before the polish) and, where the
    polish started from exact placements, ``polish_placement_budget_solves`` (the MILPs they may solve,
    :data:`~memopt_nb.planners.polish.PLACEMENT_SOLVES`), ``polish_placement_skipped`` (starts left out when they
    ran out; normally 0) and ``polish_placement_stops`` (what ended each of their MILPs,
    :func:`~memopt_nb.planners.milp.stopped_by`: ``"optimal"`` or ``"node_limit"``, the same on every machine, unless
    the wall-clock safety net ``"time_limit"`` was reached); where the polish ran, ``polish_heuristic_starts`` (the
    baselines it also started from),
    ``polish_heuristic_skipped`` and ``polish_heuristic_cut`` (those left out, or polished only until
    :data:`~memopt_nb.planners.polish.HEURISTIC_ROUNDS` ran out; normally none),
    ``stopped`` (why the agents stopped: ``"all timesteps run"``, ``"no better plan in the last N iterations"`` or
    ``"time limit"``), ``cut_by_time_limit`` (``time_limit=`` stopped the agents or the polish: the plan depends on
    the machine's speed), ``polish_heuristic_seconds`` and ``polish_start`` (the start whose polished plan was returned:
    ``"agents"``, ``"agents_placed"``, ``"plain_placed"``, ``"polished_placed"``, one of those three with ``"_again"``
    (see :func:`polish_exact_placements`) or a baseline's name). The plan's own ``predicted_peak_bytes`` /
    ``predicted_step_time`` are the final figures.

    Where no episode of the agents fitted the budget (a tight budget on hundreds of units), the plan they came closest
    with is repaired (:func:`~memopt_nb.planners.polish.repair`: one unit at a time down the peak) and, if it then
    fits, polished as theirs would be: ``meta["agents_found_no_plan"]`` is ``True``, ``repair_moves`` counts the
    moves and ``agents_step_time`` is ``None``. Otherwise (or with ``polish_plan=False``) the least infeasible plan is
    returned flagged, ``meta["no_feasible_plan"]``, with a warning.

    The global torch, NumPy and ``random`` RNG states are left as the search found them.
    """
    if time_limit is not None and not time_limit > 0:
        raise PlanError(f"time_limit must be a positive number of seconds or None, not {time_limit!r}")
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
        raise PlanError(f"patience must be a positive number of PPO iterations or None, not {patience!r}")
    t0 = time.perf_counter()
    task = PlanningTask(profile, budget, device, offload_state=offload_state, step_in_backward=step_in_backward,
                        strategies=strategies)
    cfg = config or PPOConfig(update_epochs=default_update_epochs(task), risk_quantile=default_risk_quantile(task),
                              risk_agents=(STRATEGY,))
    cfg = PPOConfig(**{**cfg.__dict__, "seed": seed,
                       "total_timesteps": total_timesteps or (config.total_timesteps if config else
                                                              default_timesteps(task.n, states=task.C > 1))})
    runs = max(1, int(restarts if restarts is not None else default_restarts(task.n)))
    units_order = decision_order(task, order)  # a bad order is refused here, before any training
    tracker = SearchTracker(task, cfg, runs, t0, callback, order=units_order, time_limit=time_limit,
                            patience=patience)
    make_env = functools.partial(MemoryPlanningEnv, task, reward_scale=reward_scale, order=units_order)
    make_envs = functools.partial(MemoryPlanningEnv.vector, task, reward_scale=reward_scale, order=units_order)
    interrupted = False
    # The networks are tiny: one intra-op thread is fastest, immune to oversubscription, and the same on every
    # machine (so a seed gives the same plan everywhere). The user's setting is restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for k in range(runs):
            tracker.restart = k
            run_cfg = PPOConfig(**{**cfg.__dict__, "seed": seed * 7919 + k,
                                   "total_timesteps": cfg.total_timesteps // runs})
            agents = train(make_envs(run_cfg.num_envs), run_cfg, on_episode=tracker.on_episode,
                           on_iteration=tracker.on_iteration,
                           should_stop=tracker.should_stop)
            _greedy_rollout(make_env, agents, tracker.on_episode)
            if tracker.out_of_time():
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        torch.set_num_threads(threads)
    return _finish(task, tracker, seed=seed, interrupted=interrupted, polish_plan=polish_plan, t0=t0)


class SearchTracker:
    """What the search keeps while the agents train: the best feasible plan, the least infeasible one, the history.

    ``on_episode`` receives every finished episode's info from the environment; ``on_iteration`` receives PPO's stats
    after each update, turns them into a history row (numbered across restarts) and passes it to the user's callback.
    """

    def __init__(self, task: PlanningTask, cfg: PPOConfig, runs: int, t0: float,
                 callback: Callable[[dict], None] | None, order: Sequence[int] | None = None,
                 time_limit: float | None = None, patience: int | None = None) -> None:
        self.task = task
        self.t0 = t0
        self.callback = callback
        self.best: dict[str, Any] = {"time": math.inf, "peak": math.inf, "plan": None, "episode": None,
                                     "restart": None}
        self.least_bad: dict[str, Any] = {"objective": math.inf, "plan": None, "peak": math.inf, "time": math.inf}
        self.history: list[dict[str, Any]] = []
        self.episodes = 0
        self.restart = 0
        #: the units in the order the agents decide them (default: the model's)
        self.order = [int(u) for u in (range(task.n) if order is None else order)]
        self._window = {"episodes": 0, "feasible": 0}  # episodes since the last history row
        self._offset = {"iterations": 0, "steps": 0}  # where the current agent pair's numbering starts
        # What PPO will really run: whole iterations of num_envs x num_steps per agent pair (the progress bar's 100%).
        batch = cfg.num_envs * (cfg.num_steps or task.n + 1)
        self.planned_steps = runs * max(1, (cfg.total_timesteps // runs) // batch) * batch
        self.requested_steps = cfg.total_timesteps
        self.runs = runs
        self.time_limit, self.patience = time_limit, patience
        self.stopped: list[str] = []  # why each agent pair stopped early
        self._mark = math.inf  # the best step time when it last improved by more than PATIENCE_TOLERANCE
        self._improved = False
        self._stale = 0  # iterations of this agent pair since then

    def on_episode(self, info: dict) -> None:
        self.episodes += 1
        self._window["episodes"] += 1
        plan = (info["codes"], info["windows"], info["dists"], info["states"])
        if info["feasible"]:
            self._window["feasible"] += 1
            if info["time"] < self._mark * (1 - PATIENCE_TOLERANCE):
                self._mark, self._improved = info["time"], True
            if info["time"] < self.best["time"]:
                self.best.update(time=info["time"], peak=info["peak"], plan=plan, episode=self.episodes,
                                 restart=self.restart)
        elif info["objective"] < self.least_bad["objective"]:
            self.least_bad.update(objective=info["objective"], plan=plan, peak=info["peak"], time=info["time"])

    def on_iteration(self, stats: dict) -> None:
        history, best, task = self.history, self.best, self.task
        if stats["iteration"] == 1 and history:  # a new agent pair continues the numbering
            self._offset["iterations"] = history[-1]["iteration"]
            self._offset["steps"] = history[-1]["global_step"]
        if stats["iteration"] == 1:
            self._stale = 0
        self._stale = 0 if self._improved else self._stale + 1
        self._improved = False
        row = {
            "iteration": stats["iteration"] + self._offset["iterations"],
            "restart": self.restart,
            "global_step": stats["global_step"] + self._offset["steps"],
            "total_timesteps": self.planned_steps,
            "seconds": time.perf_counter() - self.t0,
            "reward_strategy": stats[f"{STRATEGY}/episodic_return"],
            "reward_timing": stats[f"{TIMING}/episodic_return"],
            "entropy_strategy": stats[f"{STRATEGY}/entropy"],
            "entropy_timing": stats[f"{TIMING}/entropy"],
            "best_step_time": best["time"] if best["plan"] is not None else None,
            "best_peak": best["peak"] if best["plan"] is not None else None,
            "feasible_fraction": self._window["feasible"] / max(self._window["episodes"], 1),
            "budget": task.budget,
            "base_step_time": task.base_time,
            "base_peak": task.base_peak,
        }
        self._window.update(episodes=0, feasible=0)
        history.append(row)
        if self.callback is not None:
            self.callback(row)

    def out_of_time(self) -> bool:
        """Whether the time limit has passed (asked during training and between agent pairs); recorded once."""
        if self.time_limit is None or time.perf_counter() - self.t0 < self.time_limit:
            return False
        if "time limit" not in self.stopped:
            self.stopped.append("time limit")
        return True

    def should_stop(self) -> bool:
        """Asked after each PPO update: the time limit is reached, or the best plan stopped improving."""
        if self.out_of_time():
            return True
        if self.patience is not None and self.best["plan"] is not None and self._stale >= self.patience:
            self.stopped.append(f"no better plan in the last {self.patience} iterations")
            return True
        return False

    def meta(self, interrupted: bool) -> dict[str, Any]:
        """The search's record for the plan's ``meta``."""
        history = self.history
        return {"history": history, "search_seconds": time.perf_counter() - self.t0, "interrupted": interrupted,
                "total_timesteps": self.planned_steps, "requested_timesteps": self.requested_steps,
                "timesteps_run": history[-1]["global_step"] if history else 0, "restarts": self.runs,
                "episodes": self.episodes, "best_episode": self.best["episode"], "base_step_time": self.task.base_time,
                "state_choices": [list(STATE_CHOICES[int(i)]) for i in self.task.state_ids],
                "allowed_strategies": list(self.task.strategies), "decision_order": list(self.order),
                "best_restart": self.best["restart"], "time_limit": self.time_limit, "patience": self.patience,
                "stopped": "; ".join(dict.fromkeys(self.stopped)) or "all timesteps run",
                "cut_by_time_limit": "time limit" in self.stopped}


def _finish(task: PlanningTask, tracker: SearchTracker, *, seed: int, interrupted: bool, polish_plan: bool,
            t0: float) -> Plan:
    """The plan to return: the agents' best feasible one (polished), else their least infeasible one repaired into
    the budget (polished), else that one, flagged."""
    meta = tracker.meta(interrupted)
    best, least_bad = tracker.best, tracker.least_bad
    repaired: dict[str, Any] = {}
    if best["plan"] is None and polish_plan and not interrupted and least_bad["plan"] is not None:
        c, w, d, st, moves, fits = repair(task, *least_bad["plan"])
        if fits:  # polished below as the agents' plan would be; the agents' own time stays None
            repaired = {"agents_found_no_plan": True, "repair_moves": moves}
            best = {"plan": (c, w, d, st), "time": None, "peak": None}
    if best["plan"] is None:
        warnings.warn("the agents found no plan within the budget; returning the least infeasible one, flagged",
                      stacklevel=3)
        if least_bad["plan"] is None:
            least_bad["plan"] = (*option_arrays(task.plain_options()), np.zeros(task.n, dtype=np.int64))
        c, w, d, st = least_bad["plan"]
        return plan_from_arrays(task, c, w, d, st, seed=seed, **meta, no_feasible_plan=True, agents_step_time=None,
                                polished_step_time=None, polish="skipped: no feasible plan")
    c, w, d, st = best["plan"]
    agents_time = best["time"]
    moves = 0
    placement: dict[str, Any] = {}  # what the exact-placement starts of the polish took
    if not polish_plan:
        polish_state = "off"
    elif interrupted:
        polish_state = "skipped: interrupted"
    else:
        deadline = Deadline(tracker.time_limit, t0)  # the search's time limit, from its start
        c, w, d, st, moves = polish(task, c, w, d, st, deadline=deadline)
        placement["polish_start"] = "agents"
        c, w, d, st, moves = polish_exact_placements(task, (c, w, d, st), best["plan"], moves, placement, deadline)
        c, w, d, st, moves = polish_heuristic_starts(task, (c, w, d, st, moves), placement, deadline)
        polish_state = "cut by the time limit" if deadline.cut else "ran"
    plan = plan_from_arrays(task, c, w, d, st, seed=seed, **meta, **repaired,
                            agents_step_time=agents_time, agents_peak=best["peak"],
                            agents_decisions=[int(x) for x in to_options(*best["plan"][:3])],
                            agents_states=[int(x) for x in best["plan"][3]],
                            polished=moves > 0, polish_moves=moves, polish=polish_state, **placement)
    # Only a polish that ran has a step time of its own; the plan's predictions are the one source of the final numbers.
    plan.meta["polished_step_time"] = plan.predicted_step_time if polish_state in ("ran", "cut by the time limit") \
        else None
    plan.meta["cut_by_time_limit"] = meta["cut_by_time_limit"] or polish_state == "cut by the time limit"
    plan.meta["search_seconds"] = time.perf_counter() - t0
    return plan


def _greedy_rollout(make_env: Callable[[], MemoryPlanningEnv], agents: dict,
                    on_episode: Callable[[dict], None]) -> None:
    """One deterministic episode with each agent's most likely action; its plan competes like any other."""
    env = make_env()
    obs, _ = env.reset()
    info: dict = {}
    while env.agents:
        acts = {}
        for a in env.agents:
            x = torch.as_tensor(obs[a]["observation"])[None]
            m = torch.as_tensor(obs[a]["action_mask"])[None]
            with torch.no_grad():
                acts[a] = int(agents[a].greedy(x, m)[0])
        obs, _, _, _, infos = env.step(acts)
        info = infos.get(STRATEGY, info)
    on_episode(info)
