"""``python -m memopt_nb bench``: the evaluation suite behind the README table.

Every zoo model × (this machine's device, measured; two GPU presets, simulated) × every method, at a fixed budget per
model: 50% of the model's unoptimized peak at its reference (zoo default) batch size, over batch sizes from an eighth
to twice the reference. Writes ``results/bench.md``, ``results/bench.json`` and ``results/bench.png``.

Headline ratios compare memopt-ppo with the best *baseline* (none, recompute_all, sqrt_n, swap_all, capuchin) of each
case: max batch ratio and max throughput ratio; the exact optimum is reported beside them as the yardstick.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .evaluate import BASELINE_METHODS, Evaluation, evaluate
from .zoo import BUILDERS

__all__ = ["FULL", "QUICK", "headline", "markdown", "run_bench"]

FULL = {"models": ("gpt", "resnet", "vit", "unet", "mlp"), "devices": (None, "a100-40gb", "v100-16gb"),
        "multipliers": (0.125, 0.25, 0.5, 1, 2), "search_timesteps": None}
QUICK = {"models": ("mlp", "unet"), "devices": (None, "a100-40gb"), "multipliers": (0.25, 0.5, 1),
         "search_timesteps": 2000}


def _batches(ref: int, multipliers: tuple[float, ...]) -> list[int]:
    return sorted({max(1, int(round(ref * m))) for m in multipliers})


def headline(ev: Evaluation) -> dict[str, Any]:
    """memopt-ppo against the best baseline and the optimum, for one evaluation."""
    ppo = ev.methods.get("memopt-ppo")
    bases = [ev.methods[m] for m in BASELINE_METHODS if m in ev.methods]
    best_batch = max((b.max_batch or 0 for b in bases), default=0)
    best_tp = max((b.max_throughput or 0.0 for b in bases), default=0.0)
    opt = ev.methods.get("optimal")
    out = {"model": ev.model, "device": ev.device, "source": ev.source, "verdict": ev.verdict, "worth_it": ev.worth_it,
           "best_baseline_max_batch": best_batch, "best_baseline_max_throughput": best_tp}
    if ppo is not None:
        out["ppo_max_batch"] = ppo.max_batch
        out["ppo_max_throughput"] = ppo.max_throughput
        out["max_batch_ratio"] = (ppo.max_batch or 0) / best_batch if best_batch else math.nan
        out["throughput_ratio"] = (ppo.max_throughput or 0.0) / best_tp if best_tp else math.nan
        if opt is not None and opt.max_throughput:
            out["throughput_vs_optimal"] = (ppo.max_throughput or 0.0) / opt.max_throughput
    # room for a bigger batch than the best baseline's: the smallest peak of any plan vs the lowest baseline peak,
    # at the batch just above the best baseline's max batch (1.00: no plan can fit it either)
    above = [b for b in ev.batch_sizes if b > best_batch]
    if above and ev.min_peak_bytes:
        b = above[0]
        i = ev.batch_sizes.index(b)  # every method's lists are aligned with ev.batch_sizes
        lowest = min((r.peak_bytes[i] for r in bases if r.peak_bytes[i] is not None), default=None)
        floor = ev.min_peak_bytes.get(b)
        if lowest and floor:
            out["next_batch"] = b
            out["min_peak_vs_lowest_baseline"] = floor / lowest
            out["min_peak_over_budget"] = floor / ev.budget_bytes
    return out


def run_bench(quick: bool = False, out: str | Path = "results", progress: Callable[[str], None] = print,
              suite: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the suite and write the three result files; returns what was written to bench.json."""
    cfg = dict(suite or (QUICK if quick else FULL))
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    evaluations: list[Evaluation] = []
    for name in cfg["models"]:
        import inspect

        ref = inspect.signature(BUILDERS[name]).parameters["batch_size"].default
        sizes = _batches(ref, cfg["multipliers"])
        for device in cfg["devices"]:
            progress(f"bench: {name} on {device or 'this machine'} at batches {sizes}")
            ev = evaluate(name, device=device, budget="50%", batch_sizes=sizes, reference_batch=ref,
                          search_timesteps=cfg["search_timesteps"])
            evaluations.append(ev)
            progress(f"  {ev.verdict}")
    heads = [headline(ev) for ev in evaluations]
    ratios_b = [h["max_batch_ratio"] for h in heads if not math.isnan(h.get("max_batch_ratio", math.nan))]
    ratios_t = [h["throughput_ratio"] for h in heads if not math.isnan(h.get("throughput_ratio", math.nan))]
    import torch

    result = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "torch": torch.__version__,
        "quick": quick,
        "seconds": time.perf_counter() - t0,
        "budget_rule": "50% of the unoptimized peak at the zoo default batch",
        "median_max_batch_ratio": statistics.median(ratios_b) if ratios_b else None,
        "median_throughput_ratio": statistics.median(ratios_t) if ratios_t else None,
        "cases": heads,
        "evaluations": [ev.to_dict() for ev in evaluations],
    }
    (outdir / "bench.json").write_text(json.dumps(result, indent=1, default=_json_default))
    (outdir / "bench.md").write_text(markdown(result))
    _figure(evaluations, outdir / "bench.png")
    progress(f"bench: wrote {outdir / 'bench.md'}, bench.json and bench.png in {result['seconds']:.0f} s")
    return result


