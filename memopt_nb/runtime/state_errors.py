"""What the loop may not do with state a plan manages, and the errors that say so."""

from __future__ import annotations

from ..core.errors import PlanError

__all__ = ["STEP_RULES", "StateError", "StepInBackwardError"]


class StateError(PlanError):
    """Optimizer state, gradients or parameters cannot be placed as asked, or were used as their placement forbids."""


class StepInBackwardError(StateError):
    """The loop did something that step-in-backward cannot reproduce (gradient accumulation, clipping, zero_grad
    before step). Raised before that call changes anything; when a backward had already stepped some units and not
    the parameters outside them, those units are first put back as they were before it (or, without undo copies, the
    step is completed), so the model is never half-stepped, and the message says which."""


#: Before a unit steps in backward, keep host copies of its parameters and optimizer state, so that a backward that
#: fails after that step (an exception, an interrupt, an optimizer refused mid-loop) puts the unit back and the usual
#: "skip the bad batch" ``opt.zero_grad()`` works. It costs a copy of those bytes per step in backward (host memory,
#: not device memory; on the CPU about 10-20 % of a step-in-backward step, not priced by the simulator). ``False``
#: skips it: a failed backward then leaves the units it stepped updated, and ``opt.zero_grad()`` raises.


#: What a loop under a plan with a step in backward must do (quoted by every refusal).
STEP_RULES = ("with grads='step' the optimizer steps those units inside backward, so the loop must run exactly one "
               "backward per opt.step(), call opt.step() (then opt.zero_grad()) before the next forward, and not read, "
               "clip, unscale (torch.amp.GradScaler) or accumulate those gradients; use grads='offload' (or "
               "'resident') for gradient accumulation, clip_grad_norm_ or a GradScaler")
