"""``with memopt.plan(p):`` — apply a plan to a live model (and its optimizer) for a block, then restore it exactly.

A plan decides per unit an activation strategy (keep, recompute, swap, ...) and, from schema 2 on, where the unit's
optimizer state, gradients and parameters live. The activation part is applied here by wrapping the units'
``forward``, each strategy run by its mechanism (:data:`MECHANISMS`); the state part by a
:class:`~memopt_nb.runtime.state.StateManager` over the same units and the optimizer. Both are installed together and
removed together, also when the block raises or is interrupted.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn

from ..core.budget import format_bytes
from ..core.errors import MemoptWarning, PlanError
from ..core.fingerprint import optimizer_differences, optimizer_fingerprint
from ..core.plan import OFFLOADING, RECOMPUTING, Plan, effective_triggers
from ..core.strategies import by_name
from .distributed import check_state_placements, order_guard, unwrap
from .head import ChunkedHead, find_head
from .hooks import uncopied
from .oom import StepGuard, leave_plan
from .outputs import KeptOutputWatch
from .recompute import checkpointed
from .replay_guard import ReplayGuard, cache_tensors, is_cache
from .state import Placement, StateManager, parked_manager
from .step import autocast_name
from .storages import plain_storage_ptrs
from .swap import SwapEngine

__all__ = ["EXACT_BACKENDS", "MECHANISMS", "AppliedPlan", "PlannedForward", "plan"]

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


#: torch.compile backends under which a plan keeps results bit-identical (they run the plan's eager code as is).
EXACT_BACKENDS = ("eager", "aot_eager")


@torch.compiler.disable(recursive=False)
def _compile_callback() -> Any:
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return get_eval_frame_callback()  # dynamo runs this frame as is, between graphs: it sees the real backend


def _check_compile_backend(unit: str) -> None:
    """Refuse to be traced by a torch.compile backend that would make results differ from training without a plan."""
    from torch._dynamo.eval_frame import innermost_backend

    callback = _compile_callback()
    if callback is None or isinstance(callback, bool):
        return  # traced by something other than torch.compile (export, make_fx)
    backend = innermost_backend(callback)
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", type(backend).__name__)
    if name not in EXACT_BACKENDS:
        raise PlanError(
            f"torch.compile with backend {name!r} traced unit {unit!r} of a memopt plan: under it a plan does not "
            "keep results identical (it draws dropout's random numbers its own way and fuses differently around the "
            "units' boundaries, so losses and gradients change). With a plan compile with "
            f"{' or '.join(f'backend={b!r}' for b in EXACT_BACKENDS)} (bit-identical), or train the compiled model "
            "without a plan")


def _unplanned_forward(module: nn.Module, previous: Any = None) -> Any:
    """The ``forward`` a module has without a plan: what a copy or a pickle of a planned module gets."""
    if previous is not None:
        return previous
    return type(module).forward.__get__(module, type(module))


def _value_key(v: Any, depth: int = 0) -> Any:
    if isinstance(v, torch.Tensor):
        return (v.shape, v.stride(), v.dtype, v.device, v.layout, v.requires_grad)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (tuple, list)) and depth < 2:
        return (type(v), tuple(_value_key(x, depth + 1) for x in v))
    if is_cache(v):  # a new one each step (Hugging Face's DynamicCache): by what it holds so far
        return (type(v), tuple(_value_key(t) for t in cache_tensors(v)))
    return (type(v), id(v))  # any other object: this very one (a new object each call never matches)


def _call_key(modules: list[nn.Module], args: tuple, kwargs: dict) -> tuple:
    """What decides which tensors a unit's forward saves for backward, as far as a call shows it: the arguments'
    shapes, strides, dtypes, devices and ``requires_grad`` (other arguments by value or identity; a cache by the
    tensors it holds), the modules' training modes and which parameters need grad, and whether autocast is on (grad
    mode is on: the caller checks)."""
    return (tuple(_value_key(a) for a in args), tuple((k, _value_key(v)) for k, v in kwargs.items()),
            tuple(m.training for m in modules),
            tuple(p.requires_grad for m in modules for p in m._parameters.values() if p is not None),
            torch._C._is_any_autocast_enabled())


#: whether a selective unit whose save-set keeps everything its backward needs runs as a keep unit after its first
#: forward (:meth:`PlannedForward._checkpointed`); off, every call goes through the checkpoint (tests compare)
COMPLETE_AS_KEEP = True


class _UnitPtrs:
    """The storages a unit's saved tensors are never moved from: the model's parameters and buffers when the plan was
    applied, and the parameters the unit's modules hold when its forward runs (a sharded module's all-gathered ones,
    read from each module's ``_parameters`` as it is then), listed on the first question only."""

    __slots__ = ("model", "modules", "own")

    def __init__(self, model: set[int], modules: list[nn.Module]) -> None:
        self.model, self.modules, self.own = model, modules, None

    def __contains__(self, ptr: int) -> bool:
        if ptr in self.model:
            return True
        if self.own is None:
            self.own = plain_storage_ptrs(p for m in self.modules for p in m._parameters.values())  # skips None
        return ptr in self.own


