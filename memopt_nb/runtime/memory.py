"""Device memory measurement: what a training step holds, event by event.

* On CUDA, :class:`CudaMeter` reads the caching allocator (``memory_allocated`` / ``max_memory_allocated``), which
  includes kernel workspaces, less what tensors outside the training held when it started.
* On the CPU (the emulated device), :class:`StorageTracker` is a ``TorchDispatchMode`` that sees every tensor storage an
  operator creates and follows its lifetime with a weak reference, like ``torch.distributed._tools.MemTracker``. Tensors
  the swap engine keeps in its host store are created where the tracker does not look and are not counted; tensors it
  brings back are registered with :func:`note_device_storage`.

Both meters record *marks* — ``(label, level, peak since the previous mark)`` — that the profiler turns into a timeline.
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["CudaMeter", "StorageTracker", "active_meter", "meter_for", "note_device_storage"]


_ACTIVE: list[Any] = []
#: memory limits (:mod:`memopt_nb.runtime.limit`) told about every storage :func:`note_device_storage` reports
_LISTENERS: list[Any] = []


def active_meter() -> Any | None:
    """The meter currently measuring, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


def note_device_storage(storage: torch.UntypedStorage) -> None:
    """Tell the active CPU tracker about a device-pool storage created outside its view (swap engine prefetch)."""
    meter = active_meter()
    if isinstance(meter, StorageTracker):
        meter.add_storage(storage)
    for listener in _LISTENERS:
        listener.note(storage)


