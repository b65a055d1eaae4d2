"""Recompute (activation checkpointing) of one unit, built on non-reentrant ``torch.utils.checkpoint``.

A recomputed forward must see what the first forward saw and leave everything as the first forward left it. Plain
checkpointing gets several things wrong; here:

* RNG: ``preserve_rng_state=True`` replays the same dropout masks in the recomputation.
* Buffers a forward changes (BatchNorm running statistics, spectral norm's power-iteration vectors ``u``/``v``, any
  buffer updated in place or reassigned): the first forward's starting values are kept, the recomputation runs on
  throw-away copies of them, and afterwards every buffer is put back as the first forward left it. So buffers are
  updated exactly once per forward and the recomputation computes exactly what the first forward computed.
* Plain attributes a forward sets on its modules (``self.weight = ...`` in the old ``spectral_norm`` hook,
  ``self.calls += 1``): the recomputation starts from the first forward's values and they are put back after.
* Hugging Face caches (``transformers.Cache``, e.g. the ``DynamicCache`` a decoder returns with ``use_cache=True``):
  the recomputation appends to a throw-away copy of the cache as it was before the first forward, so the returned
  cache is not extended twice.
* Other objects passed in and changed by the forward (a list appended to, an object's attribute set) cannot be put
  back exactly: the first forward raises :class:`~memopt_nb.core.errors.PlanError` naming the unit and the argument.
* The unit's own keyword arguments go to the unit, never to ``torch.utils.checkpoint`` (whose options ``debug``,
  ``use_reentrant``, ``context_fn``… would otherwise swallow them).
* ``selective`` units keep the outputs of their save-set's op calls with two lean dispatch modes
  (:func:`caching_modes`, torch's selective-checkpointing rules at a fraction of its per-op cost), and a unit whose
  backward needs only tensors it holds anyway is not run again at all (:class:`_DirectSaves`).
"""

from __future__ import annotations

import collections
import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..core.errors import PlanError
from .storages import is_plain

__all__ = ["ForwardEffects", "ReplayGuard", "argument_changes", "cache_tensors", "caching_modes", "checkpointed",
           "checkpointed_call", "forward_side_effects", "is_cache", "running_stat_modules", "save_policy",
           "sac_counts_op"]

def running_stat_modules(module: nn.Module) -> list[nn.Module]:
    """Submodules whose training-mode forward updates running statistics (BatchNorm and friends)."""
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.running_mean is not None
    ]


# ====================================================================== caches and other arguments
def is_cache(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face ``transformers`` cache (``DynamicCache``, ``EncoderDecoderCache`` …)."""
    mod = sys.modules.get("transformers.cache_utils")
    cls = getattr(mod, "Cache", None) if mod is not None else None
    return cls is not None and isinstance(obj, cls)


def _plain_object(obj: Any) -> bool:
    return (hasattr(obj, "__dict__") and not isinstance(obj, (type, nn.Module, torch.Tensor))
            and not callable(obj) and type(obj).__module__ != "builtins")


def _copy_state(obj: Any, depth: int) -> Any:
    """A copy of ``obj``'s Python structure (containers, plain objects); tensors are shared, not copied."""
    if depth <= 0 or isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, list):
        return [_copy_state(v, depth - 1) for v in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_copy_state(v, depth - 1) for v in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _copy_state(v, depth - 1) for k, v in obj.items()}
    if _plain_object(obj):
        new = copy.copy(obj)
        for k, v in vars(obj).items():
            new.__dict__[k] = _copy_state(v, depth - 1)
        return new
    return obj


