"""What one forward of a model does besides computing (buffers and attributes it changes, its own
checkpointing): what the profile records so that a plan never recomputes a unit it cannot replay exactly.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .replay_guard import MISSING, CacheSnapshot, argument_changes, is_cache, named_arguments, tensor_attrs

__all__ = ["ForwardEffects", "forward_side_effects"]


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
    before_attrs = {m: tensor_attrs(m) for m in names}
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
        caches = [CacheSnapshot(a) for _, a in named_arguments(args, kwargs) if is_cache(a)]
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
        attrs = [k for k, v in tensor_attrs(m).items() if before_attrs[m].get(k, MISSING) is not v]
        for owner in [name, *parents[name]]:
            if changed:
                add(res.effects, owner, "changes buffers " + ", ".join(f"{name}.{k}".lstrip(".") for k in changed))
            if attrs:
                add(res.effects, owner, "sets attributes " + ", ".join(f"{name}.{k}".lstrip(".") for k in attrs))
    return res
