"""The profiler's instruments: one observed training step that follows every storage autograd saves (which unit made
it, which units save and read it, when nothing but autograd refers to it), the timed steps, and the unit-by-unit
optimizer step whose cost state placements need."""

from __future__ import annotations

import collections
import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.errors import ProfileError
from ..core.profile import Segment, StorageGroup
from ..runtime.memory import meter_for
from ..runtime.recompute import checkpointed
from ..runtime.replay_guard import cache_tensors, is_cache
from ..runtime.step import (
    forward_autocast,
    kept_outputs,
    output_tensors,
    training_step,
)
from ..runtime.storages import is_plain, movable, tensor_on, use_count

__all__ = ["chunked_step", "discover", "forward", "groups_from", "param_steps", "segments_from", "static_bytes",
           "timed_step", "tracked_step", "unique_bytes", "unit_state_bytes"]

_RNG_OPS = ("bernoulli", "dropout", "rand", "normal", "uniform", "multinomial", "randperm", "exponential")


def forward(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """One forward as the training step makes it (under the profile's ``autocast``, if any)."""
    with forward_autocast():
        return model(*inputs, **kwargs)


class _OpWatcher(TorchDispatchMode):
    """Notes which modules on the stack run random ops."""

    def __init__(self, stack: list[str], rng: set[str]) -> None:
        super().__init__()
        self.stack, self.rng = stack, rng

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if self.stack and any(k in func.__name__ for k in _RNG_OPS):
            self.rng.update(self.stack)
        return func(*args, **(kwargs or {}))


class _Births(TorchDispatchMode):
    """Notes the mark at which each storage an op makes was made (where code outside units made it: the profile's
    ``made_pos``)."""

    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        born = self.run.born
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
                st = t.untyped_storage()
                entry = born.get(id(st))
                if entry is None or entry[0]() is not st:
                    born[id(st)] = (weakref.ref(st), self.run.n_marks - 1)
        return out


class _Discovery:
    """What :func:`discover`'s hooks gather during its forward, per module (``info``) and in all (``total``)."""

    def __init__(self, model: nn.Module) -> None:
        self.info: dict[str, dict[str, Any]] = {
            n: {"calls": 0, "order": 10**9, "saved": 0, "backward": False, "seen": set(), "inplace": False,
                "input_changed": False} for n, _ in model.named_modules()}
        #: per module on the stack, its input tensors and their versions when it was called
        self.versions: dict[str, list[tuple[weakref.ref, int]]] = {}
        #: each module's inputs after it returned, as detached aliases (they share the input's version counter and
        #: keep it readable when the forward's code drops the tensor object), with their versions then
        self.after: list[tuple[str, torch.Tensor, int]] = []
        self.stack: list[str] = []
        self.rng: set[str] = set()
        self.order = 0
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.total = 0
        self.all_seen: set[int] = set()

    def pre(self, name: str) -> Callable:
        def hook(mod: nn.Module, args: Any) -> None:
            d = self.info[name]
            d["calls"] += 1
            if d["order"] == 10**9:
                d["order"] = self.order
                self.order += 1
            self.versions[name] = [(weakref.ref(t), t._version) for t in tree_leaves(args)
                                   if isinstance(t, torch.Tensor)]
            self.stack.append(name)

        return hook

    def post(self, name: str) -> Callable:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(out)):
                self.info[name]["backward"] = True
            for ref, v in self.versions.pop(name, ()):
                t = ref()
                if t is not None:
                    if t._version != v:
                        self.info[name]["inplace"] = True
                    self.after.append((name, t.detach(), t._version))

        return hook

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if is_plain(t):
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.param_ptrs and st.nbytes() > 0:
                if ptr not in self.all_seen:
                    self.all_seen.add(ptr)
                    self.total += st.nbytes()
                for name in self.stack:
                    if ptr not in self.info[name]["seen"]:
                        self.info[name]["seen"].add(ptr)
                        self.info[name]["saved"] += st.nbytes()
        # never ``t`` itself: a tensor an op saves of its own output would then hold its autograd node through the
        # node's saved variable — a cycle through C++ the garbage collector cannot see, keeping the whole model alive
        return t.detach()


