"""``memopt.profile``: what a model's training step costs, per unit.

A *unit* is a module on which a plan decides (a transformer block, a ResNet block). The profiler runs a few real
training steps (and restores the model, optimizer and RNG afterwards) to measure:

* per unit: forward and backward time, bytes autograd saves inside it (each storage once, parameters excluded), its
  internal ("interior") bytes that recompute or swap can free, input/output/parameter bytes, and flags (RNG ops,
  running statistics);
* the step as a timeline of *segments* — each unit's forward and backward, and the code between units — with the
  memory level at the start of each segment and its peak above that level, with every unit kept and with every unit
  recomputed;
* *storage groups*: saved or unit-input storages with the same producer, savers and consumers, and the unit boundary at
  which nothing but autograd refers to them any more. This is what lets the simulator predict swap and recompute
  exactly, skip connections and shared boundary tensors included;
* totals: parameter, gradient, optimizer-state bytes, the measured peak and the bytes not attributed to units.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import datetime
import difflib
import html
import json
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .budget import format_bytes
from .device import DeviceSpec
from .errors import ProfileError
from .opsets import mark_pareto, propose_save_sets, record_ops
from .plan import SAVE_SETS, model_fingerprint, optimizer_fingerprint, unit_fingerprint
from .runtime.measure import model_device
from .runtime.memory import meter_for
from .runtime.recompute import (
    ForwardEffects,
    cache_tensors,
    checkpointed,
    forward_side_effects,
    is_cache,
    running_stat_modules,
)
from .runtime.step import (
    autocast_name,
    forward_autocast,
    model_keywords,
    preserved_state,
    resolve_autocast,
    step_autocast,
    training_step,
)
from .runtime.storages import is_plain, movable, tensor_on, use_count

PROFILE_FORMAT = "memopt_nb.profile"
PROFILE_SCHEMA = 2  # 2: per-unit state bytes and the unit-by-unit optimizer step (schema 1 loads with zeros)
_RNG_OPS = ("bernoulli", "dropout", "rand", "normal", "uniform", "multinomial", "randperm", "exponential")


# ====================================================================== data
@dataclass
class UnitProfile:
    """What one unit costs.

    Attributes:
        name: qualified module name; index: position in forward order; type: module class name.
        fwd_time, bwd_time: median seconds of its forward and backward (backward includes its parameters' grads).
        saved_bytes: bytes autograd saves inside the unit (unique storages, parameters and buffers excluded).
        interior_bytes: saved bytes created inside the unit and needed by no one else — what recompute frees.
        input_bytes, output_bytes, param_bytes: sizes of its inputs, outputs and parameters.
        has_rng: runs random ops (dropout); recompute replays them. has_running_stats: has BatchNorm-like buffers.
        recomputable, swappable: whether a plan may recompute / swap it.
        side_effects: what its forward changes besides its output that a recomputation replays exactly (buffers
            such as running statistics or spectral norm's vectors, attributes, a Hugging Face cache); "" for none.
        not_recomputable_reason: why recomputing it cannot be exact (e.g. it changes an argument), "" if it can.
        fwd_segment, bwd_segment: indices of its forward and backward in ``ModelProfile.segments``.
        rc_fwd_rel_peak, rc_bwd_rel_peak: peak above the segment's start level when the unit is recomputed.
        grad_bytes, optimizer_bytes: its gradients (trainable parameters the optimizer steps) and the optimizer state
            a placement can move (tensors with at least one dimension, measured after a first step); param_storages,
            grad_storages, optimizer_storages: how many storages each is (the per-copy cost counts them).
        step_time, step_rel_peak: the optimizer step over this unit's parameters alone, as the unit-by-unit step of
            :class:`~memopt_nb.runtime.state.StateManager` runs it: seconds, and peak above the level before it.
        params_offloadable: every parameter is a whole, resizable storage used by no module outside the unit.
        grads_done_extra: the level when backward has accumulated the unit's last gradient (where a step in backward
            runs) minus the level where its backward segment ends (every unit kept): what the backward still holds
            then, e.g. the gradient of the unit's input. 0 when the profile has no such moment (no trainable parameter).
        save_sets: (``profile(..., selective=True)``) per save-set name of :data:`~memopt_nb.plan.SAVE_SETS` the unit
            offers: ``"ops"`` (the ``[op name, call index]`` pairs whose outputs it keeps), ``"held_bytes"`` (what the
            kept outputs hold from its forward to its backward, measured), ``"recompute_time"`` (seconds its backward
            spends recomputing the rest), ``"fwd_rel_peak"`` / ``"bwd_rel_peak"`` (its segments' peaks above their
            start when it runs selective) and ``"pareto"`` (not dominated by another set: the planners' options).
            Empty without ``selective=True``.
    """

    name: str
    index: int
    type: str
    fwd_time: float
    bwd_time: float
    saved_bytes: int
    interior_bytes: int
    input_bytes: int
    output_bytes: int
    param_bytes: int
    has_rng: bool
    has_running_stats: bool
    recomputable: bool
    swappable: bool
    fwd_segment: int
    bwd_segment: int
    rc_fwd_rel_peak: int
    rc_bwd_rel_peak: int
    input_shapes: list[list[int]] = field(default_factory=list)
    output_shapes: list[list[int]] = field(default_factory=list)
    side_effects: str = ""
    not_recomputable_reason: str = ""
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    param_storages: int = 0
    grad_storages: int = 0
    optimizer_storages: int = 0
    step_time: float = 0.0
    step_rel_peak: int = 0
    params_offloadable: bool = False
    save_sets: dict[str, dict[str, Any]] = field(default_factory=dict)
    grads_done_extra: int = 0


@dataclass
class Segment:
    """One stretch of the training step: a unit's forward (``"fwd"``), its backward (``"bwd"``) or other code.

    ``start_level`` is the device memory in use when it starts (every unit kept), ``rel_peak`` the peak during it above
    that level, ``time`` its median duration in seconds.
    """

    kind: str
    unit: int
    label: str
    time: float
    start_level: int
    rel_peak: int


@dataclass
class StorageGroup:
    """Storages that units save or take as input, grouped by who makes, saves and uses them.

    Attributes:
        nbytes: total bytes; count: number of storages.
        producer: unit that created them (-1: code outside units).
        savers: units that save them for backward; outside_saver: code outside units saves them too.
        consumers: units that receive them as forward input.
        free_pos: the segment boundary (index) at which nothing but autograd refers to them any more, or ``None`` if
            something still does at the end of the forward.
        outside_release: for storages code outside units saves, the segment in which that code's backward lets go.
        release_pos: for storages something besides autograd still refers to when the forward ends (``free_pos`` is
            ``None``): the boundary, after the forward, at which nothing but autograd refers to them any more (a
            model's output dropped after the loss: a Hugging Face KV cache), or ``None`` if never in the step.
        death_seg, late_bytes: the profiled run freed them partway through segment ``death_seg``, and that segment's
            peak would have been ``late_bytes`` higher had they lived to its end (its peak came after they were
            freed): what a plan that holds them past ``death_seg`` (a recomputed unit's checkpoint keeping an input
            made outside the units, such as a mask the model's forward let go of before its head) adds to that
            segment's peak. ``None`` and 0 when that is nothing. With several storages freed in one segment, each
            storage's share leaves out only the room below the peak that earlier ones' shares did not use, so any set of
            them held together is never predicted below what the run would hold (exact for the first to die).
    """

    nbytes: int
    count: int
    producer: int
    savers: tuple[int, ...]
    consumers: tuple[int, ...]
    outside_saver: bool
    free_pos: int | None
    outside_release: int | None = None
    release_pos: int | None = None
    death_seg: int | None = None
    late_bytes: int = 0


@dataclass
class ModelProfile:
    """What a model's training step costs, per unit — the input of the simulator and every planner.

    Build one with :func:`profile`. It round-trips through JSON (:meth:`save`, :meth:`load`) and renders as a table in
    a notebook.

    The optimizer step: ``segments[step_segment]`` is the plain step (all parameters in one ``opt.step()``); the
    unit-by-unit step that state placements use is described by each unit's ``step_time`` / ``step_rel_peak`` and,
    for the parameters outside units (stepped first), ``outside_step_time`` / ``outside_step_rel_peak``;
    ``chunked_step_time`` is that whole step's seconds (0 when no optimizer was given).
    """

    units: list[UnitProfile]
    segments: list[Segment]
    groups: list[StorageGroup]
    device: DeviceSpec
    peak_bytes: int
    step_time: float
    start_level: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    input_bytes: int
    unattributed_bytes: int
    batch_size: int | None
    fingerprint: tuple[dict[str, Any], ...]
    excluded: list[dict[str, str]] = field(default_factory=list)
    coverage: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)
    step_segment: int = -1
    outside_step_time: float = 0.0
    outside_step_rel_peak: int = 0
    chunked_step_time: float = 0.0

    def __post_init__(self) -> None:
        self._model_ref: weakref.ref | None = None
        self._optimizer_ref: weakref.ref | None = None
        if self.step_segment < 0:  # schema 1: the optimizer step is the segment that ends at "optimizer_end"
            self.step_segment = next((i for i, sg in enumerate(self.segments) if sg.label == "to optimizer_end"), -1)

    # ------------------------------------------------------------------ convenience
    @property
    def n_units(self) -> int:
        return len(self.units)

    @property
    def unit_names(self) -> list[str]:
        return [u.name for u in self.units]

    @property
    def model(self) -> nn.Module | None:
        """The profiled model, while it is alive in this session (not saved to JSON)."""
        return self._model_ref() if self._model_ref is not None else None

    def unit(self, name: str) -> UnitProfile:
        for u in self.units:
            if u.name == name:
                return u
        raise ProfileError(f"no unit named {name!r}; units: {', '.join(self.unit_names)}")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        d = {
            "format": PROFILE_FORMAT,
            "schema_version": PROFILE_SCHEMA,
            **{f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)
               if f.name not in ("units", "segments", "groups", "device")},
        }  # copies: a profile made from this dict shares nothing with this one
        d["units"] = [dataclasses.asdict(u) for u in self.units]
        d["segments"] = [dataclasses.asdict(s) for s in self.segments]
        d["groups"] = [dataclasses.asdict(g) for g in self.groups]
        d["device"] = self.device.to_dict()
        d["fingerprint"] = [dict(f) for f in self.fingerprint]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError("not a memopt_nb profile (missing \"format\": \"memopt_nb.profile\")")
        if not isinstance(data.get("schema_version"), int) or data["schema_version"] > PROFILE_SCHEMA:
            raise ProfileError(f"profile schema {data.get('schema_version')!r} is not readable by this memopt_nb "
                               f"(reads up to {PROFILE_SCHEMA})")
        try:
            kw = {k: v for k, v in data.items() if k not in ("format", "schema_version")}
            kw["units"] = [UnitProfile(**u) for u in kw["units"]]
            kw["segments"] = [Segment(**s) for s in kw["segments"]]
            kw["groups"] = [StorageGroup(**{**g, "savers": tuple(g["savers"]), "consumers": tuple(g["consumers"])})
                            for g in kw["groups"]]
            kw["device"] = DeviceSpec.from_dict(kw["device"])
            kw["fingerprint"] = tuple(kw["fingerprint"])
            return cls(**kw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"corrupt profile: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ProfileError(f"corrupt profile file: not valid JSON ({exc.msg})") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> ModelProfile:
        return cls.from_json(Path(path).read_text())

    # ------------------------------------------------------------------ display
    def summary(self) -> str:
        amp = f" under autocast {self.meta['autocast']}" if self.meta.get("autocast") else ""
        ext = self.meta.get("extrapolation") if self.meta.get("method") == "extrapolated" else None
        how = (f", extrapolated to batch {self.batch_size} from batches "
               f"{' and '.join(map(str, ext.get('fitted_batches') or ext.get('batches') or []))} (it did not fit)"
               if isinstance(ext, dict) else "")
        return (f"{self.meta.get('model_class', 'model')}: {self.n_units} units, peak {format_bytes(self.peak_bytes)}, "
                f"step {self.step_time * 1e3:.1f} ms on {self.device.name}{amp}{how}")

    def __repr__(self) -> str:
        return f"<ModelProfile {self.summary()}>"

    def _floor_html(self) -> str:
        """The smallest peak any plan reaches on the profiled device and what bounds it (see :mod:`memopt_nb.floor`)."""
        from .floor import explain_floor

        try:
            floor = explain_floor(self, offload_state=True)  # the planners' default space
        except Exception as exc:  # noqa: BLE001 - a display must not fail
            return f"<p>smallest reachable peak: not computed ({html.escape(type(exc).__name__)}: " \
                   f"{html.escape(str(exc))})</p>"
        advice = ("<br>To lower it: " + html.escape("; ".join(floor.advice)) + ".") if floor.advice else ""
        return (f"<p><b>Smallest reachable peak (any plan): {format_bytes(floor.floor_bytes)}</b> = "
                f"{html.escape(floor.breakdown_text())}.<br>{html.escape(floor.bound_text())}{advice}</p>")

    def hierarchy(self) -> list[tuple[int, str, int | None]]:
        """The units as a tree, for display: ``(depth, module name, unit index or None)`` in forward order; rows with
        ``None`` are the modules ``units="fine"`` split into their children (``meta["split"]``), each just above its
        first child. Without splits: one row per unit, all at depth 0."""
        split = sorted(self.meta.get("split") or {}, key=len)
        rows: list[tuple[int, str, int | None]] = []
        shown: list[str] = []  # the split ancestors of the previous unit, outermost first
        for u in self.units:
            chain = [p for p in split if u.name.startswith(p + ".")]
            common = 0
            while common < min(len(chain), len(shown)) and chain[common] == shown[common]:
                common += 1
            rows.extend((depth, chain[depth], None) for depth in range(common, len(chain)))
            shown = chain
            rows.append((len(chain), u.name, u.index))
        return rows

    def _repr_html_(self) -> str:
        numbered = any(u.name != str(u.index) for u in self.units)  # nn.Sequential children: the name is the index
        split = self.meta.get("split") or {}
        parents: list[str] = []
        cells = []
        for depth, name, index in self.hierarchy():
            parents = parents[:depth]
            label = name[len(parents[-1]) + 1:] if parents else name
            if index is None:
                cells.append(f'<tr><td colspan="{10 if numbered else 9}" style="text-align:left;padding-left:'
                             f'{1.2 * depth:.1f}em"><b>{html.escape(label)}</b> ({html.escape(split.get(name, ""))}, '
                             "split into the units below)</td></tr>")
                parents.append(name)
            else:
                cells.append(self._unit_row(self.units[index], numbered, depth, label))
        rows = "".join(cells)
        totals = (f"peak {format_bytes(self.peak_bytes)} · step {self.step_time * 1e3:.1f} ms · params "
                  f"{format_bytes(self.param_bytes)} · optimizer state {format_bytes(self.optimizer_state_bytes)} · "
                  f"not in units {format_bytes(self.unattributed_bytes)} · units cover {self.coverage:.0%} of saved "
                  f"bytes · device {html.escape(self.device.name)}")
        excluded = ""
        if self.excluded:
            excluded = "<p>excluded: " + "; ".join(html.escape(f"{e['name']} ({e['reason']})")
                                                   for e in self.excluded) + "</p>"
        head = ("<th>#</th>" if numbered else "") + (
            "<th>unit</th><th>type</th><th>fwd ms</th><th>bwd ms</th>"
            '<th title="activations the unit saves for backward">saved</th>'
            '<th title="saved bytes that recomputing the unit frees (made and used only inside it)">freed by '
            "recompute</th><th>output</th><th>params</th>"
            '<th title="random ops (dropout): recompute replays their random numbers; running stats (BatchNorm): '
            'recompute does not update them twice">notes</th>')
        return (
            f"<div><b>{html.escape(self.summary())}</b><p>{totals}</p>{self._floor_html()}{excluded}<table><thead>"
            f"<tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
        )

    @staticmethod
    def _unit_row(u: UnitProfile, numbered: bool, depth: int = 0, label: str | None = None) -> str:
        pad = f' style="padding-left:{1.2 * depth:.1f}em" title="{html.escape(u.name)}"' if depth else ""
        return (
            "<tr>" + (f"<td>{u.index}</td>" if numbered else "") +
            f"<td{pad}>{html.escape(label if label is not None else u.name)}</td><td>{html.escape(u.type)}</td>"
            f"<td>{u.fwd_time * 1e3:.2f}</td><td>{u.bwd_time * 1e3:.2f}</td><td>{format_bytes(u.saved_bytes)}</td>"
            f"<td>{format_bytes(u.interior_bytes)}</td><td>{format_bytes(u.output_bytes)}</td>"
            f"<td>{format_bytes(u.param_bytes)}</td>"
            f"<td>{', '.join(f for f, on in (('random ops', u.has_rng), ('running stats', u.has_running_stats)) if on)}"
            f"{_effects_html(u)}</td></tr>")


def _effects_html(u: UnitProfile) -> str:
    out = ""
    if u.side_effects:
        out += f' <span title="{html.escape(u.side_effects)}">state</span>'
    if not u.recomputable:
        reason = u.not_recomputable_reason or "marked so"
        out += f" <b>not recomputable</b>: {html.escape(reason)}"
    return out


# ====================================================================== forward side effects
def _refuse_own_checkpointing(model: nn.Module, effects: ForwardEffects) -> None:
    """A model that checkpoints its own blocks cannot be profiled: the profile would see recompute as "keep"."""
    if not effects.own_checkpointing:
        return
    shown = ", ".join(repr(n) for n in effects.own_checkpointing[:4]) + (
        " …" if len(effects.own_checkpointing) > 4 else "")
    how = ("call model.gradient_checkpointing_disable() (Hugging Face models) before profiling"
           if hasattr(model, "gradient_checkpointing_disable") else
           "remove the torch.utils.checkpoint call from its forward (or the option that enables it)")
    raise ProfileError(
        f"{type(model).__name__} already runs {shown} under torch.utils.checkpoint (its own activation "
        f"checkpointing); memopt cannot profile or plan a model that checkpoints itself. Turn that off — {how} — "
        "and let a plan choose recompute where it pays (Plan.uniform(profile, 'recompute') does what it did)")


def _mark_side_effects(prof: ModelProfile, effects: ForwardEffects) -> None:
    """Record each unit's forward side effects; a unit whose recomputation cannot be exact is not recomputable.

    The reason also goes into the unit's fingerprint entry, so a plan made from this profile carries it and applying
    a plan that recomputes the unit is refused before anything runs.
    """
    for u, fp in zip(prof.units, prof.fingerprint, strict=True):
        u.side_effects, reason = effects.for_unit(u.name)
        if reason:
            u.recomputable = False
            u.not_recomputable_reason = reason
            fp["not_recomputable"] = reason


# ====================================================================== unit selection
def _container_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of ModuleList/Sequential containers, outermost first, expanding nested containers."""
    out: list[tuple[str, nn.Module]] = []
    # module-level recursion: a nested function that calls itself is a reference cycle, which would keep the model
    # (and its device memory) alive after the caller drops it, until Python's gc ran
    _visit_containers(model, {m: n for n, m in model.named_modules()}, out)
    return out


def _is_container(m: nn.Module) -> bool:
    # a list of blocks, not a short sequence of plain layers (conv, norm, activation)
    return (isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2
            and any(len(list(c.children())) > 0 for c in m.children()))


def _visit_containers(m: nn.Module, names: dict[nn.Module, str], out: list[tuple[str, nn.Module]]) -> None:
    if _is_container(m):
        for child in m.children():
            if _is_container(child):
                _visit_containers(child, names, out)
            else:
                out.append((names[child], child))
        return
    for child in m.children():
        _visit_containers(child, names, out)


def _select_units(model: nn.Module, units: Any, info: dict[str, dict[str, Any]],
                  split: dict[str, str] | None = None) -> tuple[list[str], list[dict]]:
    """Pick unit names; returns (names in forward order, excluded with reasons). ``split`` receives, for
    ``units="fine"``, each module split into its children -> its class name."""
    all_names = [n for n, _ in model.named_modules() if n]
    if units == "fine":
        blocks, excluded = _select_units(model, "auto", info)
        return _split_largest(model, blocks, info, split if split is not None else {}), excluded
    if isinstance(units, str) and units != "auto":
        units = [units]
    if units == "auto":
        candidates = [n for n, _ in _container_children(model)]
        usable = [n for n in candidates if info[n]["calls"] == 1 and info[n]["backward"]]
        if len(usable) < 2 or len(usable) > 64:
            best = None
            for depth in range(1, 6):
                names = [n for n in all_names if n.count(".") == depth - 1]
                ok = [n for n in names if info[n]["calls"] == 1 and info[n]["backward"]]
                cover = sum(info[n]["saved"] for n in ok)
                score = (4 <= len(ok) <= 64, cover, -abs(len(ok) - 16))
                if ok and (best is None or score > best[0]):
                    best = (score, names)
            if best is not None and (len(usable) < 2 or best[0][0]):
                candidates = best[1]
    elif isinstance(units, int) and not isinstance(units, bool):
        if units < 1:
            raise ProfileError(f"units as a depth must be >= 1, got {units}")
        candidates = [n for n in all_names if n.count(".") == units - 1]
        if not candidates:
            raise ProfileError(f"the model has no modules at depth {units}")
    elif isinstance(units, (list, tuple)):
        candidates = []
        for n in units:
            if not isinstance(n, str):
                raise ProfileError(f"unit names must be strings, got {n!r}")
            if n not in info:
                close = difflib.get_close_matches(n, all_names, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ProfileError(f"the model has no module named {n!r}{hint}")
            candidates.append(n)
        for i, a in enumerate(candidates):
            for b in candidates[i + 1:]:
                if b.startswith(a + ".") or a.startswith(b + ".") or a == b:
                    raise ProfileError(f"units {a!r} and {b!r} overlap; give modules that do not contain each other")
    else:
        raise ProfileError(f"units must be 'auto', 'fine', an int depth or a list of module names, got {units!r}")
    chosen, excluded = [], []
    for n in candidates:
        calls = info[n]["calls"]
        if calls == 0:
            excluded.append({"name": n, "reason": "not called in forward"})
        elif calls > 1:
            excluded.append({"name": n, "reason": f"called {calls} times per forward"})
        elif not info[n]["backward"]:
            excluded.append({"name": n, "reason": "its output needs no gradient"})
        else:
            chosen.append(n)
    chosen.sort(key=lambda n: info[n]["order"])
    if not chosen:
        raise ProfileError("no usable units: " + "; ".join(f"{e['name']} ({e['reason']})" for e in excluded)
                           if excluded else "the model has no module to plan on; pass units=[...]")
    return chosen, excluded


#: ``units="fine"``: at most this many units, a split only when its children cover this share of the parent's saved
#: bytes (what they leave is saved by the parent's own code between them, which no plan then manages) and its largest
#: child saves at most this share of the parent (else the split does not lower the working set that bounds the floor).
FINE_MAX_UNITS = 64
FINE_MIN_COVER = 0.98
FINE_MAX_CHILD = 0.8


def _split_largest(model: nn.Module, units: list[str], info: dict[str, dict[str, Any]],
                   split: dict[str, str]) -> list[str]:
    """``units="fine"``: repeatedly replace the unit that saves the most bytes by its children, while it can be split.

    The floor of a plan (see :mod:`memopt_nb.floor`) is bounded by the working set of the largest unit: its saved
    bytes come back, or are recomputed, all at once. Splitting it into its direct submodules lowers that, and gives
    the planner finer choices (recompute a layer norm, keep a matmul's output). A unit is split when every one of its
    direct children that runs once with gradient becomes a unit, those children together save at least
    ``FINE_MIN_COVER`` of its saved bytes, the largest saves at most ``FINE_MAX_CHILD`` of them, and the total stays
    within ``FINE_MAX_UNITS``. Splitting stops at the first largest unit that cannot be split: splitting a smaller one
    would not lower the floor. Units never nest; the result may mix depths (a block kept whole next to split ones).
    """
    modules = dict(model.named_modules())
    units = list(units)
    while True:
        largest = max(units, key=lambda n: info[n]["saved"])
        saved = info[largest]["saved"]
        kids = [f"{largest}.{c}" for c, _ in modules[largest].named_children()]
        usable = [k for k in kids if info[k]["calls"] == 1 and info[k]["backward"]]
        if (saved == 0 or not usable or len(units) - 1 + len(usable) > FINE_MAX_UNITS
                or sum(info[k]["saved"] for k in usable) < FINE_MIN_COVER * saved
                or max(info[k]["saved"] for k in usable) > FINE_MAX_CHILD * saved):
            break
        at = units.index(largest)
        units[at:at + 1] = sorted(usable, key=lambda n: info[n]["order"])
        split[largest] = type(modules[largest]).__name__
    return units


class _OpWatcher(TorchDispatchMode):
    """Notes which modules on the stack run random ops."""

    def __init__(self, stack: list[str], rng: set[str]) -> None:
        super().__init__()
        self.stack, self.rng = stack, rng

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self.stack and any(k in func.__name__ for k in _RNG_OPS):
            self.rng.update(self.stack)
        return func(*args, **(kwargs or {}))


def _discover(model: nn.Module, inputs: Sequence[Any],
              kwargs: Mapping[str, Any] | None = None) -> tuple[dict[str, dict[str, Any]], int]:
    """One forward with hooks on every module: call counts, order, saved bytes, backward reach, RNG."""
    info: dict[str, dict[str, Any]] = {n: {"calls": 0, "order": 10**9, "saved": 0, "backward": False, "seen": set()}
                                       for n, _ in model.named_modules()}
    stack: list[str] = []
    rng: set[str] = set()
    order = [0]
    handles = []
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    total = [0]
    all_seen: set[int] = set()

    def pre(name: str) -> Callable:
        def hook(mod: nn.Module, args: Any) -> None:
            d = info[name]
            d["calls"] += 1
            if d["order"] == 10**9:
                d["order"] = order[0]
                order[0] += 1
            stack.append(name)

        return hook

    def post(name: str) -> Callable:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if stack and stack[-1] == name:
                stack.pop()
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out)):
                info[name]["backward"] = True

        return hook

    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(pre(name)))
            handles.append(mod.register_forward_hook(post(name)))

    def pack(t: torch.Tensor) -> torch.Tensor:
        if is_plain(t):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in param_ptrs and st.nbytes() > 0:
                if ptr not in all_seen:
                    all_seen.add(ptr)
                    total[0] += st.nbytes()
                for name in stack:
                    if ptr not in info[name]["seen"]:
                        info[name]["seen"].add(ptr)
                        info[name]["saved"] += st.nbytes()
        # never ``t`` itself: a tensor an op saves of its own output would then hold its autograd node through the
        # node's saved variable — a cycle through C++ the garbage collector cannot see, keeping the whole model alive
        return t.detach()

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _OpWatcher(stack, rng):
            out = _forward(model, inputs, kwargs or {})
        del out
    finally:
        for h in handles:
            h.remove()
    for name in rng:
        info[name]["rng"] = True
    for d in info.values():
        d.pop("seen")
    return info, total[0]


# ====================================================================== instrumented runs
class _SInfo:
    __slots__ = ("nbytes", "producer", "savers", "consumers", "outside", "free_pos", "weak", "outside_release",
                 "release_pos", "death_seg", "late", "__weakref__")

    def __init__(self, st: torch.UntypedStorage, producer: int) -> None:
        self.nbytes = st.nbytes()
        self.producer = producer
        self.savers: set[int] = set()
        self.consumers: set[int] = set()
        self.outside = False
        self.free_pos: int | None = None
        self.outside_release: int | None = None
        self.release_pos: int | None = None
        self.death_seg: int | None = None  # the segment in which the storage was freed, and what it adds there
        self.late = 0  # to the segment's peak when held past it (see StorageGroup.late_bytes)
        self.weak = weakref.ref(st)  # never a strong reference: handles keep saved storages alive, as autograd would


class _Handle:
    __slots__ = ("st", "offset", "size", "stride", "dtype")

    def __init__(self, st: torch.UntypedStorage, t: torch.Tensor) -> None:
        self.st, self.offset, self.size, self.stride, self.dtype = st, t.storage_offset(), t.size(), t.stride(), t.dtype


class _OutsideRef:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _unpack(h: Any) -> torch.Tensor:
    if isinstance(h, torch.Tensor):
        return h
    if isinstance(h, _OutsideRef):
        return h.t
    return tensor_on(h.st, h.dtype, h.offset, h.size, h.stride)


class _Run:
    """Instrumentation for one profiled step: marks at unit boundaries and, in observe mode, storage bookkeeping."""

    def __init__(self, model: nn.Module, unit_names: list[str], mark: Callable[[Any], None], *, observe: bool,
                 recompute: bool, save_ops: Mapping[int, Any] | None = None,
                 split: Callable[[int | None], int] | None = None) -> None:
        self.model = model
        # observe mode with a meter: when a storage dies, ``split`` closes a part of the segment's peak there, so the
        # peak after its death is known (StorageGroup.late_bytes)
        self.split = split
        self.finalizers: list[weakref.finalize] = []
        self.deaths: list[tuple[_SInfo, int]] = []  # this segment's deaths: (info, index of the part after it)
        self.parts: list[int] = []  # this segment's closed parts' peaks
        self.save_ops = dict(save_ops or {})  # with recompute: units run selective with these op outputs kept
        self.names = unit_names
        self.modules = [model.get_submodule(n) for n in unit_names]
        self.mark = mark
        self.observe = observe
        self.recompute = recompute
        self.n_marks = 0
        # per storage seen, by id of its Python object while it lives (a dead storage's id is reused by a new one,
        # whose info then takes the slot); every info ever made stays in ``all_infos``
        self.infos: dict[int, _SInfo] = {}
        self.all_infos: list[_SInfo] = []
        self.produced: dict[int, tuple[weakref.ref, int]] = {}
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.hook_events: dict[int, tuple[list[tuple[str, int]], int]] = {}
        self.pending_inputs: dict[int, int] = {}
        self.unit_io: dict[int, tuple[list[list[int]], list[list[int]], int, int]] = {}
        self._installed: list[tuple[nn.Module, Any]] = []
        self.bwd_started: set[int] = set()
        self.forward_done = False
        self.grads_done: dict[int, int] = {}  # unit -> level when its last gradient was accumulated
        self.outside_refs: list[weakref.ref] = []  # the markers _outside_pack made

    def release(self) -> None:
        """After a step that failed before its backward was done (out of memory): let go of the tensors the markers
        hold. A marker of a tensor its own node saves (a softmax's output) is a cycle through autograd's C++ graph
        that the garbage collector cannot see; left alone it would keep the failed step's memory."""
        for ref in self.outside_refs:
            marker = ref()
            if marker is not None:
                marker.t = None
        self.outside_refs.clear()

    # -- marks
    def _mark(self, label: Any) -> int:
        if self.deaths:
            self._settle_deaths()
        self.mark(label)
        self.n_marks += 1
        pos = self.n_marks - 1
        if label[0] == "forward_end":
            self.forward_done = True
        if self.observe and self.forward_done:
            self._scan_release(pos)
        return pos

    # -- storage bookkeeping (observe mode)
    def _info(self, st: torch.UntypedStorage, producer: int) -> _SInfo:
        inf = self.infos.get(id(st))
        if inf is None or inf.weak() is not st:
            inf = _SInfo(st, producer)
            self.infos[id(st)] = inf
            self.all_infos.append(inf)
            if self.split is not None:
                self.finalizers.append(weakref.finalize(st, self._died, weakref.ref(inf), id(st)))
        return inf

    def _died(self, ref: weakref.ref, key: int) -> None:
        inf = ref()
        if inf is None or self.split is None or self.n_marks == 0:
            return
        self.parts.append(self.split(key))
        self.deaths.append((inf, len(self.parts)))

    def _settle_deaths(self) -> None:
        """At the end of a segment in which observed storages died: what each adds to the segment's peak if a plan
        holds it past the segment. Storage ``i`` (in order of death, ``b_i`` bytes, ``A_i`` the peak after its death,
        ``P`` the segment's) adds ``max(0, b_i - (S_i - S_{i-1}))`` with ``S_i = P - A_i`` (``S_0 = 0``): the room
        below the peak after it, less what earlier deaths' shares used up: exact for the first (or only) one, never
        short for any set held together, possibly over for a later one held alone."""
        self.parts.append(self.split(None))
        top = max(self.parts)
        room_before = 0
        for inf, after in self.deaths:
            room = top - max(self.parts[after:])
            inf.death_seg = self.n_marks - 1
            inf.late = max(0, inf.nbytes - (room - room_before))
            room_before = room
        self.deaths.clear()
        self.parts.clear()

    def stop_watching(self) -> None:
        """Deaths after the step (the run's last segment is over) tell nothing: stop following them."""
        self.split = None
        for f in self.finalizers:
            f.detach()
        self.finalizers.clear()
        self.deaths.clear()
        self.parts.clear()

    def _producer_of(self, st: torch.UntypedStorage) -> int:
        entry = self.produced.get(id(st))
        if entry is not None and entry[0]() is st:
            return entry[1]
        return -1

    def _scan(self, pos: int) -> None:
        for inf in self.all_infos:
            if inf.free_pos is not None:
                continue
            st = inf.weak()  # holding the Python storage object adds exactly one reference
            if st is None or use_count(st) <= 1:
                inf.free_pos = pos

    def _scan_release(self, pos: int) -> None:
        # after the forward: when what was still referenced at its end (a model output, a KV cache) is let go of
        for inf in self.all_infos:
            if inf.free_pos is not None or inf.release_pos is not None:
                continue
            st = inf.weak()
            if st is None or use_count(st) <= 1:
                inf.release_pos = pos

    def _outside_pack(self, t: torch.Tensor) -> Any:
        if is_plain(t):
            st = t.untyped_storage()
            if st.data_ptr() not in self.param_ptrs and st.nbytes() > 0:
                inf = self._info(st, self._producer_of(st))
                inf.outside = True
                # a direct reference (like autograd's own), plus a marker that tells when that code's backward is done
                marker = _OutsideRef(t)
                weakref.finalize(marker, self._outside_released, inf)
                self.outside_refs.append(weakref.ref(marker))
                return marker
        return t

    def _outside_released(self, inf: _SInfo) -> None:
        inf.outside_release = max(inf.outside_release or 0, self.n_marks - 1)

    def outer_hooks(self) -> Any:
        if not self.observe:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._outside_pack, _unpack)

    # -- backward marks: one hook per tensor, "end" events before "start" events
    def _tensor_event(self, t: torch.Tensor, kind: str, unit: int) -> None:
        key = id(t)
        entry = self.hook_events.get(key)
        if entry is not None and entry[1] is not None and entry[1]() is t:
            entry[0].append((kind, unit))
            return
        events: list[tuple[str, int]] = [(kind, unit)]
        self.hook_events[key] = (events, weakref.ref(t))

        def hook(grad: torch.Tensor) -> None:
            for k, u in sorted(events, key=lambda e: (e[0] != "end", -e[1])):
                if k == "end":
                    left = self.pending_inputs.get(u, 0) - 1
                    self.pending_inputs[u] = left
                    if left == 0:
                        self._mark(("bwd_end", u))
                elif u not in self.bwd_started:
                    self.bwd_started.add(u)
                    self._mark(("bwd_start", u))

        t.register_hook(hook)

    # -- unit wrappers
    def install(self) -> None:
        for index, module in enumerate(self.modules):
            previous = module.__dict__.get("forward")
            inner = previous or type(module).forward.__get__(module, type(module))
            module.forward = self._wrapper(index, module, inner)
            self._installed.append((module, previous))

    def remove(self) -> None:
        for module, previous in reversed(self._installed):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._installed.clear()

    def _wrapper(self, index: int, module: nn.Module, inner: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            pos = self._mark(("fwd_start", index))
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            grad_inputs = {id(t): t for t in leaves if t.requires_grad}
            self.pending_inputs[index] = len(grad_inputs)
            for t in grad_inputs.values():
                self._tensor_event(t, "end", index)
            in_ptrs = set()
            # a recomputed unit keeps the tensors of a cache passed in (its copy of the cache before the forward)
            held = [t for a in [*args, *kwargs.values()] if is_cache(a) for t in cache_tensors(a)]
            for t in [*leaves, *held]:
                if t.layout == torch.strided and not t.is_meta:
                    st = t.untyped_storage()
                    in_ptrs.add(id(st))
                    if self.observe and st.data_ptr() not in self.param_ptrs and st.nbytes() > 0:
                        self._info(st, self._producer_of(st)).consumers.add(index)
            if self.observe:
                self._scan(pos)
            if self.recompute:
                out = checkpointed(module, inner, args, kwargs, save_ops=self.save_ops.get(index))
            elif self.observe:
                ptrs = self.param_ptrs

                def pack(t: torch.Tensor) -> Any:
                    if not is_plain(t):
                        return t
                    st = t.untyped_storage()
                    if st.data_ptr() in ptrs or st.nbytes() == 0:
                        return t
                    inf = self._info(st, self._producer_of(st) if id(st) in in_ptrs else index)
                    inf.savers.add(index)
                    return _Handle(st, t)

                with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                    out = inner(*args, **kwargs)
            else:
                out = inner(*args, **kwargs)
            pos = self._mark(("fwd_end", index))
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            for t in outs:
                if t.layout == torch.strided and not t.is_meta:
                    st = t.untyped_storage()
                    if id(st) not in in_ptrs:
                        self.produced[id(st)] = (weakref.ref(st), index)
                if t.requires_grad:
                    self._tensor_event(t, "start", index)
            if self.observe:
                self._scan(pos)
                self.unit_io[index] = (
                    [list(t.shape) for t in leaves],
                    [list(t.shape) for t in outs],
                    _unique_bytes(leaves),
                    _unique_bytes(outs),
                )
            return out

        return forward


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.layout != torch.strided or t.is_meta:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def _tracked_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any, names: list[str],
                  device: torch.device, *, observe: bool, recompute: bool,
                  kwargs: Mapping[str, Any] | None = None,
                  save_ops: Mapping[int, Any] | None = None) -> tuple[list, _Run, int]:
    meter = meter_for(device)
    meter.track(model, optimizer, list(inputs), kwargs)
    meter.reset_peak()
    run = _Run(model, names, meter.mark, observe=observe, recompute=recompute, save_ops=save_ops,
               split=meter.split if observe else None)
    run.install()
    handles = _watch_grads_done(run.modules, lambda u: run.grads_done.setdefault(u, int(meter.current)))
    try:
        with meter:
            run._mark(("step_start", -1))
            with run.outer_hooks():
                training_step(model, inputs, loss_fn, optimizer, mark=lambda label: run._mark((label, -1)),
                              kwargs=kwargs)
            run.stop_watching()
    except BaseException:
        run.release()
        raise
    finally:
        for h in handles:
            h.remove()
        run.stop_watching()
        run.remove()
    return meter.marks, run, int(meter.peak)


def _watch_grads_done(modules: list[nn.Module], done: Callable[[int], None]) -> list[Any]:
    """Call ``done(u)`` when backward has accumulated the gradient of every trainable parameter of unit ``u`` (the
    moment the runtime steps a unit in backward)."""
    handles = []
    for u, mod in enumerate(modules):
        params = [p for p in mod.parameters() if p.requires_grad]
        seen: set[int] = set()

        def hook(p: nn.Parameter, u: int = u, seen: set[int] = seen, want: int = len(params)) -> None:
            seen.add(id(p))
            if len(seen) == want:
                done(u)

        handles += [p.register_post_accumulate_grad_hook(hook) for p in params]
    return handles


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[Any] = []

    def mark(self, label: Any) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.stamps.append((label, ev))
        else:
            self.stamps.append((label, time.perf_counter()))

    def durations(self) -> list[float]:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
            evs = [e for _, e in self.stamps]
            return [evs[i].elapsed_time(evs[i + 1]) / 1e3 for i in range(len(evs) - 1)]
        ts = [t for _, t in self.stamps]
        return [ts[i + 1] - ts[i] for i in range(len(ts) - 1)]


def _timed_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any, names: list[str],
                device: torch.device, kwargs: Mapping[str, Any] | None = None, *, recompute: bool = False,
                save_ops: Mapping[int, Any] | None = None) -> tuple[list[Any], list[float]]:
    clock = _Clock(device)
    run = _Run(model, names, clock.mark, observe=False, recompute=recompute, save_ops=save_ops)
    run.install()
    try:
        if device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(device)
        run._mark(("step_start", -1))
        training_step(model, inputs, loss_fn, optimizer, mark=lambda label: run._mark((label, -1)), kwargs=kwargs)
    finally:
        run.remove()
    return [lab for lab, _ in clock.stamps], clock.durations()


