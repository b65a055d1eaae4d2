"""More than one device: memory plans under DDP and FSDP2 (``torch.distributed.fsdp.fully_shard``), per rank.

memopt adds no distribution layer of its own: ranks are ``torch.distributed`` processes (``torchrun``), models
are wrapped with ``DistributedDataParallel`` or sharded with ``fully_shard``, and every rank applies the same plan to
its own replica or shard. This module adds the order that works, errors for the orders that do not, the per-rank
memory account (:func:`per_rank`) and a few helpers.

The order
---------
1. Build the **plain** model (same seed on every rank). Profile it and make a plan — on every rank, or on rank 0 and
   send it to the others with :func:`broadcast_plan`. Plan unit names are the plain model's (``"blocks.0"``).
2. **Wrap or shard** it: ``DDP(model)``, or :func:`fully_shard_units` (``fully_shard`` on every unit, then on the root).
3. **Apply** the plan to the wrapped model and train as usual::

       with memopt.plan(p, ddp_model):     # or ddp_model.module, or the fully_shard-ed root
           for x, y in loader: ...

   A DDP wrapper's module names gain a ``"module."`` prefix; :func:`unwrap` resolves the plan's names through it.
   FSDP2 keeps names but swaps every sharded module's class for ``FSDP<Class>`` and its parameters for DTensor shards;
   plan validation looks through both (:func:`plain_module_type`; DTensor shapes are the global ones).

Why this order, and what raises :class:`~memopt_nb.core.errors.WrapOrderError` instead:

* ``memopt.profile`` of a wrapped or sharded model. FSDP2's DTensor parameters have no storage the profiler can read
  (it failed with ``RuntimeError: Attempted to access the data pointer on an invalid python storage``); a DDP model
  profiles, but the profiler's extra steps then run all-reduces — every rank must profile in lockstep or the others
  hang — its unit times include communication, and the plan's names carry the ``module.`` prefix. The per-rank account
  comes from the plain profile instead (:func:`per_rank`), so one profile serves every world size.
* Sharding a model while a plan is applied to it (``with memopt.plan(p, model): fully_shard(...)``) raises at the next
  forward. The plan had validated, and the swap engine had recorded the storages of, parameters that ``fully_shard``
  then replaced; measured before this check existed, activations later allocated at the freed addresses were silently
  never offloaded — a different amount on each rank (11.39 MB vs 11.19 MB against 11.65 MB offloaded per step on
  both ranks in the right order). Wrapping with DDP inside a plan is harmless (DDP changes no module or parameter)
  and is not refused, but the documented order is the same for both.
* FSDP1 (``FullyShardedDataParallel`` wrapper, flat parameters, renamed modules) is not supported; use FSDP2.

What a plan does under FSDP2
----------------------------
``fully_shard`` all-gathers a module's parameters in a forward pre-hook (outside the unit's ``forward``, which is what
memopt replaces) and frees them after its forward; in backward it all-gathers them again before the unit's backward.
So a ``recompute`` unit re-runs its forward on parameters that are unsharded at that moment — the recomputation reads
the module's attributes, which FSDP2 points at the all-gathered tensors — and issues no extra collective. A ``swap``
unit never offloads them: the swap engine skips every saved tensor that is a parameter, shares a storage with one of
the unit's or the model's parameters at call time, or is a view of a parameter (FSDP2's unsharded parameters are views
of its all-gather buffers; the last rule also covers modules sharded *inside* a unit, all-gathered after the unit
started). Those storages are also held by FSDP itself, so they never become eligible for offload in the first place.

Whole-step plans (optimizer state, gradients, parameters)
---------------------------------------------------------
A schema-2 plan may also place each unit's optimizer state, gradients and parameters on the host
(:mod:`memopt_nb.runtime.state`). What applies where, checked by :func:`check_state_placements` when the plan is
entered (a :class:`~memopt_nb.core.errors.PlanError`, with nothing changed):

* **DDP** — placements apply per rank, to that rank's replica and optimizer: ``optimizer="offload"`` and
  ``params="offload"`` work as on one device and train bit-identically to DDP without a plan. ``grads="offload"`` and
  ``grads="step"`` are refused: DDP averages gradients across ranks *after* backward has accumulated them (its hooks
  run after memopt's), so a step in backward would use this rank's un-averaged gradients, and DDP's buckets hold a
  copy of every gradient anyway, so offloading them saves nothing. Pass the DDP wrapper itself to ``memopt.plan``
  (passing ``ddp.module`` hides DDP from this check).
* **FSDP2** — a plan that moves state is refused; plan activations only (``offload_state=False``). FSDP2 owns the
  parameters (DTensor shards it all-gathers around each unit), reduce-scatters the gradients and hands the optimizer
  shards; a second mechanism moving the same tensors would fight it. Each rank already holds only its shard of
  parameters, gradients and optimizer state (what :func:`per_rank` accounts), and when that shard does not fit, FSDP2's
  own ``fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=True))`` is the right tool: it keeps the shards on
  the host and runs the optimizer step on the CPU. That step is numerically different from a device step (results are
  close, not bit-identical to training without offload), whereas memopt's placements on one device or under DDP step
  on the device with the state streamed in and out and keep every bit.

:func:`per_rank` records what a rank may move (``profile.meta["state_movable"]``: nothing under FSDP2, optimizer
state and parameters under DDP), and the cost model offers planners only those placements, so a plan searched for a
rank's profile is one the rank can apply.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..core.errors import PlanError, ProfileError, WrapOrderError
from ..core.plan import Plan, plain_module_type
from ..core.profile import ProfileLike
from .hooks import uncopied

__all__ = [
    "broadcast_plan", "check_plain", "check_state_placements", "ddp_bucket_bytes", "ddp_bucket_view",
    "fsdp_modules", "fully_shard_units", "order_guard", "per_rank", "plain_module_type", "resized_storages", "unwrap",
]

SHARDINGS = (None, "ddp", "fsdp")


# ====================================================================== recognising wrapped / sharded models
def _fsdp() -> Any:
    """``torch.distributed.fsdp`` if something imported it (nothing can be sharded otherwise), else ``None``."""
    return sys.modules.get("torch.distributed.fsdp")


def is_ddp(model: Any) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2-sharded modules (``fully_shard``) in ``model``, outermost first."""
    fsdp = _fsdp()
    if fsdp is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def _fsdp1_modules(model: nn.Module) -> list[nn.Module]:
    fsdp = _fsdp()
    if fsdp is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FullyShardedDataParallel)]


