"""memopt_nb — fit a bigger batch or model into the memory you have, from a Jupyter notebook.

``import memopt_nb as memopt``::

    prof = memopt.profile(model, x, loss_fn=loss_fn, optimizer=opt)   # what each unit costs
    p = memopt.search(prof, budget="60%")                             # two PPO agents search a plan
    memopt.simulate(prof, p)                                           # predicted peak and step time
    with memopt.plan(p):                                               # apply it to your own training loop
        ...
    memopt.measure(model, x, loss_fn=loss_fn, optimizer=opt, plan=p)  # what it really uses

In IPython/Jupyter: ``%load_ext memopt_nb`` for the ``%memopt_profile`` and ``%memopt_plan`` magics.
"""

from __future__ import annotations

from typing import Any

from . import distributed, solvers, zoo  # noqa: E402,I001

# NB: `plan` must be bound after `.plan` (the module) is imported, so that `memopt.plan` is the context manager.
from .budget import format_bytes, parse_bytes, resolve_budget
from .device import DeviceSpec
from .errors import BudgetError, MemoptError, PlanError, ProfileError, WrapOrderError
from .evaluate import Evaluation, evaluate
from .maxbatch import MaxBatch, max_batch
from .plan import Decision, Plan
from .profile import ModelProfile, UnitProfile
from .profile import profile as profile
from .rl.search import search
from .runtime.apply import AppliedPlan
from .runtime.apply import plan as plan
from .runtime.limit import MemoryLimit, limit_memory
from .runtime.measure import Measurement, measure
from .runtime.state import StateError, StepInBackwardError
from .simulate import SimResult, Simulator
from .simulate import simulate as simulate

__version__ = "0.1.0"

__all__ = [
    "AppliedPlan", "BudgetError", "Decision", "DeviceSpec", "Evaluation", "Measurement", "MemoptError",
    "ModelProfile", "Plan", "PlanError", "ProfileError", "SimResult", "Simulator", "StateError", "StepInBackwardError",
    "UnitProfile", "WrapOrderError",
    "MaxBatch", "MemoryLimit", "limit_memory", "max_batch",
    "distributed", "evaluate", "format_bytes", "measure", "parse_bytes", "plan", "profile", "resolve_budget", "search",
    "simulate", "solvers", "zoo",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memopt_nb``: register the ``%memopt_*`` magics."""
    from .notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext memopt_nb``: remove the magics again."""
    from .notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)