def discover(model: nn.Module, inputs: Sequence[Any],
             kwargs: Mapping[str, Any] | None = None) -> tuple[dict[str, dict[str, Any]], int]:
    """One forward with hooks on every module: call counts, order, saved bytes, backward reach, RNG, and whether a
    module's input tensor is changed in place (``"inplace"``: by the module itself, as ``ReLU(inplace=True)``;
    ``"input_changed"``: by code that runs after it). Such a module cannot be a unit: recomputing it, or swapping its
    input back, needs the input as it was."""
    found = _Discovery(model)
    info = found.info
    handles = []
    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(found.pre(name)))
            handles.append(mod.register_forward_hook(found.post(name)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(found.pack, lambda t: t), _OpWatcher(found.stack, found.rng):
            out = forward(model, inputs, kwargs or {})
        for name, t, v in found.after:
            if t._version != v:
                info[name]["input_changed"] = True
        found.after.clear()
        del out
    finally:
        for h in handles:
            h.remove()
    for name in found.rng:
        info[name]["rng"] = True
    for d in info.values():
        d.pop("seen")
    return info, found.total


# ====================================================================== instrumented runs
class _SInfo:
    __slots__ = ("nbytes", "producer", "savers", "consumers", "outside", "free_pos", "weak", "outside_release",
                 "release_pos", "death_seg", "late", "made_pos", "__weakref__")

    def __init__(self, st: torch.UntypedStorage, producer: int) -> None:
        self.nbytes = st.nbytes()
        self.producer = producer
        self.savers: set[int] = set()
        self.consumers: set[int] = set()
        self.outside = False
        self.free_pos: int | None = None
        self.outside_release: int | None = None
        self.release_pos: int | None = None
        self.death_seg: int | None = None  # the segment in which the storage was freed, and what it adds there
        self.late = 0  # to the segment's peak when held past it (see StorageGroup.late_bytes)
        self.made_pos: int | None = None  # made by code outside units during the step: the boundary before
        self.weak = weakref.ref(st)  # never a strong reference: handles keep saved storages alive, as autograd would


class _Handle:
    __slots__ = ("st", "offset", "size", "stride", "dtype")

    def __init__(self, st: torch.UntypedStorage, t: torch.Tensor) -> None:
        self.st, self.offset, self.size, self.stride, self.dtype = st, t.storage_offset(), t.size(), t.stride(), t.dtype


class _OutsideRef:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def _unpack(h: Any) -> torch.Tensor:
    if isinstance(h, torch.Tensor):
        return h
    if isinstance(h, _OutsideRef):
        return h.t
    return tensor_on(h.st, h.dtype, h.offset, h.size, h.stride)


class _Run:
    """Instrumentation for one profiled step: marks at unit boundaries and, in observe mode, storage bookkeeping."""

    def __init__(self, model: nn.Module, unit_names: list[str], mark: Callable[[Any], None], *, observe: bool,
                 recompute: bool, save_ops: Mapping[int, Any] | None = None,
                 split: Callable[[int | None], int] | None = None, blocks: Sequence[str] = ()) -> None:
        self.model = model
        # modules that hold units, each run as one checkpoint (a merged unit's recomputation, measured at the units'
        # own marks); a unit's forward called after the forward ended is then that recomputation: no marks
        self.blocks = list(blocks)
        self.block_io: dict[str, tuple[list[list[int]], int]] = {}
        # observe mode with a meter: when a storage dies, ``split`` closes a part of the segment's peak there, so the
        # peak after its death is known (StorageGroup.late_bytes)
        self.split = split
        self.finalizers: list[weakref.finalize] = []
        self.deaths: list[tuple[_SInfo, int]] = []  # this segment's deaths: (info, index of the part after it)
        self.parts: list[int] = []  # this segment's closed parts' peaks
        self.save_ops = dict(save_ops or {})  # with recompute: units run selective with these op outputs kept
        self.names = unit_names
        self.modules = [model.get_submodule(n) for n in unit_names]
        self.mark = mark
        self.observe = observe
        self.recompute = recompute
        self.n_marks = 0
        # per storage seen, by id of its Python object while it lives (a dead storage's id is reused by a new one,
        # whose info then takes the slot); every info ever made stays in ``all_infos``
        self.infos: dict[int, _SInfo] = {}
        self.all_infos: list[_SInfo] = []
        self.produced: dict[int, tuple[weakref.ref, int]] = {}
        self.born: dict[int, tuple[weakref.ref, int]] = {}  # observe mode: per storage made in the step, its mark
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.param_ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
        self.hook_events: dict[int, tuple[list[tuple[str, int]], int]] = {}
        self.pending_inputs: dict[int, int] = {}
        self.unit_io: dict[int, tuple[list[list[int]], list[list[int]], int, int]] = {}
        self._installed: list[tuple[nn.Module, Any]] = []
        self.bwd_started: set[int] = set()
        self.forward_done = False
        self.grads_done: dict[int, int] = {}  # unit -> level when its last gradient was accumulated
        self.outside_refs: list[weakref.ref] = []  # the markers _outside_pack made

    def release(self) -> None:
        """After a step that failed before its backward was done (out of memory): let go of the tensors the markers
        hold. A marker of a tensor its own node saves (a softmax's output) is a cycle through autograd's C++ graph
        that the garbage collector cannot see; left alone it would keep the failed step's memory."""
        for ref in self.outside_refs:
            marker = ref()
            if marker is not None:
                marker.t = None
        self.outside_refs.clear()

    # -- marks
    def _mark(self, label: Any) -> int:
        if self.deaths:
            self._settle_deaths()
        self.mark(label)
        self.n_marks += 1
        pos = self.n_marks - 1
        if label[0] == "forward_end":
            self.forward_done = True
        if self.observe and self.forward_done:
            self._scan_release(pos)
        return pos

    # -- storage bookkeeping (observe mode)
    def _info(self, st: torch.UntypedStorage, producer: int) -> _SInfo:
        inf = self.infos.get(id(st))
        if inf is None or inf.weak() is not st:
            inf = _SInfo(st, producer)
            born = self.born.get(id(st)) if producer == -1 else None
            if born is not None and born[0]() is st:
                inf.made_pos = born[1]
            self.infos[id(st)] = inf
            self.all_infos.append(inf)
            if self.split is not None:
                self.finalizers.append(weakref.finalize(st, self._died, weakref.ref(inf), id(st)))
        return inf

    def _died(self, ref: weakref.ref, key: int) -> None:
        inf = ref()
        if inf is None or self.split is None or self.n_marks == 0:
            return
        self.parts.append(self.split(key))
        self.deaths.append((inf, len(self.parts)))

    def _settle_deaths(self) -> None:
        """At the end of a segment in which observed storages died: what each adds to the segment's peak if a plan
        holds it past the segment. Storage ``i`` (in order of death, ``b_i`` bytes, ``A_i`` the peak after its death,
        ``P`` the segment's) adds ``max(0, b_i - (S_i - S_{i-1}))`` with ``S_i = P - A_i`` (``S_0 = 0``): the room
        below the peak after it, less what earlier deaths' shares used up: exact for the first (or only) one, never
        short for any set held together, possibly over for a later one held alone."""
        self.parts.append(self.split(None))
        top = max(self.parts)
        room_before = 0
        for inf, after in self.deaths:
            room = top - max(self.parts[after:])
            inf.death_seg = self.n_marks - 1
            inf.late = max(0, inf.nbytes - (room - room_before))
            room_before = room
        self.deaths.clear()
        self.parts.clear()

    def stop_watching(self) -> None:
        """Deaths after the step (the run's last segment is over) tell nothing: stop following them."""
        self.split = None
        for f in self.finalizers:
            f.detach()
        self.finalizers.clear()
        self.deaths.clear()
        self.parts.clear()

    def _producer_of(self, st: torch.UntypedStorage) -> int:
        entry = self.produced.get(id(st))
        if entry is not None and entry[0]() is st:
            return entry[1]
        return -1

    def _scan(self, pos: int) -> None:
        for inf in self.all_infos:
            if inf.free_pos is not None:
                continue
            st = inf.weak()  # holding the Python storage object adds exactly one reference
            if st is None or use_count(st) <= 1:
                inf.free_pos = pos

    def _scan_release(self, pos: int) -> None:
        # after the forward: when what was still referenced at its end (a model output, a KV cache) is let go of
        for inf in self.all_infos:
            if inf.free_pos is not None or inf.release_pos is not None:
                continue
            st = inf.weak()
            if st is None or use_count(st) <= 1:
                inf.release_pos = pos

    def _outside_pack(self, t: torch.Tensor) -> Any:
        if is_plain(t):
            st = t.untyped_storage()
            if st.data_ptr() not in self.param_ptrs and st.nbytes() > 0:
                inf = self._info(st, self._producer_of(st))
                inf.outside = True
                # a direct reference (like autograd's own), plus a marker that tells when that code's backward is done
                marker = _OutsideRef(t)
                weakref.finalize(marker, self._outside_released, inf)
                self.outside_refs.append(weakref.ref(marker))
                return marker
        return t

    def _outside_released(self, inf: _SInfo) -> None:
        inf.outside_release = max(inf.outside_release or 0, self.n_marks - 1)

    def outer_hooks(self) -> Any:
        if not self.observe:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._outside_pack, _unpack))
        stack.enter_context(_Births(self))
        return stack

    # -- backward marks: one hook per tensor, "end" events before "start" events
    def _tensor_event(self, t: torch.Tensor, kind: str, unit: int) -> None:
        key = id(t)
        entry = self.hook_events.get(key)
        if entry is not None and entry[1] is not None and entry[1]() is t:
            entry[0].append((kind, unit))
            return
        events: list[tuple[str, int]] = [(kind, unit)]
        self.hook_events[key] = (events, weakref.ref(t))

        def hook(grad: torch.Tensor) -> None:
            for k, u in sorted(events, key=lambda e: (e[0] != "end", -e[1])):
                if k == "end":
                    left = self.pending_inputs.get(u, 0) - 1
                    self.pending_inputs[u] = left
                    if left == 0:
                        self._mark(("bwd_end", u))
                elif u not in self.bwd_started:
                    self.bwd_started.add(u)
                    self._mark(("bwd_start", u))

        t.register_hook(hook)

    # -- unit wrappers
    def install(self) -> None:
        for index, module in enumerate(self.modules):
            self._install(module, lambda inner, i=index, m=module: self._wrapper(i, m, inner))
        for name in self.blocks:
            module = self.model.get_submodule(name)
            self._install(module, lambda inner, b=name, m=module: self._block_wrapper(b, m, inner))

    def _install(self, module: nn.Module, wrap: Callable[[Callable], Callable]) -> None:
        """Replace ``module.forward`` by ``wrap(its forward)``; :meth:`remove` puts it back."""
        previous = module.__dict__.get("forward")
        inner = previous or type(module).forward.__get__(module, type(module))
        module.forward = wrap(inner)
        self._installed.append((module, previous))

    def remove(self) -> None:
        for module, previous in reversed(self._installed):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._installed.clear()

    def _block_wrapper(self, name: str, module: nn.Module, inner: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.block_io[name] = ([list(t.shape) for t in leaves], unique_bytes(leaves))
            return checkpointed(module, inner, args, kwargs)

        return forward

    def _wrapper(self, index: int, module: nn.Module, inner: Callable) -> Callable:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.blocks and self.forward_done:  # a block's recomputation in backward
                return inner(*args, **kwargs)
            pos = self._mark(("fwd_start", index))
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            grad_inputs = {id(t): t for t in leaves if t.requires_grad}
            self.pending_inputs[index] = len(grad_inputs)
            for t in grad_inputs.values():
                self._tensor_event(t, "end", index)
            in_ptrs = set()
            # a recomputed unit keeps the tensors of a cache passed in (its copy of the cache before the forward)
            held = [t for a in [*args, *kwargs.values()] if is_cache(a) for t in cache_tensors(a)]
            for t in [*leaves, *held]:
                if t.layout == torch.strided and not t.is_meta:
                    st = t.untyped_storage()
                    in_ptrs.add(id(st))
                    if self.observe and st.data_ptr() not in self.param_ptrs and st.nbytes() > 0:
                        self._info(st, self._producer_of(st)).consumers.add(index)
            if self.observe:
                self._scan(pos)
            if self.recompute:
                out = checkpointed(module, inner, args, kwargs, save_ops=self.save_ops.get(index))
            elif self.observe:
                ptrs = self.param_ptrs

                def pack(t: torch.Tensor) -> Any:
                    if not is_plain(t):
                        return t
                    st = t.untyped_storage()
                    if st.data_ptr() in ptrs or st.nbytes() == 0:
                        return t
                    inf = self._info(st, self._producer_of(st) if id(st) in in_ptrs else index)
                    inf.savers.add(index)
                    return _Handle(st, t)

                with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                    out = inner(*args, **kwargs)
            else:
                out = inner(*args, **kwargs)
            pos = self._mark(("fwd_end", index))
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            for t in outs:
                if t.layout == torch.strided and not t.is_meta:
                    st = t.untyped_storage()
                    if id(st) not in in_ptrs:
                        self.produced[id(st)] = (weakref.ref(st), index)
                if t.requires_grad:
                    self._tensor_event(t, "start", index)
            if self.observe:
                self._scan(pos)
                self.unit_io[index] = (
                    [list(t.shape) for t in leaves],
                    [list(t.shape) for t in outs],
                    unique_bytes(leaves),
                    unique_bytes(outs),
                )
            return out

        return forward


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t.layout != torch.strided or t.is_meta:
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def tracked_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any, names: list[str],
                  device: torch.device, *, observe: bool, recompute: bool,
                  kwargs: Mapping[str, Any] | None = None,
                  save_ops: Mapping[int, Any] | None = None, blocks: Sequence[str] = ()) -> tuple[list, _Run, int]:
    """One training step with marks at the units' boundaries: ``(label, level, peak)`` per mark, the run's records
    and the step's peak. ``observe``: follow every saved storage (the groups); ``recompute``: every unit
    checkpointed; ``blocks``: these modules (each holding units) checkpointed as wholes instead."""
    meter = meter_for(device)
    meter.track(model, optimizer, list(inputs), kwargs, [t for _, t in output_tensors(kept_outputs())])
    meter.reset_peak()
    run = _Run(model, names, meter.mark, observe=observe, recompute=recompute, save_ops=save_ops,
               split=meter.split if observe else None, blocks=blocks)
    run.install()
    handles = _watch_grads_done(run.modules, lambda u: run.grads_done.setdefault(u, int(meter.current)))
    try:
        with meter:
            run._mark(("step_start", -1))
            with run.outer_hooks():
                training_step(model, inputs, loss_fn, optimizer, mark=lambda label: run._mark((label, -1)),
                              kwargs=kwargs)
            run.stop_watching()
    except BaseException:
        run.release()
        raise
    finally:
        for h in handles:
            h.remove()
        run.stop_watching()
        run.remove()
    return meter.marks, run, int(meter.peak)


