"""The swap engine: offload a unit's saved tensors to host memory and bring them back before backward needs them.

It works on storages, not tensors: every tensor autograd saves inside a managed unit is replaced (through
``torch.autograd.graph.saved_tensors_hooks``) by a handle to a *record* of its storage, so views share one copy and a
storage saved by several units moves once. Parameters and buffers are never offloaded.

Life of a record in one forward pass (see :mod:`memopt_nb.core.plan` for the timing knobs):

1. **pending** — saved by one or more units; its *owner* is the last unit that saved it.
2. At every unit boundary (before and after each unit's forward) pending records whose storage nobody else references
   any more become eligible. If the owner's strategy is ``swap`` the copy to host starts now on the device-to-host
   copy engine, otherwise the record simply stays on the device.
3. **released** — before the forward of unit ``j + w`` (``j``: the next unit to run, ``w``: the owner's offload
   window), or at the end of the forward, the engine waits for the copy and drops the device storage.
4. When backward reaches the owner's trigger unit the copy back starts (host-to-device engine, in the order backward
   needs them); the first unpack waits for it. An unpack that finds its record still on the host fetches it on demand.

On CUDA the copies run on two side streams into a reusable pinned host pool, ordered with events. On the CPU the
training device is emulated: two worker threads play the copy engines (a job of at most
``ThreadCopyEngine.INLINE_BYTES`` is copied on the calling thread, which costs it less than the hand-off) and the host
store is invisible to the memory tracker, so the saving is an emulation there.
"""

from __future__ import annotations

import collections
import ctypes
import queue
import threading
import time
import weakref
from collections.abc import Container
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..core.plan import OFFLOADING
from .memory import note_device_storage
from .storages import byte_view, drop_storage, is_plain, tensor_on, use_count

__all__ = ["CudaCopyEngine", "HostPool", "SwapEngine", "ThreadCopyEngine"]


class HostPool:
    """Reusable host buffers for offloaded storages (pinned memory on CUDA), by power-of-two size class."""

    MIN_CLASS = 1 << 12

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[tuple[torch.UntypedStorage, Any]]] = collections.defaultdict(list)
        self._lock = threading.Lock()
        self.allocated_bytes = 0
        self.allocations = 0
        self.reuses = 0
        self.closed = False

    @classmethod
    def size_class(cls, nbytes: int) -> int:
        return max(cls.MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length())

    def get(self, nbytes: int) -> torch.UntypedStorage:
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free[size]
            if free:
                storage, ready = free.pop()
                self.reuses += 1
            else:
                storage, ready = None, None
        if storage is None:
            self.allocations += 1
            self.allocated_bytes += size
            if self.pin:
                return torch.empty(size, dtype=torch.uint8, pin_memory=True).untyped_storage()
            # a storage made directly, not by an operator: the CPU meter (a dispatch mode of the thread that asks
            # here, which may be the training thread) never sees the host store
            return torch.UntypedStorage(size)
        if ready is not None:
            ready.synchronize()
        return storage

    def put(self, storage: torch.UntypedStorage, ready: Any = None) -> None:
        with self._lock:
            if not self.closed:  # a closed pool keeps nothing: host memory goes back as records die
                self._free[storage.nbytes()].append((storage, ready))

    def close(self) -> None:
        """Drop every free buffer and keep none handed back from now on."""
        with self._lock:
            self.closed = True
            self._free.clear()

    def stats(self) -> dict[str, int]:
        return {"pool_bytes": self.allocated_bytes, "pool_allocations": self.allocations, "pool_reuses": self.reuses}