def unwrap(model: nn.Module) -> nn.Module:
    """The module a plan's unit names refer to: a DDP wrapper's ``.module``; any other model itself.

    Raises :class:`WrapOrderError` for FSDP1, whose wrappers rename modules and flatten parameters.
    """
    while is_ddp(model):
        model = model.module
    if isinstance(model, nn.Module) and _fsdp1_modules(model):
        raise WrapOrderError("FSDP1 (FullyShardedDataParallel) is not supported: it flattens parameters and renames "
                             "modules; shard with FSDP2 instead — torch.distributed.fsdp.fully_shard, or "
                             "memopt.distributed.fully_shard_units(model, plan)")
    return model


def check_state_placements(wrapped: nn.Module, model: nn.Module, plan: Plan) -> None:
    """Raise :class:`~memopt_nb.core.errors.PlanError` if ``plan``'s state placements cannot apply to this (wrapped or
    sharded) model; see "Whole-step plans" in this module's docs. ``wrapped`` is what the user passed, ``model`` the
    module the plan's names refer to."""
    if not plan.moves_state:
        return
    sharded = fsdp_modules(model)
    if sharded:
        raise PlanError(
            "this plan moves optimizer state, gradients or parameters, and the model is sharded with fully_shard "
            "(FSDP2): FSDP2 owns those tensors (DTensor shards, its own gradient reduce-scatter and all-gathers), so "
            "memopt does not move them. Use FSDP2's own offload for that: fully_shard(..., "
            "offload_policy=CPUOffloadPolicy()) keeps this rank's parameter, gradient and optimizer-state shards on "
            "the host and runs the optimizer step there (numerically different from a device step: not "
            "bit-identical to training without it). Then plan activations only: memopt.search(profile, budget, "
            "offload_state=False)")
    if is_ddp(wrapped):
        moved = [d.unit for d in plan.decisions if d.grads != "resident"]
        if moved:
            more = " …" if len(moved) > 3 else ""
            raise PlanError(
                f"this plan offloads or steps in backward the gradients of units {', '.join(moved[:3])}{more}, and "
                "the model is wrapped with DistributedDataParallel: DDP averages gradients across ranks after "
                "backward has accumulated them (in its own buckets, which hold a copy of every gradient anyway), so "
                "offloading them saves nothing and stepping in backward would step on this rank's un-averaged "
                "gradients. Under DDP a plan may offload optimizer state and parameters per rank; plan with "
                "memopt.search(profile, budget, offload_state={'optimizer', 'params'})")


def check_plain(model: nn.Module, what: str = "profile") -> None:
    """Raise :class:`WrapOrderError` unless ``model`` is plain: not DDP-wrapped, nothing in it sharded."""
    hint = (f"memopt.{what}() needs the plain model: {what} it before wrapping/sharding, then wrap or shard it and "
            "apply the plan to the wrapped model — `with memopt.plan(p, wrapped_model):` (see "
            "memopt_nb.runtime.distributed)")
    if is_ddp(model):
        raise WrapOrderError(f"got a DistributedDataParallel-wrapped model; {hint}. (Profiling it would run "
                             "all-reduces inside the profiler's steps and name units 'module.…'.)")
    if _fsdp1_modules(model):
        raise WrapOrderError(f"got an FSDP1 (FullyShardedDataParallel) model; {hint}")
    sharded = fsdp_modules(model)
    if sharded:
        names = {m: n for n, m in model.named_modules()}
        shown = ", ".join(repr(names[m]) for m in sharded[:3]) + (" …" if len(sharded) > 3 else "")
        raise WrapOrderError(f"got a model sharded with fully_shard ({shown}); its parameters are DTensor shards. "
                             f"{hint}; memopt.distributed.per_rank(profile, world_size, 'fsdp') accounts what each "
                             "rank then holds")


class _OrderGuard:
    """The pre-hook :func:`order_guard` installs (registered :func:`~memopt_nb.runtime.hooks.uncopied`: a copy or
    pickle of the model gets a hook that does nothing)."""

    def __init__(self, expected: list[tuple[str, nn.Module, type]]) -> None:
        self.expected = expected

    def __call__(self, module: nn.Module, args: Any) -> None:
        for label, m, cls in self.expected:
            if type(m) is not cls:
                raise WrapOrderError(
                    f"{label} was sharded (fully_shard) after `memopt.plan` was applied to it: it is now "
                    f"{type(m).__name__}, and the plan had recorded parameters that sharding replaced. Leave the "
                    "`with memopt.plan(...)` block, shard first, then enter `with memopt.plan(p, model)`.")


def order_guard(model: nn.Module, units: Sequence[nn.Module], names: Sequence[str]) -> Any:
    """A forward pre-hook on ``model`` that raises if it or a unit was sharded after the plan was applied.

    ``fully_shard`` swaps the class of every module it shards, so comparing classes with those at apply time is
    exact and costs one check per unit per forward. Returns the hook handle (``.remove()`` it with the plan). The
    hook survives ``copy.deepcopy`` and ``torch.save`` of the model as a hook that does nothing.
    """
    expected = [("the model", model, type(model))] + [(repr(n), m, type(m)) for n, m in zip(names, units)]
    return model.register_forward_pre_hook(uncopied(_OrderGuard(expected)))


def resized_storages(model: nn.Module) -> list[torch.UntypedStorage]:
    """Storages FSDP2 frees and re-allocates in place, outside the dispatcher (``UntypedStorage.resize_``).

    These are the all-gather outputs that hold each sharded module's unsharded parameters. A dispatch-mode memory
    tracker sees them created but not resized; :meth:`StorageTracker.watch` re-reads them around every operator.
    They exist after the first all-gather (one warm-up step). Uses FSDP2 internals (``_get_fsdp_state``,
    ``fsdp_params``, ``all_gather_outputs``); returns what it finds, ``[]`` for models that are not sharded.
    """
    out: list[torch.UntypedStorage] = []
    for m in fsdp_modules(model):
        state = m._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
        for group in groups:
            for fp in getattr(group, "fsdp_params", None) or ():
                tensors = list(getattr(fp, "all_gather_outputs", ()) or ())
                tensors += list(getattr(fp, "_unsharded_inner_tensors", ()) or ())
                out.extend(t.untyped_storage() for t in tensors)
    return out


# ====================================================================== helpers for training scripts
def _unit_names(units: Any) -> list[str]:
    if isinstance(units, Plan):
        return units.units
    names = getattr(units, "unit_names", None)
    if names is not None:
        return list(names)
    if isinstance(units, (list, tuple)) and all(isinstance(n, str) for n in units):
        return list(units)
    raise ProfileError(f"units must be a Plan, a ModelProfile or a list of module names, got {type(units).__name__}")


def fully_shard_units(model: nn.Module, units: Any, **kwargs: Any) -> nn.Module:
    """Shard ``model`` the way :func:`per_rank` with ``sharding="fsdp"`` accounts it.

    ``fully_shard`` on every unit (``units``: a Plan, a ModelProfile or module names), then on the root, so each unit
    is one all-gather group and the parameters outside units belong to the root. ``kwargs`` go to ``fully_shard``
    (``mesh=...``); the account assumes its defaults (``reshard_after_forward=True``, no mixed precision, no CPU
    offload). Returns the model, sharded in place.
    """
    from torch.distributed.fsdp import fully_shard

    for name in _unit_names(units):
        fully_shard(model.get_submodule(name), **kwargs)
    fully_shard(model, **kwargs)
    return model


def broadcast_plan(plan: Plan | None, src: int = 0, model: nn.Module | None = None, group: Any = None) -> Plan:
    """Send rank ``src``'s plan to every rank (a collective: call it on all ranks; other ranks pass ``None``).

    Plans made by a search depend on measured times, so ranks that plan on their own may disagree; one plan for all
    keeps every rank's memory the same. On the other ranks the plan is tied to ``model`` (if given), so
    ``memopt.plan(p)`` finds it.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    if rank == src and not isinstance(plan, Plan):
        raise WrapOrderError(f"rank {src} must pass the plan to broadcast, got {type(plan).__name__}")
    box = [plan.to_json() if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    if rank == src:
        return plan  # type: ignore[return-value]
    out = Plan.from_json(box[0])
    if model is not None:
        out._model_ref = weakref.ref(unwrap(model))
    return out


def ddp_bucket_bytes(ddp: nn.Module) -> int:
    """Bytes of a DDP model's gradient buckets, as DDP reports them (after its first step, the rebuilt buckets)."""
    if not is_ddp(ddp):
        raise ProfileError(f"ddp_bucket_bytes() needs a DistributedDataParallel model, got {type(ddp).__name__}")
    data = ddp._get_ddp_logging_data()
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    return sum(int(x) for x in str(sizes).split(",") if x.strip())


def ddp_bucket_view(ddp: nn.Module) -> bool:
    """Whether a DDP model's gradients are views into its buckets (``gradient_as_bucket_view=True``)."""
    return bool(ddp._get_ddp_logging_data().get("gradient_as_bucket_view"))


# ====================================================================== per-rank account
def _padded_unit_bytes(profile: ProfileLike, index: int, nbytes: int, world_size: int) -> int:
    """A unit's all-gathered parameter bytes: FSDP2 pads every parameter's dim 0 to a multiple of the shard count."""
    fp = profile.fingerprint[index] if index < len(profile.fingerprint) else {}
    shapes = fp.get("param_shapes") or []
    numel = sum(math.prod(s) for s in shapes)
    if not numel:
        return nbytes
    padded = sum(math.ceil((s[0] if s else 1) / world_size) * world_size * math.prod(s[1:]) for s in shapes)
    return int(round(nbytes * padded / numel))


def _check_per_rank(profile: ProfileLike, world_size: int, sharding: str | None) -> None:
    """:class:`ProfileError` for a sharding or world size :func:`per_rank` does not know, or a per-rank profile."""
    if sharding not in SHARDINGS:
        raise ProfileError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ProfileError(f"world_size must be a positive int, got {world_size!r}")
    if profile.meta.get("per_rank"):
        raise ProfileError("this profile is already per rank; pass the plain model's profile")


def _shift_levels(out: Any, deltas: list[tuple[float, float]], scale: list[float]) -> None:
    """Each segment's start level and peak (its own part scaled by ``scale``) moved by ``deltas`` (what one rank holds
    more or less at the segment's start and at its peak), and the units' recomputed peaks with them."""
    for k, seg in enumerate(out.segments):
        d0, d1 = deltas[k]
        seg.start_level = int(seg.start_level + d0)
        seg.rel_peak = int(max(0, round(seg.rel_peak * scale[k]) + d1 - d0))
    for u in out.units:
        f0, f1 = deltas[u.fwd_segment]
        b0, b1 = deltas[u.bwd_segment]
        u.rc_fwd_rel_peak = int(max(0, u.rc_fwd_rel_peak + f1 - f0))
        u.rc_bwd_rel_peak = int(max(0, u.rc_bwd_rel_peak + b1 - b0))


def per_rank(profile: ProfileLike, world_size: int, sharding: str | None = "fsdp", *, ddp: nn.Module | None = None,
             bucket_bytes: int | None = None, gradient_as_bucket_view: bool | None = None) -> ProfileLike:
    """What one rank holds: a copy of ``profile`` whose memory is that of one of ``world_size`` ranks.

    Give it the profile of the **plain** model at the per-rank batch size; plan and simulate with the result as with
    any profile (``memopt.simulate(per_rank(prof, 2), p)``, ``solvers.optimal(per_rank(prof, 2), budget=...)``).
    Plans made for it are plans of the plain model (same units), applied on every rank.

    Why a transform of a profile and not ``memopt.profile(..., world_size=)``: the profiler must run on the plain model
    anyway (see the module docstring), the per-rank difference is arithmetic on quantities a profile already has
    (parameter, gradient and optimizer-state bytes, per-unit parameters, the timeline), so one profile — made on one
    device, or loaded from JSON, with no process group — can be re-targeted to any world size and both shardings.

    The model (``P``: parameter bytes, ``G``: gradient bytes, ``O``: optimizer-state bytes of the plain model,
    ``P_u``: parameters of unit ``u``, ``R = P - sum(P_u)``: parameters outside units, ``N = world_size``):

    * ``sharding=None``: the profile unchanged (each rank trains its own copy without communication).
    * ``"ddp"``: full replicas, so the plain timeline plus DDP's gradient buckets ``B`` for the whole step (allocated
      at construction). ``B`` is ``bucket_bytes``, else what ``ddp`` (the wrapped model, after one step) reports, else
      ``G``. With ``gradient_as_bucket_view`` the gradients live in the buckets, so gradients present in the plain
      timeline (a unit's from the segment after its backward, all of them after the backward) are subtracted.
    * ``"fsdp"``: FSDP2 with :func:`fully_shard_units`' layout and ``fully_shard`` defaults. Everywhere, parameters
      and optimizer state are the rank's shard: ``P`` → ``P/N`` (each parameter's dim 0 padded to a multiple of
      ``N``, as FSDP2 does; units' shapes come from the fingerprint), ``O`` → ``O/N``. A unit's gradients become
      ``G_u/N`` once reduce-scattered (from the segment after its backward); the root's, after the backward. On top,
      the all-gathered (unsharded) parameters alive in each segment:

      - before the first unit: none at its start; the root's and unit 0's gathers (``2R + 2·P_0``) at its peak;
      - forward of unit ``u``: ``R + 2·P_u`` (the root stays gathered through the backward; a unit's unsharded
        parameters plus the all-gather output FSDP2 keeps until the next all-gather); between units ``u`` and
        ``u+1``, ``P_{u+1}`` more at the peak (the next gather);
      - after the last forward: ``R`` (plus ``2·P_{n-1}`` until it is resharded);
      - backward of unit ``u``: ``R + 2·P_u + P_{u-1}`` (FSDP2 prefetches the next unit's gather in backward); for
        the last unit ``R + P_u`` at its start and ``R + P_u + P_{u-1}`` at its peak; between backwards, the
        preceding unit's amount;
      - optimizer step and ``zero_grad``: none, all gradients sharded; the optimizer's temporaries scale with ``1/N``.

      Each rank computes on its own batch, so activations and the plan's savings are the plain profile's.

    Segments where FSDP2 frees an all-gather buffer early are over-predicted by at most one unit's parameters;
    ``tests/test_distributed.py`` checks the per-rank prediction against :func:`memopt.measure` on CPU/gloo.
    Not modelled: mixed precision (``param_dtype``), ``reshard_after_forward=False``, CPU offload, hybrid sharding,
    explicit prefetching, and other layouts than :func:`fully_shard_units`.
    """
    _check_per_rank(profile, world_size, sharding)
    out = type(profile).from_dict(profile.to_dict())
    out._model_ref = profile._model_ref
    info: dict[str, Any] = {"world_size": world_size, "sharding": sharding}
    out.meta["per_rank"] = info
    # what a whole-step plan may move on a rank (check_state_placements refuses the rest): FSDP2 owns parameters,
    # gradients and optimizer state (use its CPUOffloadPolicy); DDP reduces gradients itself
    if sharding == "fsdp":
        out.meta["state_movable"] = []
    elif sharding == "ddp":
        out.meta["state_movable"] = ["optimizer", "params"]
    if sharding is None:
        return out
    segs = out.segments
    if sharding == "ddp":
        deltas = _ddp_deltas(out, ddp, bucket_bytes, gradient_as_bucket_view, info)
        scale = [1.0] * len(segs)
    else:
        deltas, scale = _fsdp_deltas(out, world_size, info)
    _shift_levels(out, deltas, scale)
    out.start_level = segs[0].start_level if segs else out.start_level
    info["plain_peak_bytes"] = profile.peak_bytes
    out.peak_bytes = int(max((s.start_level + s.rel_peak for s in segs), default=out.peak_bytes))
    if sharding == "fsdp":  # what one rank holds of them
        out.param_bytes = info["param_bytes"]
        out.grad_bytes = info["grad_bytes"]
        out.optimizer_state_bytes = info["optimizer_state_bytes"]
    return out


def _phases(profile: ProfileLike) -> tuple[list[int], list[int], int]:
    fwd = [u.fwd_segment for u in profile.units]
    bwd = [u.bwd_segment for u in profile.units]
    labels = [s.label for s in profile.segments]
    end = labels.index("to backward_end") if "to backward_end" in labels else max(bwd) + 1
    return fwd, bwd, end


def _ddp_deltas(prof: ProfileLike, ddp: nn.Module | None, bucket_bytes: int | None, view: bool | None,
                info: dict[str, Any]) -> list[tuple[float, float]]:
    if bucket_bytes is None and ddp is not None:
        bucket_bytes = ddp_bucket_bytes(ddp)
    if view is None:
        view = ddp_bucket_view(ddp) if ddp is not None else False
    b = int(bucket_bytes) if bucket_bytes else int(prof.grad_bytes)
    info.update(bucket_bytes=b, gradient_as_bucket_view=view)
    n = prof.n_units
    fwd, bwd, end = _phases(prof)
    ratio = prof.grad_bytes / prof.param_bytes if prof.param_bytes else 0.0
    grads = [u.param_bytes * ratio for u in prof.units]
    out = []
    for k, _ in enumerate(prof.segments):
        present = 0.0
        if view:
            present = prof.grad_bytes if k > end else sum(grads[v] for v in range(n) if bwd[v] < k)
        out.append((b - present, b - present))
    return out


def _fsdp_deltas(prof: ProfileLike, N: int, info: dict[str, Any]) -> tuple[list[tuple[float, float]], list[float]]:
    n = prof.n_units
    fwd, bwd, end = _phases(prof)
    P, opt = prof.param_bytes, prof.optimizer_state_bytes
    ratio = prof.grad_bytes / P if P else 0.0
    full = [u.param_bytes for u in prof.units]
    gathered = [_padded_unit_bytes(prof, i, full[i], N) for i in range(n)]  # the unit's all-gather, per rank
    R = max(0, P - sum(full))  # parameters outside units: the root's group
    shard = sum(gathered) / N + math.ceil(R / N)
    base = (P - shard) + (opt - opt * shard / P if P else 0.0)  # held by every rank in the plain profile, not here
    red = [full[u] * ratio - gathered[u] / N * ratio for u in range(n)]  # a unit's gradients once reduce-scattered
    g_root = max(0.0, prof.grad_bytes - sum(full[u] * ratio for u in range(n)))
    red_root = g_root - g_root / N
    info.update(param_bytes=int(shard), optimizer_state_bytes=int(opt * shard / P) if P else 0,
                grad_bytes=int(prof.grad_bytes * shard / P) if P else 0, root_param_bytes=int(R),
                unit_all_gather_bytes=gathered)

    def bwd_ag(u: int) -> tuple[int, int]:  # all-gathered bytes at the start and peak of unit u's backward
        prev = gathered[u - 1] if u > 0 else 0
        if u == n - 1:
            return R + gathered[u], R + gathered[u] + prev
        return R + 2 * gathered[u] + prev, R + 2 * gathered[u] + prev

    deltas, scale = [], []
    for k, seg in enumerate(prof.segments):
        s = 1.0
        if seg.kind == "fwd":
            a0 = a1 = R + 2 * gathered[seg.unit]
            gr = 0.0
        elif seg.kind == "bwd":
            a0, a1 = bwd_ag(seg.unit)
            gr = sum(red[v] for v in range(seg.unit + 1, n))
        elif k < fwd[0]:
            a0, a1, gr = 0, 2 * R + 2 * gathered[0], 0.0
        elif k < fwd[n - 1]:
            u = max(v for v in range(n) if fwd[v] < k)
            a0 = R + 2 * gathered[u]
            a1 = a0 + gathered[u + 1]
            gr = 0.0
        elif k < bwd[n - 1]:
            gr = 0.0
            if k == fwd[n - 1] + 1:
                a0 = a1 = R + 2 * gathered[n - 1]
            elif k == bwd[n - 1] - 1:
                a0, a1 = R, R + gathered[n - 1]
            else:
                a0 = a1 = R
        elif k <= end:
            u = min(v for v in range(n) if bwd[v] < k)
            a0 = a1 = bwd_ag(u)[1]
            gr = sum(red[v] for v in range(u + 1, n))
        else:
            a0 = a1 = 0
            gr = sum(red) + red_root
            if seg.label == "to optimizer_end":
                s = 1.0 / N
        deltas.append((a0 - base - gr, a1 - base - gr))
        scale.append(s)
    return deltas, scale
