"""A whole-step plan's optimizer state and gradients moving between the device and the host, and the optimizer's
``zero_grad`` / ``state_dict`` / ``load_state_dict`` while they do (see :mod:`memopt_nb.runtime.state`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .limit import active_limit, recount
from .slots import HostTensor, Slot, placeholder
from .state_errors import STEP_RULES, StepInBackwardError
from .storages import exclusive as _exclusive
from .storages import movable

__all__ = ["StateMoves"]


class _Missing:
    pass


#: an optimizer method the manager replaced that the optimizer did not have as its own attribute
_MISSING = _Missing()


class StateMoves:
    """Optimizer state sent to the host and brought back, gradients offloaded as backward accumulates them, and the
    optimizer's own methods over them: a part of :class:`~memopt_nb.runtime.state.StateManager`."""

    def _send_state(self, p: nn.Parameter) -> None:
        """Start moving the device tensors of ``opt.state[p]`` to the host; placeholders take their place."""
        st = self.optimizer.state.get(p)  # not state[p]: the defaultdict would add an entry plain training has not
        if not st:
            return
        for key, v in list(st.items()):
            if isinstance(v, HostTensor) or not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            if v.device != p.device or not movable(v):
                self.stats["state_left_resident"] += 1
                continue
            slot = self._state_slots.get((id(p), key))
            if slot is None or slot.tensor is not v or slot.nbytes != v.nbytes:
                slot = self._state_slots[(id(p), key)] = Slot(self._mover, v, True, "state", p)
            slot.send(slot.storage)
            self.stats["state_d2h_bytes"] += slot.nbytes
            st[key] = placeholder(slot)
            self._pending.append(slot)

    def _release_pending(self) -> None:
        pending, self._pending = self._pending, []
        for slot in pending:
            slot.free()

    def _bring_state(self, p: nn.Parameter, wait: bool) -> list[Slot]:
        st = self.optimizer.state.get(p)
        out = []
        if st:
            for key, v in list(st.items()):
                if isinstance(v, HostTensor) and not v._stepped:
                    slot = v._slot
                    slot.refill()
                    self.stats["state_h2d_bytes"] += slot.nbytes
                    out.append(slot)
                    st[key] = slot.tensor
        if wait:
            for slot in out:
                slot.wait()
        return out

    def _offload_grad(self, p: nn.Parameter) -> torch.Tensor | None:
        """Start copying ``p.grad`` to the host, a placeholder in its place; the device gradient (None if it stays)."""
        g = p.grad
        if not _exclusive(g):
            self.stats["grads_left_resident"] += 1
            return None
        slot = self._grad_slots.get(id(p))
        if slot is None or slot.nbytes != g.nbytes or slot.dtype != g.dtype:
            slot = self._grad_slots[id(p)] = Slot(self._mover, g, False, "grad", p)
        slot.send(g.untyped_storage())  # the copy job holds the storage until it has been read
        self.stats["grad_d2h_bytes"] += slot.nbytes
        p.grad = placeholder(slot)
        return g

    def _make_pre_hook(self, u: int, p: nn.Parameter) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            self._queue_end_of_backward()
            if (self.placements[u].grads == "step" and self._sib_gen != self._gen
                    and (self._stepped or self._stale_now())):
                raise StepInBackwardError("a backward reached parameters that were already stepped in backward and "
                                          f"whose gradients were not cleared by opt.zero_grad(); {STEP_RULES}."
                                          + self._settle())
            old = p.grad
            if isinstance(old, HostTensor):  # accumulate as plain training would: old += new
                acc = old._slot.materialize()
                self.stats["grad_h2d_bytes"] += old._slot.nbytes
                p.grad = None
                return acc.add_(grad)
            return None

        return hook

    def _make_post_hook(self, u: int, in_opt: dict[int, int]) -> Any:
        pl = self.placements[u]

        def hook(p: nn.Parameter) -> None:
            self._queue_end_of_backward()
            if pl.grads == "offload" and id(p) in in_opt and p.grad is not None:
                sent = self._offload_grad(p)
                if sent is not None:
                    self._sent_grads[u].append(sent)
            seen = self._seen[u]
            seen.add(id(p))
            if len(seen) < len(self._trainable[u]):
                return
            seen.clear()
            if pl.grads == "offload":  # the unit's gradients leave the device before backward moves on
                self._drop_sent_grads(u)
            if pl.grads == "step":
                self._step_in_backward(u)
            if self._param_slots[u]:
                if self._frozen[u]:  # its backward may still read a frozen parameter (a LoRA adapter's base
                    self._deferred.add(u)  # weight, for the input's gradient): freed when backward leaves the unit
                    return
                self._free_params(u)
                self._in_bw[u] = False

        return hook

    def _drop_sent_grads(self, u: int) -> None:
        for i in self._trainable[u]:
            slot = self._grad_slots.get(i)
            if slot is not None:
                slot.mover.release(slot.ticket)
        self._sent_grads[u].clear()

    def _zero_grad(self, set_to_none: bool) -> None:
        if self._backward_failed():  # skipping a batch whose backward raised: put its stepped units back first
            self._recover_failed_backward()
        self._undone_pending = False
        if self._stepped and all(u in self._undo for u in self._stepped):
            self._undo_stepped()  # skipping the batch: its steps put back, as plain training never made them
            self._undone_pending = False
        if self._stepped:
            names = self.unit_names(sorted(self._stepped))
            raise StepInBackwardError("opt.zero_grad() before opt.step() after a backward that already stepped "
                                      f"units {names}: plain training would discard those gradients, but without undo "
                                      "copies (memopt.runtime.state.UNDO_STEPS_IN_BACKWARD off) the units cannot be "
                                      f"put back; {STEP_RULES}." + self._settle())
        hidden = []
        for ps in self.unit_params:
            for p in ps:
                g = p.grad
                if not isinstance(g, HostTensor):
                    continue
                if g._stepped:
                    self._stale -= 1
                if set_to_none:
                    p.grad = None
                    continue
                if g._stepped:  # plain training would now hold zeros: a zero-filled host value
                    slot = self._grad_slots.get(id(p))
                    if slot is None:
                        slot = self._grad_slots[id(p)] = Slot(self._mover, g._like, False, "grad", p)
                    g = placeholder(slot)
                g._slot.zero()
                hidden.append((p, g))
                p.grad = None
        self._stale = max(self._stale, 0)
        prev = self._opt_saved.get("zero_grad", _MISSING)
        opt = self.optimizer
        try:
            if prev is _MISSING:
                type(opt).zero_grad(opt, set_to_none)
            else:
                prev(set_to_none)
        finally:
            for p, g in hidden:
                p.grad = g

    def _state_dict(self) -> dict[str, Any]:
        prev = self._opt_saved.get("state_dict", _MISSING)
        opt = self.optimizer
        sd = type(opt).state_dict(opt) if prev is _MISSING else prev()
        state = {}
        for k, v in sd["state"].items():
            if isinstance(v, dict) and any(isinstance(x, HostTensor) for x in v.values()):
                v = {kk: (x._slot.host_copy() if isinstance(x, HostTensor) else x) for kk, x in v.items()}
            state[k] = v
        sd["state"] = state
        return sd

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The optimizer's own ``load_state_dict`` (it replaces the state, offloaded entries included: nothing is
        brought back for it), then the state of units that keep it on the host sent there one parameter at a time.
        A tensor of ``state_dict`` the optimizer took as it is (same device and dtype) is copied before it is sent, so
        the caller's state dict keeps its values."""
        opt = self.optimizer
        given = {id(v) for st in state_dict.get("state", {}).values() if isinstance(st, dict)
                 for v in st.values() if isinstance(v, torch.Tensor)}
        prev = self._opt_saved.get("load_state_dict", _MISSING)
        if prev is _MISSING:
            type(opt).load_state_dict(opt, state_dict)
        else:
            prev(state_dict)
        self._state_slots.clear()
        for u, pl in enumerate(self.placements):
            if pl.optimizer == "resident":
                continue
            for p in self.unit_params[u]:
                st = opt.state.get(p)
                if not st:
                    continue
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and id(v) in given and v.dim() > 0:
                        st[k] = v.clone(memory_format=torch.preserve_format)
                self._send_state(p)
                self._release_pending()
        if active_limit() is not None:
            recount(opt)  # state loaded from host copies is the device's now
        self._state_keys = {id(k) for k in opt.state}