# ====================================================================== building the profile
def _segments_from(marks: list[tuple[Any, int, int]], n_units: int) -> tuple[list[Segment], dict, dict]:
    segs: list[Segment] = []
    fwd_seg, bwd_seg = {}, {}
    for i in range(len(marks) - 1):
        (label, level, _), (nlabel, _, peak) = marks[i], marks[i + 1]
        kind, unit = label
        if kind == "fwd_start" and nlabel == ("fwd_end", unit):
            seg = Segment("fwd", unit, f"fwd {unit}", 0.0, level, max(0, peak - level))
            fwd_seg[unit] = len(segs)
        elif kind == "bwd_start":
            seg = Segment("bwd", unit, f"bwd {unit}", 0.0, level, max(0, peak - level))
            bwd_seg[unit] = len(segs)
        else:
            seg = Segment("other", -1, f"to {nlabel[0]}" + (f" {nlabel[1]}" if nlabel[1] >= 0 else ""), 0.0, level,
                          max(0, peak - level))
        segs.append(seg)
    missing = [u for u in range(n_units) if u not in fwd_seg or u not in bwd_seg]
    if missing:
        raise ProfileError(f"units {missing} did not run a forward and a backward exactly once in the step")
    return segs, fwd_seg, bwd_seg


def _save_sets(proposed: dict[int, dict[str, dict[str, Any]]], sac_marks: dict[str, list], rc_marks: list,
               labels_ref: list, segs: list[Segment], fwd_seg: dict, bwd_seg: dict,
               rc_time: list[float] | None = None,
               sac_time: dict[str, list[float]] | None = None) -> tuple[dict[int, dict], list]:
    """Each unit's measured save-sets from the selective steps' marks against the all-recompute step's, and what
    could not be measured (as notes).

    ``recompute_time``: the simulator charges a recomputed unit its forward time; a selective unit is charged that
    times what selective adds to the unit's forward and backward over keeping, divided by what recompute adds (timed
    steps, medians; within 0..2), and the op-time estimate (the share of the unit's op time its kept calls do not
    save) where recompute added nothing measurable."""
    out: dict[int, dict[str, dict[str, Any]]] = {i: {} for i in proposed}
    notes = []
    for name, marks in sac_marks.items():
        if [m[0] for m in marks] != labels_ref or [m[0] for m in rc_marks] != labels_ref:
            notes.append(f"{name}: the step ran differently under selective checkpointing; not offered")
            continue
        diff = [m[1] - r[1] for m, r in zip(marks, rc_marks, strict=True)]  # kept bytes at each mark
        for i, sets in proposed.items():
            if name not in sets:
                continue
            f, b = fwd_seg[i], bwd_seg[i]
            held = diff[f + 1] - diff[f]
            if held < 0 or diff[b + 1] - diff[b] != -held:  # not held from its forward to its backward alone
                notes.append(f"{name} of unit {i}: kept bytes not released at its backward; not offered")
                continue
            out[i][name] = {
                "ops": sets[name]["ops"],
                "held_bytes": int(held),
                "recompute_time": _selective_time(sets[name]["fraction"], segs, f, b, rc_time,
                                                  (sac_time or {}).get(name)),
                "fwd_rel_peak": int(max(0, marks[f + 1][2] - marks[f][1])),
                "bwd_rel_peak": int(max(0, marks[b + 1][2] - marks[b][1])),
            }
    for sets in out.values():
        mark_pareto(sets)
    return out, notes


