"""Whole-step runtime: where each unit's optimizer state, gradients and parameters live during training.

This is the runtime half of plans that move more than activations. A *unit* is a set of parameters (a module, or a
list of parameters); per unit a :class:`Placement` says

* ``optimizer``: ``"resident"``, ``"offload"`` or ``"stream"`` — between steps the unit's optimizer-state tensors live
  on the host; ``opt.step()`` brings them back unit by unit, runs the user's own optimizer on the device over that
  unit's parameters only, and sends them back. ``"stream"`` does the same one parameter at a time (the next
  parameter's state comes in while one steps), so the step holds two parameters' state of the unit, not all of it.
* ``grads``: ``"resident"``, ``"offload"`` (copied to the host as soon as backward has accumulated them, freed on the
  device, brought back for the step) or ``"step"`` (the unit's optimizer step runs inside backward as soon as its
  gradients are complete, then they are dropped; opt-in with ``step_in_backward=True``).
* ``params``: ``"resident"`` or ``"offload"`` — the parameter data lives on the host and is fetched before the unit's
  forward and again when backward reaches the unit, then freed.

:class:`StateManager` applies placements to a model and its ``torch.optim`` optimizer for the duration of a ``with``
block; the training loop is unchanged::

    with StateManager(model, opt, model.blocks, Placement(optimizer="offload", grads="offload")):
        for x, y in loader:
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad()

How values stay identical to plain training:

* A torch optimizer's update is element-wise per parameter, so stepping a subset of parameters (``param_groups``
  temporarily restricted to the unit's parameters, same state tensors, same hyper-parameters) computes the same bits
  for the single-tensor and foreach paths. Optimizers that couple parameters (``LBFGS``) are refused. Step pre/post
  hooks run once per ``opt.step()``, as without the manager. New state entries are re-ordered as plain training
  would have created them, so ``opt.state_dict()`` is the same, key order included.
* Offloaded state and gradients are replaced, in ``opt.state`` and ``p.grad``, by storage-less placeholder tensors
  (:class:`HostTensor`) that remember where the value is; any operation on one (``torch.equal``, ``clip_grad_norm_``'s
  norms and in-place scaling, ``repr``) runs on a temporary device copy and writes in-place changes back, so reading and
  updating them still works. Only ops that would return a view of one raise :class:`StateError`.
* Offloaded parameters keep their identity: the same ``nn.Parameter`` objects, whose storage is freed with
  ``untyped_storage().resize_(0)`` and re-grown and refilled in place (FSDP2's way). ``p.data = ...`` would not do:
  autograd saves views of parameters (``weight.t()`` for a linear layer), which would keep pointing at the old storage.
  Resizing the one storage all views share keeps every saved view valid once it is refilled. While its storage is
  empty (a kernel reading it would crash the process), an offloaded parameter wears a subclass of its class whose
  ``__torch_function__`` serves the loop's own uses between steps: metadata as it is, ``detach()`` / ``.data`` as a
  :class:`HostTensor` of the host copy, any other operator with the unit's parameters brought back (in-place changes
  kept) and offloaded again (:func:`offloaded_class`); one that would return a view raises :class:`StateError`. The
  manager checks that no module outside the unit holds it and that the unit does not return a view of it;
  ``model.state_dict()`` / ``model.load_state_dict()`` go through the host copy, and :meth:`StateManager.gathered`
  brings every offloaded parameter back for a block of code that needs the parameters themselves. The plan's hooks
  are registered through :func:`~memopt_nb.runtime.hooks.uncopied`, so a copy of the model made inside the block is a
  plain model.

On exit everything is put back exactly — the original state tensor objects refilled and back in ``opt.state``,
placeholder gradients replaced by real ones, parameters refilled, hooks removed, ``opt.step`` / ``zero_grad`` /
``state_dict`` / ``load_state_dict`` restored, also when the block raises or is interrupted — if what is on the host
fits the device then (:meth:`StateManager.leave`: inside ``memopt.limit_memory`` the limit less what it counts, on
CUDA what the allocator can still give). A graph built inside the block and backpropagated after it runs none of the
manager's hooks (the parameters are back on the device).

When it does not fit (a model whose training state is larger than the device), the manager stays applied, *parked*:
every tensor stays where the plan put it and keeps moving as under the plan, so the device holds what it held between
steps inside the block, never more, and a warning says so. Bringing back part of it instead would fill the device and
leave no room for the next step's activations or an evaluation. Parked, the loop works as inside the block: a plain
``forward`` / ``backward`` / ``opt.step()`` trains the same values (activations unplanned), an evaluation or an EMA
brings a unit's parameters at a time. The next ``with memopt.plan(p):`` with the same placements takes the parked
manager over; another plan brings the state back first (:class:`StateError` if it does not fit).
:func:`bring_back` (``memopt.bring_back(opt)``) removes it once the device has room.

``model.state_dict()`` and ``opt.state_dict()`` (inside the block and parked) give offloaded parameters and state as
host copies (CPU tensors; on the emulated device made under :func:`~memopt_nb.runtime.limit.uncounted`): saving a
checkpoint brings nothing to the device. ``load_state_dict`` sends loaded state of offloaded units to the host a
parameter at a time.

What the loop may get wrong:

* A unit stepped in backward first keeps host copies of its parameters and optimizer state
  (:data:`UNDO_STEPS_IN_BACKWARD`): a backward that raises after stepping it (a bad batch, an interrupt) puts it back
  as it was, so ``opt.zero_grad()`` skips the batch as in plain training, and leaving the block leaves the model as
  plain training stopped there does (less the gradients those units consumed). ``opt.zero_grad()`` after a backward
  that stepped units puts them back the same way. A rule broken after such a backward (gradient accumulation,
  clipping, a second backward) is refused with those units put back first and every gradient cleared, so the model
  is as before that step (without the copies: the step is completed, so it is as after it); never half-stepped.
* Another optimizer than the managed one stepping parameters of a managed unit (one made after profiling, or the one
  ``transformers.Trainer`` builds) is refused before it steps (:mod:`memopt_nb.runtime.foreign`).
* A unit holding a frozen parameter (a LoRA adapter's base weight) keeps its offloaded parameters until backward
  reaches an earlier unit: its last gradient is not the end of its backward, which still needs the frozen weight for
  its input's gradient.

Schedule (fixed, so that what is on the device at any moment depends on each unit's own placement only — the cost
model of :mod:`memopt_nb.sim.simulator` sums over units and relies on it):

* with any unit's ``params="offload"``, every unit's forward pre-hook fetches unit ``u + 1``'s offloaded parameters
  ahead, and backward reaching unit ``u`` fetches unit ``u - 1``'s (the fixed neighbour, whatever the placements in
  between);
* ``grads="offload"``: a unit's gradient copies to the host are waited for when its last gradient is accumulated, so
  they have left the device before backward moves on; the device gradients are held until then, not freed by the copy
  thread as it finishes (which would make the peak inside the unit's backward depend on that thread's timing);
* ``opt.step()`` with any placement managed runs in parts: the parameters outside units, then unit 0, 1, … each alone
  (a unit stepped in backward is an empty part), bringing part ``i + 1``'s state and parameters while part ``i``
  steps. A streamed unit's part is one chunk per parameter: when the part starts, the next part's first chunk (its
  first parameter's state, or a whole unit's, and its offloaded parameters) starts coming in; each chunk's state comes
  in while the one before it steps and leaves once the one after it is on the device. With every placement resident
  it is one plain step.

Transfers: on the CPU (the emulated device) host copies are ``torch.UntypedStorage`` objects and a worker thread per
direction copies with ``memmove``, so the meter of :mod:`memopt_nb.runtime.memory` does not count the host store
(storages freed or re-grown are reported to it with ``note_device_storage``). On CUDA the copies run on a
device-to-host and a host-to-device side stream into pinned host buffers, ordered with events; that path has not run on
a GPU yet.
"""

