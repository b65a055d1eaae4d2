"""Solve time of the exact MILP planner (``memopt_nb.planners.optimal``) on synthetic chains of growing length.

For chains of 12, 24, 48 and 96 units (``memopt_nb.harness.synthetic.chain_profile(n, seed)``) and budgets 40 % and 70
% of the way from the smallest feasible peak (``solvers.min_peak``) to the unoptimized peak (``profile.peak_bytes``),
the script solves with all strategies and with ``strategies=("keep", "recompute")`` only, and prints the solve time,
whether optimality was proven within the time limit (``plan.meta["proven_optimal"]``; otherwise the limit was hit and
the plan is the best incumbent), the MILP objective vs the simulated step time of the returned plan
(``plan.meta["milp_step_time"]``, ``plan.predicted_step_time``) and the plan's strategy counts.

Budgets are placed relative to the minimum peak *of the strategy set solved*: keep+recompute alone cannot reach the
minimum peak swapping allows, so a budget derived from the all-strategy minimum could be infeasible for it.

For every all-strategy solve the last column is the checkpoint-only optimum at the *same* budget (a feasible plan of the
all-strategy problem too, found in well under a second): a time-limited all-strategy solve that is slower than it, or
finds no plan at all, returned something worse than a trivially available alternative ("BETTER" marks those).

"solve s" is ``plan.meta["solve_seconds"]`` (MILP construction + HiGHS), or the wall time when no plan came back.

Seeds: by default 2 seeds for chains shorter than 48 units and 1 seed for 48 and 96 units, where the all-strategy
solves run into the 60 s limit anyway (each such solve costs the full limit; more seeds there would push the run well
past 5 minutes). ``--seeds`` / ``--large-seeds`` change this.

    python benchmarks/solver_scaling.py            # time limit 60 s (~5 min)
    python benchmarks/solver_scaling.py --quick    # time limit 10 s, one seed, 12-48 units (~1 min)

``--quick`` leaves out the 96-unit chain: its all-strategy MILP has ~3.8 M nonzeros and HiGHS' presolve alone runs
~40 s without looking at the time limit, so a "10 s" solve takes 20-45 s there.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections import defaultdict
from typing import Any

import _common
import scipy

from memopt_nb import solvers
from memopt_nb.core.errors import BudgetError
from memopt_nb.harness.synthetic import chain_profile

FRACTIONS = (0.4, 0.7)
SETS = {"all": ("keep", "recompute", "swap"), "keep+rc": ("keep", "recompute")}


def run_one(n: int, seed: int, time_limit: float) -> list[dict[str, Any]]:
    prof = chain_profile(n, seed=seed)
    out = []
    for set_name, strategies in SETS.items():
        t0 = time.perf_counter()
        lowest = solvers.min_peak(prof, strategies=strategies)
        t_min = time.perf_counter() - t0
        for frac in FRACTIONS:
            budget = int(lowest + frac * (prof.peak_bytes - lowest))
            row: dict[str, Any] = {"n": n, "seed": seed, "set": set_name, "frac": frac, "budget": budget,
                                   "min_peak": lowest, "peak": prof.peak_bytes, "min_peak_s": t_min}
            t0 = time.perf_counter()
            try:
                plan = solvers.optimal(prof, budget, strategies=strategies, time_limit=time_limit)
            except BudgetError as exc:  # no incumbent within the limit
                row.update(wall=time.perf_counter() - t0, error=str(exc))
                out.append(row)
                print(f"  n={n:3d} seed={seed} {set_name:7s} {frac:.0%}: no plan ({exc})", flush=True)
                continue
            row.update(wall=time.perf_counter() - t0, plan=plan, solve=plan.meta["solve_seconds"],
                       proven=plan.meta["proven_optimal"], gap=plan.meta.get("mip_gap", 0.0),
                       milp=plan.meta["milp_step_time"], sim=plan.predicted_step_time, counts=plan.counts(),
                       feasible=plan.feasible, pred_peak=plan.predicted_peak_bytes)
            out.append(row)
            print(f"  n={n:3d} seed={seed} {set_name:7s} {frac:.0%}: {row['solve']:6.2f} s "
                  f"{'proven' if row['proven'] else 'LIMIT HIT'}", flush=True)
    # reference for the all-strategy solves: the checkpoint-only optimum at the *same* budget (also a feasible plan of
    # the all-strategy problem, so a proven all-strategy optimum can never be slower than it)
    for row in out:
        if row["set"] != "all":
            continue
        try:
            ref = solvers.optimal(prof, row["budget"], strategies=SETS["keep+rc"], time_limit=time_limit)
            row["kr_same"] = ref.predicted_step_time
            row["kr_same_proven"] = ref.meta["proven_optimal"]
        except BudgetError:  # below the checkpoint-only minimum peak
            row["kr_same"] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="time limit 10 s, one seed per size, up to 48 units")
    ap.add_argument("--sizes", default=None, help="chain lengths (default 12,24,48,96; quick 12,24,48)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per size below --large (default 2, quick 1)")
    ap.add_argument("--large-seeds", type=int, default=1, help="seeds per size at or above --large (default 1)")
    ap.add_argument("--large", type=int, default=48, help="smallest size counted as large (default 48)")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per solve (default 60, quick 10)")
    args = ap.parse_args()
    time_limit = args.time_limit if args.time_limit is not None else (10.0 if args.quick else 60.0)
    small_seeds = args.seeds if args.seeds is not None else (1 if args.quick else 2)
    sizes = [int(s) for s in (args.sizes or ("12,24,48" if args.quick else "12,24,48,96")).split(",") if s.strip()]
    t_start = time.perf_counter()
    print(f"# solver scaling ({'quick' if args.quick else 'default'} mode) — python {platform.python_version()}, "
          f"scipy {scipy.__version__} (HiGHS MILP)")
    print(f"time limit {time_limit:g} s per solve; budgets at {', '.join(f'{f:.0%}' for f in FRACTIONS)} of the way "
          "from min_peak (of the strategy set) to the unoptimized peak\n", flush=True)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        for seed in range(small_seeds if n < args.large else args.large_seeds):
            rows += run_one(n, seed, time_limit)
    table = []
    for r in rows:
        head = [r["n"], r["seed"], r["set"], f"{r['frac']:.0%}", f"{r['budget'] / _common.MiB:.0f}",
                f"{r['min_peak'] / _common.MiB:.0f}", f"{r['min_peak_s']:.2f}"]
        kr = r.get("kr_same")
        kr_cell = "-" if kr is None else f"{kr * 1e3:.3f}" + ("" if r.get("kr_same_proven", True) else " (limit)")
        if "error" in r:
            table.append(head + [f"{r['wall']:.2f}", "NO PLAN (limit hit)", "-", "-", "-", "-", "-", "-", kr_cell])
            continue
        c = r["counts"]
        diff = _common.rel_err(r["milp"], r["sim"])
        table.append(head + [
            f"{r['solve']:.2f}", "yes" if r["proven"] else f"LIMIT HIT (gap {r['gap']:.2%})", f"{r['milp'] * 1e3:.3f}",
            f"{r['sim'] * 1e3:.3f}", f"{diff:+.1e}", f"{c['keep']}/{c['recompute']}/{c['swap']}",
            f"{r['pred_peak'] / _common.MiB:.0f}", "yes" if r["feasible"] else "NO",
            kr_cell + (" BETTER" if kr is not None and kr < r["sim"] * (1 - 1e-9) else ""),
        ])
    print()
    print(_common.md_table(
        ["units", "seed", "strategies", "budget at", "budget MiB", "min peak MiB", "min-peak s", "solve s",
         "proven optimal", "MILP ms", "sim ms", "MILP vs sim %", "keep/rc/swap", "plan peak MiB", "fits",
         "keep+rc optimum at same budget, sim ms"], table, "rrlrrrrrlrrrcrcr"))
    # summary per size and strategy set
    agg: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        agg[(r["n"], r["set"])].append(r)
    summary = []
    for (n, set_name), rs in sorted(agg.items()):
        solved = [r for r in rs if "error" not in r]
        proven = [r for r in solved if r["proven"]]
        summary.append([n, set_name, len(rs), f"{_common.median([r['wall'] for r in rs]):.2f}",
                        f"{max(r['wall'] for r in rs):.2f}", f"{len(proven)}/{len(rs)}",
                        len(solved) - len(proven), len(rs) - len(solved)])
    print()
    print(_common.md_table(["units", "strategies", "solves", "median s", "max s", "proven", "limit hit",
                            "no plan"], summary, "rlrrrrrr"))
    solved = [r for r in rows if "error" not in r]
    hits = [r for r in rows if "error" in r or not r["proven"]]
    hit_where = sorted({f"n={r['n']} {r['set']}" for r in hits}, key=lambda s: (int(s.split()[0][2:]), s))
    agree = [r for r in solved if abs(_common.rel_err(r["milp"], r["sim"])) <= 1e-6]
    infeasible = [r for r in solved if not r["feasible"]]
    worse = [r for r in rows if r["set"] == "all" and r.get("kr_same") is not None
             and ("error" in r or r["kr_same"] < r["sim"] * (1 - 1e-9))]
    worse_where = [f"n={r['n']} seed={r['seed']} {r['frac']:.0%}" for r in worse]
    print()
    print(f"summary: {len(rows)} solves, {len(rows) - len(hits)} proven optimal within {time_limit:g} s, "
          f"{len(hits)} hit the time limit" + (f" ({', '.join(hit_where)})" if hits else "")
          + f"; MILP objective = simulated step time (to 1e-6) for {len(agree)}/{len(solved)} plans; plans over "
          f"budget: {len(infeasible)}; all-strategy solves beaten by (or without a plan, unlike) the checkpoint-only "
          f"optimum at the same budget: {len(worse)}"
          + (f" ({', '.join(worse_where)})" if worse else "")
          + f" [{time.perf_counter() - t_start:.0f} s]")

if __name__ == "__main__":
    main()