def _selective_time(fraction: float, segs: list[Segment], f: int, b: int, rc_time: list[float] | None,
                    sel_time: list[float] | None) -> float:
    """Seconds a selective unit adds (see :func:`_save_sets`)."""
    fwd = segs[f].time
    estimate = (1.0 - fraction) * fwd
    if rc_time is None or sel_time is None:
        return estimate
    keep = segs[f].time + segs[b].time
    rc_extra = rc_time[f] + rc_time[b] - keep
    if rc_extra <= 0.02 * keep:  # recompute added nothing measurable: nothing to scale by
        return estimate
    return fwd * min(2.0, max(0.0, (sel_time[f] + sel_time[b] - keep) / rc_extra))


#: profile()'s own keyword options; every other keyword goes to the model.
PROFILE_OPTIONS = ("loss_fn", "optimizer", "units", "repeats", "device", "model_kwargs", "selective", "autocast",
                   "batch_dim", "batch_fn")


def _forward(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """One forward as the training step makes it (under the profile's ``autocast``, if any)."""
    with forward_autocast():
        return model(*inputs, **kwargs)


def profile(model: nn.Module, *example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
            optimizer: torch.optim.Optimizer | None = None, units: Any = "auto", repeats: int = 3,
            device: DeviceSpec | None = None, model_kwargs: Mapping[str, Any] | None = None,
            selective: bool = False, autocast: torch.dtype | str | None = None, batch_dim: int | None = 0,
            batch_fn: Callable[[int], Any] | None = None, **example_kwargs: Any) -> ModelProfile:
    """Profile one training step of ``model`` on ``example_inputs``.

    The model is called as ``model(*example_inputs, **example_kwargs)``, as you call it in training:
    ``memopt.profile(model, input_ids=ids, attention_mask=mask, labels=ids, loss_fn=lambda out: out.loss)``.

    Args:
        model: the model, on the device it trains on.
        example_inputs: positional inputs of ``model(...)``, at the batch size you train with.
        example_kwargs: keyword inputs of ``model(...)``: every keyword that is not one of profile()'s own options
            (``loss_fn``, ``optimizer``, ``units``, ``repeats``, ``device``, ``model_kwargs``, ``selective``,
            ``autocast``) goes to the model.
        model_kwargs: the same as a dict, for a model keyword named like one of those options
            (``model_kwargs={"device": ...}``); may be combined with ``example_kwargs``.
        loss_fn: ``loss_fn(output) -> scalar``; by default the output itself if scalar, else its sum.
        optimizer: the optimizer you train with (its state counts towards memory); optional.
        units: ``"auto"`` (repeated blocks: children of ModuleList/Sequential containers, about 4–64 of them),
            ``"fine"`` (those blocks, then the unit that saves the most split into its submodules while that lowers
            the largest unit, up to 64 units; a transformer block becomes attention, MLP and norms — plans reach a
            lower floor and can recompute the cheap parts only; see ``_split_largest``), a list of qualified module
            names (units must not contain each other), or an int depth in the module tree.
        repeats: timed steps; times are medians.
        device: the DeviceSpec of the device measured (detected by default).
        selective: also measure, per unit, the save-sets selective checkpointing may keep (``UnitProfile.save_sets``,
            see :mod:`memopt_nb.opsets`): what planners need for ``strategies=`` with ``"selective"``. Costs one
            forward, one profiled step per save-set found (up to three) and ``repeats`` timed steps each of plain
            recompute and of every save-set.
        autocast: mixed precision as your loop uses it: ``torch.bfloat16`` or ``torch.float16`` (or ``"bf16"``,
            ``"fp16"``) runs every forward and the loss under ``torch.autocast(device_type, dtype=...)`` and backward
            and the optimizer step outside, as ``with torch.autocast(...): loss = loss_fn(model(x))`` then
            ``loss.backward()`` does. Profile the way you train: a profile made without autocast does not predict a
            loop with it. Calling ``profile`` inside ``torch.autocast`` raises :class:`ProfileError` (its backward
            would run under autocast too, and autocast's weight cache would live through it).
        batch_dim, batch_fn: where the unplanned step runs out of memory (``torch.OutOfMemoryError``: a full GPU, or
            :func:`memopt_nb.limit_memory`), the profile is made at smaller batches that fit and extrapolated to this
            one (:mod:`memopt_nb.profile_fallback`; ``meta["method"] == "extrapolated"``). The smaller batches slice
            the input tensors along ``batch_dim`` (default 0; ``None`` forbids it), or come from
            ``batch_fn(b) -> (inputs, loss_fn)`` (a tuple of positional or a dict of keyword inputs) where the loss
            function holds targets of the full batch. A step that fits is profiled as always
            (``meta["method"] == "measured"``).

    The model, optimizer and RNG state are restored afterwards. Modules that run more than once per forward, not at
    all, or whose output needs no gradient are excluded and listed in ``profile.excluded``.
    """
    if not isinstance(model, nn.Module):
        raise ProfileError(f"profile() needs a torch.nn.Module, got {type(model).__name__}")
    from .profile_fallback import extrapolating, profile_or_extrapolate

    if not extrapolating():  # the step as it is; where it runs out of memory, smaller batches extrapolated
        options = dict(loss_fn=loss_fn, optimizer=optimizer, units=units, repeats=repeats, device=device,
                       model_kwargs=model_kwargs, selective=selective, autocast=autocast)
        return profile_or_extrapolate(profile, model, example_inputs, options, example_kwargs, batch_dim, batch_fn)
    from .distributed import check_plain

    check_plain(model, "profile")  # DDP / FSDP2: profile the plain model, then wrap it (memopt_nb.distributed)
    kwargs = model_keywords(model, "profile", PROFILE_OPTIONS, model_kwargs, example_kwargs)
    if not example_inputs and not kwargs:
        raise ProfileError("profile() needs example inputs: memopt.profile(model, x) with x a batch of inputs, or "
                           "keyword inputs as the model takes them, e.g. memopt.profile(model, input_ids=ids)")
    if loss_fn is not None and not callable(loss_fn):
        raise ProfileError("loss_fn must be callable: loss_fn(output) -> scalar tensor")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ProfileError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be a positive int, got {repeats!r}")
    dev = model_device(model, example_inputs, kwargs)
    amp = resolve_autocast(autocast, dev, "profile")
    spec = device if device is not None else DeviceSpec.detect(dev)
    inputs = tuple(example_inputs)
    t_start = time.perf_counter()
    with preserved_state(model, optimizer), step_autocast(dev.type, amp):
        try:
            training_step(model, inputs, loss_fn, optimizer, kwargs=kwargs)  # warm-up: optimizer state, lazy init
        except ProfileError:
            raise
        except Exception as exc:
            raise ProfileError(f"a training step of the model failed before profiling: {type(exc).__name__}: {exc}"
                               ) from exc
        effects = forward_side_effects(model, lambda: _forward(model, inputs, kwargs))
        _refuse_own_checkpointing(model, effects)
        info, total_saved = _discover(model, inputs, kwargs)
        split: dict[str, str] = {}
        names, excluded = _select_units(model, units, info, split)
        n = len(names)
        keep_marks, run, peak = _tracked_step(model, inputs, loss_fn, optimizer, names, dev, observe=True,
                                              recompute=False, kwargs=kwargs)
        rc_marks, _, _ = _tracked_step(model, inputs, loss_fn, optimizer, names, dev, observe=False, recompute=True,
                                       kwargs=kwargs)
        timings: list[list[float]] = []
        labels_ref = [m[0] for m in keep_marks]
        proposed: dict[int, dict[str, dict[str, Any]]] = {}
        set_ops: dict[str, dict[int, Any]] = {}  # per save-set, the ops each unit that has it keeps
        if selective:
            calls = record_ops(model, inputs, kwargs, names)
            proposed = {i: propose_save_sets(calls.get(i, [])) for i in range(n)}
            set_ops = {k: ops for k in SAVE_SETS if (ops := {i: p[k]["ops"] for i, p in proposed.items() if k in p})}
        sac_marks = {k: _tracked_step(model, inputs, loss_fn, optimizer, names, dev, observe=False, recompute=True,
                                      kwargs=kwargs, save_ops=ops)[0] for k, ops in set_ops.items()}
        # untimed: the tracked steps leave caches cold
        _timed_step(model, inputs, loss_fn, optimizer, names, dev, kwargs)
        for _ in range(repeats):
            labels, durations = _timed_step(model, inputs, loss_fn, optimizer, names, dev, kwargs)
            if labels != labels_ref:
                raise ProfileError("the step ran differently between repeats (data-dependent control flow?)")
            timings.append(durations)
        sac_times: dict[str, list[list[float]]] = {k: [] for k in set_ops}
        rc_times: list[list[float]] = []
        for _ in range(repeats if set_ops else 0):  # what selective costs, against recompute, measured
            rc_times.append(_timed_step(model, inputs, loss_fn, optimizer, names, dev, kwargs, recompute=True)[1])
            for k, ops in set_ops.items():
                sac_times[k].append(_timed_step(model, inputs, loss_fn, optimizer, names, dev, kwargs, recompute=True,
                                                save_ops=ops)[1])
        static = _static_bytes(model, optimizer)
        modules = dict(model.named_modules())
        unit_params = [list(modules[nm].parameters()) for nm in names]
        state_bytes = _unit_state_bytes(model, optimizer, unit_params, [modules[nm] for nm in names])
        chunked = (_chunked_step(model, inputs, loss_fn, optimizer, unit_params, dev, kwargs)
                   if optimizer is not None else None)
    segs, fwd_seg, bwd_seg = _segments_from(keep_marks, n)
    for i, seg in enumerate(segs):
        seg.time = statistics.median(t[i] for t in timings)
    rc_rel = {}
    if [m[0] for m in rc_marks] == labels_ref:
        for i in range(len(rc_marks) - 1):
            rc_rel[i] = max(0, rc_marks[i + 1][2] - rc_marks[i][1])
    groups = _groups_from(run)
    median = lambda runs: [statistics.median(t[i] for t in runs) for i in range(len(segs))]  # noqa: E731
    save_sets, sac_notes = _save_sets(proposed, sac_marks, rc_marks, labels_ref, segs, fwd_seg, bwd_seg,
                                      median(rc_times) if rc_times else None,
                                      {k: median(v) for k, v in sac_times.items() if v})
    spec_link = spec.has_host_link
    unit_list = []
    for i, name in enumerate(names):
        mod = modules[name]
        saved = sum(g.nbytes for g in groups if i in g.savers)
        interior = sum(g.nbytes for g in groups if g.savers == (i,) and g.producer == i and not g.outside_saver)
        in_shapes, out_shapes, in_bytes, out_bytes = run.unit_io.get(i, ([], [], 0, 0))
        unit_list.append(UnitProfile(
            name=name, index=i, type=type(mod).__name__, fwd_time=segs[fwd_seg[i]].time, bwd_time=segs[bwd_seg[i]].time,
            saved_bytes=saved, interior_bytes=interior, input_bytes=in_bytes, output_bytes=out_bytes,
            param_bytes=sum(p.numel() * p.element_size() for p in mod.parameters()),
            has_rng=bool(info[name].get("rng")), has_running_stats=bool(running_stat_modules(mod)),
            recomputable=True, swappable=spec_link, fwd_segment=fwd_seg[i], bwd_segment=bwd_seg[i],
            rc_fwd_rel_peak=rc_rel.get(fwd_seg[i], segs[fwd_seg[i]].rel_peak),
            rc_bwd_rel_peak=rc_rel.get(bwd_seg[i], segs[bwd_seg[i]].rel_peak + 0),
            input_shapes=in_shapes, output_shapes=out_shapes, **state_bytes[i],
            step_time=chunked[0][i + 1] if chunked else 0.0, step_rel_peak=chunked[1][i + 1] if chunked else 0,
            save_sets=save_sets.get(i, {}),
            grads_done_extra=(run.grads_done[i] - segs[bwd_seg[i] + 1].start_level
                              if i in run.grads_done and bwd_seg[i] + 1 < len(segs) else 0),
        ))
    unit_saved = sum(g.nbytes for g in groups if g.savers)
    batch = None  # the first dimension of the first batched input tensor, positional first, then keyword
    first = next((x for x in [*inputs, *kwargs.values()] if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if first is not None:
        batch = int(first.shape[0])
    prof = ModelProfile(
        units=unit_list, segments=segs, groups=groups, device=spec, peak_bytes=peak,
        step_time=sum(s.time for s in segs), start_level=keep_marks[0][1], param_bytes=static["params"],
        grad_bytes=static["params_trainable"], optimizer_state_bytes=static["optimizer"],
        buffer_bytes=static["buffers"],
        input_bytes=_unique_bytes([x for x in [*inputs, *kwargs.values()] if isinstance(x, torch.Tensor)]),
        unattributed_bytes=max(0, peak - static["params"] - static["params_trainable"] - static["optimizer"]
                               - static["buffers"] - unit_saved),
        batch_size=batch, fingerprint=tuple(unit_fingerprint(nm, modules[nm]) for nm in names), excluded=excluded,
        coverage=(unit_saved / total_saved) if total_saved else 1.0,
        meta={
            "model_class": type(model).__name__,
            "torch_version": torch.__version__,
            "repeats": repeats,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "profile_seconds": round(time.perf_counter() - t_start, 3),
            "rc_marks_matched": bool(rc_rel),
            "model_fingerprint": model_fingerprint(model, names),  # a plan made from this profile refuses other models
            "optimizer_fingerprint": optimizer_fingerprint(optimizer) if optimizer is not None else None,
            "units_rule": units if units in ("auto", "fine") else "depth" if isinstance(units, int) else "names",
            "split": split,  # units="fine": module split into its children -> its class (the table's hierarchy)
            "selective": ({"measured": True, "notes": sac_notes} if selective else None),
            "autocast": autocast_name(amp),  # the forward's, if any
            "method": "measured",  # or "extrapolated" from smaller batches (memopt_nb.profile_fallback)
        },
        step_segment=next((i for i, sg in enumerate(segs) if sg.label == "to optimizer_end"), -1),
        outside_step_time=chunked[0][0] if chunked else 0.0, outside_step_rel_peak=chunked[1][0] if chunked else 0,
        chunked_step_time=chunked[2] if chunked else 0.0,
    )
    _mark_side_effects(prof, effects)
    prof._model_ref = weakref.ref(model)
    if optimizer is not None:
        prof._optimizer_ref = weakref.ref(optimizer)
    return prof


def _unit_state_bytes(model: nn.Module, optimizer: Any, unit_params: list[list[nn.Parameter]],
                      unit_modules: list[nn.Module]) -> list[dict[str, Any]]:
    """Per unit: gradient and movable optimizer-state bytes and storage counts, and whether its parameters can move."""
    in_opt = set()
    if optimizer is not None:
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    owners: dict[int, set[int]] = collections.defaultdict(set)
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)].add(id(m))
    out = []
    for ps, mod in zip(unit_params, unit_modules, strict=True):
        inside = {id(m) for m in mod.modules()}
        grads = [p for p in ps if p.requires_grad and id(p) in in_opt]
        state = []
        for p in grads:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device == p.device:
                    state.append(v)
        offloadable = bool(ps) and all(movable(p) and owners[id(p)] <= inside for p in ps)
        out.append({
            "grad_bytes": sum(p.nbytes for p in grads), "grad_storages": len(grads),
            "optimizer_bytes": sum(v.untyped_storage().nbytes() for v in state), "optimizer_storages": len(state),
            "param_storages": len(ps), "params_offloadable": offloadable,
        })
    return out


class _ChunkedOptimizer:
    """Stands in for the optimizer in a training step: steps the parameters outside units, then each unit's, apart
    (as :class:`~memopt_nb.runtime.state.StateManager` does), marking before and after each part."""

    def __init__(self, optimizer: Any, chunks: list[list[nn.Parameter]], mark: Callable[[Any], None]) -> None:
        self.optimizer, self.chunks, self.mark = optimizer, chunks, mark

    def step(self) -> None:
        opt = self.optimizer
        fn = type(opt).step
        raw = fn.__wrapped__ if getattr(fn, "hooked", False) else fn
        groups = opt.param_groups
        saved = [g["params"] for g in groups]
        try:
            for i, chunk in enumerate(self.chunks):
                ids = {id(p) for p in chunk}
                self.mark(("chunk_start", i))
                if chunk:
                    for g, ps in zip(groups, saved, strict=True):
                        g["params"] = [p for p in ps if id(p) in ids]
                    raw(opt)
                self.mark(("chunk_end", i))
        finally:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = ps

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _chunked_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any,
                  unit_params: list[list[nn.Parameter]], device: torch.device,
                  kwargs: Mapping[str, Any] | None) -> tuple[list[float], list[int], float]:
    """The unit-by-unit optimizer step: per chunk (outside units first) seconds and peak above its start level, and
    the whole step's seconds."""
    mine = {id(p) for ps in unit_params for p in ps}
    in_units = [[p for p in ps if p.requires_grad] for ps in unit_params]
    outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    chunks = [outside, *in_units]
    meter = meter_for(device)
    meter.track(model, optimizer, list(inputs), kwargs)
    with meter:
        training_step(model, inputs, loss_fn, _ChunkedOptimizer(optimizer, chunks, meter.mark), kwargs=kwargs)
    rel = [0] * len(chunks)
    for (label, level, _), (nlabel, _, peak) in zip(meter.marks, meter.marks[1:]):
        if label[0] == "chunk_start" and nlabel == ("chunk_end", label[1]):
            rel[label[1]] = max(0, peak - level)
    clock = _Clock(device)
    training_step(model, inputs, loss_fn, _ChunkedOptimizer(optimizer, chunks, clock.mark), kwargs=kwargs)
    d = clock.durations()
    times = [d[2 * i] for i in range(len(chunks))]
    return times, rel, float(sum(d))


def _static_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    opt = 0
    if optimizer is not None:
        seen = set()
        for state in optimizer.state.values():
            for v in tree_leaves(state):
                if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    opt += v.numel() * v.element_size()
    return {"params": params, "params_trainable": trainable, "buffers": buffers, "optimizer": opt}


def _groups_from(run: _Run) -> list[StorageGroup]:
    agg: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for inf in run.all_infos:
        if not inf.savers and not inf.consumers:
            continue
        key = (inf.producer, tuple(sorted(inf.savers)), tuple(sorted(inf.consumers)), inf.outside, inf.free_pos,
               inf.outside_release, inf.release_pos, inf.death_seg if inf.late else None)
        agg[key][0] += inf.nbytes
        agg[key][1] += 1
        agg[key][2] += inf.late
    out = [StorageGroup(nbytes=v[0], count=v[1], producer=k[0], savers=k[1], consumers=k[2], outside_saver=k[3],
                        free_pos=k[4], outside_release=k[5], release_pos=k[6], death_seg=k[7], late_bytes=v[2])
           for k, v in agg.items()]
    out.sort(key=lambda g: (g.savers[-1] if g.savers else max(g.consumers), g.producer, g.free_pos or 0))
    return out