class _Record:
    """One device storage saved for backward inside managed units."""

    __slots__ = ("storage", "nbytes", "device", "owner", "seq", "state", "release_at", "host", "off_event", "back",
                 "back_event", "views", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, owner: int, seq: int) -> None:
        self.storage: torch.UntypedStorage | None = storage
        self.nbytes = storage.nbytes()
        self.device = storage.device
        self.owner = owner
        self.seq = seq
        self.state = "pending"
        self.release_at = -1
        self.host: torch.UntypedStorage | None = None
        self.off_event: Any = None
        self.back: torch.UntypedStorage | None = None
        self.back_event: Any = None
        #: the handles' views of the storage (each handle's ``ref``), kept here so that their number is known at every
        #: boundary; they lose the storage when it is released (:meth:`SwapEngine._boundary`)
        self.views: list[torch.Tensor] = []


class _Handle:
    __slots__ = ("rec", "offset", "size", "stride", "dtype", "ref", "version")

    def __init__(self, rec: _Record, t: torch.Tensor) -> None:
        self.rec = rec
        self.offset = t.storage_offset()
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        # to check at unpack, as autograd does, that nobody changed the tensor in place in between: a view that shares
        # its version counter. It holds the storage until the record is released and is then left without it
        # (``drop_storage``): a record that never leaves the device costs no alias, and its unpack hands back this
        # view.
        self.version = t._version
        self.ref = t.detach()
        rec.views.append(self.ref)

    def check_version(self) -> None:
        now = self.ref._version
        if now != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{self.ref.type()} {list(self.size)}] is at version {now}; expected version {self.version} "
                "instead. Hint: the tensor was saved for backward inside a unit of a memopt swap plan; change it out "
                "of place (y = y * 2, not y.mul_(2)), or clone it before changing it.")


def _manageable(t: torch.Tensor) -> bool:
    return is_plain(t) and t.device.type in ("cpu", "cuda")


#: the event of a copy made on the calling thread: already done
_DONE = threading.Event()
_DONE.set()


