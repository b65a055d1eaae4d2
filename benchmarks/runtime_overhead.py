"""Runtime overhead of applying a plan, on the zoo models (CPU).

Four comparisons, each timed on real training steps (forward, loss, backward, Adam step, zero_grad) in one process, with
the two variants interleaved A B, B A, A B, ... so that drift of this (shared, noisy) machine hits both alike:

(a) ``Plan.uniform(profile, "keep")`` applied with ``with memopt.plan(p, model):`` vs. no plan — target ratio <= 1.03;
(b) ``Plan.uniform(profile, "recompute")`` applied the same way vs. hand-applied non-reentrant checkpointing,
    ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` on the same units (each unit's ``forward``
    monkeypatched by this script and restored afterwards) — target ratio <= 1.03;
(c) ``Plan.uniform(profile, "recompute_offload", offload_window=1, prefetch_distance=1)`` vs. the recompute
    plan of (b) plus the copy time the simulator charges the plan on this emulated device (its inputs to the host and
    back) — target ratio <= 1.03;
(d) a ``selective`` plan that keeps the output of every op call of every unit that makes a new tensor (a
    save-set of all of them, from :func:`memopt_nb.profiling.opsets.record_ops`, outputs changed in place later
    included, such as a dropout mask scaled in place) vs. the keep plan — target ratio <= 1.03. Its recomputation runs
    no op again, so after a unit's first forward under the plan, calls made the same way run as a keep unit's do
    (``memopt_nb.runtime.apply.PlannedForward``): (d) measures that the machinery gets out of the way; with
    ``--first-step`` it measures the checkpoint and the caching modes of the first forward.

(e) the keep plan with every unit's optimizer state and gradients offloaded, its state streamed one parameter at a
    time (``optimizer="stream"``) vs. moved a whole unit at a time (``"offload"``): what streaming costs over today's
    per-unit movement, beside the simulator's predicted ratio for the same two plans (per-parameter steps are
    smaller kernels; the copies are the same bytes) — target ratio <= 1.03.

Every variant runs on the same model (and Adam), its plan entered and left around each sample: a settling step, then
the timed step, both inside the block — the timed step runs as every step after the first in a notebook loop inside
one ``with memopt.plan(p):``. The reference variants (no plan, hand checkpointing) run the same way. With
``--first-step`` there is no settling step, so the timed step is the first under its plan. The timer covers only the
timed step; what entering and leaving costs is reported separately ("apply+remove": keep and recompute plans). Ratios
are ``median(plan) / median(reference)``; the "paired" column is the median of the per-pair ratios, which cancels drift
even better, with a 95 % interval for it (order statistics, no assumption about the noise): where the interval is wider
than the target's margin, more pairs (``--only c --reps 200``) narrow it. The plans are made from a profile of the
model itself (``memopt.profile``, one timed repeat).

    python benchmarks/runtime_overhead.py            # zoo default batch sizes, 25 pairs per comparison (~6 min)
    python benchmarks/runtime_overhead.py --quick    # 7 pairs per comparison (~2 min)
    python benchmarks/runtime_overhead.py --only c --reps 200   # one comparison, many pairs (~12 min)

Both modes use the zoo's default batch sizes (``--batch-scale`` changes them) and one torch thread (``--threads``): on
this shared 2-vCPU machine, 2-thread steps are at times 10-50x slower for seconds to minutes, 1-thread steps are not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import _common
import torch
from torch.utils.checkpoint import checkpoint

import memopt_nb as memopt
from memopt_nb import zoo
from memopt_nb.core.plan import Decision
from memopt_nb.profiling.opsets import record_ops
from memopt_nb.runtime.step import preserved_state

TARGET = 1.03
#: untimed settling steps inside the block before the timed one (see :class:`Timed`)
SETTLE = 1


def _sync(inputs: tuple[Any, ...]) -> None:
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
        torch.cuda.synchronize()


def train_step(model: torch.nn.Module, inputs: tuple[Any, ...], loss_fn: Callable, opt: torch.optim.Optimizer) -> float:
    """One real training step; returns its seconds (garbage collection held off while timing; on CUDA the device is
    synchronized before and after)."""
    gc.collect()
    gc.disable()
    try:
        _sync(inputs)
        t0 = time.perf_counter()
        loss = loss_fn(model(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(inputs)
        return time.perf_counter() - t0
    finally:
        gc.enable()


@contextlib.contextmanager
def hand_checkpoint(model: torch.nn.Module, unit_names: list[str]) -> Iterator[None]:
    """Wrap each unit's forward in non-reentrant ``torch.utils.checkpoint``; restore the modules afterwards."""
    saved = []
    for name in unit_names:
        module = model.get_submodule(name)
        had_own = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        inner = module.forward  # bound method (or the instance attribute, if one exists)

        def forward(*args: Any, _inner: Callable = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        module.forward = forward
        saved.append((module, had_own, previous))
    try:
        yield
    finally:
        for module, had_own, previous in reversed(saved):
            if had_own:
                module.forward = previous
            else:
                del module.forward


class Timed:
    """One side of a comparison on the shared model: its plan (``None``: no plan) or hand checkpointing, entered and
    left around each sample. A sample is a settling step and then the timed step, both inside the block — the timed
    step runs as every step after the first does in a notebook's loop inside one ``with memopt.plan(p):`` (a selective
    unit found to keep everything runs as keep then, the swap engine's threads and host buffers exist). With
    ``first=True`` there is no settling step: the timed step is the first under the plan. What entering and leaving
    costs is kept apart (``apply_s``)."""

    def __init__(self, model: torch.nn.Module, plan: memopt.Plan | None = None, *,
                 hand_units: list[str] | None = None, first: bool = False) -> None:
        self.model, self.plan, self.hand_units, self.first = model, plan, hand_units, first
        self.apply_s: list[float] = []

    def _block(self) -> contextlib.AbstractContextManager:
        if self.hand_units is not None:
            return hand_checkpoint(self.model, self.hand_units)
        return memopt.plan(self.plan, self.model) if self.plan is not None else contextlib.nullcontext()

    def step(self, inputs: tuple[Any, ...], loss_fn: Callable, opt: torch.optim.Optimizer) -> float:
        t0 = time.perf_counter()
        block = self._block()
        block.__enter__()
        t1 = time.perf_counter()
        try:
            for _ in range(0 if self.first else SETTLE):
                train_step(self.model, inputs, loss_fn, opt)
            dt = train_step(self.model, inputs, loss_fn, opt)
        finally:
            t2 = time.perf_counter()
            block.__exit__(None, None, None)
            t3 = time.perf_counter()
        self.apply_s.append((t1 - t0) + (t3 - t2))
        return dt


def interleaved(a: Callable[[], float], b: Callable[[], float], reps: int) -> tuple[list[float], list[float]]:
    """One untimed warm-up of each, then ``reps`` pairs, in the order A B, B A, A B, ... (ABBA): a drift that is
    linear over two pairs, and whatever the first of a pair leaves the second (a warm cache, a step's garbage), hits
    both alike."""
    a()
    b()
    ta, tb = [], []
    for i in range(reps):
        if i % 2:
            tb.append(b())
            ta.append(a())
        else:
            ta.append(a())
            tb.append(b())
    return ta, tb


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of ``values`` (order statistics and the binomial
    distribution: no assumption about the noise's shape); ``(nan, nan)`` for fewer than 6 values, which have none at
    0.95."""
    xs = sorted(values)
    n = len(xs)
    # the largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2: then [x_(k), x_(n-k+1)] (1-based) covers it
    tail, k, cdf = (1 - level) / 2, 0, 0.0
    while True:
        nxt = cdf + math.comb(n, k) / 2**n
        if nxt > tail:
            break
        cdf, k = nxt, k + 1
    if k == 0:
        return math.nan, math.nan
    return xs[k - 1], xs[n - k]


def interval_text(ci: Sequence[float]) -> str:
    """An interval from :func:`median_interval` as ``"lo–hi"``; ``"–"`` where there were too few pairs for one."""
    lo, hi = ci
    return "–" if math.isnan(lo) else f"{lo:.3f}–{hi:.3f}"


def forwards_untouched(model: torch.nn.Module) -> bool:
    return not any("forward" in m.__dict__ for m in model.modules())


def save_everything(prof: memopt.ModelProfile, model: torch.nn.Module, inputs: tuple[Any, ...]) -> memopt.Plan:
    """A selective plan keeping the output of every op call of every unit that makes a new tensor (not views nor
    in-place ops; an output changed in place later is kept too: its call runs again only if the unit recomputes)."""
    with preserved_state(model):  # recording runs a training forward: BatchNorm statistics, RNG
        calls = record_ops(model, inputs, {}, prof.unit_names)
    decisions = tuple(
        Decision(u.name, "selective", save_set="matmuls",
                 save_ops=tuple((c.name, c.index) for c in calls[i] if c.nbytes) or (("none", 0),))
        for i, u in enumerate(prof.units))
    return memopt.Plan(decisions=decisions, fingerprint=prof.fingerprint, method="selective_all_saved",
                       model_fingerprint=prof.meta.get("model_fingerprint"))


COMPARISONS = "abcde"


def placed(plan: memopt.Plan, optimizer: str, grads: str, params: str) -> memopt.Plan:
    """``plan`` with one placement for every unit."""
    decisions = tuple(dataclasses.replace(d, optimizer=optimizer, grads=grads, params=params) for d in plan.decisions)
    return plan.with_meta(decisions=decisions)


def run_model(name: str, batch: int, reps: int, device: str = "cpu", first: bool = False,
              comparisons: str = COMPARISONS) -> dict[str, Any]:
    """The comparisons (``comparisons``: some of ``"abcde"``, see the module docs) on zoo model ``name`` at ``batch``
    on ``device`` (``"cuda"``: the real device, its copy engines and the simulator's copy time for it; run by
    ``cuda_check.py``); ``first``: time each plan's first step (see :class:`Timed`). Per comparison ``x``:
    ``ratio_x`` (median ÷ median), ``paired_x`` (the median of the per-pair ratios) and ``ci_x`` (a 95 % interval for
    that median, :func:`median_interval`)."""
    model, inputs, loss_fn, _ = zoo.build(name, batch_size=batch, device=device)
    opt = torch.optim.Adam(model.parameters())
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
    units = prof.unit_names
    train_step(model, inputs, loss_fn, opt)  # creates the Adam state and warms the allocator

    def step(t: Timed) -> Callable[[], float]:
        return lambda: t.step(inputs, loss_fn, opt)

    med = _common.median
    out: dict[str, Any] = {"model": name, "batch": batch, "units": len(units), "n_pairs": reps,
                           "comparisons": comparisons}

    def compare(key: str, ref: Timed, plan: Timed, extra: float = 0.0) -> tuple[list[float], list[float]]:
        t_ref, t_plan = interleaved(step(ref), step(plan), reps)
        pairs = [p / (r + extra) for p, r in zip(t_plan, t_ref)]
        out[f"ratio_{key}"] = med(t_plan) / (med(t_ref) + extra)
        out[f"paired_{key}"] = med(pairs)
        out[f"ci_{key}"] = median_interval(pairs)
        return t_ref, t_plan

    keep_t = Timed(model, memopt.Plan.uniform(prof, "keep"), first=first)
    rc_t = Timed(model, memopt.Plan.uniform(prof, "recompute"), first=first)
    if "a" in comparisons:
        t_plain, t_keep = compare("a", Timed(model, first=first), keep_t)
        out.update(plain=med(t_plain), keep=med(t_keep), spread_plain=(max(t_plain) - min(t_plain)) / med(t_plain))
    if "b" in comparisons:
        t_hand, t_rc = compare("b", Timed(model, hand_units=units, first=first), rc_t)
        out.update(hand=med(t_hand), rc=med(t_rc))
    if "c" in comparisons:
        ro = memopt.Plan.uniform(prof, "recompute_offload", offload_window=1, prefetch_distance=1)
        sim = memopt.Simulator(prof)
        copy_s = float(sim.evaluate(*sim.encode(ro), details=True)["copy"][0])  # what its transfers cost here
        t_rc2, t_ro = compare("c", rc_t, Timed(model, ro, first=first), extra=copy_s)
        out.update(ro=med(t_ro), rc2=med(t_rc2), copy=copy_s)
    if "d" in comparisons:
        sac = save_everything(prof, model, inputs)
        _, t_sac = compare("d", keep_t, Timed(model, sac, first=first))
        out.update(sac=med(t_sac))
    if "e" in comparisons:
        keep = memopt.Plan.uniform(prof, "keep")
        whole, streamed = placed(keep, "offload", "offload", "resident"), placed(keep, "stream", "offload", "resident")
        t_whole, t_stream = compare("e", Timed(model, whole, first=first), Timed(model, streamed, first=first))
        out.update(whole=med(t_whole), stream=med(t_stream),
                   sim_e=memopt.simulate(prof, streamed).step_time / memopt.simulate(prof, whole).step_time)
    applied = keep_t.apply_s + rc_t.apply_s
    out["apply_us"] = med(applied) * 1e6 if applied else math.nan
    assert forwards_untouched(model), "a variant left a wrapped forward behind"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="7 pairs per comparison instead of 25")
    ap.add_argument("--models", default=",".join(zoo.MODELS), help="comma-separated zoo models (default: all)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved pairs per comparison (>= 5; default 25, "
                    "quick 7)")
    ap.add_argument("--batch-scale", type=float, default=1.0, help="multiply the zoo's default batch sizes")
    ap.add_argument("--device", default="cpu", help="cpu (the emulated device, default) or cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0 = torch's default)")
    ap.add_argument("--first-step", action="store_true", help="time each plan's first step (no settling step inside "
                    "the block): what the plan costs before it settles")
    ap.add_argument("--only", default=COMPARISONS, help="which comparisons to run, some of 'abcde' (default all), "
                    "e.g. --only c --reps 200 to narrow one ratio's interval")
    args = ap.parse_args()
    if not args.only or set(args.only) - set(COMPARISONS):
        ap.error(f"--only takes letters of {COMPARISONS!r}, got {args.only!r}")
    args.only = "".join(x for x in COMPARISONS if x in args.only)
    _common.set_threads(args.threads)
    args.reps = args.reps if args.reps is not None else (7 if args.quick else 25)
    if args.reps < 5:
        ap.error("--reps must be >= 5 (medians of fewer repetitions are not worth quoting here)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    t_start = time.perf_counter()
    print(f"# runtime overhead ({'quick' if args.quick else 'default'} mode"
          f"{', first steps under each plan' if args.first_step else ''}) — {_common.environment_line()}")
    print(f"median of {args.reps} interleaved pairs per comparison, target ratio <= {TARGET}\n", flush=True)
    results = []
    for name in models:
        batch = max(1, round(zoo.build(name).inputs[0].shape[0] * args.batch_scale))
        results.append(run_model(name, batch, args.reps, args.device, args.first_step, args.only))
        r = results[-1]
        print(f"  {name}: " + "  ".join(f"({x}) {r[f'ratio_{x}']:.3f}" for x in args.only), flush=True)
    print()
    print(table(results, args.only))
    print()
    print("ratio = median ÷ median; paired = the median of the per-pair ratios, with its 95 % interval (order "
          "statistics): an interval reaching past the target says the machine's noise hides whether it is met.")
    if "a" in args.only:
        print("spread = (max - min) / median of the no-plan steps: the noise floor of this machine for that model. "
              "(a): a keep-all plan that swaps nothing wraps no module, so its ratio is pure noise.")
    if "b" in args.only:
        print("(b) is not like for like on BatchNorm models (resnet, unet): plain checkpointing updates BatchNorm "
              "running statistics a second time in the recomputation; memopt's recompute redirects that update to "
              "throw-away copies, which costs a few clones per BatchNorm per step.")
    parts, missed_any = [], False
    for x in args.only:
        miss = [r["model"] for r in results if r[f"ratio_{x}"] > TARGET]
        missed_any |= bool(miss)
        parts.append(f"({x}) {LABELS[x]} <= {TARGET}: {len(results) - len(miss)}/{len(results)} met"
                     + (f" (missed: {', '.join(miss)})" if miss else ""))
    print("summary: " + "; ".join(parts)
          + f" — {'ALL TARGETS MET' if not missed_any else 'TARGETS MISSED'} [{time.perf_counter() - t_start:.0f} s]")


LABELS = {"a": "keep-plan/no-plan", "b": "recompute-plan/hand checkpoint", "c": "recompute_offload/(recompute + copy)",
          "d": "selective, everything saved/keep", "e": "state streamed/moved per unit"}


def table(results: list[dict[str, Any]], comparisons: str) -> str:
    """The results as one Markdown table: the columns of the comparisons that ran."""
    headers, align = ["model", "batch", "units"], "lrr"
    cols: list[tuple[str, Callable[[dict], str]]] = []

    def ms(key: str) -> Callable[[dict], str]:
        return lambda r: f"{r[key] * 1e3:.1f}"

    def ratio(x: str) -> list[tuple[str, Callable[[dict], str]]]:
        return [(f"({x}) ratio", lambda r: f"{r[f'ratio_{x}']:.3f}"),
                (f"({x}) paired", lambda r: f"{r[f'paired_{x}']:.3f}"),
                (f"({x}) paired 95 % interval", lambda r: interval_text(r[f"ci_{x}"]))]

    if "a" in comparisons:
        cols += [("no plan ms", ms("plain")), ("keep plan ms", ms("keep")), *ratio("a"),
                 ("no-plan spread %", lambda r: f"{r['spread_plain'] * 100:.1f}")]
    if "b" in comparisons:
        cols += [("hand ckpt ms", ms("hand")), ("rc plan ms", ms("rc")), *ratio("b")]
    if "a" in comparisons or "b" in comparisons:
        cols += [("apply+remove µs", lambda r: f"{r['apply_us']:.0f}")]
    if "c" in comparisons:
        cols += [("rc ms (beside ro)", ms("rc2")), ("ro plan ms", ms("ro")),
                 ("ro copy ms (simulated)", lambda r: f"{r['copy'] * 1e3:.2f}"), *ratio("c")]
    if "d" in comparisons:
        cols += [("sac-all ms", ms("sac")), *ratio("d")]
    if "e" in comparisons:
        cols += [("per-unit state ms", ms("whole")), ("streamed state ms", ms("stream")), *ratio("e"),
                 ("(e) simulated ratio", lambda r: f"{r['sim_e']:.3f}")]
    headers += [h for h, _ in cols]
    align += "r" * len(cols)
    headers.append(" / ".join(f"({x})" for x in comparisons))
    align += "c"
    rows = [[r["model"], r["batch"], r["units"], *(f(r) for _, f in cols),
             " / ".join("ok" if r[f"ratio_{x}"] <= TARGET else "MISS" for x in comparisons)] for r in results]
    return _common.md_table(headers, rows, align)


if __name__ == "__main__":
    main()
