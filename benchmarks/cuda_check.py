"""CUDA verification: the one script to run on a machine with an NVIDIA GPU to check everything that needs a GPU.

Activation plans, per zoo model (GPT-style and ResNet-style by default) at a GPU-sized batch:

1. loss and gradients under keep / recompute / swap / mixed plans equal plain training (deterministic algorithms on);
   so do those under ``recompute_offload``, ``selective`` and a plan on finer units (``units="fine"``, each
   block's children a unit: ``fine_mixed``, every strategy mixed);
2. the swap engine really uses its side copy streams and pinned pool (engine stats: bytes moved, pool reuse);
3. ``torch.cuda.max_memory_allocated`` under each plan vs the simulator's predicted peak (the profile is taken on the
   GPU, so the allocator's view, workspaces included, is what the simulator starts from; a measured peak more than
   2 % + 2 MiB off the prediction, the README's tolerance, fails: above it, a plan made for a budget would overrun it);
4. step time under each plan vs keep-all, measured vs simulated.

Whole-step plans (optimizer state, gradients and parameters placed per unit), on a zoo model and the
fixed-state-heavy models (``memopt.zoo.STATE_HEAVY``):

5. three training steps bit-equal to plain training (losses, readable gradients, parameters, buffers,
   ``opt.state_dict()`` inside and after the block) under plans that offload the optimizer state (moved a unit at a
   time, or streamed a parameter at a time), the gradients, the parameters, step in backward, all of these together,
   and mixed with recompute/swap — for Adam (foreach, the
   default on CUDA), Adam ``fused=True``, AdamW and SGD with momentum — and that each plan really moved bytes
   (``AppliedPlan.stats``);
6. per whole-step plan, the measured peak (``memopt.measure``: ``torch.cuda.max_memory_allocated`` on CUDA) and step
   time vs ``memopt.simulate`` (the same peak check as 3); plus one plan searched with ``offload_state=True`` at a
   budget below the activation-only floor (its measured peak vs the budget, and its bit equality; over it by up to
   :data:`ALLOCATOR_ALLOWANCE`, the caching allocator's blocks, is reported, not failed);
7. from a ``torch.profiler`` trace of one step: the state copies run on side streams (not the compute stream), to and
   from pinned host memory, and how much of their time overlaps compute kernels;
8. ``--pytest``: the CUDA tests of the test suite (``-k cuda`` in :data:`PYTEST_FILES`: state placements, whole-step
   plans, mixed precision, the loop's habits between steps, LoRA with parameters offloaded, timm models with units
   split by state), in a pytest with deterministic algorithms on (:func:`pytest_env`), pass/fail counts recorded;
9. the runtime overheads of ``benchmarks/runtime_overhead.py`` on the GPU (target <= 1.03, reported, not
   checked): (c) ``recompute_offload`` vs recompute plus the simulator's copy time, (d) ``selective`` keeping every
   op output vs keep — on the CPU these miss the target by the per-op cost of Python dispatch, which a GPU may hide —
   and (e) optimizer state streamed a parameter at a time vs moved a unit at a time, beside the simulated ratio;
10. the swap engine's cost per storage copied on the GPU, beyond the bytes (three runs, reported next to the
   ``DeviceSpec.copy_overhead_s`` that CUDA detection measured the same way);
11. a step that does not fit: inside ``memopt.limit_memory(0.6 × its unplanned peak)`` (on CUDA
   ``set_per_process_memory_fraction``, checked set inside and restored after) the unplanned step raises
   ``torch.OutOfMemoryError`` and leaves the parameters as they were; ``memopt.profile`` extrapolates from smaller
   batches (its peak vs the one measured without the limit); the exact plan for the limit trains three steps inside
   it, bit-equal to unplanned training without the limit; ``memopt.max_batch`` answers a batch at least as big, and
   a step at that batch under its plan stays inside the limit;
12. the LM head (``profile(..., head="chunked")``) on a transformers GPT-2 with its real vocabulary (50257): per
   measured number of chunks, a keep and a recompute plan with the head chunked, their measured peak vs the prediction
   (the peak check of 3), the first loss bit-equal to the head as written and three steps' parameters within 1e-5;
   then the transformers documentation's loop (``outputs`` kept) profiled with ``keep_outputs=True``, planned at 50 %
   and trained three steps inside ``memopt.limit_memory`` of that budget.

Bit equality runs with deterministic algorithms and their NaN fill of new memory; timing runs without the fill (one
kernel per new tensor, which would charge a plan for every buffer it makes).

    python benchmarks/cuda_check.py [--quick] [--pytest] [--out DIR]     # on the GPU machine (run times:
                                                                        # benchmarks/RESULTS.md)
    python benchmarks/cuda_check.py --dry-run                               # anywhere: every plan and check on CPU

``--dry-run`` builds every plan and runs every check on the CPU at tiny sizes (the trace check needs CUDA and is
skipped), so that the script's own logic is tested where there is no GPU (tests/test_cuda_check_script.py).
``CUBLAS_WORKSPACE_CONFIG`` is set to ``:4096:8`` unless already set. Writes ``cuda_check.json`` to ``--out``
(default: $OUT or the current directory) and prints Markdown tables. Exit status 0 when every check passed.
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch initialises cuBLAS

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import xml.etree.ElementTree as ET  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the tolerances of the README's claims, defined once for the tests and here

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from helpers.tolerances import CUDA_ABS, CUDA_REL, cuda_allows  # noqa: E402

import memopt_nb as memopt  # noqa: E402
from memopt_nb.core.cuts import outermost  # noqa: E402
from memopt_nb.core.plan import Plan, optimizer_fingerprint  # noqa: E402
from memopt_nb.runtime.state import HostTensor  # noqa: E402

MiB = 2**20

# ---------------------------------------------------------------------- configurations
#: Tiny sizes for --dry-run (seconds on a CPU).
DRY_SIZES: dict[str, dict[str, Any]] = {
    "gpt": dict(batch_size=2, seq_len=16, d_model=32, n_layers=4, n_heads=2, vocab=64),
    "resnet": dict(batch_size=4, widths=(8, 16), blocks_per_stage=2),
    "mlp": dict(batch_size=8, width=32, depth=4),
    "vit": dict(batch_size=4, d_model=32, n_layers=4, n_heads=2),
    "unet": dict(batch_size=2, widths=(8, 16), image=16),
    "resnet18": dict(batch_size=2, image=32),  # BatchNorm needs 2 samples at the 1×1 last stage
    "vit_tiny": dict(batch_size=1, image=32),
    "convnext_atto": dict(batch_size=1, image=32),
}

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),  # foreach: the default kernel on CUDA (single-tensor on CPU)
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}

#: per unit, cycled: (strategy, optimizer, grads, params)
VARIANTS: dict[str, list[tuple[str, str, str, str]]] = {
    "opt_offload": [("keep", "offload", "resident", "resident")],
    "grads_offload": [("keep", "resident", "offload", "resident")],
    "params_offload": [("keep", "resident", "resident", "offload")],
    "step_in_bw": [("keep", "resident", "step", "resident")],
    "all_offload": [("keep", "offload", "offload", "offload")],
    "all_step": [("keep", "offload", "step", "offload")],
    "mixed": [("recompute", "offload", "offload", "resident"), ("swap", "resident", "resident", "offload"),
              ("keep", "offload", "offload", "offload"), ("recompute", "resident", "offload", "offload")],
    "mixed_step": [("recompute", "offload", "step", "resident"), ("swap", "offload", "resident", "offload"),
                   ("keep", "resident", "step", "offload"), ("swap", "offload", "offload", "resident")],
    # optimizer state streamed one parameter at a time, beside units that move it whole
    "stream": [("keep", "stream", "offload", "resident"), ("recompute", "stream", "resident", "offload"),
               ("keep", "offload", "offload", "resident")],
    "stream_step": [("keep", "stream", "step", "offload"), ("swap", "stream", "offload", "resident")],
}
#: --quick: every variant with the default Adam, these with the other optimizers
QUICK_VARIANTS = ("all_step", "mixed", "stream")


@dataclasses.dataclass
class Config:
    """What one run checks (set from the command line by :func:`config_from_args`)."""

    device: torch.device
    dry_run: bool
    quick: bool
    models: list[str]
    whole_models: list[str]
    batch: int | None
    optimizers: list[str]
    steps: int = 3
    measure_steps: int = 5
    search_timesteps: int | None = None
    search_models: list[str] = dataclasses.field(default_factory=list)
    trace: bool = True
    pytest: bool = False
    pytest_timeout: float = 300.0
    fit_check: bool = True
    head_check: bool = True
    #: the device with the measured per-storage copy cost (set by :func:`copy_cost_section`; None: not measured)
    costed_device: Any = None


def model_kwargs(name: str, cfg: Config, whole: bool) -> dict[str, Any]:
    """Builder keywords of zoo model ``name`` for this run."""
    if cfg.dry_run:
        return dict(DRY_SIZES.get(name, {}))
    ref = inspect.signature(memopt.zoo.BUILDERS[name]).parameters["batch_size"].default
    if cfg.batch:
        return {"batch_size": cfg.batch}
    if whole and name in memopt.zoo.STATE_HEAVY:
        return {"batch_size": 4 * ref}  # still fixed-state-heavy: the state is most of the peak
    return {"batch_size": (4 if whole else 8) * ref}


def builder(name: str, cfg: Config, whole: bool) -> Callable[[], Any]:
    kw = model_kwargs(name, cfg, whole)
    return lambda: memopt.zoo.build(name, seed=0, device=cfg.device, **kw)


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def no_fill() -> Any:
    """Timing without deterministic mode's NaN fill of every new tensor (a kernel per ``torch.empty``, which would
    charge a plan for each buffer it makes); the bit-equality checks keep the fill, which also catches a read of
    uninitialised memory."""
    import torch.utils.deterministic as det

    old = det.fill_uninitialized_memory
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        det.fill_uninitialized_memory = old


def kernel_of(opt: torch.optim.Optimizer, device: torch.device) -> str:
    """Which update kernel ``opt`` runs on ``device``: fused, foreach or single-tensor."""
    d = opt.defaults
    if d.get("fused"):
        return "fused"
    if d.get("foreach") or (d.get("foreach") is None and device.type == "cuda"):
        return "foreach"
    return "single"


def whole_plan(base: Plan, rows: list[tuple[str, str, str, str]]) -> Plan:
    """``base`` with per-unit (strategy, optimizer, grads, params) from ``rows`` (cycled); step_in_backward set when a
    unit steps in backward; swap timings as ``base``'s."""
    decisions = tuple(dataclasses.replace(d, strategy=s, optimizer=o, grads=g, params=q)
                      for d, (s, o, g, q) in zip(base.decisions, (rows[i % len(rows)] for i in range(len(base.units))),
                                                 strict=True))
    return base.with_meta(decisions=decisions, step_in_backward=any(r[2] == "step" for r in rows),
                          method="cuda_check")


