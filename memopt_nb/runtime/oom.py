"""Running out of memory inside ``with memopt.plan(p):`` loses nothing.

A plan can still run out of memory: allocator fragmentation on CUDA, an input larger than the profiled one, a device
shared with other work, a limit below the plan's predicted peak. :class:`StepGuard` follows the training step under
the plan and keeps, on the host, what the step changes and cannot give back by itself:

* at the start of every training forward (each micro-batch): the RNG states, the gradients accumulated so far (host
  copies of resident ones, copies of the host values of offloaded ones; only where gradients exist) and the model's
  buffers (copied again only when one changed since the last copy, and running statistics each time, not a constant
  mask);
* at the start of ``opt.step()`` (once per step, not per micro-batch): the parameters that step will change and their
  optimizer state (offloaded state is copied from its host value, host to host). Units stepped in backward were
  kept by the plan's own undo copies before their step (:data:`~memopt_nb.runtime.state.UNDO_STEPS_IN_BACKWARD`).
  :data:`KEEP_BEFORE_STEP` off (by default on CUDA, where the copy would cross the host link every step) saves this
  copy; a step that runs out of memory in ``opt.step()`` then leaves parameters and optimizer state partly updated,
  and the note says so.

When ``torch.OutOfMemoryError`` leaves the block, whatever the nesting of ``memopt.limit_memory`` and ``memopt.plan``,
the recovery needs no device memory of its own: it first lets go of the failed step (the error's traceback below the
frame of the ``with`` statement, whose frames and closures hold its activations, and its partial gradients: the note
says where in the model's code it ran out of memory instead), then removes the
plan (every offloaded optimizer state, gradient and parameter back in its own tensor on the device), then puts
parameters, gradients, optimizer state, buffers and RNG back as they were before the step — on the emulated device by
handing the host copies over as they are, on CUDA by copying them back into the memory the failed step freed, past a
``limit_memory`` fraction if one is set (:func:`~memopt_nb.runtime.limit.exempt`: the device held all of it before the
step). The error gets a note saying what happened, what was put back and what to do; the next micro-batch then trains
as if the failed one had never run.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves

from ..core.budget import format_bytes
from .hooks import uncopied
from .limit import active_limit, exempt, recount
from .replay_guard import running_stat_modules
from .slots import HostTensor
from .storages import tensor_on

__all__ = ["KEEP_BEFORE_STEP", "StepGuard", "leave_plan"]

#: keep host copies of the parameters and optimizer state each ``opt.step()`` under a plan changes, so that one that
#: runs out of memory partway is put back (one copy per step): ``True``, ``False``, or ``None`` (the default): on the
#: CPU's emulated device, where the copy is a memory copy (a few % of a step), not on CUDA, where it would cross the
#: host link every step with all the state
KEEP_BEFORE_STEP: bool | None = None

#: the phases of a step under a plan in which a step has begun and is put back after running out of memory
_MID_STEP = ("forward", "loss or backward", "backward", "optimizer step")


@contextlib.contextmanager
def _unseen() -> Iterator[None]:
    """Host copies that no meter counts as device memory: made outside every dispatch mode (the memory meters of
    ``measure`` and ``profile``, the emulated limit), without autograd."""
    with _disable_current_modes(), torch.no_grad():
        yield


def _host_value(t: torch.Tensor) -> torch.Tensor | None:
    """A host copy of ``t``'s value (the caller holds :func:`_unseen`): of a device tensor, of an
    offloaded placeholder's or offloaded parameter's host value (host to host), ``None`` for a gradient already
    consumed by a step in backward (it has no value)."""
    slot = None
    if isinstance(t, HostTensor):
        if t._stepped:
            return None
        slot = t._slot
    elif isinstance(t, nn.Parameter) and "_memopt_offload" in t.__dict__:
        slot = t.__dict__["_memopt_offload"].slot  # its device storage is empty: the host copy is its value
    if slot is not None:
        slot.mover.wait_host(slot.ticket)
        return tensor_on(slot.host, slot.dtype, slot.offset, slot.size, slot.stride).clone()
    return t.detach().to("cpu", copy=True)


def _on(kept: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``kept`` as a tensor on ``device``: itself on the emulated device (no copy), else copied back."""
    return kept if kept.device == device else kept.to(device)


