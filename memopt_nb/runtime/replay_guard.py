"""What a recomputed forward must leave as the first forward left it: buffers and plain attributes its modules
change, Hugging Face caches and other arguments passed in (:class:`ReplayGuard`).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..core.errors import PlanError

__all__ = ["CacheSnapshot", "MISSING", "ReplayGuard", "argument_changes", "cache_tensors", "is_cache",
           "named_arguments", "running_stat_modules", "tensor_attrs", "without_caches"]

#: marks an attribute a module did not have
MISSING = object()


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


def without_caches(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    swap = lambda a: _CacheKey(id(a)) if is_cache(a) else a  # noqa: E731
    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}


class CacheSnapshot:
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


def named_arguments(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    out = [(f"argument {i}", a) for i, a in enumerate(args)]
    out += [(f"argument {k!r}", v) for k, v in kwargs.items()]
    return out


def argument_changes(args: tuple, kwargs: dict) -> Callable[[], list[str]]:
    """Record the non-tensor arguments of a call (caches aside); the returned function lists those changed since."""
    before = []
    for label, a in named_arguments(args, kwargs):
        if a is None or isinstance(a, (torch.Tensor, str, int, float, bool, bytes)) or is_cache(a):
            continue
        sig = _shallow_signature(a)
        if sig is not None:
            before.append((label, a, sig))

    def changed() -> list[str]:
        return [f"{label} ({type(a).__name__})" for label, a, sig in before if _shallow_signature(a) != sig]

    return changed


# ====================================================================== module state
def tensor_attrs(m: nn.Module) -> dict[str, Any]:
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
        self.before_attrs = [tensor_attrs(m) for m in modules]
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
        for _label, a in named_arguments(args, kwargs):
            if is_cache(a) and id(a) not in caches:
                caches[id(a)] = CacheSnapshot(a)
        changed_args = argument_changes(args, kwargs)
        out = forward(*args, **kwargs)
        first_call = not self._seen
        self._seen = True
        lost = []
        for i, m in enumerate(self.modules):
            bufs = m._buffers
            state.after_bufs.append(dict(bufs))
            state.after_attrs.append(tensor_attrs(m))
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
                                    if state.before_attrs[i].get(k, MISSING) is not v}
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