# ---------------------------------------------------------------------- training and comparing
def same(a: object, b: object) -> bool:
    """Equal values and structure, dict key order included; tensors bit-equal (torch.equal, same dtype)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def readable_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient the loop may read (not those a step in backward already applied), as plain tensors."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None or (isinstance(g, HostTensor) and g._stepped):
            continue
        out[n] = g.clone()
    return out


def train(build: Callable[[], Any], opt_name: str, plan: Plan | None, steps: int) -> tuple[nn.Module, Any, dict]:
    """``steps`` plain training steps of a fresh model, under ``plan`` if given (made for this optimizer)."""
    zm = build()
    model = zm.model
    opt = OPTIMIZERS[opt_name](model.parameters())
    seed_all(11)  # dropout
    rec: dict[str, Any] = {"losses": [], "grads": [], "sd_inside": None, "stats": {}, "mover": None,
                           "kernel": kernel_of(opt, next(model.parameters()).device)}
    applied = None
    if plan is not None:
        applied = memopt.plan(plan.with_meta(optimizer_fingerprint=optimizer_fingerprint(opt)), model, optimizer=opt)
        applied.apply()
    try:
        for _ in range(steps):
            loss = zm.loss_fn(model(*zm.inputs))
            loss.backward()
            rec["losses"].append(loss.detach().clone())
            rec["grads"].append(readable_grads(model))
            opt.step()
            opt.zero_grad()
        rec["sd_inside"] = opt.state_dict()
        if applied is not None and applied.state is not None:
            rec["mover"] = type(applied.state._mover).__name__
    finally:
        if applied is not None:
            applied.remove()
            rec["stats"] = dict(applied.stats)
    return model, opt, rec


def differences(ref: tuple, got: tuple) -> list[str]:
    """What differs between two training runs (empty: bit-identical)."""
    (m0, o0, r0), (m1, o1, r1) = ref, got
    out = []
    for i, (a, b) in enumerate(zip(r0["losses"], r1["losses"], strict=True)):
        if not torch.equal(a, b):
            out.append(f"loss {i}")
    for i, (g0, g1) in enumerate(zip(r0["grads"], r1["grads"], strict=True)):
        if not set(g1) <= set(g0) or not same({k: g0[k] for k in g1}, g1):
            out.append(f"grads {i}")
    out += [f"param {n}" for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True)
            if type(b) is not nn.Parameter or not torch.equal(a, b)]
    out += [f"buffer {n}" for (n, a), (_, b) in zip(m0.named_buffers(), m1.named_buffers(), strict=True)
            if not torch.equal(a, b)]
    if not same(r0["sd_inside"], r1["sd_inside"]):
        out.append("state_dict inside")
    if not same(o0.state_dict(), o1.state_dict()):
        out.append("state_dict after")
    if any(isinstance(v, HostTensor) for st in o1.state.values() for v in st.values()):
        out.append("placeholder left in opt.state")
    return out


def moved_problems(stats: dict, plan: Plan, steps: int | None) -> list[str]:
    """What the plan says it moves but the runtime's stats do not show (a plan doing nothing trains identically too).
    ``steps``: exact count of steps in backward expected, or None for at least one."""
    c = plan.state_counts()
    out = []
    if c["optimizer"] and not (stats.get("state_d2h_bytes", 0) > 0 and stats.get("state_h2d_bytes", 0) > 0):
        out.append("no optimizer-state bytes moved")
    if c["grads"] and not stats.get("grad_d2h_bytes", 0) > 0:
        out.append("no gradient bytes moved")
    if c["step"]:
        sib = stats.get("steps_in_backward", 0)
        if (steps is not None and sib != steps * c["step"]) or sib == 0:
            out.append(f"steps_in_backward {sib}, expected {steps * c['step'] if steps else '> 0'}")
    if c["params"] and not stats.get("param_h2d_bytes", 0) > 0:
        out.append("no parameter bytes moved")
    if {"swap", "recompute_offload"} & set(plan.strategies) and not stats.get("offloaded_bytes", 0) > 0:
        out.append("no activation bytes swapped")
    return out


STAT_KEYS = ("state_d2h_bytes", "state_h2d_bytes", "grad_d2h_bytes", "grad_h2d_bytes", "param_h2d_bytes",
             "param_d2h_bytes", "steps_in_backward", "offloaded_bytes", "prefetched_bytes", "on_demand", "pool_reuses")


def short_stats(stats: dict) -> dict[str, float]:
    return {k: stats[k] for k in STAT_KEYS if stats.get(k)}


def guarded(fn: Callable[[], Any], failures: list[str], what: str) -> Any:
    """Run ``fn``; an exception is recorded as a failure of ``what`` (one broken check does not end the run)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the report must say what broke and go on with the other checks
        traceback.print_exc()
        failures.append(f"{what}: {type(e).__name__}: {e}")
        return None