from __future__ import annotations

import collections
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..core.plan import GRAD_PLACES, OPTIMIZER_PLACES, PARAM_PLACES
from .foreign import unwatch as _unwatch_foreign
from .foreign import watch as _watch_foreign
from .hooks import uncopied
from .movers import CudaMover, ThreadMover
from .slots import HostTensor, Slot, stepped_placeholder
from .state_backward import StepInBackward
from .state_errors import STEP_RULES, StateError, StepInBackwardError
from .state_moves import _MISSING, StateMoves
from .state_params import ParamPlacement
from .state_parking import _PARKED, Parking, bring_back, parked_manager
from .state_recovery import Recovery
from .state_stream import Stepping
from .storages import movable

__all__ = ["HostTensor", "Placement", "StateError", "StateManager", "StepInBackwardError", "bring_back", "manage_state",
           "parked_manager"]



UNDO_STEPS_IN_BACKWARD = True


@dataclass(frozen=True)
class Placement:
    """Where one unit's optimizer state, gradients and parameters live (see the module docstring)."""

    optimizer: str = "resident"
    grads: str = "resident"
    params: str = "resident"

    def check(self, step_in_backward: bool, where: str) -> None:
        for field, value, choices in (("optimizer", self.optimizer, OPTIMIZER_PLACES),
                                      ("grads", self.grads, GRAD_PLACES), ("params", self.params, PARAM_PLACES)):
            if value not in choices:
                raise StateError(f"{where}: {field}={value!r} is not one of {', '.join(map(repr, choices))}")
        if self.grads == "step" and not step_in_backward:
            raise StateError(f"{where}: grads='step' changes what the training loop may do ({STEP_RULES}); opt in "
                             "with step_in_backward=True")

    @property
    def managed(self) -> bool:
        return (self.optimizer, self.grads, self.params) != ("resident", "resident", "resident")


