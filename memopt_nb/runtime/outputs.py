"""A warning when the training loop keeps the model's output that its plan was profiled without.

A profile assumes, unless made with ``keep_outputs=True``, that the loop lets go of the model's output once the loss
is computed (``loss = loss_fn(model(x))``). The loop in the transformers documentation keeps it
(``outputs = model(**batch); outputs.loss.backward()``): its logits and cache then live through backward and the next
forward, above what the plan predicted. :class:`KeptOutputWatch` notes the large tensors of each training forward's
output (weakly) and, at the next training forward, warns once if any is still alive, naming them and their bytes.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.nn as nn

from ..core.budget import format_bytes
from ..core.errors import MemoptWarning
from .hooks import uncopied
from .step import output_tensors

__all__ = ["KEPT_MIN_BYTES", "KeptOutputWatch"]

#: outputs smaller than this are not worth a warning (a kept scalar loss)
KEPT_MIN_BYTES = 64 * 1024


def _nbytes(t: torch.Tensor) -> int:
    inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]] if hasattr(t, "__tensor_flatten__") else [t]
    seen, total = set(), 0
    for x in inner:
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_meta:
            st = x.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


class KeptOutputWatch:
    """Installed on ``model`` by an applied plan profiled without ``keep_outputs=True`` (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self._refs: list[tuple[str, weakref.ref, int]] = []
        self._warned = False
        self._pre = model.register_forward_pre_hook(uncopied(self._check))  # a copy of the model carries no watch
        self._post = model.register_forward_hook(uncopied(self._note))

    def _note(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._warned or not torch.is_grad_enabled():
            return
        self._refs = [(path, weakref.ref(t), n) for path, t in output_tensors(output)
                      if (n := _nbytes(t)) >= KEPT_MIN_BYTES]

    def _check(self, module: nn.Module, args: Any) -> None:
        if self._warned or not torch.is_grad_enabled():
            return
        alive = [(path, n) for path, ref, n in self._refs if ref() is not None]
        self._refs = []
        if not alive:
            return
        self._warned = True
        total = sum(n for _, n in alive)
        shown = ", ".join(f"{p} ({format_bytes(n)})" for p, n in alive[:4]) + (" …" if len(alive) > 4 else "")
        warnings.warn(
            f"the training loop keeps the model's output from one step into the next: {shown}, "
            f"{format_bytes(total)} in all, alive through backward and the next forward, which this plan's profile "
            "did not count (it assumed the output is let go once the loss is computed). Let go of it after the loss "
            "(`loss = model(**batch).loss`, or `del outputs` before backward), or profile the loop as it is: "
            "memopt.profile(..., keep_outputs=True), then plan again", MemoptWarning, stacklevel=3)

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()
        self._refs = []
