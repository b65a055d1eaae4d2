"""A swap plan's slowdown on the emulated CPU device: ``memopt.compare`` beside the prediction, and where time goes.

The goal: on the zoo GPT at 60 % the predicted slowdown and the measured one (median of >= 5 paired steps) should
agree within 20 % on a quiet machine. The plan is the default search's (``memopt.search(profile, "60%")``,
seed 0), which swaps blocks. Per repeat: the machine's load average, the plan, ``memopt.compare`` (``--pairs`` paired
steps: median and range of the per-pair ratios) beside the prediction on the profiled device, and the prediction the
same device gives without copy overlap (the copy threads without a core of their own).

With ``--cpu`` it then splits the cost with CPU clocks, which a busy machine's waiting does not inflate: per pair,
``--steps`` steps without the plan and as many inside ``with memopt.plan(p, model)``; the median ratio of the wall
time, of the training thread's CPU time (``time.thread_time``) and of the whole process's (``time.process_time``,
the copy threads included), and the minor page faults per step (``getrusage``). ``--inline`` copies every job on the
training thread (``ThreadCopyEngine.INLINE_BYTES``), to compare with the prediction without overlap.

    python benchmarks/compare_swap.py                    # 3 repeats of 7 pairs (~4 min quiet, ~10 min loaded)
    python benchmarks/compare_swap.py --repeats 1 --cpu  # and the CPU split, 8 pairs of 3 steps
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time

import _common  # the repository root on sys.path
import torch

import memopt_nb as memopt
from memopt_nb.runtime.swap import ThreadCopyEngine


def predicted(prof, plan, overlap: bool) -> float:
    """The simulator's slowdown of ``plan`` on the profiled device with ``copy_overlap`` set to ``overlap``."""
    dev = prof.device.with_changes(copy_overlap=overlap)
    keep = memopt.Plan.uniform(prof, "keep")
    return memopt.simulate(prof, plan, dev).step_time / memopt.simulate(prof, keep, dev).step_time


def cpu_split(zm, opt, plan, pairs: int, steps: int) -> None:
    def step() -> None:
        zm.loss_fn(zm.model(*zm.inputs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed() -> tuple[float, float, float, float]:
        rows = []
        for _ in range(steps):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            w, t, p = time.perf_counter(), time.thread_time(), time.process_time()
            step()
            rows.append((time.perf_counter() - w, time.thread_time() - t, time.process_time() - p,
                         resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        return tuple(statistics.median(col) for col in zip(*rows))

    step()
    ratios, faults = [], []
    for _ in range(pairs):
        plain = timed()
        with memopt.plan(plan, zm.model):
            step()  # settles the engine's host pool
            planned = timed()
        ratios.append([b / a for a, b in zip(plain[:3], planned[:3])])
        faults.append((plain[3], planned[3]))
    for i, what in enumerate(("wall", "training thread CPU", "process CPU (copy threads included)")):
        col = [r[i] for r in ratios]
        print(f"  {what:38s} median ratio {statistics.median(col):.3f}  (pairs {min(col):.2f}-{max(col):.2f})")
    print(f"  minor page faults per step: {statistics.median(f[0] for f in faults):.0f} without the plan, "
          f"{statistics.median(f[1] for f in faults):.0f} with it (median over pairs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=7, help="paired steps per memopt.compare (default 7)")
    ap.add_argument("--repeats", type=int, default=3, help="memopt.compare runs, each with a fresh profile and search")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    ap.add_argument("--cpu", action="store_true", help="then split the cost with CPU clocks")
    ap.add_argument("--steps", type=int, default=3, help="with --cpu: steps per side of a pair (default 3)")
    ap.add_argument("--inline", action="store_true", help="copy every job on the training thread")
    args = ap.parse_args()
    _common.set_threads(args.threads)
    if args.inline:
        ThreadCopyEngine.INLINE_BYTES = 1 << 62
    print(_common.environment_line())
    for r in range(args.repeats):
        zm = memopt.zoo.build("gpt", seed=0)
        opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
        prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt)
        plan = memopt.search(prof, "60%", seed=0)
        c = memopt.compare(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, profile=prof,
                           steps=args.pairs)
        print(f"repeat {r + 1}: load average {os.getloadavg()[0]:.1f}; {plan.summary()}; device {prof.device}")
        print(f"  measured {c.ratio:.3f}x (pairs {min(c.ratios):.2f}-{max(c.ratios):.2f}, {len(c.ratios)} pairs; "
              f"no plan {statistics.median(c._times(c.without)) * 1e3:.0f} ms); predicted {c.predicted_ratio:.3f}x, "
              f"{predicted(prof, plan, overlap=False):.3f}x without copy overlap")
        if args.cpu and r == args.repeats - 1:
            cpu_split(zm, opt, plan, pairs=8, steps=args.steps)


if __name__ == "__main__":
    main()