def _watch_grads_done(modules: list[nn.Module], done: Callable[[int], None]) -> list[Any]:
    """Call ``done(u)`` when backward has accumulated the gradient of every trainable parameter of unit ``u`` (the
    moment the runtime steps a unit in backward)."""
    handles = []
    for u, mod in enumerate(modules):
        params = [p for p in mod.parameters() if p.requires_grad]
        seen: set[int] = set()

        def hook(p: nn.Parameter, u: int = u, seen: set[int] = seen, want: int = len(params)) -> None:
            seen.add(id(p))
            if len(seen) == want:
                done(u)

        handles += [p.register_post_accumulate_grad_hook(hook) for p in params]
    return handles


class _Clock:
    """The profile's clock. On CUDA: events on the current stream. On the CPU: the CPU time of the thread that runs
    the step (``time.thread_time``), which is what a stretch of the step costs while it has a core — the time other
    programs on a busy machine take is wall time the thread does not run (:mod:`memopt_nb.profiling.timing`); the wall
    time is kept beside it. Elsewhere: wall time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[Any] = []
        self.walls: list[float] = []

    def mark(self, label: Any) -> None:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.stamps.append((label, ev))
            return
        self.walls.append(time.perf_counter())
        self.stamps.append((label, time.thread_time() if self.device.type == "cpu" else self.walls[-1]))

    def durations(self) -> list[float]:
        if self.device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
            evs = [e for _, e in self.stamps]
            return [evs[i].elapsed_time(evs[i + 1]) / 1e3 for i in range(len(evs) - 1)]
        return _diffs([t for _, t in self.stamps])

    def wall_durations(self) -> list[float]:
        """Wall seconds between the marks (on CUDA: the device's, as :meth:`durations`)."""
        return _diffs(self.walls) if self.walls else self.durations()


def _diffs(ts: list[float]) -> list[float]:
    return [ts[i + 1] - ts[i] for i in range(len(ts) - 1)]


def timed_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any, names: list[str],
                device: torch.device, kwargs: Mapping[str, Any] | None = None, *, recompute: bool = False,
                save_ops: Mapping[int, Any] | None = None,
                wall: list[float] | None = None) -> tuple[list[Any], list[float]]:
    """One training step timed at the units' boundaries with the profile's clock (:class:`_Clock`): the marks' labels
    and the seconds between them; ``wall`` (a list), if given, gets the wall seconds between them too."""
    clock = _Clock(device)
    run = _Run(model, names, clock.mark, observe=False, recompute=recompute, save_ops=save_ops)
    run.install()
    try:
        if device.type == "cuda":  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(device)
        run._mark(("step_start", -1))
        training_step(model, inputs, loss_fn, optimizer, mark=lambda label: run._mark((label, -1)), kwargs=kwargs)
    finally:
        run.remove()
    if wall is not None:
        wall.extend(clock.wall_durations())
    return [lab for lab, _ in clock.stamps], clock.durations()


