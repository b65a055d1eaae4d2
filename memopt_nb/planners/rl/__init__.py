"""The dual-agent planner: a PettingZoo environment (:mod:`.env`), CleanRL-style PPO (:mod:`.ppo`) and the search."""

from ..task import PlanningTask
from .env import MemoryPlanningEnv
from .ppo import PPOConfig
from .search import search

__all__ = ["MemoryPlanningEnv", "PPOConfig", "PlanningTask", "search"]
