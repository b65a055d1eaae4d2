"""``memopt.profile``: what a model's training step costs, per unit.

A *unit* is a module on which a plan decides (a transformer block, a ResNet block). The profiler runs a few real
training steps (and restores the model, optimizer and RNG afterwards) to measure:

* per unit: forward and backward time, bytes autograd saves inside it (each storage once, parameters excluded), its
  internal ("interior") bytes that recompute or swap can free, input/output/parameter bytes, and flags (RNG ops,
  running statistics);
* the step as a timeline of *segments* — each unit's forward and backward, and the code between units — with the
  memory level at the start of each segment and its peak above that level, with every unit kept and with every unit
  recomputed;
* *storage groups*: saved or unit-input storages with the same producer, savers and consumers, and the unit boundary at
  which nothing but autograd refers to them any more. This is what lets the simulator predict swap and recompute
  exactly, skip connections and shared boundary tensors included;
* totals: parameter, gradient, optimizer-state bytes, the measured peak and the bytes not attributed to units.
"""

from __future__ import annotations

import contextlib
import datetime
import statistics
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn

from ..core.device import DeviceSpec
from ..core.errors import PlanError, ProfileError
from ..core.plan import SAVE_SETS, model_fingerprint, optimizer_fingerprint, unit_fingerprint
from ..core.profile import ModelProfile, Segment, UnitProfile
from ..core.progress import advance, stage, task
from ..runtime.distributed import check_plain
from ..runtime.effects import ForwardEffects, forward_side_effects
from ..runtime.head import find_head
from ..runtime.measure import model_device
from ..runtime.outside import preserved_outside
from ..runtime.replay_guard import running_stat_modules
from ..runtime.step import (
    autocast_name,
    keeping_outputs,
    model_keywords,
    preserved_state,
    resolve_autocast,
    step_autocast,
    training_step,
)
from .fallback import extrapolating, profile_or_extrapolate, state_streamed
from .heads import measure_heads, noting_head, use_unit_times
from .merges import measure_merges
from .opsets import mark_pareto, propose_save_sets, record_ops
from .streamed import (
    StateFreeOptimizer,
    add_state_to_marks,
    step_rel_peak,
    streamed_optimizer_steps,
    streamed_why,
)
from .timing import pool_step_times, robust_times, time_warning, timed_repeats, unit_signature
from .tracer import (
    chunked_step,
    discover,
    forward,
    groups_from,
    param_steps,
    segments_from,
    static_bytes,
    timed_step,
    tracked_step,
    unique_bytes,
    unit_state_bytes,
)
from .units import module_state_bytes, select_units

__all__ = ["PROFILE_OPTIONS", "profile"]


# ====================================================================== forward side effects
def _refuse_own_checkpointing(model: nn.Module, effects: ForwardEffects) -> None:
    """A model that checkpoints its own blocks cannot be profiled: the profile would see recompute as "keep"."""
    if not effects.own_checkpointing:
        return
    shown = ", ".join(repr(n) for n in effects.own_checkpointing[:4]) + (
        " …" if len(effects.own_checkpointing) > 4 else "")
    how = ("call model.gradient_checkpointing_disable() (Hugging Face models) before profiling"
           if hasattr(model, "gradient_checkpointing_disable") else
           "remove the torch.utils.checkpoint call from its forward (or the option that enables it)")
    raise ProfileError(
        f"{type(model).__name__} already runs {shown} under torch.utils.checkpoint (its own activation "
        f"checkpointing); memopt cannot profile or plan a model that checkpoints itself. Turn that off — {how} — "
        "and let a plan choose recompute where it pays (Plan.uniform(profile, 'recompute') does what it did)")


def _mark_side_effects(prof: ModelProfile, effects: ForwardEffects) -> None:
    """Record each unit's forward side effects; a unit whose recomputation cannot be exact is not recomputable.

    The reason also goes into the unit's fingerprint entry, so a plan made from this profile carries it and applying
    a plan that recomputes the unit is refused before anything runs.
    """
    for u, fp in zip(prof.units, prof.fingerprint, strict=True):
        u.side_effects, reason = effects.for_unit(u.name)
        if reason:
            u.recomputable = False
            u.not_recomputable_reason = reason
            fp["not_recomputable"] = reason



