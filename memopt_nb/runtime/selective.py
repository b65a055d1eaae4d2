"""Selective checkpointing's caching modes: two lean dispatch modes that keep the outputs of a save-set's op
calls in the forward and hand them to the recomputation (torch's selective-checkpointing rules at a fraction of
its per-op cost), and :class:`DirectSaves`, which skips the recomputation of a unit whose backward needs only
tensors it holds anyway.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from .storages import is_plain

__all__ = ["DirectSaves", "caching_modes", "sac_counts_op", "save_policy"]


def sac_counts_op(func: Any) -> bool:
    """Whether selective checkpointing counts calls of ``func`` (it skips a few bookkeeping ops such as ``detach``):
    the call indices of a save-set are counted the same way."""
    return func not in SAC_IGNORED_OPS


_UNSEEN = object()
#: what a kept call's entry becomes once the recomputation has taken it (the reference is dropped there)
_TAKEN = object()
#: what :meth:`_Kept.take` returns for an output changed in place after its forward
_CHANGED = object()


class _SaveSet:
    """A save-set's op calls, looked up by op: ``indices(func)`` is the set of call indices of ``func`` to keep, or
    ``None`` when no call of it is kept (then it is neither counted nor looked at again: the common, cheap case).

    One per save-set, shared by every forward of its unit: the op-to-indices table fills as ops are first seen."""

    __slots__ = ("wanted", "by_op")

    def __init__(self, save_ops: Any) -> None:
        wanted: dict[str, set[int]] = {}
        for op, i in save_ops:
            wanted.setdefault(str(op), set()).add(int(i))
        self.wanted = {k: frozenset(v) for k, v in wanted.items()}
        self.by_op: dict[Any, frozenset[int] | None] = {}

    def indices(self, func: Any) -> frozenset[int] | None:
        found = self.by_op.get(func, _UNSEEN)
        if found is _UNSEEN:
            # ops torch's selective checkpointing ignores (``detach``, metadata queries) are never counted, as
            # ``record_ops`` does not count them either
            found = self.by_op[func] = None if func in SAC_IGNORED_OPS else self.wanted.get(str(func))
        return found  # type: ignore[return-value]


def _detach(x: Any) -> Any:
    """Detach a kept output as torch's selective checkpointing does: a view made beneath autograd keeps its version
    counter shared with its base (so a later in-place change is seen), and the kept tensor has no autograd history
    (so the recomputation's autograd can make it a view again, and no reference cycle forms)."""
    if isinstance(x, torch.Tensor):
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            return x.detach()
    return x


class _Kept:
    """One kept op output (a tensor, or a tuple or list of them), detached, with the version counters it had."""

    __slots__ = ("value", "versions")

    def __init__(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self.value = _detach(out)
            self.versions = out._version
        else:
            self.value = tree_map(_detach, out)
            self.versions = [v._version if isinstance(v, torch.Tensor) else None for v in tree_leaves(self.value)]

    def take(self) -> Any:
        """The kept output, or :data:`_CHANGED` where it was changed in place since (its call must then run again)."""
        value = self.value
        if isinstance(value, torch.Tensor):
            changed = value._version != self.versions
        else:
            changed = any(v is not None and t._version != v for t, v in zip(tree_leaves(value), self.versions))
        return _CHANGED if changed else value


def _code_skipper() -> Callable[[Any], None] | None:
    try:
        from torch._C._dynamo.eval_frame import _FrameAction as FrameAction
        from torch._C._dynamo.eval_frame import _FrameExecStrategy as FrameExecStrategy
        from torch._C._dynamo.eval_frame import set_code_exec_strategy
    except Exception:  # noqa: BLE001 - a torch without these: keep TorchDispatchMode's own wrapper
        return None
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)  # this frame and every frame it calls
    return lambda code: set_code_exec_strategy(code, strategy)


_SKIP_CODE = _code_skipper()
_DYNAMO_SKIPS_CODE = _SKIP_CODE is not None


class _LeanMode(TorchDispatchMode):
    """A dispatch mode whose ``__torch_dispatch__`` runs as is, without the ``torch._dynamo.disable`` wrapper
    ``TorchDispatchMode`` puts around every subclass's: that wrapper switches the frame evaluator twice per op, which
    costs many times a small CPU op itself. Dynamo is kept out of the subclasses' ``__torch_dispatch__`` all the same,
    once per code object (:func:`_keep_dynamo_out`): those
    frames and everything they call are skipped, as the wrapper would."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _DYNAMO_SKIPS_CODE

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def _keep_dynamo_out(cls: type) -> type:
    if _SKIP_CODE is not None:
        _SKIP_CODE(cls.__dict__["__torch_dispatch__"].__code__)
    return cls


@_keep_dynamo_out
class _KeepCalls(_LeanMode):
    """Around a selective unit's first forward: counts the calls of each op of the save-set and keeps (detached) the
    outputs of the listed calls in ``storage``; every other op runs untouched, at the cost of one lookup.

    What torch's ``create_selective_checkpoint_contexts`` caching mode does for a policy that saves exactly these
    calls (same counting, same detach, same lifetime of what is kept), without its per-op policy call, context
    object, compile checks and storage-key computation, which cost several times the lookup here."""

    def __init__(self, save_set: _SaveSet, storage: dict[tuple[Any, int], Any]) -> None:
        super().__init__()
        self.save_set, self.storage = save_set, storage
        self.by_op = save_set.by_op
        self.counts: dict[Any, int] = {}
        #: while a :class:`DirectSaves` watches the forward: the storages of the kept outputs (see there)
        self.direct: dict[int, torch.Tensor] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        wanted = self.by_op.get(func, _UNSEEN)
        if wanted is _UNSEEN:
            wanted = self.save_set.indices(func)
        out = func._op(*args, **(kwargs or {}))  # the OpOverload's C++ op, one Python frame less
        if wanted is not None:
            n = self.counts.get(func, 0)
            self.counts[func] = n + 1
            if n in wanted:
                kept = self.storage[(func, n)] = _Kept(out)
                if self.direct is not None:
                    value = kept.value
                    _hold_storages(self.direct, (value,) if isinstance(value, torch.Tensor) else tree_leaves(value))
        return out


@_keep_dynamo_out
class _ReplayCalls(_LeanMode):
    """Around a selective unit's recomputation: the listed calls return what :class:`_KeepCalls` kept (dropping the
    reference, so it lives on only where the recomputed autograd graph saves it), every other op runs again.

    A kept tensor changed in place since (a dropout mask scaled in place) is not handed back: its call runs again,
    which reaches the value the forward had there (torch's cached mode refuses such a tensor). Like torch it refuses a
    second backward through the same forward (its entries are taken); a listed call the forward never made is a
    mismatch between the two runs."""

    def __init__(self, save_set: _SaveSet, storage: dict[tuple[Any, int], Any]) -> None:
        super().__init__()
        self.save_set, self.storage = save_set, storage
        self.by_op = save_set.by_op
        self.counts: dict[Any, int] = {}

    def __enter__(self) -> _ReplayCalls:
        self.counts.clear()  # each recomputation counts from the start (a retained graph's second backward too)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        wanted = self.by_op.get(func, _UNSEEN)
        if wanted is _UNSEEN:
            wanted = self.save_set.indices(func)
        if wanted is None:
            return func._op(*args, **(kwargs or {}))
        n = self.counts.get(func, 0)
        self.counts[func] = n + 1
        if n not in wanted:
            return func._op(*args, **(kwargs or {}))
        entry = self.storage.get((func, n))
        if entry is None:
            raise RuntimeError(f"{func} call {n} is kept by a selective unit but its forward made no such call: the "
                               "recomputation differs from the forward (nondeterministic ops or global state that "
                               "changed between forward and backward)")
        if entry is _TAKEN:
            raise RuntimeError("Trying to backward an extra time. You are only allowed to backward once on any "
                               "region computed under selective activation checkpoint.")
        self.storage[(func, n)] = _TAKEN
        value = entry.take()
        if value is _CHANGED:  # changed in place after the forward (a dropout mask scaled in place, a ReLU_ on it):
            return func._op(*args, **(kwargs or {}))  # the replay reaches the same state, so the call runs again
        return value


def _storage_key(t: Any) -> int | None:
    """The identity of a plain tensor's storage while it lives (``None`` for other tensors and empty storages)."""
    if not is_plain(t, parameters=True):
        return None
    st = t.untyped_storage()
    return st._cdata if st.nbytes() else None


def _hold_storages(held: dict[int, torch.Tensor], tensors: Any) -> None:
    """Note the storages of ``tensors`` (an iterable; other items are skipped) in ``held``."""
    for t in tensors:
        key = _storage_key(t)
        if key is not None:
            held[key] = t


class _Saved:
    """What a selective unit's forward packs for one tensor autograd saves: checkpoint's own holder (the
    recomputation fills it) and, while the tensor is one the unit holds anyway, the tensor itself."""

    __slots__ = ("holder", "value", "version")

    def __init__(self, holder: Any) -> None:
        self.holder = holder
        self.value: torch.Tensor | None = None
        self.version = 0


class DirectSaves:
    """Lets a selective unit skip its recomputation when it would recompute nothing that backward needs.

    Inside the unit's first forward (beneath checkpoint's saved-tensor hooks, so it sees every tensor autograd saves
    there first) each saved tensor is still handed to checkpoint's pack hook, and it is noted whether its storage is
    one the unit holds anyway: that of an output its save-set keeps, of one of its own parameters or buffers, or of one
    of its inputs (which the checkpoint keeps) — the tensor itself or a view or alias of it (``weight.t()`` of a
    linear layer, the ``_unsafe_view`` of a kept ``bmm``). When *every* saved tensor is such a tensor, backward gets
    them directly: checkpoint's holders are never unpacked, so the unit is never run again, and at its first unpack the
    kept outputs nothing saved are dropped (where the recomputation would have taken them). Otherwise nothing
    changes: the direct references are dropped when the forward ends and every unpack goes through checkpoint, which
    recomputes.

    The values are the tensors autograd saved, at the versions it saved them (what training without a plan uses; the
    recomputation, replaying the same ops from the same state, would produce the same values), so results are
    bit-identical; what is held and when is what the profiler measures, as it runs units through this same code. A
    tensor changed in place between the forward and its use in backward is refused, as autograd refuses it.
    """

    __slots__ = ("storage", "all_direct", "saved", "unpacked")

    def __init__(self, storage: dict[tuple[Any, int], Any]) -> None:
        self.storage = storage
        self.all_direct = True
        self.saved: list[_Saved] = []
        self.unpacked = False

    def run(self, caching: _KeepCalls, forward: Callable[..., Any], modules: list[nn.Module], args: tuple,
            kwargs: dict) -> Any:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if hooks is None:  # not under checkpoint's hooks (nothing is saved for backward)
            with caching:
                return forward(*args, **kwargs)
        ck_pack, ck_unpack = hooks
        held: dict[int, torch.Tensor] = {}  # storage -> a tensor on it, for every storage the unit holds anyway
        for m in modules:
            for group in (m._parameters, m._buffers):
                _hold_storages(held, group.values())
        _hold_storages(held, tree_leaves((args, kwargs)))
        saved = self.saved

        def pack(x: torch.Tensor) -> _Saved:
            s = _Saved(ck_pack(x))
            key = _storage_key(x)
            if key is None or key not in held:
                self.all_direct = False
                return s
            s.value = x.detach()  # detached: no reference cycle through x's grad_fn
            s.version = x._version
            saved.append(s)
            return s

        def unpack(s: _Saved) -> torch.Tensor:
            value = s.value
            if value is None:
                return ck_unpack(s.holder)
            if not self.unpacked:
                self.unpacked = True
                self.storage.clear()  # kept outputs nothing saved go now, as the recomputation would take them
            if value._version != s.version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"[{value.type()} {list(value.shape)}] is at version {value._version}; expected version "
                    f"{s.version} instead (a tensor saved inside a selective unit of a memopt plan)")
            return value

        caching.direct = held
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), caching:
                out = forward(*args, **kwargs)
        finally:
            caching.direct = None
            held.clear()  # autograd may keep the pack hook (and so this dict) as long as it keeps what was saved
        if not self.all_direct:  # the recomputation runs: hold nothing beyond what it would
            for s in saved:
                s.value = None
        saved.clear()  # (the pack hook refers to this list too) each value is held by its saved variable alone
        return out