# ---------------------------------------------------------------------- activation section
def activation_section(cfg: Config, failures: list[str], save: Callable[[], None] = lambda: None,
                       rows: list[dict] | None = None) -> list[dict]:
    """Activation-only plans per model (appended to ``rows``, saved after each model)."""
    rows = [] if rows is None else rows
    for name in cfg.models:
        t0 = time.perf_counter()
        got = guarded(lambda name=name: activation_model(name, cfg, failures), failures, f"activation {name}")
        rows.extend(got or [])
        save()
        print(f"{name}: activation plans profiled and checked in {time.perf_counter() - t0:.1f} s")
    return rows


def selective_or_recompute(prof: Any) -> list[str]:
    """Per unit of ``prof``: ``"selective"`` where it offers a Pareto save-set, else ``"recompute"``."""
    return ["selective" if any(s["pareto"] for s in u.save_sets.values()) else "recompute" for u in prof.units]


def activation_model(name: str, cfg: Config, failures: list[str]) -> list[dict]:
    """Keep / recompute / swap / recompute_offload / selective / mixed / fine-unit / mixed-depth / searched
    activation-only plans on zoo model ``name``."""
    build = builder(name, cfg, whole=False)
    zm = build()
    model, inputs, loss_fn = zm.model, zm.inputs, zm.loss_fn
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1 if cfg.dry_run else 3,
                          selective=True)
    n = prof.n_units
    sel = selective_or_recompute(prof)
    plans = {
        "keep": Plan.uniform(prof, "keep"),
        "recompute": Plan.uniform(prof, "recompute"),
        "swap": Plan.uniform(prof, "swap", offload_window=1, prefetch_distance=1),
        "mixed": Plan.from_strategies(prof, (["swap", "recompute", "keep"] * n)[:n],
                                      offload_window=[i % 3 for i in range(n)],
                                      prefetch_distance=[(2 * i) % 4 for i in range(n)]),
        # recompute_offload: recompute with the checkpoint's inputs on the host (pinned, on the copy streams)
        "recompute_offload": Plan.uniform(prof, "recompute_offload", offload_window=1, prefetch_distance=1),
        "mixed_ro": Plan.from_strategies(prof, (["recompute_offload", "swap", "keep", "recompute"] * n)[:n],
                                         offload_window=[i % 3 for i in range(n)],
                                         prefetch_distance=[(i + 1) % 4 for i in range(n)]),
        # selective checkpointing (torch's SAC modes keep the matmul / attention outputs of the save-set)
        "selective": Plan.from_strategies(prof, sel),
        "mixed_sel": Plan.from_strategies(prof, [s if i % 3 == 0 else ("swap", "keep", "recompute")[i % 3 - 1]
                                                 for i, s in enumerate(sel)], offload_window=1, prefetch_distance=1),
    }

    # finer units, each block's children a unit of their own (units="fine"; the same units where a model's
    # blocks have no children to split into), every new strategy mixed with the old ones on them
    fine = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1 if cfg.dry_run else 3,
                          units="fine", selective=True)
    profiles = {"fine_mixed": fine}
    cycle = [("recompute_offload", "swap", "keep", s)[i % 4] for i, s in enumerate(selective_or_recompute(fine))]
    plans["fine_mixed"] = Plan.from_strategies(fine, cycle, offload_window=[i % 3 for i in range(fine.n_units)],
                                               prefetch_distance=[(i + 1) % 4 for i in range(fine.n_units)])
    # mixed depths, every other split block one unit again (its measured whole-block recomputation), the
    # rest fine, strategies cycled over the cut
    outer = outermost(fine.merges)[::2]
    if outer:
        cut = memopt.merge_units(fine, outer)
        profiles["depths_mixed"] = cut
        plans["depths_mixed"] = Plan.from_strategies(
            cut, [("recompute", "swap", "keep", "recompute_offload")[i % 4] for i in range(cut.n_units)],
            offload_window=1, prefetch_distance=1)

    def search() -> Plan:  # half-way between the activation-only floor and keep-all
        floor = memopt.solvers.min_peak(prof, offload_state=False)
        budget = (floor + memopt.simulate(prof, plans["keep"]).peak_bytes) // 2
        return memopt.search(prof, budget, offload_state=False, total_timesteps=cfg.search_timesteps)

    searched = guarded(search, failures, f"activation search {name}")
    if searched is not None:
        plans["search"] = searched
    rows = []
    base = None
    for label, plan in plans.items():
        what = f"activation {name}/{label}"
        pprof = profiles.get(label, prof)
        sim = memopt.simulate(pprof, plan)
        with no_fill():
            m = guarded(lambda p=plan: memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=p,
                                                      steps=cfg.measure_steps), failures, what)
        if m is None:
            continue
        base = base or m
        equal = None
        if label != "search":  # one step with Adam: loss, gradients, parameters, state
            diff = guarded(lambda p=plan: differences(train(build, "adam", None, 1), train(build, "adam", p, 1)),
                           failures, what)
            equal = diff == []
            if diff:
                failures.append(f"{what}: differs from plain training: {', '.join(diff[:5])}")
        row = {
            "model": name, "batch": inputs[0].shape[0], "plan": label, "units": pprof.n_units,
            "sim_peak_MiB": sim.peak_bytes / MiB,
            "cuda_peak_MiB": m.peak_bytes / MiB,
            "peak_err_pct": 100 * (sim.peak_bytes - m.peak_bytes) / m.peak_bytes,
            "sim_ms": sim.step_time * 1e3, "sim_cc_ms": costed_ms(pprof, plan, cfg), "meas_ms": m.step_time * 1e3,
            "time_ratio_vs_keep": m.step_time / base.step_time,
            "grads_equal": equal, "swap_stats": m.swap_stats, "other_MiB": m.other_bytes / MiB,
        }
        problem = peak_problem(what, sim.peak_bytes, m.peak_bytes)
        if problem:
            failures.append(problem)
        rows.append(row)
        print(json.dumps(row, default=str))
    return rows


# ---------------------------------------------------------------------- whole-step section
def pairs_for(cfg: Config) -> list[tuple[str, str]]:
    """(optimizer, variant) pairs checked for bit equality on each whole-step model."""
    out = []
    for o in cfg.optimizers:
        for v in VARIANTS:
            if cfg.quick and o != "adam" and v not in QUICK_VARIANTS:
                continue
            out.append((o, v))
    return out


