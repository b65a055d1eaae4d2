"""``with memopt.plan(p):`` — apply a plan to a live model for the duration of a block, then restore it exactly."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn

from ..distributed import order_guard, unwrap
from ..errors import PlanError
from ..plan import Plan, effective_triggers
from .recompute import checkpointed_call, running_stat_modules
from .swap import SwapEngine

_APPLIED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DEVICE_WARNED: dict[int, weakref.ref] = {}  # plans already warned about (by id, while alive): warn once per plan


def _other_device(plan: Plan, model: nn.Module) -> str | None:
    """The model's device, described, if it is not the device the plan was made for; else ``None``."""
    spec = plan.device or {}
    kind, name = spec.get("kind"), spec.get("name")
    if kind is None:
        return None
    dev = next((t.device for t in model.parameters()), torch.device("cpu"))
    if dev.type == "cpu":
        return None if kind == "cpu" else "the CPU"
    if dev.type != "cuda":
        return None
    gpu = torch.cuda.get_device_properties(dev)
    if kind == "cuda" and gpu.name == name:
        return None
    if kind == "preset" and abs(gpu.total_memory - spec.get("capacity_bytes", 0)) <= 0.1 * gpu.total_memory:
        return None  # the preset describes this GPU's size; its times were simulated from a datasheet anyway
    return f"{gpu.name} ({dev})"


def _warn_other_device(plan: Plan, model: nn.Module) -> None:
    ref = _DEVICE_WARNED.get(id(plan))
    if ref is not None and ref() is plan:
        return
    other = _other_device(plan, model)
    if other is None:
        return
    key = id(plan)
    _DEVICE_WARNED[key] = weakref.ref(plan, lambda _: _DEVICE_WARNED.pop(key, None))
    warnings.warn(
        f"this plan was made for {plan.device['name']} but the model is on {other}: it still trains the same, but its "
        f"budget and predicted peak and step time are for {plan.device['name']}; plan again for this device "
        "(memopt.search(profile, budget) without device=) to fit this one",
        UserWarning, stacklevel=4)


def _storage_ptrs(tensors: Any) -> set[int]:
    out = set()
    for t in tensors:
        if type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided and not t.is_meta:
            out.add(t.untyped_storage().data_ptr())
    return out


