"""A plan: for every unit a strategy (keep, recompute, swap) and, for swaps, its timing.

A :class:`Plan` is plain data. It knows the units it was made for (a fingerprint of names, module types and parameter
shapes), the budget and device it targets, who made it and what the simulator predicted. It saves to versioned JSON and
refuses to be applied to a model it was not made for.

Timing of a swapped unit ``i`` (both are counted in units):

* ``offload_window`` ``w`` — the copy of unit ``i``'s saved tensors to host starts as soon as they are no longer needed
  on the device by anything else (for a unit's internal tensors: right after its forward) and may overlap the next
  ``w`` unit forwards; the device copy is freed before the forward after those. ``w = 0`` makes the offload
  synchronous. (With one first-in-first-out copy engine per direction, starting a copy later can never finish any copy
  sooner, so the useful knob is how long the copy may take before its memory must be back: the window.)
* ``prefetch_distance`` ``d`` — the copy back starts when backward reaches unit ``i + d`` (``d = 0``: when unit ``i``
  itself is reached, i.e. on demand). Prefetches are issued in the order backward needs them, so a unit's prefetch never
  starts before that of a unit after it; :func:`effective_triggers` applies that rule.
"""

from __future__ import annotations

import dataclasses
import html
import json
import sys
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import PlanError

SCHEMA_VERSION = 1
FORMAT = "memopt_nb.plan"
STRATEGIES = ("keep", "recompute", "swap")
#: Offload windows the planners choose from.
WINDOWS = (0, 1, 2)
#: Prefetch distances the planners choose from.
DISTANCES = (0, 1, 2, 3)
MAX_TIMING = 64


