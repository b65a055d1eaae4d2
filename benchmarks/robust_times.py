"""Profile times that hold on a busy machine: a transformers GPT-2 of identical blocks profiled twice, optionally
beside CPU burner processes, and whether the two profiles agree where a planner looks.

    python benchmarks/robust_times.py                 # as the machine is
    python benchmarks/robust_times.py --burners 2     # two busy-looping processes beside it (3 runnable threads on 2
                                                      # cores with torch's one thread)

The model: ``GPT2LMHeadModel`` from a small config (``--layers`` blocks of width 128, 4 heads, 256-token vocabulary,
random init, no download), batch 8 x 64 tokens, Adam. Each profile is ``memopt.profile`` as a user calls it
(``repeats`` as given). Checks, printed with the figures:

* identical blocks: in each profile, the largest forward (and backward) time of a block over the smallest is at most
  1.5;
* plans: each profile's plan under 60% of its unplanned peak (``memopt.solvers.optimal``, deterministic) simulated on
  the other profile is within 3% of that profile's own plan's simulated step time;
* unplanned step times of the two profiles within 20% of each other.

``--threads`` (default 1, see ``benchmarks/_common.set_threads``; 0 keeps torch's default) sets torch's threads. The
exit status is 1 where a check fails.
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import environment_line, md_table, set_threads  # noqa: E402

#: the checks' bounds
BLOCK_RATIO, PLAN_GAP, STEP_GAP = 1.5, 0.03, 0.20


def build(layers: int):  # noqa: ANN201 - a benchmark's helper
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=64, n_layer=layers, n_embd=128, n_head=4)
    cfg.bos_token_id = cfg.eos_token_id = 0  # inside the small vocabulary
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    return model, ids, torch.optim.Adam(model.parameters())


def burners(n: int) -> list[subprocess.Popen]:
    """``n`` processes that loop without end (each one runnable thread), ended by :func:`main`."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def ratio(values: list[float]) -> float:
    return max(values) / min(values) if min(values) > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--burners", type=int, default=0, help="CPU burner processes beside the profiles (default 0)")
    ap.add_argument("--layers", type=int, default=6, help="GPT-2 blocks (default 6)")
    ap.add_argument("--repeats", type=int, default=3, help="profile(repeats=...) (default 3, profile's default)")
    ap.add_argument("--budget", type=float, default=0.6, help="plan budget as a share of the peak (default 0.6)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    args = ap.parse_args(argv)
    set_threads(args.threads)
    import memopt_nb as memopt

    model, ids, opt = build(args.layers)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    procs = burners(args.burners)
    try:
        profs, walls = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            profs.append(memopt.profile(model, input_ids=ids, labels=ids, loss_fn=lambda out: out.loss,
                                        optimizer=opt, repeats=args.repeats))
            walls.append(time.perf_counter() - t0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    budget = f"{round(100 * args.budget)}%"
    plans = [memopt.solvers.optimal(p, budget=budget) for p in profs]
    print(f"# robust profile times: GPT-2, {args.layers} blocks, {args.burners} burners, {started}")
    print(environment_line())
    rows, ok = [], True
    for k, (prof, wall) in enumerate(zip(profs, walls, strict=True)):
        blocks = [u for u in prof.units if u.type == "GPT2Block"]
        fr, br = ratio([u.fwd_time for u in blocks]), ratio([u.bwd_time for u in blocks])
        ok &= fr <= BLOCK_RATIO and br <= BLOCK_RATIO
        t = prof.meta.get("timing", {})
        rows.append([f"profile {k + 1}", f"{wall:.1f}", f"{prof.step_time * 1e3:.1f}",
                     f"{min(u.fwd_time for u in blocks) * 1e3:.2f}-{max(u.fwd_time for u in blocks) * 1e3:.2f}",
                     f"{fr:.2f}", f"{min(u.bwd_time for u in blocks) * 1e3:.2f}-"
                     f"{max(u.bwd_time for u in blocks) * 1e3:.2f}", f"{br:.2f}",
                     f"{t.get('steps', '?')}/{t.get('set_aside', '?')}", f"{t.get('outliers', 0):.0%}",
                     f"{t.get('wall_over_cpu', 1):.1f}", "yes" if prof.meta.get("time_warning") else "no"])
    print()
    print(md_table(["profile", "wall s", "step ms", "block fwd ms", "fwd max/min", "block bwd ms", "bwd max/min",
                    "steps run/set aside", "samples set aside", "wall/cpu", "busy warning"], rows))
    prow = []
    for k in range(2):
        own, other = k, 1 - k
        mine = memopt.simulate(profs[other], plans[other]).step_time
        theirs = memopt.simulate(profs[other], plans[own]).step_time
        gap = theirs / mine - 1
        ok &= abs(gap) <= PLAN_GAP
        prow.append([f"plan of profile {own + 1}", f"profile {other + 1}", f"{theirs * 1e3:.1f}",
                     f"{mine * 1e3:.1f}", f"{gap:+.1%}",
                     " ".join(s[0] for s in plans[own].strategies)])
    print()
    print(md_table(["plan", "simulated on", "step ms", "that profile's own plan ms", "gap", "strategies"], prow))
    step_gap = abs(profs[0].step_time / profs[1].step_time - 1)
    ok &= step_gap <= STEP_GAP
    print(f"\nunplanned step times differ by {step_gap:.1%} (bound {STEP_GAP:.0%}); blocks within {BLOCK_RATIO}x; "
          f"plans within {PLAN_GAP:.0%}: {'PASS' if ok else 'FAIL'}")
    for k, prof in enumerate(profs):
        if prof.meta.get("time_warning"):
            print(f"profile {k + 1}: {prof.meta['time_warning']}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
