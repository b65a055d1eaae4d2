"""``memopt.max_model``: the largest model of a family that trains under a budget, with a plan and without one.

A *family* is a builder of model sizes, ``builder(size) -> (model, inputs, loss_fn[, optimizer])`` (the contract of
:func:`memopt_nb.max_batch`'s builder, with a size instead of a batch), and the sizes to consider, smallest first
(layers, widths, or any labels the builder understands). Each size the search looks at is built and profiled once
(:func:`memopt_nb.profile`, which profiles a model whose state exceeds the device by streaming it). For that profile
it asks three questions against the budget:

* **plain training**: the unplanned peak is within the budget;
* **offload everything**: :func:`memopt_nb.solvers.offload_everything` (every unit's optimizer state, gradients and
  parameters on the host, activations swapped or recomputed: what ZeRO-Offload and FSDP2's ``CPUOffloadPolicy`` do)
  fits;
* **memopt**: the planner's floor (:func:`memopt_nb.solvers.min_peak`) is within the budget; the exact optimum
  (:func:`memopt_nb.solvers.optimal`) is then the plan, and its predicted step time the answer's.

Memory grows with the size, so each method's largest size is found by bisection over the sizes (a size is built
only when the bisection needs it). memopt's plan space contains both others, so it is searched first and the others
below it. With ``verify`` (the default) on the device the models are built on, the memopt answer is trained for a
step under its plan inside :func:`memopt_nb.limit_memory` at the budget (or the limit already in force); a size whose
step does not run inside it is dropped and the next smaller one checked, so the answer is one that ran.
"""

from __future__ import annotations

import gc
import html
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import planners as solvers
from ..core.budget import format_bytes, resolve_budget
from ..core.device import DeviceSpec
from ..core.errors import BudgetError, MemoptError, MemoptWarning, ProfileError
from ..core.plan import Plan
from ..core.progress import advance, stage, task
from ..planners.checks import default_budget
from ..planners.options import as_simulator
from ..profiling.profile import profile
from ..runtime.limit import limit_in_force, limit_memory
from ..runtime.measure import measure
from .maxbatch import OptimizerArg, _unpack, optimizer_maker

__all__ = ["ModelSize", "ModelSizes", "max_model"]

METHODS = ("plain", "offload_everything", "memopt")


@dataclass
class ModelSize:
    """One size of the family, profiled.

    Attributes:
        size: the builder's argument; params: the model's parameter count; state_bytes: its parameters, gradients
            and optimizer state; peak_bytes: the unplanned step's peak; floor_bytes: the smallest peak a plan
            reaches (memopt's floor).
        fits: per method (``"plain"``, ``"offload_everything"``, ``"memopt"``) whether it fits the budget.
        step_time: per method that fits, the (predicted, on ``device``) seconds of a step.
        verified: for memopt's answer, whether a real step under its plan ran inside the budget (``None``: not run).
        measured_peak_bytes: that step's measured peak (``None``: not run).
    """

    size: Any
    params: int
    state_bytes: int
    peak_bytes: int
    floor_bytes: int
    fits: dict[str, bool] = field(default_factory=dict)
    step_time: dict[str, float] = field(default_factory=dict)
    verified: bool | None = None
    measured_peak_bytes: int | None = None
    #: why the size could not be profiled (it then fits no method), "" if it was
    error: str = ""