class PlannedForward:
    """A unit's ``forward`` while a plan is applied (an instance attribute, which ``nn.Module.__call__`` finds first).

    ``copy.deepcopy`` and pickling (``torch.save(model)``) of the module give the copy its own plain forward, so a
    copy made inside the block is an independent model without the plan.
    """

    __slots__ = ("applied", "index", "module", "strategy", "previous", "guard", "model_ptrs", "submodules", "inner",
                 "save_ops", "complete", "mechanism")

    def __init__(self, applied: AppliedPlan, index: int, module: nn.Module, strategy: str, previous: Any,
                 guard: ReplayGuard | None, model_ptrs: set[int]) -> None:
        self.applied, self.index, self.module, self.strategy = applied, index, module, strategy
        self.previous, self.guard, self.model_ptrs = previous, guard, model_ptrs
        self.submodules = guard.modules if guard is not None else list(module.modules())
        self.inner = _unplanned_forward(module, previous)
        self.save_ops = applied.plan.decisions[index].save_ops or None  # selective: the op outputs it keeps
        #: selective: the call (see :func:`_call_key`) after which the save-set was found to keep everything backward
        #: needs, so that calls like it run as a keep unit does; ``None`` until then
        self.complete: tuple | None = None
        self.mechanism = MECHANISMS[strategy]

    @property
    def __memopt__(self) -> tuple[AppliedPlan, int]:
        return self.applied, self.index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            _check_compile_backend(self.applied.plan.units[self.index])
            if self.strategy in OFFLOADING:
                raise PlanError(
                    f"torch.compile traced unit {self.applied.plan.units[self.index]!r}, which the plan gives "
                    f"{self.strategy!r}: the swap engine cannot move the tensors a compiled graph saves to the host "
                    "and back (its check that nothing changed them in place fails in backward on every zoo model). "
                    "With torch.compile use a plan of keep / recompute / selective units (state placements work), "
                    "e.g. memopt.search(..., strategies=('keep', 'recompute')), or train this plan without compiling")
        inner = self.inner
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        engine = self.applied.engine
        if engine is None or engine.closed:
            if self.guard is None:  # a keep unit of a plan removed while another thread still runs
                return inner(*args, **kwargs)
            return self._checkpointed(args, kwargs)
        p = engine.begin_unit(self.index)
        out = self.mechanism.run(self, engine, p, args, kwargs)
        engine.end_unit(p, self.index, out)
        return out

    def _checkpointed(self, args: tuple, kwargs: dict) -> Any:
        """A recompute or selective unit's forward. A selective unit whose save-set turned out to keep every tensor
        its backward needs (its recomputation was skipped: :class:`~memopt_nb.runtime.selective.DirectSaves`) runs
        later calls made the same way (same argument shapes, strides, dtypes and ``requires_grad``, same training mode,
        autocast and parameters needing grad: :func:`_call_key`) as a keep unit: without the checkpoint and the
        caching modes. That forward runs the same ops and backward gets the same tensors, so results are
        bit-identical; it holds no more memory (only what autograd saves, not the inputs and kept outputs the
        checkpoint holds until backward), and on a device where each op is cheap it saves the per-op cost of the
        caching mode (``benchmarks/runtime_overhead.py``, comparison (d)). Any other call runs the checkpointed
        forward again and learns anew."""
        if self.save_ops is None or not COMPLETE_AS_KEEP:
            return checkpointed(self.guard, self.inner, args, kwargs, save_ops=self.save_ops)
        key = _call_key(self.guard.modules, args, kwargs)
        if key == self.complete:
            return self.inner(*args, **kwargs)

        def learned(direct: bool) -> None:
            self.complete = key if direct else None

        return checkpointed(self.guard, self.inner, args, kwargs, save_ops=self.save_ops, on_direct=learned)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _unplanned_forward, (self.module, self.previous)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        module = memo.get(id(self.module))
        if module is None:  # copying the forward alone, not its module: the copy is the forward without the plan
            return _unplanned_forward(self.module, self.previous)
        return _unplanned_forward(module, copy.deepcopy(self.previous, memo))

    def __repr__(self) -> str:
        return f"<memopt planned forward of unit {self.index} ({self.strategy})>"


