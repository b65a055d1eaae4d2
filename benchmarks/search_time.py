"""Search wall time over the enlarged space (goal: ≤ 60 s at 48 units on 2 cores).

``memopt.search(prof, budget, "a100-40gb", offload_state=True, seed=0)`` at the default timesteps on the synthetic
chain with state that ``planner_quality.py --whole-step`` uses (``chain_profile(n, seed=n, state_bytes=16 MiB)``), at
a budget ``frac`` of the way from the whole-step floor to the unoptimized peak. Prints each run's seconds, where they
went (PPO training, then the polish) and a digest of the plan (the same seed must give the same digest in every run
and on every machine whose floating point agrees), then the median.

    python benchmarks/search_time.py                      # 48 units, 25 %, 3 runs
    python benchmarks/search_time.py --units 24 --frac 0.6 --runs 1
    python benchmarks/search_time.py --tutorial01     # tutorial 01's search: default stop vs a 7-minute search

``--tutorial01``: tutorial 01's problem as it is stored (the zoo GPT of 4 layers at batch 8 with Adam, profiled
inside ``limit_memory`` at 0.6x what its step needs, extrapolated, budget the limit): the default search (its stop:
``patience``) against a search that runs 7 minutes (``patience=None``, ``time_limit=420``), their seconds and
simulated step times.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memopt_nb as memopt  # noqa: E402
from memopt_nb import solvers  # noqa: E402
from memopt_nb.harness.synthetic import chain_profile  # noqa: E402


def tutorial01(seconds: float) -> None:
    """``--tutorial01``: the default stop against ``seconds`` of search on tutorial 01's problem."""
    import torch

    def build(batch: int):
        return memopt.zoo.gpt(batch_size=batch, n_layers=4)

    model, (idx,), loss_fn, _ = build(8)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    limit = int(0.6 * memopt.measure(model, idx, loss_fn=loss_fn, optimizer=opt).peak_bytes)
    with memopt.limit_memory(limit):
        prof = memopt.profile(model, idx, loss_fn=loss_fn, optimizer=opt, batch_fn=lambda b: build(b)[1:3])
    t0 = time.perf_counter()
    quick = memopt.search(prof, limit, seed=0)
    a = time.perf_counter() - t0
    print(f"default stop: {a:.1f} s, {quick.meta['timesteps_run']} timesteps, step "
          f"{quick.predicted_step_time * 1e3:.3f} ms ({quick.meta['stopped']})", flush=True)
    t0 = time.perf_counter()
    long = memopt.search(prof, limit, seed=0, patience=None, time_limit=seconds, total_timesteps=10**8)
    b = time.perf_counter() - t0
    ratio = quick.predicted_step_time / long.predicted_step_time
    print(f"{seconds:.0f}-s search: {b:.1f} s, {long.meta['timesteps_run']} timesteps, step "
          f"{long.predicted_step_time * 1e3:.3f} ms; default ÷ long {ratio:.4f} (goal ≤ 1.02); the same plan: "
          f"{quick == long}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--units", type=int, default=48)
    ap.add_argument("--frac", type=float, default=0.25, help="budget: this far from the floor to the peak")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--timesteps", type=int, default=None, help="PPO timesteps (default: memopt's default)")
    ap.add_argument("--tutorial01", action="store_true", help="tutorial 01's search: default stop vs 7 minutes")
    ap.add_argument("--seconds", type=float, default=420.0, help="--tutorial01: the long search's time limit")
    args = ap.parse_args()
    if args.tutorial01:
        tutorial01(args.seconds)
        return
    prof = chain_profile(args.units, seed=args.units, state_bytes=16 * 2**20)
    lo = solvers.min_peak(prof, "a100-40gb", offload_state=True)
    budget = int(lo + args.frac * (prof.peak_bytes - lo))
    times = []
    for r in range(args.runs):
        t0 = time.perf_counter()
        plan = memopt.search(prof, budget, "a100-40gb", total_timesteps=args.timesteps, seed=0, offload_state=True)
        s = time.perf_counter() - t0
        times.append(s)
        train = plan.meta["history"][-1]["seconds"]
        digest = hashlib.sha256(str([d.to_dict() for d in plan.decisions]).encode()).hexdigest()[:12]
        print(f"run {r + 1}: {s:.1f} s (PPO {train:.1f} s, polish {s - train:.1f} s), "
              f"{plan.meta['timesteps_run']} timesteps, step time {plan.predicted_step_time:.6f} s, plan {digest}",
              flush=True)
    print(f"{args.units} units, budget {args.frac:.0%}: median {statistics.median(times):.1f} s over {args.runs} runs "
          f"(target ≤ 60 s at 48 units)")


if __name__ == "__main__":
    main()
