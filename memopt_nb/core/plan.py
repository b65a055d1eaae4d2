"""A plan: for every unit a strategy (keep, recompute, swap, recompute_offload, selective), for swaps its timing, and
where its state lives. The strategies and placements themselves are declared in :mod:`memopt_nb.core.strategies`.

A :class:`Plan` is plain data. It knows the units it was made for (a fingerprint of names, module types and parameter
shapes), the budget and device it targets, who made it and what the simulator predicted. It saves to versioned JSON
(:mod:`memopt_nb.core.plan_json`), reads as one line or a table (:mod:`memopt_nb.core.plan_display`) and refuses to be
applied to a model it was not made for (:func:`~memopt_nb.core.fingerprint.check_plan_target`).

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
import json
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PlanError
from .fingerprint import (
    _fingerprint_mismatch,
    check_plan_target,
    model_fingerprint,
    optimizer_differences,
    optimizer_fingerprint,
    plain_module_type,
    unit_fingerprint,
)
from .plan_display import PlanDisplay
from .plan_json import FORMAT, SCHEMA_VERSION, _is_int, checked_fields, parse_plan_json, plan_dict, read_plan_file
from .strategies import (
    DEFAULT_STRATEGIES,
    DISTANCES,
    GRAD_PLACES,
    OFFLOADING,
    OPTIMIZER_PLACES,
    PARAM_PLACES,
    PLACE_OF,
    RECOMPUTING,
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


@dataclass(eq=False)
class Plan(PlanDisplay):
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
        check_plan_target(self, target)

    # ------------------------------------------------------------------ JSON (:mod:`memopt_nb.core.plan_json`)
    def to_dict(self) -> dict[str, Any]:
        return plan_dict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        fields = checked_fields(data)
        try:
            decisions = tuple(Decision(**d) for d in fields.pop("decisions"))
            return cls(decisions=decisions, **fields)
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"corrupt plan: {exc}") from None

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), indent=kwargs.pop("indent", 1), **kwargs)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(parse_plan_json(text))

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
        return cls.from_json(read_plan_file(path))

    # ------------------------------------------------------------------ display (:class:`PlanDisplay`: summary, HTML)
    def __repr__(self) -> str:
        return f"<{self.summary()}>"


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