@dataclass
class ModelSizes:
    """The answer of :func:`max_model`.

    Attributes:
        largest: per method, the largest size that fits (``None``: not even the smallest).
        plan: memopt's plan for its largest size (``None`` if none fits).
        budget_bytes: the budget; device: the device's name the times are predicted for.
        rows: every size that was profiled, smallest first.
    """

    largest: dict[str, Any]
    plan: Plan | None
    budget_bytes: int
    device: str
    rows: list[ModelSize]

    def row(self, size: Any) -> ModelSize | None:
        """The profiled row of ``size`` (``None`` if the search never built it)."""
        return next((r for r in self.rows if r.size == size), None)

    def _largest_row(self, method: str) -> ModelSize | None:
        s = self.largest.get(method)
        return None if s is None else self.row(s)

    def summary(self) -> str:
        """One line per method: its largest size, that model's parameters and step time."""
        lines = [f"Largest model within {format_bytes(self.budget_bytes)} on {self.device}:"]
        for m in METHODS:
            r = self._largest_row(m)
            if r is None:
                lines.append(f"  {m:<19} none of the sizes")
                continue
            lines.append(f"  {m:<19} size {r.size!s:<8} {r.params / 1e6:8.2f} M parameters, state "
                         f"{format_bytes(r.state_bytes)}, step {r.step_time[m] * 1e3:.1f} ms"
                         + (", verified" if m == "memopt" and r.verified else ""))
        mem, plain = self._largest_row("memopt"), self._largest_row("plain")
        if mem is not None and plain is not None and plain.params:
            lines.append(f"memopt trains {mem.params / plain.params:.2f}x the parameters plain training does.")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.summary())}</pre>"


def _probe(builder: Callable[[Any], Any], size: Any, make: Callable | None, device: DeviceSpec | str | None,
           budget: Any, repeats: int, units: Any) -> tuple[ModelSize, Any, int]:
    """Build and profile ``size``: its row, its profile and the budget in bytes."""
    model, args, kwargs, loss_fn, opt = _unpack(builder(size), make)
    prof = profile(model, *args, loss_fn=loss_fn, optimizer=opt, repeats=repeats,
                   units=units(model) if callable(units) else units, **kwargs)
    if budget is None:
        b = default_budget(prof, device).free_bytes
    else:
        b = resolve_budget(budget, prof.peak_bytes)
    sim = as_simulator(prof, device)
    floor = solvers.min_peak(sim, offload_state=True)
    row = ModelSize(size=size, params=sum(p.numel() for p in model.parameters()),
                    state_bytes=prof.param_bytes + prof.grad_bytes + prof.optimizer_state_bytes,
                    peak_bytes=prof.peak_bytes, floor_bytes=floor)
    row.fits["plain"] = prof.peak_bytes <= b
    if row.fits["plain"]:
        row.step_time["plain"] = solvers.none(sim, b).predicted_step_time
    row.fits["memopt"] = floor <= b
    if row.fits["memopt"]:
        oe = solvers.offload_everything(sim, b)
        row.fits["offload_everything"] = oe.feasible
        if oe.feasible:
            row.step_time["offload_everything"] = oe.predicted_step_time
    else:
        row.fits["offload_everything"] = False
    return row, prof, b