def _save_sets(proposed: dict[int, dict[str, dict[str, Any]]], sac_marks: dict[str, list], rc_marks: list,
               labels_ref: list, segs: list[Segment], fwd_seg: dict, bwd_seg: dict,
               rc_time: list[float] | None = None,
               sac_time: dict[str, list[float]] | None = None) -> tuple[dict[int, dict], list]:
    """Each unit's measured save-sets from the selective steps' marks against the all-recompute step's, and what
    could not be measured (as notes).

    ``recompute_time``: the simulator charges a recomputed unit its forward time; a selective unit is charged that
    times what selective adds to the unit's forward and backward over keeping, divided by what recompute adds (timed
    steps, medians; within 0..2), and the op-time estimate (the share of the unit's op time its kept calls do not
    save) where recompute added nothing measurable."""
    out: dict[int, dict[str, dict[str, Any]]] = {i: {} for i in proposed}
    notes = []
    for name, marks in sac_marks.items():
        if [m[0] for m in marks] != labels_ref or [m[0] for m in rc_marks] != labels_ref:
            notes.append(f"{name}: the step ran differently under selective checkpointing; not offered")
            continue
        diff = [m[1] - r[1] for m, r in zip(marks, rc_marks, strict=True)]  # kept bytes at each mark
        for i, sets in proposed.items():
            if name not in sets:
                continue
            f, b = fwd_seg[i], bwd_seg[i]
            held = diff[f + 1] - diff[f]
            if held < 0 or diff[b + 1] - diff[b] != -held:  # not held from its forward to its backward alone
                notes.append(f"{name} of unit {i}: kept bytes not released at its backward; not offered")
                continue
            out[i][name] = {
                "ops": sets[name]["ops"],
                "held_bytes": int(held),
                "recompute_time": _selective_time(sets[name]["fraction"], segs, f, b, rc_time,
                                                  (sac_time or {}).get(name)),
                "fwd_rel_peak": int(max(0, marks[f + 1][2] - marks[f][1])),
                "bwd_rel_peak": int(max(0, marks[b + 1][2] - marks[b][1])),
            }
    for sets in out.values():
        mark_pareto(sets)
    return out, notes


def _selective_time(fraction: float, segs: list[Segment], f: int, b: int, rc_time: list[float] | None,
                    sel_time: list[float] | None) -> float:
    """Seconds a selective unit adds (see :func:`_save_sets`)."""
    fwd = segs[f].time
    estimate = (1.0 - fraction) * fwd
    if rc_time is None or sel_time is None:
        return estimate
    keep = segs[f].time + segs[b].time
    rc_extra = rc_time[f] + rc_time[b] - keep
    if rc_extra <= 0.02 * keep:  # recompute added nothing measurable: nothing to scale by
        return estimate
    return fwd * min(2.0, max(0.0, (sel_time[f] + sel_time[b] - keep) / rc_extra))


#: profile()'s own keyword options; every other keyword goes to the model.
PROFILE_OPTIONS = ("loss_fn", "optimizer", "units", "repeats", "device", "model_kwargs", "selective", "autocast",
                   "batch_dim", "batch_fn", "head", "head_module", "keep_outputs")