def search_plan(prof: Any, cfg: Config) -> tuple[Plan | None, dict]:
    """A plan searched over the whole step (offload_state=True, step_in_backward=True) at a budget half-way between
    the whole-step floor and the activation-only floor, i.e. one no activation plan reaches."""
    floor_act = memopt.solvers.min_peak(prof, offload_state=False)
    floor_all = memopt.solvers.min_peak(prof, offload_state=True, step_in_backward=True)
    info = {"floor_activation_only_MiB": floor_act / MiB, "floor_whole_step_MiB": floor_all / MiB}
    if floor_all >= floor_act:
        info["skipped"] = "no budget below the activation-only floor is reachable"
        return None, info
    budget = (floor_act + floor_all) // 2
    t0 = time.perf_counter()
    plan = memopt.search(prof, budget, offload_state=True, step_in_backward=True,
                         total_timesteps=cfg.search_timesteps, seed=0)
    info.update(budget_bytes=budget, budget_MiB=budget / MiB, search_s=time.perf_counter() - t0,
                state_counts=plan.state_counts(), strategy_counts=plan.counts())
    return plan, info


def whole_section(cfg: Config, failures: list[str], result: dict[str, Any] | None = None,
                  save: Callable[[], None] = lambda: None) -> tuple[list[dict], list[dict], list[dict]]:
    """Bit equality per (model, optimizer, plan), measured vs simulated per (model, plan), and the searched plans;
    also kept in ``result`` (``whole_equal``, ``whole_memory``, ``search``) and saved after each model."""
    result = {} if result is None else result
    lists = [result.setdefault(k, []) for k in ("whole_equal", "whole_memory", "search")]
    for name in cfg.whole_models:
        t0 = time.perf_counter()
        got = guarded(lambda name=name: whole_model(name, cfg, failures), failures, f"whole-step {name}")
        for acc, rows in zip(lists, got or ([], [], []), strict=True):
            acc += rows
        save()
        print(f"{name}: whole-step plans checked in {time.perf_counter() - t0:.1f} s")
    return lists[0], lists[1], lists[2]


def whole_model(name: str, cfg: Config, failures: list[str]) -> tuple[list[dict], list[dict], list[dict]]:
    """The whole-step checks on zoo model ``name``."""
    eq_rows, mem_rows, search_rows = [], [], []
    build = builder(name, cfg, whole=True)
    zm = build()
    model, inputs, loss_fn = zm.model, zm.inputs, zm.loss_fn
    opt = OPTIMIZERS["adam"](model.parameters())
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1 if cfg.dry_run else 3)
    keep = Plan.uniform(prof, "keep")
    plans = {v: whole_plan(keep, rows) for v, rows in VARIANTS.items()}
    searched, info = (None, {})
    if name in cfg.search_models:
        got = guarded(lambda: search_plan(prof, cfg), failures, f"search {name}")
        if got is not None:
            searched, info = got
            search_rows.append({"model": name, **info})

    # bit equality: one plain run per optimizer, then one per plan
    checks = [(o, v, plans[v]) for o, v in pairs_for(cfg)] + ([("adam", "search", searched)] if searched else [])
    refs: dict[str, Any] = {}
    for opt_name, label, plan in checks:
        what = f"whole-step {name}/{opt_name}/{label}"
        if opt_name not in refs:
            refs[opt_name] = guarded(lambda o=opt_name: train(build, o, None, cfg.steps), failures, what)
        ref = refs[opt_name]
        got = guarded(lambda o=opt_name, p=plan: train(build, o, p, cfg.steps), failures, what) if ref else None
        if got is None:
            eq_rows.append({"model": name, "optimizer": opt_name, "plan": label, "equal": None, "error": True})
            continue
        diff = differences(ref, got)
        moved = moved_problems(got[2]["stats"], plan, cfg.steps)
        if cfg.device.type == "cuda" and got[2]["mover"] != "CudaMover":
            moved.append(f"state moved by {got[2]['mover']}, not the CUDA side-stream mover")
        if diff:
            failures.append(f"{what}: differs from plain training: {', '.join(diff[:5])}")
        if moved:
            failures.append(f"{what}: {'; '.join(moved)}")
        eq_rows.append({"model": name, "optimizer": opt_name, "kernel": got[2]["kernel"], "plan": label,
                        "equal": not diff, "differs": diff[:10], "moved_ok": not moved, "moved_problems": moved,
                        "state_counts": plan.state_counts(),
                        "mover": got[2]["mover"], "stats": short_stats(got[2]["stats"])})
    refs.clear()
    ref = got = None  # the last plain and planned runs' models and optimizers: not on the device while measuring

    # peak and time, measured vs simulated (the profile's optimizer: Adam, default kernel)
    mem_plans = {"keep": keep, **plans, **({"search": searched} if searched else {})}
    base = None
    for label, plan in mem_plans.items():
        what = f"measure {name}/{label}"
        sim = memopt.simulate(prof, plan)
        with no_fill():
            m = guarded(lambda p=plan: memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=p,
                                                      steps=cfg.measure_steps), failures, what)
        if m is None:
            continue
        base = base or m
        moved = moved_problems(m.swap_stats, plan, None)
        if moved:
            failures.append(f"{what}: {'; '.join(moved)}")
        row = {"model": name, "batch": inputs[0].shape[0], "plan": label,
               "sim_peak_MiB": sim.peak_bytes / MiB, "meas_peak_MiB": m.peak_bytes / MiB,
               "peak_err_pct": 100 * (sim.peak_bytes - m.peak_bytes) / m.peak_bytes,
               "sim_peak_phase": getattr(sim, "peak_phase", None),
               "sim_ms": sim.step_time * 1e3, "sim_cc_ms": costed_ms(prof, plan, cfg), "meas_ms": m.step_time * 1e3,
               "time_err_pct": 100 * (sim.step_time - m.step_time) / m.step_time,
               "time_ratio_vs_keep": m.step_time / base.step_time,
               "moved_ok": not moved, "stats": short_stats(m.swap_stats), "other_MiB": m.other_bytes / MiB}
        if label == "search":
            row["budget_MiB"] = info["budget_MiB"]
            row["within_budget"] = m.peak_bytes <= info["budget_bytes"]
            row["over_budget_MiB"] = max(0, m.peak_bytes - info["budget_bytes"]) / MiB
            row["within_allowance"] = m.peak_bytes <= info["budget_bytes"] * (1 + ALLOCATOR_ALLOWANCE)
            if not row["within_allowance"]:
                failures.append(f"{what}: measured peak {m.peak_bytes / MiB:.1f} MiB over the budget "
                                f"{info['budget_MiB']:.1f} MiB by more than the allocator's "
                                f"{100 * ALLOCATOR_ALLOWANCE:.0f} %")
        problem = peak_problem(what, sim.peak_bytes, m.peak_bytes)
        if problem:
            failures.append(problem)
        mem_rows.append(row)
        print(json.dumps(row, default=str))
    return eq_rows, mem_rows, search_rows