class AppliedPlan:
    """A plan applied (or ready to be applied) to one model.

    Use as a context manager — ``with memopt.plan(p, model):`` — or call :meth:`apply` / :meth:`remove`. While applied,
    the units' ``forward`` is wrapped: ``recompute`` units run under non-reentrant checkpointing, and when the plan
    swaps anything every unit's saved tensors go through the swap engine. Nothing else about the model changes, and
    :meth:`remove` puts every ``forward`` back as it was, also when the block raises or is interrupted. Under
    ``torch.no_grad()`` the wrappers call straight through.
    """

    def __init__(self, plan: Plan, model: nn.Module | None = None) -> None:
        if not isinstance(plan, Plan):
            raise PlanError(f"memopt.plan() takes a Plan, got {type(plan).__name__}; load one with Plan.load(path)")
        if model is None:
            ref = plan._model_ref
            model = ref() if ref is not None else None
            if model is None:
                raise PlanError(
                    "this plan is not tied to a live model (it was loaded from JSON, or the profiled model is gone); "
                    "pass the model: memopt.plan(p, model)"
                )
        if not isinstance(model, nn.Module):
            raise PlanError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        model = unwrap(model)  # a DDP wrapper's names gain "module."; the plan names the wrapped module's units
        self._guard: Any = None
        self.plan = plan
        self.model = model
        self.engine: SwapEngine | None = None
        self._installed: list[tuple[nn.Module, bool, Any]] = []
        self._stats: dict[str, float] = {}

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> AppliedPlan:
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        return bool(self._installed) or _APPLIED.get(self.model) is self

    def apply(self) -> AppliedPlan:
        """Install the plan on the model. Raises :class:`PlanError` if it does not fit or another plan is applied."""
        model, plan = self.model, self.plan
        current = _APPLIED.get(model)
        if current is not None:
            raise PlanError(
                "a plan is already applied to this model; nested or concurrent plans are not supported — leave the "
                "other `with memopt.plan(...)` block (or call .remove()) first"
            )
        plan.validate(model)
        _warn_other_device(plan, model)
        modules = [model.get_submodule(name) for name in plan.units]
        names = plan.units
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if a == "" or b == "" or b.startswith(a + ".") or a.startswith(b + "."):
                    raise PlanError(f"plan units {a!r} and {b!r} are nested; units must not contain each other")
        strategies = plan.strategies
        has_swap = "swap" in strategies
        if has_swap:
            self.engine = SwapEngine(strategies, plan.offload_windows,
                                     effective_triggers(strategies, plan.prefetch_distances))
        model_ptrs = _storage_ptrs(list(model.parameters()) + list(model.buffers())) if has_swap else set()
        _APPLIED[model] = self
        try:
            self._guard = order_guard(model, modules, names)  # sharding after this point raises at forward
            for index, (module, strategy) in enumerate(zip(modules, strategies, strict=True)):
                if strategy == "keep" and not has_swap:
                    continue
                self._wrap(index, module, strategy, model_ptrs)
        except BaseException:
            self.remove()
            raise
        return self

    def _wrap(self, index: int, module: nn.Module, strategy: str, model_ptrs: set[int]) -> None:
        had_own = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        inner = previous if had_own else type(module).forward.__get__(module, type(module))
        engine = self.engine
        stats = running_stat_modules(module)  # once, not per call

        if engine is None:  # recompute only

            def forward(*args: Any, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return inner(*args, **kwargs)
                return checkpointed_call(stats, inner, *args, **kwargs)

        else:

            def forward(*args: Any, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return inner(*args, **kwargs)
                p = engine.begin_unit(index)
                if strategy == "recompute":
                    out = checkpointed_call(stats, inner, *args, **kwargs)
                else:
                    ptrs = model_ptrs | _storage_ptrs(module.parameters())
                    with engine.hooks(p, index, ptrs):
                        out = inner(*args, **kwargs)
                engine.end_unit(p, index, out)
                return out

        forward.__memopt__ = (self, index)  # type: ignore[attr-defined]
        module.forward = forward  # instance attribute: nn.Module.__call__ finds it first
        self._installed.append((module, had_own, previous))

    def remove(self) -> None:
        """Undo :meth:`apply`: every wrapped ``forward`` is restored exactly. Safe to call twice."""
        for module, had_own, previous in reversed(self._installed):
            if had_own:
                module.forward = previous
            else:
                module.__dict__.pop("forward", None)
        self._installed.clear()
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self.engine is not None:
            self._stats = {**self.engine.stats, **self.engine.pool_stats()}
            self.engine.close()
            self.engine = None
        if _APPLIED.get(self.model) is self:
            del _APPLIED[self.model]

    @property
    def stats(self) -> dict[str, float]:
        """What the swap engine did so far: bytes offloaded/prefetched, on-demand fetches, seconds waited, pool use."""
        if self.engine is not None:
            return {**self.engine.stats, **self.engine.pool_stats()}
        return dict(self._stats)

    def __repr__(self) -> str:
        state = "applied" if self._installed else "not applied"
        return f"<memopt plan {self.plan.method!r} on {type(self.model).__name__}, {state}>"


def plan(p: Plan, model: nn.Module | None = None) -> AppliedPlan:
    """Apply plan ``p`` to ``model`` (default: the model it was profiled from) inside a ``with`` block.

    Example::

        with memopt.plan(p):
            for x, y in loader:
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step(); opt.zero_grad()

    Loss and gradients are the same as without the plan; only memory and time change. On exit the model's modules are
    exactly as before.
    """
    return AppliedPlan(p, model)