@task("profile")
def profile(model: nn.Module, *example_inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
            optimizer: torch.optim.Optimizer | None = None, units: Any = "auto", repeats: int = 3,
            device: DeviceSpec | None = None, model_kwargs: Mapping[str, Any] | None = None,
            selective: bool = False, autocast: torch.dtype | str | None = None, batch_dim: int | None = 0,
            batch_fn: Callable[[int], Any] | None = None, head: str | None = None, head_module: str | None = None,
            keep_outputs: bool = False, **example_kwargs: Any) -> ModelProfile:
    """Profile one training step of ``model`` on ``example_inputs``.

    The model is called as ``model(*example_inputs, **example_kwargs)``, as you call it in training:
    ``memopt.profile(model, input_ids=ids, attention_mask=mask, labels=ids, loss_fn=lambda out: out.loss)``.

    Args:
        model: the model, on the device it trains on.
        example_inputs: positional inputs of ``model(...)``, at the batch size you train with.
        example_kwargs: keyword inputs of ``model(...)``: every keyword that is not one of profile()'s own options
            (``loss_fn``, ``optimizer``, ``units``, ``repeats``, ``device``, ``model_kwargs``, ``selective``,
            ``autocast``) goes to the model.
        model_kwargs: the same as a dict, for a model keyword named like one of those options
            (``model_kwargs={"device": ...}``); may be combined with ``example_kwargs``.
        loss_fn: ``loss_fn(output) -> scalar``; by default the output itself if scalar, else its sum.
        optimizer: the optimizer you train with (its state counts towards memory); optional.
        units: ``"auto"`` (repeated blocks: children of ModuleList/Sequential containers, about 4–64 of them),
            ``"fine"`` (those blocks, then the unit that saves the most split into its submodules while that lowers
            the largest unit; a transformer block becomes attention, MLP and norms — plans reach a lower floor and
            can recompute the cheap parts only; see ``memopt_nb.profiling.units``), a list of qualified module
            names (units must not contain each other), or an int depth in the module tree. ``"auto"`` and
            ``"fine"`` also split a unit that holds much more of the parameters, gradients and optimizer state than
            the others (a timm ResNet's last stage), which would otherwise bound a whole-step plan's floor;
            ``profile.meta["split_why"]`` says why each was split. A module that changes its input in place
            (``ReLU(inplace=True)``), or whose input later code changes in place, is never a unit.
        repeats: timed steps; a step beside which a short reference operation ran slow is measured again (at most
            ``repeats`` more). On the CPU, times are the CPU time of the thread running the step (what it costs while
            it has a core); each is a median without stalls, identical units pooled (:mod:`memopt_nb.profiling.timing`;
            ``meta["timing"]``, and ``meta["time_warning"]`` when the machine was too busy to trust them).
        device: the DeviceSpec of the device measured (detected by default).
        selective: also measure, per unit, the save-sets selective checkpointing may keep (``UnitProfile.save_sets``,
            see :mod:`memopt_nb.profiling.opsets`): what planners need for ``strategies=`` with ``"selective"``. Costs
            one forward, one profiled step per save-set found (up to three) and ``repeats`` timed steps each of plain
            recompute and of every save-set.
        autocast: mixed precision as your loop uses it: ``torch.bfloat16`` or ``torch.float16`` (or ``"bf16"``,
            ``"fp16"``) runs every forward and the loss under ``torch.autocast(device_type, dtype=...)`` and backward
            and the optimizer step outside, as ``with torch.autocast(...): loss = loss_fn(model(x))`` then
            ``loss.backward()`` does. Profile the way you train: a profile made without autocast does not predict a
            loop with it. Calling ``profile`` inside ``torch.autocast`` raises :class:`ProfileError` (its backward
            would run under autocast too, and autocast's weight cache would live through it).
        batch_dim, batch_fn: where the unplanned step runs out of memory (``torch.OutOfMemoryError``: a full GPU, or
            :func:`memopt_nb.limit_memory`), the profile is made at smaller batches that fit and extrapolated to this
            one (:mod:`memopt_nb.profiling.fallback`; ``meta["method"] == "extrapolated"``). The smaller batches
            slice the input tensors along ``batch_dim`` (default 0; ``None`` forbids it), or come from
            ``batch_fn(b) -> (inputs, loss_fn)`` (a tuple of positional or a dict of keyword inputs) where the loss
            function holds targets of the full batch. A step that fits is profiled as always
            (``meta["method"] == "measured"``).
        head, head_module: ``head="chunked"`` also measures the step with the LM head and its cross-entropy computed a
            chunk of tokens at a time (:mod:`memopt_nb.runtime.head`: the logits are never whole), in each of
            :data:`~memopt_nb.profiling.heads.HEAD_CHUNKS` chunks; planners may then choose it
            (``Plan.head``). Opt-in because it is not bit-identical: the loss is, but the head's gradients are summed
            in another order (see the README for the measured difference). The head is the model's output embeddings
            (transformers' ``get_output_embeddings()``) or the ``nn.Linear`` named by ``head_module``; the loss must
            call ``F.cross_entropy`` on its logits (transformers' loss with ``labels=`` does).
        keep_outputs: profile the loop that keeps the model's output, as the transformers documentation's does
            (``outputs = model(**batch); outputs.loss.backward(); optimizer.step()``: ``outputs``, with its logits
            and cache, lives through backward and the next forward). By default the output is let go once the loss
            is computed (``loss = loss_fn(model(x))``); a plan applied to a loop that keeps it warns once, naming
            what it keeps. ``meta["keep_outputs"]`` records it; :func:`memopt.measure` of such a plan keeps it too.

    The model, optimizer and RNG state are restored afterwards, and so is every module outside the model that
    ``loss_fn`` calls (a discriminator: its gradients, buffers and training flags). Modules that run more than once
    per forward, not at all, or whose output needs no gradient are excluded and listed in ``profile.excluded``.

    A step whose training state does not fit the device even at batch 1 is profiled state-streamed
    (:mod:`memopt_nb.profiling.streamed`; ``meta["state_streamed"]``).
    """
    if not isinstance(model, nn.Module):
        raise ProfileError(f"profile() needs a torch.nn.Module, got {type(model).__name__}")
    if not extrapolating():  # the step as it is; where it runs out of memory, smaller batches extrapolated
        options = dict(loss_fn=loss_fn, optimizer=optimizer, units=units, repeats=repeats, device=device,
                       model_kwargs=model_kwargs, selective=selective, autocast=autocast, head=head,
                       head_module=head_module, keep_outputs=keep_outputs)
        return profile_or_extrapolate(profile, model, example_inputs, options, example_kwargs, batch_dim, batch_fn)
    check_plain(model, "profile")  # DDP / FSDP2: profile the plain model, then wrap it (memopt_nb.runtime.distributed)
    kwargs = model_keywords(model, "profile", PROFILE_OPTIONS, model_kwargs, example_kwargs)
    _check_options(model, example_inputs, kwargs, loss_fn, optimizer, repeats, head, head_module)
    dev = model_device(model, example_inputs, kwargs)
    amp = resolve_autocast(autocast, dev, "profile")
    m = SimpleNamespace(model=model, inputs=tuple(example_inputs), kwargs=kwargs, loss_fn=loss_fn, optimizer=optimizer,
                        units=units, repeats=repeats, selective=selective, head=head, head_module=head_module,
                        dev=dev, streamed=state_streamed() and optimizer is not None, t_start=time.perf_counter())
    # modules outside the model that the loss calls (a GAN's discriminator) are restored too
    with preserved_outside(model) as outside, preserved_state(model, optimizer), step_autocast(dev.type, amp), \
            keeping_outputs(bool(keep_outputs)), _step_optimizer(m):
        _warm_up_and_units(m, outside)
        _tracked_steps(m)
        _timed_steps(m)
        _state_steps(m)
    spec = device if device is not None else DeviceSpec.detect(dev)
    return _assemble(m, spec, autocast_name(amp), keep_outputs)


