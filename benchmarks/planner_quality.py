"""Planner quality: the dual-agent PPO search against the exact optimum and the best baseline.

Suite: every zoo model (profiled here, on the CPU) and synthetic chains of 12, 24, 48 and 64 units, each on the
profiled device and on two GPU presets, at budgets 40%, 55%, 70% and 85% of the way from the minimum feasible peak to
the unoptimized peak. Per case: the agents' plan alone and polished, divided by the exact optimum's step time (MILP;
where it hit its time limit the incumbent is used and its proven lower bound is shown), divided by the best feasible
baseline's, feasibility and search wall time.

    python benchmarks/planner_quality.py            # full suite (about an hour on 2 cores)
    python benchmarks/planner_quality.py --quick    # a few cases
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import memopt_nb as memopt  # noqa: E402
from memopt_nb import solvers  # noqa: E402
from memopt_nb.synthetic import chain_profile  # noqa: E402

FRACTIONS = (0.40, 0.55, 0.70, 0.85)


def zoo_profile(name: str):
    zm = memopt.zoo.build(name)
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    return memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=3)


def run_case(label: str, prof, device, frac: float, time_limit: float, timesteps: int | None) -> dict:
    sim = memopt.Simulator(prof, device)
    lo = solvers.min_peak(sim)
    budget = int(lo + frac * (prof.peak_bytes - lo))
    t0 = time.perf_counter()
    opt = solvers.optimal(sim, budget, time_limit=time_limit)
    opt_s = time.perf_counter() - t0
    base = [fn(sim, budget) for fn in solvers.BASELINES.values()]
    feasible = [b for b in base if b.feasible]
    best_base = min(feasible, key=lambda b: b.predicted_step_time) if feasible else None
    t0 = time.perf_counter()
    plan = memopt.search(prof, budget, device, total_timesteps=timesteps, seed=0)
    search_s = time.perf_counter() - t0
    agents = plan.meta["agents_step_time"] or math.inf
    ref = opt.predicted_step_time
    return {
        "case": label, "device": sim.device.name, "budget": frac, "units": prof.n_units,
        "agents_vs_opt": agents / ref, "polished_vs_opt": plan.predicted_step_time / ref,
        "agents_vs_base": agents / best_base.predicted_step_time if best_base else math.nan,
        "best_base": best_base.method if best_base else "—", "feasible": bool(plan.feasible),
        "search_s": search_s, "opt_s": opt_s, "proven": bool(opt.meta["proven_optimal"]),
        "gap": float(opt.meta.get("mip_gap") or 0.0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a handful of cases")
    ap.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit per case (s)")
    ap.add_argument("--timesteps", type=int, default=None, help="PPO timesteps (default: memopt's default)")
    args = ap.parse_args()
    devices = (None, "a100-40gb", "v100-16gb")
    fractions = FRACTIONS
    if args.quick:
        cases = [("mlp", zoo_profile("mlp")), ("chain12", chain_profile(12, seed=12)),
                 ("chain24", chain_profile(24, seed=24))]
        devices, fractions = (None, "a100-40gb"), (0.4, 0.7)
    else:
        cases = [(name, zoo_profile(name)) for name in memopt.zoo.MODELS]
        cases += [(f"chain{n}", chain_profile(n, seed=n)) for n in (12, 24, 48, 64)]
    rows = []
    print("| case | device | budget | units | agents ÷ opt | polished ÷ opt | agents ÷ best baseline | best baseline "
          "| feasible | search s | MILP s | MILP proven (gap) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, prof in cases:
        for device in devices:
            for frac in fractions:
                r = run_case(label, prof, device, frac, args.time_limit, args.timesteps)
                rows.append(r)
                proven = "yes" if r["proven"] else f"no ({r['gap']:.2%})"
                print(f"| {r['case']} | {r['device']} | {r['budget']:.0%} | {r['units']} | {r['agents_vs_opt']:.4f} | "
                      f"{r['polished_vs_opt']:.4f} | {r['agents_vs_base']:.4f} | {r['best_base']} | "
                      f"{'yes' if r['feasible'] else 'NO'} | {r['search_s']:.1f} | {r['opt_s']:.1f} | {proven} |",
                      flush=True)
    a = [r["agents_vs_opt"] for r in rows]
    p = [r["polished_vs_opt"] for r in rows]
    vb = [r["agents_vs_base"] for r in rows if not math.isnan(r["agents_vs_base"])]
    s48 = [r["search_s"] for r in rows if r["units"] == 48]
    print()
    print(f"cases {len(rows)}; feasible {sum(r['feasible'] for r in rows)}/{len(rows)}")
    print(f"agents ÷ optimum: median {statistics.median(a):.4f} (target ≤ 1.02), worst {max(a):.4f} (target ≤ 1.05)")
    print(f"polished ÷ optimum: median {statistics.median(p):.4f}, worst {max(p):.4f}")
    slower = sum(v > 1 + 1e-9 for v in vb)
    print(f"agents ÷ best baseline: worst {max(vb):.4f} (target ≤ 1.0; slower in {slower} cases)")
    if s48:
        print(f"search time at 48 units: median {statistics.median(s48):.1f} s, max {max(s48):.1f} s (target ≤ 60 s)")
    print(f"MILP proven optimal in {sum(r['proven'] for r in rows)}/{len(rows)} cases (ratios use the incumbent "
          f"otherwise)")


if __name__ == "__main__":
    main()
