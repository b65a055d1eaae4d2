"""Planners with one interface, ``name(profile, budget, device=None) -> Plan``: the exact optimum and the baselines.

``budget`` is bytes, a string such as ``"1.5GiB"``, or a percentage of the unoptimized peak (``"60%"``); ``None``
means the device's capacity. A budget below :func:`min_peak` raises :class:`~memopt_nb.core.errors.BudgetError` naming
the smallest feasible peak.

The space searched: per unit an activation strategy (``strategies=``; default
:data:`~memopt_nb.core.plan.DEFAULT_STRATEGIES`, keep / recompute / swap: ``"recompute_offload"`` and ``"selective"``
are opt-in, or ``plan.STRATEGIES`` for all) and where its optimizer state, gradients and
parameters live (``offload_state=``: ``True`` — any of them may be offloaded, the default for :func:`optimal` and
:func:`min_peak`; ``False`` — activations only; or a set of ``"optimizer"``, ``"grads"``, ``"params"``).
``step_in_backward=True`` also lets units step inside backward (opt-in: the loop may then neither accumulate nor clip
gradients). The classic baselines default to ``offload_state=False`` (see :mod:`.baselines`).
"""

from __future__ import annotations

from .baselines import (
    BASELINES,
    CLASSIC_BASELINES,
    STATE_BASELINES,
    capuchin,
    none,
    offload_everything,
    op_sac,
    recompute_all,
    recompute_offload_all,
    selective_layer,
    sqrt_n,
    state_offload,
    state_offload_recompute,
    step_in_backward,
    step_in_backward_recompute,
    swap_all,
)
from .brute import brute_force
from .milp import min_peak, place_states
from .optimal import optimal

__all__ = ["BASELINES", "CLASSIC_BASELINES", "STATE_BASELINES", "brute_force", "capuchin", "min_peak", "none",
           "offload_everything", "op_sac", "optimal", "place_states", "recompute_all", "recompute_offload_all",
           "selective_layer", "sqrt_n",
           "state_offload", "state_offload_recompute", "step_in_backward", "step_in_backward_recompute", "swap_all"]