def _check_options(model: nn.Module, example_inputs: tuple, kwargs: Mapping[str, Any], loss_fn: Any, optimizer: Any,
                   repeats: Any, head: Any, head_module: str | None) -> None:
    """profile()'s arguments, each refused with what would work."""
    if not example_inputs and not kwargs:
        raise ProfileError("profile() needs example inputs: memopt.profile(model, x) with x a batch of inputs, or "
                           "keyword inputs as the model takes them, e.g. memopt.profile(model, input_ids=ids)")
    if loss_fn is not None and not callable(loss_fn):
        raise ProfileError("loss_fn must be callable: loss_fn(output) -> scalar tensor")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ProfileError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be a positive int, got {repeats!r}")
    if head not in (None, "chunked"):
        raise ProfileError(f"head={head!r} is not an option: head='chunked' measures the LM head computed a chunk of "
                           "tokens at a time (not bit-identical); leave it out for the head as written")
    if head is not None:
        try:
            find_head(model, head_module)
        except PlanError as exc:
            raise ProfileError(str(exc)) from None


@contextlib.contextmanager
def _step_optimizer(m: SimpleNamespace) -> Iterator[None]:
    """``m.opt``: what the profile's steps step — the optimizer, or where its state is streamed
    (:mod:`.streamed`) a stand-in that makes none and lets each gradient go as backward accumulates it."""
    if not m.streamed:
        m.opt = m.optimizer
        yield
        return
    with StateFreeOptimizer(m.model).installed() as opt:
        m.opt = opt
        yield


