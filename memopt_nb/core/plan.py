"""A plan: for every unit a strategy (keep, recompute, swap, recompute_offload, selective), for swaps its timing, and
where its state lives. The strategies and placements themselves are declared in :mod:`memopt_nb.core.strategies`.

A :class:`Plan` is plain data. It knows the units it was made for (a fingerprint of names, module types and parameter
shapes), the budget and device it targets, who made it and what the simulator predicted. It saves to versioned JSON and
refuses to be applied to a model it was not made for.

``recompute_offload`` recomputes the unit like ``recompute`` and, instead of keeping the unit's inputs on the device
for the recomputation, offloads them to the host like ``swap`` offloads saved tensors (a storage something else still
holds, the caller's batch say, stays). It is opt-in: planners search :data:`DEFAULT_STRATEGIES` unless given
``strategies=``.

Timing of a swapped (or ``recompute_offload``) unit ``i`` (both are counted in units):

* ``offload_window`` ``w`` — the copy of unit ``i``'s saved tensors to host starts as soon as they are no longer needed
  on the device by anything else (for a unit's internal tensors: right after its forward) and may overlap the next
  ``w`` unit forwards; the device copy is freed before the forward after those. ``w = 0`` makes the offload
  synchronous. (With one first-in-first-out copy engine per direction, starting a copy later can never finish any copy
  sooner, so the useful knob is how long the copy may take before its memory must be back: the window.)
* ``prefetch_distance`` ``d`` — the copy back starts when backward reaches unit ``i + d`` (``d = 0``: when unit ``i``
  itself is reached, i.e. on demand). Prefetches are issued in the order backward needs them, so a unit's prefetch never
  starts before that of a unit after it; :func:`effective_triggers` applies that rule.

Where a unit's training state lives (schema 2; a schema-1 plan loads with everything ``"resident"``):

* ``optimizer`` — ``"resident"``, ``"offload"`` or ``"stream"``: the unit's optimizer state lives on the host between
  steps. ``"offload"`` brings it back unit by unit for the step (which still runs on the device, with the user's
  optimizer); ``"stream"`` brings it back one parameter at a time (the next one's on its way while one steps), so the
  step holds at most two of the unit's parameters' state instead of all of it (torchao's and ZeRO-Offload's grain).
* ``grads`` — ``"resident"``, ``"offload"`` (copied to the host as soon as backward has accumulated them, brought back
  for the step) or ``"step"`` (the unit's optimizer step runs inside backward, then its gradients are freed; only in a
  plan made with ``step_in_backward=True``, because it changes what the training loop may do).
* ``params`` — ``"resident"`` or ``"offload"``: parameters live on the host and are fetched for the unit's forward
  and its backward.

:data:`STATE_CHOICES` lists every combination (all-resident first); :func:`state_choices` is the subset a planner may
use for an ``offload_state=`` argument.
"""

from __future__ import annotations

import dataclasses
import html
import json
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .budget import format_bytes
from .errors import PlanError
from .fingerprint import (
    _check_model_fingerprint,
    _check_unit_fingerprint,
    _fingerprint_matches,
    _fingerprint_mismatch,
    _model_differences,
    model_fingerprint,
    optimizer_differences,
    optimizer_fingerprint,
    plain_module_type,
    unit_fingerprint,
)
from .strategies import (
    DEFAULT_STRATEGIES,
    DISTANCES,
    GRAD_PLACES,
    OFFLOADING,
    OPTIMIZER_PLACES,
    PARAM_PLACES,
    PLACE_OF,
    RECOMPUTING,
    REGISTRY,
    SAVE_SETS,
    STATE_CHOICES,
    STATE_PIECES,
    STRATEGIES,
    WINDOWS,
    by_name,
)

__all__ = ["DEFAULT_STRATEGIES", "DISTANCES", "Decision", "FORMAT", "GRAD_PLACES", "MAX_TIMING", "OFFLOADING",
           "OPTIMIZER_PLACES", "PARAM_PLACES", "Plan", "RECOMPUTING", "SAVE_SETS", "SCHEMA_VERSION", "STATE_CHOICES",
           "STATE_PIECES", "STRATEGIES", "WINDOWS", "effective_triggers", "model_fingerprint",
           "optimizer_differences", "optimizer_fingerprint", "plain_module_type", "selective_decision",
           "state_choices", "unit_fingerprint", "with_profile_facts"]

