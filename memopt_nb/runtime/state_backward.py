"""Units whose optimizer step runs inside backward (``grads="step"``), the end of each backward, and the checks that
refuse what such a loop may not do (see :mod:`memopt_nb.runtime.state`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from .slots import HostTensor
from .state_errors import STEP_RULES, StepInBackwardError

__all__ = ["StepInBackward"]


class StepInBackward:
    """Stepping units in backward and following backward passes: a part of
    :class:`~memopt_nb.runtime.state.StateManager`."""

    def _stale_now(self) -> int:
        """Gradients consumed by a step in backward and not yet cleared (re-counted: model.zero_grad() clears too)."""
        if self._stale:
            self._stale = sum(1 for ps in self.unit_params for p in ps
                              if isinstance(p.grad, HostTensor) and p.grad._stepped)
        return self._stale

    def _guard_outputs(self, module: nn.Module, args: Any, output: Any) -> None:
        """A second backward through the same graph (``retain_graph=True``) starts at the model's outputs: refuse it
        there, before it accumulates anything (it would otherwise fail later with autograd's in-place error)."""
        if torch.is_grad_enabled():
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._check_backward)

    def _check_backward(self, grad: torch.Tensor) -> None:
        # stepped in an earlier backward, not in this one (and the plan still applied: not a graph backpropagated later)
        if self._active and self._stepped and self._sib_gen != self._gen:
            raise StepInBackwardError("a second backward through the model before opt.step() (retain_graph=True), "
                                      f"after the first one already stepped some units; {STEP_RULES}." + self._settle())

    def _settle(self) -> str:
        """Before a refusal after a backward that stepped some units (grads='step') and not yet the parameters outside
        them: make the model whole again, and say how (a sentence for the error; ``""`` if nothing was stepped).

        With the undo copies (:data:`UNDO_STEPS_IN_BACKWARD`) those units are put back as they were before their step
        and every gradient is cleared, as ``opt.zero_grad()`` after skipping the batch: nothing of that step is
        applied. Without them the step is completed on that backward's gradients (``opt.step()``, then
        ``opt.zero_grad()``): every parameter holds it. Never a model with some units stepped and others not."""
        if not self._stepped:
            return ""
        names = self.unit_names(sorted(self._stepped))
        if all(u in self._undo for u in self._stepped):
            self.undo_steps_in_backward()
            self._zero_grad(True)
            return (f" Units {names} had already been stepped by that backward, the parameters outside them not: they "
                    "were put back as they were before it (parameters and optimizer state) and every gradient was "
                    "cleared, as opt.zero_grad() after skipping a batch, so the model is as before that step and "
                    "nothing of that step is applied")
        self.optimizer.step()
        self._zero_grad(True)
        return (f" Units {names} had already been stepped by that backward, the parameters outside them not; without "
                "undo copies (memopt.runtime.state.UNDO_STEPS_IN_BACKWARD off) the step was completed on that "
                "backward's gradients (opt.step(), then opt.zero_grad()), so the model is as after a complete step")

    def _check_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._refuse_after_undo("forward with gradients enabled")
        if self._stepped and torch.is_grad_enabled():
            raise StepInBackwardError("forward with gradients enabled after a backward that already stepped some "
                                      f"units, before opt.step() (gradient accumulation); {STEP_RULES}."
                                      + self._settle())

    def _queue_end_of_backward(self) -> None:
        if not self._active:
            return
        task = torch._C._current_graph_task_id()
        if self._callback_queued and task != self._queued_task:
            self._recover_failed_backward()  # the backward it was queued in raised: its callback never ran
        if not self._callback_queued:
            self._callback_queued = True
            self._queued_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if not self._active:
            return
        self._gen += 1
        self._deferred.clear()  # freed below with every unit still in backward
        for seen in self._seen:  # a unit not complete in this backward is stepped by opt.step(), not in the next one
            seen.clear()
        for u, sent in enumerate(self._sent_grads):
            if sent:
                self._drop_sent_grads(u)
        for u in range(len(self.unit_params)):
            if self._param_slots[u] and (self._in_bw[u] or self._param_where[u] != "host"):
                self._in_bw[u] = False
                self._free_params(u)