def _warm_up_and_units(m: SimpleNamespace, outside: Any) -> None:
    """The warm-up step (optimizer state, lazy initialization), the forward's side effects, and the units."""
    model, inputs, kwargs = m.model, m.inputs, m.kwargs
    stage("warm-up")
    try:
        training_step(model, inputs, m.loss_fn, m.opt, kwargs=kwargs)  # warm-up: optimizer state, lazy init
    except ProfileError:
        raise
    except Exception as exc:
        raise ProfileError(f"a training step of the model failed before profiling: {type(exc).__name__}: {exc}"
                           ) from exc
    outside.stop()  # every module the step calls is known: the timed steps run without the watch
    m.effects = forward_side_effects(model, lambda: forward(model, inputs, kwargs))
    _refuse_own_checkpointing(model, m.effects)
    m.lm_head = {}
    with noting_head(model, m.head_module, m.lm_head):
        m.info, m.total_saved = discover(model, inputs, kwargs)
    m.split, m.split_why = {}, {}
    m.names, m.excluded = select_units(model, m.units, m.info, m.split, m.split_why,
                                       module_state_bytes(model, m.optimizer))


def _tracked_steps(m: SimpleNamespace) -> None:
    """The metered steps: every unit kept (with the saved storages followed), every unit recomputed, the merges of
    split blocks and, with ``selective``, each save-set's step."""
    model, inputs, kwargs, names, dev, opt = m.model, m.inputs, m.kwargs, m.names, m.dev, m.opt
    n = len(names)
    stage("tracked steps", total=2)
    m.keep_marks, m.run, m.peak = tracked_step(model, inputs, m.loss_fn, opt, names, dev, observe=True,
                                               recompute=False, kwargs=kwargs)
    advance()
    m.rc_marks, _, _ = tracked_step(model, inputs, m.loss_fn, opt, names, dev, observe=False, recompute=True,
                                    kwargs=kwargs)
    advance()
    _, fwd_ref, bwd_ref = segments_from(m.keep_marks, n)
    m.merges, m.merge_why = ({}, {})
    if m.split and m.streamed:  # the merged steps' levels are not corrected for the state
        m.merge_why = {b: "not measured in a state-streamed profile" for b in set(m.split)}
    elif m.split:
        m.merges, m.merge_why = measure_merges(model, inputs, m.loss_fn, opt, names, dev, kwargs, m.split, m.info,
                                               m.keep_marks, fwd_ref, bwd_ref)
    m.labels_ref = [mk[0] for mk in m.keep_marks]
    m.proposed, m.set_ops = {}, {}  # per save-set, the ops each unit that has it keeps
    if m.selective:
        stage("selective save-sets")
        calls = record_ops(model, inputs, kwargs, names)
        m.proposed = {i: propose_save_sets(calls.get(i, [])) for i in range(n)}
        m.set_ops = {k: ops for k in SAVE_SETS
                     if (ops := {i: p[k]["ops"] for i, p in m.proposed.items() if k in p})}
    m.sac_marks = {k: tracked_step(model, inputs, m.loss_fn, opt, names, dev, observe=False, recompute=True,
                                   kwargs=kwargs, save_ops=ops)[0] for k, ops in m.set_ops.items()}


