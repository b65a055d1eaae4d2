"""Save-sets for ``selective`` units: which op outputs a unit may keep, measured op by op.

Selective activation checkpointing (torch's ``create_selective_checkpoint_contexts``; the runtime's own lean modes,
:func:`memopt_nb.runtime.selective.caching_modes`, follow its rules) recomputes a unit in backward
like ``recompute`` but keeps the outputs of chosen op calls, so the expensive ops are not run twice. This module
records a unit's ops (:class:`OpRecorder`: name, call index, new bytes, seconds) during a forward run under plain
checkpointing, and proposes the save-sets of :data:`~memopt_nb.core.plan.SAVE_SETS`:

* ``"matmuls"`` — every matmul-like op (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions, ``_scaled_mm``) and
  every attention kernel (``_scaled_dot_product_*``);
* ``"alternate"`` — torchtitan's op-level SAC rule: attention kernels and every other matmul (the first, third …);
* ``"attention"`` — attention kernels only.

An op call is only ever saved when keeping its output changes nothing but memory and time: its output is a new
storage (not a view of an input), nothing outside autograd still refers to it when the unit's forward returns (not the
unit's output, not a cache entry), and no later op writes to it in place (torch would refuse the cached tensor). So
the bytes a save-set keeps are held from the unit's forward to its backward and by nothing else — what the profile
then measures (``UnitProfile.save_sets``) and the simulator adds.

Call indices are counted per op over the unit's forward, skipping the bookkeeping ops torch's selective checkpointing
does not count (:func:`~memopt_nb.runtime.selective.sac_counts_op`), so the runtime's policy
(:func:`~memopt_nb.runtime.selective.save_policy`) picks the same calls.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.plan import SAVE_SETS
from ..runtime.recompute import checkpointed_call
from ..runtime.selective import sac_counts_op
from ..runtime.step import forward_autocast

__all__ = ["OpCall", "OpRecorder", "mark_pareto", "op_kind", "propose_save_sets", "record_ops"]

_MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "_scaled_mm", "cudnn_convolution",
               "mkldnn_convolution", "_int_mm")
_ATTENTION_PREFIXES = ("_scaled_dot_product_", "_flash_attention", "_efficient_attention")


def op_kind(name: str) -> str:
    """``"matmul"``, ``"attention"`` or ``""`` for an op name like ``"aten.addmm.default"``."""
    parts = name.split(".")
    base = parts[1] if len(parts) > 1 else name
    if base.startswith(_ATTENTION_PREFIXES):
        return "attention"
    return "matmul" if base in _MATMUL_OPS else ""


@dataclass
class OpCall:
    """One op call in a unit's forward: ``(name, index)`` identifies it; ``nbytes`` its new output storages;
    ``seconds`` its time; ``safe`` whether keeping its output changes nothing but memory (see the module docs)."""

    name: str
    index: int
    nbytes: int
    seconds: float
    refs: dict[int, Any] = field(default_factory=dict, repr=False)  # data pointer -> weak ref of each new storage
    mutated: bool = False
    escaped: bool = False

    @property
    def kind(self) -> str:
        return op_kind(self.name)

    @property
    def safe(self) -> bool:
        return self.nbytes > 0 and not self.mutated and not self.escaped


def _storages(values: Any) -> list[torch.UntypedStorage]:
    out = []
    for t in tree_leaves(values):
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            try:
                out.append(t.untyped_storage())
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                continue
    return out


class OpRecorder(TorchDispatchMode):
    """Records the op calls of the unit set by :meth:`begin` until :meth:`end` (units never nest)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[int, list[OpCall]] = {}
        self._unit: int | None = None
        self._counts: collections.Counter[str] = collections.Counter()

    def begin(self, unit: int) -> None:
        self._unit = unit
        self._counts = collections.Counter()
        self.calls[unit] = []

    def end(self) -> None:
        """Close the unit: every output something outside autograd still holds now has escaped."""
        if self._unit is None:
            return
        for call in self.calls[self._unit]:
            call.escaped = any(not r.expired() for r in call.refs.values())
            call.refs = {}
        self._unit = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if self._unit is None or not sac_counts_op(func):
            return func(*args, **kwargs)
        calls = self.calls[self._unit]
        schema = func._schema
        written = [a for a, s in zip(args, schema.arguments, strict=False) if s.alias_info and s.alias_info.is_write]
        written += [kwargs[s.name] for s in schema.arguments if s.name in kwargs and s.alias_info
                    and s.alias_info.is_write]
        if written:
            ptrs = {st.data_ptr() for st in _storages(written)}
            for c in calls:  # a storage of its that is still alive (a dead one's address may be reused meanwhile)
                if any(not c.refs[p].expired() for p in c.refs.keys() & ptrs):
                    c.mutated = True
        inputs = _storages((args, kwargs))
        in_ptrs = {st.data_ptr() for st in inputs}
        cuda = any(st.device.type == "cuda" for st in inputs)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        name = str(func)
        index = self._counts[name]
        self._counts[name] += 1
        new = {st.data_ptr(): st for st in _storages(out) if st.data_ptr() not in in_ptrs and st.nbytes() > 0}
        calls.append(OpCall(name, index, sum(st.nbytes() for st in new.values()), seconds,
                            refs={p: StorageWeakRef(st) for p, st in new.items()}))
        return out