# ---------------------------------------------------------------------- side streams, from a profiler trace
def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def trace_summary(trace: dict) -> dict[str, Any]:
    """From a Chrome trace of ``torch.profiler``: per memcpy kind and stream the count, bytes-agnostic duration, and
    whether it ran on the compute stream (the stream most kernels ran on); how much memcpy time overlapped kernels."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    streams = collections.Counter(e.get("args", {}).get("stream") for e in kernels)
    compute = streams.most_common(1)[0][0] if streams else None
    by: dict[str, dict[str, Any]] = {}
    busy = _merge([(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels])
    overlap = total = 0.0
    for e in copies:
        s = e.get("args", {}).get("stream")
        key = f"{e.get('name')} @ stream {s}"
        row = by.setdefault(key, {"count": 0, "us": 0.0, "compute_stream": s == compute})
        row["count"] += 1
        a, b = e["ts"], e["ts"] + e.get("dur", 0)
        row["us"] += b - a
        total += b - a
        overlap += sum(max(0.0, min(b, y) - max(a, x)) for x, y in busy)
    side = sum(r["count"] for r in by.values() if not r["compute_stream"])
    pinned = sum(r["count"] for k, r in by.items() if "Pinned" in k)
    return {"compute_stream": compute, "copies": by, "copies_on_side_streams": side,
            "copies_total": sum(r["count"] for r in by.values()), "copies_pinned": pinned,
            "copy_us": total, "copy_us_overlapping_kernels": overlap}


def stream_section(cfg: Config, failures: list[str], out: Path) -> list[dict]:
    """One step of the all-offload and mixed-step plans under torch.profiler, on the first state-heavy model."""
    if cfg.device.type != "cuda":
        return [{"skipped": "needs CUDA (a profiler trace of the side streams)"}]
    from torch.profiler import ProfilerActivity, profile

    rows = []
    name = next((m for m in cfg.whole_models if m in memopt.zoo.STATE_HEAVY), cfg.whole_models[0])
    for label in ("all_offload", "mixed_step"):
        def run(label: str = label) -> dict:
            zm = builder(name, cfg, whole=True)()
            opt = OPTIMIZERS["adam"](zm.model.parameters())
            prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
            plan = whole_plan(Plan.uniform(prof, "keep"), VARIANTS[label])
            with memopt.plan(plan, zm.model, optimizer=opt):
                for _ in range(2):  # state exists and is offloaded before the traced step
                    zm.loss_fn(zm.model(*zm.inputs)).backward()
                    opt.step()
                    opt.zero_grad()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                    zm.loss_fn(zm.model(*zm.inputs)).backward()
                    opt.step()
                    opt.zero_grad()
                    torch.cuda.synchronize()
            path = out / f"trace_{name}_{label}.json"
            tp.export_chrome_trace(str(path))
            summary = trace_summary(json.loads(path.read_text()))
            if summary["copies_on_side_streams"] == 0:
                failures.append(f"streams {name}/{label}: no copy ran on a side stream")
            if summary["copies_pinned"] == 0:
                failures.append(f"streams {name}/{label}: no copy to or from pinned host memory")
            return {"model": name, "plan": label, **summary}

        row = guarded(run, failures, f"streams {name}/{label}")
        if row is not None:
            rows.append(row)
            print(json.dumps(row, default=str))
    return rows


# ---------------------------------------------------------------------- the CUDA tests
PYTEST_FILES = ("tests/test_state_runtime.py", "tests/test_whole_step_apply.py", "tests/test_autocast.py",
                "tests/test_between_steps.py", "tests/test_habits.py", "tests/test_timm_models.py")


def junit_counts(path: Path) -> dict[str, Any]:
    """Pass/fail/error/skip counts and failed test ids from a pytest ``--junitxml`` file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = collections.Counter()
    failed = []
    for s in suites:
        for case in s.iter("testcase"):
            tid = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            if "failure" in kinds:
                counts["failed"] += 1
                failed.append(tid)
            elif "error" in kinds:
                counts["errors"] += 1
                failed.append(tid)
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return {"passed": counts["passed"], "failed": counts["failed"], "errors": counts["errors"],
            "skipped": counts["skipped"], "failed_ids": failed}


def pytest_env() -> dict[str, str]:
    """The environment of the CUDA tests' pytest: this repository importable, and deterministic algorithms on in it
    (``tests/conftest.py`` reads ``MEMOPT_NB_DETERMINISTIC``), as in this process, since its tests compare bit for bit;
    ``CUBLAS_WORKSPACE_CONFIG`` as set here."""
    return {**os.environ, "MEMOPT_NB_DETERMINISTIC": "1",
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def pytest_section(cfg: Config, failures: list[str], out: Path, select: str = "cuda") -> dict[str, Any]:
    xml = out / "pytest_cuda.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PYTEST_FILES, "-k", select,
           f"--junitxml={xml}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=cfg.pytest_timeout,
                              env=pytest_env())
    except subprocess.TimeoutExpired:
        failures.append(f"pytest: timed out after {cfg.pytest_timeout:.0f} s")
        return {"command": " ".join(cmd), "timed_out": True}
    res: dict[str, Any] = {"command": "python " + " ".join(cmd[1:]), "returncode": proc.returncode,
                           "seconds": time.perf_counter() - t0, "tail": proc.stdout[-3000:] + proc.stderr[-2000:]}
    if xml.exists():
        res.update(junit_counts(xml))
    if proc.returncode not in (0, 5) or res.get("failed") or res.get("errors"):  # 5: nothing selected
        failures.append(f"pytest: return code {proc.returncode}, {res.get('failed')} failed, "
                        f"{res.get('errors')} errors: {', '.join(res.get('failed_ids', [])[:5])}")
    if cfg.device.type == "cuda" and not res.get("passed"):
        failures.append("pytest: no CUDA test passed on a CUDA machine")
    print(proc.stdout[-1500:])
    return res


