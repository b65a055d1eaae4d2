"""``memopt.limit_memory``: a device that holds at most so many bytes, on every machine.

On CUDA the limit is the caching allocator's per-process memory fraction: an allocation past it raises
``torch.OutOfMemoryError`` as a full GPU would.

On the CPU (the emulated device, see :mod:`memopt_nb.runtime.memory`) a dispatch mode counts the device's tensor bytes
the way :func:`memopt_nb.measure` and the simulator count them: every storage an operator creates, every storage the
swap and state engines bring back (:func:`~memopt_nb.runtime.memory.note_device_storage`), and the tensors a step
uses that existed before — a model's parameters, buffers and gradients with the state of every optimizer that holds
them, counted from the first operator that reads one of its parameters or buffers, and any other tensor an operator
reads (the batch). What the swap and state engines keep in their host store is not counted, nor are host copies made
under :func:`uncounted` (the copies ``profile`` and ``measure`` restore the model from, the planner's own networks).
An operator whose new storages would take the count above the limit raises ``torch.OutOfMemoryError`` instead of
returning, so the step stops where a device of that size would stop it.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..core.budget import format_bytes, parse_bytes
from ..core.errors import BudgetError
from .memory import _LISTENERS, StorageTracker, _plain, _tensors_of

__all__ = ["MemoryLimit", "active_limit", "exempt", "limit_in_force", "limit_memory", "recount", "uncounted"]

_LOCAL = threading.local()
#: active limits, outermost first (each one a :class:`MemoryLimit`)
_STACK: list[MemoryLimit] = []


def _uncounting() -> bool:
    return getattr(_LOCAL, "uncounted", 0) > 0


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Tensors made inside are host memory, not the emulated device's: a limit never counts them, nor later reads of
    them. For host copies made with operators (on the CPU, host and emulated device are the same memory). No effect
    on CUDA, where the device is what the allocator holds."""
    _LOCAL.uncounted = getattr(_LOCAL, "uncounted", 0) + 1
    try:
        yield
    finally:
        _LOCAL.uncounted -= 1


@contextlib.contextmanager
def exempt() -> Iterator[None]:
    """No limit in force raises inside: for putting back what the device held before a step that ran out of memory
    (:mod:`memopt_nb.runtime.oom`). On the emulated device what is made inside is uncounted until :func:`recount`
    counts it; on CUDA each limit's memory fraction is lifted to the one before it for the block."""
    lifted = [lim for lim in _STACK if lim._previous_fraction is not None]
    for lim in reversed(lifted):  # pragma: no cover - needs a GPU (the outermost's previous fraction last)
        torch.cuda.set_per_process_memory_fraction(lim._previous_fraction, lim.device)
    try:
        with uncounted():
            yield
    finally:
        for lim in lifted:  # pragma: no cover - needs a GPU
            torch.cuda.set_per_process_memory_fraction(min(1.0, lim.limit_bytes / lim._total), lim.device)


