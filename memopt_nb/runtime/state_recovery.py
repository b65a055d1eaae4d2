"""Putting back units stepped in a backward that failed afterwards (an exception, an interrupt, a refused call): the
host copies kept before their step (:data:`~memopt_nb.runtime.state.UNDO_STEPS_IN_BACKWARD`) written back."""

from __future__ import annotations

import copy
import ctypes
from typing import Any

import torch
import torch.nn as nn

from .movers import CudaMover, ThreadMover
from .slots import HostTensor
from .state_errors import StepInBackwardError

__all__ = ["Recovery"]


class Recovery:
    """Undoing steps in backward: a part of :class:`~memopt_nb.runtime.state.StateManager`."""

    def undo_steps_in_backward(self) -> int:
        """Put the units stepped in a backward that has not been followed by ``opt.step()`` back as they were before
        their step (parameters and optimizer state); returns how many. Used before refusing what would otherwise
        leave them half-trained. Their gradients are gone: ``opt.zero_grad()`` must come before the next forward or
        step (both raise :class:`StepInBackwardError` until then)."""
        self._recover_failed_backward()
        return self._undo_stepped()

    def _host_copy(self, key: tuple[int, Any], t: torch.Tensor) -> tuple[Any, int, Any]:
        """Start copying ``t``'s storage into a host buffer kept for ``key`` (reused step after step). A tensor
        already in host memory beside a CUDA device (Adam's step count) is cloned instead (no copy stream)."""
        st = t.untyped_storage()
        n = st.nbytes()
        if isinstance(self._mover, CudaMover) and t.device.type != "cuda":
            return t.detach().clone(), n, None
        host = self._undo_bufs.get(key)
        if host is None or host.nbytes() != n:
            host = self._undo_bufs[key] = self._mover.new_host(n)
        self.stats["undo_d2h_bytes"] += n
        if isinstance(self._mover, ThreadMover):  # the emulated device: on this thread, no job to hand over and wait
            ctypes.memmove(host.data_ptr(), st.data_ptr(), n)
            return host, n, None
        return host, n, self._mover.copy("d2h", host, st, n)

    def _keep_for_undo(self, u: int, chunk: list[nn.Parameter]) -> None:
        """Before unit ``u`` steps in backward: host copies of its parameters and optimizer state, so that a backward
        that fails later can put the unit back (an exception mid-backward, or a refused optimizer)."""
        opt = self.optimizer
        records, tickets = [], []
        for p in chunk:
            host, n, ticket = self._host_copy((id(p), None), p)
            tickets.append(ticket)
            st = opt.state.get(p)
            kept = None
            if st:
                kept = {}
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and not isinstance(v, HostTensor):
                        h, m, t = self._host_copy((id(p), k), v)
                        tickets.append(t)
                        kept[k] = (v, h, m)
                    else:
                        kept[k] = copy.deepcopy(v)
            records.append((p, (host, n), kept))
        for t in tickets:  # the step changes them in place: the copies must have read them first
            self._mover.wait(t)
        self._undo.setdefault(u, []).extend(records)  # a streamed unit keeps its parameters one at a time

    def _write_back(self, t: torch.Tensor, host: Any, n: int) -> None:
        if isinstance(host, torch.Tensor):  # a clone (see _host_copy)
            with torch.no_grad():
                t.copy_(host)
            return
        self._mover.wait(self._mover.copy("h2d", t.untyped_storage(), host, n))

    def _undo_stepped(self) -> int:
        """Put every unit stepped in backward and not yet followed by ``opt.step()`` back as it was before its step."""
        units = sorted(u for u in self._stepped if u in self._undo)
        opt = self.optimizer
        for u in units:
            offloaded = bool(self._param_slots[u])
            if offloaded:
                self._fetch_params(u, wait=True)
            for p, (host, n), kept in self._undo.pop(u):
                self._write_back(p, host, n)
                if kept is None:  # its state was made by that step: plain training has none yet
                    opt.state.pop(p, None)
                    continue
                self._bring_state(p, wait=True)
                st = opt.state[p]
                for k, v in kept.items():
                    if isinstance(v, tuple):
                        tensor, h, m = v
                        self._write_back(tensor, h, m)
                        st[k] = tensor
                    else:
                        st[k] = v
                if self.placements[u].optimizer != "resident":
                    self._send_state(p)
            self._release_pending()
            if offloaded:
                self._param_dirty[u] = True
                if not self._in_bw[u]:
                    self._free_params(u)
        self._stepped.difference_update(units)  # without copies (UNDO_STEPS_IN_BACKWARD off) they stay stepped
        self._undo.clear()
        if units:
            self._undone_pending = True
            self.stats["steps_in_backward_undone"] += len(units)
        return len(units)

    def _backward_failed(self) -> bool:
        """Whether a backward that reached this manager's hooks ended without running its end-of-backward callback
        (it raised, or was interrupted), and no backward runs now."""
        return self._callback_queued and torch._C._current_graph_task_id() == -1

    def _recover_failed_backward(self) -> int:
        """After a failed backward: put back the units it stepped (their parameters and optimizer state as before
        their step), then do the bookkeeping its end-of-backward callback would have done. Returns the units put
        back."""
        if not self._callback_queued or torch._C._current_graph_task_id() == self._queued_task:
            return 0
        undone = self._undo_stepped() if self._sib_gen == self._gen else 0
        self._end_of_backward()
        return undone

    def _refuse_after_undo(self, what: str) -> None:
        if self._backward_failed():
            self._recover_failed_backward()
        if self._undone_pending:
            raise StepInBackwardError(
                f"{what} after a backward that failed partway: the units it had already stepped were put back as they "
                "were before it (parameters and optimizer state), but their gradients are gone, so the batch cannot be "
                "finished. Skip it with opt.zero_grad() (or model.zero_grad() then opt.zero_grad()) and go on")