# ---------------------------------------------------------------------- per-storage copy cost
def copy_cost_section(cfg: Config, failures: list[str], spec: Any) -> dict[str, Any]:
    """The training thread's cost per storage copied by the swap engine on this device, beyond the bytes (the chain
    that detection calibrates ``DeviceSpec.copy_overhead_s`` with), median of three runs. Measured first: the plan
    tables show the simulator's step time with it (``sim_cc_ms``) next to the one with the profile's device."""
    from memopt_nb.runtime.detect import _calibrate_copy_overhead

    bandwidth = min(spec.h2d_bytes_per_s, spec.d2h_bytes_per_s)
    runs = [guarded(lambda: _calibrate_copy_overhead(bandwidth, cfg.device), failures, "copy cost")
            for _ in range(3)]
    runs = [r for r in runs if r is not None]
    if not runs:
        return {}
    got = {"per_storage_us": sorted(runs)[len(runs) // 2] * 1e6, "runs_us": [r * 1e6 for r in runs],
           "in_spec_us": spec.copy_overhead_s * 1e6}
    cfg.costed_device = dataclasses.replace(spec, copy_overhead_s=got["per_storage_us"] * 1e-6)
    print(f"per-storage copy cost: {got['per_storage_us']:.1f} µs (runs {got['runs_us']}), "
          f"detection's {got['in_spec_us']:.1f} µs")
    return got


def does_not_fit_section(cfg: Config, failures: list[str]) -> dict[str, Any]:
    """Check 11: the zoo GPT at a batch whose unplanned step does not fit a limit of 60 % of its peak."""
    want = 16 if cfg.dry_run else 64
    sizes = dict(seq_len=32, d_model=48, n_layers=4, n_heads=4, vocab=128) if cfg.dry_run else \
        dict(seq_len=256, d_model=256, n_layers=6, n_heads=8, vocab=512)

    def build(b: int) -> tuple:
        z = memopt.zoo.gpt(batch_size=b, seed=0, device=cfg.device, **sizes)
        return z.model, z.inputs, z.loss_fn, torch.optim.AdamW(z.model.parameters(), lr=1e-3)

    def steps(model: nn.Module, inputs: tuple, loss_fn: Any, opt: Any, n: int) -> list[float]:
        losses = []
        for _ in range(n):
            loss = loss_fn(model(*inputs))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    def fraction() -> float | None:
        return torch.cuda.get_per_process_memory_fraction(cfg.device) if cfg.device.type == "cuda" else None

    got: dict[str, Any] = {"batch": want}
    model, inputs, loss_fn, opt = build(want)
    peak = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=1).peak_bytes
    limit = int(0.6 * peak)
    got.update(unplanned_peak=peak, limit=limit)
    def digest(m: nn.Module) -> str:  # one parameter at a time on the host: nothing held inside the limit
        h = hashlib.sha256()
        for p in m.parameters():
            h.update(p.detach().to("cpu", copy=True).numpy().tobytes())
        return h.hexdigest()

    before = digest(model)
    outside = fraction()
    with memopt.limit_memory(limit) as lim:
        got["fraction_inside"] = fraction()
        try:
            steps(model, inputs, loss_fn, opt, 1)
            failures.append("does not fit: the unplanned step ran inside a limit of 60 % of its peak")
        except torch.OutOfMemoryError:
            got["unplanned_oom"] = True
        opt.zero_grad()
        if digest(model) != before:
            failures.append("does not fit: the failed unplanned step changed the parameters")
        prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1,
                              batch_fn=lambda b: build(b)[1:3])
        got.update(method=prof.meta.get("method"), profile_peak=prof.peak_bytes,
                   profile_error_pct=100.0 * (prof.peak_bytes - peak) / peak)
        plan = memopt.solvers.optimal(prof)  # no budget: what the device has free, the limit less other tensors
        got.update(plan=str(plan), plan_budget=plan.budget_bytes, predicted_peak=plan.predicted_peak_bytes,
                   budget_source=plan.meta.get("budget_source"))
        seed_all(1)
        with memopt.plan(plan):
            losses = steps(model, inputs, loss_fn, opt, cfg.steps)
    got.update(limited_peak=lim.peak_bytes, fraction_after=fraction(), fraction_before=outside)
    ref_model, ref_inputs, ref_loss_fn, ref_opt = build(want)
    seed_all(1)
    ref = steps(ref_model, ref_inputs, ref_loss_fn, ref_opt, cfg.steps)
    got["bit_equal"] = ref == losses and all(
        torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters(), strict=True))
    del model, inputs, opt, ref_model, ref_inputs, ref_opt  # max_batch has the limit to itself
    gc.collect()
    if cfg.device.type == "cuda":
        torch.cuda.empty_cache()
    with memopt.limit_memory(limit):
        fit = memopt.max_batch(build)  # planned for the AdamW build returns, the optimizer trained with
    got.update(max_batch=fit.batch, plain_max_batch=fit.plain.batch, baseline_max_batch=fit.baseline.batch,
               max_batch_verified=dict(fit.verified), max_batch_seconds=fit.seconds)
    problems = [
        "the profile was not extrapolated" if got["method"] != "extrapolated" else None,
        f"the profile's peak is {got['profile_error_pct']:+.2f} % off the unplanned peak (over 2 %)"
        if abs(got["profile_error_pct"]) > 2 else None,
        "the plan's budget is not the limit less what other tensors hold (plan.meta['budget_source'])"
        if (got["budget_source"] or {}).get("capacity_bytes") != limit
        or plan.budget_bytes != got["budget_source"]["free_bytes"] else None,
        "training under the plan is not bit-equal to unplanned training without the limit"
        if not got["bit_equal"] else None,
        f"the steps under the plan peaked at {lim.peak_bytes} B, over the limit {limit} B"
        if lim.peak_bytes > limit else None,
        f"max_batch answered {fit.batch}, below the batch {want} the plan trained"
        if fit.batch is None or fit.batch < want else None,
        "max_batch's answer ran over the limit" if fit.verified.get("peak_bytes", 0) > limit else None,
        "the memory fraction was not set inside limit_memory or not restored after"
        if cfg.device.type == "cuda" and (got["fraction_inside"] == outside or got["fraction_after"] != outside)
        else None,
    ]
    failures += [f"does not fit: {p}" for p in problems if p]
    print(f"does not fit: batch {want}, limit {limit / MiB:.1f} MiB of {peak / MiB:.1f} MiB; profile "
          f"{got['profile_error_pct']:+.2f} %; bit-equal {got['bit_equal']}; max batch {fit.batch} (plain "
          f"{fit.plain.batch}, baseline {fit.baseline.batch})")
    return got


def head_section(cfg: Config, failures: list[str]) -> dict[str, Any]:
    """Check 12: the chunked LM head and the loop that keeps its outputs, on a transformers GPT-2 (vocabulary 50257)."""
    import transformers

    batch, seq, width = (4, 32, 32) if cfg.dry_run else (16, 256, 256)
    tcfg = transformers.GPT2Config(n_layer=4, n_embd=width, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(tcfg).to(cfg.device)
    ids = torch.randint(0, tcfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(cfg.device)

    def steps(model: nn.Module, plan: Plan | None, n: int, keep: bool = False) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ctx = memopt.plan(plan, model, optimizer=opt) if plan is not None else contextlib.nullcontext()
        losses = []
        with ctx:
            for _ in range(n):
                outputs = model(input_ids=ids, labels=ids)
                loss = outputs.loss
                if not keep:
                    del outputs
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
        return losses

    ref = copy.deepcopy(base)
    ref_losses = steps(ref, None, cfg.steps)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=lambda o: o.loss, optimizer=opt, repeats=1,
                          head="chunked")
    got: dict[str, Any] = {"peak": prof.peak_bytes, "options": {}, "floor_plain": memopt.solvers.min_peak(
        prof, head=False), "floor_head": memopt.solvers.min_peak(prof)}
    for key, option in sorted(prof.heads.items(), key=lambda kv: int(kv[0])):
        for strategy in ("keep", "recompute"):
            plan = dataclasses.replace(memopt.Plan.uniform(prof, strategy),
                                       head={"module": option["module"], "chunks": int(key)})
            plan._model_ref, plan._optimizer_ref = prof._model_ref, prof._optimizer_ref
            sim = memopt.simulate(prof, plan).peak_bytes
            meas = memopt.measure(model, input_ids=ids, labels=ids, loss_fn=lambda o: o.loss, optimizer=opt,
                                  plan=plan).peak_bytes
            copy_model = copy.deepcopy(base)
            losses = steps(copy_model, plan, cfg.steps)
            drift = max((a - b).abs().max().item() for a, b in zip(copy_model.parameters(), ref.parameters()))
            row = {"predicted": sim, "measured": meas, "first_loss_equal": losses[0] == ref_losses[0],
                   "param_drift": drift}
            got["options"][f"{key} {strategy}"] = row
            problem = peak_problem(f"head {key} chunks {strategy}", sim, meas)
            if problem:
                failures.append(problem)
            if not row["first_loss_equal"] or drift > 1e-5:
                failures.append(f"head {key} chunks {strategy}: first loss equal {row['first_loss_equal']}, "
                                f"parameters {drift:.2e} from the head as written (over 1e-5)")
    kept = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=lambda o: o.loss, optimizer=opt, repeats=1,
                          head="chunked", keep_outputs=True)
    plan = memopt.search(kept, budget="50%", total_timesteps=cfg.search_timesteps or 2048)
    with memopt.limit_memory(plan.budget_bytes) as lim:
        steps(copy.deepcopy(base), plan, cfg.steps, keep=True)
    got.update(kept_plan=str(plan), kept_budget=plan.budget_bytes, kept_peak=lim.peak_bytes)
    if lim.peak_bytes > plan.budget_bytes:
        failures.append(f"head: the loop that keeps its outputs peaked at {lim.peak_bytes} B under a plan for "
                        f"{plan.budget_bytes} B")
    print(f"head: floor {got['floor_head'] / MiB:.1f} MiB with the head chunked, {got['floor_plain'] / MiB:.1f} MiB "
          f"as written, of a {prof.peak_bytes / MiB:.1f} MiB peak; kept-outputs loop {lim.peak_bytes / MiB:.1f} of "
          f"{plan.budget_bytes / MiB:.1f} MiB")
    return got