class StepGuard:
    """What the current training step under a plan changes, to put it back if the step runs out of memory."""

    def __init__(self, applied: Any) -> None:
        self.applied = applied
        self.model: nn.Module = applied.model
        self.phase = "between steps"
        self._rng: tuple[Any, Any] | None = None
        self._grads: list[tuple[nn.Parameter, torch.Tensor | None]] | None = None
        #: per parameter, its gradient when the copies were taken (weakly) and that gradient's version
        self._marks: list[tuple[weakref.ref, int] | None] = []
        #: (module, name, buffer, its version when kept, or -1: put back whatever its version)
        self._buffers: list[tuple[nn.Module, str, torch.Tensor, int]] = []
        self._buffer_copies: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._step: tuple[Any, list[tuple[nn.Parameter, torch.Tensor]], list[tuple[nn.Parameter, Any]]] | None = None
        self._handles = [
            self.model.register_forward_pre_hook(uncopied(self._before_forward)),
            self.model.register_forward_hook(uncopied(self._after_forward)),
            register_optimizer_step_pre_hook(uncopied(self._before_step)),
            register_optimizer_step_post_hook(uncopied(self._after_step)),
        ]

    # -- following the step
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        # a new step (micro-batch) begins at a training forward after a backward or a step; another forward before
        # any gradient changed (two forwards, one loss) is part of the same one
        if not torch.is_grad_enabled() or self.phase == "forward":
            return
        if self.phase == "loss or backward" and not self._grads_changed():
            self.phase = "forward"
            return
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._rng = (torch.get_rng_state(), cuda)
        params = list(self.model.parameters())
        with _unseen():  # host copies, only of gradients that exist (accumulation)
            self._grads = [(p, None if p.grad is None else _host_value(p.grad)) for p in params]
            self._keep_buffers()
        self._marks = [None if p.grad is None else (weakref.ref(p.grad), p.grad._version) for p in params]
        self._step = None
        self.phase = "forward"

    def _grads_changed(self) -> bool:
        """Whether any gradient is another tensor, or was changed in place, since the copies were taken (a backward
        ran, through the model's outputs or not)."""
        params = list(self.model.parameters())
        if self._grads is None or len(params) != len(self._marks):
            return True
        for p, mark in zip(params, self._marks, strict=True):
            g = p.grad
            if mark is None:
                if g is not None:
                    return True
            elif g is None or mark[0]() is not g or g._version != mark[1]:
                return True
        return False

    def _keep_buffers(self) -> None:
        """The model's buffers as they are now. A buffer unchanged since its last copy (same tensor, same version)
        keeps that copy; running statistics are copied each time (the batch-norm kernels update them in place
        without bumping their version)."""
        kept, copies = [], {}
        stats = {id(m) for m in running_stat_modules(self.model)}
        for mod in self.model.modules():
            for name, b in mod._buffers.items():
                if b is None:
                    continue
                version, always = b._version, id(mod) in stats
                old = self._buffer_copies.get(id(b))
                copies[id(b)] = old if not always and old is not None and old[0] is b and old[1] == version else \
                    (b, version, _host_value(b))
                kept.append((mod, name, b, -1 if always else version))
        self._buffers, self._buffer_copies = kept, copies

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase != "forward":
            return
        self.phase = "loss or backward"
        for t in tree_leaves(output):  # only to name the phase in the note
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_reached)

    def _backward_reached(self, grad: torch.Tensor) -> None:
        if self.phase == "loss or backward":
            self.phase = "backward"

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        mine = {id(p) for p in self.model.parameters()}
        params = list({id(p): p for g in optimizer.param_groups for p in g["params"] if id(p) in mine}.values())
        if not params:
            return  # another model's optimizer
        self.phase = "optimizer step"
        if KEEP_BEFORE_STEP is False or (KEEP_BEFORE_STEP is None and params[0].device.type != "cpu"):
            return
        state = self.applied.state
        stepped = set()  # units stepped in backward: the plan's undo copies hold them as before their step
        if state is not None:
            stepped = {id(p) for u in state._stepped for p in state.unit_params[u]}
        with _unseen():
            kept_params = [(p, _host_value(p)) for p in params if p.grad is not None and id(p) not in stepped]
            kept_state = []
            for p, _ in kept_params:
                st = optimizer.state.get(p)  # not state[p]: the defaultdict would add an entry
                kept_state.append((p, None if st is None else {
                    k: _host_value(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in st.items()}))
        self._step = (optimizer, kept_params, kept_state)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.phase == "optimizer step":
            self.phase = "between steps"
            self._step = None

    def close(self) -> None:
        """Stop following the steps (the copies stay, for :meth:`recover`)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- after the error
    def recover(self, error: BaseException, tb: Any) -> None:
        """Remove the plan and put the model back as it was before the step that ran out of memory (see the module
        docstring); add a note to ``error`` saying what was put back and what to do."""
        phase, applied = self.phase, self.applied
        # mid-step: a forward under the plan kept the gradients, or an opt.step() under it began (perhaps after a
        # backward outside the block: then the gradients are as it left them, which the step does not change)
        mid = phase in _MID_STEP and (self._grads is not None or phase == "optimizer step")
        lost: list[str] = []
        where = None
        optimizer = applied.optimizer if self._step is None else self._step[0]
        try:
            with exempt():
                where = _let_go(error, tb)
                if mid and self._grads is not None:
                    for p in self.model.parameters():
                        p.grad = None  # the partial gradients go before anything comes back
                if phase == "optimizer step" and applied.state is not None and applied.state._stepped:
                    applied.state.undo_steps_in_backward()  # units stepped in backward, from the plan's own copies
                gc.collect()
                try:
                    applied.remove(everything=True)
                finally:
                    if mid:
                        self._put_back(lost)
        except Exception as exc:  # noqa: BLE001 - the out-of-memory error is the one to raise; this goes in its note
            lost.append(f"putting the step back failed ({type(exc).__name__}: {exc})")
        finally:
            if active_limit() is not None:
                recount(self.model, *([optimizer] if optimizer is not None else []))
            if hasattr(error, "add_note"):
                error.add_note(self._note(phase, mid, lost, where))

    def _put_back(self, lost: list[str]) -> None:
        """Gradients, parameters and optimizer state (a step that had reached ``opt.step()``), buffers and RNG as
        before the step, from the host copies (the plan is removed: every tensor is back in its own storage)."""
        with torch.no_grad():
            if self._step is not None:
                optimizer, kept_params, kept_state = self._step
                for p, v in kept_params:
                    p.copy_(v)
                for p, kept in kept_state:
                    self._put_back_state(optimizer, p, kept)
            elif self.phase == "optimizer step":
                lost.append("the optimizer step had started, so some parameters and optimizer state already hold "
                            "this step's update (memopt.runtime.oom.KEEP_BEFORE_STEP is off, as it is by default on "
                            "CUDA; set it to True to keep a host copy before each step)")
            for p, g in self._grads or []:
                p.grad = None if g is None else _on(g, p.device)
            for mod, name, b, version in self._buffers:
                if mod._buffers.get(name) is not b:
                    mod._buffers[name] = b
                if b._version != version:
                    b.copy_(self._buffer_copies[id(b)][2])
        if self._rng is not None:
            torch.set_rng_state(self._rng[0])
            if self._rng[1] is not None:
                torch.cuda.set_rng_state_all(self._rng[1])
        self._grads, self._step = None, None

    @staticmethod
    def _put_back_state(optimizer: Any, p: nn.Parameter, kept: dict[str, Any] | None) -> None:
        if kept is None:  # the failed step made it: plain training has none yet
            optimizer.state.pop(p, None)
            return
        st = optimizer.state[p]
        for k in [k for k in st if k not in kept]:
            del st[k]
        for k, v in kept.items():
            cur = st.get(k)
            if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor) and cur.shape == v.shape \
                    and cur.dtype == v.dtype and type(cur) is torch.Tensor:
                cur.copy_(v)  # the same tensor object, as before the step
            elif isinstance(v, torch.Tensor):
                st[k] = _on(v, cur.device if isinstance(cur, torch.Tensor) else p.device)
            else:
                st[k] = v

    def _note(self, phase: str, mid: bool, lost: list[str], where: str | None) -> str:
        plan = self.applied.plan
        predicted, budget = plan.predicted_peak_bytes, plan.budget_bytes
        dev = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        limit = active_limit(dev)
        facts = []
        if isinstance(predicted, (int, float)):
            facts.append(f"predicted peak {format_bytes(predicted)}")
        if isinstance(budget, (int, float)):
            facts.append(f"budget {format_bytes(budget)}")
        if limit is not None:
            facts.append(f"memopt.limit_memory {format_bytes(limit)}")
        if not mid:
            restored = ("it came between steps, so nothing of a step was put back: parameters, gradients and optimizer "
                        "state are as the last step left them")
        elif not lost:
            restored = ("parameters, gradients (those accumulated before it included), optimizer state, buffers and "
                        "RNG are as before the step, so training can go on with the next batch as if this one had "
                        "never run")
        else:
            restored = "gradients, buffers and RNG are as before the step, but " + "; ".join(lost)
        return (f"memopt: out of memory in the {phase} of a step under the plan {plan.method!r}"
                + (f" ({', '.join(facts)})" if facts else "") + (f", {where}" if where else "")
                + ". The plan was removed: every offloaded optimizer state, gradient and parameter is back in its "
                f"own tensor on the device; {restored}. Drop your own references to the failed step (e.g. `del loss`) "
                "before going on. To fit: plan for less memory (memopt.search(prof, budget=...) with a lower budget, "
                "or profile at the input shape you train with), or train a smaller batch: memopt.max_batch(builder) "
                "gives the largest that any plan fits.")


def _let_go(error: BaseException, tb: Any) -> str | None:
    """Let go of what the error still holds of the failed step: its traceback below the frame that left the plan's
    block (those frames, their variables and the closures they ran hold its activations) and the tracebacks of the
    errors it was raised while handling. Returns where in the model's own code it ran out of memory, for the note."""
    where = None
    if tb is not None:
        outside = [f for f in traceback.extract_tb(tb) if not any(
            part in f.filename.replace("\\", "/") for part in ("/torch/", "/memopt_nb/", "/contextlib.py"))]
        if len(outside) > 1:  # the innermost frame of the user's or the model's code (not the with statement's)
            f = outside[-1]
            where = f"at {f.filename}, line {f.lineno}, in {f.name}"
        traceback.clear_frames(tb)
        tb.tb_next = None
    seen, other = {id(error)}, error.__context__ or error.__cause__
    while other is not None and id(other) not in seen:
        seen.add(id(other))
        traceback.clear_frames(other.__traceback__)
        other.__traceback__ = None
        other = other.__context__ or other.__cause__
    return where


def leave_plan(applied: Any, exc: tuple[Any, Any, Any]) -> None:
    """``AppliedPlan.__exit__``: remove the plan and, when out of memory ended the block, put the step back (see the
    module docstring). What the plan held on the host comes back only if it fits the device (counted by an emulated
    limit as it comes); otherwise it stays there, the plan's state placements still in force
    (:meth:`~memopt_nb.runtime.state.StateManager.leave`)."""
    guard = getattr(applied, "_oom_guard", None)
    if guard is not None and isinstance(exc[1], torch.OutOfMemoryError):
        guard.recover(exc[1], exc[2])
        return
    model, optimizer = applied.model, applied.optimizer
    try:
        applied.remove()
    finally:
        if active_limit() is not None:
            recount(model, optimizer)