def record_ops(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any],
             names: list[str]) -> dict[int, list[OpCall]]:
    """Each unit's op calls (by unit index), from one forward of ``model(*inputs, **kwargs)`` with every unit (a
    qualified module name) under plain checkpointing, as the profile's ``selective=True`` records them."""
    recorder = OpRecorder()
    installed: list[tuple[nn.Module, Any]] = []

    def wrap(index: int, module: nn.Module, inner: Callable) -> Callable:
        def forward(*args: Any, **kw: Any) -> Any:
            recorder.begin(index)
            out = checkpointed_call(module, inner, *args, **kw)
            recorder.end()  # while its output is alive: what is still referenced now has escaped the unit
            return out

        return forward

    try:
        for index, name in enumerate(names):
            module = model.get_submodule(name)
            previous = module.__dict__.get("forward")
            module.forward = wrap(index, module, previous or type(module).forward.__get__(module, type(module)))
            installed.append((module, previous))
        with recorder, forward_autocast():  # as the training step runs it (a profile's autocast=)
            out = model(*inputs, **kwargs)
        del out
    finally:
        for module, previous in reversed(installed):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
    return recorder.calls


def propose_save_sets(calls: list[OpCall]) -> dict[str, dict[str, Any]]:
    """The non-empty save-sets of one unit's op calls: per name ``{"ops": [[name, index], ...], "fraction": the share
    of the unit's op time the saved calls take (what the recomputation no longer spends)}``."""
    total = sum(c.seconds for c in calls) or 1.0
    heavy = [c for c in calls if c.kind and c.safe]
    attention = [c for c in heavy if c.kind == "attention"]
    matmuls = [c for c in heavy if c.kind == "matmul"]
    chosen = {
        "matmuls": heavy,
        "alternate": sorted(attention + matmuls[::2], key=heavy.index),
        "attention": attention,
    }
    out: dict[str, dict[str, Any]] = {}
    for name in SAVE_SETS:
        cs = chosen[name]
        if cs:
            out[name] = {"ops": [[c.name, c.index] for c in cs],
                         "fraction": min(1.0, sum(c.seconds for c in cs) / total)}
    return out


def mark_pareto(sets: dict[str, dict[str, Any]]) -> None:
    """Set ``"pareto"`` on each save-set: False when an earlier set saves the same calls, or another set (saving
    different calls) holds no more bytes and recomputes for no longer, and is better in one of the two. At least one
    set is always Pareto."""
    names = [n for n in SAVE_SETS if n in sets]
    distinct = [a for i, a in enumerate(names) if all(sets[b]["ops"] != sets[a]["ops"] for b in names[:i])]
    for a in names:
        sa = sets[a]
        dominated = any(
            sets[b]["held_bytes"] <= sa["held_bytes"] and sets[b]["recompute_time"] <= sa["recompute_time"]
            and (sets[b]["held_bytes"] < sa["held_bytes"] or sets[b]["recompute_time"] < sa["recompute_time"])
            for b in distinct if b != a)
        sa["pareto"] = a in distinct and not dominated