class ThreadCopyEngine:
    """Copy engines of the emulated CPU device: one worker thread per direction, one job per batch of records.

    A job of at most :attr:`INLINE_BYTES` runs on the calling thread instead: handing it to a worker (a queue, a
    wake-up, the interpreter lock going back and forth while the training thread runs its ops) costs the training
    thread more than the memmove itself (a 512 KiB memmove takes ~16 µs here, one idle round trip to a worker ~60 µs).
    What is copied and when a storage is released are the same either way; only which thread moves the bytes differs.
    """

    #: jobs of at most this many bytes are copied on the calling thread (``0``: every job goes to a worker)
    INLINE_BYTES = 1 << 20

    def __init__(self, threads: bool = True) -> None:
        self.pool = HostPool(pin=False)
        self.closed = not threads  # without threads every copy runs on the caller (a plan already removed)
        #: copy jobs run so far: ``"inline"`` on the calling thread, ``"threaded"`` by a worker
        self.jobs: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._queues = {"d2h": queue.Queue(), "h2d": queue.Queue()}
        self._threads = [threading.Thread(target=self._work, args=(q,), daemon=True, name=f"memopt-{k}")
                         for k, q in self._queues.items()] if threads else []
        if not threads:
            self.pool.close()
        for th in self._threads:
            th.start()

    def _work(self, q: queue.Queue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            kind, recs, ev = job
            del job
            self._copy(kind, recs)
            del recs
            ev.set()

    def _copy(self, kind: str, recs: list[_Record]) -> None:
        # a plain memmove: single-threaded and GIL-free, so the emulated copy engine does not fight the
        # compute threads' OpenMP pool the way a second thread's tensor.copy_ would
        for rec in recs:
            if kind == "d2h":
                host = self.pool.get(rec.nbytes)
                ctypes.memmove(host.data_ptr(), rec.storage.data_ptr(), rec.nbytes)
                rec.host = host
            else:
                host = rec.host
                ctypes.memmove(rec.back.data_ptr(), host.data_ptr(), rec.nbytes)
                rec.host = None
                self.pool.put(host)
            del host

    def _submit(self, kind: str, recs: list[_Record], event: str) -> None:
        """Copy ``recs`` (``kind``: ``"d2h"`` or ``"h2d"``); each record's attribute ``event`` becomes an event set once
        they are copied: for a job handed to a worker, before it is queued; for one copied here, after the copy."""
        if sum(rec.nbytes for rec in recs) > self.INLINE_BYTES:
            with self._lock:
                if not self.closed:
                    ev = threading.Event()
                    for rec in recs:
                        setattr(rec, event, ev)
                    self._queues[kind].put((kind, list(recs), ev))
                    self.jobs["threaded"] += 1
                    return
        # a small job, or the engine is closed (the plan was removed): copy on the calling thread, start no thread
        self._copy(kind, recs)
        for rec in recs:
            setattr(rec, event, _DONE)
        self.jobs["inline"] += 1

    def offload(self, recs: list[_Record]) -> None:
        self._submit("d2h", recs, "off_event")

    def wait_offload(self, rec: _Record) -> None:
        rec.off_event.wait()

    def prefetch(self, recs: list[_Record]) -> None:
        for rec in recs:
            rec.back = torch.UntypedStorage(rec.nbytes, device=rec.device)
            note_device_storage(rec.back)
        self._submit("h2d", recs, "back_event")

    def wait_prefetch(self, rec: _Record) -> None:
        rec.back_event.wait()

    def close(self) -> None:
        """Stop the worker threads once the copies already queued are done; later copies run on the caller."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            for q in self._queues.values():
                q.put(None)
        for th in self._threads:
            if th is not threading.current_thread():
                th.join(timeout=5)
        self.pool.close()


class CudaCopyEngine:  # pragma: no cover - needs a GPU
    """Copy engines of a CUDA device: a device-to-host and a host-to-device stream, pinned host pool, events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = HostPool(pin=True)
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def offload(self, recs: list[_Record]) -> None:
        compute = torch.cuda.current_stream(self.device)
        hosts = [self.pool.get(rec.nbytes) for rec in recs]
        self.d2h.wait_stream(compute)
        with torch.cuda.stream(self.d2h):
            for rec, host in zip(recs, hosts):
                byte_view(host, rec.nbytes).copy_(byte_view(rec.storage, rec.nbytes), non_blocking=True)
                rec.host = host
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        for rec in recs:
            rec.off_event = ev

    def wait_offload(self, rec: _Record) -> None:
        # Later compute-stream work (and reuse of the freed block) is ordered after the copy.
        torch.cuda.current_stream(self.device).wait_event(rec.off_event)

    def prefetch(self, recs: list[_Record]) -> None:
        compute = torch.cuda.current_stream(self.device)
        backs = [torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device) for rec in recs]
        self.h2d.wait_stream(compute)
        for rec in recs:
            self.h2d.wait_event(rec.off_event)
        with torch.cuda.stream(self.h2d):
            for rec, back in zip(recs, backs):
                back.copy_(byte_view(rec.host, rec.nbytes), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        for rec, back in zip(recs, backs):
            back.record_stream(self.h2d)
            rec.back = back.untyped_storage()
            rec.back_event = ev
            self.pool.put(rec.host, ready=ev)
            rec.host = None

    def wait_prefetch(self, rec: _Record) -> None:
        torch.cuda.current_stream(self.device).wait_event(rec.back_event)

    def close(self) -> None:
        self.pool.close()


class _Pass:
    """Book-keeping of one forward pass (a sequence of unit calls in increasing index).

    Only records whose copy to host is in flight are held strongly; otherwise a record lives exactly as long as the
    autograd graph holds a handle to it, as the tensor would without a plan.
    """

    def __init__(self) -> None:
        self.records: weakref.WeakValueDictionary[int, _Record] = weakref.WeakValueDictionary()
        self.pending: list[weakref.ref] = []
        self.issued: list[_Record] = []
        self.by_owner: dict[int, list[weakref.ref]] = collections.defaultdict(list)
        self.last_index = -1
        self.triggered: set[int] = set()
        self.seq = 0


class SwapEngine:
    """Runs the swap part of a plan for one model (see the module docstring for the protocol).

    Args:
        strategies, windows, distances: per unit, in forward order.
        triggers: per unit, the unit whose backward starts its prefetch (``plan.effective_triggers``).
    """

    def __init__(self, strategies: list[str], windows: list[int], triggers: list[int | None]) -> None:
        self.n = len(strategies)
        self.strategies = strategies
        self.windows = windows
        self.triggers = triggers
        self.owners_by_trigger: dict[int, list[int]] = collections.defaultdict(list)
        for u in range(self.n - 1, -1, -1):
            t = triggers[u]
            if t is not None:
                self.owners_by_trigger[t].append(u)
        self._copy: dict[torch.device, Any] = {}
        self._pass: _Pass | None = None
        self.stats = collections.Counter()
        self._lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------ copy engines
    def _engine(self, device: torch.device) -> Any:
        eng = self._copy.get(device)
        if eng is None:
            with self._lock:
                eng = self._copy.get(device)
                if eng is None:
                    # a copy needed after close starts no thread and keeps no pool
                    eng = CudaCopyEngine(device) if device.type == "cuda" else ThreadCopyEngine(not self.closed)
                    if self.closed:
                        eng.close()
                    self._copy[device] = eng
        return eng

    def close(self) -> None:
        """Stop the copy engines and drop the host pool. A graph built under the plan can still be backpropagated
        afterwards: what it still needs is copied back on the calling thread, and no thread or pool is started."""
        with self._lock:
            self.closed = True
            engines = list(self._copy.values())
        for eng in engines:
            eng.close()
        self._pass = None

    def pool_stats(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for eng in self._copy.values():
            out.update(eng.pool.stats())
            out.update({f"copy_jobs_{k}": v for k, v in getattr(eng, "jobs", {}).items()})
        return dict(out)

    # ------------------------------------------------------------------ unit boundaries
    def begin_unit(self, index: int) -> _Pass:
        """Called before unit ``index`` runs forward (with grad enabled)."""
        p = self._pass
        if p is None or index <= p.last_index:
            p = self._pass = _Pass()
        p.last_index = index
        self._boundary(p, next_unit=index, release_upto=index)
        return p

    def end_unit(self, p: _Pass, index: int, output: Any) -> None:
        """Called after unit ``index``'s forward returned ``output``."""
        last = index == self.n - 1
        self._boundary(p, next_unit=index + 1, release_upto=self.n if last else -1)
        owners = self.owners_by_trigger.get(index)
        if owners:
            self._hook_trigger(p, index, output)

    def _boundary(self, p: _Pass, next_unit: int, release_upto: int) -> None:
        if p.pending:
            ready, still = [], []
            for ref in p.pending:
                rec = ref()
                if rec is None:
                    continue
                # the record's storage object and its handles' views are the engine's; anyone else: still in use
                (still if use_count(rec.storage) > 1 + len(rec.views) else ready).append(rec)
            p.pending = [weakref.ref(r) for r in still]
            issue = []
            for rec in ready:
                if self.strategies[rec.owner] in OFFLOADING:
                    rel = next_unit + self.windows[rec.owner]
                    rec.release_at = rel if rel < self.n else self.n
                    issue.append(rec)
                else:
                    rec.state = "kept"
                    p.records.pop(id(rec.storage), None)
            # one copy job per (device, release point), earliest release first — as the simulator queues them
            issue.sort(key=lambda r: (r.release_at, r.seq))
            batches: dict[tuple[torch.device, int], list[_Record]] = {}
            for rec in issue:
                rec.state = "offloading"
                batches.setdefault((rec.device, rec.release_at), []).append(rec)
                self.stats["offloaded_bytes"] += rec.nbytes
                self.stats["offloads"] += 1
            for (device, _), recs in batches.items():
                self._engine(device).offload(recs)
            p.issued.extend(issue)
        if release_upto >= 0 and p.issued:
            keep = []
            for rec in p.issued:
                if rec.release_at <= release_upto:
                    t0 = time.perf_counter()
                    self._engine(rec.device).wait_offload(rec)
                    self.stats["offload_wait_s"] += time.perf_counter() - t0
                    p.records.pop(id(rec.storage), None)
                    rec.storage = None
                    for v in rec.views:  # storage-less from now on; the version counter stays shared
                        drop_storage(v)
                    rec.state = "offloaded"
                    p.by_owner[rec.owner].append(weakref.ref(rec))
                else:
                    keep.append(rec)
            p.issued = keep

    # ------------------------------------------------------------------ backward triggers
    def _hook_trigger(self, p: _Pass, index: int, output: Any) -> None:
        fired = [False]

        def hook(grad: torch.Tensor) -> None:
            if not fired[0]:
                fired[0] = True
                self._prefetch_for(p, index)

        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)

    def _prefetch_for(self, p: _Pass, trigger: int) -> None:
        if trigger in p.triggered:
            return
        p.triggered.add(trigger)
        for owner in self.owners_by_trigger.get(trigger, ()):
            recs = [r for r in (ref() for ref in p.by_owner.pop(owner, [])) if r is not None and r.back is None]
            if recs:
                self._start_prefetch(recs)

    def _start_prefetch(self, recs: list[_Record]) -> None:
        by_device: dict[torch.device, list[_Record]] = {}
        for rec in recs:
            rec.state = "prefetching"
            by_device.setdefault(rec.device, []).append(rec)
            self.stats["prefetched_bytes"] += rec.nbytes
        for device, batch in by_device.items():
            self._engine(device).prefetch(batch)

    # ------------------------------------------------------------------ saved tensor hooks
    def hooks(self, p: _Pass, index: int, param_ptrs: Container[int]) -> torch.autograd.graph.saved_tensors_hooks:
        """``saved_tensors_hooks`` for unit ``index`` in pass ``p``."""
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(p, index, param_ptrs, t), self._unpack)

    def pack(self, p: _Pass, index: int, param_ptrs: Container[int], t: torch.Tensor) -> Any:
        """What unit ``index`` keeps of ``t`` for its backward: ``t`` itself (a parameter, an empty or unmanaged
        tensor), or a handle to the storage's record, owned by the highest unit that packed it. Used for the tensors
        autograd saves inside a unit and for the inputs a ``recompute_offload`` unit's checkpoint keeps."""
        if not _manageable(t):
            return t
        st = t.untyped_storage()
        # a view of a parameter stays, even one the caller could not list: FSDP2's unsharded parameters (views of
        # its all-gather buffers) all-gathered by a module sharded inside the unit, after param_ptrs was taken
        if st.nbytes() == 0 or st.data_ptr() in param_ptrs or isinstance(t._base, torch.nn.Parameter):
            return t
        rec = p.records.get(id(st))
        if rec is None or rec.storage is not st:
            rec = _Record(st, index, p.seq)
            p.seq += 1
            p.records[id(st)] = rec
            p.pending.append(weakref.ref(rec))
        elif index > rec.owner:
            rec.owner = index
        return _Handle(rec, t)

    def unpack(self, h: Any) -> torch.Tensor:
        """The tensor a handle from :meth:`pack` stands for (waiting for, or starting, its copy back): a tensor of its
        own, which the caller may mark as needing grad."""
        out = self._unpack(h)
        return out.detach() if isinstance(h, _Handle) and out is h.ref else out

    def _unpack(self, h: Any) -> torch.Tensor:
        if isinstance(h, torch.Tensor):
            return h
        h.check_version()
        rec = h.rec
        if rec.storage is not None:  # never left the device: the handle's view still holds it
            return h.ref
        with self._lock:
            if rec.back is None:
                self.stats["on_demand"] += 1
                self._start_prefetch([rec])
        if rec.state == "prefetching":
            t0 = time.perf_counter()
            self._engine(rec.device).wait_prefetch(rec)
            self.stats["prefetch_wait_s"] += time.perf_counter() - t0
            rec.state = "back"
        return tensor_on(rec.back, h.dtype, h.offset, h.size, h.stride)