def _timed_steps(m: SimpleNamespace) -> None:
    """The timed steps (:mod:`.timing`), and with ``selective`` what each save-set costs against recompute."""
    model, inputs, kwargs, names, dev, opt, repeats = m.model, m.inputs, m.kwargs, m.names, m.dev, m.opt, m.repeats
    timed_step(model, inputs, m.loss_fn, opt, names, dev, kwargs)  # untimed: the tracked steps leave caches cold
    stage("timed steps", total=repeats)  # timed_repeats advances it

    def one_step() -> tuple[list[float], list[float]]:
        wall: list[float] = []
        labels, durations = timed_step(model, inputs, m.loss_fn, opt, names, dev, kwargs, wall=wall)
        if labels != m.labels_ref:
            raise ProfileError("the step ran differently between repeats (data-dependent control flow?)")
        return durations, wall

    m.timings, m.timing = timed_repeats(one_step, repeats, dev)  # robust: see .timing
    m.sac_times = {k: [] for k in m.set_ops}
    m.rc_times = []
    if m.set_ops:
        stage("selective timed steps", total=repeats * (1 + len(m.set_ops)))
    for _ in range(repeats if m.set_ops else 0):  # what selective costs, against recompute, measured
        m.rc_times.append(timed_step(model, inputs, m.loss_fn, opt, names, dev, kwargs, recompute=True)[1])
        for k, ops in m.set_ops.items():
            m.sac_times[k].append(timed_step(model, inputs, m.loss_fn, opt, names, dev, kwargs, recompute=True,
                                             save_ops=ops)[1])
        advance(1 + len(m.set_ops))


def _state_steps(m: SimpleNamespace) -> None:
    """The state's bytes, the optimizer step unit by unit and parameter by parameter, and the LM head's options."""
    model, optimizer, names = m.model, m.optimizer, m.names
    m.modules = dict(model.named_modules())
    m.unit_params = [list(m.modules[nm].parameters()) for nm in names]
    unit_modules = [m.modules[nm] for nm in names]
    if optimizer is not None:
        stage("optimizer steps", total=2)
    if m.streamed:  # each unit's state made, stepped and let go in turn (.streamed)
        done = streamed_optimizer_steps(model, optimizer, m.unit_params, unit_modules, m.dev)
        m.static = {**static_bytes(model, None), "optimizer": done["optimizer_bytes"]}
        m.state_bytes, m.chunked, m.param_steps = done["state_bytes"], done["chunked"], done["param_steps"]
        advance(2)
        for name in ("keep_marks", "rc_marks"):  # the state, never on the device, in every level
            setattr(m, name, add_state_to_marks(getattr(m, name), m.static["optimizer"]))
        m.sac_marks = {k: add_state_to_marks(v, m.static["optimizer"]) for k, v in m.sac_marks.items()}
        m.peak += m.static["optimizer"]
        m.run.grads_done = {u: v + m.static["optimizer"] for u, v in m.run.grads_done.items()}
    else:
        m.static = static_bytes(model, optimizer)
        m.state_bytes = unit_state_bytes(model, optimizer, m.unit_params, unit_modules)
        m.chunked = (chunked_step(model, m.inputs, m.loss_fn, optimizer, m.unit_params, m.dev, m.kwargs)
                     if optimizer is not None else None)
        advance()
        m.param_steps = (param_steps(model, m.inputs, m.loss_fn, optimizer, m.unit_params, m.dev, m.kwargs)
                         if optimizer is not None else None)
        advance()
    m.heads, m.head_why = {}, ""
    if m.head and m.streamed:
        m.head_why = "the LM head's options are not measured in a state-streamed profile"
    elif m.head:
        m.heads, m.head_why = measure_heads(model, m.inputs, m.loss_fn, m.opt, names, m.dev, m.kwargs,
                                            m.head_module, m.labels_ref, m.repeats)