class _Saved:
    """keep, swap: the unit's forward as it is, under the swap engine's hooks (which move the saved tensors of a unit
    whose strategy offloads and leave a kept unit's where they are)."""

    @staticmethod
    def run(f: PlannedForward, engine: SwapEngine, p: Any, args: tuple, kwargs: dict) -> Any:
        with engine.hooks(p, f.index, _UnitPtrs(f.model_ptrs, f.submodules)):
            return f.inner(*args, **kwargs)


class _Checkpointed:
    """recompute, selective: the unit's forward under checkpointing (its inputs kept on the device)."""

    @staticmethod
    def run(f: PlannedForward, engine: SwapEngine, p: Any, args: tuple, kwargs: dict) -> Any:
        return f._checkpointed(args, kwargs)


class _CheckpointedOffloaded:
    """recompute_offload: the unit's forward under checkpointing, the inputs its checkpoint keeps sent to the host
    through the swap engine and fetched back when the recomputation starts."""

    @staticmethod
    def run(f: PlannedForward, engine: SwapEngine, p: Any, args: tuple, kwargs: dict) -> Any:
        index, ptrs = f.index, _UnitPtrs(f.model_ptrs, f.submodules)
        return checkpointed(f.guard, f.inner, args, kwargs, hold=lambda t: engine.pack(p, index, ptrs, t),
                            fetch=engine.unpack)


#: The mechanism each strategy of :data:`~memopt_nb.core.strategies.REGISTRY` runs a unit's forward with while the plan
#: has a swap engine (without one a unit runs checkpointed if its strategy recomputes, else as it is).
MECHANISMS: dict[str, type] = {"keep": _Saved, "swap": _Saved, "recompute": _Checkpointed,
                               "selective": _Checkpointed, "recompute_offload": _CheckpointedOffloaded}


def _check_recomputable(plan: Plan, model: nn.Module) -> None:
    """Refuse a plan that recomputes a unit its profile marks not recomputable, or a model that checkpoints itself."""
    for i, d in enumerate(plan.decisions):
        reason = plan.fingerprint[i].get("not_recomputable") if plan.fingerprint else None
        if d.strategy in RECOMPUTING and reason:
            raise PlanError(f"the plan recomputes unit {d.unit!r}, which its profile marks not recomputable: {reason}. "
                            "Keep or swap this unit (the planners never recompute it)")
    # Hugging Face layers set `gradient_checkpointing`, timm models `grad_checkpointing`
    own = [n for n, m in model.named_modules()
           if getattr(m, "gradient_checkpointing", False) is True or getattr(m, "grad_checkpointing", False) is True]
    # transformers 5 names it is_activation_checkpointing (the old name still works but warns)
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    if own or flag is True:
        shown = ", ".join(repr(n) for n in own[:3]) + (" …" if len(own) > 3 else "")
        raise PlanError(f"the model checkpoints its own blocks ({shown or 'gradient checkpointing is on'}); a plan "
                        "decides recompute itself. Turn that off first: model.gradient_checkpointing_disable() "
                        "(Hugging Face), model.set_grad_checkpointing(False) (timm)")