@task("max_model")
def max_model(builder: Callable[[Any], Any], sizes: Sequence[Any], budget: Any = None,
              device: DeviceSpec | str | None = None, *, optimizer: OptimizerArg = None, verify: bool = True,
              repeats: int = 1, time_limit: float = 30.0, units: Any = "auto") -> ModelSizes:
    """The largest of ``sizes`` (smallest first) that trains within ``budget``: with memopt's plan, with plain
    training, and with everything offloaded, each with its step time (see the module's description).

    Args:
        builder: ``builder(size) -> (model, inputs, loss_fn[, optimizer])``, inputs a tuple of positional or a dict of
            keyword inputs; called once per size looked at.
        sizes: the sizes to consider, in increasing memory.
        budget: bytes or a string (``"6GiB"``); ``None``: what the device can still give (inside
            :func:`memopt_nb.limit_memory`, the limit less what other tensors hold; on a preset, its capacity). A
            percentage is refused (of which model's peak?).
        device: the device the times and the default budget are for (``None``: where the models are built; a preset
            name such as ``"a100-40gb"`` predicts its times and, without a budget, uses its capacity).
        optimizer: the optimizer to train with, as :func:`memopt_nb.max_batch` takes it (default: the builder's, else
            Adam).
        verify: run memopt's answer for one step under its plan inside the budget (only where the models live: not
            for a preset), stepping down a size if it does not run.
        repeats: the profiler's repeats per size. time_limit: the exact planner's safety limit per plan.
        units: :func:`memopt_nb.profile`'s ``units=``, or a function of the model giving them (e.g. the embedding, each
            block and the LM head, so that a plan may move the embedding's and the head's state too).
    """
    sizes = list(sizes)
    if not sizes:
        raise MemoptError("max_model needs at least one size, smallest first: e.g. sizes=[2, 4, 8, 16] layers")
    if isinstance(budget, str) and budget.strip().endswith("%"):
        raise MemoptError(f"max_model: budget={budget!r} is a share of a peak, but each size has its own; give bytes "
                          "or a size such as '6GiB', or no budget for what the device can still give")
    make = optimizer_maker(optimizer)
    rows: dict[int, tuple[ModelSize, Any, int]] = {}
    preset = device is not None and DeviceSpec.resolve(device, None).kind == "preset"

    def at(i: int) -> ModelSize:
        if i not in rows:
            gc.collect()
            try:
                rows[i] = _probe(builder, sizes[i], make, device, budget, repeats, units)
            except ProfileError as exc:  # not even a state-streamed profile fits: the size fits no method
                row = ModelSize(size=sizes[i], params=0, state_bytes=0, peak_bytes=0, floor_bytes=0,
                                fits=dict.fromkeys(METHODS, False), error=str(exc))
                rows[i] = (row, None, 0)
            advance(1)
        return rows[i][0]

    def largest(method: str, hi: int) -> int:
        """The largest index <= hi whose size fits ``method`` (-1: none), by bisection."""
        lo, best = 0, -1
        while lo <= hi:
            mid = (lo + hi) // 2
            if at(mid).fits[method]:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best

    stage("profiling sizes", total=max(1, math.ceil(math.log2(len(sizes) + 1))))
    top = largest("memopt", len(sizes) - 1)
    plan = None
    while top >= 0:
        row, prof, b = rows[top]
        try:
            plan = solvers.optimal(prof, b, device, time_limit=time_limit, offload_state=True)
        except BudgetError:
            plan = None
        if (plan is None or not plan.feasible) and row.fits["offload_everything"]:
            plan = solvers.offload_everything(prof, b, device)  # in memopt's space too: never a smaller answer
        if plan is not None and plan.feasible:
            row.step_time["memopt"] = plan.predicted_step_time
            if verify and not preset:
                gc.collect()
                row.verified, row.measured_peak_bytes = _verify(_unpack(builder(sizes[top]), make), plan, b)
            if row.verified is not False:
                break
        row.fits["memopt"] = False
        top = largest("memopt", top - 1)
        plan = None
    tops = {"memopt": top}
    for m in ("plain", "offload_everything"):
        tops[m] = largest(m, top) if top >= 0 else -1
    profiled = [r for r in rows.values() if r[1] is not None]
    if not profiled:
        raise MemoptError(f"max_model: none of the sizes looked at could be profiled here ("
                          f"{'; '.join(r[0].error for r in rows.values())[:400]}); give smaller sizes")
    b = profiled[0][2]
    name = as_simulator(profiled[0][1], device).device.name
    ordered = [rows[i][0] for i in sorted(rows)]
    return ModelSizes(largest={m: (sizes[i] if i >= 0 else None) for m, i in tops.items()}, plan=plan,
                      budget_bytes=b, device=name, rows=ordered)


def _verify(built: tuple, plan: Plan, budget: int) -> tuple[bool, int | None]:
    """Whether one step under ``plan`` runs inside ``budget`` (the limit in force, else one set to ``budget``)."""
    model, args, kwargs, loss_fn, opt = built
    try:
        with warnings.catch_warnings():  # the state this throw-away model leaves parked on the host is let go below
            warnings.simplefilter("ignore", MemoptWarning)
            if limit_in_force() is not None:
                m = measure(model, *args, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **kwargs)
            else:
                with limit_memory(budget):
                    m = measure(model, *args, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **kwargs)
    except (torch.OutOfMemoryError, MemoryError, MemoptError):
        return False, None
    finally:
        del model, opt
        gc.collect()
    return m.peak_bytes <= budget, m.peak_bytes