def _segments(m: SimpleNamespace) -> tuple[list[Segment], dict, dict, list[list[int]], dict[int, int]]:
    """The step's segments with their times, the pooled units, and each segment's peak with every unit recomputed."""
    names, modules, run = m.names, m.modules, m.run
    segs, fwd_seg, bwd_seg = segments_from(m.keep_marks, len(names))
    pools = robust_times(segs, m.timings, fwd_seg, bwd_seg, names, [
        unit_signature(modules[nm], *run.unit_io.get(i, ([], []))[:2]) for i, nm in enumerate(names)], m.timing)
    use_unit_times(m.heads, segs)
    if m.streamed:  # the optimizer over every parameter at once never ran: the sum of its parts (.streamed)
        opt_seg = next(i for i, sg in enumerate(segs) if sg.label == "to optimizer_end")
        segs[opt_seg].time = m.chunked[2]
        segs[opt_seg].rel_peak = step_rel_peak(m.optimizer, m.chunked[1], m.dev)
        m.peak = max(m.peak, segs[opt_seg].start_level + segs[opt_seg].rel_peak)
    rc_rel = {}
    if [mk[0] for mk in m.rc_marks] == m.labels_ref:
        for i in range(len(m.rc_marks) - 1):
            rc_rel[i] = max(0, m.rc_marks[i + 1][2] - m.rc_marks[i][1])
    return segs, fwd_seg, bwd_seg, pools, rc_rel


def _unit_profiles(m: SimpleNamespace, spec: DeviceSpec, segs: list[Segment], fwd_seg: dict, bwd_seg: dict,
                   rc_rel: dict[int, int], groups: list, save_sets: dict) -> list[UnitProfile]:
    run, chunked, streamed = m.run, m.chunked, m.param_steps
    unit_list = []
    for i, name in enumerate(m.names):
        mod = m.modules[name]
        saved = sum(g.nbytes for g in groups if i in g.savers)
        interior = sum(g.nbytes for g in groups if g.savers == (i,) and g.producer == i and not g.outside_saver)
        in_shapes, out_shapes, in_bytes, out_bytes = run.unit_io.get(i, ([], [], 0, 0))
        unit_list.append(UnitProfile(
            name=name, index=i, type=type(mod).__name__, fwd_time=segs[fwd_seg[i]].time, bwd_time=segs[bwd_seg[i]].time,
            saved_bytes=saved, interior_bytes=interior, input_bytes=in_bytes, output_bytes=out_bytes,
            param_bytes=sum(p.numel() * p.element_size() for p in mod.parameters()),
            has_rng=bool(m.info[name].get("rng")), has_running_stats=bool(running_stat_modules(mod)),
            recomputable=True, swappable=spec.has_host_link, fwd_segment=fwd_seg[i], bwd_segment=bwd_seg[i],
            rc_fwd_rel_peak=rc_rel.get(fwd_seg[i], segs[fwd_seg[i]].rel_peak),
            rc_bwd_rel_peak=rc_rel.get(bwd_seg[i], segs[bwd_seg[i]].rel_peak + 0),
            input_shapes=in_shapes, output_shapes=out_shapes, **m.state_bytes[i],
            step_time=chunked[0][i + 1] if chunked else 0.0, step_rel_peak=chunked[1][i + 1] if chunked else 0,
            param_steps=streamed[i] if streamed else [], save_sets=save_sets.get(i, {}),
            grads_done_extra=(run.grads_done[i] - segs[bwd_seg[i] + 1].start_level
                              if i in run.grads_done and bwd_seg[i] + 1 < len(segs) else 0),
        ))
    return unit_list


