"""Planners with one interface, ``name(profile, budget, device=None) -> Plan``: the exact optimum and the baselines.

``budget`` is bytes, a string such as ``"1.5GiB"``, or a percentage of the unoptimized peak (``"60%"``); ``None``
means the device's capacity. A budget below :func:`min_peak` raises :class:`~memopt_nb.errors.BudgetError` naming the
smallest feasible peak.

The space searched: per unit an activation strategy (``strategies=``; default
:data:`~memopt_nb.plan.DEFAULT_STRATEGIES`, keep / recompute / swap: ``"recompute_offload"`` and ``"selective"`` are
opt-in, or ``plan.STRATEGIES`` for all) and where its optimizer state, gradients and
parameters live (``offload_state=``: ``True`` — any of them may be offloaded, the default for :func:`optimal` and
:func:`min_peak`; ``False`` — activations only; or a set of ``"optimizer"``, ``"grads"``, ``"params"``).
``step_in_backward=True`` also lets units step inside backward (opt-in: the loop may then neither accumulate nor clip
gradients). The classic baselines default to ``offload_state=False`` (see :mod:`.baselines`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ..device import DeviceSpec
from ..plan import DEFAULT_STRATEGIES
from .baselines import (
    BASELINES,
    CLASSIC_BASELINES,
    STATE_BASELINES,
    capuchin,
    none,
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
from .common import allowed_strategies, as_simulator, cached_min_peak
from .milp import optimal, place_states


def min_peak(profile: Any, device: DeviceSpec | str | None = None,
             strategies: str | Sequence[str] = DEFAULT_STRATEGIES, *,
             offload_state: bool | str | Iterable[str] = True, step_in_backward: bool = False) -> int:
    """The smallest peak memory (bytes) any plan reaches for ``profile`` on ``device``, using only ``strategies`` for
    activations (a non-empty set of keep, recompute, swap, recompute_offload, selective, else
    :class:`~memopt_nb.errors.PlanError`; default keep, recompute, swap; selective needs a profile made with
    ``selective=True``) and moving only the state ``offload_state`` allows (``False``: activations only)."""
    return cached_min_peak(as_simulator(profile, device), allowed_strategies(strategies), offload_state=offload_state,
                           step_in_backward=step_in_backward)


__all__ = ["BASELINES", "CLASSIC_BASELINES", "STATE_BASELINES", "brute_force", "capuchin", "min_peak", "none",
           "op_sac", "optimal", "place_states", "recompute_all", "recompute_offload_all", "selective_layer", "sqrt_n",
           "state_offload", "state_offload_recompute", "step_in_backward", "step_in_backward_recompute", "swap_all"]
