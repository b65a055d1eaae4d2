"""Proximal Policy Optimization for the two planning agents, written in the manner of CleanRL's ``ppo.py``.

One actor-critic per agent: the strategy and timing agents see different observations and choose from different
action sets, so a shared network would only have to learn to tell them apart. Each is trained on its own (difference)
reward by the same loop: rollouts from ``num_envs`` copies of the environment, GAE, clipped policy and value losses, an
entropy bonus, masked logits, Adam. Two departures from CleanRL: where the environment says what its actions are made
of (``action_parts``), the actor scores the parts and an action's logit is the sum of its parts' (:class:`Agent`); and
with ``risk_quantile`` the policy learns only from the best episodes of each rollout (the risk-seeking policy gradient
of Petersen et al., "Deep symbolic regression", ICLR 2021; :func:`risk_seeking_advantages`), for searches that keep
the best episode they see rather than the policy's average one.
No SuperSuit, no argument parsing: construct :class:`PPOConfig` directly.

Randomness comes only from a ``torch.Generator`` and a NumPy generator seeded with ``config.seed``, so a search is
reproducible and leaves the global RNG of the user's session untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

__all__ = ["PPOConfig", "Agent", "layer_init", "compute_gae", "risk_seeking_advantages", "ppo_losses", "update_agent",
           "train"]


@dataclass
class PPOConfig:
    total_timesteps: int = 60_000
    """total environment steps, summed over the vectorized copies"""
    learning_rate: float = 1e-3
    """Adam learning rate of both agents (CleanRL's default, 2.5e-4, learns too slowly in the ~100 updates a search
    runs)"""
    num_envs: int = 16
    """number of environment copies stepped together"""
    num_steps: int | None = None
    """steps per copy per rollout; ``None`` means one episode (units + 1 steps)"""
    anneal_lr: bool = True
    """anneal the learning rate linearly to zero over the run"""
    gamma: float = 1.0
    """discount factor (episodes are short and the objective is their total cost)"""
    gae_lambda: float = 0.95
    """lambda of generalized advantage estimation"""
    num_minibatches: int = 4
    """minibatches per update epoch"""
    update_epochs: int = 4
    """epochs over each rollout (``search`` without a config takes 8 where recompute_offload or selective may be
    chosen: :func:`~memopt_nb.planners.rl.search.default_update_epochs`)"""
    norm_adv: bool = True
    """normalize advantages within a minibatch"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient"""
    clip_vloss: bool = True
    """clip the value loss as in the PPO paper"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clip"""
    target_kl: float | None = None
    """stop an update early when the approximate KL exceeds this"""
    hidden: int = 64
    """width of the two hidden layers of actor and critic"""
    score_parts: bool = True
    """score the parts actions are made of, where the environment names them (``action_parts``; see :class:`Agent`),
    rather than each action on its own"""
    risk_quantile: float | None = None
    """risk-seeking: each agent's policy learns only from the best ``risk_quantile`` share of the rollout's episodes
    (by that agent's return), each of their steps with the advantage (episode return − the share's threshold) / the
    returns' standard deviation (:func:`risk_seeking_advantages`); the other episodes still train the critic, which
    then only reports. Needs one episode per environment copy per rollout (``num_steps=None``). ``None``: ordinary
    PPO (GAE advantages, normalized per minibatch)"""
    risk_agents: tuple[str, ...] | None = None
    """the agents ``risk_quantile`` applies to (``None``: all); the others learn by ordinary PPO"""
    seed: int = 0
    """seed of every random choice (initialization, sampling, minibatch order)"""


