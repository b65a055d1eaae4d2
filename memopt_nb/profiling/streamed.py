"""Profiling a model whose training state does not fit the device: the optimizer's state a unit at a time.

When a training step runs out of memory even at batch 1 (what the model holds without activations is too much: its
parameters, their gradients and the optimizer's state), :func:`memopt_nb.profile` profiles it *state-streamed*:

* the forward and backward steps run at the batch asked for with the parameters on the device, but no optimizer state
  is ever created there, and each gradient is let go as soon as backward has accumulated it. The meter counts every
  gradient on from that moment until the step's ``zero_grad`` (as plain training holds it), and the optimizer's state
  is added to every level afterwards: the levels, peaks and saved bytes are those of the plain step, measured exactly
  on the CPU tracker (on CUDA a segment's peak may count a gradient let go in it from the segment's start on);
* the optimizer step is measured a unit at a time (the parameters outside units first): that unit's gradients and
  state are made on the device, its step is metered and timed, whole and one parameter at a time (what whole-step plans
  need), and its state is let go before the next unit's. The state's bytes are measured, not estimated. The plain
  step's own segment (the optimizer over every parameter at once, which never ran) is made of those parts: its time
  the parts' times added, its peak above its start the largest part's where the optimizer steps one parameter at a
  time (``foreach=False``, the default on the CPU) and the parts' peaks added where its ``foreach`` kernels hold
  temporaries for every parameter at once (an estimate: no device here could hold that step).

What is never on the device at once: more than the parameters, one step's activations and the gradients backward is
accumulating, or the parameters and one unit's gradients and optimizer state. ``prof.meta["state_streamed"]`` is
``True`` and ``meta["state_streamed_why"]`` says so in a sentence. The parameters themselves must fit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ..runtime.memory import CudaMeter, StorageTracker, active_meter, meter_for
from .tracer import _ChunkedOptimizer, _Clock, _movable_state, static_bytes, unit_state_bytes

__all__ = ["StateFreeOptimizer", "add_state_to_marks", "step_rel_peak", "streamed_optimizer_steps", "streamed_why"]


def _hold(meter: Any, nbytes: int) -> None:
    """Keep counting ``nbytes`` the meter just saw freed (or, with ``-nbytes``, stop)."""
    if isinstance(meter, StorageTracker):
        with meter._lock:
            meter.current += nbytes
    elif isinstance(meter, CudaMeter):  # pragma: no cover - needs a GPU
        meter.other -= nbytes


class StateFreeOptimizer:
    """Stands in for the optimizer in the profile's forward-and-backward steps: its ``step`` does nothing, each
    gradient is let go as backward accumulates it (the active meter counting it on), and ``zero_grad`` ends that."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._held: dict[int, int] = {}
        self._meter: Any = None
        self._handles: list[Any] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[StateFreeOptimizer]:
        self._handles = [p.register_post_accumulate_grad_hook(self._drop) for p in self.params]
        try:
            yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
            for p in self.params:
                p.grad = None

    def _drop(self, p: nn.Parameter) -> None:
        g = p.grad
        if g is None:
            return
        st = g.untyped_storage()
        nbytes, ref = st.nbytes(), weakref.ref(st)
        p.grad = None
        del g, st
        meter = active_meter()
        if meter is None or ref() is not None or id(p) in self._held:  # not freed, or counted already (tied)
            return
        if self._meter is not meter:
            self._held, self._meter = {}, meter
        self._held[id(p)] = nbytes
        _hold(meter, nbytes)

    def step(self) -> None:
        """Nothing: the optimizer step is measured a unit at a time (:func:`streamed_optimizer_steps`)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        if self._meter is not None and self._meter is active_meter():
            _hold(self._meter, -sum(self._held.values()))
        self._held, self._meter = {}, None


def add_state_to_marks(marks: list[tuple[Any, int, int]], nbytes: int) -> list[tuple[Any, int, int]]:
    """Marks ``(label, level, peak)`` with ``nbytes`` (the optimizer's state, never on the device) added to both."""
    return [(label, level + nbytes, peak + nbytes) for label, level, peak in marks]


def _step_parts(optimizer: torch.optim.Optimizer, parts: list[list[nn.Parameter]],
                device: torch.device) -> tuple[list[float], list[int]]:
    """Each part's optimizer step, metered (peak above its start) then timed."""
    meter = meter_for(device)
    meter.track(*[p for ps in parts for p in ps], optimizer)
    with meter:
        _ChunkedOptimizer(optimizer, parts, meter.mark).step()
    rel = [0] * len(parts)
    for (label, level, _), (nlabel, _, peak) in zip(meter.marks, meter.marks[1:]):
        if label[0] == "chunk_start" and nlabel == ("chunk_end", label[1]):
            rel[label[1]] = max(0, peak - level)
    clock = _Clock(device)
    _ChunkedOptimizer(optimizer, parts, clock.mark).step()
    d = clock.durations()
    return [d[2 * i] for i in range(len(parts))], rel


def streamed_optimizer_steps(model: nn.Module, optimizer: torch.optim.Optimizer,
                             unit_params: list[list[nn.Parameter]], unit_modules: list[nn.Module],
                             device: torch.device) -> dict[str, Any]:
    """The optimizer step a unit at a time (outside units first), each unit's state made, measured and let go.

    Returns ``chunked`` (as :func:`~memopt_nb.profiling.tracer.chunked_step`: per part seconds, per part peak above its
    start, the sum of the seconds), ``param_steps`` (as :func:`~memopt_nb.profiling.tracer.param_steps`),
    ``state_bytes`` (as :func:`~memopt_nb.profiling.tracer.unit_state_bytes`) and ``optimizer_bytes`` (every state
    tensor's bytes, as :func:`~memopt_nb.profiling.tracer.static_bytes` counts them). The parameters are changed by
    the steps (the profile restores them)."""
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    mine = {id(p) for ps in unit_params for p in ps}
    outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine and p.requires_grad]
    parts = [outside, *[sorted((p for p in ps if p.requires_grad and id(p) in order), key=lambda p: order[id(p)])
                        for ps in unit_params]]
    times, rels, rows, states, total = [], [], [], [], 0
    for i, part in enumerate(parts):
        for p in part:
            p.grad = torch.zeros_like(p)
        _ChunkedOptimizer(optimizer, [part], lambda label: None).step()  # the part's state, made as plain does
        total += static_bytes(model, optimizer)["optimizer"]
        if i:
            states.append(unit_state_bytes(model, optimizer, [unit_params[i - 1]], [unit_modules[i - 1]])[0])
        t, r = _step_parts(optimizer, [part], device)
        times.append(t[0])
        rels.append(r[0])
        if i:
            pt, pr = _step_parts(optimizer, [[p] for p in part], device)
            rows.append([{"optimizer_bytes": sum(v.untyped_storage().nbytes() for v in _movable_state(optimizer, p)),
                          "optimizer_storages": len(_movable_state(optimizer, p)), "grad_bytes": p.nbytes,
                          "step_time": pt[j], "step_rel_peak": pr[j], "order": order[id(p)]}
                         for j, p in enumerate(part)])
        for p in part:
            optimizer.state.pop(p, None)
            p.grad = None
    return {"chunked": (times, rels, float(sum(times))), "param_steps": rows, "state_bytes": states,
            "optimizer_bytes": total}


def step_rel_peak(optimizer: torch.optim.Optimizer, part_peaks: list[int], device: torch.device) -> int:
    """The whole optimizer step's peak above its start, from its parts' (see the module docstring)."""
    foreach = optimizer.defaults.get("foreach")
    if foreach is None:  # torch's default: foreach kernels on CUDA, one parameter at a time elsewhere
        foreach = device.type == "cuda"
    return int(sum(part_peaks)) if foreach else int(max(part_peaks, default=0))


def streamed_why(optimizer_bytes: int, grad_bytes: int) -> str:
    """The sentence ``meta["state_streamed_why"]`` holds."""
    mib = 1 << 20
    return (f"The training step did not fit the device even at batch 1, so it was profiled state-streamed: the "
            f"optimizer's state ({optimizer_bytes / mib:.2f} MiB) was made and stepped a unit at a time and each "
            f"gradient ({grad_bytes / mib:.2f} MiB in all) let go as backward accumulated it, both counted in the "
            "profile's levels as plain training holds them; the optimizer step over every parameter at once is made "
            "of the units' steps.")