def _units(row: dict) -> str:
    """How many units a fine-unit plan has, for its row in the report."""
    return f" ({row['units']} units)" if row["plan"].startswith("fine") else ""


def costed_ms(prof: Any, plan: Plan, cfg: Config) -> float | None:
    """The simulator's step time (ms) on this device with the measured per-storage copy cost, if it was measured."""
    if cfg.costed_device is None:
        return None
    return memopt.simulate(prof, plan, device=cfg.costed_device).step_time * 1e3


#: what the CUDA caching allocator may add to the tensors' bytes that a plan's budget counts: blocks rounded up to
#: 512 bytes, and a cached block handed out whole when the rest would be under 1 MiB (so it depends on what earlier
#: work left in the cache). Measured on an H200: 0 on the zoo GPT, 1.3–3.6 MiB (0.6–2.0 %) on ResNet-18 after the
#: bit-equality runs, and 0.05 MiB for the same keep plan in a fresh process.
ALLOCATOR_ALLOWANCE = CUDA_REL


def peak_problem(what: str, sim_bytes: int, meas_bytes: int) -> str | None:
    """A measured peak off the simulator's by more than the README's CUDA tolerance (``CUDA_REL`` of it + ``CUDA_ABS``,
    from ``tests/helpers/tolerances.py``, which the tests use too). Above it, a plan made for a budget would overrun
    it; below it, the plan gives away memory it could use (or the measurement missed some)."""
    if abs(meas_bytes - sim_bytes) > cuda_allows(sim_bytes):
        return (f"{what}: measured peak {meas_bytes / MiB:.1f} MiB vs the simulated {sim_bytes / MiB:.1f} MiB, "
                f"off by more than {100 * CUDA_REL:.0f} % + {CUDA_ABS / MiB:.0f} MiB")
    return None


