"""A chunked LM head and cross-entropy: the logits are never materialized whole.

A language model's training peak often sits in its head: the logits are batch × tokens × vocabulary, the loss keeps
their log-softmax, and backward makes the gradients of both. :class:`ChunkedHead` replaces the head module's
``forward`` (an ``nn.Linear``, e.g. a transformers model's ``get_output_embeddings()``) while installed: in training it
returns :class:`LazyLogits` — a tensor with the logits' shape and dtype but no storage, holding the head's input. A
cross-entropy over it (``F.cross_entropy``, which transformers' causal-LM loss calls after ``.float()`` and ``.view``)
runs :class:`ChunkedCrossEntropy`: rows of the logits are computed ``rows`` at a time, each chunk's per-token loss
kept, the chunk freed; backward recomputes each chunk's logits and accumulates the head's gradients. Any other use of
the lazy logits (an accuracy, a user's own loss, printing) computes the full logits exactly as the plain head would,
with their autograd graph.

Exactness: the loss value is bit-identical to plain training (each token's loss is computed row by row as the plain
kernel does, and the same reduction kernel sums them: see :func:`_reduce`), but the head's weight gradient is summed
over chunks instead of in one matrix product, and the input's gradient comes from smaller matrix products, so
gradients differ in the last bits. That is why a plan uses it only when asked (``profile(..., head="chunked")``) and
says so (``Plan.exact``). Under ``torch.autocast`` or ``torch.no_grad()`` the head runs as it always does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.errors import PlanError

__all__ = ["ChunkedCrossEntropy", "ChunkedHead", "LazyLogits", "chunked_cross_entropy", "find_head"]

_REDUCTIONS = ("mean", "sum", "none")
#: Tensor methods that read only the lazy logits' metadata (answered without computing them)
_META = frozenset({"size", "dim", "ndim", "shape", "dtype", "device", "numel", "ndimension", "nelement",
                   "is_floating_point", "requires_grad", "is_cuda", "layout", "element_size", "__len__"})


def find_head(model: nn.Module, name: str | None = None) -> tuple[str, nn.Linear]:
    """The head module to chunk: ``name``, or the model's output embeddings (transformers' ``get_output_embeddings()``).

    Raises :class:`PlanError` when there is none or it is not an ``nn.Linear``, saying how to name it."""
    modules = dict(model.named_modules())
    if name is None:
        getter = getattr(model, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        name = next((n for n, m in modules.items() if m is head), None) if head is not None else None
        if name is None:
            raise PlanError(f"{type(model).__name__} has no output embeddings to chunk (get_output_embeddings() gives "
                            "none); name the head: memopt.profile(..., head='chunked', head_module='lm_head')")
    if name not in modules:
        raise PlanError(f"no module named {name!r} in {type(model).__name__} to use as the chunked head")
    head = modules[name]
    if type(head) is not nn.Linear:
        raise PlanError(f"the chunked head must be an nn.Linear (the logits as hidden @ weight.T + bias); {name!r} is "
                        f"{type(head).__name__}")
    return name, head


# ====================================================================== the lazy logits
class LazyLogits(torch.Tensor):
    """Logits not yet computed: ``F.linear(hidden, weight, bias)`` followed by ``transforms`` (views, casts).

    ``.float()``, ``.to(dtype)``, ``.view``/``.reshape`` that keep the last (vocabulary) dimension, ``.contiguous()``
    and indexing that keeps it whole stay lazy; ``F.cross_entropy`` over 2-D lazy logits runs chunked; everything else
    computes the logits (exactly as the plain head, with their autograd graph) and runs on them.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    rows: int
    transforms: tuple[tuple[Callable[..., Any], tuple, dict], ...]
    lead: torch.Tensor  # the head's input reshaped/indexed as the logits' leading dimensions are

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
                transforms: tuple = (), lead: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                shape: Sequence[int] | None = None) -> LazyLogits:
        lead = hidden if lead is None else lead
        shape = tuple(lead.shape[:-1]) + (weight.shape[0],) if shape is None else tuple(shape)
        out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype or hidden.dtype, device=hidden.device,
                                                  requires_grad=False)
        out.hidden, out.weight, out.bias, out.rows = hidden, weight, bias, rows
        out.transforms, out.lead = tuple(transforms), lead
        return out

    def __tensor_flatten__(self) -> tuple[list[str], dict[str, Any]]:
        # what holds its memory (the head's input; the weight is a parameter): for meters and memory limits
        return ["hidden", "lead"], {}

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, size: Any, stride: Any) -> Any:
        raise NotImplementedError("lazy logits are not rebuilt from their parts")

    def __repr__(self) -> str:  # noqa: D105
        return repr(self.materialize())

    def materialize(self) -> torch.Tensor:
        """The logits, computed as the plain head computes them, then this object's views and casts applied."""
        out = F.linear(self.hidden, self.weight, self.bias)
        for func, args, kwargs in self.transforms:
            out = func(out, *args, **kwargs)
        return out

    def _then(self, func: Callable[..., Any], args: tuple, kwargs: dict, *, lead: torch.Tensor | None = None,
              dtype: torch.dtype | None = None, shape: Sequence[int] | None = None) -> LazyLogits:
        return LazyLogits(self.hidden, self.weight, self.bias, self.rows, self.transforms + ((func, args, kwargs),),
                          self.lead if lead is None else lead, dtype or self.dtype, shape)

    def _lazy(self, func: Any, args: tuple, kwargs: dict) -> LazyLogits | None:
        """This op on the lazy logits, still lazy; ``None`` where it must compute them."""
        name = getattr(func, "__name__", "")
        vocab = self.shape[-1]
        if name in ("float", "to") and not kwargs:
            dtype = torch.float32 if name == "float" else (args[0] if len(args) == 1 else None)
            if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
                return self._then(getattr(torch.Tensor, name), args, {}, dtype=dtype)
            return None
        if name == "contiguous" and not args and not kwargs:
            return self
        if name in ("view", "reshape") and not kwargs:
            shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
            if not all(isinstance(s, int) for s in shape) or not shape:
                return None
            shape = list(shape)
            known = math.prod(s for s in shape if s != -1)
            if -1 in shape:
                if shape.count(-1) > 1 or known == 0:
                    return None
                shape[shape.index(-1)] = self.numel() // known
            if shape[-1] != vocab or math.prod(shape) != self.numel():
                return None
            lead = self.lead.reshape(*shape[:-1], self.lead.shape[-1])
            return self._then(getattr(torch.Tensor, name), (tuple(shape),), {}, lead=lead, shape=shape)
        if name == "__getitem__" and not kwargs and len(args) == 1:
            index = args[0]
            if not isinstance(index, tuple) or not index or index[-1] != slice(None) or not all(
                    isinstance(i, (int, slice)) or i is Ellipsis for i in index):
                return None
            lead = self.lead[index]
            return self._then(torch.Tensor.__getitem__, (index,), {}, lead=lead,
                              shape=tuple(lead.shape[:-1]) + (vocab,))
        return None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: .shape, .dtype, .device ... (or .T, .mT: computed)
            name = getattr(getattr(func, "__self__", None), "__name__", "")
        if args and isinstance(args[0], LazyLogits):
            me = args[0]
            if name in _META:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            done = (_cross_entropy(me, *args[1:], **kwargs) if func is F.cross_entropy
                    else me._lazy(func, args[1:], kwargs))
            if done is not None:
                return done
        args, kwargs = torch.utils._pytree.tree_map_only(LazyLogits, LazyLogits.materialize, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # below autograd: only what escaped __torch_function__ (no graph is recorded here)
        args, kwargs = torch.utils._pytree.tree_map_only(LazyLogits, LazyLogits.materialize, (args, kwargs or {}))
        return func(*args, **kwargs)


# ====================================================================== the chunked loss
def _cross_entropy(logits: LazyLogits, target: torch.Tensor, weight: torch.Tensor | None = None,
                   size_average: Any = None, ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor | None:
    """``F.cross_entropy`` over lazy 2-D logits, chunked; ``None`` where that call is not one it chunks."""
    if (logits.dim() != 2 or weight is not None or size_average is not None or reduce is not None
            or label_smoothing != 0.0 or reduction not in _REDUCTIONS or not isinstance(target, torch.Tensor)
            or target.dim() != 1 or target.is_floating_point()):
        return None
    cast = logits.dtype
    rows = ChunkedCrossEntropy.apply(logits.lead, logits.weight, logits.bias, target, ignore_index, cast,
                                     logits.rows)
    return _reduce(rows, target, ignore_index, reduction)


def _reduce(rows: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The per-token losses reduced as ``F.cross_entropy`` reduces them, bit for bit: the same ``nll_loss`` kernel sums
    the same values (each token's log-probability of its target) in the same order, over one column."""
    if reduction == "none":
        return rows
    picked = torch.where(target == ignore_index, target, torch.zeros_like(target))
    return F.nll_loss((-rows).unsqueeze(1), picked, ignore_index=ignore_index, reduction=reduction)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``F.linear(hidden, weight, bias)`` (cast to ``cast``) against ``target``, ``rows``
    tokens at a time. Saves only its inputs; backward recomputes each chunk's logits. Returns the per-token losses
    (0 where ``target == ignore_index``), as ``F.cross_entropy(..., reduction="none")``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, ignore_index: int, cast: torch.dtype, rows: int) -> torch.Tensor:
        n = hidden.shape[0]
        out = torch.empty(n, dtype=cast, device=hidden.device)
        for i in range(0, n, rows):
            logits = F.linear(hidden[i:i + rows], weight, bias).to(cast)
            out[i:i + rows] = F.cross_entropy(logits, target[i:i + rows], ignore_index=ignore_index, reduction="none")
            del logits
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.ignore_index, ctx.cast, ctx.rows = ignore_index, cast, rows
        return out

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, target = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w: torch.Tensor | None = None
        grad_b: torch.Tensor | None = None
        for i in range(0, hidden.shape[0], ctx.rows):
            h = hidden[i:i + ctx.rows]
            with torch.enable_grad():
                logits = F.linear(h.detach(), weight.detach(), None if bias is None else bias.detach())
                logits.requires_grad_(True)
                per_token = F.cross_entropy(logits.to(ctx.cast), target[i:i + ctx.rows],
                                            ignore_index=ctx.ignore_index, reduction="none")
                (g,) = torch.autograd.grad(per_token, logits, grad_rows[i:i + ctx.rows])
            del per_token, logits
            if need_h:
                torch.mm(g, weight, out=grad_h[i:i + ctx.rows])
            if need_w:
                grad_w = g.t().mm(h) if grad_w is None else grad_w.addmm_(g.t(), h)
            if need_b and bias is not None:
                grad_b = g.sum(0) if grad_b is None else grad_b.add_(g.sum(0))
            del g
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                          reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))`` for a loss you write yourself.

    Under a plan with a chunked head, ``logits`` are :class:`LazyLogits` and the loss runs chunked (calling
    ``F.cross_entropy`` on lazy logits directly does the same); otherwise it is plain ``F.cross_entropy``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=ignore_index,
                           reduction=reduction)