def _tensor_versions(obj: Any, depth: int, out: list[tuple[torch.Tensor, int]]) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((obj, obj._version))
    elif depth <= 0:
        return
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _tensor_versions(v, depth - 1, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _tensor_versions(v, depth - 1, out)
    elif _plain_object(obj):
        for v in vars(obj).values():
            _tensor_versions(v, depth - 1, out)


#: how deep a cache's Python structure is copied (cache -> its dict -> list of layers -> layer -> tensors)
_CACHE_DEPTH = 4


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a cache refers to now: what a recomputed unit's copy of it (its state before the first forward)
    keeps alive until the unit's backward."""
    found: list[tuple[torch.Tensor, int]] = []
    _tensor_versions(cache, _CACHE_DEPTH, found)
    return [t for t, _ in found]


class _CacheKey:
    """Stands in a recomputed unit's arguments for a cache after the first forward, so the live cache (which later
    units extend) is not kept alive by the recomputation; :meth:`ReplayGuard.again` puts the replay copy there."""

    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key


def _without_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    swap = lambda a: _CacheKey(id(a)) if is_cache(a) else a  # noqa: E731
    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


class _CacheSnapshot:
    """A Hugging Face cache as it was before a unit's first forward, for the recomputation to append to instead."""

    def __init__(self, cache: Any) -> None:
        self.state = _copy_state(cache, _CACHE_DEPTH)
        self.versions: list[tuple[torch.Tensor, int]] = []
        _tensor_versions(self.state, _CACHE_DEPTH, self.versions)

    def replay_copy(self, unit: str) -> Any:
        changed = [t for t, v in self.versions if t._version != v]
        if changed:
            raise PlanError(
                f"unit {unit!r} updates a cache ({type(self.state).__name__}) in place, so its recomputation cannot "
                "start from the cache as the first forward saw it; keep or swap this unit, or call the model with "
                "use_cache=False while training")
        return _copy_state(self.state, _CACHE_DEPTH)


def _shallow_signature(obj: Any) -> Any:
    """What identifies the state of a non-tensor argument one level deep (identity of items, tensor versions)."""

    def ident(v: Any) -> Any:
        return (id(v), v._version) if isinstance(v, torch.Tensor) else id(v)

    if isinstance(obj, list):
        return ("list", tuple(ident(v) for v in obj))
    if isinstance(obj, dict) and type(obj) is dict:
        return ("dict", tuple((k, ident(v)) for k, v in obj.items()))
    if isinstance(obj, set):
        return ("set", frozenset(id(v) for v in obj))
    if _plain_object(obj):
        return ("object", tuple((k, ident(v)) for k, v in vars(obj).items()))
    return None


def _arguments(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    out = [(f"argument {i}", a) for i, a in enumerate(args)]
    out += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    return out


def argument_changes(args: tuple, kwargs: dict) -> Callable[[], list[str]]:
    """Record the non-tensor arguments of a call (caches aside); the returned function lists those changed since."""
    before = []
    for label, a in _arguments(args, kwargs):
        if a is None or isinstance(a, (torch.Tensor, str, int, float, bool, bytes)) or is_cache(a):
            continue
        sig = _shallow_signature(a)
        if sig is not None:
            before.append((label, a, sig))

    def changed() -> list[str]:
        return [f"{label} ({type(a).__name__})" for label, a, sig in before if _shallow_signature(a) != sig]

    return changed


# ====================================================================== module state
def _tensor_attrs(m: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in m.__dict__.items() if not k.startswith("_") and k != "training"}


class _UnitState:
    """One forward's view of a unit's buffers and plain attributes: what they were before it, and after it."""

    __slots__ = ("before_bufs", "copies", "versions", "before_attrs", "after_bufs", "after_attrs")

    def __init__(self, modules: list[nn.Module], copy_names: set[tuple[int, str]] | None) -> None:
        self.before_bufs = [dict(m._buffers) for m in modules]
        self.versions = [{k: b._version for k, b in d.items() if b is not None} for d in self.before_bufs]
        self.copies: dict[tuple[int, str], torch.Tensor] = {}
        for i, d in enumerate(self.before_bufs):
            for k, b in d.items():
                if b is not None and (copy_names is None or (i, k) in copy_names):
                    self.copies[(i, k)] = b.detach().clone()
        self.before_attrs = [_tensor_attrs(m) for m in modules]
        self.after_bufs: list[dict[str, Any]] = []
        self.after_attrs: list[dict[str, Any]] = []


class ReplayGuard:
    """What a unit's recomputation needs so it replays its first forward exactly; one per unit, reused every step.

    Args:
        module: the unit.
        name: its name, for error messages.
        strict: raise :class:`PlanError` when the first forward changes something a recomputation cannot undo (an
            argument); the profiler's measuring run passes ``False``.
    """

    def __init__(self, module: nn.Module, name: str = "", strict: bool = True) -> None:
        self.module = module
        self.name = name or type(module).__name__
        self.strict = strict
        self.modules = list(module.modules())
        # buffers (module index, name) seen changing in forward; BatchNorm's kernels update running statistics
        # without moving their version counters, so those are listed up front
        stat_modules = set(running_stat_modules(module))
        #: running statistics do not enter a training-mode forward's output: the recomputation updates throw-away
        #: copies of them made when it runs, and no starting value is kept from the first forward
        self.stats: set[tuple[int, str]] = {(i, k) for i, m in enumerate(self.modules) if m in stat_modules
                                            for k, b in m._buffers.items() if b is not None}
        self.changed: set[tuple[int, str]] = set(self.stats)
        self._seen = False

    def _copy_names(self) -> set[tuple[int, str]] | None:
        # the first forward keeps every buffer's starting value, to find out by value which ones it changes; later
        # forwards keep only those (a copy of an unchanged buffer would be device memory no plan accounts for)
        return None if not self._seen else self.changed - self.stats

    def first(self, forward: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """Run the first forward; returns its output and what :meth:`again` needs."""
        state = _UnitState(self.modules, self._copy_names())
        caches = {}
        for _label, a in _arguments(args, kwargs):
            if is_cache(a) and id(a) not in caches:
                caches[id(a)] = _CacheSnapshot(a)
        changed_args = argument_changes(args, kwargs)
        out = forward(*args, **kwargs)
        first_call = not self._seen
        self._seen = True
        lost = []
        for i, m in enumerate(self.modules):
            bufs = m._buffers
            state.after_bufs.append(dict(bufs))
            state.after_attrs.append(_tensor_attrs(m))
            for k, b in bufs.items():
                was = state.before_bufs[i].get(k)
                key = (i, k)
                if key in self.changed:
                    continue
                moved = b is not was or (b is not None and b._version != state.versions[i].get(k))
                if not moved and first_call and b is not None and key in state.copies:
                    with torch.no_grad():  # changes made by a kernel that does not move the version counter
                        moved = not torch.equal(state.copies[key], b)
                if moved:
                    self.changed.add(key)
                    if b is was and key not in state.copies:
                        lost.append(k)
        mutated = changed_args()
        if mutated and self.strict:
            raise PlanError(
                f"unit {self.name!r} changed {', '.join(mutated)} in its forward; recomputing it would change it "
                "a second time, and memopt cannot undo that. Keep or swap this unit (its profile marks it not "
                "recomputable), or pass the object some other way")
        if lost and self.strict:
            raise PlanError(
                f"unit {self.name!r} changed buffer(s) {', '.join(lost)} in its forward for the first time after "
                "its first step, so their starting values were not kept for the recomputation; profile the model "
                "again in the mode you train it in, or keep or swap this unit")
        for i in range(len(self.modules)):  # keep only what differs: nothing to restore is the common case
            state.after_attrs[i] = {k: v for k, v in state.after_attrs[i].items()
                                    if state.before_attrs[i].get(k, _MISSING) is not v}
        state.copies = {key: t for key, t in state.copies.items() if key in self.changed and key not in self.stats}
        return out, (state, caches)

    def again(self, forward: Callable[..., Any], args: tuple, kwargs: dict, memo: Any) -> Any:
        """Run the recomputation from the first forward's starting state, then put back the state it left."""
        state, caches = memo
        if caches:
            replays = {key: snap.replay_copy(self.name) for key, snap in caches.items()}

            def replay(a: Any) -> Any:  # the live cache, or what stands for it once the first forward is done
                if isinstance(a, _CacheKey):
                    return replays[a.key]
                return replays.get(id(a), a) if is_cache(a) else a

            args = tuple(replay(a) for a in args)
            kwargs = {k: replay(v) for k, v in kwargs.items()}
        for i, m in enumerate(self.modules):
            before = state.before_bufs[i]
            for k in list(m._buffers):
                if (i, k) in state.copies:
                    m._buffers[k] = state.copies[(i, k)].clone()  # the recomputation may change it again
                elif (i, k) in self.stats and m._buffers[k] is not None:
                    m._buffers[k] = m._buffers[k].clone()  # updated by the recomputation, then thrown away
                elif k in before:
                    m._buffers[k] = before[k]
            for k in state.after_attrs[i]:
                if k in state.before_attrs[i]:
                    m.__dict__[k] = state.before_attrs[i][k]
                else:
                    m.__dict__.pop(k, None)
        try:
            return forward(*args, **kwargs)
        finally:
            for i, m in enumerate(self.modules):
                m._buffers.clear()
                m._buffers.update(state.after_bufs[i])
                for k, v in state.after_attrs[i].items():
                    m.__dict__[k] = v


_MISSING = object()


def checkpointed_call(guard: ReplayGuard | nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``forward(*args, **kwargs)`` under non-reentrant checkpointing, its recomputation replaying it exactly.

    ``guard`` is the unit's :class:`ReplayGuard` (made once beforehand, as a plan does) or the unit itself (then
    nothing is refused: what the profiler uses to measure). ``args`` and ``kwargs`` all go to ``forward``; none of
    them is read by ``torch.utils.checkpoint``.
    """
    return checkpointed(guard, forward, args, kwargs)


class _Held:
    """An input a ``recompute_offload`` unit's checkpoint keeps as a swap-engine handle, not as the tensor."""

    __slots__ = ("handle", "requires_grad")

    def __init__(self, handle: Any, requires_grad: bool) -> None:
        self.handle, self.requires_grad = handle, requires_grad


def _fetched(fetch: Callable[[Any], torch.Tensor], held: _Held) -> torch.Tensor:
    if isinstance(held.handle, torch.Tensor):  # kept as it was (a parameter, an unmanaged tensor)
        return held.handle
    t = fetch(held.handle)  # a new tensor on the storage brought back
    return t.requires_grad_() if held.requires_grad else t


def sac_counts_op(func: Any) -> bool:
    """Whether selective checkpointing counts calls of ``func`` (it skips a few bookkeeping ops such as ``detach``):
    the call indices of a save-set are counted the same way."""
    return func not in SAC_IGNORED_OPS


# ====================================================================== selective checkpointing's caching modes
_UNSEEN = object()
#: what a kept call's entry becomes once the recomputation has taken it (the reference is dropped there)
_TAKEN = object()
#: what :meth:`_Kept.take` returns for an output changed in place after its forward
_CHANGED = object()


class _SaveSet:
    """A save-set's op calls, looked up by op: ``indices(func)`` is the set of call indices of ``func`` to keep, or
    ``None`` when no call of it is kept (then it is neither counted nor looked at again: the common, cheap case).

    One per save-set, shared by every forward of its unit: the op-to-indices table fills as ops are first seen."""

    __slots__ = ("wanted", "by_op")

    def __init__(self, save_ops: Any) -> None:
        wanted: dict[str, set[int]] = {}
        for op, i in save_ops:
            wanted.setdefault(str(op), set()).add(int(i))
        self.wanted = {k: frozenset(v) for k, v in wanted.items()}
        self.by_op: dict[Any, frozenset[int] | None] = {}

    def indices(self, func: Any) -> frozenset[int] | None:
        found = self.by_op.get(func, _UNSEEN)
        if found is _UNSEEN:
            # ops torch's selective checkpointing ignores (``detach``, metadata queries) are never counted, as
            # ``record_ops`` does not count them either
            found = self.by_op[func] = None if func in SAC_IGNORED_OPS else self.wanted.get(str(func))
        return found  # type: ignore[return-value]


def _detach(x: Any) -> Any:
    """Detach a kept output as torch's selective checkpointing does: a view made beneath autograd keeps its version
    counter shared with its base (so a later in-place change is seen), and the kept tensor has no autograd history
    (so the recomputation's autograd can make it a view again, and no reference cycle forms)."""
    if isinstance(x, torch.Tensor):
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            return x.detach()
    return x


class _Kept:
    """One kept op output (a tensor, or a tuple or list of them), detached, with the version counters it had."""

    __slots__ = ("value", "versions")

    def __init__(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self.value = _detach(out)
            self.versions = out._version
        else:
            self.value = tree_map(_detach, out)
            self.versions = [v._version if isinstance(v, torch.Tensor) else None for v in tree_leaves(self.value)]

    def take(self) -> Any:
        """The kept output, or :data:`_CHANGED` where it was changed in place since (its call must then run again)."""
        value = self.value
        if isinstance(value, torch.Tensor):
            changed = value._version != self.versions
        else:
            changed = any(v is not None and t._version != v for t, v in zip(tree_leaves(value), self.versions))
        return _CHANGED if changed else value


def _code_skipper() -> Callable[[Any], None] | None:
    try:
        from torch._C._dynamo.eval_frame import _FrameAction as FrameAction
        from torch._C._dynamo.eval_frame import _FrameExecStrategy as FrameExecStrategy
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
    except Exception:  # noqa: BLE001 - a torch without these: keep TorchDispatchMode's own wrapper
        return None
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # this frame and every frame it calls
    return lambda code: set_code_exec_strategy(code, strategy)


_SKIP_CODE = _code_skipper()
_DYNAMO_SKIPS_CODE = _SKIP_CODE is not None


class _LeanMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` runs as is, without the ``torch._dynamo.disable`` wrapper
    ``TorchDispatchMode`` puts around every subclass's: that wrapper switches the frame evaluator twice per op, which
    costs ~15x the op itself on small CPU ops (~60 µs against ~4 µs per call measured here). Dynamo is kept out of
    the subclasses' ``__torch_dispatch__`` all the same, once per code object (:func:`_keep_dynamo_out`): those
    frames and everything they call are skipped, as the wrapper would."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _DYNAMO_SKIPS_CODE

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _keep_dynamo_out(cls: type) -> type:
    if _SKIP_CODE is not None:
        _SKIP_CODE(cls.__dict__["__torch_dispatch__"].__code__)
    return cls


@_keep_dynamo_out
class _KeepCalls(_LeanMode):
    """Around a selective unit's first forward: counts the calls of each op of the save-set and keeps (detached) the
    outputs of the listed calls in ``storage``; every other op runs untouched, at the cost of one lookup.

    What torch's ``create_selective_checkpoint_contexts`` caching mode does for a policy that saves exactly these
    calls (same counting, same detach, same lifetime of what is kept), without its per-op policy call, context
    object, compile checks and storage-key computation, which cost several times the lookup here."""

    def __init__(self, save_set: _SaveSet, storage: dict[tuple[Any, int], Any]) -> None:
        super().__init__()
        self.save_set, self.storage = save_set, storage
        self.by_op = save_set.by_op
        self.counts: dict[Any, int] = {}
        #: while a :class:`_DirectSaves` watches the forward: the storages of the kept outputs (see there)
        self.direct: dict[int, torch.Tensor] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        wanted = self.by_op.get(func, _UNSEEN)
        if wanted is _UNSEEN:
            wanted = self.save_set.indices(func)
        out = func._op(*args, **(kwargs or {}))  # the OpOverload's C++ op, one Python frame less
        if wanted is not None:
            n = self.counts.get(func, 0)
            self.counts[func] = n + 1
            if n in wanted:
                kept = self.storage[(func, n)] = _Kept(out)
                if self.direct is not None:
                    value = kept.value
                    _hold_storages(self.direct, (value,) if isinstance(value, torch.Tensor) else tree_leaves(value))
        return out


@_keep_dynamo_out
class _ReplayCalls(_LeanMode):
    """Around a selective unit's recomputation: the listed calls return what :class:`_KeepCalls` kept (dropping the
    reference, so it lives on only where the recomputed autograd graph saves it), every other op runs again.

    A kept tensor changed in place since (a dropout mask scaled in place) is not handed back: its call runs again,
    which reaches the value the forward had there (torch's cached mode refuses such a tensor). Like torch it refuses a
    second backward through the same forward (its entries are taken); a listed call the forward never made is a
    mismatch between the two runs."""

    def __init__(self, save_set: _SaveSet, storage: dict[tuple[Any, int], Any]) -> None:
        super().__init__()
        self.save_set, self.storage = save_set, storage
        self.by_op = save_set.by_op
        self.counts: dict[Any, int] = {}

    def __enter__(self) -> _ReplayCalls:
        self.counts.clear()  # each recomputation counts from the start (a retained graph's second backward too)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        wanted = self.by_op.get(func, _UNSEEN)
        if wanted is _UNSEEN:
            wanted = self.save_set.indices(func)
        if wanted is None:
            return func._op(*args, **(kwargs or {}))
        n = self.counts.get(func, 0)
        self.counts[func] = n + 1
        if n not in wanted:
            return func._op(*args, **(kwargs or {}))
        entry = self.storage.get((func, n))
        if entry is None:
            raise RuntimeError(f"{func} call {n} is kept by a selective unit but its forward made no such call: the "
                               "recomputation differs from the forward (nondeterministic ops or global state that "
                               "changed between forward and backward)")
        if entry is _TAKEN:
            raise RuntimeError("Trying to backward an extra time. You are only allowed to backward once on any "
                               "region computed under selective activation checkpoint.")
        self.storage[(func, n)] = _TAKEN
        value = entry.take()
        if value is _CHANGED:  # changed in place after the forward (a dropout mask scaled in place, a ReLU_ on it):
            return func._op(*args, **(kwargs or {}))  # the replay reaches the same state, so the call runs again
        return value


def _storage_key(t: Any) -> int | None:
    """The identity of a plain tensor's storage while it lives (``None`` for other tensors and empty storages)."""
    if not is_plain(t, parameters=True):
        return None
    st = t.untyped_storage()
    return st._cdata if st.nbytes() else None


def _hold_storages(held: dict[int, torch.Tensor], tensors: Any) -> None:
    """Note the storages of ``tensors`` (an iterable; other items are skipped) in ``held``."""
    for t in tensors:
        key = _storage_key(t)
        if key is not None:
            held[key] = t


class _Saved:
    """What a selective unit's forward packs for one tensor autograd saves: checkpoint's own holder (the
    recomputation fills it) and, while the tensor is one the unit holds anyway, the tensor itself."""

    __slots__ = ("holder", "value", "version")

    def __init__(self, holder: Any) -> None:
        self.holder = holder
        self.value: torch.Tensor | None = None
        self.version = 0


class _DirectSaves:
    """Lets a selective unit skip its recomputation when it would recompute nothing that backward needs.

    Inside the unit's first forward (beneath checkpoint's saved-tensor hooks, so it sees every tensor autograd saves
    there first) each saved tensor is still handed to checkpoint's pack hook, and it is noted whether its storage is
    one the unit holds anyway: that of an output its save-set keeps, of one of its own parameters or buffers, or of one
    of its inputs (which the checkpoint keeps) — the tensor itself or a view or alias of it (``weight.t()`` of a
    linear layer, the ``_unsafe_view`` of a kept ``bmm``). When *every* saved tensor is such a tensor, backward gets
    them directly: checkpoint's holders are never unpacked, so the unit is never run again, and at its first unpack the
    kept outputs nothing saved are dropped (where the recomputation would have taken them). Otherwise nothing
    changes: the direct references are dropped when the forward ends and every unpack goes through checkpoint, which
    recomputes.

    The values are the tensors autograd saved, at the versions it saved them (what training without a plan uses; the
    recomputation, replaying the same ops from the same state, would produce the same values), so results are
    bit-identical; what is held and when is what the profiler measures, as it runs units through this same code. A
    tensor changed in place between the forward and its use in backward is refused, as autograd refuses it.
    """

    __slots__ = ("storage", "all_direct", "saved", "unpacked")

    def __init__(self, storage: dict[tuple[Any, int], Any]) -> None:
        self.storage = storage
        self.all_direct = True
        self.saved: list[_Saved] = []
        self.unpacked = False

    def run(self, caching: _KeepCalls, forward: Callable[..., Any], modules: list[nn.Module], args: tuple,
            kwargs: dict) -> Any:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if hooks is None:  # not under checkpoint's hooks (nothing is saved for backward)
            with caching:
                return forward(*args, **kwargs)
        ck_pack, ck_unpack = hooks
        held: dict[int, torch.Tensor] = {}  # storage -> a tensor on it, for every storage the unit holds anyway
        for m in modules:
            for group in (m._parameters, m._buffers):
                _hold_storages(held, group.values())
        _hold_storages(held, tree_leaves((args, kwargs)))
        saved = self.saved

        def pack(x: torch.Tensor) -> _Saved:
            s = _Saved(ck_pack(x))
            key = _storage_key(x)
            if key is None or key not in held:
                self.all_direct = False
                return s
            s.value = x.detach()  # detached: no reference cycle through x's grad_fn
            s.version = x._version
            saved.append(s)
            return s

        def unpack(s: _Saved) -> torch.Tensor:
            value = s.value
            if value is None:
                return ck_unpack(s.holder)
            if not self.unpacked:
                self.unpacked = True
                self.storage.clear()  # kept outputs nothing saved go now, as the recomputation would take them
            if value._version != s.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"[{value.type()} {list(value.shape)}] is at version {value._version}; expected version "
                    f"{s.version} instead (a tensor saved inside a selective unit of a memopt plan)")
            return value

        caching.direct = held
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), caching:
                out = forward(*args, **kwargs)
        finally:
            caching.direct = None
            held.clear()  # autograd may keep the pack hook (and so this dict) as long as it keeps what was saved
        if not self.all_direct:  # the recomputation runs: hold nothing beyond what it would
            for s in saved:
                s.value = None
        saved.clear()  # (the pack hook refers to this list too) each value is held by its saved variable alone
        return out


def caching_modes(save_ops: Any) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The two modes :func:`checkpointed` enters around a selective unit's first forward and its recomputation: the
    first keeps the outputs of the ``save_ops`` calls, the second hands them back instead of running those calls.

    ``save_ops``: ``(op name, call index)`` pairs, the index counted per op over the unit's forward
    (``("aten.mm.default", 1)`` is its second ``mm``), as :func:`memopt_nb.profiling.profile` lists them in a unit's
    ``save_sets``; every op not listed is recomputed in backward. What torch's selective checkpointing
    (``create_selective_checkpoint_contexts`` with a policy saving these calls, :func:`save_policy`) does, with the same
    results and memory, at a fraction of its per-op cost (see :class:`_KeepCalls`)."""
    save_set = _save_set(tuple((str(op), int(i)) for op, i in save_ops))
    storage: dict[tuple[Any, int], Any] = {}
    return _KeepCalls(save_set, storage), _ReplayCalls(save_set, storage)


@functools.lru_cache(maxsize=256)
def _save_set(save_ops: tuple[tuple[str, int], ...]) -> _SaveSet:
    return _SaveSet(save_ops)


def save_policy(save_ops: Any) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that keeps the outputs of the listed op calls with torch's own
    selective checkpointing (``create_selective_checkpoint_contexts``): the reference :func:`caching_modes` is
    checked against, and a way to run a save-set under torch's checkpoint directly.

    ``save_ops`` as for :func:`caching_modes`; every other op is recomputed in backward.
    """
    wanted = frozenset((str(op), int(i)) for op, i in save_ops)

    def context_fn() -> tuple[Any, Any]:
        counts: collections.Counter[str] = collections.Counter()

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if ctx.is_recompute:  # torch replays the first forward's decisions; asked only in the forward here
                return CheckpointPolicy.PREFER_RECOMPUTE
            name = str(func)
            index = counts[name]
            counts[name] += 1
            return CheckpointPolicy.MUST_SAVE if (name, index) in wanted else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


#: whether a selective unit whose backward needs only what it holds anyway skips its recomputation
#: (:class:`_DirectSaves`); off, every selective unit recomputes as torch's selective checkpointing does (tests compare)
DIRECT_SAVES = True


def checkpointed(guard: ReplayGuard | nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict, *,
                 hold: Callable[[torch.Tensor], Any] | None = None,
                 fetch: Callable[[Any], torch.Tensor] | None = None,
                 save_ops: Any = None, on_direct: Callable[[bool], None] | None = None) -> Any:
    """:func:`checkpointed_call` with the arguments as a tuple and a dict; with ``hold`` and ``fetch``, the tensors
    among them (pytree leaves) are kept for the recomputation as ``hold(t)`` — a swap-engine handle, so the storage can
    go to the host — and ``fetch(handle)`` gives them back when the recomputation starts (``recompute_offload``).
    With ``save_ops`` (``selective``), the outputs of those op calls are kept and not recomputed (see
    :func:`caching_modes`), and the recomputation is skipped where it would redo nothing (:class:`_DirectSaves`);
    then ``on_direct``, if given, is told after the forward whether it was skipped so (every tensor backward needs is
    one the unit holds anyway: the save-set keeps everything, and the unit is a keep unit in effect)."""
    if not isinstance(guard, ReplayGuard):
        guard = ReplayGuard(guard, strict=False)
    memo: list[Any] = []
    # what the recomputation calls forward with: after the first forward a cache argument is replaced by a marker (the
    # recomputation appends to a copy of the cache as it was before, which the guard keeps), so the live cache, which
    # later units extend, is not held until this unit's backward (what a profile's storage groups assume)
    held: list[Any] = [args, kwargs]

    first_fwd, again_fwd = forward, forward
    direct: _DirectSaves | None = None
    if save_ops:  # the selective modes around the unit's forward only, not around the guard's own bookkeeping
        caching, cached = caching_modes(save_ops)
        again_fwd = _under(cached, forward)
        if DIRECT_SAVES:
            direct = _DirectSaves(caching.storage)
            modules = guard.modules

            def first_fwd(*a: Any, **k: Any) -> Any:
                return direct.run(caching, forward, modules, a, k)
        else:
            first_fwd = _under(caching, forward)

    def run(*_devices: Any) -> Any:  # the tensors passed only tell checkpoint which devices' RNG to keep
        if not memo:
            out, state = guard.first(first_fwd, held[0], held[1])
            if on_direct is not None and direct is not None:
                on_direct(direct.all_direct)
            memo.append(state)
            if state[1]:
                held[:] = _without_caches(held[0], held[1])
            if hold is not None:
                held[:] = _map_leaves(_once(lambda v: _Held(hold(v), v.requires_grad), torch.Tensor), held[0], held[1])
            return out
        a, k = held
        if fetch is not None:  # a fetched tensor needs grad as the input did: ops save the same tensors again
            a, k = _map_leaves(_once(lambda v: _fetched(fetch, v), _Held), a, k)
        return guard.again(again_fwd, a, k, memo[0])

    leaves = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
    # with ``hold``, checkpoint must not keep the inputs themselves: an empty tensor per device tells it the devices
    tensors = leaves if hold is None else [torch.empty(0, device=d) for d in dict.fromkeys(t.device for t in leaves)]
    del args, kwargs, leaves
    return checkpoint(run, *tensors, use_reentrant=False, preserve_rng_state=True)


_FLAT = (torch.Tensor, _Held, int, float, bool, str, type(None))


def _once(fn: Callable[[Any], Any], kind: type) -> Callable[[Any], Any]:
    """``fn`` on the leaves of type ``kind``, called once per object: a tensor passed twice (``attn(x, x, x)``) is
    held once and comes back as one tensor, so a forward that asks ``query is key`` (``nn.MultiheadAttention``'s
    packed projection) takes the same path when it is recomputed."""
    done: dict[int, Any] = {}

    def call(v: Any) -> Any:
        if not isinstance(v, kind):
            return v
        out = done.get(id(v))
        if out is None:
            out = done[id(v)] = fn(v)
        return out

    return call


def _map_leaves(fn: Callable[[Any], Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``tree_map(fn, (args, kwargs))``, without building tree specs when no argument is a container (the usual
    call of a unit: a few tensors and flags)."""
    if all(isinstance(v, _FLAT) for v in args) and all(isinstance(v, _FLAT) for v in kwargs.values()):
        return tuple(fn(v) for v in args), {k: fn(v) for k, v in kwargs.items()}
    return tree_map(fn, (args, kwargs))


def _under(mode: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with mode:
            return forward(*args, **kwargs)

    return call


# ====================================================================== what a profile needs to know
class ForwardEffects:
    """What one forward of a model did besides computing: see :func:`forward_side_effects`.

    Attributes:
        own_checkpointing: names of modules that run themselves under ``torch.utils.checkpoint`` (outermost ones).
        effects: per module name, side effects a recomputation replays exactly (buffers, attributes, caches).
        not_recomputable: per module name, why recomputing it cannot be exact.
    """

    def __init__(self) -> None:
        self.own_checkpointing: list[str] = []
        self.effects: dict[str, list[str]] = {}
        self.not_recomputable: dict[str, list[str]] = {}

    def for_unit(self, name: str) -> tuple[str, str]:
        """``(side effects, not-recomputable reason)`` of module ``name``, as text ("" for none)."""
        return "; ".join(self.effects.get(name, [])), "; ".join(self.not_recomputable.get(name, []))


def _checkpoint_codes() -> set[Any]:
    import inspect

    import torch.utils.checkpoint as ck

    codes = {ck.checkpoint.__code__, inspect.unwrap(ck.checkpoint).__code__}
    fn = getattr(ck, "CheckpointFunction", None)
    if fn is not None:
        codes.add(fn.forward.__code__)
    return codes


def _inside_checkpoint(codes: set[Any]) -> bool:
    f = sys._getframe(2)
    while f is not None:
        if f.f_code in codes:
            return True
        f = f.f_back
    return False


def forward_side_effects(model: nn.Module, call: Callable[[], Any]) -> ForwardEffects:
    """Run ``call()`` (one forward of ``model``) once, watching every module, and report its side effects.

    Found: modules that checkpoint themselves; buffers changed (in place, by a kernel, or reassigned) and plain
    attributes set, which a plan's recomputation replays; Hugging Face caches passed in or returned, which it
    replays on a copy unless they are updated in place; other arguments changed, which it cannot undo. The caller
    restores the model's state afterwards (the profiler runs this inside ``preserved_state``).
    """
    res = ForwardEffects()
    names = {m: n for n, m in model.named_modules()}
    before_bufs = {m: (dict(m._buffers), {k: (b._version, b.detach().clone()) for k, b in m._buffers.items()
                                          if b is not None and not b.is_meta}) for m in names}
    before_attrs = {m: _tensor_attrs(m) for m in names}
    codes = _checkpoint_codes()
    stack: list[tuple[str, bool]] = []
    calls: dict[str, list[Any]] = collections.defaultdict(list)

    def add(table: dict[str, list[str]], name: str, what: str) -> None:
        if what not in table.setdefault(name, []):
            table[name].append(what)

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        name = names[mod]
        inside = _inside_checkpoint(codes)
        if inside and not (stack and stack[-1][1]) and name:
            res.own_checkpointing.append(name)
        stack.append((name, inside))
        caches = [_CacheSnapshot(a) for _, a in _arguments(args, kwargs) if is_cache(a)]
        if caches:
            add(res.effects, name, "updates a cache passed in (recompute appends to a copy)")
        calls[name].append((argument_changes(args, kwargs), caches))

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        name = names[mod]
        if stack and stack[-1][0] == name:
            stack.pop()
        changed, caches = calls[name].pop()
        for what in changed():
            add(res.not_recomputable, name, f"changes {what} in forward")
        if any(t._version != v for snap in caches for t, v in snap.versions):
            add(res.not_recomputable, name, "updates a cache in place (a static cache)")

    handles = []
    for m in names:
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    try:
        call()
    finally:
        for h in handles:
            h.remove()
    parents = {n: [p for p in names.values() if p == "" or n.startswith(p + ".")] for n in names.values()}
    for m, name in names.items():
        bufs, versions = before_bufs[m]
        changed = []
        for k, b in m._buffers.items():
            was = bufs.get(k)
            if b is None or was is None or k not in versions:
                continue
            v, value = versions[k]
            if b is not was or b._version != v or b.shape != value.shape or (
                    not b.is_meta and not torch.equal(b, value)):
                changed.append(k)
        attrs = [k for k, v in _tensor_attrs(m).items() if before_attrs[m].get(k, _MISSING) is not v]
        for owner in [name, *parents[name]]:
            if changed:
                add(res.effects, owner, "changes buffers " + ", ".join(f"{name}.{k}".lstrip(".") for k in changed))
            if attrs:
                add(res.effects, owner, "sets attributes " + ", ".join(f"{name}.{k}".lstrip(".") for k in attrs))
    return res
