"""Running out of memory inside ``with memopt.plan(p):`` loses nothing.

A plan can still run out of memory: allocator fragmentation on CUDA, an input larger than the profiled one, a device
shared with other work, a limit below the plan's predicted peak. :class:`StepGuard` remembers, at the start of every
training forward under the plan, what the step is about to change and cannot give back by itself — the RNG states and
the gradients accumulated so far (host copies, only where gradients exist) — and follows which phase the step is in.
When ``torch.OutOfMemoryError`` leaves the block, the plan is removed first (every offloaded optimizer state, gradient
and parameter back in its own tensor on the device, even past an emulated limit), then the gradients and RNG are put
back as they were before the step, and the error gets a note that says what happened and what to do.

Parameters and optimizer state are not copied each step (that would double the step's traffic): a step that ran out of
memory in its forward or backward has not changed them. One that ran out inside the optimizer step, or after a step
in backward had updated some units, has; the note then says which and that they could not be put back.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..core.budget import format_bytes
from .hooks import uncopied
from .limit import active_limit, recount, uncounted

__all__ = ["StepGuard", "leave_plan"]


class StepGuard:
    """What the current training step under a plan changes, to put it back if the step runs out of memory."""

    def __init__(self, applied: Any) -> None:
        self.applied = applied
        self.model: nn.Module = applied.model
        self.phase = "between steps"
        self._rng: tuple[Any, Any] | None = None
        self._grads: list[tuple[nn.Parameter, torch.Tensor | None]] | None = None
        self._grads_kept = True
        self._steps_in_backward = 0
        self._handles = [
            self.model.register_forward_pre_hook(uncopied(self._before_forward)),
            self.model.register_forward_hook(uncopied(self._after_forward)),
            register_optimizer_step_pre_hook(uncopied(self._before_step)),
            register_optimizer_step_post_hook(uncopied(self._after_step)),
        ]

    # -- following the step
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or self.phase == "forward":
            return
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._rng = (torch.get_rng_state(), cuda)
        grads: list[tuple[nn.Parameter, torch.Tensor | None]] = []
        self._grads_kept = True
        with uncounted(), torch.no_grad():  # host copies, only of gradients that exist (accumulation)
            for p in self.model.parameters():
                g = p.grad
                if g is None:
                    grads.append((p, None))
                elif type(g) is torch.Tensor:
                    grads.append((p, g.detach().to("cpu", copy=True)))
                else:  # a placeholder of an offloaded gradient: its value lives in the plan's host store
                    self._grads_kept = False
        self._grads = grads
        self._steps_in_backward = self._stepped_in_backward()
        self.phase = "forward"

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase == "forward":
            self.phase = "loss or backward"

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.phase = "optimizer step"

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.phase = "between steps"

    def _stepped_in_backward(self) -> int:
        state = self.applied.state
        return int(state.stats.get("steps_in_backward", 0)) if state is not None else 0

    def close(self) -> None:
        """Stop following the steps (the snapshot stays, for :meth:`recover`)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- after the error
    def recover(self, error: BaseException) -> None:
        """Put gradients and RNG back as they were before the step that ran out of memory, and add a note to
        ``error`` saying what was restored and what to do."""
        phase = self.phase
        lost = []
        if phase == "optimizer step":
            lost.append("the optimizer step had started, so some parameters and optimizer state already hold this "
                        "step's update")
        if self._steps_in_backward_since():
            lost.append("units stepped in backward (grads='step') already hold this step's update")
        if self._grads is not None:
            with torch.no_grad():
                for p, _ in self._grads:
                    p.grad = None  # drop the partial gradients first: their memory goes before the copies come back
                for p, g in self._grads:
                    if g is not None:
                        p.grad = g.to(p.device, copy=True)
            if not self._grads_kept:
                lost.append("gradients offloaded by the plan before this step were left as the step left them")
        if self._rng is not None:
            torch.set_rng_state(self._rng[0])
            if self._rng[1] is not None:
                torch.cuda.set_rng_state_all(self._rng[1])
        recount(self.model)
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
        restored = ("gradients and RNG are as before the step; parameters and optimizer state were not changed by it"
                    if not lost else "gradients and RNG are as before the step, but " + "; ".join(lost))
        note = (f"memopt: out of memory in the {phase} of a step under the plan {plan.method!r}"
                + (f" ({', '.join(facts)})" if facts else "") + f". The plan was removed: every offloaded optimizer "
                f"state, gradient and parameter is back in its own tensor on the device; {restored}. To fit: plan for "
                f"less memory (memopt.search(prof, budget=...) with a lower budget, or profile at the input shape you "
                f"train with), or train a smaller batch: memopt.max_batch(builder) gives the largest that any plan "
                f"fits.")
        if hasattr(error, "add_note"):
            error.add_note(note)

    def _steps_in_backward_since(self) -> bool:
        return self._stepped_in_backward() > self._steps_in_backward


def leave_plan(applied: Any, exc: tuple[Any, Any, Any]) -> None:
    """``AppliedPlan.__exit__``: remove the plan and, when out of memory ended the block, recover the step (see the
    module docstring). Removing never runs into an emulated limit: what the plan held on the host comes back even if
    the device is then over it (the next allocation past the limit raises)."""
    guard = getattr(applied, "_oom_guard", None)
    model, optimizer = applied.model, applied.optimizer
    try:
        with uncounted() if active_limit() is not None else contextlib.nullcontext():
            applied.remove()
    finally:
        if active_limit() is not None:
            recount(model, optimizer)
        if guard is not None and isinstance(exc[1], torch.OutOfMemoryError):
            guard.recover(exc[1])
