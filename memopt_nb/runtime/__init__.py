"""Applying plans to a live model, and measuring what a training step really uses."""

__all__ = ["apply", "hooks", "measure", "memory", "recompute", "state", "step", "storages", "swap"]
