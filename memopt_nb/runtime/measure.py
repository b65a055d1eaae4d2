"""``memopt.measure``: peak device memory and step time of real training steps."""

from __future__ import annotations

import contextlib
import html
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core.budget import format_bytes
from ..core.errors import PlanError, ProfileError
from ..core.plan import Plan
from ..core.progress import advance, stage, task
from .apply import AppliedPlan
from .distributed import ddp_bucket_bytes, ddp_bucket_view, is_ddp, resized_storages
from .memory import meter_for
from .outside import preserved_outside
from .step import (
    keeping_outputs,
    kept_outputs,
    model_keywords,
    output_tensors,
    preserved_state,
    resolve_autocast,
    step_autocast,
    training_step,
)

__all__ = ["MEASURE_OPTIONS", "Measurement", "measure", "model_device"]


#: measure()'s own keyword options; every other keyword goes to the model.
MEASURE_OPTIONS = ("loss_fn", "optimizer", "plan", "steps", "warmup", "model_kwargs", "autocast")


@dataclass
class Measurement:
    """What real training steps used.

    Attributes:
        peak_bytes: peak device memory of one step: the model's, the optimizer's and the inputs' tensors and
            everything the step allocates (CUDA: the caching allocator's ``max_memory_allocated``, workspaces included,
            less ``other_bytes``; CPU: live tensor storages on the emulated device, swap host store excluded).
        step_time: median seconds per step over the timed steps.
        step_times: every timed step's seconds.
        losses: loss of every step run (warm-up, memory step and timed steps), for equality checks.
        device: ``"cpu"`` or ``"cuda:0"``.
        method: the plan's method, or ``"none"``.
        swap_stats: what the plan did: the swap engine's bytes moved and waits, if it swaps; the state placements'
            bytes moved each way and steps in backward, if it moves optimizer state, gradients or parameters.
        other_bytes: (CUDA) what other tensors held on the device when measuring began, not counted in ``peak_bytes``
            (the CPU meter never sees them).
    """

    peak_bytes: int
    step_time: float
    step_times: list[float]
    losses: list[float]
    device: str
    method: str
    swap_stats: dict[str, float] = field(default_factory=dict)
    other_bytes: int = 0

    def _repr_html_(self) -> str:
        return (f"<b>{html.escape(self.method)}</b> on {self.device}: peak {format_bytes(self.peak_bytes)}, "
                f"step {self.step_time * 1e3:.2f} ms (median of {len(self.step_times)})")

    def __repr__(self) -> str:
        return (f"Measurement({self.method}: peak {format_bytes(self.peak_bytes)}, step {self.step_time * 1e3:.2f} ms, "
                f"{len(self.step_times)} timed steps on {self.device})")


