"""The classic heuristics, each ``name(profile, budget, device=None) -> Plan`` with ``plan.method == name``.

* ``none`` — keep everything (plain training).
* ``recompute_all`` — checkpoint every unit.
* ``sqrt_n`` — Chen et al. (2016) √n checkpointing, at unit granularity: units are split into ⌈√n⌉ contiguous
  segments; the last unit of each segment is kept, the others recomputed. It ignores the budget.
* ``swap_all`` — offload every unit and bring it back on demand, synchronously both ways: what
  ``torch.autograd.graph.save_on_cpu`` does (offload window 0, prefetch distance 0).
* ``selective_layer`` — torchtitan's selective *layer* checkpointing (``ac_freq``): recompute every ``k``-th unit
  (units ``0, k, 2k, …``), keep the others, with the best ``k``: the fastest that fits the budget (without a budget:
  ``k = 2``, torchtitan's common setting; if none fits, the one with the smallest peak, flagged infeasible).
* ``recompute_offload_all`` — every unit recomputed with its inputs offloaded to the host at once and brought back
  on demand (offload window 0, prefetch distance 0): what FairScale's ``checkpoint_wrapper(offload_to_cpu=True)`` or
  ``offload_wrapper(checkpoint_wrapper(m))`` do. Units that cannot be recomputed, or any unit on a device without a host
  link, keep. Its budget check is against the floor of the whole space, recompute_offload included. It is an
  ecosystem baseline: in :data:`BASELINES`, not in :data:`CLASSIC_BASELINES`.
* ``op_sac`` — torchtitan's op-level selective activation checkpointing (``ac_mode="selective"``,
  ``selective_ac_option="op"``): every recomputable unit ``selective`` with the save-set ``"alternate"`` (attention
  kernels and every other matmul, torchtitan's rule) when its profile has it (Pareto or not), else ``"matmuls"``, else
  plain ``recompute``; units that cannot be recomputed keep. It needs a profile made with ``selective=True``
  (:class:`~memopt_nb.core.errors.PlanError` otherwise). Its budget check is against the floor of the whole space. An
  ecosystem baseline.
* ``capuchin`` — a Capuchin-style greedy (Peng et al., ASPLOS 2020): until the budget holds, first swap the units whose
  copies the surrounding compute hides (largest first, with the shortest timing that hides them), then recompute in
  order of memory saved per second of recompute.

Where the optimizer state, gradients and parameters live:

* ``state_offload`` — every unit's optimizer state and gradients offloaded to the host, the step still on the device
  with the user's optimizer (ZeRO-Offload or torchao's ``CPUOffloadOptimizer(offload_gradients=True)``, but stepping
  on the device, so the bits stay identical); activations and parameters stay.
* ``step_in_backward`` — every unit's optimizer step runs inside backward as soon as its gradients are complete, then
  its gradients are freed (PyTorch's optimizer-in-backward tutorial); the plan has ``step_in_backward=True``.
* ``state_offload_recompute``, ``step_in_backward_recompute`` — each of these with every unit recomputed.
* ``offload_everything`` — every unit's optimizer state, gradients and parameters offloaded (ZeRO-Offload's and FSDP2's
  ``CPUOffloadPolicy``'s "everything on the host, always"), activations swap-all or recompute-all, the faster that
  fits (the smaller peak if neither does). A reference for models whose state exceeds the device; in no dict.

A unit for which the placement changes nothing (no parameters) keeps everything resident. These four ignore the
budget; each refuses one below the floor of its own space (the state it may move, every activation strategy).

The classic heuristics decide activations only. They take ``offload_state=`` (and ``step_in_backward=``) as the
planners do: their activation decisions stay their own, and when state may move *and a budget is given* the state
placement is the fastest allowed one that fits the budget with those activations fixed (exact:
:func:`~memopt_nb.planners.milp.place_states`, the MILP with activations fixed; the one with the smallest peak if none
fits). Without a budget everything stays resident. Their default is ``offload_state=False`` — activations only, as
the classic methods were published — so that comparing them with the planners in the enlarged space is asked for
explicitly (``offload_state=True``: the same state options for every method).

A plan that misses its budget is returned with ``feasible=False`` — never silently presented as fitting.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..core.device import DeviceSpec
from ..core.plan import DEFAULT_STRATEGIES, DISTANCES, STATE_CHOICES, STRATEGIES, WINDOWS, Plan
from ..core.space import PlanSpace
from ..sim.simulator import KEEP, RECOMPUTE, RECOMPUTE_OFFLOAD, SWAP, Simulator, code_of
from .checks import check_budget
from .milp import place_states
from .options import OffloadState, as_simulator, check_save_sets, make_plan, uniform_arrays, unit_states

__all__ = ["BASELINES", "CLASSIC_BASELINES", "ECOSYSTEM_BASELINES", "STATE_BASELINES", "capuchin", "none",
           "offload_everything", "op_sac", "recompute_all", "recompute_offload_all", "selective_layer", "sqrt_n",
           "state_offload", "state_offload_recompute", "step_in_backward", "step_in_backward_recompute", "swap_all"]


#: A classic heuristic's rule: ``rule(sim, budget, b) -> ((codes, windows, distances), meta)`` — its activation
#: arrays for the simulator's units, given the budget asked for (``None``: none given) and its value in bytes ``b``.
Rule = Callable[[Simulator, Any, int], tuple[tuple[list, list, list], dict[str, Any]]]


def _classic(name: str, rule: Rule, doc: str, space: Sequence[str] | None = None,
             needs_save_sets: bool = False) -> Callable[..., Plan]:
    """The baseline ``name(profile, budget=None, device=None, *, offload_state=False, step_in_backward=False)``.

    Every classic heuristic does the same around its rule: the budget is checked against the floor of the space its
    actions need (``space``: the default strategies, or ``STRATEGIES`` for one that uses an opt-in strategy), the rule
    decides the activations, and where state may move and a budget is given the placements are the fastest that fit
    with those activations fixed (:func:`~memopt_nb.planners.milp.place_states`)."""

    def baseline(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None, *,
                 offload_state: OffloadState = False, step_in_backward: bool = False) -> Plan:
        sim = as_simulator(profile, device)
        if needs_save_sets:
            check_save_sets(sim, ("selective",))  # PlanError: this profile has no save-sets
        within = PlanSpace.of(space if space is not None else DEFAULT_STRATEGIES, offload_state, step_in_backward)
        b = check_budget(sim, budget, within)
        arrays, meta = rule(sim, budget, b)
        states = None
        if budget is not None:
            states = place_states(sim, b, *arrays, within)
        plan = make_plan(sim, *arrays, budget=b, method=name, states=states, step_in_backward=step_in_backward)
        plan.meta.update(meta)
        return plan

    baseline.__name__ = baseline.__qualname__ = name
    baseline.__doc__ = doc
    return baseline


def _ones(sim: Simulator, codes: list[int]) -> tuple[tuple[list, list, list], dict[str, Any]]:
    return (codes, [1] * sim.n, [1] * sim.n), {}


def _sqrt_n(sim: Simulator, budget: Any, b: int) -> tuple[tuple[list, list, list], dict[str, Any]]:
    n = sim.n
    size = math.ceil(n / max(1, math.ceil(math.sqrt(n))))
    codes = [KEEP if (u + 1) % size == 0 or u == n - 1 else RECOMPUTE for u in range(n)]
    return _ones(sim, [c if (c != RECOMPUTE or sim.recomputable[u]) else KEEP for u, c in enumerate(codes)])


def _op_sac(sim: Simulator, budget: Any, b: int) -> tuple[tuple[list, list, list], dict[str, Any]]:
    codes = []
    for u, up in enumerate(sim.profile.units):
        sets = getattr(up, "save_sets", None) or {}
        name = next((x for x in ("alternate", "matmuls") if x in sets), None)
        if sim.recomputable[u] and name is not None:
            codes.append(code_of("selective", name))
        else:
            codes.append(RECOMPUTE if sim.recomputable[u] else KEEP)
    return _ones(sim, codes)


def _selective_layer(sim: Simulator, budget: Any, b: int) -> tuple[tuple[list, list, list], dict[str, Any]]:
    n = sim.n
    ks = list(range(1, n + 1))
    codes = np.array([[RECOMPUTE if u % k == 0 and sim.recomputable[u] else KEEP for u in range(n)] for k in ks])
    ones = np.ones_like(codes)
    peak, t = sim.evaluate(codes, ones, ones)
    if budget is None:
        i = ks.index(min(2, n))
    elif (peak <= b).any():
        i = int(np.argmin(np.where(peak <= b, t, np.inf)))
    else:
        i = int(np.argmin(peak))
    return (codes[i].tolist(), [1] * n, [1] * n), {"k": ks[i]}


def _capuchin(sim: Simulator, budget: Any, b: int) -> tuple[tuple[list, list, list], dict[str, Any]]:
    n = sim.n
    prof = sim.profile
    codes, windows, dists = [KEEP] * n, [1] * n, [1] * n

    def peak_of(c: list[int], w: list[int], d: list[int]) -> float:
        return float(sim.evaluate(np.array([c]), np.array([w]), np.array([d]))[0][0])

    swap_bytes = np.array([u.interior_bytes + u.input_bytes for u in prof.units], dtype=float)
    fwd = np.array([sim.dur[s] for s in sim.fwd_seg])
    bwd = np.array([sim.dur[s] for s in sim.bwd_seg])
    order = np.argsort(-swap_bytes, kind="stable")
    if peak_of(codes, windows, dists) > b and sim.device.has_host_link:
        for u in order:
            if not sim.swappable[u]:
                continue
            if not sim.device.copy_overlap:
                continue  # copies cost compute time on this device: never hidden
            # what the copy engine spends on the unit's bytes, the slower way (DeviceSpec.copy_seconds); the
            # per-storage part is the training thread's and is never hidden, so it plays no part in choosing a timing
            copy = max(sim.device.copy_seconds(swap_bytes[u], 0, d) for d in ("d2h", "h2d"))
            hidden = None
            for w in WINDOWS[1:]:
                if fwd[u + 1: u + 1 + w].sum() >= copy:
                    for d in DISTANCES[1:]:
                        if bwd[u + 1: u + 1 + d].sum() >= copy:
                            hidden = (w, d)
                            break
                if hidden:
                    break
            if hidden is None:
                continue
            codes[u], windows[u], dists[u] = SWAP, hidden[0], hidden[1]
            if peak_of(codes, windows, dists) <= b:
                break
    if peak_of(codes, windows, dists) > b:
        interior = np.array([u.interior_bytes for u in prof.units], dtype=float)
        msps = interior / np.maximum(fwd, 1e-9)
        for u in np.argsort(-msps, kind="stable"):
            if codes[u] != KEEP or not sim.recomputable[u]:
                continue
            codes[u] = RECOMPUTE
            if peak_of(codes, windows, dists) <= b:
                break
    return (codes, windows, dists), {}



none = _classic("none", lambda sim, budget, b: (uniform_arrays(sim, KEEP), {}), "Plain training: keep every unit.")
recompute_all = _classic("recompute_all", lambda sim, budget, b: (uniform_arrays(sim, RECOMPUTE), {}),
                         "Activation checkpointing of every unit.")
sqrt_n = _classic("sqrt_n", _sqrt_n,
                  "Chen et al. √n rule over units (keeps every ⌈n/⌈√n⌉⌉-th unit, recomputes the rest).")
swap_all = _classic("swap_all", lambda sim, budget, b: (uniform_arrays(sim, SWAP, window=0, distance=0), {}),
                    "Offload every unit, reload on demand (like ``save_on_cpu``).")
recompute_offload_all = _classic(
    "recompute_offload_all", lambda sim, budget, b: (uniform_arrays(sim, RECOMPUTE_OFFLOAD, window=0, distance=0), {}),
    "Recompute every unit and offload its inputs, at once, back on demand (FairScale's "
    "``checkpoint_wrapper(offload_to_cpu=True)``).", space=STRATEGIES)
op_sac = _classic(
    "op_sac", _op_sac, "torchtitan's op-level SAC: every recomputable unit selective with ``\"alternate\"`` (else "
    "``\"matmuls\"``, else plain recompute). Needs a profile made with ``memopt.profile(..., selective=True)``.",
    space=STRATEGIES, needs_save_sets=True)
selective_layer = _classic(
    "selective_layer", _selective_layer, "Recompute every ``k``-th unit (torchtitan's selective layer "
    "checkpointing), the best ``k`` for the budget.\n\n``plan.meta[\"k\"]`` is the chosen frequency (1: every unit "
    "recomputed).")
capuchin = _classic("capuchin", _capuchin,
                    "Capuchin-style greedy: hidden swaps first, then recompute by memory saved per second.")


def _everywhere(profile: Any, budget: Any, device: DeviceSpec | str | None, code: int,
                placement: tuple[str, str, str], method: str) -> Plan:
    """Activation ``code`` and state ``placement`` on every unit that can take them."""
    sim = as_simulator(profile, device)
    stepped = placement[1] == "step"
    space = PlanSpace.of(offload_state=False if stepped else {"optimizer", "grads"}, step_in_backward=stepped)
    b = check_budget(sim, budget, space)
    c = STATE_CHOICES.index(placement)
    offered = unit_states(sim, space)
    states = [c if c in offered[u] else 0 for u in range(sim.n)]
    return make_plan(sim, *uniform_arrays(sim, code), budget=b, method=method, states=states,
                     step_in_backward=stepped)


def state_offload(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Optimizer state and gradients offloaded on every unit, the step on the device (ZeRO-Offload-like)."""
    return _everywhere(profile, budget, device, KEEP, ("offload", "offload", "resident"), "state_offload")


