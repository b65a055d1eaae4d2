"""A whole-step plan's offloaded parameters: fetched for their unit's forward and backward (the neighbour's ahead),
freed after, guarded between steps (:func:`~memopt_nb.runtime.offloaded.offloaded_class`), saved and loaded through
their host copies (see :mod:`memopt_nb.runtime.state`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from .hooks import uncopied
from .offloaded import Worn, offloaded_class
from .slots import HostTensor
from .state_errors import StateError

__all__ = ["ParamPlacement"]


class ParamPlacement:
    """Parameters kept on the host between their unit's uses: a part of
    :class:`~memopt_nb.runtime.state.StateManager`."""

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