def caching_modes(save_ops: Any) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The two modes :func:`checkpointed` enters around a selective unit's first forward and its recomputation: the
    first keeps the outputs of the ``save_ops`` calls, the second hands them back instead of running those calls.

    ``save_ops``: ``(op name, call index)`` pairs, the index counted per op over the unit's forward
    (``("aten.mm.default", 1)`` is its second ``mm``), as :func:`memopt_nb.profiling.profile` lists them in a unit's
    ``save_sets``; every op not listed is recomputed in backward. What torch's selective checkpointing
    (``create_selective_checkpoint_contexts`` with a policy saving these calls, :func:`save_policy`) does, with the same
    results and memory, at a fraction of its per-op cost (see :class:`_KeepCalls`)."""
    save_set = _save_set(tuple((str(op), int(i)) for op, i in save_ops))
    storage: dict[tuple[Any, int], Any] = {}
    return _KeepCalls(save_set, storage), _ReplayCalls(save_set, storage)


@functools.lru_cache(maxsize=256)
def _save_set(save_ops: tuple[tuple[str, int], ...]) -> _SaveSet:
    return _SaveSet(save_ops)


def save_policy(save_ops: Any) -> Callable[[], tuple[Any, Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that keeps the outputs of the listed op calls with torch's own
    selective checkpointing (``create_selective_checkpoint_contexts``): the reference :func:`caching_modes` is
    checked against, and a way to run a save-set under torch's checkpoint directly.

    ``save_ops`` as for :func:`caching_modes`; every other op is recomputed in backward.
    """
    wanted = frozenset((str(op), int(i)) for op, i in save_ops)

    def context_fn() -> tuple[Any, Any]:
        counts: collections.Counter[str] = collections.Counter()

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if ctx.is_recompute:  # torch replays the first forward's decisions; asked only in the forward here
                return CheckpointPolicy.PREFER_RECOMPUTE
            name = str(func)
            index = counts[name]
            counts[name] += 1
            return CheckpointPolicy.MUST_SAVE if (name, index) in wanted else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