# ====================================================================== installing it
class ChunkedHead:
    """While installed, ``module`` (an ``nn.Linear``) returns :class:`LazyLogits` in training: its logits are computed
    ``ceil(tokens / chunks)`` rows at a time by the loss (see the module docstring). :meth:`remove` puts its
    ``forward`` back exactly. Under ``torch.no_grad()``, ``torch.autocast`` or for a 1-D input it runs as always."""

    def __init__(self, module: nn.Linear, chunks: int) -> None:
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise PlanError(f"a chunked head needs a whole number of chunks >= 1, got {chunks!r}")
        self.module, self.chunks = module, chunks
        self._had_own = "forward" in module.__dict__
        self._previous = module.__dict__.get("forward")
        self._installed = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        if (not torch.is_grad_enabled() or x.dim() < 2 or torch.is_autocast_enabled(x.device.type)
                or isinstance(x, LazyLogits)):
            return F.linear(x, m.weight, m.bias)
        rows = max(1, math.ceil(x.numel() // x.shape[-1] / self.chunks))
        return LazyLogits(x, m.weight, m.bias, rows)

    def install(self) -> ChunkedHead:
        if not self._installed:
            self.module.forward = self
            self._installed = True
        return self

    def remove(self) -> None:
        if not self._installed:
            return
        if self._had_own:
            self.module.forward = self._previous
        else:
            self.module.__dict__.pop("forward", None)
        self._installed = False

    def __enter__(self) -> ChunkedHead:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.remove()
