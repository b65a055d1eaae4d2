"""Applying plans to a live model, and measuring what a training step really uses (the layer above ``core``)."""

__all__ = ["apply", "detect", "distributed", "effects", "foreign", "free", "hooks", "limit", "measure", "memory",
           "movers", "offloaded", "oom", "outside", "recompute", "replay_guard", "selective", "slots", "state",
           "state_errors", "step", "storages", "swap"]
