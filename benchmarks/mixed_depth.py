"""Plans that mix depths: on the deep GPT-2 with ``units="fine"``, the plan of the fine units,
the plan of the whole blocks and the mixed plan of ``memopt.search_depths``, at budgets above both floors, simulated
and measured side by side (interleaved steps, medians); and what the blocks' own measurement adds to profiling
(``units="fine"`` against ``units="auto"``, alternated).

    python benchmarks/mixed_depth.py [--layers 24] [--space checkpoint|default] [--fracs 0.05,0.15,0.3]
                                     [--planner milp|search] [--reps 7]

``--space checkpoint``: keep and recompute only (where a fine plan pays most for recomputing unit by unit);
``default``: keep, recompute and swap. A budget is the higher of the two floors plus ``frac`` of the way to the
unplanned peak. ``--planner milp``: HiGHS with ``--time-limit`` per plan; ``search``: ``memopt.search`` (seed 0).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # noqa: F401 - puts the repository root on sys.path
import torch
from _common import MiB
from planner_quality import gpt2_deep

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.cuts import merge_units, mergeable, outermost

SPACES = {"checkpoint": ("keep", "recompute"), "default": ("keep", "recompute", "swap")}


def profiles(layers: int, rounds: int = 2) -> tuple[memopt.ModelProfile, dict[str, list[float]]]:
    """The fine profile, and the seconds of ``units="auto"`` and ``units="fine"`` profiles made alternately."""
    model, inputs, loss_fn, opt = gpt2_deep(layers)
    seconds: dict[str, list[float]] = {"auto": [], "fine": []}
    fine = None
    for _ in range(rounds):
        for units in ("auto", "fine"):
            t0 = time.perf_counter()
            prof = memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units=units, repeats=3)
            seconds[units].append(time.perf_counter() - t0)
            if units == "fine":
                fine = prof
    return fine, seconds


def measured(layers: int, plans: dict[str, memopt.Plan], reps: int) -> dict[str, tuple[float, int]]:
    """Per plan, the median seconds of a training step and the measured peak. Each plan is applied once to its own
    copy of the model (the same weights), and the copies' steps are interleaved (A B C, C B A, …) so that a drift hits
    them alike; the peaks come from ``memopt.measure`` afterwards."""
    runs = {}
    for k, p in plans.items():
        model, inputs, loss_fn, opt = gpt2_deep(layers)
        applied = memopt.plan(p, model, optimizer=opt)
        applied.apply()
        runs[k] = (model, inputs, loss_fn, opt, applied)
    times: dict[str, list[float]] = {k: [] for k in runs}

    def step(k: str) -> float:
        model, inputs, loss_fn, opt, _ = runs[k]
        t0 = time.perf_counter()
        loss = loss_fn(model(**inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    try:
        names = list(runs)
        for _ in range(2):  # warm-up
            for k in names:
                step(k)
        for r in range(reps):
            for k in (names if r % 2 == 0 else names[::-1]):
                times[k].append(step(k))
    finally:
        for *_, applied in runs.values():
            applied.remove()
    out = {}
    for k, p in plans.items():
        model, inputs, loss_fn, opt, _ = runs[k]
        peak = memopt.measure(model, **inputs, loss_fn=loss_fn, optimizer=opt, plan=p, steps=1).peak_bytes
        out[k] = (statistics.median(times[k]), peak)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--space", choices=list(SPACES), default="checkpoint")
    ap.add_argument("--fracs", default="0.05,0.15,0.3")
    ap.add_argument("--planner", choices=("milp", "search"), default="milp")
    ap.add_argument("--time-limit", type=float, default=60.0, help="--planner milp: seconds per plan")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    strategies = SPACES[args.space]

    fine, seconds = profiles(args.layers)
    print(f"profiling ({args.layers} layers, repeats=3, alternated): units=\"auto\" "
          f"{', '.join(f'{s:.1f}' for s in seconds['auto'])} s; units=\"fine\" "
          f"{', '.join(f'{s:.1f}' for s in seconds['fine'])} s (fine ÷ auto, medians: "
          f"{statistics.median(seconds['fine']) / statistics.median(seconds['auto']):.2f}); {fine.n_units} fine units, "
          f"{len(fine.merges)} blocks measured whole")
    blocks = outermost(mergeable(fine))
    whole = merge_units(fine, blocks)
    lo = solvers.min_peak(fine, None, strategies, offload_state=False)
    hi = solvers.min_peak(whole, None, strategies, offload_state=False)
    print(f"space {args.space} {strategies}: floor of the fine units {lo / MiB:.2f} MiB, of the whole blocks "
          f"{hi / MiB:.2f} MiB; no plan {fine.peak_bytes / MiB:.2f} MiB, {fine.step_time * 1e3:.1f} ms")

    made: dict[tuple, memopt.Plan] = {}

    def planner(profile: memopt.ModelProfile, budget, device) -> memopt.Plan:
        key = (tuple(profile.unit_names), budget)
        if key not in made:
            if args.planner == "milp":
                made[key] = solvers.optimal(profile, budget, device, strategies=strategies, offload_state=False,
                                            time_limit=args.time_limit)
            else:
                made[key] = memopt.search(profile, budget, device, strategies=strategies, offload_state=False, seed=0)
        return made[key]

    print("| budget | plan | units (merged blocks) | simulated ms | measured ms (median) | measured peak | "
          "search s |")
    print("|---|---|---|---|---|---|---|")
    for frac in (float(f) for f in args.fracs.split(",")):
        budget = int(max(lo, hi) + frac * (fine.peak_bytes - max(lo, hi)))
        t0 = time.perf_counter()
        mixed = memopt.search_depths(fine, budget, planner=planner, strategies=strategies, offload_state=False)
        took = time.perf_counter() - t0
        plans = {"fine": planner(fine, budget, None),
                 "blocks": planner(whole, budget, None).with_meta(meta={"merged": blocks}), "mixed": mixed}
        plans = {k: p for k, p in plans.items() if p.feasible}
        print(f"depths: {mixed.meta['depths']}", flush=True)
        got = measured(args.layers, plans, args.reps)
        for k, p in plans.items():
            merged = len(p.meta.get("merged") or [])
            print(f"| {budget / MiB:.2f} MiB ({frac:.0%}) | {k} | {len(p.units)} ({merged}) | "
                  f"{p.predicted_step_time * 1e3:.1f} | {got[k][0] * 1e3:.1f} | {got[k][1] / MiB:.2f} MiB"
                  f"{'' if got[k][1] == p.predicted_peak_bytes else ' (predicted ' + str(p.predicted_peak_bytes) + ')'}"
                  f" | {took if k == 'mixed' else 0:.1f} |", flush=True)


if __name__ == "__main__":
    main()