def _assemble(m: SimpleNamespace, spec: DeviceSpec, amp_name: str | None, keep_outputs: bool) -> ModelProfile:
    """The profile from what the steps measured."""
    segs, fwd_seg, bwd_seg, pools, rc_rel = _segments(m)
    model, optimizer, names, modules, static, chunked, peak = (m.model, m.optimizer, m.names, m.modules, m.static,
                                                               m.chunked, m.peak)
    groups = groups_from(m.run)
    median = lambda runs: [statistics.median(t[i] for t in runs) for i in range(len(segs))]  # noqa: E731
    save_sets, sac_notes = _save_sets(m.proposed, m.sac_marks, m.rc_marks, m.labels_ref, segs, fwd_seg, bwd_seg,
                                      median(m.rc_times) if m.rc_times else None,
                                      {k: median(v) for k, v in m.sac_times.items() if v})
    unit_list = _unit_profiles(m, spec, segs, fwd_seg, bwd_seg, rc_rel, groups, save_sets)
    pool_step_times(unit_list, pools)
    unit_saved = sum(g.nbytes for g in groups if g.savers)
    batch = None  # the first dimension of the first batched input tensor, positional first, then keyword
    tensors = [x for x in [*m.inputs, *m.kwargs.values()] if isinstance(x, torch.Tensor)]
    first = next((x for x in tensors if x.dim() > 0), None)
    if first is not None:
        batch = int(first.shape[0])
    prof = ModelProfile(
        units=unit_list, segments=segs, groups=groups, device=spec, peak_bytes=peak,
        step_time=sum(s.time for s in segs), start_level=m.keep_marks[0][1], param_bytes=static["params"],
        grad_bytes=static["params_trainable"], optimizer_state_bytes=static["optimizer"],
        buffer_bytes=static["buffers"], input_bytes=unique_bytes(tensors),
        unattributed_bytes=max(0, peak - static["params"] - static["params_trainable"] - static["optimizer"]
                               - static["buffers"] - unit_saved),
        batch_size=batch, fingerprint=tuple(unit_fingerprint(nm, modules[nm]) for nm in names), excluded=m.excluded,
        coverage=(unit_saved / m.total_saved) if m.total_saved else 1.0,
        meta=_meta(m, sac_notes, amp_name, keep_outputs),
        step_segment=next((i for i, sg in enumerate(segs) if sg.label == "to optimizer_end"), -1),
        outside_step_time=chunked[0][0] if chunked else 0.0, outside_step_rel_peak=chunked[1][0] if chunked else 0,
        chunked_step_time=chunked[2] if chunked else 0.0, merges=m.merges, heads=m.heads,
    )
    _mark_side_effects(prof, m.effects)
    prof._model_ref = weakref.ref(model)
    if optimizer is not None:
        prof._optimizer_ref = weakref.ref(optimizer)
    return prof


def _meta(m: SimpleNamespace, sac_notes: list, amp_name: str | None, keep_outputs: bool) -> dict[str, Any]:
    model, optimizer, units = m.model, m.optimizer, m.units
    return {
        "model_class": type(model).__name__,
        "torch_version": torch.__version__,
        "repeats": m.repeats,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "profile_seconds": round(time.perf_counter() - m.t_start, 3),
        "rc_marks_matched": [mk[0] for mk in m.rc_marks] == m.labels_ref,
        "model_fingerprint": model_fingerprint(model, m.names),  # a plan made from this profile refuses other models
        "optimizer_fingerprint": optimizer_fingerprint(optimizer) if optimizer is not None else None,
        "units_rule": units if units in ("auto", "fine") else "depth" if isinstance(units, int) else "names",
        "split": m.split,  # units="fine": module split into its children -> its class (the table's hierarchy)
        "split_why": m.split_why,  # units="fine": why each block was split or kept whole
        "merge_why": m.merge_why,  # split blocks that cannot be one unit again (merge_units), and why
        "selective": ({"measured": True, "notes": sac_notes} if m.selective else None),
        "autocast": amp_name,  # the forward's, if any
        "method": "measured",  # or "extrapolated" from smaller batches (memopt_nb.profiling.fallback)
        **({"head_why": m.head_why} if m.head_why else {}),  # head options the profile could not measure, and why
        "keep_outputs": bool(keep_outputs),  # the loop keeps the model's output (profiled so)
        **({"lm_head": m.lm_head} if m.lm_head else {}),  # the LM head: module, logits bytes, vocabulary
        "timing": m.timing,  # repeats, spreads, pooled units (memopt_nb.profiling.timing)
        "time_warning": time_warning(m.timing),  # plain words when the machine was too busy to trust the times
        **({"state_streamed": True,  # the optimizer's state a unit at a time (memopt_nb.profiling.streamed)
            "state_streamed_why": streamed_why(m.static["optimizer"], m.static["params_trainable"])}
           if m.streamed else {}),
    }
