"""What a model's training step costs, per unit: the profile's data types and their JSON form.

:class:`ModelProfile` is what :func:`memopt_nb.profiling.profile.profile` measures and what the simulator and every
planner read. A *unit* (:class:`UnitProfile`) is a module a plan decides on; a *segment* (:class:`Segment`) is a slice
of the step's timeline (a unit's forward or backward, or the code between units) with its memory level and peak; a
*storage group* (:class:`StorageGroup`) is a set of saved storages with the same producer, savers and consumers. The
profile round-trips through JSON; its notebook table is drawn by :mod:`memopt_nb.notebook.profile_html`.
"""

from __future__ import annotations

import copy
import dataclasses
import html
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.nn as nn

from .budget import format_bytes
from .device import DeviceSpec
from .errors import ProfileError

__all__ = ["ModelProfile", "PROFILE_FORMAT", "PROFILE_SCHEMA", "ProfileLike", "Segment", "StorageGroup",
           "UnitProfile", "set_html_renderer"]

PROFILE_FORMAT = "memopt_nb.profile"
PROFILE_SCHEMA = 2  # 2: per-unit state bytes and the unit-by-unit optimizer step (schema 1 loads with zeros)



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
        param_steps: per parameter the optimizer steps, in ``param_groups`` order, the step of that parameter alone
            (as ``optimizer="stream"`` runs it): a dict with ``optimizer_bytes``, ``optimizer_storages`` (its
            movable state), ``grad_bytes``, ``step_time`` and ``step_rel_peak`` (the step's seconds and peak above the
            level before it). Empty in a profile made without an optimizer (or an older one): the unit cannot stream.
        params_offloadable: every parameter is a whole, resizable storage used by no module outside the unit.
        grads_done_extra: the level when backward has accumulated the unit's last gradient (where a step in backward
            runs) minus the level where its backward segment ends (every unit kept): what the backward still holds
            then, e.g. the gradient of the unit's input. 0 when the profile has no such moment (no trainable parameter).
        save_sets: (``profile(..., selective=True)``) per save-set name of :data:`~memopt_nb.core.plan.SAVE_SETS` the
        unit
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
    param_steps: list[dict[str, Any]] = field(default_factory=list)
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
        made_pos: for storages made in the step by code outside units (``producer == -1``), the last boundary before
            they were made: which tells a split block's own code from the code between blocks when units are merged
            (:mod:`~memopt_nb.core.cuts`). ``None`` for what existed before the step (the batch).
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
    made_pos: int | None = None


@dataclass
class ModelProfile:
    """What a model's training step costs, per unit — the input of the simulator and every planner.

    Build one with :func:`profile`. It round-trips through JSON (:meth:`save`, :meth:`load`) and renders as a table in
    a notebook.

    The optimizer step: ``segments[step_segment]`` is the plain step (all parameters in one ``opt.step()``); the
    unit-by-unit step that state placements use is described by each unit's ``step_time`` / ``step_rel_peak`` and,
    for the parameters outside units (stepped first), ``outside_step_time`` / ``outside_step_rel_peak``;
    ``chunked_step_time`` is that whole step's seconds (0 when no optimizer was given).

    ``merges`` (``units="fine"``): per module split into units that can be one unit again, what it costs as one
    (:mod:`memopt_nb.core.cuts`: ``units`` its first and last unit, its peaks recomputed whole, its inputs, its
    fingerprint); ``memopt.merge_units(profile, blocks)`` makes the profile with those blocks merged.

    ``heads`` (``profile(..., head="chunked")``): per number of chunks of the LM head (a string key), the step's
    segments and storage groups with the head chunked (:mod:`memopt_nb.core.heads`); ``meta["head"]`` names the head
    of a profile made from one of them.
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
    merges: dict[str, dict[str, Any]] = field(default_factory=dict)
    heads: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._model_ref: weakref.ref | None = None
        self._optimizer_ref: weakref.ref | None = None
        self._input_refs: list[weakref.ref] = []
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

    @property
    def live_step(self) -> list[Any]:
        """The profiled model, its optimizer and the example input tensors that are still alive in this session (not
        saved to JSON): the tensors the profile's ``start_level`` holds, which a plan's budget is not to lose twice."""
        refs = [self._model_ref, self._optimizer_ref, *self._input_refs]
        return [obj for ref in refs if ref is not None and (obj := ref()) is not None]

    def unit(self, name: str) -> UnitProfile:
        for u in self.units:
            if u.name == name:
                return u
        raise ProfileError(f"no unit named {name!r}; units: {', '.join(self.unit_names)}")

    def _adopt(self, other: ModelProfile) -> ModelProfile:
        """This profile, knowing the live model and optimizer ``other`` was made from (a profile derived from it)."""
        self._model_ref, self._optimizer_ref = other._model_ref, other._optimizer_ref
        self._input_refs = list(getattr(other, "_input_refs", []))
        return self

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

    def _repr_html_(self, spelling: str = "python") -> str:
        """The profile as HTML, its advice spelt for ``"python"`` or the magics (``"magic"``)."""
        if _html_renderer is None:
            return f"<pre>{html.escape(self.summary())}</pre>"
        return _html_renderer(self, spelling)


#: Draws a profile as HTML in a notebook; the package installs :func:`memopt_nb.notebook.profile_html.profile_html`
#: (the data types cannot import the planners the table quotes, so the drawing is handed in from above).
_html_renderer: Callable[[ModelProfile, str], str] | None = None


class ProfileLike(Protocol):
    """What the simulator, the planners and the harness read of a profile: a :class:`ModelProfile`, or any object with
    these fields (a per-rank copy, a hand-made profile in a test). The fields each reader needs beyond these are
    :class:`ModelProfile`'s, under the same names."""

    units: list[UnitProfile]
    segments: list[Segment]
    groups: list[StorageGroup]
    device: DeviceSpec
    peak_bytes: int
    meta: dict[str, Any]

    @property
    def n_units(self) -> int: ...


def set_html_renderer(render: Callable[[ModelProfile, str], str] | None) -> None:
    """Install the function that draws a :class:`ModelProfile` in a notebook (``None``: plain text)."""
    global _html_renderer
    _html_renderer = render