@dataclass(frozen=True)
class Decision:
    """What to do with one unit.

    Attributes:
        unit: qualified module name (as in ``model.named_modules()``).
        strategy: ``"keep"`` (default autograd), ``"recompute"`` (activation checkpointing) or ``"swap"`` (offload the
            unit's saved tensors to host memory, bring them back in backward).
        offload_window: for swap, how many following unit forwards the offload may overlap (see module docs).
        prefetch_distance: for swap, how many units ahead in backward the copy back starts (0 = on demand).
    """

    unit: str
    strategy: str = "keep"
    offload_window: int = 1
    prefetch_distance: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise PlanError(
                f"unit {self.unit!r}: strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}"
            )
        for name, allowed in (("offload_window", WINDOWS), ("prefetch_distance", DISTANCES)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TIMING:
                raise PlanError(f"unit {self.unit!r}: {name} must be an int in 0..{MAX_TIMING} (planners use "
                                f"{list(allowed)}), got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def effective_triggers(strategies: Sequence[str], distances: Sequence[int]) -> list[int | None]:
    """Index of the unit whose backward starts each swapped unit's prefetch (``None`` for other units).

    Unit ``i``'s prefetch starts when backward reaches unit ``min(i + d_i, n - 1)``, but never before the prefetch of
    the next swapped unit after it (backward needs that one first).
    """
    n = len(strategies)
    out: list[int | None] = [None] * n
    later = n - 1
    for i in range(n - 1, -1, -1):
        if strategies[i] == "swap":
            out[i] = min(i + int(distances[i]), n - 1, later)
            later = out[i]
    return out


def _fingerprint_matches(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("type") == b.get("type") and [list(s) for s in a.get("param_shapes", [])] == [
        list(s) for s in b.get("param_shapes", [])
    ]


def plain_module_type(module: Any) -> type:
    """The module's own class: FSDP2's ``fully_shard`` swaps it for a dynamic ``FSDP<Class>(FSDPModule, Class)``."""
    cls = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")  # nothing can be sharded unless something imported it
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        for base in cls.__mro__[1:]:
            if not issubclass(base, fsdp.FSDPModule):
                return base
    return cls


def unit_fingerprint(name: str, module: Any) -> dict[str, Any]:
    """What identifies a unit across runs: its name, module type (the plain one under FSDP2) and parameter shapes."""
    return {
        "name": name,
        "type": plain_module_type(module).__name__,
        "param_shapes": [list(p.shape) for p in module.parameters()],
    }


@dataclass(eq=False)
class Plan:
    """A memory plan for one model: a :class:`Decision` per unit plus what it was made for.

    Two plans are equal (``==``) when they make the same decisions for the same units; metadata such as search time or
    history is not compared.

    Attributes:
        decisions: one decision per unit, in forward order.
        fingerprint: per unit ``{"name", "type", "param_shapes"}``, used to refuse another model.
        budget_bytes: the memory budget the plan was made for, if any.
        device: the :class:`~memopt_nb.device.DeviceSpec` (as a dict) the plan targets, if any.
        method: who made it (``"memopt-ppo"``, ``"optimal"``, ``"recompute_all"``, ``"manual"`` …).
        seed: the seed of a randomized search.
        predicted_peak_bytes: simulated peak memory of one training step under the plan.
        predicted_step_time: simulated seconds per training step.
        feasible: whether the simulator found the plan within its budget (``None`` if not checked).
        meta: anything else (search history, timings, solver status).
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
            raise PlanError("plan fingerprint and decisions name different units")
        self._model_ref: weakref.ref | None = None

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
        """A plan from a list of strategies (one per unit) or a ``{unit name: strategy}`` mapping (others keep)."""
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
            Decision(n, s, int(w), int(d)) for n, s, w, d in zip(names, strategies, windows, dists, strict=True)
        )
        plan = cls(decisions=decisions, fingerprint=profile.fingerprint, method=method,
                   device=profile.device.to_dict(), **kwargs)
        plan._model_ref = getattr(profile, "_model_ref", None)
        return plan

    # ------------------------------------------------------------------ views
    @property
    def units(self) -> list[str]:
        return [d.unit for d in self.decisions]

    @property
    def strategies(self) -> list[str]:
        return [d.strategy for d in self.decisions]

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
            if a.strategy != b.strategy:
                return False
            if a.strategy == "swap" and (a.offload_window, a.prefetch_distance) != (
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
        return plan

    # ------------------------------------------------------------------ validation
    def validate(self, target: Any) -> None:
        """Raise :class:`PlanError` unless this plan was made for ``target`` (an ``nn.Module`` or a ModelProfile).

        The error names every unit that is missing or does not match (module type or parameter shapes).
        """
        import torch.nn as nn

        if isinstance(target, nn.Module):
            modules = dict(target.named_modules())
            problems = []
            for i, d in enumerate(self.decisions):
                mod = modules.get(d.unit)
                if mod is None:
                    problems.append(f"{d.unit!r} (no such module)")
                    continue
                if self.fingerprint:
                    want = self.fingerprint[i]
                    have = unit_fingerprint(d.unit, mod)
                    if not _fingerprint_matches(want, have):
                        problems.append(
                            f"{d.unit!r} (plan: {want['type']} {want['param_shapes']}, "
                            f"model: {have['type']} {have['param_shapes']})"
                        )
            if problems:
                raise PlanError(
                    "this plan was made for another model; units that do not match: " + "; ".join(problems)
                )
            return
        fp = getattr(target, "fingerprint", None)
        if fp is None:
            raise PlanError(f"can validate a plan against an nn.Module or a ModelProfile, not {type(target).__name__}")
        have = {f["name"]: f for f in fp}
        problems = []
        for i, d in enumerate(self.decisions):
            if d.unit not in have:
                problems.append(f"{d.unit!r} (not a unit of the profile)")
            elif self.fingerprint and not _fingerprint_matches(self.fingerprint[i], have[d.unit]):
                problems.append(f"{d.unit!r} (module type or parameter shapes differ)")
        if [f["name"] for f in fp] != self.units and not problems:
            problems.append(f"unit order differs (profile: {[f['name'] for f in fp]}, plan: {self.units})")
        if problems:
            raise PlanError("this plan was made for another model; units that do not match: " + "; ".join(problems))

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
        try:
            decisions = tuple(Decision(**d) for d in data["decisions"])
            return cls(
                decisions=decisions,
                fingerprint=tuple(data.get("fingerprint", ())),
                budget_bytes=data.get("budget_bytes"),
                device=data.get("device"),
                method=data.get("method", "manual"),
                seed=data.get("seed"),
                predicted_peak_bytes=data.get("predicted_peak_bytes"),
                predicted_step_time=data.get("predicted_step_time"),
                feasible=data.get("feasible"),
                meta=dict(data.get("meta") or {}),
            )
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
        """Read a plan written by :meth:`save`."""
        path = Path(path)
        if not path.exists():
            raise PlanError(f"no plan file at {path}")
        return cls.from_json(path.read_text())

    # ------------------------------------------------------------------ display
    def summary(self) -> str:
        """One line: method, the device it is for, strategy counts and predictions."""
        from .budget import format_bytes

        c = self.counts()
        name = (self.device or {}).get("name")
        device = f" for {name}" if name else ""
        parts = [f"Plan[{self.method}]{device}: {len(self.decisions)} units: keep {c['keep']}, recompute "
                 f"{c['recompute']}, swap {c['swap']}"]
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
            if d.strategy == "swap":
                w, k = d.offload_window, d.prefetch_distance
                out = ("copy to host done before the next forward" if w == 0 else
                       f"copy to host may overlap the next {w} forward{'s' if w > 1 else ''}")
                back = ("copy back when its backward starts" if k == 0 else
                        f"copy back starts {k} unit{'s' if k > 1 else ''} ahead in backward")
                timing = f"{out}; {back} (window {w}, prefetch {k})"
            rows.append(f"<tr><td>{html.escape(d.unit)}</td><td>{d.strategy}</td><td>{timing}</td></tr>")
        return (
            f"<div><b>{html.escape(self.summary())}</b><table><thead><tr><th>unit</th><th>strategy</th>"
            '<th title="swapped units only: offload window (forwards the copy to host may overlap) and prefetch '
            f'distance (units ahead the copy back starts)">swap timing</th></tr></thead><tbody>{"".join(rows)}'
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


def decisions_from(strategies: Iterable[str], units: Sequence[str], windows: Sequence[int],
                   distances: Sequence[int]) -> tuple[Decision, ...]:
    """Decisions from parallel lists (used by planners)."""
    return tuple(Decision(u, s, int(w), int(d)) for u, s, w, d in zip(units, strategies, windows, distances,
                                                                         strict=True))