def layer_init(layer: nn.Linear, std: float, gen: torch.Generator, bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std, generator=gen)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Actor and critic MLPs (tanh), CleanRL's initialization: √2 hidden, 0.01 actor head, 1.0 critic head.

    With ``parts`` (a 0/1 matrix, actions × parts, from the environment's :meth:`action_parts`) the actor's head scores
    the *parts* an action is made of and an action's logit is the sum of its parts' scores: a strategy-and-placement
    action is "recompute" + "optimizer state offloaded" + "gradients resident" + ..., so what the agent learns about
    one part carries over to every action that has it (with one logit per action, each of the 24 combinations of a
    unit would have to be learned on its own). The distribution is still over whole actions, masked.
    """

    def __init__(self, obs_dim: int, n_actions: int, hidden: int, gen: torch.Generator,
                 parts: np.ndarray | None = None) -> None:
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden), np.sqrt(2), gen), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden), np.sqrt(2), gen), nn.Tanh(),
            layer_init(nn.Linear(hidden, 1), 1.0, gen),
        )
        if parts is not None and parts.shape[0] != n_actions:
            raise ValueError(f"parts has {parts.shape[0]} rows for {n_actions} actions")
        n_out = n_actions if parts is None else parts.shape[1]
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_dim, hidden), np.sqrt(2), gen), nn.Tanh(),
            layer_init(nn.Linear(hidden, hidden), np.sqrt(2), gen), nn.Tanh(),
            layer_init(nn.Linear(hidden, n_out), 0.01, gen),
        )
        # (parts, actions): the actor's part scores times this are the action logits
        self.register_buffer("parts", None if parts is None else torch.as_tensor(parts, dtype=torch.float32).T)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = self.actor(x)
        return out if self.parts is None else out @ self.parts

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, mask: torch.Tensor, action: torch.Tensor | None = None,
                             gen: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        logits = self.logits(x).masked_fill(mask == 0, -1e9)
        logp_all = torch.log_softmax(logits, dim=-1)
        probs = logp_all.exp()
        if action is None:
            action = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        logprob = logp_all.gather(-1, action.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(probs * logp_all).sum(-1)
        return action, logprob, entropy, self.critic(x).squeeze(-1)

    def greedy(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.logits(x).masked_fill(mask == 0, -1e9).argmax(-1)


def compute_gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor,
                next_done: torch.Tensor, gamma: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over a ``(num_steps, num_envs)`` rollout; returns (advantages, returns).

    ``dones[t]`` flags that the observation at step ``t`` starts a new episode; ``next_value``/``next_done`` are the
    value and flag of the observation after the last step (bootstrapping across the rollout's end).
    """
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
        advantages[t] = lastgaelam
    return advantages, advantages + values


def risk_seeking_advantages(episode_returns: torch.Tensor, quantile: float,
                            num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and policy-loss weights, both ``(num_steps, num_envs)``, of the risk-seeking policy gradient for a
    rollout holding one episode per environment copy (``episode_returns``: ``(num_envs,)``).

    The episodes whose return reaches the ``1 − quantile`` quantile of the rollout's returns get weight 1 and, at
    every step, the advantage ``(return − quantile threshold) / std(returns)`` (zero where all returns are equal); the
    others get weight 0 and advantage 0. The advantages are never negative: the policy is pulled towards its best
    episodes and nothing pushes it away from the rest, so it keeps exploring around its best plan instead of settling
    on a safe average one.
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"risk_quantile={quantile!r}: expected a share of the episodes in (0, 1], e.g. 0.25")
    threshold = torch.quantile(episode_returns, 1.0 - quantile)
    weight = (episode_returns >= threshold).float()
    spread = episode_returns.std() if episode_returns.numel() > 1 else episode_returns.new_tensor(0.0)
    adv = torch.where(spread > 0, (episode_returns - threshold) / spread.clamp_min(1e-12), torch.zeros(()))
    adv = adv * weight
    return adv.expand(num_steps, -1).clone(), weight.expand(num_steps, -1).clone()


def ppo_losses(agent: Agent, config: PPOConfig, obs: torch.Tensor, mask: torch.Tensor, actions: torch.Tensor,
               old_logprobs: torch.Tensor, advantages: torch.Tensor, returns: torch.Tensor,
               old_values: torch.Tensor, weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The clipped PPO objective on one minibatch: ``loss`` plus its parts and the diagnostics CleanRL logs.

    ``weights`` (risk-seeking, see :func:`risk_seeking_advantages`): the policy loss is the weighted mean over the
    minibatch and the advantages are used as given; without them, CleanRL's mean with normalized advantages."""
    _, newlogprob, entropy, newvalue = agent.get_action_and_value(obs, mask, actions)
    logratio = newlogprob - old_logprobs
    ratio = logratio.exp()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - logratio).mean()
        clipfrac = ((ratio - 1.0).abs() > config.clip_coef).float().mean()
    if weights is None and config.norm_adv and advantages.numel() > 1:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    # policy loss
    pg_terms = torch.max(-advantages * ratio,
                         -advantages * torch.clamp(ratio, 1 - config.clip_coef, 1 + config.clip_coef))
    pg_loss = pg_terms.mean() if weights is None else (weights * pg_terms).sum() / weights.sum().clamp_min(1.0)
    # value loss
    if config.clip_vloss:
        v_unclipped = (newvalue - returns) ** 2
        v_clipped = old_values + torch.clamp(newvalue - old_values, -config.clip_coef, config.clip_coef)
        v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - returns) ** 2).mean()
    else:
        v_loss = 0.5 * ((newvalue - returns) ** 2).mean()
    entropy_loss = entropy.mean()
    loss = pg_loss - config.ent_coef * entropy_loss + v_loss * config.vf_coef
    return {"loss": loss, "pg_loss": pg_loss, "v_loss": v_loss, "entropy": entropy_loss, "approx_kl": approx_kl,
            "clipfrac": clipfrac}


