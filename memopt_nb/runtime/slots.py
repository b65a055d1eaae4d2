"""A device value with a host home (:class:`Slot`) and the placeholders that stand in for it while it is on the
host (:class:`HostTensor`): what the optimizer's state dict and ``p.grad`` hold between their visits to the device.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .limit import uncounted
from .memory import note_device_storage
from .state_errors import STEP_RULES, StateError, StepInBackwardError
from .storages import tensor_on

__all__ = ["HostTensor", "Slot", "foreach_over", "one_at_a_time", "placeholder", "stepped_placeholder"]


class Slot:
    """One tensor's bytes with a host copy.

    ``tensor`` (if kept) is the device tensor whose storage is freed and refilled in place; otherwise the value is
    materialized into a new device tensor when needed.
    """

    __slots__ = ("mover", "tensor", "storage", "nbytes", "host", "ticket", "dtype", "device", "size", "stride",
                 "offset", "kind", "owner")

    def __init__(self, mover: Any, like: Any, keep: bool, kind: str, owner: Any) -> None:
        self.mover = mover
        self.tensor = like if keep else None
        self.storage = like.untyped_storage() if keep else None
        self.nbytes = like.nbytes if isinstance(like, _Like) else like.untyped_storage().nbytes()
        self.host = mover.new_host(self.nbytes)
        self.ticket: Any = None
        self.dtype, self.device = like.dtype, like.device
        if isinstance(like, _Like):
            self.size, self.stride, self.offset = like.size, like.stride, like.offset
        else:
            self.size, self.stride, self.offset = like.size(), like.stride(), like.storage_offset()
        self.kind = kind
        self.owner = owner

    def send(self, src: torch.UntypedStorage) -> None:
        """Start copying ``src`` (this slot's bytes on the device) to the host."""
        self.ticket = self.mover.copy("d2h", self.host, src, self.nbytes, after=self.ticket)

    def free(self) -> None:
        """Drop the kept tensor's device bytes (not reused before the copy to the host has read them)."""
        self.mover.release(self.ticket)
        self.storage.resize_(0)
        note_device_storage(self.storage)

    def refill(self) -> None:
        """Re-grow the kept tensor's storage and start copying the host bytes into it (wait with :meth:`wait`)."""
        after = self.mover.chain(self.ticket)
        self.storage.resize_(self.nbytes)
        note_device_storage(self.storage)
        self.ticket = self.mover.copy("h2d", self.storage, self.host, self.nbytes, after=after)

    def wait(self) -> None:
        self.mover.wait(self.ticket)

    def materialize(self) -> torch.Tensor:
        """A new device tensor holding the host value."""
        after = self.mover.chain(self.ticket)
        st = self.mover.new_device(self.nbytes, self.device)
        ticket = self.mover.copy("h2d", st, self.host, self.nbytes, after=after)
        self.mover.wait(ticket)
        return tensor_on(st, self.dtype, self.offset, self.size, self.stride)

    def host_copy(self) -> torch.Tensor:
        """A host (CPU) tensor holding the value, for a state dict: no device memory. On the emulated device it is
        made under :func:`~memopt_nb.runtime.limit.uncounted`, so a limit counts it as the host memory it is."""
        self.mover.wait_host(self.ticket)
        with uncounted():
            host = tensor_on(self.host, self.dtype, self.offset, self.size, self.stride)
            return host.clone(memory_format=torch.preserve_format)

    def store(self, t: torch.Tensor) -> None:
        """Write a device tensor's value (same layout) back to the host, synchronously."""
        self.send(t.untyped_storage())
        self.mover.wait_host(self.ticket)

    def zero(self) -> None:
        self.mover.wait_host(self.ticket)
        ctypes.memset(self.host.data_ptr(), 0, self.nbytes)


# ---------------------------------------------------------------------- placeholders
def one_at_a_time(func: Any, args: Any, kwargs: dict) -> Any:
    """A ``torch._foreach_*`` call as one call per element (lists of one), so that of the host-held values among its
    arguments only one is on the device at a time, not all of them at once (an EMA over every parameter)."""
    n = next(len(a) for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)))
    outs = []
    for j in range(n):
        a = [x[j:j + 1] if isinstance(x, (list, tuple)) else x for x in args]
        k = {key: x[j:j + 1] if isinstance(x, (list, tuple)) else x for key, x in kwargs.items()}
        outs.append(func(*a, **k))
    return None if all(o is None for o in outs) else [t for o in outs for t in o]


def foreach_over(func: Any, held: int) -> bool:
    return held > 1 and getattr(func, "__name__", "").startswith("_foreach_")


