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

import sys
from typing import Any

from . import planners
from .core import plan as _plan_module
from .core import profile as _profile_data
from .core import progress as _progress
from .core.budget import format_bytes, parse_bytes, resolve_budget
from .core.cuts import merge_units
from .core.device import DeviceSpec
from .core.errors import BudgetError, MemoptError, MemoptWarning, PlanError, ProfileError, WrapOrderError
from .core.plan import Decision, Plan
from .core.profile import ModelProfile, UnitProfile
from .harness import zoo
from .harness.compare import Comparison, compare
from .harness.evaluate import Evaluation, evaluate
from .harness.maxbatch import MaxBatch, max_batch
from .harness.maxmodel import ModelSizes, max_model
from .planners.depths import search_depths
from .planners.rl.search import search
from .profiling import profile as _profile_module
from .profiling.profile import profile
from .runtime import detect as _detect  # noqa: F401 - installs DeviceSpec.detect
from .runtime import distributed
from .runtime.apply import AppliedPlan, plan
from .runtime.head import chunked_cross_entropy
from .runtime.limit import MemoryLimit, limit_memory
from .runtime.measure import Measurement, measure
from .runtime.state import StateError, StepInBackwardError, bring_back
from .sim.simulator import SimResult, Simulator, simulate


# The profile's notebook table quotes the planners' floor, so it is drawn from the notebook layer; the data types
# below it only hold the hook.
def _profile_html(prof: ModelProfile, spelling: str) -> str:
    from .notebook.profile_html import profile_html  # matplotlib and widgets load only when a notebook draws one

    return profile_html(prof, spelling)


_profile_data.set_html_renderer(_profile_html)


# Long calls report their progress (memopt_nb.core.progress); in a Jupyter kernel a bar shows it. The notebook layer
# loads at the first long call, not here, and outside a kernel nothing listens unless MEMOPT_NB_PROGRESS=lines.
def _notebook_progress(event: str, tasks: tuple[_progress.Task, ...]) -> None:
    from .notebook.progress import notebook_listener

    listener = notebook_listener()
    if listener is not None:
        listener(event, tasks)


if _progress.progress_mode() == "lines":
    _progress.set_default_listener(_progress.ProgressLines())
elif _progress.progress_mode() == "auto" and "ipykernel" in sys.modules:
    _progress.set_default_listener(_notebook_progress)

#: ``memopt.solvers`` is the planners' package under the name it had before the layers.
solvers = planners
# Module paths from before the layers keep importing: ``from memopt_nb.core.plan import Plan``,
# ``from memopt_nb.profiling.profile import ModelProfile``, ``from memopt_nb.planners import optimal``. Aliased in
# sys.modules
# (not as attributes), so ``memopt.plan`` and ``memopt.profile`` stay the functions.
sys.modules[__name__ + ".solvers"] = planners
sys.modules[__name__ + ".plan"] = _plan_module
sys.modules[__name__ + ".profile"] = _profile_module

__version__ = "0.1.0"

__all__ = [
    "AppliedPlan", "BudgetError", "Comparison", "Decision", "DeviceSpec", "Evaluation", "MaxBatch", "Measurement",
    "MemoptError", "MemoptWarning", "MemoryLimit", "ModelProfile", "ModelSizes", "Plan", "PlanError",
    "ProfileError", "SimResult", "Simulator", "StateError", "StepInBackwardError", "UnitProfile", "WrapOrderError",
    "bring_back", "chunked_cross_entropy", "compare", "distributed", "evaluate", "format_bytes", "limit_memory",
    "max_batch", "max_model", "measure", "merge_units", "parse_bytes", "plan", "profile", "resolve_budget",
    "search", "search_depths", "simulate", "solvers", "zoo",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext memopt_nb``: register the ``%memopt_*`` magics."""
    from .notebook.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext memopt_nb``: remove the magics again."""
    from .notebook.magics import unload_ipython_extension as _unload

    _unload(ipython)