def state_offload_recompute(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """:func:`state_offload` with every unit recomputed."""
    return _everywhere(profile, budget, device, RECOMPUTE, ("offload", "offload", "resident"),
                       "state_offload_recompute")


def step_in_backward(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Every unit's optimizer step inside backward, its gradients freed right after (optimizer-in-backward)."""
    return _everywhere(profile, budget, device, KEEP, ("resident", "step", "resident"), "step_in_backward")


def step_in_backward_recompute(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """:func:`step_in_backward` with every unit recomputed."""
    return _everywhere(profile, budget, device, RECOMPUTE, ("resident", "step", "resident"),
                       "step_in_backward_recompute")


def offload_everything(profile: Any, budget: Any = None, device: DeviceSpec | str | None = None) -> Plan:
    """Every unit's optimizer state, gradients and parameters offloaded (where a unit cannot take that, its optimizer
    state and gradients), activations swap-all or recompute-all: the faster plan that fits, else the smaller peak."""
    sim = as_simulator(profile, device)
    space = PlanSpace.of(offload_state=True)
    b = check_budget(sim, budget, space)
    offered = unit_states(sim, space)
    wanted = [STATE_CHOICES.index(("offload", "offload", "offload")), STATE_CHOICES.index(("offload", "offload",
                                                                                            "resident"))]
    states = [next((c for c in wanted if c in offered[u]), 0) for u in range(sim.n)]
    plans = [make_plan(sim, *uniform_arrays(sim, code), budget=b, method="offload_everything", states=states)
             for code in (SWAP, RECOMPUTE)]
    fit = [p for p in plans if p.feasible]
    return min(fit, key=lambda p: p.predicted_step_time) if fit else min(plans, key=lambda p: p.predicted_peak_bytes)


#: The activation heuristics (they take ``offload_state=``, default ``False``).
CLASSIC_BASELINES = {"none": none, "recompute_all": recompute_all, "sqrt_n": sqrt_n, "swap_all": swap_all,
                     "capuchin": capuchin, "selective_layer": selective_layer}
#: The fixed-state baselines.
STATE_BASELINES = {"state_offload": state_offload, "state_offload_recompute": state_offload_recompute,
                   "step_in_backward": step_in_backward, "step_in_backward_recompute": step_in_backward_recompute}
#: Baselines from the ecosystem that need a strategy outside the default space.
ECOSYSTEM_BASELINES = {"recompute_offload_all": recompute_offload_all, "op_sac": op_sac}
#: Every baseline, ``name(profile, budget, device=None) -> Plan``.
BASELINES = {**CLASSIC_BASELINES, **STATE_BASELINES, **ECOSYSTEM_BASELINES}
