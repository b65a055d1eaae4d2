"""Recompute (activation checkpointing) of one unit, built on non-reentrant ``torch.utils.checkpoint``.

Two things plain checkpointing gets wrong are handled here:

* RNG: ``preserve_rng_state=True`` replays the same dropout masks in the recomputation.
* BatchNorm: recomputing a unit in training mode would update its running statistics a second time. During the
  recomputation the running buffers are swapped for throw-away copies, so they are updated exactly once per forward,
  as without a plan. (Batch statistics, not running ones, normalise in training mode, so outputs are unchanged.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def running_stat_modules(module: nn.Module) -> list[nn.Module]:
    """Submodules whose training-mode forward updates running statistics (BatchNorm and friends)."""
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.running_mean is not None
    ]


@contextlib.contextmanager
def frozen_running_stats(modules: list[nn.Module]) -> Iterator[None]:
    """Let a forward run without touching running statistics (updates go to copies that are thrown away)."""
    saved = []
    for m in modules:
        if not m.training:
            continue
        originals = {name: getattr(m, name) for name in _RUNNING if getattr(m, name, None) is not None}
        for name, buf in originals.items():
            setattr(m, name, buf.clone())
        saved.append((m, originals))
    try:
        yield
    finally:
        for m, originals in saved:
            for name, buf in originals.items():
                setattr(m, name, buf)


def checkpointed_call(module: nn.Module | list[nn.Module], forward: Callable[..., Any], *args: Any,
                      **kwargs: Any) -> Any:
    """Run ``forward(*args, **kwargs)`` under non-reentrant checkpointing with RNG and BatchNorm handled.

    ``module`` is the unit, or its :func:`running_stat_modules` found once beforehand (what a plan does).
    """
    stat_modules = module if isinstance(module, list) else running_stat_modules(module)
    calls = [0]

    def run(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1 or not stat_modules:
            return forward(*a, **k)
        with frozen_running_stats(stat_modules):
            return forward(*a, **k)

    return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