def model_device(model: nn.Module, inputs: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> torch.device:
    for p in model.parameters():
        return p.device
    for x in [*inputs, *(kwargs or {}).values()]:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _ddp_buckets_untracked(model: nn.Module) -> int:
    """Bytes of DDP's gradient buckets that no tensor reachable from the model holds: all of them, unless the
    gradients are views into them (``gradient_as_bucket_view``) and present. DDP allocates them when it wraps the
    model, so the CUDA meter would otherwise count them as other tensors' memory (0 for a model that is not DDP)."""
    if not is_ddp(model):
        return 0
    if ddp_bucket_view(model) and any(p.grad is not None for p in model.parameters()):
        return 0
    return ddp_bucket_bytes(model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@task("measure")
def measure(model: nn.Module, *inputs: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None,
            optimizer: torch.optim.Optimizer | None = None, plan: Plan | None = None, steps: int = 3,
            warmup: int = 1, model_kwargs: Mapping[str, Any] | None = None,
            autocast: torch.dtype | str | None = None, **kwargs: Any) -> Measurement:
    """Run real training steps (optionally under ``plan``) and report peak memory and median step time.

    The model is called as ``model(*inputs, **kwargs)``: every keyword that is not one of measure()'s own options
    (``loss_fn``, ``optimizer``, ``plan``, ``steps``, ``warmup``, ``model_kwargs``, ``autocast``) goes to the model,
    e.g. ``memopt.measure(model, input_ids=ids, attention_mask=mask, labels=ids, loss_fn=lambda out: out.loss)``. A
    model keyword named like one of those options goes in ``model_kwargs={"plan": ...}``.

    ``warmup`` steps (default 1; 0 skips it) create optimizer state, one step is measured for memory, then ``steps``
    steps are timed. The model, optimizer and RNG are restored afterwards, and so is every module outside the model that
    ``loss_fn`` calls (a discriminator), so measuring has no side effects.

    A plan that moves optimizer state, gradients or parameters (a whole-step plan) manages ``optimizer`` (required
    then) for the measured steps, so the peak and time include the state's transfers and the unit-by-unit step.

    ``autocast=torch.bfloat16`` (or ``torch.float16``, ``"bf16"``, ``"fp16"``) runs each step's forward and loss under
    ``torch.autocast`` and its backward and optimizer step outside, as :func:`memopt_nb.profiling.profile`'s
    ``autocast=`` does:
    measure as you profiled.
    """
    if not isinstance(model, nn.Module):
        raise ProfileError(f"measure() needs a torch.nn.Module, got {type(model).__name__}")
    for name, value, lowest in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            what = "timed steps, at least 1" if name == "steps" else "untimed warm-up steps, 0 or more"
            raise ProfileError(f"{name} must be an int ({what}), e.g. {name}={3 if name == 'steps' else 1}; "
                               f"got {value!r} ({type(value).__name__})")
    kwargs = model_keywords(model, "measure", MEASURE_OPTIONS, model_kwargs, kwargs)
    device = model_device(model, inputs, kwargs)
    amp = resolve_autocast(autocast, device, "measure")
    if plan is not None and plan.moves_state and optimizer is None:
        raise PlanError("this plan moves optimizer state, gradients or parameters, which only a training step with "
                        "an optimizer exercises; pass it: memopt.measure(model, ..., optimizer=opt, plan=p)")
    ctx: Any = AppliedPlan(plan, model, optimizer) if plan is not None else contextlib.nullcontext()
    losses: list[float] = []
    times: list[float] = []
    # modules outside the model that the loss calls (a GAN's discriminator) are restored too
    keep = bool(plan is not None and plan.meta.get("keep_outputs"))  # the loop the plan was profiled for
    with preserved_outside(model) as outside, preserved_state(model, optimizer), step_autocast(device.type, amp), \
            keeping_outputs(keep), ctx:
        stage("warm-up and memory steps", total=warmup + 1)
        for _ in range(warmup - 1):
            losses.append(training_step(model, inputs, loss_fn, optimizer, kwargs=kwargs).item())
            advance()
        meter = meter_for(device)
        meter.track(model, optimizer, list(inputs), kwargs, [t for _, t in output_tensors(kept_outputs())])
        if hasattr(meter, "track_bytes"):  # CUDA: memory of this training that no tracked tensor reaches
            meter.track_bytes(_ddp_buckets_untracked(model))
        with meter:
            # the last warm-up step under the meter too: on CPU it then also counts memory the step keeps that no
            # Python object lists (DDP's gradient buckets, first used by the all-reduce of this step)
            if warmup > 0:
                losses.append(training_step(model, inputs, loss_fn, optimizer, kwargs=kwargs).item())
            if hasattr(meter, "watch"):  # FSDP2 resizes its unsharded parameters where a dispatch mode cannot see it

                meter.watch(resized_storages(model))
            meter.reset_peak()
            loss = training_step(model, inputs, loss_fn, optimizer, kwargs=kwargs)
        peak = int(meter.peak)
        advance(2 if warmup > 0 else 1)
        outside.stop()  # every module the step calls is known: the timed steps run without the watch
        losses.append(loss.item())
        stage("timed steps", total=steps)
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            loss = training_step(model, inputs, loss_fn, optimizer, kwargs=kwargs)
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
            advance()
        stats = dict(ctx.stats) if isinstance(ctx, AppliedPlan) else {}
    return Measurement(peak_bytes=peak, step_time=statistics.median(times), step_times=times, losses=losses,
                       device=str(device), method=plan.method if plan is not None else "none", swap_stats=stats,
                       other_bytes=int(getattr(meter, "other", 0)))