def _resolve_optimizer(plan: Plan, optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer a plan that moves state manages: the one given, else the one its profile saw, else an error."""
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise PlanError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        return optimizer
    if not plan.moves_state:
        return None
    ref = plan._optimizer_ref
    optimizer = ref() if ref is not None else None
    if optimizer is None:
        sc = plan.state_counts()
        what = ", ".join(f"{k} {v}" for k, v in sc.items() if v)
        raise PlanError(
            f"this plan moves training state ({what} units) but is not tied to a live optimizer (it was loaded "
            "from JSON, the profile was made without optimizer=, or that optimizer is gone); pass the optimizer you "
            "train with: memopt.plan(p, model, optimizer=opt)")
    return optimizer


class AppliedPlan:
    """A plan applied (or ready to be applied) to one model and, when the plan moves state, its optimizer.

    Use as a context manager — ``with memopt.plan(p, model):`` — or call :meth:`apply` / :meth:`remove`. While applied,
    the units' ``forward`` is wrapped: ``recompute`` units run under non-reentrant checkpointing, and when the plan
    swaps anything every unit's saved tensors go through the swap engine. A plan that places optimizer state,
    gradients or parameters anywhere but on the device also installs a
    :class:`~memopt_nb.runtime.state.StateManager` (:attr:`state`) over the same units and the optimizer. Nothing else
    about the model or optimizer changes, and :meth:`remove` puts every ``forward``, hook, optimizer method, state
    tensor, gradient and parameter back as it was, also when the block raises or is interrupted. Under
    ``torch.no_grad()`` the activation wrappers call straight through.
    """

    def __init__(self, plan: Plan, model: nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
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
        self._wrapper = model  # DDP, if it is one: the state placements it allows differ
        model = unwrap(model)  # a DDP wrapper's names gain "module."; the plan names the wrapped module's units
        self._guard: Any = None
        self.plan = plan
        self.model = model
        self.optimizer = _resolve_optimizer(plan, optimizer)
        self.engine: SwapEngine | None = None
        #: the :class:`~memopt_nb.runtime.state.StateManager` placing state while applied (``None`` if nothing moves)
        self.state: StateManager | None = None
        self._installed: list[tuple[nn.Module, bool, Any]] = []
        self._stats: dict[str, float] = {}
        self._autocast_hook: Any = None  # checks the first training forward's autocast against the profile's
        self._shape_hooks: list[Any] = []  # warn once when a unit's inputs are larger than profiled
        self._oom_guard: StepGuard | None = None
        self._head: ChunkedHead | None = None  # the LM head computed in chunks (plan.head)
        self._kept: KeptOutputWatch | None = None  # warns when the loop keeps outputs the profile let go of

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> AppliedPlan:
        self.apply()
        return self

    def __exit__(self, *exc: Any) -> None:
        leave_plan(self, exc)  # remove(); after an out-of-memory error also the step's gradients and RNG put back

    @property
    def active(self) -> bool:
        return bool(self._installed) or _APPLIED.get(self.model) is self

    def _state_manager(self, modules: list[nn.Module]) -> StateManager | None:
        """The StateManager for the plan's placements (checked, not installed), or ``None`` if it moves no state."""
        plan, opt = self.plan, self.optimizer
        if not plan.moves_state:
            return None
        check_state_placements(self._wrapper, self.model, plan)
        if plan.optimizer_fingerprint is not None:
            diff = optimizer_differences(plan.optimizer_fingerprint, optimizer_fingerprint(opt))
            if diff:
                raise PlanError("this plan was made for another optimizer: " + "; ".join(diff) + ". Pass the "
                                "optimizer the plan was made for, or profile with this one and plan again")
        mine = {id(p) for p in self.model.parameters()}
        if not any(id(p) in mine for g in opt.param_groups for p in g["params"]):
            raise PlanError("the optimizer holds none of the model's parameters; pass the optimizer that trains this "
                            "model: memopt.plan(p, model, optimizer=opt)")
        placements = [Placement(*d.placement) for d in plan.decisions]
        parked = parked_manager(opt)  # the state an earlier block left on the host: taken over, or brought back
        if parked is not None:
            if parked.matches(self.model, modules, placements, plan.step_in_backward):
                return parked
            parked.bring_back()
        return StateManager(self.model, opt, modules, placements, step_in_backward=plan.step_in_backward)

    def apply(self) -> AppliedPlan:
        """Install the plan on the model (and optimizer). Raises :class:`PlanError`, with nothing changed, if it does
        not fit, if another plan is applied, or if the optimizer is not the one the plan was made for."""
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
        _check_recomputable(plan, model)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if a == "" or b == "" or b.startswith(a + ".") or a.startswith(b + "."):
                    raise PlanError(f"plan units {a!r} and {b!r} are nested; units must not contain each other")
        state = self._state_manager(modules)  # every check before anything changes
        head = ChunkedHead(find_head(model, plan.head["module"])[1], plan.head["chunks"]) if plan.head else None
        self._stats = {}
        strategies = plan.strategies
        has_swap = any(s in OFFLOADING for s in strategies)
        if has_swap:
            self.engine = SwapEngine(strategies, plan.offload_windows,
                                     effective_triggers(strategies, plan.prefetch_distances))
        # parameters a unit offloads leave their storage (its address may then hold an activation): a unit's own
        # parameters are read at each call instead
        moved = {id(p) for m, d in zip(modules, plan.decisions, strict=True) if d.params == "offload"
                 for p in m.parameters()}
        model_ptrs = plain_storage_ptrs([t for t in [*model.parameters(), *model.buffers()] if id(t) not in moved]) \
            if has_swap else set()
        _APPLIED[model] = self
        try:
            self._guard = order_guard(model, modules, names)  # sharding after this point raises at forward
            for index, (module, strategy) in enumerate(zip(modules, strategies, strict=True)):
                if not (has_swap or by_name(strategy).recomputes or by_name(strategy).offloads):
                    continue  # a kept unit runs as it is unless a swap engine must see its saved tensors
                self._wrap(index, module, strategy, model_ptrs)
            if state is not None:
                self.state = state
                if state.parked:
                    state.resume()
                else:
                    state.apply()
            if head is not None:
                self._head = head.install()
            if not plan.meta.get("keep_outputs"):
                self._kept = KeptOutputWatch(model)
            self._oom_guard = StepGuard(self)  # what a step that runs out of memory must give back
            if "autocast" in plan.meta:  # the profile said how its forward ran (plans made before it did: no check)
                self._autocast_hook = model.register_forward_pre_hook(uncopied(self._check_autocast))
            shapes = plan.meta.get("unit_input_shapes")
            if isinstance(shapes, list) and len(shapes) == len(modules):
                self._shape_hooks = [
                    m.register_forward_pre_hook(uncopied(_ShapeCheck(self, i, _elements(s))), with_kwargs=True)
                    for i, (m, s) in enumerate(zip(modules, shapes, strict=True)) if s]
        except BaseException:
            self.remove()
            raise
        return self

    def _wrap(self, index: int, module: nn.Module, strategy: str, model_ptrs: set[int]) -> None:
        had_own = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        guard = ReplayGuard(module, self.plan.units[index]) if strategy in RECOMPUTING else None  # once, not per call
        module.forward = PlannedForward(self, index, module, strategy, previous, guard, model_ptrs)
        self._installed.append((module, had_own, previous))

    def remove(self, *, everything: bool = False) -> None:
        """Undo :meth:`apply`: every wrapped ``forward`` restored exactly; optimizer state, gradients and parameters
        back on the device in their own tensors and the optimizer's methods restored if they fit the device now (or
        with ``everything=True``), else left where the plan put them, still moved as under the plan
        (:meth:`~memopt_nb.runtime.state.StateManager.leave`; :func:`~memopt_nb.runtime.state.bring_back` later).
        Safe to call twice."""
        try:
            if self.state is not None:
                try:
                    if everything:
                        self.state.remove()
                    else:
                        self.state.leave()
                finally:  # after: removing may still move state (a failed backward's steps put back)
                    self._stats.update(self.state.stats)
        finally:
            self.state = None
            if self._head is not None:
                self._head.remove()
                self._head = None
            if self._kept is not None:
                self._kept.remove()
                self._kept = None
            for module, had_own, previous in reversed(self._installed):
                if had_own:
                    module.forward = previous
                else:
                    module.__dict__.pop("forward", None)
            self._installed.clear()
            if self._oom_guard is not None:  # no cycle through it keeps the model (the block's exit kept its own)
                self._oom_guard.close()
                self._oom_guard = None
            if self._autocast_hook is not None:
                self._autocast_hook.remove()
                self._autocast_hook = None
            self._drop_shape_hooks()
            if self._guard is not None:
                self._guard.remove()
                self._guard = None
            if self.engine is not None:
                self._stats.update({**self.engine.stats, **self.engine.pool_stats()})
                self.engine.close()
                self.engine = None
            if _APPLIED.get(self.model) is self:
                del _APPLIED[self.model]

    def _drop_shape_hooks(self) -> None:
        for hook in self._shape_hooks:
            hook.remove()
        self._shape_hooks = []

    def _check_autocast(self, module: nn.Module, args: Any) -> None:
        """Before the first forward with grad enabled: warn when it runs under another autocast than the profile's
        (``profile(..., autocast=)``): the plan still trains the same, but its peak was predicted for the other
        precision."""
        if not torch.is_grad_enabled():
            return  # an evaluation pass: wait for a training one
        self._autocast_hook.remove()
        self._autocast_hook = None
        param = next(module.parameters(), None)
        dev = param.device.type if param is not None else "cpu"
        have = autocast_name(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
        want = self.plan.meta["autocast"]
        if have != want:
            def said(dtype: str | None) -> str:
                return f"under autocast {dtype}" if dtype else "without autocast"

            warnings.warn(
                f"this plan was made from a profile {said(want)}, but the model's forward runs {said(have)}: it "
                f"trains the same, but its predicted peak and "
                f"budget are for the other precision. Profile as you train — memopt.profile(..., autocast="
                f"{'torch.' + have if have else 'None'}) with the forward and the loss under autocast and backward "
                f"outside — and plan again", UserWarning, stacklevel=3)

    @property
    def stats(self) -> dict[str, float]:
        """What the plan did so far: the swap engine's bytes offloaded/prefetched, on-demand fetches, seconds waited
        and pool use; the state placements' bytes moved each way (``state_d2h_bytes``, ``grad_d2h_bytes``,
        ``param_h2d_bytes`` …) and ``steps_in_backward``."""
        out = dict(self._stats)
        if self.engine is not None:
            out.update({**self.engine.stats, **self.engine.pool_stats()})
        if self.state is not None:
            out.update(self.state.stats)
        return out

    def __repr__(self) -> str:
        state = "applied" if self._installed or self.state is not None else "not applied"
        return f"<memopt plan {self.plan.method!r} on {type(self.model).__name__}, {state}>"


def _elements(shapes: Any) -> int:
    """Elements in tensors of the given shapes."""
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total


class _ShapeCheck:
    """A unit's forward pre-hook: the first training forward whose tensor inputs hold more elements than the profiled
    ones (a bigger batch or a longer sequence) warns, once per applied plan, that the plan's predicted peak was for
    the profiled shapes. Smaller inputs (an evaluation batch, the last short batch) pass silently."""

    def __init__(self, applied: AppliedPlan, index: int, profiled: int) -> None:
        self.applied = weakref.ref(applied)
        self.index = index
        self.profiled = profiled

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not torch.is_grad_enabled():
            return None
        leaves = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if sum(t.numel() for t in leaves) <= self.profiled:
            return None
        applied = self.applied()
        if applied is None:
            return None
        plan = applied.plan
        profiled = plan.meta["unit_input_shapes"][self.index]
        got = [list(t.shape) for t in leaves]
        budget = f" (budget {format_bytes(plan.budget_bytes)})" if plan.budget_bytes else ""
        peak = (f"its predicted peak {format_bytes(plan.predicted_peak_bytes)}{budget}"
                if plan.predicted_peak_bytes else "its predicted peak")
        applied._drop_shape_hooks()
        warnings.warn(
            f"memopt: unit {plan.units[self.index]!r} got inputs of shape {_shapes(got)}, larger than the "
            f"{_shapes(profiled)} this plan was made for: {peak} holds for the profiled shapes only, and this "
            "step may use more memory. Profile at this size and plan again, or ask memopt.max_batch how big a batch "
            "fits", MemoptWarning, stacklevel=2)
        return None


def _shapes(shapes: Any) -> str:
    return ", ".join("(" + ", ".join(str(d) for d in s) + ")" for s in shapes) or "()"


def plan(p: Plan, model: nn.Module | None = None, *, optimizer: torch.optim.Optimizer | None = None) -> AppliedPlan:
    """Apply plan ``p`` to ``model`` (default: the model it was profiled from) inside a ``with`` block.

    Example::

        with memopt.plan(p):
            for x, y in loader:
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step(); opt.zero_grad()

    Loss, gradients, parameters, buffers and optimizer state are the same as without the plan; only memory and time
    change. On exit the model's modules (and the optimizer) are exactly as before, also after an exception or an
    interrupt — except that training state the plan keeps on the host comes back only if all of it fits the device
    then; else it stays placed as under the plan, training on the same way, until ``memopt.bring_back(opt)`` or the
    same plan's next block (:mod:`memopt_nb.runtime.state`). State dicts hold offloaded state as host copies.

    A plan that moves optimizer state, gradients or parameters (schema 2) manages the optimizer too: by default the one
    its profile saw (``memopt.profile(..., optimizer=opt)``); for a loaded plan, or another optimizer object, pass it:
    ``memopt.plan(p, model, optimizer=opt)``. ``opt.step()``, ``opt.zero_grad()``, ``opt.state_dict()`` and
    ``opt.load_state_dict()`` keep working and give the same values; the step runs unit by unit on the device with
    the optimizer's own code. An optimizer of another class, with other parameter groups or hyper-parameters that
    change its state (e.g. SGD momentum 0 vs not) raises :class:`PlanError` naming the difference; learning rates may
    differ (a scheduler changes them, and one made after profiling is accepted). Another optimizer over the same
    parameters stepped inside the block (one made after profiling; the one ``transformers.Trainer`` builds unless given
    ``optimizers=(opt, None)``) is refused at its first step, before it changes anything.

    A plan made with ``step_in_backward=True`` that steps units in backward (``grads="step"``) changes what the loop may
    do between ``backward()`` and ``opt.step()``: exactly one backward per step (no gradient accumulation), no
    ``clip_grad_norm_`` or other reading of those gradients, and ``opt.step()`` then ``opt.zero_grad()`` before the
    next forward. Breaking a rule raises :class:`~memopt_nb.runtime.state.StepInBackwardError` (a ``PlanError``)
    before the offending call changes anything. Use a plan with ``grads="offload"`` for such loops.

    While a unit's parameters are offloaded they have no device data outside its forward, backward and step; an
    operator on one between steps (an EMA, a norm, ``copy.deepcopy``) brings its unit's parameters back for itself,
    and one that would return a view raises :class:`~memopt_nb.runtime.state.StateError`; for a block of code that
    needs the parameters themselves use ``with applied.state.gathered():``. Under DDP and FSDP2 see
    :mod:`memopt_nb.runtime.distributed` for what may move.
    """
    return AppliedPlan(p, model, optimizer)