# ---------------------------------------------------------------------- runtime overhead
def overhead_section(cfg: Config, failures: list[str]) -> list[dict]:
    """``runtime_overhead.run_model`` per activation model on this device: the ratios (a)-(e), reported (goals, not
    pass/fail checks: timing on a shared machine is not a correctness check)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import runtime_overhead

    rows = []
    for name in cfg.models:
        batch = 2 if cfg.dry_run else memopt.zoo.build(name).inputs[0].shape[0] * 4
        with no_fill():
            got = guarded(lambda name=name, batch=batch: runtime_overhead.run_model(
                name, batch, reps=5 if cfg.dry_run else 9, device=cfg.device.type), failures, f"overhead {name}")
        if got:
            rows.append({k: got[k] for k in ("model", "batch", "keep", "rc", "ro", "copy", "sac", "ratio_a",
                                             "ratio_b", "ratio_c", "ratio_d", "paired_c", "paired_d", "ci_c",
                                             "ci_d", "ratio_e", "paired_e", "ci_e", "sim_e")})
            print(f"{name}: (a) {got['ratio_a']:.3f} (b) {got['ratio_b']:.3f} (c) {got['ratio_c']:.3f} "
                  f"(d) {got['ratio_d']:.3f} (e) {got['ratio_e']:.3f} (simulated {got['sim_e']:.3f})")
    return rows


# ---------------------------------------------------------------------- report
def _paired(r: dict, x: str) -> str:
    """Comparison ``x`` of a runtime-overhead row: its ratio, then the paired median and its interval when known."""
    out = f"{r[f'ratio_{x}']:.3f}"
    paired, ci = r.get(f"paired_{x}"), r.get(f"ci_{x}")
    if paired is not None:
        interval = (f", {ci[0]:.3f}–{ci[1]:.3f}" if ci is not None and all(v == v for v in ci) else "")
        out += f" ({paired:.3f}{interval})"
    return out


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def tables(result: dict) -> str:
    lines = []
    act = result.get("activation", [])
    if act:
        lines += ["### Activation plans", "",
                  "| model | plan | sim peak MiB | cuda peak MiB | err % | sim ms | sim ms + copy cost "
                  "| meas ms | ×keep | grads equal | pool reuses |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['plan']}{_units(r)} | {r['sim_peak_MiB']:.1f} | {r['cuda_peak_MiB']:.1f} | "
                  f"{r['peak_err_pct']:+.1f} | {r['sim_ms']:.2f} | {_ms(r.get('sim_cc_ms'))} | {r['meas_ms']:.2f} | "
                  f"{r['time_ratio_vs_keep']:.2f} | {r['grads_equal']} | {r['swap_stats'].get('pool_reuses', '-')} |"
                  for r in act]
        lines.append("")
    eq = result.get("whole_equal", [])
    if eq:
        labels = list(dict.fromkeys(r["plan"] for r in eq))
        lines += ["### Whole-step plans: 3 steps bit-equal to plain training (✓ equal and bytes moved)", "",
                  "| model | optimizer (kernel) | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
        grid: dict[tuple[str, str], dict[str, str]] = {}
        kern: dict[tuple[str, str], str] = {}
        for r in eq:
            key = (r["model"], r["optimizer"])
            kern.setdefault(key, r.get("kernel", "?"))
            cell = "error" if r["equal"] is None else ("✓" if r["equal"] and r["moved_ok"] else
                                                        "✗ differs" if not r["equal"] else "✗ nothing moved")
            grid.setdefault(key, {})[r["plan"]] = cell
        for (m, o), cells in grid.items():
            lines.append(f"| {m} | {o} ({kern[(m, o)]}) | " + " | ".join(cells.get(v, "–") for v in labels) + " |")
        lines.append("")
    mem = result.get("whole_memory", [])
    if mem:
        lines += ["### Whole-step plans: measured vs simulated (Adam)", "",
                  "| model | plan | sim peak MiB | meas peak MiB | err % | sim ms | sim ms + copy cost "
                  "| meas ms | err % | ×keep | state d2h MiB | grad d2h MiB | param h2d MiB | steps in bw |",
                  "|---|---|" + "---|" * 12]
        for r in mem:
            s = r["stats"]
            lines.append(f"| {r['model']} | {r['plan']} | {r['sim_peak_MiB']:.1f} | {r['meas_peak_MiB']:.1f} | "
                         f"{r['peak_err_pct']:+.1f} | {r['sim_ms']:.2f} | {_ms(r.get('sim_cc_ms'))} | "
                         f"{r['meas_ms']:.2f} | {r['time_err_pct']:+.0f} | {r['time_ratio_vs_keep']:.2f} | "
                         f"{s.get('state_d2h_bytes', 0) / MiB:.1f} | {s.get('grad_d2h_bytes', 0) / MiB:.1f} | "
                         f"{s.get('param_h2d_bytes', 0) / MiB:.1f} | {s.get('steps_in_backward', 0)} |")
        lines.append("")
    for r in result.get("search", []):
        m = next((x for x in mem if x["model"] == r["model"] and x["plan"] == "search"), None)
        lines.append(f"- searched plan on {r['model']}: floors {r['floor_whole_step_MiB']:.1f} MiB (whole step) / "
                     f"{r['floor_activation_only_MiB']:.1f} MiB (activations only); "
                     + (f"budget {r['budget_MiB']:.1f} MiB, measured {m['meas_peak_MiB']:.1f} MiB, "
                        f"within budget: {m['within_budget']}"
                        + (f" ({m.get('over_budget_MiB', 0):.1f} MiB over: the allocator's blocks, within its "
                           f"{100 * ALLOCATOR_ALLOWANCE:.0f} % allowance)"
                           if not m["within_budget"] and m.get("within_allowance") else "")
                        + f", search {r['search_s']:.1f} s, {r['state_counts']}"
                        if m else r.get("skipped", "not measured")))
    for r in result.get("streams", []):
        if "skipped" in r:
            lines.append(f"- side streams: skipped ({r['skipped']})")
        else:
            lines.append(f"- side streams, {r['model']}/{r['plan']}: {r['copies_on_side_streams']} of "
                         f"{r['copies_total']} copies on side streams, {r['copies_pinned']} to/from pinned memory, "
                         f"{r['copy_us_overlapping_kernels']:.0f} of {r['copy_us']:.0f} µs overlapping kernels")
    cc = result.get("copy_cost")
    if cc:
        lines.append(f"- per-storage copy cost of the swap engine on this device: {cc['per_storage_us']:.1f} µs per "
                     f"storage and direction (median of {len(cc['runs_us'])}; detection uses "
                     f"{cc['in_spec_us']:.1f} µs)")
    ov = result.get("overhead", [])
    if ov:
        lines += ["", "### Runtime overhead (goal <= 1.03 each; medians of interleaved pairs)", "",
                  "| model | batch | keep ms | (a) keep ÷ none | (b) recompute ÷ hand checkpoint | (c) "
                  "recompute_offload ÷ (recompute + copies) | (d) selective, everything kept ÷ keep | (e) state "
                  "streamed ÷ moved per unit (simulated) |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['batch']} | {r['keep'] * 1e3:.2f} | {r['ratio_a']:.3f} | {r['ratio_b']:.3f} "
                  f"| {_paired(r, 'c')} | {_paired(r, 'd')} | {_paired(r, 'e')} ({r['sim_e']:.3f}) |" for r in ov]
        lines += ["", "(c) and (d): median ÷ median (the paired median; a 95 % interval for it where there are enough "
                  "pairs): an interval reaching past 1.03 says this run cannot tell.", ""]
    pt = result.get("pytest")
    if pt:
        lines.append(f"- pytest `{pt.get('command')}`: {pt.get('passed')} passed, {pt.get('failed')} failed, "
                     f"{pt.get('errors')} errors, {pt.get('skipped')} skipped")
    fails = result.get("failures", [])
    lines.append(f"- **{'all checks passed' if not fails else f'{len(fails)} check(s) failed'}**")
    lines += [f"  - {f}" for f in fails[:40]]
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=None, help="zoo models for the activation section "
                    "(default: gpt resnet; none to skip)")
    ap.add_argument("--whole-models", nargs="*", default=None,
                    help="zoo models for the whole-step section (default: gpt + the STATE_HEAVY models; --quick: gpt "
                         "resnet18; --dry-run: gpt resnet18)")
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: a GPU-sized multiple of the zoo's)")
    ap.add_argument("--search-timesteps", type=int, default=None,
                    help="PPO timesteps of each search (default 20000; --quick 6000; --dry-run 600)")
    ap.add_argument("--no-search", action="store_true", help="skip the searched whole-step plan")
    ap.add_argument("--no-fit-check", action="store_true",
                    help="skip check 11 (a step that does not fit: limit_memory, extrapolated profile, max_batch)")
    ap.add_argument("--quick", action="store_true",
                    help="fewer models and (optimizer, plan) pairs: ~90 s on an H200 with --pytest")
    ap.add_argument("--dry-run", action="store_true",
                    help="run every plan and check on the CPU at tiny sizes (tests the script without a GPU)")
    ap.add_argument("--pytest", action="store_true", help="also run the CUDA tests (-k cuda) and record the counts")
    ap.add_argument("--no-head-check", action="store_true", help="skip the LM head section (check 12)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    return ap.parse_args(argv)


def config_from_args(args: argparse.Namespace) -> Config:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.models is not None:
        models = args.models
    else:
        models = ["gpt"] if args.quick or args.dry_run else ["gpt", "resnet"]
    if args.whole_models is not None:
        whole = args.whole_models
    else:
        whole = ["gpt", "resnet18"] if args.quick or args.dry_run else ["gpt", *memopt.zoo.STATE_HEAVY]
    for m in [*models, *whole]:
        if m not in memopt.zoo.BUILDERS:
            raise SystemExit(f"unknown zoo model {m!r}; choose from {', '.join(memopt.zoo.BUILDERS)}")
    steps = args.search_timesteps or (600 if args.dry_run else 6000 if args.quick else 20000)
    heavy = [m for m in whole if m in memopt.zoo.STATE_HEAVY] or whole[-1:]
    search_models = [] if args.no_search else (heavy[:1] if args.quick or args.dry_run else heavy)
    return Config(device=device, dry_run=args.dry_run, quick=args.quick, models=models, whole_models=whole,
                  batch=args.batch, optimizers=args.optimizers, measure_steps=1 if args.dry_run else 5,
                  search_timesteps=steps, search_models=search_models, pytest=args.pytest,
                  fit_check=not args.no_fit_check, head_check=not args.no_head_check)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (use --dry-run to test the script on the CPU)")
        return 1
    cfg = config_from_args(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    spec = memopt.DeviceSpec.detect(cfg.device)
    print(f"device: {spec}; CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}; "
          f"torch {torch.__version__}")
    t0 = time.perf_counter()
    failures: list[str] = []
    result: dict[str, Any] = {"device": str(spec), "torch": torch.__version__, "dry_run": cfg.dry_run,
                              "quick": cfg.quick, "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()}}
    timings: dict[str, float] = {}
    result["section_seconds"] = timings

    def save() -> None:  # after every section, so a run cut short by `timeout` still leaves what it checked
        result["failures"] = failures
        result["seconds"] = time.perf_counter() - t0
        (out / "cuda_check.json").write_text(json.dumps(result, indent=1, default=str))

    def section(label: str, fn: Callable[[], Any]) -> Any:
        ts = time.perf_counter()
        got = fn()
        timings[label] = time.perf_counter() - ts
        return got

    result["copy_cost"] = section("copy_cost", lambda: copy_cost_section(cfg, failures, spec))
    save()
    result["activation"] = []
    if cfg.models:
        section("activation", lambda: activation_section(cfg, failures, save, result["activation"]))
    save()
    if cfg.whole_models:
        section("whole_step", lambda: whole_section(cfg, failures, result, save))
    else:
        result.update(whole_equal=[], whole_memory=[], search=[])
    save()
    result["streams"] = section("streams", lambda: stream_section(cfg, failures, out)) if cfg.whole_models else []
    save()
    result["overhead"] = section("overhead", lambda: overhead_section(cfg, failures)) if cfg.models else []
    save()
    if cfg.fit_check:
        result["does_not_fit"] = section("does_not_fit", lambda: guarded(
            lambda: does_not_fit_section(cfg, failures), failures, "does not fit"))
    save()
    if cfg.head_check:
        result["head"] = section("head", lambda: guarded(lambda: head_section(cfg, failures), failures, "head"))
    save()
    if cfg.pytest:
        result["pytest"] = section("pytest", lambda: pytest_section(cfg, failures, out))
    save()
    text = tables(result)
    print(text)
    print(f"total {result['seconds']:.1f} s; per section: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    (out / "cuda_check.md").write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
