"""CUDA verification, to run on a machine with an NVIDIA GPU (nothing here runs on the CPU-only CI).

Checks, per zoo model (GPT-style and ResNet-style by default) at a GPU-sized batch:

1. loss and gradients under keep / recompute / swap / mixed plans equal plain training (deterministic algorithms on);
2. the swap engine really uses its side copy streams and pinned pool (engine stats: bytes moved, pool reuse);
3. ``torch.cuda.max_memory_allocated`` under each plan vs the simulator's predicted peak (the profile is taken on the
   GPU, so the allocator's view, workspaces included, is what the simulator starts from);
4. step time under each plan vs keep-all, measured vs simulated.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/cuda_check.py [--out DIR] [--models gpt resnet] [--batch 64]

Writes ``cuda_check.json`` to ``--out`` (default: $OUT or the current directory) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import memopt_nb as memopt  # noqa: E402
from memopt_nb.plan import Plan  # noqa: E402


def grads_equal(name: str, batch: int, plan: Plan | None, device: torch.device) -> bool:
    """Loss and every gradient bit-identical with and without ``plan`` (fresh identical models)."""

    def run(p: Plan | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        zm = memopt.zoo.build(name, batch_size=batch, seed=0, device=device)
        torch.manual_seed(1)
        torch.cuda.manual_seed_all(1)
        ctx = memopt.plan(p, zm.model) if p is not None else None
        if ctx:
            ctx.apply()
        try:
            loss = zm.loss_fn(zm.model(*zm.inputs))
            loss.backward()
        finally:
            if ctx:
                ctx.remove()
        return loss.detach(), [q.grad.detach().clone() for q in zm.model.parameters()]

    a, ga = run(None)
    b, gb = run(plan)
    return bool(torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: 8x the zoo default)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda")
    spec = memopt.DeviceSpec.detect(device)
    print(f"device: {spec}")
    rows = []
    for name in args.models:
        import inspect

        ref = inspect.signature(memopt.zoo.BUILDERS[name]).parameters["batch_size"].default
        batch = args.batch or 8 * ref
        zm = memopt.zoo.build(name, batch_size=batch, device=device)
        model, inputs, loss_fn = zm.model, zm.inputs, zm.loss_fn
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt)
        n = prof.n_units
        plans = {
            "keep": Plan.uniform(prof, "keep"),
            "recompute": Plan.uniform(prof, "recompute"),
            "swap": Plan.uniform(prof, "swap", offload_window=1, prefetch_distance=1),
            "mixed": Plan.from_strategies(prof, (["swap", "recompute", "keep"] * n)[:n],
                                          offload_window=[i % 3 for i in range(n)],
                                          prefetch_distance=[(2 * i) % 4 for i in range(n)]),
            "search": memopt.search(prof, "60%"),
        }
        base = None
        for label, plan in plans.items():
            sim = memopt.simulate(prof, plan)
            m = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=5)
            base = base or m
            row = {
                "model": name, "batch": batch, "plan": label, "sim_peak_MiB": sim.peak_bytes / 2**20,
                "cuda_peak_MiB": m.peak_bytes / 2**20,
                "peak_err_pct": 100 * (sim.peak_bytes - m.peak_bytes) / m.peak_bytes,
                "sim_ms": sim.step_time * 1e3, "meas_ms": m.step_time * 1e3,
                "time_ratio_vs_keep": m.step_time / base.step_time,
                "grads_equal": grads_equal(name, batch, plan, device) if label != "search" else None,
                "swap_stats": m.swap_stats,
            }
            rows.append(row)
            print(json.dumps(row))
        print(f"{name}: profiled and checked in {time.perf_counter() - t0:.1f} s")
    print("| model | plan | sim peak MiB | cuda peak MiB | err % | sim ms | meas ms | ×keep | grads equal "
          "| pool reuses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['plan']} | {r['sim_peak_MiB']:.1f} | {r['cuda_peak_MiB']:.1f} | "
              f"{r['peak_err_pct']:+.1f} | {r['sim_ms']:.2f} | {r['meas_ms']:.2f} | {r['time_ratio_vs_keep']:.2f} | "
              f"{r['grads_equal']} | {r['swap_stats'].get('pool_reuses', '-')} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cuda_check.json").write_text(json.dumps({"device": str(spec), "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