# ---------------------------------------------------------------------- the manager
class StateManager(StateMoves, ParamPlacement, Stepping, StepInBackward, Recovery, Parking):
    """Applies per-unit placements of optimizer state, gradients and parameters to ``model`` and ``optimizer``.

    Each job lives in its own part: optimizer state and gradients moving, and the optimizer's methods over them
    (:mod:`~memopt_nb.runtime.state_moves`); offloaded parameters (:mod:`~memopt_nb.runtime.state_params`); the step in
    parts (:mod:`~memopt_nb.runtime.state_stream`); steps in backward (:mod:`~memopt_nb.runtime.state_backward`) and
    putting them back (:mod:`~memopt_nb.runtime.state_recovery`); leaving the block
    (:mod:`~memopt_nb.runtime.state_parking`). This class validates, installs and removes.

    Args:
        model: the module trained (its forward pre-hook guards step-in-backward loops).
        optimizer: the ``torch.optim`` optimizer over (some of) the model's parameters.
        units: per unit, an ``nn.Module`` (its parameters) or a list of parameters, in forward order. A parameter may
            belong to one unit only; parameters in no unit stay as they are.
        placements: one :class:`Placement` for every unit, or one per unit.
        step_in_backward: opt in to ``grads="step"`` (changes what the loop may do; see :class:`StepInBackwardError`).
        prefetch: start fetching the next unit's offloaded parameters (forward) or the previous one's (backward), and
            the next unit's state and parameters for the step, while the current unit runs. ``False`` holds one unit
            of each kind on the device instead of two, and waits for every transfer.

    Use as a context manager, or :meth:`apply` / :meth:`remove`. :attr:`stats` counts the bytes moved.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 units: Sequence[nn.Module | Sequence[nn.Parameter]],
                 placements: Placement | Sequence[Placement] = Placement(), *, step_in_backward: bool = False,
                 prefetch: bool = True) -> None:
        if not isinstance(model, nn.Module):
            raise StateError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise StateError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer = model, optimizer
        self.modules: list[nn.Module | None] = []
        self.unit_params: list[list[nn.Parameter]] = []
        for i, u in enumerate(units):
            if isinstance(u, nn.Module):
                self.modules.append(u)
                self.unit_params.append(list(u.parameters()))
            else:
                ps = list(u)
                if not all(isinstance(p, nn.Parameter) for p in ps):
                    raise StateError(f"unit {i}: give an nn.Module or a list of nn.Parameter objects")
                self.modules.append(None)
                self.unit_params.append(list(dict.fromkeys(ps)))
        n = len(self.unit_params)
        if isinstance(placements, Placement):
            placements = [placements] * n
        placements = list(placements)
        if len(placements) != n:
            raise StateError(f"{len(placements)} placements for {n} units; give one Placement or one per unit")
        for i, pl in enumerate(placements):
            if not isinstance(pl, Placement):
                raise StateError(f"unit {i}: placement must be a Placement, got {type(pl).__name__}")
            pl.check(step_in_backward, f"unit {i}")
        self.placements = placements
        self.step_in_backward = step_in_backward
        self.prefetch = prefetch
        self.unit_of: dict[int, int] = {}
        for i, ps in enumerate(self.unit_params):
            for p in ps:
                if id(p) in self.unit_of:
                    raise StateError(f"a parameter of shape {tuple(p.shape)} is in units {self.unit_of[id(p)]} "
                                     f"and {i}; a parameter may belong to one unit only")
                self.unit_of[id(p)] = i
        self._check_optimizer()
        self._active = False
        self._parked = False
        self._device = torch.device("cpu")
        self._mover: Any = None
        self._managed_ids: set[int] | None = None
        self.stats: collections.Counter = collections.Counter()
        self._reset()

    # ------------------------------------------------------------------ validation
    def _opt_ids(self) -> dict[int, int]:
        """id(param) -> position in param_groups order (the order plain training creates state in)."""
        out: dict[int, int] = {}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                out.setdefault(id(p), len(out))
        return out

    def _check_optimizer(self) -> None:
        opt = self.optimizer
        if isinstance(opt, torch.optim.LBFGS) and any(pl.managed for pl in self.placements):
            raise StateError("LBFGS couples all parameters in one step and re-evaluates its closure; it cannot step "
                             "unit by unit — keep every placement 'resident' or use another optimizer")
        for i, (pl, ps, mod) in enumerate(zip(self.placements, self.unit_params, self.modules, strict=True)):
            if pl.params != "offload":
                continue
            if mod is None:
                raise StateError(f"unit {i}: params='offload' needs the unit as an nn.Module (its forward is where the "
                                 "parameters are fetched); give the module instead of a parameter list")
            for p in ps:
                if not movable(p):
                    raise StateError(f"unit {i}: a parameter of shape {tuple(p.shape)} shares or cannot resize its "
                                     "storage (a view, a flat buffer or memory-mapped), so it cannot be offloaded")
            inside = {id(m) for m in mod.modules()}
            mine = {id(p) for p in ps}
            for name, m in self.model.named_modules():
                if id(m) in inside:
                    continue
                for pn, p in m._parameters.items():
                    if p is not None and id(p) in mine:
                        raise StateError(f"unit {i}: parameter {name + '.' + pn if name else pn!r} is also used by a "
                                         "module outside the unit (tied weights); its parameters cannot be offloaded")

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> StateManager:
        return self.apply()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    @property
    def active(self) -> bool:
        return self._active

    def _reset(self) -> None:
        self._handles: list[Any] = []
        self._opt_saved: dict[str, Any] = {}
        self._state_slots: dict[tuple[int, Any], Slot] = {}
        self._grad_slots: dict[int, Slot] = {}
        self._param_slots: list[list[Slot]] = [[] for _ in self.unit_params]
        self._param_where = ["device"] * len(self.unit_params)  # device | host | fetching
        self._param_dirty = [False] * len(self.unit_params)
        self._in_bw = [False] * len(self.unit_params)
        self._seen: list[set[int]] = [set() for _ in self.unit_params]
        self._trainable = [{id(p) for p in ps if p.requires_grad} for ps in self.unit_params]
        #: per unit, whether it holds a frozen parameter (no gradient): then its last gradient does not mark the end
        #: of its backward, which may still need that parameter for its input's gradient
        self._frozen = [any(not p.requires_grad for p in ps) for ps in self.unit_params]
        self._deferred: set[int] = set()  # units whose gradients are done, freed when backward reaches an earlier one
        self._stepped: set[int] = set()  # units stepped in backward, waiting for opt.step()
        self._stale = 0  # stepped placeholders not yet cleared by zero_grad
        self._callback_queued = False
        self._gen = 0  # backward passes seen (bumped at the end of each)
        self._sib_gen = -1  # the backward pass in which units were last stepped
        self._state_keys: set[int] = set()
        self._lr_sched = False
        # per unit stepped in backward, its parameters and optimizer state as they were before that step (host
        # copies): a backward that fails after stepping it puts it back (:meth:`_recover_failed_backward`)
        self._undo: dict[int, list[tuple[nn.Parameter, Any, Any]]] = {}
        self._undo_bufs: dict[tuple[int, Any], Any] = {}
        self._queued_task = -1  # the autograd graph task the end-of-backward callback was queued in
        #: units were put back after a failed backward, their gradients gone: opt.zero_grad() must come first
        self._undone_pending = False
        self._pending: list[Slot] = []
        # per unit, the device gradients sent to the host in its current backward: held until that backward ends, so
        # they leave the device there whenever the copy thread finishes (the schedule the simulator counts)
        self._sent_grads: list[list[torch.Tensor]] = [[] for _ in self.unit_params]

    def apply(self) -> StateManager:
        """Install the placements. Raises :class:`StateError` if they do not fit or are applied already."""
        if self._active:
            raise StateError("this StateManager is applied already; leave its `with` block first")
        opt = self.optimizer
        other = getattr(opt, "_memopt_state", None)
        if other is not None and other.parked:
            raise StateError("a plan's block left this optimizer's training state on the host (it did not fit the "
                             "device); apply that plan again, or call memopt.bring_back(optimizer) first")
        if other is not None:
            raise StateError("another StateManager manages this optimizer; leave its `with` block first")
        device = next((p.device for ps in self.unit_params for p in ps), torch.device("cpu"))
        self._device = device
        self._reset()
        self._mover = CudaMover(device) if device.type == "cuda" else ThreadMover()
        self._active = True
        opt._memopt_state = self
        try:
            self._install()
            _watch_foreign(self)  # another optimizer stepping these parameters is refused (runtime/foreign.py)
        except BaseException:
            self.remove()
            raise
        return self

    def _install(self) -> None:
        opt, model = self.optimizer, self.model
        in_opt = self._opt_ids()
        prev_step = opt.__dict__.get("step")
        self._lr_sched = bool(getattr(prev_step, "_wrapped_by_lr_sched", False))
        for name in ("step", "zero_grad", "state_dict", "load_state_dict"):
            self._opt_saved[name] = opt.__dict__.get(name, _MISSING)
        this = self

        def step(opt_self: Any, closure: Any = None) -> Any:
            if not this._active:
                return type(opt_self).step(opt_self, closure)
            return this._hooked_step(opt_self, closure)

        def zero_grad(opt_self: Any, set_to_none: bool = True) -> None:
            return this._zero_grad(set_to_none)

        def state_dict(opt_self: Any) -> dict[str, Any]:
            return this._state_dict()

        def load_state_dict(opt_self: Any, state_dict: dict[str, Any]) -> None:
            return this._load_state_dict(state_dict)

        if self._lr_sched:  # an LR scheduler wrapped opt.step to see it called: this wrapper tells it instead
            step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        opt.step = types.MethodType(step, opt)
        opt.zero_grad = types.MethodType(zero_grad, opt)
        opt.state_dict = types.MethodType(state_dict, opt)
        opt.load_state_dict = types.MethodType(load_state_dict, opt)
        self._hooked_step = torch.optim.Optimizer.profile_hook_step(self._all_chunks)
        self._state_keys = {id(k) for k in opt.state}

        for u, (pl, ps) in enumerate(zip(self.placements, self.unit_params, strict=True)):
            post = self._make_post_hook(u, in_opt)
            for p in ps:
                if not p.requires_grad:
                    continue
                self._handles.append(p.register_post_accumulate_grad_hook(post))
                if pl.grads != "resident" and id(p) in in_opt:
                    self._handles.append(p.register_hook(self._make_pre_hook(u, p)))
            if pl.grads == "offload":
                for p in ps:
                    if id(p) in in_opt and p.grad is not None and not isinstance(p.grad, HostTensor):
                        self._offload_grad(p)
            if pl.optimizer != "resident":
                for p in ps:
                    if p in opt.state:
                        self._send_state(p)
                self._release_pending()
            if pl.params == "offload":
                mod = self.modules[u]
                self._param_slots[u] = [Slot(self._mover, p, True, "param", u) for p in ps]
                for s in self._param_slots[u]:
                    s.send(s.storage)
                for s in self._param_slots[u]:
                    s.free()
                self._param_where[u] = "host"
                self._wear(u, True)
                self._handles += self._state_dict_hooks(u, mod)
        if any(pl.params == "offload" for pl in self.placements):
            # every unit's forward prefetches its neighbour's parameters (a fixed neighbour: u + 1 in forward, u - 1
            # in backward), whatever its own placement
            for u, mod in enumerate(self.modules):
                if mod is not None:
                    self._handles.append(mod.register_forward_pre_hook(uncopied(self._make_fwd_pre(u))))
                    self._handles.append(mod.register_forward_hook(uncopied(self._make_fwd_post(u))))
        if self.step_in_backward:
            self._handles.append(model.register_forward_pre_hook(uncopied(self._check_forward)))
            self._handles.append(model.register_forward_hook(uncopied(self._guard_outputs)))

    def remove(self) -> None:
        """Undo :meth:`apply`: state, gradients and parameters back on the device, hooks and methods removed."""
        if self._mover is None:
            return
        opt = self.optimizer
        self._parked = False
        _PARKED.discard(self)
        try:
            if self._backward_failed():  # leaving the block by an exception raised mid-backward
                self._recover_failed_backward()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            for u in range(len(self.unit_params)):
                if self._param_slots[u]:
                    self._fetch_params(u, wait=True)
            for p_id_key, slot in list(self._state_slots.items()):
                p = slot.owner
                st = opt.state.get(p)
                if st is not None and isinstance(st.get(p_id_key[1]), HostTensor) and st[p_id_key[1]]._slot is slot:
                    slot.refill()
                    slot.wait()
                    st[p_id_key[1]] = slot.tensor
            for ps in self.unit_params:
                for p in ps:
                    g = p.grad
                    if isinstance(g, HostTensor):
                        p.grad = None if g._stepped else g._slot.materialize()
        finally:
            for name, prev in self._opt_saved.items():
                if prev is _MISSING:
                    opt.__dict__.pop(name, None)
                else:
                    opt.__dict__[name] = prev
            self._opt_saved = {}
            _unwatch_foreign(self)
            if getattr(opt, "_memopt_state", None) is self:
                del opt._memopt_state
            self._mover.close()
            self._mover = None
            self._sent_grads = [[] for _ in self.unit_params]
            self._active = False
            self._hooked_step = None  # it holds a bound method of this manager: a cycle that would keep the model
            # and optimizer (their device memory) alive after the caller drops them, until Python's gc ran

    # ------------------------------------------------------------------ a step in backward (reads the undo switch)
    def _step_in_backward(self, u: int) -> None:
        in_opt = self._opt_ids()
        chunk = sorted((p for p in self.unit_params[u] if id(p) in in_opt and p.grad is not None),
                       key=lambda p: in_opt[id(p)])  # param_groups order, as opt.step() and the profile step them
        if not chunk:
            return
        keep = (lambda ps: self._keep_for_undo(u, ps)) if UNDO_STEPS_IN_BACKWARD else None
        self._run_parts([self._chunks_of(u, chunk)], before_step=keep)
        for p in chunk:
            p.grad = stepped_placeholder(p.grad, self._settle)
            self._stale += 1
        self._stepped.add(u)
        self._sib_gen = self._gen
        self._queue_end_of_backward()
        self.stats["steps_in_backward"] += 1

    # ------------------------------------------------------------------ another optimizer (runtime/foreign.py)
    error = StateError

    def managed_param_ids(self) -> set[int]:
        """The ids of the parameters in units whose optimizer state, gradients or parameters this manager moves."""
        if self._managed_ids is None:  # placements and units do not change: once per manager
            self._managed_ids = {id(p) for pl, ps in zip(self.placements, self.unit_params, strict=True) if pl.managed
                                 for p in ps}
        return self._managed_ids

    def unit_names(self, units: Iterable[int]) -> str:
        """Units by their module names in the model (``unit 3`` for a unit given as a list of parameters)."""
        names = {id(m): n for n, m in self.model.named_modules()}
        out = [repr(names.get(id(self.modules[u]), f"unit {u}")) if self.modules[u] is not None else f"unit {u}"
               for u in units]
        return ", ".join(out[:4]) + (f" and {len(out) - 4} more" if len(out) > 4 else "")

    # ------------------------------------------------------------------ reporting
    def unit_bytes(self) -> list[dict[str, int]]:
        """Per unit: parameter, gradient (trainable parameters) and optimizer-state bytes, wherever they live now."""
        out = []
        for ps in self.unit_params:
            state = 0
            for p in ps:
                for v in self.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        state += v.numel() * v.element_size()
            out.append({"params": sum(p.numel() * p.element_size() for p in ps),
                        "grads": sum(p.numel() * p.element_size() for p in ps if p.requires_grad),
                        "optimizer": state})
        return out

    def __repr__(self) -> str:
        counts = collections.Counter((pl.optimizer, pl.grads, pl.params) for pl in self.placements)
        what = ", ".join(f"{n}× optimizer={o}/grads={g}/params={q}" for (o, g, q), n in counts.items())
        state = "applied" if self._active else "not applied"
        return f"<memopt StateManager over {len(self.unit_params)} units ({what}), {state}>"


def manage_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                 units: Sequence[nn.Module | Sequence[nn.Parameter]] | Iterable[nn.Module],
                 optimizer_state: str = "resident", grads: str = "resident", params: str = "resident",
                 step_in_backward: bool = False) -> StateManager:
    """One placement for every unit: ``with manage_state(model, opt, model.blocks, optimizer_state="offload"):``."""
    return StateManager(model, optimizer, list(units), Placement(optimizer_state, grads, params),
                        step_in_backward=step_in_backward)