SCHEMA_VERSION = 2
FORMAT = "memopt_nb.plan"
MAX_TIMING = 64


@dataclass(frozen=True)
class Decision:
    """What to do with one unit.

    Attributes:
        unit: qualified module name (as in ``model.named_modules()``).
        strategy: ``"keep"`` (default autograd), ``"recompute"`` (activation checkpointing), ``"swap"`` (offload the
            unit's saved tensors to host memory, bring them back in backward), ``"recompute_offload"`` (recompute,
            with the inputs the recomputation needs offloaded to host memory and brought back in backward) or
            ``"selective"`` (recompute, but keep the outputs of the ops in ``save_ops``: selective checkpointing).
        offload_window: for swap and recompute_offload, how many following unit forwards the offload may overlap (see
            module docs).
        prefetch_distance: for swap and recompute_offload, how many units ahead in backward the copy back starts (0 =
            on demand).
        optimizer: where the unit's optimizer state lives: ``"resident"``, ``"offload"`` (brought back for the unit's
            step) or ``"stream"`` (brought back one parameter at a time for the step; see module docs).
        grads: where its gradients live: ``"resident"``, ``"offload"`` or ``"step"`` (stepped in backward).
        params: where its parameters live: ``"resident"`` or ``"offload"``.
        save_set: for selective, the name of its save-set (one of :data:`SAVE_SETS`); ``""`` otherwise.
        save_ops: for selective, the op calls whose outputs its forward keeps, as ``(op name, call index)`` pairs
            counted in the unit's forward (``("aten.mm.default", 0)`` is its first ``mm``); ``()`` otherwise.
    """

    unit: str
    strategy: str = "keep"
    offload_window: int = 1
    prefetch_distance: int = 1
    optimizer: str = "resident"
    grads: str = "resident"
    params: str = "resident"
    save_set: str = ""
    save_ops: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.unit, str):
            raise PlanError(f"a decision's unit must be a module name (a string), got {self.unit!r}")
        if self.strategy not in STRATEGIES:
            raise PlanError(
                f"unit {self.unit!r}: strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        kind = by_name(self.strategy)
        if kind.offloads and not kind.timed:  # an offloading strategy without timing knobs copies with its own timing
            object.__setattr__(self, "offload_window", kind.timing[0])
            object.__setattr__(self, "prefetch_distance", kind.timing[1])
        for name, allowed in (("offload_window", WINDOWS), ("prefetch_distance", DISTANCES)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TIMING:
                raise PlanError(f"unit {self.unit!r}: {name} must be an int in 0..{MAX_TIMING} (planners use "
                                f"{list(allowed)}), got {value!r}")
        for name, places in (("optimizer", OPTIMIZER_PLACES), ("grads", GRAD_PLACES), ("params", PARAM_PLACES)):
            if getattr(self, name) not in places:
                raise PlanError(f"unit {self.unit!r}: {name} must be one of {', '.join(map(repr, places))}, "
                                f"got {getattr(self, name)!r}")
        self._check_save_set()

    def _check_save_set(self) -> None:
        if self.strategy != "selective":
            if self.save_set or self.save_ops:
                raise PlanError(f"unit {self.unit!r}: save_set and save_ops are for strategy 'selective' only, "
                                f"not {self.strategy!r}")
            return
        if self.save_set not in SAVE_SETS:
            raise PlanError(f"unit {self.unit!r}: a selective unit needs save_set, one of {', '.join(SAVE_SETS)}; "
                            f"got {self.save_set!r}")
        try:
            ops = tuple((str(op), int(i)) for op, i in self.save_ops)
            ok = bool(ops) and all(isinstance(op, str) and isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                   for (op, i) in self.save_ops)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise PlanError(f"unit {self.unit!r}: save_ops must be a non-empty list of [op name, call index] pairs "
                            f"(as the profile's save_sets give them), got {self.save_ops!r}")
        object.__setattr__(self, "save_ops", ops)

    @property
    def placement(self) -> tuple[str, str, str]:
        """``(optimizer, grads, params)``."""
        return (self.optimizer, self.grads, self.params)

    @property
    def state_index(self) -> int:
        """Index of :attr:`placement` in :data:`STATE_CHOICES` (0: everything resident)."""
        return STATE_CHOICES.index(self.placement)

    @property
    def moves_state(self) -> bool:
        """Whether anything of this unit's state is not simply resident."""
        return self.placement != STATE_CHOICES[0]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.strategy != "selective":  # the save-set fields only where they mean something
            del d["save_set"], d["save_ops"]
        else:
            d["save_ops"] = [list(x) for x in self.save_ops]
        return d


def state_choices(offload_state: bool | str | Iterable[str] = True, *,
                  step_in_backward: bool = False) -> tuple[tuple[str, str, str], ...]:
    """The placements (a subset of :data:`STATE_CHOICES`, all-resident first) a planner may choose from.

    ``offload_state``: ``True`` (optimizer state, gradients and parameters may be offloaded), ``False`` (activations
    only: everything stays resident) or a set of pieces from :data:`STATE_PIECES`, e.g. ``{"optimizer", "grads"}``.
    ``step_in_backward=True`` adds ``grads="step"``: it is opt-in because the loop may then no longer accumulate or
    clip gradients (see :mod:`memopt_nb.runtime.state`).
    """
    if offload_state is True:
        pieces = set(STATE_PIECES)
    elif offload_state is False or offload_state is None:
        pieces = set()
    else:
        if isinstance(offload_state, str):
            offload_state = [p.strip() for p in offload_state.split(",") if p.strip()]
        try:
            pieces = set(offload_state)
        except TypeError:
            raise PlanError(f"offload_state must be True, False or a set of {', '.join(STATE_PIECES)}; got "
                            f"{offload_state!r}") from None
        unknown = sorted(map(str, pieces - set(STATE_PIECES)))
        if unknown:
            raise PlanError(f"offload_state names unknown pieces {unknown}; use any of {', '.join(STATE_PIECES)} "
                            "(or True for all, False for activations only)")
    if not isinstance(step_in_backward, bool):
        raise PlanError(f"step_in_backward must be True or False, got {step_in_backward!r}")
    opted = {"step_in_backward": step_in_backward}

    def allowed(piece: str, name: str) -> bool:
        place = PLACE_OF[name]
        return (not place.moves or piece in pieces) and (not place.opt_in or opted[place.opt_in])

    return tuple(c for c in STATE_CHOICES if all(allowed(*x) for x in zip(STATE_PIECES, c, strict=True)))


def effective_triggers(strategies: Sequence[str], distances: Sequence[int]) -> list[int | None]:
    """Index of the unit whose backward starts each swapped unit's prefetch (``None`` for other units).

    Unit ``i``'s prefetch starts when backward reaches unit ``min(i + d_i, n - 1)``, but never before the prefetch of
    the next swapped unit after it (backward needs that one first). A ``recompute_offload`` unit counts as swapped.
    """
    n = len(strategies)
    out: list[int | None] = [None] * n
    later = n - 1
    for i in range(n - 1, -1, -1):
        if strategies[i] in OFFLOADING:
            out[i] = min(i + int(distances[i]), n - 1, later)
            later = out[i]
    return out


def with_profile_facts(meta: dict[str, Any], profile: Any) -> dict[str, Any]:
    """``meta`` with what an applied plan checks the training loop against: the profile's ``autocast`` (the precision
    its forward ran in, ``None``: without autocast), ``keep_outputs`` (whether the loop keeps the model's output) and
    ``unit_input_shapes`` (the shapes of each unit's tensor
    inputs when profiled: a larger input than planned for is warned about once). Profiles made before a fact was
    recorded add nothing for it (then it is not checked)."""
    pmeta = getattr(profile, "meta", None) or {}
    out = {**meta, "autocast": pmeta["autocast"]} if "autocast" in pmeta else dict(meta)
    if "keep_outputs" in pmeta:  # whether the loop was profiled keeping the model's output
        out["keep_outputs"] = bool(pmeta["keep_outputs"])
    units = getattr(profile, "units", None) or []
    if units and any(getattr(u, "input_shapes", None) for u in units):
        out["unit_input_shapes"] = [[list(s) for s in u.input_shapes] for u in units]
    return out


def _check_field(data: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str) -> Any:
    value = data.get(key)
    if value is not None and not ok(value):
        raise PlanError(f"corrupt plan: {key} must be {want} or null, got {value!r}"[:300])
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(eq=False)
class Plan:
    """A memory plan for one model: a :class:`Decision` per unit plus what it was made for.

    Two plans are equal (``==``) when they make the same decisions for the same units; metadata such as search time or
    history is not compared.

    Attributes:
        decisions: one decision per unit, in forward order.
        fingerprint: per unit ``{"name", "type", "param_shapes"}``, used to refuse another model.
        model_fingerprint: the whole model it was made for (see :func:`model_fingerprint`): a model with other
            candidate units (e.g. 6 blocks where the plan knew 4) or another module tree is refused. ``None`` for
            plans saved by older versions, which are checked by their units only.
        budget_bytes: the memory budget the plan was made for, if any.
        device: the :class:`~memopt_nb.core.device.DeviceSpec` (as a dict) the plan targets, if any.
        method: who made it (``"memopt-ppo"``, ``"optimal"``, ``"recompute_all"``, ``"manual"`` …).
        seed: the seed of a randomized search.
        predicted_peak_bytes: simulated peak memory of one training step under the plan.
        predicted_step_time: simulated seconds per training step.
        feasible: whether the simulator found the plan within its budget (``None`` if not checked).
        meta: anything else (search history, timings, solver status).
        step_in_backward: whether the plan may step units inside backward (``grads="step"``); such a plan changes
            what the training loop may do (no gradient accumulation, no clipping), so it is opt-in.
        optimizer_fingerprint: the optimizer the plan was made for (its class, hyper-parameters and the shapes of
            each parameter group), ``None`` when the plan moves no state or was made without one.
        head: ``{"module": name, "chunks": k}`` when the plan computes the LM head and its cross-entropy ``k`` chunks
            of tokens at a time (:mod:`memopt_nb.runtime.head`; opt-in, ``profile(..., head="chunked")``): the logits
            are never whole, the loss is bit-identical but the gradients are summed in another order, so the plan is
            not :attr:`exact`. ``None``: the head runs as written.
    """

    decisions: tuple[Decision, ...]
    fingerprint: tuple[dict[str, Any], ...] = ()
    budget_bytes: int | None = None
    device: dict[str, Any] | None = None
    method: str = "manual"
    seed: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_step_time: float | None = None
    feasible: bool | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    model_fingerprint: dict[str, Any] | None = None
    step_in_backward: bool = False
    optimizer_fingerprint: dict[str, Any] | None = None
    head: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.decisions = tuple(self.decisions)
        self.fingerprint = tuple(dict(f) for f in self.fingerprint)
        if not self.decisions:
            raise PlanError("a plan needs at least one unit decision")
        for d in self.decisions:
            if not isinstance(d, Decision):
                raise PlanError(f"plan decisions must be Decision objects, got {type(d).__name__}")
        names = [d.unit for d in self.decisions]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise PlanError(f"a plan names each unit once; repeated: {', '.join(dupes)}")
        if self.fingerprint and [f.get("name") for f in self.fingerprint] != names:
            raise PlanError(_fingerprint_mismatch(names, [f.get("name") for f in self.fingerprint]))
        if not isinstance(self.step_in_backward, bool):
            raise PlanError(f"step_in_backward must be True or False, got {self.step_in_backward!r}")
        stepped = [d.unit for d in self.decisions if d.grads == "step"]
        if stepped and not self.step_in_backward:
            more = " …" if len(stepped) > 4 else ""
            raise PlanError(f"units {', '.join(stepped[:4])}{more} have grads='step' but the "
                            "plan was not made with step_in_backward=True; stepping in backward changes what the "
                            "training loop may do (no gradient accumulation or clipping), so it must be asked for")
        if self.head is not None and not (
                isinstance(self.head, dict) and isinstance(self.head.get("module"), str)
                and _is_int(self.head.get("chunks")) and self.head["chunks"] >= 1):
            raise PlanError("head must be None or {'module': name, 'chunks': a whole number >= 1}, "
                            f"got {self.head!r}")
        self._model_ref: weakref.ref | None = None
        self._optimizer_ref: weakref.ref | None = None

    # ------------------------------------------------------------------ constructors
    @classmethod
    def uniform(cls, profile: Any, strategy: str, *, offload_window: int = 1, prefetch_distance: int = 1,
                method: str | None = None) -> Plan:
        """The same strategy for every unit of ``profile`` (e.g. recompute-all)."""
        return cls.from_strategies(profile, [strategy] * len(profile.units), offload_window=offload_window,
                                   prefetch_distance=prefetch_distance, method=method or f"{strategy}_all")

    @classmethod
    def from_strategies(cls, profile: Any, strategies: Sequence[str] | Mapping[str, str], *,
                        offload_window: int | Sequence[int] = 1, prefetch_distance: int | Sequence[int] = 1,
                        method: str = "manual", **kwargs: Any) -> Plan:
        """A plan from a list of strategies (one per unit) or a ``{unit name: strategy}`` mapping (others keep).

        ``"selective"`` uses the unit's first Pareto save-set of its profile (``profile(..., selective=True)``);
        ``"selective:alternate"`` names one (see :data:`SAVE_SETS`).
        """
        names = [u.name for u in profile.units]
        if isinstance(strategies, Mapping):
            unknown = sorted(set(strategies) - set(names))
            if unknown:
                raise PlanError(f"unknown unit names {unknown}; the profile's units are: {', '.join(names)}")
            strategies = [strategies.get(n, "keep") for n in names]
        strategies = list(strategies)
        if len(strategies) != len(names):
            raise PlanError(f"got {len(strategies)} strategies for a profile with {len(names)} units")
        windows = [offload_window] * len(names) if isinstance(offload_window, int) else list(offload_window)
        dists = [prefetch_distance] * len(names) if isinstance(prefetch_distance, int) else list(prefetch_distance)
        decisions = tuple(
            _decision(unit, s, int(w), int(d))
            for unit, s, w, d in zip(profile.units, strategies, windows, dists, strict=True)
        )
        kwargs.setdefault("model_fingerprint", (getattr(profile, "meta", None) or {}).get("model_fingerprint"))
        kwargs["meta"] = with_profile_facts(kwargs.get("meta") or {}, profile)
        kwargs.setdefault("optimizer_fingerprint",
                          (getattr(profile, "meta", None) or {}).get("optimizer_fingerprint"))
        plan = cls(decisions=decisions, fingerprint=profile.fingerprint, method=method,
                   device=profile.device.to_dict(), **kwargs)
        plan._model_ref = getattr(profile, "_model_ref", None)
        plan._optimizer_ref = getattr(profile, "_optimizer_ref", None)
        return plan

    # ------------------------------------------------------------------ views
    @property
    def exact(self) -> bool:
        """Whether training under the plan is bit-identical to training without it (``False``: the head is chunked,
        see :attr:`head`, or a unit's strategy is not :attr:`~memopt_nb.core.strategies.Strategy.exact`)."""
        return self.head is None and all(by_name(d.strategy).exact for d in self.decisions)

    @property
    def units(self) -> list[str]:
        return [d.unit for d in self.decisions]

    @property
    def strategies(self) -> list[str]:
        return [d.strategy for d in self.decisions]

    @property
    def placements(self) -> list[tuple[str, str, str]]:
        """Per unit ``(optimizer, grads, params)``."""
        return [d.placement for d in self.decisions]

    @property
    def state_indices(self) -> list[int]:
        """Per unit the index of its placement in :data:`STATE_CHOICES`."""
        return [d.state_index for d in self.decisions]

    @property
    def moves_state(self) -> bool:
        """Whether the plan places any optimizer state, gradient or parameter anywhere but on the device."""
        return any(d.moves_state for d in self.decisions)

    def state_counts(self) -> dict[str, int]:
        """How many units offload their optimizer state / gradients / parameters, and step in backward."""
        return {"optimizer": sum(d.optimizer != "resident" for d in self.decisions),
                "grads": sum(d.grads == "offload" for d in self.decisions),
                "step": sum(d.grads == "step" for d in self.decisions),
                "params": sum(d.params == "offload" for d in self.decisions)}

    @property
    def offload_windows(self) -> list[int]:
        return [d.offload_window for d in self.decisions]

    @property
    def prefetch_distances(self) -> list[int]:
        return [d.prefetch_distance for d in self.decisions]

    def counts(self) -> dict[str, int]:
        """How many units use each strategy."""
        return {s: self.strategies.count(s) for s in STRATEGIES}

    def same_decisions(self, other: Plan) -> bool:
        """Whether two plans do the same thing, ignoring timings of units that are not swapped."""
        if self.units != other.units:
            return False
        for a, b in zip(self.decisions, other.decisions, strict=True):
            if (a.strategy, a.placement, a.save_set, a.save_ops) != (b.strategy, b.placement, b.save_set, b.save_ops):
                return False
            if a.strategy in OFFLOADING and (a.offload_window, a.prefetch_distance) != (
                b.offload_window, b.prefetch_distance
            ):
                return False
        return True

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Plan):
            return NotImplemented
        return self.decisions == other.decisions and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.decisions)

    def with_meta(self, **changes: Any) -> Plan:
        """A copy with some attributes changed (``meta`` entries are merged)."""
        meta = {**self.meta, **changes.pop("meta", {})}
        plan = dataclasses.replace(self, meta=meta, **changes)
        plan._model_ref = self._model_ref
        plan._optimizer_ref = self._optimizer_ref
        return plan

    # ------------------------------------------------------------------ validation
    def validate(self, target: Any) -> None:
        """Raise :class:`PlanError` unless this plan was made for ``target`` (an ``nn.Module`` or a ModelProfile).

        The error names what differs: the model's class, the number of blocks in a container of units (a plan for 4
        blocks refuses a model with 6), every unit that is missing or does not match (module type or parameter
        shapes), or the part of the module tree that differs. A plan without a model fingerprint (saved by an older
        version) is checked by its units only.
        """
        import torch.nn as nn

        if isinstance(target, nn.Module):
            modules = dict(target.named_modules())
            problems = []
            if self.model_fingerprint:
                problems += _model_differences(self.model_fingerprint, model_fingerprint(target, self.units))
            for i, d in enumerate(self.decisions):
                mod = modules.get(d.unit)
                if mod is None:
                    problems.append(f"unit {d.unit!r}: no such module")
                    continue
                if self.fingerprint:
                    want = self.fingerprint[i]
                    have = unit_fingerprint(d.unit, mod)
                    if not _fingerprint_matches(want, have):
                        problems.append(
                            f"unit {d.unit!r}: plan {want['type']} {want['param_shapes']}, "
                            f"model {have['type']} {have['param_shapes']}"
                        )
            if problems:
                raise PlanError("this plan was made for another model: " + "; ".join(problems)
                                + ". Profile this model and make a plan for it")
            return
        fp = getattr(target, "fingerprint", None)
        if fp is None:
            raise PlanError(f"can validate a plan against an nn.Module or a ModelProfile, not {type(target).__name__}")
        have = {f["name"]: f for f in fp}
        problems = []
        for i, d in enumerate(self.decisions):
            if d.unit not in have:
                problems.append(f"unit {d.unit!r}: not a unit of the profile")
            elif self.fingerprint and not _fingerprint_matches(self.fingerprint[i], have[d.unit]):
                problems.append(f"unit {d.unit!r}: module type or parameter shapes differ")
        if [f["name"] for f in fp] != self.units and not problems:
            problems.append(f"unit order differs (profile: {[f['name'] for f in fp]}, plan: {self.units})")
        have_model = (getattr(target, "meta", None) or {}).get("model_fingerprint")
        if self.model_fingerprint and have_model:
            problems = _model_differences(self.model_fingerprint, have_model) + problems
        if problems:
            raise PlanError("this plan was made for another model: " + "; ".join(problems))

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "schema_version": SCHEMA_VERSION,
            "method": self.method,
            "seed": self.seed,
            "budget_bytes": self.budget_bytes,
            "device": self.device,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_step_time": self.predicted_step_time,
            "feasible": self.feasible,
            "decisions": [d.to_dict() for d in self.decisions],
            "fingerprint": [dict(f) for f in self.fingerprint],
            "model_fingerprint": self.model_fingerprint,
            "step_in_backward": self.step_in_backward,
            "optimizer_fingerprint": self.optimizer_fingerprint,
            "head": self.head,
            "meta": _jsonable(self.meta),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanError("not a memopt_nb plan (missing \"format\": \"memopt_nb.plan\")")
        version = data.get("schema_version")
        if not isinstance(version, int):
            raise PlanError("corrupt plan: schema_version is missing or not an int")
        if version > SCHEMA_VERSION:
            raise PlanError(
                f"this plan was written by a newer memopt_nb (schema {version}); this version reads schema "
                f"{SCHEMA_VERSION} — upgrade memopt_nb to load it"
            )
        if not isinstance(data.get("decisions"), list) or not all(isinstance(d, dict) for d in data["decisions"]):
            raise PlanError("corrupt plan: decisions must be a list of {\"unit\": ..., \"strategy\": ...} objects")
        number = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)  # noqa: E731
        fields = {
            "budget_bytes": _check_field(data, "budget_bytes", lambda v: _is_int(v) and v > 0,
                                         "a positive int of bytes"),
            "device": _check_field(data, "device", lambda v: isinstance(v, dict), "an object"),
            "method": _check_field(data, "method", lambda v: isinstance(v, str), "a string") or "manual",
            "seed": _check_field(data, "seed", _is_int, "an int"),
            "predicted_peak_bytes": _check_field(data, "predicted_peak_bytes", lambda v: _is_int(v) and v >= 0,
                                                 "an int of bytes"),
            "predicted_step_time": _check_field(data, "predicted_step_time", number, "a number of seconds"),
            "feasible": _check_field(data, "feasible", lambda v: isinstance(v, bool), "true or false"),
            "meta": _check_field(data, "meta", lambda v: isinstance(v, dict), "an object") or {},
            "step_in_backward": _check_field(data, "step_in_backward", lambda v: isinstance(v, bool),
                                             "true or false") or False,
            "optimizer_fingerprint": _check_field(data, "optimizer_fingerprint", lambda v: isinstance(v, dict),
                                                  "an object"),
            "head": _check_field(data, "head", lambda v: isinstance(v, dict), "an object"),
        }
        fingerprint = _check_unit_fingerprint(data.get("fingerprint"))
        model_fp = _check_model_fingerprint(data.get("model_fingerprint"))
        try:
            decisions = tuple(Decision(**d) for d in data["decisions"])
            return cls(decisions=decisions, fingerprint=fingerprint, model_fingerprint=model_fp,
                       **{**fields, "meta": dict(fields["meta"])})
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"corrupt plan: {exc}") from None

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 1), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"corrupt plan file: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> Path:
        """Write the plan as JSON; returns the path."""
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises :class:`PlanError` for a path that is missing or a directory, a file that is not UTF-8 JSON, or JSON
        that is not a valid plan (each field is checked, so a plan that loads also displays and applies).
        """
        path = Path(path)
        if not path.exists():
            raise PlanError(f"no plan file at {path}")
        if path.is_dir():
            raise PlanError(f"{path} is a directory; give the path of a plan's JSON file (written by plan.save(path))")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise PlanError(f"{path} is not a memopt_nb plan: not UTF-8 text (byte {exc.start}); a plan is the JSON "
                            "file written by plan.save(path)") from None
        except OSError as exc:
            raise PlanError(f"cannot read the plan file {path}: {exc.strerror or exc}") from None
        return cls.from_json(text)

    # ------------------------------------------------------------------ display
    def summary(self) -> str:
        """One line: method, the device it is for, strategy counts and predictions."""
        c = self.counts()
        name = (self.device or {}).get("name")
        device = f" for {name}" if name else ""
        counted = ", ".join(f"{s.name} {c[s.name]}" for s in REGISTRY if s.default or c[s.name])  # opt-in: if used
        parts = [f"Plan[{self.method}]{device}: {len(self.decisions)} units: {counted}"]
        sc = self.state_counts()
        moved = [f"{k} {v}" for k, v in (("optimizer offloaded", sc["optimizer"]),
                                         ("grads offloaded", sc["grads"]), ("stepped in backward", sc["step"]),
                                         ("params offloaded", sc["params"])) if v]
        streamed = sum(d.optimizer == "stream" for d in self.decisions)
        if streamed:
            moved[0] += f" ({streamed} streamed a parameter at a time)"
        if moved:
            parts.append("state: " + ", ".join(moved))
        if self.head:
            parts.append(f"LM head {self.head['module']} in {self.head['chunks']} chunks (not bit-identical: "
                         "gradients summed in another order)")
        if self.budget_bytes:
            parts.append(f"budget {format_bytes(self.budget_bytes)}")
        if self.predicted_peak_bytes is not None:
            parts.append(f"predicted peak {format_bytes(self.predicted_peak_bytes)}")
        if self.predicted_step_time is not None:
            parts.append(f"step {self.predicted_step_time * 1e3:.2f} ms")
        if self.feasible is False:
            parts.append("INFEASIBLE")
        if self.meta.get("interrupted"):
            parts.append("interrupted")
        return ", ".join(parts)

    def __repr__(self) -> str:
        return f"<{self.summary()}>"

    def _repr_html_(self) -> str:
        rows = []
        for d in self.decisions:
            timing = ""
            if d.strategy in OFFLOADING:
                w, k = d.offload_window, d.prefetch_distance
                out = ("copy to host done before the next forward" if w == 0 else
                       f"copy to host may overlap the next {w} forward{'s' if w > 1 else ''}")
                back = ("copy back when its backward starts" if k == 0 else
                        f"copy back starts {k} unit{'s' if k > 1 else ''} ahead in backward")
                timing = f"{out}; {back} (window {w}, prefetch {k})"
            state = ", ".join(f"{k} {v}" for k, v in zip(("optimizer", "grads", "params"), d.placement, strict=True)
                              if v != "resident") or "resident"
            if d.strategy == "selective":
                timing = f"saves {html.escape(d.save_set)} ({len(d.save_ops)} op outputs)"
            rows.append(f"<tr><td>{html.escape(d.unit)}</td><td>{d.strategy}</td><td>{timing}</td>"
                        f"<td>{state}</td></tr>")
        return (
            f"<div><b>{html.escape(self.summary())}</b><table><thead><tr><th>unit</th><th>strategy</th>"
            '<th title="swapped units only: offload window (forwards the copy to host may overlap) and prefetch '
            f'distance (units ahead the copy back starts)">swap timing</th>'
            '<th title="where the unit\'s optimizer state, gradients and parameters live">state</th></tr></thead>'
            f'<tbody>{"".join(rows)}'
            "</tbody></table></div>"
        )


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def selective_decision(unit: Any, save_set: str, window: int = 1, distance: int = 1,
                       placement: tuple[str, str, str] = STATE_CHOICES[0]) -> Decision:
    """A ``selective`` decision for ``unit`` (a :class:`~memopt_nb.core.profile.UnitProfile`) carrying the ops its
    profile lists for ``save_set``, so the plan applies without the profile; :class:`PlanError` naming what the unit
    offers
    when it has no such save-set."""
    sets = getattr(unit, "save_sets", None) or {}
    if save_set not in sets:
        offered = ", ".join(sets) if sets else "none (profile the model with memopt.profile(..., selective=True))"
        raise PlanError(f"unit {unit.name!r}: selective with save-set {save_set or 'of its own'!r}, which its profile "
                        f"does not offer; it offers {offered}. Use recompute for this unit, or another save-set of "
                        f"{', '.join(SAVE_SETS)}")
    return Decision(unit.name, "selective", window, distance, *placement, save_set=save_set,
                    save_ops=tuple((str(op), int(i)) for op, i in sets[save_set]["ops"]))


def _decision(unit: Any, strategy: str, window: int, distance: int) -> Decision:
    """One unit's decision for :meth:`Plan.from_strategies` (``"selective[:save-set]"`` read from its profile; plain
    ``"selective"`` takes its first Pareto save-set)."""
    if not isinstance(strategy, str) or not strategy.startswith("selective"):
        return Decision(unit.name, strategy, window, distance)
    wanted = strategy.partition(":")[2]
    if not wanted:
        sets = getattr(unit, "save_sets", None) or {}
        wanted = next((k for k in SAVE_SETS if sets.get(k, {}).get("pareto")), "")
    return selective_decision(unit, wanted, window, distance)
