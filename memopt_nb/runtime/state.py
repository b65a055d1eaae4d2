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
import contextlib
import copy
import ctypes
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from ..core.budget import format_bytes
from ..core.errors import MemoptWarning
from ..core.plan import GRAD_PLACES, OPTIMIZER_PLACES, PARAM_PLACES
from .foreign import unwatch as _unwatch_foreign
from .foreign import watch as _watch_foreign
from .free import device_room
from .hooks import uncopied
from .limit import active_limit, recount
from .movers import CudaMover, ThreadMover
from .offloaded import Worn, offloaded_class
from .slots import HostTensor, Slot, placeholder, stepped_placeholder
from .state_errors import STEP_RULES, StateError, StepInBackwardError
from .storages import exclusive as _exclusive
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
class StateManager:
    """Applies per-unit placements of optimizer state, gradients and parameters to ``model`` and ``optimizer``.

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

    @property
    def parked(self) -> bool:
        """Whether the plan's block has ended with this manager still applied, its host state not fitting the device
        (see :meth:`leave`)."""
        return self._parked

    def host_bytes(self) -> int:
        """The bytes of parameters, optimizer state and gradients on the host now: what :meth:`remove` would bring to
        the device."""
        total = sum(s.nbytes for u, slots in enumerate(self._param_slots) if self._param_where[u] != "device"
                    for s in slots)
        for (_, key), slot in self._state_slots.items():
            st = self.optimizer.state.get(slot.owner)
            v = st.get(key) if st is not None else None
            if isinstance(v, HostTensor) and v._slot is slot:
                total += slot.nbytes
        return total + sum(p.grad._slot.nbytes for ps in self.unit_params for p in ps
                           if isinstance(p.grad, HostTensor) and not p.grad._stepped)

    def leave(self) -> bool:
        """End the plan's block: :meth:`remove` if what is on the host fits the device now (returns ``True``), else
        stay applied, parked (returns ``False``): every parameter, gradient and optimizer-state tensor stays where the
        plan put it and keeps moving as under the plan, so the model and optimizer keep working as inside the block
        and the device never holds more than it did between steps there. :func:`bring_back` removes it later; the next
        ``memopt.plan`` with the same placements takes it over."""
        if self._mover is None:
            return True
        if self._backward_failed():  # leaving by an exception raised mid-backward
            self._recover_failed_backward()
        need, room = self.host_bytes(), device_room(self._device)
        if room is None or need <= room:
            self.remove()
            return True
        if not self._parked:
            self._parked = True
            _PARKED.add(self)
            self.stats["parked_bytes"] = need
            warnings.warn(
                f"memopt: {format_bytes(need)} of training state (parameters, gradients, optimizer state) stay on the "
                f"host after the plan's block: the device has {format_bytes(room)} free. The model and optimizer keep "
                "working (that state moves to the device as under the plan); call memopt.bring_back(optimizer) when "
                "the device has room", MemoptWarning, stacklevel=4)
        return False

    def resume(self) -> StateManager:
        """A parked manager taken over by the next block of a plan with its placements: applied again as it is."""
        self._parked = False
        _PARKED.discard(self)
        return self

    def matches(self, model: nn.Module, units: Sequence[nn.Module], placements: Sequence[Placement],
                step_in_backward: bool) -> bool:
        """Whether this manager places the state of ``units`` of ``model`` as ``placements`` say."""
        return (model is self.model and len(units) == len(self.modules)
                and all(a is b for a, b in zip(units, self.modules, strict=True))
                and list(placements) == self.placements and step_in_backward == self.step_in_backward)

    def bring_back(self) -> int:
        """Remove a parked manager if what it holds on the host fits the device now (see :func:`bring_back`); returns
        the bytes brought back."""
        need, room = self.host_bytes(), device_room(self._device)
        if room is not None and need > room:
            raise StateError(
                f"the training state a plan's block left on the host ({format_bytes(need)}) does not fit the device "
                f"now ({format_bytes(room)} free); free device memory first (del what you no longer need), or keep "
                "training under the plan (`with memopt.plan(p):` with the same plan takes the state over as it is)")
        self.remove()
        return need

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

    # ------------------------------------------------------------------ optimizer state
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

    # ------------------------------------------------------------------ gradients
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

    # ------------------------------------------------------------------ parameters
    def _fetch_params(self, u: int, wait: bool) -> None:
        if self._param_where[u] == "host":
            for s in self._param_slots[u]:
                s.refill()
                self.stats["param_h2d_bytes"] += s.nbytes
            self._param_where[u] = "fetching"
        if wait and self._param_where[u] == "fetching":
            for s in self._param_slots[u]:
                s.wait()
            self._param_where[u] = "device"
            self._wear(u, False)

    def _free_params(self, u: int) -> None:
        if self._param_where[u] == "host":
            return
        self._fetch_params(u, wait=True)
        if self._param_dirty[u]:
            for s in self._param_slots[u]:
                s.send(s.storage)
                self.stats["param_d2h_bytes"] += s.nbytes
            self._param_dirty[u] = False
        for s in self._param_slots[u]:
            s.free()
        self._param_where[u] = "host"
        self._wear(u, True)

    def _wear(self, u: int, offloaded: bool) -> None:
        """Unit ``u``'s parameters take (or leave) the class that guards them while their data is on the host
        (:func:`offloaded_class`); same objects, only ``__class__`` changes."""
        for s in self._param_slots[u]:
            p = s.tensor
            worn = "_memopt_offload" in p.__dict__
            if offloaded and not worn:
                sub = offloaded_class(type(p))
                if sub is not None:
                    p._memopt_offload = Worn(self, u, s)
                    p.__class__ = sub
            elif not offloaded and worn:
                p.__class__ = type(p).__bases__[0]  # the class it wore before: the one offloaded_class derived from
                del p._memopt_offload

    @contextlib.contextmanager
    def _reading(self, u: int) -> Iterator[set[int]]:
        """Unit ``u``'s parameters on the device for one operator of the caller's (what
        :func:`_offloaded_torch_function` runs), kept if it changed them, offloaded again after if they were. Yields
        the ids of their storages."""
        prior = self._param_where[u]
        self._fetch_params(u, wait=True)
        slots = self._param_slots[u]
        versions = [s.tensor._version for s in slots]
        self.stats["param_reads_between_steps"] += 1
        try:
            yield {s.storage._cdata for s in slots}
        finally:
            if any(s.tensor._version != v for s, v in zip(slots, versions, strict=True)):
                self._param_dirty[u] = True
            if prior == "host" and not self._in_bw[u]:
                self._free_params(u)

    def _state_dict_hooks(self, u: int, mod: nn.Module) -> list[Any]:
        """``model.state_dict()`` gets offloaded parameters' host values; ``model.load_state_dict()`` writes them."""
        slot_of = {id(s.tensor): s for s in self._param_slots[u]}

        def saving(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
            if self._param_where[u] != "host":
                return
            for name, p in module.named_parameters(prefix=prefix.rstrip(".")):
                slot = slot_of.get(id(p))
                if slot is not None and name in state_dict:
                    state_dict[name] = slot.host_copy()  # a host copy: the parameter has no device data now

        def loading(module: nn.Module, *args: Any) -> None:
            self._fetch_params(u, wait=True)

        def loaded(module: nn.Module, incompatible: Any) -> None:
            self._param_dirty[u] = True
            if not self._in_bw[u]:
                self._free_params(u)

        return [mod.register_state_dict_post_hook(uncopied(saving)),
                mod.register_load_state_dict_pre_hook(uncopied(loading)),
                mod.register_load_state_dict_post_hook(uncopied(loaded))]

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every offloaded parameter on the device for the block (to read or change it), offloaded again after.

        Outside a unit's forward and backward an offloaded parameter has an empty storage: reading it (``torch.equal``,
        ``p.sum()``) would read freed memory. ``model.state_dict()`` / ``load_state_dict()`` are safe without this.
        """
        units = [u for u in range(len(self.unit_params)) if self._param_slots[u]]
        for u in units:
            self._fetch_params(u, wait=True)
        try:
            yield
        finally:
            for u in units:
                self._param_dirty[u] = True
                if not self._in_bw[u]:
                    self._free_params(u)

    def _neighbour(self, u: int, step: int) -> int | None:
        """The unit next to ``u`` (``u + step``) if its parameters are offloaded — a fixed neighbour, so what is on
        the device at any moment depends on each unit's own placement only (the cost model relies on it)."""
        v = u + step
        if 0 <= v < len(self.unit_params) and self._param_slots[v]:
            return v
        return None

    def _make_fwd_pre(self, u: int) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self._param_slots[u]:
                self._fetch_params(u, wait=True)
            nxt = self._neighbour(u, 1) if self.prefetch and not self._in_bw[u] else None
            if nxt is not None:
                self._fetch_params(nxt, wait=False)

        return hook

    def _make_fwd_post(self, u: int) -> Any:
        storages = None

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            nonlocal storages
            if storages is None:
                storages = {s.storage._cdata for s in self._param_slots[u]}
            outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
            if storages and any(type(t) is not HostTensor and t.untyped_storage()._cdata in storages for t in outs):
                raise StateError(f"unit {u} returns a view of one of its parameters; its parameters cannot be "
                                 "offloaded (the view would lose its data) — keep params='resident' for it")
            grads = [t for t in outs if t.requires_grad] if torch.is_grad_enabled() else []
            if grads:
                fired = [False]

                def trigger(grad: torch.Tensor) -> None:
                    if fired[0] or not self._active:  # a graph built in the block, backpropagated after it: the
                        return  # parameters are back on the device, and nothing of the plan runs any more
                    fired[0] = True
                    self._queue_end_of_backward()  # first: after a failed backward it frees what that one left
                    self._free_deferred(u)
                    self._in_bw[u] = True
                    if self._param_slots[u]:
                        self._fetch_params(u, wait=True)
                    prev = self._neighbour(u, -1) if self.prefetch else None
                    if prev is not None:
                        self._fetch_params(prev, wait=False)

                for t in grads:
                    t.register_hook(trigger)
            if self._param_slots[u] and not self._in_bw[u]:  # a recompute inside backward must not free what
                self._free_params(u)                            # backward still needs

        return hook

    def _free_deferred(self, u: int) -> None:
        """Backward reached unit ``u``: the units after it whose gradients are complete are done with their
        parameters (frozen ones included): free them before ``u``'s are fetched, as a unit without frozen parameters
        is freed at its last gradient."""
        for w in sorted(w for w in self._deferred if w > u):
            self._deferred.discard(w)
            if self._in_bw[w]:
                self._free_params(w)
                self._in_bw[w] = False

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

    # ------------------------------------------------------------------ the step
    def _raw_step(self, chunk: list[nn.Parameter]) -> None:
        opt = self.optimizer
        fn = type(opt).step
        raw = fn.__wrapped__ if getattr(fn, "hooked", False) else fn
        ids = {id(p) for p in chunk}
        groups = opt.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = [p for p in ps if id(p) in ids]
            raw(opt)
        finally:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = ps

    def _bring(self, chunk: list[nn.Parameter], wait: bool) -> list[Slot]:
        """Start (and optionally finish) bringing a chunk's state and parameters to the device."""
        slots = []
        for p in chunk:
            slots += self._bring_state(p, wait=False)
        for u in sorted({self.unit_of[id(p)] for p in chunk if id(p) in self.unit_of}):
            if self._param_slots[u]:
                self._fetch_params(u, wait=False)
        if wait:
            self._finish_bring(chunk, slots)
        return slots

    def _finish_bring(self, chunk: list[nn.Parameter], slots: list[Slot]) -> None:
        for s in slots:
            s.wait()
        for u in sorted({self.unit_of[id(p)] for p in chunk if id(p) in self.unit_of}):
            if self._param_slots[u]:
                self._fetch_params(u, wait=True)

    def _chunks_of(self, u: int, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """Unit ``u``'s part of the step (``params`` in ``param_groups`` order): one chunk, or one per trainable
        parameter when its optimizer state streams (frozen ones, which step nothing, ride with the first)."""
        if self.placements[u].optimizer != "stream":
            return [params]
        chunks = [[p] for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        if frozen:
            chunks = [chunks[0] + frozen, *chunks[1:]] if chunks else [frozen]
        return chunks

    def _run_parts(self, parts: list[list[list[nn.Parameter]]], before_step: Any = None) -> None:
        """Step ``parts`` one after another, each one chunk after another (see the module docstring).

        With prefetch, part ``i + 1``'s first chunk comes in when part ``i`` starts and the next chunk of a part while
        the one before it steps; a chunk's state leaves once the next chunk is on the device. ``before_step(chunk)``,
        if given, runs when a chunk's parameters, gradients and state are on the device, just before it steps."""
        if not parts:
            return
        ahead: list[Slot] | None = None  # the next part's first chunk, on its way in
        for i, part in enumerate(parts):
            pending, ahead = ahead, None
            for j, chunk in enumerate(part):
                if pending is None:
                    pending = self._bring(chunk, wait=False)
                self._finish_bring(chunk, pending)
                self._release_pending()  # the previous chunk's state has reached the host
                pending = None
                if self.prefetch:  # else each chunk comes after the one before it has stepped (one on the device)
                    if j == 0 and i + 1 < len(parts):
                        ahead = self._bring(parts[i + 1][0], wait=False)
                    if j + 1 < len(part):
                        pending = self._bring(part[j + 1], wait=False)
                self._step_chunk(chunk, before_step)
                for p in chunk:
                    u = self.unit_of.get(id(p))
                    if u is not None and self.placements[u].optimizer != "resident":
                        self._send_state(p)
            for u in sorted({self.unit_of[id(p)] for chunk in part for p in chunk if id(p) in self.unit_of}):
                if self._param_slots[u]:
                    self._param_dirty[u] = True
                    if not self._in_bw[u]:
                        self._free_params(u)
        self._release_pending()

    def _step_chunk(self, chunk: list[nn.Parameter], before_step: Any) -> None:
        """Step one chunk, its offloaded gradients brought back for the step (their host copies stay valid)."""
        swapped = []
        for p in chunk:
            g = p.grad
            if isinstance(g, HostTensor) and not g._stepped:
                p.grad = g._slot.materialize()
                self.stats["grad_h2d_bytes"] += g._slot.nbytes
                swapped.append((p, g))
        if chunk:
            if before_step is not None:
                before_step(chunk)
            self._raw_step(chunk)
        for p, g in swapped:
            p.grad = g

    def _all_chunks(self, opt: torch.optim.Optimizer, closure: Any = None) -> Any:
        self._refuse_after_undo("opt.step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        order = self._opt_ids()
        outside: list[nn.Parameter] = []
        by_unit: list[list[nn.Parameter]] = [[] for _ in self.unit_params]
        for g in opt.param_groups:
            for p in g["params"]:
                u = self.unit_of.get(id(p))
                if u is None:
                    outside.append(p)
                elif u not in self._stepped:
                    by_unit[u].append(p)
        if any(pl.managed for pl in self.placements):
            # a fixed schedule: the parameters outside units, then every unit in order, each while the next one's
            # state and parameters come in (a unit stepped in backward is an empty chunk), so what is on the device
            # at each point of the step depends on each unit's own placement only
            # (a unit whose state streams steps one parameter at a time)
            parts = [[outside]] + [self._chunks_of(u, ps) or [[]] for u, ps in enumerate(by_unit)]
        else:
            parts = [[outside + [p for ps in by_unit for p in ps]]]
        self._run_parts(parts)
        self._stepped.clear()
        self._undo.clear()  # the steps in backward were this step's: no longer to be undone (until here they are, if
        # the step runs out of memory: runtime/oom.py)
        self._reorder_state(order)
        if self._lr_sched:
            opt._opt_called = True
        return loss

    def _reorder_state(self, order: dict[int, int]) -> None:
        """Put state entries created in this step in the order plain training creates them (``param_groups`` order)."""
        state = self.optimizer.state
        new = [k for k in state if id(k) not in self._state_keys]
        if new:
            old = [(k, v) for k, v in state.items() if id(k) in self._state_keys]
            fresh = sorted(((k, state[k]) for k in new), key=lambda kv: order.get(id(kv[0]), len(order)))
            state.clear()
            state.update(old + fresh)
        self._state_keys = {id(k) for k in state}

    # ------------------------------------------------------------------ zero_grad / state_dict / load_state_dict
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

    def undo_steps_in_backward(self) -> int:
        """Put the units stepped in a backward that has not been followed by ``opt.step()`` back as they were before
        their step (parameters and optimizer state); returns how many. Used before refusing what would otherwise
        leave them half-trained. Their gradients are gone: ``opt.zero_grad()`` must come before the next forward or
        step (both raise :class:`StepInBackwardError` until then)."""
        self._recover_failed_backward()
        return self._undo_stepped()

    # ------------------------------------------------------------------ undoing a step in backward
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


class _Missing:
    pass


_MISSING = _Missing()
#: managers whose plan's block ended with their host state not fitting the device (:meth:`StateManager.leave`)
_PARKED: weakref.WeakSet = weakref.WeakSet()


def parked_manager(obj: Any) -> StateManager | None:
    """The parked :class:`StateManager` of ``obj`` (a model or an optimizer), or ``None``."""
    for mgr in list(_PARKED):
        if mgr.parked and (obj is mgr.optimizer or obj is mgr.model):
            return mgr
    return None


def bring_back(obj: Any) -> int:
    """Bring the training state a plan's block left on the host back to the device and remove what of the plan stayed
    to move it; ``obj`` is the model or its optimizer. Returns the bytes brought back (0 if nothing was left there).

    Leaving ``with memopt.plan(p):`` brings every parameter, gradient and optimizer-state tensor back only if all of
    it fits the device then; otherwise it stays where the plan put it (see :meth:`StateManager.leave`). Call this once
    the device has room (outside ``memopt.limit_memory``, or after freeing memory). Raises :class:`StateError`, with
    nothing changed, if it still does not fit."""
    mgr = parked_manager(obj)
    return 0 if mgr is None else mgr.bring_back()


def manage_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                 units: Sequence[nn.Module | Sequence[nn.Parameter]] | Iterable[nn.Module],
                 optimizer_state: str = "resident", grads: str = "resident", params: str = "resident",
                 step_in_backward: bool = False) -> StateManager:
    """One placement for every unit: ``with manage_state(model, opt, model.blocks, optimizer_state="offload"):``."""
    return StateManager(model, optimizer, list(units), Placement(optimizer_state, grads, params),
                        step_in_backward=step_in_backward)
