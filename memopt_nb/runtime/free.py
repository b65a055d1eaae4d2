"""What the device can still give a training step: its capacity less what live tensors outside the step hold.

A plan searched with no budget is made for this amount, not for the device's whole capacity: a notebook that keeps
another model, a saved copy of the parameters or an EMA on the device has that much less for the step, and a plan for
the whole capacity would run out of memory under it.

* On CUDA: the capacity (the detected memory, or :func:`memopt_nb.limit_memory`'s limit) less what the caching
  allocator has allocated for tensors that are not the step's, and never more than the GPU can still give
  (``torch.cuda.mem_get_info``'s free memory, plus what the allocator holds reserved but unallocated, plus the step's
  own tensors): memory other processes hold is left out too.
* On the emulated device inside :func:`memopt_nb.limit_memory`: the limit less what the limit counts now that is not
  the step's own (the limit counts a tensor made before the block from the first operator that reads it).
* On the emulated device outside every limit (its capacity is the host's memory), for a preset, or for a profile made
  on a GPU this machine does not have: the capacity, nothing known to be held.

The step's own tensors — the model's parameters, buffers and gradients, its optimizer's state, the profiled inputs —
are in the profile's start level already, so they are not subtracted a second time. Tensors the loss function holds
(targets in its closure) are not in the profile's levels: they count as held, which they are.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.budget import format_bytes
from ..core.device import DeviceSpec
from .limit import limit_in_force
from .memory import CudaMeter, _storages_on

__all__ = ["FreeMemory", "device_room", "free_memory"]


@dataclass(frozen=True)
class FreeMemory:
    """What a plan with no budget is made for.

    Attributes:
        free_bytes: what the device can still give the step: the budget.
        capacity_bytes: the device's capacity (inside :func:`memopt_nb.limit_memory`, the limit).
        held_bytes: ``capacity_bytes - free_bytes``: held by tensors outside the step (on CUDA, also by other
            processes).
        device: the device's name.
        source: ``"free"`` (measured on the device the model is on) or ``"capacity"`` (a preset, or a device whose
            memory in use is not known here: its whole capacity).
        known: whether ``capacity_bytes`` is what a step must fit in (not the emulated device's host memory).
    """

    free_bytes: int
    capacity_bytes: int
    held_bytes: int
    device: str
    source: str
    known: bool = True

    @classmethod
    def capacity_of(cls, spec: DeviceSpec) -> FreeMemory:
        """The whole capacity of ``spec``, nothing known to be held (a preset, or a GPU that is not here)."""
        cap = int(spec.capacity_bytes)
        return cls(free_bytes=cap, capacity_bytes=cap, held_bytes=0, device=spec.name, source="capacity",
                   known=spec.capacity_known)

    def line(self) -> str:
        """One line for people: ``planning for 207.00 MiB free of 258.00 MiB (51.00 MiB held by other tensors)``."""
        if self.source == "capacity":
            return f"planning for {format_bytes(self.free_bytes)}, the capacity of {self.device}"
        held = (f"{format_bytes(self.held_bytes)} held by other tensors" if self.held_bytes
                else "nothing else held on it")
        return f"planning for {format_bytes(self.free_bytes)} free of {format_bytes(self.capacity_bytes)} ({held})"

    def to_meta(self) -> dict[str, Any]:
        """The fields and :meth:`line` as a JSON-ready dict (``plan.meta["budget_source"]``)."""
        return {**dataclasses.asdict(self), "line": self.line()}


def free_memory(spec: DeviceSpec, own: Iterable[Any] = ()) -> FreeMemory:
    """What the device ``spec`` describes, the one tensors live on here, can still give a training step whose own
    tensors are those of ``own`` (modules, optimizers, tensors): see the module docstring. Python's garbage is
    collected first, so that tensors already unreachable are not counted as held."""
    own = [o for o in own if o is not None]
    if spec.kind == "cpu":
        lim = limit_in_force("cpu")
        if lim is None or lim.current_bytes is None:
            return FreeMemory.capacity_of(spec)
        gc.collect()
        cap = min(int(spec.capacity_bytes), lim.limit_bytes)
        held = max(0, int(lim.current_bytes) - int(lim.counted_bytes(*own) or 0))
        return _free(cap, cap - held, spec.name)
    if spec.kind == "cuda" and torch.cuda.is_available():  # pragma: no cover - needs a GPU (benchmarks/cuda_check.py)
        dev = next((st.device for st in _storages_on(torch.device("cuda"), own)),
                   torch.device("cuda", torch.cuda.current_device()))
        gc.collect()
        meter = CudaMeter(dev)
        meter.track(*own)
        mine = meter.tracked_bytes()
        allocated = torch.cuda.memory_allocated(dev)
        cap = int(spec.capacity_bytes)
        lim = limit_in_force(dev)
        if lim is not None:
            cap = min(cap, lim.limit_bytes)
        driver_free, _ = torch.cuda.mem_get_info(dev)
        can_give = driver_free + (torch.cuda.memory_reserved(dev) - allocated) + mine
        return _free(cap, min(cap - max(0, allocated - mine), can_give), spec.name)
    return FreeMemory.capacity_of(spec)


def _free(capacity: int, free: int, device: str) -> FreeMemory:
    free = max(0, min(int(free), capacity))
    return FreeMemory(free_bytes=free, capacity_bytes=capacity, held_bytes=capacity - free, device=device,
                      source="free")


def device_room(device: torch.device | str) -> int | None:
    """How many more bytes of tensors ``device`` can take now: inside :func:`memopt_nb.limit_memory` on the emulated
    device, the limit less what it counts; on CUDA what the caching allocator can still give (the driver's free memory
    plus what it holds reserved but unallocated, and no more than a ``limit_memory`` fraction leaves); ``None`` on the
    emulated device outside every limit (its memory is the host's)."""
    dev = torch.device(device)
    if dev.type == "cuda":  # pragma: no cover - needs a GPU (benchmarks/cuda_check.py)
        driver_free, total = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        room = driver_free + torch.cuda.memory_reserved(dev) - allocated
        room = min(room, int(torch.cuda.get_per_process_memory_fraction(dev) * total) - allocated)
        return max(0, room)
    lim = limit_in_force(dev.type)
    if lim is None or lim.current_bytes is None:
        return None
    return max(0, lim.limit_bytes - lim.current_bytes)