# ====================================================================== building the profile
def segments_from(marks: list[tuple[Any, int, int]], n_units: int) -> tuple[list[Segment], dict, dict]:
    segs: list[Segment] = []
    fwd_seg, bwd_seg = {}, {}
    for i in range(len(marks) - 1):
        (label, level, _), (nlabel, _, peak) = marks[i], marks[i + 1]
        kind, unit = label
        if kind == "fwd_start" and nlabel == ("fwd_end", unit):
            seg = Segment("fwd", unit, f"fwd {unit}", 0.0, level, max(0, peak - level))
            fwd_seg[unit] = len(segs)
        elif kind == "bwd_start":
            seg = Segment("bwd", unit, f"bwd {unit}", 0.0, level, max(0, peak - level))
            bwd_seg[unit] = len(segs)
        else:
            seg = Segment("other", -1, f"to {nlabel[0]}" + (f" {nlabel[1]}" if nlabel[1] >= 0 else ""), 0.0, level,
                          max(0, peak - level))
        segs.append(seg)
    missing = [u for u in range(n_units) if u not in fwd_seg or u not in bwd_seg]
    if missing:
        raise ProfileError(f"units {missing} did not run a forward and a backward exactly once in the step")
    return segs, fwd_seg, bwd_seg



def unit_state_bytes(model: nn.Module, optimizer: Any, unit_params: list[list[nn.Parameter]],
                      unit_modules: list[nn.Module]) -> list[dict[str, Any]]:
    """Per unit: gradient and movable optimizer-state bytes and storage counts, and whether its parameters can move."""
    in_opt = set()
    if optimizer is not None:
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
    owners: dict[int, set[int]] = collections.defaultdict(set)
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                owners[id(p)].add(id(m))
    out = []
    for ps, mod in zip(unit_params, unit_modules, strict=True):
        inside = {id(m) for m in mod.modules()}
        grads = [p for p in ps if p.requires_grad and id(p) in in_opt]
        state = [v for p in grads for v in _movable_state(optimizer, p)]
        offloadable = bool(ps) and all(movable(p) and owners[id(p)] <= inside for p in ps)
        out.append({
            "grad_bytes": sum(p.nbytes for p in grads), "grad_storages": len(grads),
            "optimizer_bytes": sum(v.untyped_storage().nbytes() for v in state), "optimizer_storages": len(state),
            "param_storages": len(ps), "params_offloadable": offloadable,
        })
    return out


