"""The copy engines that move a unit's optimizer state, gradients and parameters between the device and its host
home: worker threads doing ``memmove`` on the emulated CPU device, side streams and pinned buffers on CUDA.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .memory import note_device_storage
from .storages import byte_view as _u8

__all__ = ["CudaMover", "ThreadMover"]


class ThreadMover:
    """Copies of the emulated CPU device: one worker thread per direction, ``memmove`` (invisible to the meter)."""

    def __init__(self) -> None:
        self._pools = {d: ThreadPoolExecutor(1, thread_name_prefix=f"memopt-state-{d}") for d in ("d2h", "h2d")}

    @staticmethod
    def new_host(nbytes: int) -> torch.UntypedStorage:
        return torch.UntypedStorage(nbytes)  # not an operator: the dispatch-mode meter does not see it

    @staticmethod
    def new_device(nbytes: int, device: torch.device) -> torch.UntypedStorage:
        st = torch.UntypedStorage(nbytes, device=device)
        note_device_storage(st)
        return st

    def copy(self, direction: str, dst: torch.UntypedStorage, src: torch.UntypedStorage, nbytes: int,
             after: Any = None) -> Future:
        refs = [dst, src, after]

        def job() -> None:
            d, s, a = refs
            refs.clear()  # let go of the storages before the ticket reads done, so a freed one is gone by then
            if a is not None:
                a.result()
            ctypes.memmove(d.data_ptr(), s.data_ptr(), nbytes)
            del d, s, a

        return self._pools[direction].submit(job)

    @staticmethod
    def wait(ticket: Any) -> None:
        """Wait until the device may use (or free) what ``ticket`` copied."""
        if ticket is not None:
            ticket.result()

    wait_host = wait
    #: before freeing the device side of a copy: the worker thread reads it, so the copy must be done
    release = wait

    @classmethod
    def chain(cls, ticket: Any) -> None:
        """Order a next copy of the same host bytes after ``ticket``: here, by finishing it on the calling thread."""
        cls.wait(ticket)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)


class CudaMover:  # pragma: no cover - needs a GPU (benchmarks/cuda_check.py runs it)
    """Copies of a CUDA device: a device-to-host and a host-to-device side stream, pinned host buffers, events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {"d2h": torch.cuda.Stream(device), "h2d": torch.cuda.Stream(device)}

    @staticmethod
    def new_host(nbytes: int) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()

    @staticmethod
    def new_device(nbytes: int, device: torch.device) -> torch.UntypedStorage:
        return torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()

    def copy(self, direction: str, dst: torch.UntypedStorage, src: torch.UntypedStorage, nbytes: int,
             after: Any = None) -> Any:
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            _u8(dst, nbytes).copy_(_u8(src, nbytes), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        # the device side must not be reused by the allocator before the copy has read or written it
        _u8(src if direction == "d2h" else dst, nbytes).record_stream(stream)
        return ev

    def wait(self, ticket: Any) -> None:
        if ticket is not None:
            torch.cuda.current_stream(self.device).wait_event(ticket)

    @staticmethod
    def wait_host(ticket: Any) -> None:
        if ticket is not None:
            ticket.synchronize()

    @staticmethod
    def release(ticket: Any) -> None:
        """Nothing to wait for before freeing the device side of a copy: :meth:`copy` recorded it on the copy stream,
        so the allocator reuses its block only once the copy has passed (the training thread does not stall)."""

    @staticmethod
    def chain(ticket: Any) -> Any:
        """Order a next copy of the same host bytes after ``ticket``: its stream waits for the event (GPU side)."""
        return ticket

    def close(self) -> None:
        torch.cuda.synchronize(self.device)


