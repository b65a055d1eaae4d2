"""Risk-seeking PPO (``PPOConfig.risk_quantile``): the policy learns from the best episodes of each rollout only, and
``memopt.search`` uses it for the strategy agent where state may move."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from gymnasium import spaces

from memopt_nb.planners.rl.ppo import PPOConfig, SyncVectorEnv, risk_seeking_advantages, train


def test_the_best_share_of_episodes_gets_its_excess_return_and_the_rest_nothing():
    returns = torch.tensor([4.0, 1.0, 3.0, 2.0])
    adv, w = risk_seeking_advantages(returns, 0.5, num_steps=3)
    assert adv.shape == w.shape == (3, 4)
    threshold = torch.quantile(returns, 0.5)  # 2.5
    assert torch.equal(w[0], torch.tensor([1.0, 0.0, 1.0, 0.0]))
    expected = torch.tensor([4.0 - threshold, 0.0, 3.0 - threshold, 0.0]) / returns.std()
    assert torch.allclose(adv, expected.expand(3, 4))
    assert (adv >= 0).all()
    # all episodes alike: nothing to learn from, and no division by zero
    adv, w = risk_seeking_advantages(torch.full((8,), -2.0), 0.25, num_steps=2)
    assert torch.equal(adv, torch.zeros(2, 8)) and w.sum() == 16
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="risk_quantile"):
            risk_seeking_advantages(returns, bad, 1)


class _Bandit:
    """One agent, one-step episodes: arm 0 pays about 0 every time, arm 1 pays -0.5 on average but often much more —
    the arm whose *best* outcomes are best, which a search keeping its best episode wants and ordinary PPO avoids."""

    possible_agents = ["strategy"]

    def __init__(self) -> None:
        self.agents: list[str] = []
        self.rng = np.random.default_rng(0)

    def observation_space(self, agent: str) -> spaces.Space:
        return spaces.Dict({"observation": spaces.Box(-1, 1, (1,), np.float32),
                            "action_mask": spaces.Box(0, 1, (2,), np.int8)})

    def action_space(self, agent: str) -> spaces.Space:
        return spaces.Discrete(2)

    def _obs(self) -> dict:
        return {"strategy": {"observation": np.zeros(1, np.float32), "action_mask": np.ones(2, np.int8)}}

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        return self._obs(), {"strategy": {}}

    def step(self, actions: dict) -> tuple[dict, ...]:
        arm = int(actions["strategy"])
        reward = self.rng.normal(0.0, 0.05) if arm == 0 else self.rng.normal(-0.5, 1.0)
        return (self._obs(), {"strategy": reward}, {"strategy": True}, {"strategy": False},
                {"strategy": {"arm": arm}})


def _bandits(cfg: PPOConfig) -> SyncVectorEnv:
    return SyncVectorEnv(_Bandit, cfg.num_envs, episode_steps=1)


@pytest.mark.slow  # search quality: PPO trained to convergence
@pytest.mark.parametrize("risk", [None, 0.25])
def test_risk_seeking_prefers_the_arm_with_the_best_episodes_and_ordinary_ppo_the_best_mean(risk):
    cfg = PPOConfig(total_timesteps=16 * 60, num_envs=16, num_minibatches=1, seed=3, risk_quantile=risk)
    agent = train(_bandits(cfg), cfg)["strategy"]
    with torch.no_grad():
        p_arm1 = torch.softmax(agent.logits(torch.zeros(1, 1)), -1)[0, 1].item()
    if risk is None:
        assert p_arm1 < 0.2
    else:
        assert p_arm1 > 0.8


def test_wrong_risk_settings_are_refused_before_training():
    calls = []
    with pytest.raises(ValueError, match="num_steps=None"):
        cfg = PPOConfig(total_timesteps=64, risk_quantile=0.25, num_steps=2)
        train(_bandits(cfg), cfg, on_iteration=calls.append)
    with pytest.raises(ValueError, match="risk_quantile"):
        cfg = PPOConfig(total_timesteps=64, risk_quantile=2.0)
        train(_bandits(cfg), cfg, on_iteration=calls.append)
    with pytest.raises(ValueError, match="risk_agents"):
        cfg = PPOConfig(total_timesteps=64, risk_quantile=0.25, risk_agents=("timing",))
        train(_bandits(cfg), cfg, on_iteration=calls.append)
    assert calls == []


@pytest.mark.slow
def test_search_makes_the_strategy_agent_risk_seeking_only_where_state_may_move(monkeypatch):
    from memopt_nb.harness.synthetic import chain_profile

    sm = importlib.import_module("memopt_nb.planners.rl.search")  # the module, not the function
    seen = []
    real_train = sm.train

    def spy(make_env, cfg, **kw):
        seen.append(cfg)
        return real_train(make_env, cfg, **kw)

    monkeypatch.setattr(sm, "train", spy)
    prof = chain_profile(6, seed=6, state_bytes=4 * 2**20)
    sm.search(prof, "70%", "a100-40gb", total_timesteps=2000, seed=0, polish_plan=False)
    assert {(c.risk_quantile, c.risk_agents) for c in seen} == {(sm.RISK_QUANTILE, ("strategy",))}
    seen.clear()
    sm.search(prof, "70%", "a100-40gb", total_timesteps=2000, seed=0, polish_plan=False, offload_state=False)
    assert {c.risk_quantile for c in seen} == {None}
    # without a step count the budget is the larger one where state may move, as before elsewhere
    assert sm.default_timesteps(8, states=True) == 45_000 and sm.default_timesteps(8) == 30_000
    assert sm.default_timesteps(64, states=True) == sm.default_timesteps(64) == 97_500