class _MeterBase:
    def __init__(self) -> None:
        self.marks: list[tuple[Any, int, int]] = []
        self._mark_peak = 0
        self._carry = 0  # peak of the parts of the current interval that split() closed

    def mark(self, label: Any) -> None:
        """Record the current level and the peak since the previous mark, then start a new interval."""
        level = self.current
        self.marks.append((label, level, max(self._interval_peak(), level, self._carry)))
        self._carry = 0
        self._reset_interval(level)

    def split(self, dying: int | None = None) -> int:
        """Close a part of the current interval here and return its peak (the interval's own peak keeps it).

        ``dying``: the key (``id``) of a storage being freed right now, from a finalizer that runs before the meter has
        counted the free; the part after this point starts without it where the meter can tell (the CPU tracker; on
        CUDA the allocator frees it after the finalizer, so that part's peak may count it once more).
        """
        if dying is not None:
            self._forget(dying)
        level = self.current
        part = max(self._interval_peak(), level)
        self._carry = max(self._carry, part)
        self._reset_interval(level)
        return part

    def _forget(self, key: int) -> None:
        """Count a storage whose Python object is being freed as gone (a meter that can tell)."""

    # implemented by subclasses
    current: int
    peak: int

    def _interval_peak(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _reset_interval(self, level: int) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class StorageTracker(_MeterBase, TorchDispatchMode):
    """Bytes of live tensor storages on one device, with peak, as a dispatch mode.

    Use as a context manager around a training step; call :meth:`track` first for tensors that already exist
    (parameters, gradients, optimizer state, inputs).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        _MeterBase.__init__(self)
        TorchDispatchMode.__init__(self)
        self.device = torch.device(device)
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0
        self._ipeak = 0
        self._watched: list[weakref.ref] = []

    # -- registration
    def add_storage(self, st: torch.UntypedStorage) -> None:
        if st.device.type != self.device.type:
            return
        key = id(st)
        nbytes = st.nbytes()
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[0]() is st:
                if entry[1] != nbytes:  # resized in place
                    self.current += nbytes - entry[1]
                    self._live[key] = (entry[0], nbytes)
                    self._bump()
                return
            ref = weakref.ref(st, self._make_callback(key))
            self._live[key] = (ref, nbytes)
            self.current += nbytes
            self._bump()

    def _make_callback(self, key: int):  # noqa: ANN202
        def _dead(ref: weakref.ref) -> None:
            with self._lock:
                entry = self._live.get(key)
                if entry is not None and entry[0] is ref:
                    del self._live[key]
                    self.current -= entry[1]

        return _dead

    def _bump(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
        if self.current > self._ipeak:
            self._ipeak = self.current

    def track(self, *objs: Any) -> None:
        """Count tensors that exist already: tensors, modules (parameters, buffers, grads), optimizers (state)."""
        for st in _storages_on(self.device, objs):
            self.add_storage(st)

    def watch(self, storages: Iterable[torch.UntypedStorage]) -> None:
        """Follow storages whose size changes outside the dispatcher: re-read them before and after every operator.

        FSDP2 frees and re-allocates its unsharded parameters with ``UntypedStorage.resize_``, which no dispatch mode
        sees (``memopt_nb.runtime.distributed.resized_storages`` lists them).
        """
        for st in storages:
            if st.device.type == self.device.type:
                self._watched.append(weakref.ref(st))
                self.add_storage(st)

    def _resync(self) -> None:
        for ref in self._watched:
            st = ref()
            if st is not None:
                entry = self._live.get(id(st))
                if entry is None or entry[1] != st.nbytes():
                    self.add_storage(st)

    def reset_peak(self) -> None:
        self.peak = self.current
        self._ipeak = self.current

    # -- marks
    def _interval_peak(self) -> int:
        return self._ipeak

    def _reset_interval(self, level: int) -> None:
        self._ipeak = level

    def _forget(self, key: int) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is not None and entry[0]() is None:  # dead, its weak-reference callback still to come
                del self._live[key]
                self.current -= entry[1]

    # -- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self._watched:
            self._resync()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device.type:
                for q in _plain(t):
                    self.add_storage(q.untyped_storage())
        if self._watched:
            self._resync()
        return out

    def __enter__(self) -> StorageTracker:
        _ACTIVE.append(self)
        return TorchDispatchMode.__enter__(self)

    def __exit__(self, *exc: Any) -> None:
        try:
            TorchDispatchMode.__exit__(self, *exc)
        finally:
            _ACTIVE.remove(self)


class CudaMeter(_MeterBase):  # pragma: no cover - needs a GPU (tests/test_memory.py fakes the allocator)
    """The CUDA caching allocator's view of one device, with the same interface as :class:`StorageTracker`.

    Like the CPU tracker, it counts this training alone: the tensors of the objects given to :meth:`track` and
    everything allocated while it measures. Memory that other tensors held on the device when the meter was entered
    (a second model in the notebook, an earlier run's results) is read then as ``memory_allocated()`` less the tracked
    tensors' blocks, kept in :attr:`other`, and left out of :attr:`current` and :attr:`peak`. Entering runs Python's
    gc first, so that tensors already unreachable are not counted as other and then freed partway through the step.
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__()
        self.device = torch.device(device)
        self._overall = 0
        self._tracked: list[Any] = []
        #: bytes other tensors held on the device when the meter was entered (not counted)
        self.other = 0
        self._extra = 0

    @property
    def current(self) -> int:  # type: ignore[override]
        return torch.cuda.memory_allocated(self.device) - self.other

    @property
    def peak(self) -> int:  # type: ignore[override]
        return max(self._overall, torch.cuda.max_memory_allocated(self.device)) - self.other

    def track(self, *objs: Any) -> None:
        """Name what the training holds already (modules, optimizers, tensors): the rest is :attr:`other`."""
        self._tracked.extend(objs)

    def track_bytes(self, nbytes: int) -> None:
        """Count ``nbytes`` the training holds that no tracked object's tensors reach (DDP's gradient buckets)."""
        self._extra += _blocks(int(nbytes))

    def tracked_bytes(self) -> int:
        """Bytes the allocator holds for the tracked objects' tensors on this device (each storage once, rounded up
        to the allocator's 512-byte blocks), plus those of :meth:`track_bytes`."""
        seen: set[int] = set()
        total = self._extra
        for st in _storages_on(self.device, self._tracked):
            ptr, n = st.data_ptr(), st.nbytes()
            if ptr and n and ptr not in seen:
                seen.add(ptr)
                total += _blocks(n)
        return total

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._overall = torch.cuda.memory_allocated(self.device)

    def _interval_peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.other

    def _reset_interval(self, level: int) -> None:
        self._overall = max(self._overall, torch.cuda.max_memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)

    def __enter__(self) -> CudaMeter:
        gc.collect()  # garbage in reference cycles is freed now, not by a collection partway through the step
        torch.cuda.synchronize(self.device)
        self.other = max(0, torch.cuda.memory_allocated(self.device) - self.tracked_bytes())
        self.reset_peak()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize(self.device)
        self._tracked = []  # read once, on entering: the meter does not keep the model alive
        _ACTIVE.remove(self)


#: the CUDA caching allocator rounds every block up to a multiple of 512 bytes
_CUDA_BLOCK = 512


def _blocks(nbytes: int) -> int:
    """``nbytes`` as the CUDA caching allocator holds them: rounded up to whole blocks."""
    return -(-nbytes // _CUDA_BLOCK) * _CUDA_BLOCK


def meter_for(device: torch.device | str) -> StorageTracker | CudaMeter:
    """The right meter for a device."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaMeter(device)
    return StorageTracker(device)


def _plain(t: torch.Tensor) -> Iterable[torch.Tensor]:
    """The tensors that hold ``t``'s memory: itself, or for a wrapper subclass (DTensor) its inner local tensors."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not is_traceable_wrapper_subclass(t):
        yield t
        return
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh
            yield from _plain(inner)


def _storages_on(device: torch.device, objs: Iterable[Any]) -> Iterable[torch.UntypedStorage]:
    """The storages of the tensors of ``objs`` (see :meth:`StorageTracker.track`) on ``device`` (any index of its
    type where it names none), a wrapper subclass's inner tensors in its place; repeats are left to the caller."""
    for obj in objs:
        for t in _tensors_of(obj):
            for q in _plain(t):
                if not q.is_meta and q.device.type == device.type and device.index in (None, q.device.index):
                    yield q.untyped_storage()


def _tensors_of(obj: Any) -> Iterable[torch.Tensor]:
    if obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        return
    if isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
        return
    if isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            for v in tree_leaves(state):
                if isinstance(v, torch.Tensor):
                    yield v
        return
    for v in tree_leaves(obj):
        if isinstance(v, torch.Tensor):
            yield v