class HostTensor(torch.Tensor):
    """A storage-less stand-in for a tensor whose value lives in the host store (offloaded state or gradient).

    It has the shape, dtype and device of the value. An operator applied to it runs on a temporary device copy and
    in-place changes are written back, so ``torch.equal(p.grad, g)``, ``clip_grad_norm_`` or ``print`` work. An
    operator that would return a view raises :class:`StateError`. A placeholder of a gradient consumed by a step in
    backward (``stepped``) has no value: every operator on it raises :class:`StepInBackwardError`.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def numpy(self, *, force: bool = False) -> Any:
        """A NumPy array of the value (a copy: the value has no device memory to share)."""
        if self._stepped:
            raise StepInBackwardError(f"this gradient was already applied in backward; {STEP_RULES}." + self._how())
        return self._slot.materialize().numpy(force=force)

    @staticmethod
    def __new__(cls, like: Any, slot: Slot | None, stepped: bool = False) -> HostTensor:
        r = torch.Tensor._make_wrapper_subclass(cls, like.size, strides=like.stride, storage_offset=like.offset,
                                                dtype=like.dtype, device=like.device, requires_grad=False)
        r._slot = slot
        r._stepped = stepped
        r._like = like
        r._settle = None  # a stepped gradient's: makes the model whole before a refusal (StateManager._settle)
        return r

    def __init__(self, like: Any, slot: Slot | None, stepped: bool = False) -> None:
        super().__init__()

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return [], None  # no inner tensors: the memory meter counts nothing for it

    @staticmethod
    def __tensor_unflatten__(inner: Any, meta: Any, size: Any, stride: Any) -> Any:  # pragma: no cover
        raise StateError("a memopt host placeholder cannot be traced or compiled")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        if self._stepped:
            return f"<gradient already applied by a step in backward: shape {tuple(self.shape)}>"
        return f"HostTensor({self._slot.materialize()!r})"

    def _how(self) -> str:
        """Before refusing an operator on a gradient a step in backward consumed: the model made whole again (the
        units stepped put back, or the step completed), said in a sentence for the error."""
        settle, self._settle = self._settle, None
        return settle() if settle is not None else ""

    def __reduce_ex__(self, proto: Any) -> Any:
        if self._stepped:
            raise StepInBackwardError(f"this gradient was already applied in backward; {STEP_RULES}." + self._how())
        return self._slot.materialize().__reduce_ex__(proto)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        holders = [t for t in tree_leaves((args, kwargs)) if isinstance(t, HostTensor)]
        stepped = [h for h in holders if h._stepped]
        if stepped:
            how = next((h for h in stepped if h._settle is not None), stepped[0])._how()
            if "unscale" in str(func):  # torch.amp.GradScaler.unscale_, from scaler.unscale_() or scaler.step()
                raise StepInBackwardError(
                    "torch.amp.GradScaler cannot be used with a step in backward: the units with grads='step' were "
                    "already stepped in this backward with the *scaled* gradients, before the scaler could unscale "
                    "them or skip the step." + (how or " Their parameters now hold that update; reload them from a "
                                                      "checkpoint") + ". Use bf16 autocast (it needs no scaler), or a "
                    "plan with grads='offload' or 'resident'")
            raise StepInBackwardError(f"{func} on a gradient that was already applied by a step in backward; "
                                      f"{STEP_RULES}." + how)
        if any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            raise StateError(f"{func} would return a view of an offloaded tensor; operate on a copy "
                             "(e.g. t.clone()) or leave the memopt block first")
        if foreach_over(func, len({id(h) for h in holders})):
            return one_at_a_time(func, args, kwargs)
        mats: dict[int, torch.Tensor] = {}
        for h in holders:
            if id(h) not in mats:
                mats[id(h)] = h._slot.materialize()
        a, k = tree_map(lambda x: mats[id(x)] if isinstance(x, HostTensor) else x, (args, kwargs))
        out = func(*a, **k)
        if func._schema.is_mutable:
            for h in {id(h): h for h in holders}.values():
                h._slot.store(mats[id(h)])
        back = {id(m): h for h in holders for m in (mats[id(h)],)}
        return tree_map(lambda x: back.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)


class _Like:
    """The layout of a dense tensor, without its data."""

    __slots__ = ("size", "stride", "offset", "dtype", "device", "nbytes")

    def __init__(self, t: torch.Tensor) -> None:
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        self.dtype, self.device = t.dtype, t.device
        self.nbytes = t.numel() * t.element_size()


def placeholder(slot: Slot) -> HostTensor:
    return HostTensor(slot, slot)


def stepped_placeholder(g: torch.Tensor, settle: Any = None) -> HostTensor:
    """The placeholder of a gradient a step in backward consumed; ``settle()`` makes the model whole before an
    operator on it is refused and says how (see ``StateManager._settle``)."""
    r = HostTensor(_Like(g), None, stepped=True)
    r._settle = settle
    return r


