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
  backward needs only tensors it holds anyway is not run again at all (:class:`DirectSaves`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import checkpoint

from .replay_guard import ReplayGuard, without_caches
from .selective import DirectSaves, caching_modes

__all__ = ["DIRECT_SAVES", "checkpointed", "checkpointed_call"]

#: whether a selective unit whose backward needs only what it holds anyway skips its recomputation
#: (:class:`DirectSaves`); off, every selective unit recomputes as torch's selective checkpointing does (tests compare)
DIRECT_SAVES = True



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


def checkpointed(guard: ReplayGuard | nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict, *,
                 hold: Callable[[torch.Tensor], Any] | None = None,
                 fetch: Callable[[Any], torch.Tensor] | None = None,
                 save_ops: Any = None, on_direct: Callable[[bool], None] | None = None) -> Any:
    """:func:`checkpointed_call` with the arguments as a tuple and a dict; with ``hold`` and ``fetch``, the tensors
    among them (pytree leaves) are kept for the recomputation as ``hold(t)`` — a swap-engine handle, so the storage can
    go to the host — and ``fetch(handle)`` gives them back when the recomputation starts (``recompute_offload``).
    With ``save_ops`` (``selective``), the outputs of those op calls are kept and not recomputed (see
    :func:`caching_modes`), and the recomputation is skipped where it would redo nothing (:class:`DirectSaves`);
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
    direct: DirectSaves | None = None
    if save_ops:  # the selective modes around the unit's forward only, not around the guard's own bookkeeping
        caching, cached = caching_modes(save_ops)
        again_fwd = _under(cached, forward)
        if DIRECT_SAVES:
            direct = DirectSaves(caching.storage)
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
                held[:] = without_caches(held[0], held[1])
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