def _movable_state(optimizer: Any, p: nn.Parameter) -> list[torch.Tensor]:
    """The optimizer-state tensors of ``p`` a placement moves: at least one dimension, on ``p``'s device (a 0-dim
    ``step`` count stays)."""
    return [v for v in optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.device == p.device]


class _ChunkedOptimizer:
    """Stands in for the optimizer in a training step: steps the parameters outside units, then each unit's, apart
    (as :class:`~memopt_nb.runtime.state.StateManager` does), marking before and after each part."""

    def __init__(self, optimizer: Any, chunks: list[list[nn.Parameter]], mark: Callable[[Any], None]) -> None:
        self.optimizer, self.chunks, self.mark = optimizer, chunks, mark

    def step(self) -> None:
        opt = self.optimizer
        fn = type(opt).step
        raw = fn.__wrapped__ if getattr(fn, "hooked", False) else fn
        groups = opt.param_groups
        saved = [g["params"] for g in groups]
        try:
            for i, chunk in enumerate(self.chunks):
                ids = {id(p) for p in chunk}
                self.mark(("chunk_start", i))
                if chunk:
                    for g, ps in zip(groups, saved, strict=True):
                        g["params"] = [p for p in ps if id(p) in ids]
                    raw(opt)
                self.mark(("chunk_end", i))
        finally:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = ps

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def chunked_step(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any,
                  unit_params: list[list[nn.Parameter]], device: torch.device,
                  kwargs: Mapping[str, Any] | None) -> tuple[list[float], list[int], float]:
    """The unit-by-unit optimizer step: per chunk (outside units first) seconds and peak above its start level, and
    the whole step's seconds."""
    mine = {id(p) for ps in unit_params for p in ps}
    in_units = [[p for p in ps if p.requires_grad] for ps in unit_params]
    outside = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in mine]
    chunks = [outside, *in_units]
    meter = meter_for(device)
    meter.track(model, optimizer, list(inputs), kwargs)
    with meter:
        training_step(model, inputs, loss_fn, _ChunkedOptimizer(optimizer, chunks, meter.mark), kwargs=kwargs)
    rel = [0] * len(chunks)
    for (label, level, _), (nlabel, _, peak) in zip(meter.marks, meter.marks[1:]):
        if label[0] == "chunk_start" and nlabel == ("chunk_end", label[1]):
            rel[label[1]] = max(0, peak - level)
    clock = _Clock(device)
    training_step(model, inputs, loss_fn, _ChunkedOptimizer(optimizer, chunks, clock.mark), kwargs=kwargs)
    d = clock.durations()
    times = [d[2 * i] for i in range(len(chunks))]
    return times, rel, float(sum(d))


