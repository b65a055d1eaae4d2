"""Applying plans to a live model, and measuring what a training step really uses."""
