"""Parameters read between steps while they are offloaded (an EMA, norms, ``copy.deepcopy``, ``torch.save``): an
offloaded parameter's class answers what reads no data as it is and brings its data for the rest, never handing
out a view of the host copy.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from .slots import HostTensor, Slot, foreach_over, one_at_a_time, placeholder
from .state_errors import StateError

__all__ = ["Worn", "offloaded_class"]

#: Attributes and methods of a tensor that read no data: an offloaded parameter answers them as it is.
_META_ATTRS = frozenset({
    "shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "layout", "ndim", "names", "grad_fn", "_version",
    "is_cuda", "is_cpu", "is_meta", "is_mps", "is_xpu", "is_sparse", "is_quantized", "is_nested", "is_mkldnn",
    "itemsize", "nbytes", "output_nr", "retains_grad", "_base", "_cdata", "_backward_hooks",
    "_post_accumulate_grad_hooks", "__dict__", "__class__"})
_META_METHODS = frozenset({
    "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "untyped_storage", "data_ptr",
    "is_contiguous", "is_floating_point", "is_complex", "is_signed", "get_device", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "__hash__", "__len__", "__sizeof__", "_is_view", "is_pinned", "is_shared",
    "_has_compatible_shallow_copy_type"})
#: Calls whose result would keep pointing at the parameter's device memory outside any tensor (refused while offloaded).
_RAW_ALIASES = frozenset({"numpy", "__array__", "__dlpack__", "storage", "_typed_storage"})


def _moves_nothing(name: str, args: Any, kwargs: dict) -> bool:
    """Whether ``p.to(...)``, ``p.cpu()`` or ``p.cuda()`` would return ``p`` itself (reading no data): what
    ``model.to(device)`` on its own device does, in a loop or in accelerate's ``prepare``."""
    p, rest = args[0], args[1:]
    kw = dict(kwargs)
    try:
        if name == "to":
            if kw.pop("copy", False):
                return False
            device, dtype, _, fmt = torch._C._nn._parse_to(*rest, **kw)
        elif name in ("cpu", "cuda") and not rest and kw.get("device") is None and not kw.get("memory_format"):
            device, dtype, fmt = torch.device(name), None, None
        else:
            return False
    except (TypeError, RuntimeError, ValueError):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        here, own = p.device, p.dtype
    if device is not None and device.type != here.type:
        return False
    if device is not None and device.index != here.index:
        current = torch.cuda.current_device() if here.type == "cuda" else None
        if device.index is not None or current != here.index:
            return False
    return (dtype is None or dtype == own) and fmt in (None, torch.preserve_format)


def _offloaded_torch_function(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """Operators on a parameter whose data lives on the host between steps (see :func:`offloaded_class`)."""
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    attr = getattr(getattr(func, "__self__", None), "__name__", None) if name in ("__get__", "__set__") else None
    if (attr in _META_ATTRS) if attr is not None else (name in _META_METHODS):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    held = {id(t): t for t in tree_leaves((args, kwargs)) if getattr(t, "_memopt_offload", None) is not None}
    if not held:  # a copy made from one (not managed): an ordinary parameter
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    what = f"{attr} of" if attr is not None else f"{name}() on"
    if attr == "data" and name == "__set__":
        target, value = args[0], args[1]
        if value is target:  # p.data = p: what model.to(its own device) does (Trainer, accelerate); nothing changes
            return None
        raise StateError("p.data = ... on a parameter the plan keeps on the host between steps would lose it; write "
                         "with `with torch.no_grad(): p.copy_(value)` instead")
    if name in _RAW_ALIASES:
        raise StateError(f"{what} a parameter the plan keeps on the host between steps would point at memory the "
                         "plan frees; use p.detach().clone() first, or model.state_dict()")
    if name in ("to", "cpu", "cuda") and _moves_nothing(name, args, kwargs):
        return args[0]  # the parameter itself, as torch returns it: nothing to bring back
    if (attr == "data" and name == "__get__") or name == "detach":
        p = next(iter(held.values()))
        return placeholder(p._memopt_offload.slot)  # reads and writes go through the host copy, like offloaded state
    units = {(id(w.manager), w.unit): w for w in (p._memopt_offload for p in held.values())}
    if len(units) > 1 and foreach_over(func, len(held)):
        return one_at_a_time(func, args, kwargs)  # one unit's parameters on the device at a time
    with contextlib.ExitStack() as stack:
        storages = set()
        for w in units.values():
            storages |= stack.enter_context(w.manager._reading(w.unit))
        out = func(*args, **kwargs)
        if any(isinstance(t, torch.Tensor) and type(t) is not HostTensor and id(t) not in held
               and t.untyped_storage()._cdata in storages for t in tree_leaves(out)):
            raise StateError(f"{what} a parameter the plan keeps on the host between steps would return a view of "
                             "memory the plan frees; read it through p.detach() (which reads the host copy), a copy "
                             "(p.detach().clone()) or model.state_dict(), or inside `with applied.state.gathered():`")
    return out


def _offloaded_deepcopy(self: nn.Parameter, memo: dict) -> Any:
    w = self._memopt_offload
    with w.manager._reading(w.unit):
        return copy.deepcopy(self, memo)


def _offloaded_reduce_ex(self: nn.Parameter, proto: Any) -> Any:
    w = self._memopt_offload
    with w.manager._reading(w.unit):
        return copy.deepcopy(self).__reduce_ex__(proto)  # a copy: pickling reads it after the parameter is freed


class Worn(NamedTuple):
    """What an offloaded parameter wearing :func:`offloaded_class` knows of its home (``p._memopt_offload``)."""

    manager: Any  # the StateManager of the unit
    unit: int
    slot: Slot


_OFFLOADED_CLASSES: dict[type, type] = {}


def offloaded_class(cls: type) -> type | None:
    """The class an offloaded parameter of class ``cls`` wears while its data is on the host (``None``: leave it).

    Its device storage is empty then, and a kernel reading it would crash the process (a notebook's kernel dies).
    Every operator on it therefore goes through :func:`_offloaded_torch_function`: metadata as it is; ``detach()`` and
    ``.data`` a :class:`HostTensor` of its host copy; anything else runs with the unit's parameters brought back
    (in-place changes kept) and offloaded again after — an EMA, a weight-norm log or ``copy.deepcopy(model)`` between
    steps then works and computes what it would without the plan. Only plain parameters (no ``__torch_function__`` of
    their own) get one."""
    if cls.__torch_function__ is not torch._C._disabled_torch_function_impl:
        return None
    sub = _OFFLOADED_CLASSES.get(cls)
    if sub is None:
        sub = _OFFLOADED_CLASSES[cls] = type(f"Offloaded{cls.__name__}", (cls,), {
            "__torch_function__": classmethod(_offloaded_torch_function), "__deepcopy__": _offloaded_deepcopy,
            "__reduce_ex__": _offloaded_reduce_ex, "__module__": __name__})
    return sub