def _json_default(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def _f(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:,.{digits}f}" if isinstance(x, float) else str(x)


def markdown(result: dict[str, Any]) -> str:
    """The README table: one row per case and method."""
    lines = [f"Benchmark of {result['date']} on {result['machine']} (torch {result['torch']}), "
             f"{'quick' if result['quick'] else 'full'} suite, {result['seconds']:.0f} s. Budget: "
             f"{result['budget_rule']}.", ""]
    lines.append("| model | device | figures | method | max batch | max samples/s | at batch | p-score |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for ev in result["evaluations"]:
        for name, r in ev["methods"].items():
            p = r.get("p_score")
            lines.append(f"| {ev['model']} | {ev['device']} | {ev['source']} | {name} | {_f(r['max_batch'])} | "
                         f"{_f(r['max_throughput'])} | {_f(r['best_batch'])} | {_f(p, 0)} |")
    lines += ["", "| model | device | memopt-ppo max batch ÷ best baseline | memopt-ppo throughput ÷ best baseline | "
              "÷ optimal | next batch: min peak ÷ budget | min peak ÷ lowest baseline peak | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for h in result["cases"]:
        nxt = f"{h['next_batch']}: {_f(h['min_peak_over_budget'], 3)}" if "next_batch" in h else "–"
        lines.append(f"| {h['model']} | {h['device']} | {_f(h.get('max_batch_ratio'), 2)} | "
                     f"{_f(h.get('throughput_ratio'), 3)} | {_f(h.get('throughput_vs_optimal'), 3)} | {nxt} | "
                     f"{_f(h.get('min_peak_vs_lowest_baseline'), 3)} | {h['verdict']} |")
    lines += ["", f"Median max-batch ratio {_f(result['median_max_batch_ratio'], 2)} (target ≥ 1.10), median "
              f"throughput ratio {_f(result['median_throughput_ratio'], 3)} (target ≥ 1.0) vs the best baseline.",
              "", "*next batch*: the first batch size above the best baseline's max batch; *min peak*: the smallest "
              "peak any keep/recompute/swap plan reaches there (`solvers.min_peak`). Where min peak ÷ budget > 1 no "
              "plan — memopt-ppo, the optimum or any other — fits that batch, so the max-batch ratio is 1.00 by "
              "necessity; where min peak ÷ lowest baseline peak is 1.000 a baseline already reaches the minimum."]
    return "\n".join(lines) + "\n"


def _figure(evaluations: list[Evaluation], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    n = len(evaluations)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    names = list(evaluations[0].methods) if evaluations else []
    palette = dict(zip(names, sns.color_palette("tab10", len(names))))
    for ax, ev in zip(axes.flat, evaluations):
        for name, r in ev.methods.items():
            xs = [b for b, f in zip(r.batch_sizes, r.feasible) if f]
            ys = [t for t, f in zip(r.throughput, r.feasible) if f]
            if xs:
                ax.plot(xs, ys, "o-", label=name, color=palette.get(name))
        ax.set_xscale("log", base=2)
        ax.set_title(f"{ev.model} · {ev.device} ({ev.source})", fontsize=9)
        ax.set_xlabel("batch size")
        ax.set_ylabel("samples/s")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if names:
        axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
