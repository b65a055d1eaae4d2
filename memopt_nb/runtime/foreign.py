"""Refuse an optimizer a plan does not manage when it steps parameters whose state the plan moves.

A :class:`~memopt_nb.runtime.state.StateManager` manages one optimizer: the one the profile saw, or the one passed to
``memopt.plan(p, model, optimizer=opt)``. Another optimizer over the same parameters — made after profiling, or built
inside ``transformers.Trainer.train()`` (``adamw_torch_fused`` by default) — would step parameters whose data lives on
the host and gradients that are placeholders: the single-tensor kernel happens to compute the same values one operator
at a time, a fused kernel does not (measured: different from the second step on). While a manager is applied, a global
optimizer step pre-hook refuses such a step, before it changes anything, saying what to do instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["unwatch", "watch"]

_ACTIVE: list[Any] = []  # the applied StateManagers, in the order they were applied
_HANDLE: list[Any] = []  # the global pre-hook's handle while any is applied


def watch(manager: Any) -> None:
    """Refuse other optimizers' steps over ``manager``'s managed parameters until :func:`unwatch`."""
    if any(m is manager for m in _ACTIVE):
        return
    _ACTIVE.append(manager)
    if not _HANDLE:
        _HANDLE.append(register_optimizer_step_pre_hook(_pre_step))


def unwatch(manager: Any) -> None:
    """Stop watching for ``manager`` (safe to call twice)."""
    _ACTIVE[:] = [m for m in _ACTIVE if m is not manager]
    if not _ACTIVE and _HANDLE:
        _HANDLE.pop().remove()


def _describe(opt: torch.optim.Optimizer) -> str:
    flags = [k for k in ("fused", "foreach") if opt.defaults.get(k)]
    return type(opt).__name__ + (f"({', '.join(f'{k}=True' for k in flags)})" if flags else "")


def _pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if getattr(opt, "_memopt_state", None) is not None:
        return  # a managed optimizer (its manager steps it unit by unit)
    for manager in list(_ACTIVE):
        ids = manager.managed_param_ids()
        hit = [p for g in opt.param_groups for p in g["params"] if id(p) in ids]
        if not hit:
            continue
        units = sorted({manager.unit_of[id(p)] for p in hit})
        names = manager.unit_names(units)
        undone = manager.undo_steps_in_backward()
        raise manager.error(
            f"an optimizer the plan does not manage, {_describe(opt)}, is stepping {len(hit)} parameter(s) of units "
            f"whose optimizer state, gradients or parameters the plan moves ({names}). The plan manages another "
            f"optimizer object ({_describe(manager.optimizer)}: the one its profile saw, or the one given to "
            "memopt.plan), and this one would read those parameters and gradients through the plan's placeholders "
            "(a fused or foreach kernel then computes something else than without the plan)"
            + (f"; the {undone} unit(s) already stepped in this backward were put back as they were" if undone else "")
            + ". Nothing was stepped. Pass the optimizer you train with: memopt.plan(p, model, optimizer=opt) (profile "
            "with it and plan again if its class or settings differ), or step the one the plan manages; with "
            "transformers.Trainer build the optimizer yourself and give it: Trainer(..., optimizers=(opt, None))")
