"""The dual-agent planner: a PettingZoo environment (:mod:`.env`), CleanRL-style PPO (:mod:`.ppo`) and the search."""