def update_agent(agent: Agent, optimizer: torch.optim.Optimizer, config: PPOConfig, buf: dict[str, torch.Tensor],
                 advantages: torch.Tensor, returns: torch.Tensor, rng: np.random.Generator,
                 minibatch_size: int, weights: torch.Tensor | None = None) -> dict[str, float]:
    """``config.update_epochs`` epochs of minibatch PPO updates of one agent on its rollout; returns the last stats.
    ``weights``: the risk-seeking policy-loss weights, shaped like the rewards (see :func:`ppo_losses`)."""
    batch_size = buf["rewards"].numel()
    b_obs = buf["obs"].reshape(batch_size, -1)
    b_mask = buf["mask"].reshape(batch_size, -1)
    b_actions = buf["actions"].reshape(-1)
    b_logprobs = buf["logprobs"].reshape(-1)
    b_adv = advantages.reshape(-1)
    b_returns = returns.reshape(-1)
    b_values = buf["values"].reshape(-1)
    b_weights = None if weights is None else weights.reshape(-1)
    clipfracs = []
    for _epoch in range(config.update_epochs):
        order = rng.permutation(batch_size)
        for lo in range(0, batch_size, minibatch_size):
            mb = torch.as_tensor(order[lo: lo + minibatch_size])
            out = ppo_losses(agent, config, b_obs[mb], b_mask[mb], b_actions[mb], b_logprobs[mb], b_adv[mb],
                             b_returns[mb], b_values[mb], None if b_weights is None else b_weights[mb])
            clipfracs.append(out["clipfrac"].item())
            optimizer.zero_grad()
            out["loss"].backward()
            nn.utils.clip_grad_norm_(agent.parameters(), config.max_grad_norm)
            optimizer.step()
        if config.target_kl is not None and out["approx_kl"] > config.target_kl:
            break
    return {"policy_loss": float(out["pg_loss"].item()), "value_loss": float(out["v_loss"].item()),
            "entropy": float(out["entropy"].item()), "approx_kl": float(out["approx_kl"].item()),
            "clipfrac": float(np.mean(clipfracs)) if clipfracs else 0.0}


class SyncVectorEnv:
    """``num_envs`` copies of a PettingZoo parallel environment, reset and stepped together: what :func:`train` steps
    (CleanRL's ``gym.vector.SyncVectorEnv``, for PettingZoo's parallel API).

    ``episode_steps``: the length of every episode, where all have one (the rollout then holds whole episodes by
    default); a subclass may step its copies together faster (:meth:`step`) or name each action's parts for the
    agents to score (:meth:`action_parts`).
    """

    def __init__(self, make_env: Callable[[], Any], num_envs: int, episode_steps: int | None = None) -> None:
        self.envs = [make_env() for _ in range(num_envs)]
        self.num_envs = num_envs
        self.episode_steps = episode_steps
        self.possible_agents = list(self.envs[0].possible_agents)

    def observation_space(self, agent: str) -> Any:
        return self.envs[0].observation_space(agent)

    def action_space(self, agent: str) -> Any:
        return self.envs[0].action_space(agent)

    def action_parts(self, agent: str) -> np.ndarray | None:
        """Per action the parts it is made of (see :class:`Agent`), or ``None``: every action scored on its own."""
        return None

    def reset(self, seed: int) -> list[dict]:
        """Every copy's first observations; copy ``i`` is seeded ``seed + i``."""
        return [env.reset(seed=seed + i)[0] for i, env in enumerate(self.envs)]

    def reset_one(self, i: int) -> dict:
        """Copy ``i``'s first observations of its next episode (its random stream goes on)."""
        return self.envs[i].reset()[0]

    def step(self, actions: list[dict[str, int]]) -> list[tuple[dict, ...]]:
        """``env.step`` of each copy with its actions: ``(obs, rewards, terminations, truncations, infos)`` each."""
        return [env.step(a) for env, a in zip(self.envs, actions, strict=True)]


