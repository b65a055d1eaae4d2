"""What every planner shares: the plan space per unit (:mod:`.space`) and the budget checks against the smallest
reachable peak (:mod:`.milp`, whose minimum that peak is).

The modules depend on each other in one direction only: :mod:`.space` ← :mod:`.milp` ← this module ← the baselines
and the enumerator.
"""

from __future__ import annotations

from .milp import cached_min_peak, check_budget, place_states
from .space import (
    Option,
    allowed_states,
    allowed_strategies,
    as_simulator,
    evaluate_arrays,
    make_plan,
    state_table_of,
    uniform_arrays,
    unit_options,
    unit_states,
)

__all__ = ["Option", "allowed_states", "allowed_strategies", "as_simulator", "cached_min_peak", "check_budget",
           "evaluate_arrays", "make_plan", "place_states", "state_table_of", "uniform_arrays", "unit_options",
           "unit_states"]
