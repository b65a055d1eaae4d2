"""Storage helpers shared by the runtime (swap engine, plan application, state placement) and the profiler.

memopt moves and counts *storages*, not tensors: views share one storage, and a storage is what the allocator frees.
These few helpers were written out in several modules; they live here once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["byte_view", "dense", "drop_storage", "exclusive", "is_plain", "movable", "plain_storage_ptrs",
           "tensor_on", "use_count"]


def use_count(storage: torch.UntypedStorage) -> int:
    """How many references the storage's C++ object has (holding the Python ``storage`` itself adds one)."""
    return torch._C._storage_Use_Count(storage._cdata)


def is_plain(t: Any, *, parameters: bool = False) -> bool:
    """A plain dense tensor that owns its memory as one storage: a ``torch.Tensor`` (or, with ``parameters=True``, an
    ``nn.Parameter``), strided, not on the meta device. Subclasses (DTensor, placeholders) and sparse or nested tensors
    are not plain."""
    kinds = (torch.Tensor, nn.Parameter) if parameters else (torch.Tensor,)
    return type(t) in kinds and t.layout == torch.strided and not t.is_meta


def dense(t: torch.Tensor) -> bool:
    """Every element at its own place and no gaps: contiguous in *some* order of the dimensions (row-major,
    ``channels_last``, any permutation), so that the tensor's bytes are one block of ``t.nbytes``."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def exclusive(t: Any) -> bool:
    """A plain tensor or parameter that is the whole of its storage (so moving the storage moves exactly this
    tensor): offset 0, dense in any dimension order (:func:`dense`: a ``channels_last`` weight and its Adam state
    are), as many bytes as the storage, not empty."""
    return (is_plain(t, parameters=True) and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
            and t.nbytes > 0 and dense(t))


def movable(t: Any) -> bool:
    """:func:`exclusive` and its storage resizable (not memory-mapped, not a fixed buffer): a tensor whose device bytes
    a state placement may free in place and refill."""
    return exclusive(t) and t.untyped_storage().resizable()


def plain_storage_ptrs(tensors: Any) -> set[int]:
    """Data pointers of the storages of the plain tensors and parameters among ``tensors``."""
    return {t.untyped_storage().data_ptr() for t in tensors if is_plain(t, parameters=True)}


def tensor_on(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: Any, stride: Any) -> torch.Tensor:
    """A tensor viewing ``storage`` with the given layout (rebuilding a saved or offloaded tensor from its storage)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``storage`` as a flat ``uint8`` tensor (for copies between storages)."""
    return tensor_on(storage, torch.uint8, 0, (nbytes,), (1,))


def drop_storage(view: torch.Tensor) -> None:
    """Leave ``view`` (a ``detach()`` of a saved tensor, sharing its version counter) without its storage, so that it
    still answers autograd's in-place check but no longer keeps the memory. Done by assigning ``.data``, which never
    touches the shared counter: ``set_()`` would bump it for a moment, and another thread saving the tensor in that
    moment would record the wrong version."""
    view.data = torch.empty(0, dtype=view.dtype, device=view.device)