def train(envs: SyncVectorEnv, config: PPOConfig, on_episode: Callable[[dict], None] | None = None,
          on_iteration: Callable[[dict], None] | None = None,
          should_stop: Callable[[], bool] | None = None) -> dict[str, Agent]:
    """Train one agent per PettingZoo agent of the environment ``envs`` holds copies of, with PPO; returns them.

    ``on_episode(info)`` receives each finished episode's info (of the first agent); ``on_iteration(stats)`` is called
    after each update with mean episodic returns per agent and the losses. Raising in a callback stops training;
    ``should_stop()``, asked after each update, ends it early and still returns the agents.

    CleanRL's shape, read top to bottom: setup here, then per iteration the rollout (:func:`_rollout`) and per agent
    GAE and the update (:func:`_update_agents`).
    """
    # ---- seeding: every random draw comes from these two generators
    gen = torch.Generator().manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)

    # ---- env setup
    names = list(envs.possible_agents)
    num_steps = _check_setup(envs, config, names)
    batch_size = config.num_envs * num_steps
    minibatch_size = max(1, batch_size // config.num_minibatches)
    num_iterations = max(1, config.total_timesteps // batch_size)
    E = config.num_envs

    # ---- agent setup: one actor-critic and one Adam per agent (scoring the actions' parts where the env names them)
    agents = {a: Agent(envs.observation_space(a)["observation"].shape[0], envs.action_space(a).n, config.hidden, gen,
                       envs.action_parts(a) if config.score_parts else None) for a in names}
    optims = {a: torch.optim.Adam(agents[a].parameters(), lr=config.learning_rate, eps=1e-5) for a in names}

    # ---- storage setup
    current = envs.reset(seed=config.seed)
    next_obs, next_mask = _stack(current, names)
    roll = _Rollout(current=current, next_obs=next_obs, next_mask=next_mask, next_done=torch.zeros(E),
                    ep_return={a: np.zeros(E) for a in names})
    buf = {a: {
        "obs": torch.zeros((num_steps, E, next_obs[a].shape[1])),
        "mask": torch.zeros((num_steps, E, next_mask[a].shape[1]), dtype=torch.int8),
        "actions": torch.zeros((num_steps, E), dtype=torch.long),
        "logprobs": torch.zeros((num_steps, E)),
        "rewards": torch.zeros((num_steps, E)),
        "values": torch.zeros((num_steps, E)),
        "dones": torch.zeros((num_steps, E)),
    } for a in names}
    start = time.perf_counter()
    for iteration in range(1, num_iterations + 1):
        # ---- learning-rate annealing
        if config.anneal_lr:
            frac = 1.0 - (iteration - 1.0) / num_iterations
            for opt in optims.values():
                opt.param_groups[0]["lr"] = frac * config.learning_rate
        finished = _rollout(envs, agents, buf, roll, names, num_steps, gen, on_episode)
        stats: dict[str, Any] = {"iteration": iteration, "global_step": roll.global_step,
                                 "sps": int(roll.global_step / max(time.perf_counter() - start, 1e-9))}
        _update_agents(agents, optims, config, buf, roll, finished, rng, minibatch_size, num_steps, stats)
        if on_iteration is not None:
            on_iteration(stats)
        if should_stop is not None and should_stop():
            break
    return agents


def _check_setup(envs: SyncVectorEnv, config: PPOConfig, names: list[str]) -> int:
    """The rollout length; a ``ValueError`` saying what to change where ``config`` does not fit ``envs``."""
    if envs.num_envs != config.num_envs:
        raise ValueError(f"config.num_envs is {config.num_envs}, but envs holds {envs.num_envs} copies")
    num_steps = config.num_steps or envs.episode_steps
    if not num_steps:
        raise ValueError("set config.num_steps: the environment's episodes have no one length (envs.episode_steps)")
    if config.risk_quantile is not None:
        if config.num_steps is not None:
            raise ValueError("risk_quantile needs one episode per environment copy per rollout: leave num_steps=None")
        risk_seeking_advantages(torch.zeros(1), config.risk_quantile, 1)  # a wrong quantile is refused here
        unknown = set(config.risk_agents or ()) - set(names)
        if unknown:
            raise ValueError(f"risk_agents names {sorted(unknown)}; the environment's agents are {names}")
    return num_steps


def _stack(obs_list: list[dict], names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per agent, the copies' observations and action masks stacked."""
    o = {a: torch.as_tensor(np.stack([ob[a]["observation"] for ob in obs_list])) for a in names}
    m = {a: torch.as_tensor(np.stack([ob[a]["action_mask"] for ob in obs_list])) for a in names}
    return o, m


@dataclass
class _Rollout:
    """What carries over from one rollout to the next: the copies' current observations, the episodes' returns so
    far, and the steps taken."""

    current: list[dict]
    next_obs: dict[str, torch.Tensor]
    next_mask: dict[str, torch.Tensor]
    next_done: torch.Tensor
    ep_return: dict[str, np.ndarray]
    global_step: int = 0


def _rollout(envs: SyncVectorEnv, agents: dict[str, Agent], buf: dict[str, dict[str, torch.Tensor]], roll: _Rollout,
             names: list[str], num_steps: int, gen: torch.Generator,
             on_episode: Callable[[dict], None] | None) -> dict[str, list[float]]:
    """Both agents act at every step of every env copy for ``num_steps`` steps, filling ``buf``; per agent, the
    returns of the episodes that finished."""
    E, first = envs.num_envs, names[0]
    finished: dict[str, list[float]] = {a: [] for a in names}
    for step in range(num_steps):
        roll.global_step += E
        acts = {}
        for a in names:
            b = buf[a]
            b["obs"][step] = roll.next_obs[a]
            b["mask"][step] = roll.next_mask[a]
            b["dones"][step] = roll.next_done
            with torch.no_grad():
                action, logprob, _, value = agents[a].get_action_and_value(roll.next_obs[a], roll.next_mask[a],
                                                                           gen=gen)
            b["actions"][step], b["logprobs"][step], b["values"][step] = action, logprob, value
            acts[a] = action.numpy()
        dones = np.zeros(E)
        step_acts = [{a: int(acts[a][i]) for a in names} for i in range(E)]
        results = envs.step(step_acts)
        for i in range(E):
            obs_i, rew_i, term_i, trunc_i, info_i = results[i]
            for a in names:
                buf[a]["rewards"][step, i] = float(rew_i[a])
                roll.ep_return[a][i] += float(rew_i[a])
            if term_i[first] or trunc_i[first]:
                dones[i] = 1.0
                for a in names:
                    finished[a].append(roll.ep_return[a][i])
                    roll.ep_return[a][i] = 0.0
                if on_episode is not None:
                    on_episode(info_i[first])
                obs_i = envs.reset_one(i)
            roll.current[i] = obs_i
        roll.next_obs, roll.next_mask = _stack(roll.current, names)
        roll.next_done = torch.as_tensor(dones, dtype=torch.float32)
    return finished


def _update_agents(agents: dict[str, Agent], optims: dict[str, torch.optim.Optimizer], config: PPOConfig,
                   buf: dict[str, dict[str, torch.Tensor]], roll: _Rollout, finished: dict[str, list[float]],
                   rng: np.random.Generator, minibatch_size: int, num_steps: int, stats: dict[str, Any]) -> None:
    """Per agent: bootstrap value and GAE, then the policy and value update; its figures go into ``stats``."""
    for a in agents:
        b = buf[a]
        # ---- bootstrap value and GAE
        with torch.no_grad():
            next_value = agents[a].get_value(roll.next_obs[a]).reshape(1, -1)
            advantages, returns = compute_gae(b["rewards"], b["values"], b["dones"], next_value, roll.next_done,
                                              config.gamma, config.gae_lambda)
        weights = None
        if config.risk_quantile is not None and (config.risk_agents is None or a in config.risk_agents):
            if not bool(roll.next_done.all()) or bool(b["dones"][1:].any()):
                raise RuntimeError("risk_quantile: a rollout did not hold exactly one episode per copy (the "
                                   "environment's episodes must all be envs.episode_steps long)")
            advantages, weights = risk_seeking_advantages(b["rewards"].sum(0), config.risk_quantile, num_steps)
        # ---- optimize the policy and value networks
        update = update_agent(agents[a], optims[a], config, b, advantages, returns, rng, minibatch_size, weights)
        # ---- logging
        stats[f"{a}/episodic_return"] = float(np.mean(finished[a])) if finished[a] else float("nan")
        for key, value in update.items():
            stats[f"{a}/{key}"] = value