def param_steps(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any,
                unit_params: list[list[nn.Parameter]], device: torch.device,
                kwargs: Mapping[str, Any] | None) -> list[list[dict[str, Any]]]:
    """Per unit, per parameter the optimizer steps (``param_groups`` order): the step of that parameter alone, as
    ``optimizer="stream"`` runs it (:attr:`~memopt_nb.core.profile.UnitProfile.param_steps`)."""
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    per_unit = [sorted((p for p in ps if p.requires_grad and id(p) in order), key=lambda p: order[id(p)])
                for ps in unit_params]
    flat = [[p] for ps in per_unit for p in ps]
    times, rel, _ = chunked_step(model, inputs, loss_fn, optimizer, flat, device, kwargs)
    out, i = [], 1  # chunk 0: everything outside these chunks
    for ps in per_unit:
        rows = []
        for p in ps:
            state = _movable_state(optimizer, p)
            rows.append({"optimizer_bytes": sum(v.untyped_storage().nbytes() for v in state),
                         "optimizer_storages": len(state), "grad_bytes": p.nbytes, "step_time": times[i],
                         "step_rel_peak": rel[i], "order": order[id(p)]})
            i += 1
        out.append(rows)
    return out


def static_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    opt = 0
    if optimizer is not None:
        seen = set()
        for state in optimizer.state.values():
            for v in tree_leaves(state):
                if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    opt += v.numel() * v.element_size()
    return {"params": params, "params_trainable": trainable, "buffers": buffers, "optimizer": opt}


def groups_from(run: _Run) -> list[StorageGroup]:
    agg: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for inf in run.all_infos:
        if not inf.savers and not inf.consumers:
            continue
        key = (inf.producer, tuple(sorted(inf.savers)), tuple(sorted(inf.consumers)), inf.outside, inf.free_pos,
               inf.outside_release, inf.release_pos, inf.death_seg if inf.late else None, inf.made_pos)
        agg[key][0] += inf.nbytes
        agg[key][1] += 1
        agg[key][2] += inf.late
    out = [StorageGroup(nbytes=v[0], count=v[1], producer=k[0], savers=k[1], consumers=k[2], outside_saver=k[3],
                        free_pos=k[4], outside_release=k[5], release_pos=k[6], death_seg=k[7], late_bytes=v[2],
                        made_pos=k[8])
           for k, v in agg.items()]
    out.sort(key=lambda g: (g.savers[-1] if g.savers else max(g.consumers), g.producer, g.free_pos or 0))
    return out
