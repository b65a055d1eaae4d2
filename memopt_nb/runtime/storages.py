"""Storage helpers shared by the runtime (swap engine, plan application, state placement) and the profiler.

memopt moves and counts *storages*, not tensors: views share one storage, and a storage is what the allocator frees.
These few helpers were written out in several modules; they live here once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

__all__ = ["byte_view", "exclusive", "is_plain", "plain_storage_ptrs", "storageless_alias", "tensor_on", "use_count"]


def use_count(storage: torch.UntypedStorage) -> int:
    """How many references the storage's C++ object has (holding the Python ``storage`` itself adds one)."""
    return torch._C._storage_Use_Count(storage._cdata)


def is_plain(t: Any, *, parameters: bool = False) -> bool:
    """A plain dense tensor that owns its memory as one storage: a ``torch.Tensor`` (or, with ``parameters=True``, an
    ``nn.Parameter``), strided, not on the meta device. Subclasses (DTensor, placeholders) and sparse or nested tensors
    are not plain."""
    kinds = (torch.Tensor, nn.Parameter) if parameters else (torch.Tensor,)
    return type(t) in kinds and t.layout == torch.strided and not t.is_meta


def exclusive(t: Any) -> bool:
    """A plain tensor or parameter that is the whole of its storage (so moving the storage moves exactly this
    tensor): offset 0, contiguous, as many bytes as the storage, not empty."""
    return (is_plain(t, parameters=True) and t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.nbytes and t.nbytes > 0)


def plain_storage_ptrs(tensors: Any) -> set[int]:
    """Data pointers of the storages of the plain tensors and parameters among ``tensors``."""
    return {t.untyped_storage().data_ptr() for t in tensors if is_plain(t, parameters=True)}


def tensor_on(storage: torch.UntypedStorage, dtype: torch.dtype, offset: int, size: Any, stride: Any) -> torch.Tensor:
    """A tensor viewing ``storage`` with the given layout (rebuilding a saved or offloaded tensor from its storage)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def byte_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of ``storage`` as a flat ``uint8`` tensor (for copies between storages)."""
    return tensor_on(storage, torch.uint8, 0, (nbytes,), (1,))


def storageless_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor that shares ``t``'s version counter but not its storage (for autograd's in-place check without
    keeping the memory). Made by assigning ``.data``, which never touches the shared counter: ``set_()`` would bump it
    for a moment, and another thread saving ``t`` in that moment would record the wrong version."""
    alias = t.detach()
    alias.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias
