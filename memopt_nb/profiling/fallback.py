"""Profiling a step that does not fit the device: profiles at smaller batches, extrapolated in the batch.

:func:`memopt_nb.profile` first runs as it always does. When the unplanned step runs out of memory
(``torch.OutOfMemoryError``, on CUDA or under :func:`memopt_nb.limit_memory`), it is cleaned up (the profile restores
the model, optimizer and RNG; the failed step's tensors are freed) and the same model is profiled at smaller batches
that fit: the largest of ``B/2, B/4, …`` that fits (``hi``), then ``hi/2`` and ``hi/4``. Every per-unit byte count and
time (saved and interior bytes, inputs and outputs, segment levels and peaks, storage groups, step peak) is then a
line through the two largest, evaluated at ``B``; parameters, gradients and optimizer state, which do not grow with
the batch, come out unchanged. The third batch checks the line: where a byte count it predicts there is off by more
than :data:`LINEAR_TOLERANCE` the profile is refused with a :class:`~memopt_nb.errors.ProfileError` naming the unit and
field, since then it would not predict the batch asked for. Times are extrapolated the same way but not checked
(small batches are overhead-bound, so they predict the step time less well than the bytes; the third batch is timed
with one step, not ``repeats``); the profile records the check's step-time error, and what each batch tried cost
(``meta["extrapolation"]["attempts"]``: ``[batch, seconds, fitted]``, the batch asked for first).

Where not even batch 1 fits, or only batch 1 does (what the model holds without activations, its parameters,
gradients and optimizer state, is too much for the device), the step is profiled state-streamed at the batch asked for
(:mod:`memopt_nb.profiling.streamed`: the optimizer's state a unit at a time, each gradient let go as backward makes
it, both counted in the levels); where even that runs out of memory, state-streamed profiles at smaller batches are
extrapolated as above. A step whose state fits is profiled exactly as before.

Why this approach: it needs nothing but the ordinary profiler, on the real device, at sizes that fit; the bytes of a
training step are linear in the batch for almost every layer (activations grow with it; the fixed state does not), and
the two largest fitting batches put the line's ends close to the batch asked for. ``FakeTensorMode`` would give exact
bytes without allocating but no times and no recompute/swap behaviour, which the planner needs; profiling under a safe
plan would need a plan before a profile exists.

How a smaller batch is made: tensors among the inputs whose dimension ``batch_dim`` (default 0) has the batch size are
sliced to the smaller batch (a Hugging Face model's ``input_ids``, ``attention_mask`` and ``labels`` together); where
the loss function holds targets of the full batch, pass ``batch_fn(b) -> (inputs, loss_fn)`` instead.
"""

from __future__ import annotations

import contextvars
import gc
import math
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ..core.errors import ProfileError
from ..core.profile import ModelProfile

__all__ = ["LINEAR_TOLERANCE", "extrapolate", "extrapolating", "profile_or_extrapolate", "state_streamed"]

#: relative error (of the measured value) a byte count at the check batch may be off by; at least :data:`LINEAR_SLACK`
LINEAR_TOLERANCE = 0.02
#: bytes any check may be off by (allocator rounding of tiny tensors)
LINEAR_SLACK = 4096

#: the fields of a profile that grow with the batch (bytes, times, shapes); every other field must be the same at
#: every batch
_BYTES = frozenset({"saved_bytes", "interior_bytes", "input_bytes", "output_bytes", "rc_fwd_rel_peak",
                    "rc_bwd_rel_peak", "step_rel_peak", "grads_done_extra", "held_bytes", "fwd_rel_peak",
                    "bwd_rel_peak", "start_level", "rel_peak", "nbytes", "late_bytes", "peak_bytes",
                    "outside_step_rel_peak"})
#: byte fields that are the highest of several sums (a peak): at a batch below the two fitted ones such a field may
#: lie above their line (a fixed-size temporary outgrows the batch-sized ones there), never below it
_PEAKS = frozenset({"rc_fwd_rel_peak", "rc_bwd_rel_peak", "step_rel_peak", "fwd_rel_peak", "bwd_rel_peak", "rel_peak",
                    "peak_bytes", "outside_step_rel_peak"})
_UNCHECKED = frozenset({"unattributed_bytes", "coverage", "grads_done_extra", "late_bytes"})  # clamped or derived
_TIMES = frozenset({"fwd_time", "bwd_time", "step_time", "recompute_time", "time", "outside_step_time",
                    "chunked_step_time"})
_SHAPES = frozenset({"input_shapes", "output_shapes"})
_TAKE_LARGER = frozenset({"meta", "pareto", "batch_size"})  # taken from the larger batch's profile

_DIRECT: contextvars.ContextVar[bool] = contextvars.ContextVar("memopt_profile_direct", default=False)
_STREAMED: contextvars.ContextVar[bool] = contextvars.ContextVar("memopt_profile_streamed", default=False)


class _StateTooBig(ProfileError):
    """The step does not fit at batch 1, or fits only there: what the model holds without activations is too much."""


def state_streamed() -> bool:
    """Whether :func:`memopt_nb.profile` is to profile the step state-streamed (:mod:`memopt_nb.profiling.streamed`)."""
    return _STREAMED.get()


def extrapolating() -> bool:
    """Whether :func:`memopt_nb.profile` is being called by this module (then it profiles directly)."""
    return _DIRECT.get()


def _is_oom(exc: BaseException) -> bool:
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        exc = exc.__cause__
    return False


def _first_line(exc: BaseException | None) -> str:
    """The out-of-memory error in ``exc``'s chain of causes, as one line."""
    while exc is not None and not isinstance(exc, torch.OutOfMemoryError):
        exc = exc.__cause__
    text = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else ""
    return f"OutOfMemoryError: {text}"


def _batch_of(inputs: Sequence[Any], kwargs: Mapping[str, Any], batch_dim: int) -> int | None:
    for x in [*inputs, *kwargs.values()]:
        if isinstance(x, torch.Tensor) and x.dim() > batch_dim:
            return int(x.shape[batch_dim])
    return None


def _sliced(inputs: Sequence[Any], kwargs: Mapping[str, Any], batch: int, b: int,
            batch_dim: int) -> tuple[tuple, dict]:
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > batch_dim and x.shape[batch_dim] == batch:
            return x.narrow(batch_dim, 0, b)
        return x

    return tuple(cut(x) for x in inputs), {k: cut(v) for k, v in kwargs.items()}


def profile_or_extrapolate(profile_fn: Callable[..., Any], model: torch.nn.Module, inputs: tuple, options: dict,
                           kwargs: dict, batch_dim: int | None, batch_fn: Callable[[int], Any] | None) -> Any:
    """:func:`memopt_nb.profile`: the ordinary profile, or where the step runs out of memory the extrapolated one."""
    token = _DIRECT.set(True)
    t0 = time.perf_counter()
    try:
        try:
            return _knowing_inputs(profile_fn(model, *inputs, **options, **kwargs), inputs, options, kwargs)
        except Exception as exc:  # noqa: BLE001 - only out of memory is handled; the rest is raised as it was
            if not _is_oom(exc):
                raise
            first = _first_line(exc)
        # outside the except block: the failed step's traceback, and with it its tensors, are gone
        gc.collect()
        failed = time.perf_counter() - t0
        try:
            prof = _extrapolated_profile(profile_fn, model, inputs, options, kwargs, batch_dim, batch_fn, first, failed)
        except _StateTooBig as exc:
            if options.get("optimizer") is None:
                raise
            too_big = exc
        else:
            return _knowing_inputs(prof, inputs, options, kwargs)
        gc.collect()
        return _knowing_inputs(_streamed_profile(profile_fn, model, inputs, options, kwargs, batch_dim, batch_fn,
                                                 too_big), inputs, options, kwargs)
    finally:
        _DIRECT.reset(token)


def _streamed_profile(profile_fn: Callable[..., Any], model: torch.nn.Module, inputs: tuple, options: dict,
                      kwargs: dict, batch_dim: int | None, batch_fn: Callable[[int], Any] | None,
                      too_big: ProfileError) -> Any:
    """The step profiled state-streamed (:mod:`memopt_nb.profiling.streamed`), at its batch or, where even its
    activations do not fit beside the parameters, extrapolated from smaller batches profiled so."""
    t0 = time.perf_counter()
    token = _STREAMED.set(True)
    try:
        try:
            return profile_fn(model, *inputs, **options, **kwargs)
        except Exception as exc:  # noqa: BLE001 - only out of memory is handled; the rest is raised as it was
            if not _is_oom(exc):
                raise
            first = _first_line(exc)
        gc.collect()
        try:
            return _extrapolated_profile(profile_fn, model, inputs, options, kwargs, batch_dim, batch_fn, first,
                                         time.perf_counter() - t0)
        except _StateTooBig:
            raise ProfileError(f"{too_big} Profiled state-streamed (the optimizer's state a unit at a time, each "
                               "gradient let go as backward made it), it still does not fit: the parameters with "
                               "one step's activations are too much for the device") from None
    finally:
        _STREAMED.reset(token)


def _knowing_inputs(prof: Any, inputs: tuple, options: dict, kwargs: dict) -> Any:
    """``prof``, knowing the example input tensors it was asked for while they are alive (``ModelProfile.live_step``:
    what its start level holds, which a plan for the device's free memory does not count as held by others)."""
    given = [*inputs, *kwargs.values(), *(options.get("model_kwargs") or {}).values()]
    prof._input_refs = [weakref.ref(t) for t in tree_leaves(given) if isinstance(t, torch.Tensor)]
    return prof


def _extrapolated_profile(profile_fn: Callable[..., Any], model: torch.nn.Module, inputs: tuple, options: dict,
                          kwargs: dict, batch_dim: int | None, batch_fn: Callable[[int], Any] | None,
                          first: str, failed_seconds: float = 0.0) -> Any:
    t0 = time.perf_counter()
    #: what each profile tried cost: [batch, seconds, fitted]; the step asked for first (it ran out of memory)
    attempts: list[list[Any]] = []
    all_kwargs = {**kwargs, **(options.get("model_kwargs") or {})}
    batch = _batch_of(inputs, all_kwargs, batch_dim if batch_dim is not None else 0)
    if batch is None or batch < 2:
        raise _StateTooBig(f"the training step does not fit the device ({first}) and its batch cannot be made "
                           "smaller to profile it in parts (no input tensor with a batch dimension of 2 or more). "
                           "Lower the batch or the sequence length, or free device memory") from None
    if batch_fn is None and batch_dim is None:
        raise _StateTooBig(f"the training step does not fit the device ({first}); profile(..., batch_dim=None) "
                           "forbids slicing the inputs. Pass batch_dim= (the inputs' batch dimension) or "
                           "batch_fn=lambda b: (inputs, loss_fn) to profile it at smaller batches") from None

    def at(b: int, **change: Any) -> Any:
        t = time.perf_counter()
        try:
            prof = _at(b, {**options, **change})
        except BaseException:
            attempts.append([b, round(time.perf_counter() - t, 3), False])
            raise
        attempts.append([b, round(time.perf_counter() - t, 3), True])
        return prof

    def _at(b: int, options: dict) -> Any:
        if batch_fn is not None:
            made = batch_fn(b)
            gc.collect()  # whatever batch_fn built besides the inputs (a model) is gone before profiling
            if not (isinstance(made, tuple) and len(made) == 2):
                raise ProfileError(f"batch_fn({b}) must return (inputs, loss_fn), with inputs a tuple of positional "
                                   f"inputs or a dict of keyword inputs; got {type(made).__name__}")
            ins, loss_fn = made
            opts = {**options, "loss_fn": loss_fn}
            if isinstance(ins, Mapping):  # batch b's keyword inputs in place of the full batch's (model_kwargs too)
                return profile_fn(model, **{**opts, "model_kwargs": dict(ins)})
            return profile_fn(model, *tuple(ins), **opts)
        ins, kws = _sliced(inputs, kwargs, batch, b, batch_dim)
        opts = dict(options)
        if opts.get("model_kwargs"):
            opts["model_kwargs"] = _sliced((), opts["model_kwargs"], batch, b, batch_dim)[1]
        return profile_fn(model, *ins, **opts, **kws)

    tried: list[str] = []
    hi, prof_hi = batch // 2, None
    while hi >= 1:
        try:
            prof_hi = at(hi)
            break
        except Exception as exc:  # noqa: BLE001
            if not _is_oom(exc):
                raise ProfileError(
                    f"the training step does not fit the device at batch {batch} ({first}), and profiling it at "
                    f"batch {hi} to extrapolate failed: {type(exc).__name__}: {exc}. If the loss function holds "
                    f"targets of the full batch, pass them as model inputs (e.g. labels=...) or give "
                    f"batch_fn=lambda b: (inputs, loss_fn) making batch b") from exc
            tried.append(str(hi))
        gc.collect()
        hi //= 2
    if prof_hi is None:
        raise _StateTooBig(f"the training step does not fit the device even at batch 1 ({first}; tried "
                           f"{', '.join(tried)}): what the model holds without activations is too much. Plan its "
                           "state with a preset instead (memopt.profile on a bigger device or the CPU, then "
                           "memopt.search(prof, device=...)), or make the model smaller") from None
    if hi < 2:
        raise _StateTooBig(f"the training step does not fit the device at batch {batch} ({first}) and fits only at "
                           f"batch 1, so it cannot be extrapolated in the batch. Free device memory or lower the "
                           f"batch") from None
    # the smaller batches are profiled on the same units (how a model is split may depend on its saved bytes); split
    # blocks are not measured whole there, so an extrapolated profile merges none (memopt.merge_units)
    options = {**options, "units": [u.name for u in prof_hi.units]}
    if prof_hi.merges:
        prof_hi.meta["merge_why"] = {b: "not measured in an extrapolated profile" for b in prof_hi.merges}
        prof_hi.merges = {}
    mid = hi // 2
    prof_mid = at(mid)
    low = mid // 2
    # the check batch's bytes are compared with the line; its times only give the recorded step-time error, so one
    # timed step does (about a quarter less of that profile's time; benchmarks/max_batch.py --profile-cost)
    prof_low = at(low, repeats=1) if low >= 1 and low < mid else None
    prof = extrapolate({mid: prof_mid, hi: prof_hi}, batch, check=(low, prof_low) if prof_low is not None else None)
    prof.meta["method"] = "extrapolated"
    prof.meta["extrapolation"] = {
        **prof.meta.get("extrapolation", {}),
        "requested_batch": batch, "fitted_batches": [mid, hi], "check_batch": low if prof_low is not None else None,
        "out_of_memory": first, "too_big_batches": [int(b) for b in tried], "batch_dim": batch_dim,
        "sliced": batch_fn is None,
        "attempts": [[batch, round(failed_seconds, 3), False], *attempts],
    }
    prof.meta["profile_seconds"] = round(time.perf_counter() - t0 + failed_seconds, 3)
    if prof_low is None:
        warnings.warn(f"memopt.profile: the step at batch {batch} did not fit; extrapolated from batches {mid} and "
                      f"{hi} without a third batch to check the line", UserWarning, stacklevel=3)
    prof._model_ref = prof_hi._model_ref
    prof._optimizer_ref = prof_hi._optimizer_ref
    return prof


def _line(x1: float, y1: Any, x2: float, y2: Any, x: float) -> float:
    return y1 + (y2 - y1) * (x - x1) / (x2 - x1)


def _merge(a: Any, b: Any, xa: int, xb: int, x: int, key: str, where: str) -> Any:
    """Field ``key`` at batch ``x`` from its values ``a`` at ``xa`` and ``b`` at ``xb`` (see the module docstring)."""
    if key in _TAKE_LARGER:
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            raise _structure(where, key)
        return {k: _merge(a[k], b[k], xa, xb, x, k if k not in ("ops",) else "ops", f"{where}.{key}") for k in a}
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise _structure(where, key)
        out = [_merge(u, v, xa, xb, x, key, f"{where}[{i}]") for i, (u, v) in enumerate(zip(a, b, strict=True))]
        return type(a)(out) if isinstance(a, tuple) else out
    if a == b:
        return a
    numeric = isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
        and not isinstance(b, bool)
    if numeric and key in _PEAKS and x > xb:  # a peak does not shrink as the batch grows
        return max(0, int(b), int(round(_line(xa, a, xb, b, x))))
    if numeric and (key in _BYTES or key in _SHAPES or key in _UNCHECKED):
        return max(0, int(round(_line(xa, a, xb, b, x))))
    if numeric and key in _TIMES:
        return max(0.0, float(_line(xa, a, xb, b, x)))
    raise _structure(where, key)


_GROUP_KEY = ("producer", "savers", "consumers", "outside_saver", "free_pos", "outside_release", "release_pos",
              "death_seg", "made_pos")


def _groups(ga: list[dict], gb: list[dict], xa: int, xb: int, x: int) -> list[dict]:
    """The storage groups at batch ``x``: the larger batch's groups, each group's bytes on the line through its bytes
    at both batches where the smaller batch has it too, else grown in proportion to the batch. Which groups exist can
    differ between batches (a storage freed partway through a segment counts as late only where the peak came after
    it), so groups are matched by what they are, not by position; the number of storages is the larger batch's."""
    def key(g: dict) -> tuple:
        return tuple(tuple(g[k]) if isinstance(g.get(k), list) else g.get(k) for k in _GROUP_KEY)

    small: dict[tuple, list[int]] = {}
    for g in ga:
        acc = small.setdefault(key(g), [0, 0])
        acc[0] += g["nbytes"]
        acc[1] += g["late_bytes"]
    seen: dict[tuple, int] = {}
    out = []
    for g in gb:
        k = key(g)
        seen[k] = seen.get(k, 0) + 1
        g = dict(g)
        if k in small and seen[k] == 1 and sum(key(h) == k for h in gb) == 1:
            g["nbytes"] = max(0, int(round(_line(xa, small[k][0], xb, g["nbytes"], x))))
            g["late_bytes"] = max(0, int(round(_line(xa, small[k][1], xb, g["late_bytes"], x))))
        else:
            g["nbytes"] = int(round(g["nbytes"] * x / xb))
            g["late_bytes"] = int(round(g["late_bytes"] * x / xb))
        out.append(g)
    return out


def _heads(ha: dict, hb: dict, xa: int, xb: int, x: int) -> dict:
    """The LM head's options (``ModelProfile.heads``) at batch ``x``: each option's peak and segments on their lines,
    its storage groups as :func:`_groups` does; an option measured at one batch only is left out."""
    out = {}
    for key in sorted(set(ha) & set(hb), key=int):
        a, b = ha[key], hb[key]
        option = {k: _merge(a[k], b[k], xa, xb, x, k, f"heads[{key}]") for k in b if k != "groups"}
        option["groups"] = _groups(a["groups"], b["groups"], xa, xb, x)
        option["peak_bytes"] = max([option["peak_bytes"]] + [sg["start_level"] + sg["rel_peak"]
                                                             for sg in option["segments"]])
        out[key] = option
    return out


def _structure(where: str, key: str) -> ProfileError:
    return ProfileError(f"the step changes with the batch beyond its sizes ({where}: {key} differs between the "
                        "batches profiled), so a profile at smaller batches cannot be extrapolated to this one. "
                        "Profile it where it fits (a smaller batch, or memopt.profile on a device with more memory)")


def _checks(pred: Any, meas: Any, key: str, where: str, out: list[tuple[str, float, float]]) -> None:
    if isinstance(pred, dict):
        for k in pred:
            if k not in _TAKE_LARGER:
                _checks(pred[k], meas[k], k, f"{where}.{k}", out)
    elif isinstance(pred, (list, tuple)):
        for i, (u, v) in enumerate(zip(pred, meas, strict=True)):
            _checks(u, v, key, f"{where}[{i}]", out)
    elif key in _BYTES and key not in _UNCHECKED and isinstance(pred, (int, float)):
        out.append((where, float(pred), float(meas)))


def extrapolate(profiles: Mapping[int, Any], batch: int, check: tuple[int, Any] | None = None) -> Any:
    """The profile at ``batch``, from profiles of the same model at two other batches (``{b1: prof1, b2: prof2}``).

    Bytes and times are the line through the two, evaluated at ``batch`` (bytes rounded, nothing below 0); every
    other field must be equal in both. ``check=(b3, prof3)``: a third profile whose byte counts the line must predict
    within :data:`LINEAR_TOLERANCE` (of the measured value, at least :data:`LINEAR_SLACK` bytes), else
    :class:`ProfileError` naming the first field that is not linear in the batch.
    """

    if len(profiles) != 2:
        raise ProfileError(f"extrapolate() needs profiles at exactly two batch sizes, got {sorted(profiles)}")
    (xa, pa), (xb, pb) = sorted(profiles.items())
    da, db = pa.to_dict(), pb.to_dict()
    merged = {k: _merge(da[k], db[k], xa, xb, batch, k, "profile") for k in db
              if k not in ("device", "groups", "heads")}
    merged["groups"] = _groups(da["groups"], db["groups"], xa, xb, batch)
    merged["heads"] = _heads(da.get("heads") or {}, db.get("heads") or {}, xa, xb, batch)
    merged["device"] = db["device"]
    merged["batch_size"] = batch
    merged["unattributed_bytes"] = max(0, int(round(_line(xa, da["unattributed_bytes"], xb, db["unattributed_bytes"],
                                                          batch))))
    merged["coverage"] = min(1.0, max(0.0, float(_line(xa, da["coverage"], xb, db["coverage"], batch))))
    merged["meta"] = dict(db["meta"])
    # the step's peak is its highest segment, as in a measured profile (and as the simulator finds it)
    merged["peak_bytes"] = max([merged["peak_bytes"]] + [sg["start_level"] + sg["rel_peak"]
                                                         for sg in merged["segments"]])
    info: dict[str, Any] = {}
    if check is not None:
        xc, pc = check
        dc = pc.to_dict()
        # the storage groups are left out: at small batches storages may fall into other groups (the units' saved
        # bytes, the segments and the peak, which the groups add up to, are checked)
        pred = {k: _merge(da[k], db[k], xa, xb, xc, k, "profile") for k in db
                if k not in ("device", "meta", "groups", "heads")}
        errors: list[tuple[str, float, float]] = []
        try:
            for k in pred:
                if k in dc:
                    _checks(pred[k], dc[k], k, k, errors)
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            raise _structure(f"the profile at batch {xc}", str(exc)) from None
        worst = None
        for where, p, m in errors:
            off = abs(p - m)
            if where.rsplit(".", 1)[-1].split("[")[0] in _PEAKS and m > p:
                off = 0.0  # a peak above the line below the fitted batches: a smaller piece of the maximum
            if off > max(LINEAR_SLACK, LINEAR_TOLERANCE * abs(m)):
                raise ProfileError(
                    f"{_name(where, pb)} is not linear in the batch: profiled at batches {xa} and {xb}, the line "
                    f"predicts {p:.0f} bytes at batch {xc} but it measured {m:.0f}, so a profile extrapolated to "
                    f"batch {batch} would not predict the step. Profile it where it fits (a smaller batch, or a "
                    f"device with more memory)")
            rel = off / abs(m) if m else 0.0
            if worst is None or rel > worst[1]:
                worst = (where, rel)
        step_err = abs(pred["step_time"] - dc["step_time"]) / dc["step_time"] if dc["step_time"] else math.nan
        info = {"check_max_bytes_error": round(worst[1], 6) if worst else 0.0,
                "check_worst_field": worst[0] if worst else None,
                "check_peak_error": (abs(pred["peak_bytes"] - dc["peak_bytes"]) / dc["peak_bytes"]
                                     if dc["peak_bytes"] else 0.0),
                "check_step_time_error": round(step_err, 4)}
    merged["meta"]["extrapolation"] = {"batches": [xa, xb], **info}
    for k in ("format", "schema_version"):
        merged[k] = db[k]
    return ModelProfile.from_dict(merged)


def _name(where: str, prof: Any) -> str:
    """A readable name for a field path: ``units[3].saved_bytes`` -> ``unit 'h.3' (saved_bytes)``."""
    if where.startswith("units["):
        i = int(where[6:where.index("]")])
        if i < len(prof.units):
            return f"unit {prof.units[i].name!r} ({where.split('.', 1)[-1]})"
    return where