def _tensor_leaves(obj: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or result (nested tuples, lists and dicts), as ``tree_leaves`` finds
    them, without its per-node cost (this runs on every operator under a limit)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _tensor_leaves(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensor_leaves(x, out)
    elif obj is not None and not isinstance(obj, (int, float, bool, str, torch.dtype, torch.device, torch.layout,
                                                  torch.memory_format)):
        out.extend(t for t in tree_leaves(obj) if isinstance(t, torch.Tensor))  # anything else pytree knows
    return out


def active_limit(device: torch.device | str | None = None) -> int | None:
    """The smallest limit in force for ``device`` (any device if ``None``), in bytes, or ``None`` outside every
    :func:`limit_memory` block."""
    lim = limit_in_force(device)
    return lim.limit_bytes if lim is not None else None


def limit_in_force(device: torch.device | str | None = None) -> MemoryLimit | None:
    """The :func:`limit_memory` block whose limit is the smallest in force for ``device`` (any device if ``None``),
    or ``None`` outside every block."""
    dev = torch.device(device) if device is not None else None
    limits = [lim for lim in _STACK if dev is None or lim.device.type == dev.type]
    return min(limits, key=lambda lim: lim.limit_bytes) if limits else None


class _EmulatedLimit(StorageTracker):
    """The CPU device's tensor bytes (see the module docstring), raising ``torch.OutOfMemoryError`` past ``limit``."""

    def __init__(self, limit: int, device: torch.device) -> None:
        super().__init__(device)
        self.limit = limit
        self._host: dict[int, weakref.ref] = {}
        self._roots: list[nn.Module] = []
        self._optimizers: list[weakref.ref] = []
        self._owner: dict[int, list[int]] = {}  # id of a parameter or buffer -> indices of the roots that hold it
        self._active_roots: set[int] = set()

    # -- what existed before
    def index_existing(self) -> None:
        """Find the models and optimizers alive now; each is counted from the first operator that reads it."""
        gc.collect()
        modules, optimizers = [], []
        for obj in gc.get_objects():
            kind = type(obj)  # not isinstance: that reads __class__, which some module proxies warn about
            if issubclass(kind, nn.Module):
                modules.append(obj)
            elif issubclass(kind, torch.optim.Optimizer):
                optimizers.append(obj)
        children = {id(c) for m in modules for c in m.children()}
        self._roots = [m for m in modules if id(m) not in children]
        for i, root in enumerate(self._roots):
            for t in [*root.parameters(), *root.buffers()]:
                self._owner.setdefault(id(t), []).append(i)
        self._optimizers = [weakref.ref(o) for o in optimizers]

    def _activate(self, roots: list[int]) -> None:
        for i in roots:
            if i in self._active_roots:
                continue
            self._active_roots.add(i)
            root = self._roots[i]
            mine = {id(p) for p in root.parameters()}
            opts = [o for ref in self._optimizers if (o := ref()) is not None
                    and any(id(p) in mine for g in o.param_groups for p in g["params"])]
            for t in _tensors_of_all([root, *opts]):
                for q in _plain(t):
                    self._count(q.untyped_storage())

    # -- counting
    def _is_host(self, st: torch.UntypedStorage) -> bool:
        ref = self._host.get(id(st))
        return ref is not None and ref() is st

    def _mark_host(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        self._host[key] = weakref.ref(st, lambda _r, key=key: self._host.pop(key, None))

    def recount(self, objs: list[Any]) -> None:
        """Count the tensors of ``objs`` (modules, optimizers, tensors) as the device's now, host copies included."""
        for t in _tensors_of_all(objs):
            for q in _plain(t):
                st = q.untyped_storage()
                if st.device.type == self.device.type:
                    self._host.pop(id(st), None)
                    self.add_storage(st)

    def _count(self, st: torch.UntypedStorage) -> None:
        entry = self._live.get(id(st))
        if entry is not None and entry[0]() is st and entry[1] == st.nbytes():
            return  # counted already, at this size (the common case: an operator's inputs)
        if st.device.type == self.device.type and not self._is_host(st):
            self.add_storage(st)

    def _new_bytes(self, storages: list[torch.UntypedStorage]) -> int:
        """Bytes counting ``storages`` would add (new ones, and growth of ones resized in place)."""
        extra, seen = 0, set()
        for st in storages:
            key = id(st)
            if key in seen or st.device.type != self.device.type or self._is_host(st):
                continue
            seen.add(key)
            entry = self._live.get(key)
            if entry is not None and entry[0]() is st:
                extra += max(0, st.nbytes() - entry[1])
            else:
                extra += st.nbytes()
        return extra

    def check(self, storages: list[torch.UntypedStorage], what: Any) -> None:
        """Raise ``torch.OutOfMemoryError`` if counting ``storages`` would take the device above the limit."""
        extra = self._new_bytes(storages)
        if extra and self.current + extra > self.limit:
            raise torch.OutOfMemoryError(
                f"memopt emulated device out of memory: {what} tried to allocate {format_bytes(extra)}; "
                f"{format_bytes(self.current)} of the {format_bytes(self.limit)} limit (memopt.limit_memory) are in "
                f"use. Plan the step to fit: prof = memopt.profile(...); p = memopt.search(prof); with memopt.plan(p): "
                f"..., or find the largest batch that fits with memopt.max_batch(...)")

    def note(self, st: torch.UntypedStorage) -> None:
        """A storage the swap or state engine made or resized outside any operator (prefetch, refill)."""
        if st.device.type != self.device.type or _uncounting():
            return
        self.check([st], "bringing an offloaded tensor back")
        self.add_storage(st)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if _uncounting():  # new storages are host memory; views of existing ones are what they were
            out = func(*args, **kwargs)
            given = {id(q.untyped_storage()) for t in _tensor_leaves((args, kwargs), [])
                     if not t.is_meta for q in _plain(t)}
            for t in _tensor_leaves(out, []):
                if t.device.type == self.device.type and not t.is_meta:
                    for q in _plain(t):
                        st = q.untyped_storage()
                        if id(st) not in self._live and id(st) not in given:
                            self._mark_host(st)
            return out
        for t in _tensor_leaves((args, kwargs), []):
            if self._owner:
                roots = self._owner.get(id(t))
                if roots is not None:
                    self._activate(roots)
            if t.device.type == self.device.type and not t.is_meta:
                for q in _plain(t):
                    self._count(q.untyped_storage())
        out = func(*args, **kwargs)
        made = [q.untyped_storage() for t in _tensor_leaves(out, [])
                if t.device.type == self.device.type and not t.is_meta for q in _plain(t)]
        if made:
            self.check(made, func)  # named only in the error
            for st in made:
                self._count(st)
        return out

    def __enter__(self) -> _EmulatedLimit:
        return torch.utils._python_dispatch.TorchDispatchMode.__enter__(self)

    def __exit__(self, *exc: Any) -> None:
        torch.utils._python_dispatch.TorchDispatchMode.__exit__(self, *exc)


def recount(*objs: Any) -> None:
    """Tell every limit in force that the tensors of ``objs`` (modules, optimizers, tensors) are on the device now,
    also those made as host copies under :func:`uncounted` (a model restored from them)."""
    for lim in _STACK:
        if lim._tracker is not None:
            lim._tracker.recount(list(objs))


def _tensors_of_all(objs: list[Any]) -> Iterator[torch.Tensor]:
    for obj in objs:
        yield from _tensors_of(obj)


class MemoryLimit:
    """A :func:`limit_memory` block: the limit, and on the emulated device what the block used.

    Attributes:
        limit_bytes: the limit.
        device: the device limited.
    """

    def __init__(self, limit: int, device: torch.device) -> None:
        self.limit_bytes = limit
        self.device = device
        self._tracker: _EmulatedLimit | None = None
        self._previous_fraction: float | None = None
        self._total = 0
        self._entered = False

    @property
    def peak_bytes(self) -> int | None:
        """(emulated device) the most tensor bytes the device held in the block so far; ``None`` on CUDA."""
        return int(self._tracker.peak) if self._tracker is not None else None

    @property
    def current_bytes(self) -> int | None:
        """(emulated device) the tensor bytes the device holds now; ``None`` on CUDA."""
        return int(self._tracker.current) if self._tracker is not None else None

    def counted_bytes(self, *objs: Any) -> int | None:
        """(emulated device) the bytes of the tensors of ``objs`` (modules, optimizers, tensors) that the block
        counts now, each storage once; ``None`` on CUDA."""
        if self._tracker is None:
            return None
        total, seen = 0, set()
        for t in _tensors_of_all(list(objs)):
            for q in _plain(t):
                st = q.untyped_storage()
                entry = self._tracker._live.get(id(st))
                if id(st) not in seen and entry is not None and entry[0]() is st:
                    seen.add(id(st))
                    total += entry[1]
        return total

    def __enter__(self) -> MemoryLimit:
        if self._entered:
            raise BudgetError("this limit_memory block is already in use; enter a new memopt.limit_memory(...)")
        self._entered = True
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU (benchmarks/cuda_check.py)
            self._total = torch.cuda.get_device_properties(self.device).total_memory
            self._previous_fraction = torch.cuda.get_per_process_memory_fraction(self.device)
            torch.cuda.set_per_process_memory_fraction(min(1.0, self.limit_bytes / self._total), self.device)
        else:
            tracker = _EmulatedLimit(self.limit_bytes, self.device)
            tracker.index_existing()
            tracker.__enter__()
            self._tracker = tracker
            _LISTENERS.append(tracker)
        _STACK.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._tracker is not None:
                _LISTENERS.remove(self._tracker)
                self._tracker.__exit__(*exc)
            elif self._previous_fraction is not None:  # pragma: no cover - needs a GPU
                torch.cuda.set_per_process_memory_fraction(self._previous_fraction, self.device)
        finally:
            _STACK.remove(self)
            if self._tracker is not None:
                self._tracker._roots = []  # keep no model alive after the block
                self._tracker._owner = {}

    def __repr__(self) -> str:
        used = f", peak {format_bytes(self.peak_bytes)}" if self._tracker is not None else ""
        return f"<memopt.limit_memory {format_bytes(self.limit_bytes)} on {self.device}{used}>"


def limit_memory(limit: int | float | str, device: torch.device | str | None = None) -> MemoryLimit:
    """Make the device hold at most ``limit`` inside a ``with`` block: bytes, or a size such as ``"96MiB"``.

    Example::

        with memopt.limit_memory("96MiB"):
            loss_fn(model(x)).backward()          # raises torch.OutOfMemoryError if the step needs more
            prof = memopt.profile(model, x, loss_fn=loss_fn, optimizer=opt)
            p = memopt.search(prof)               # plans for the 96 MiB: DeviceSpec.detect() reports it as capacity
            with memopt.plan(p):
                ...                               # trains inside the limit

    ``device``: the device to limit (default: CUDA if available, else the CPU as the emulated device). On CUDA this is
    ``torch.cuda.set_per_process_memory_fraction(limit / total)``, the previous fraction restored on exit. On the
    emulated device the tensor bytes are counted as :func:`memopt_nb.measure` counts them (see
    :mod:`memopt_nb.runtime.limit`), and an operator that would take them above the limit raises
    ``torch.OutOfMemoryError`` (the class CUDA raises). Blocks nest: the smallest limit in force applies. Leaving
    the block, normally or by an exception, restores everything as it was.
    """
    if isinstance(limit, bool):
        raise BudgetError(f"limit_memory needs bytes or a size such as '96MiB', got {limit!r}")
    if isinstance(limit, str) and limit.strip().endswith("%"):
        raise BudgetError(f"limit_memory needs an absolute size (bytes or e.g. '96MiB'), not a share {limit!r}: a "
                          "device's memory is not relative to a step")
    nbytes = parse_bytes(limit)
    if nbytes <= 0:
        raise BudgetError(f"limit_memory needs a positive size, got {limit!r}")
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type not in ("cpu", "cuda"):
        raise BudgetError(f"limit_memory limits a CUDA device or the CPU (emulated device), not {dev.type!r}")
    return MemoryLimit(nbytes, dev)
