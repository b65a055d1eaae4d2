"""How big a batch trains under a budget, and how fast: ``memopt.max_batch`` per model and device setting.

For each model and device setting, ``memopt.max_batch`` gives the largest batch of plain training, of the best classic
baseline (recompute-all, sqrt(n), swap-all, Capuchin, every-k-th-layer checkpointing: the one that fits the largest
batch) and of memopt's plan (the exact optimum over keep / recompute / swap with optimizer state, gradients and
parameters offloadable), and each one's fastest batch with its predicted throughput. The tables add memopt's max batch
÷ the best baseline's (goal: median 1.25x over the rows) and memopt's best throughput ÷ plain training's (a plan should
never train slower than plain training at the batch that suits it), and the seconds each call took (goal: at most
60 s on 2 cores for the zoo models).

Models (``builder(b) -> (model, inputs, loss_fn, optimizer)``, random init, nothing downloaded, AdamW):

* ``gpt``, ``resnet``, ``vit``: the zoo's models at their defaults;
* ``gpt2``: a transformers ``GPT2LMHeadModel`` (6 layers, width 64, 4 heads, vocabulary 256), 64 tokens, keyword
  inputs ``input_ids`` and ``labels``, loss ``out.loss``;
* ``vit_tiny``: the zoo's model with ViT-Tiny's shapes (width 192, 12 blocks, 3 heads; 64 patches of 8x8, 1000
  classes), where parameters, gradients and AdamW's state outweigh the activations at small batches.

Device settings share one byte budget per model: 0.6 x the unplanned peak (``memopt.measure``, no limit) at the
model's reference batch (:data:`REFERENCE`).

* ``emulated``: this CPU as a device that holds the budget. ``max_batch`` runs inside ``memopt.limit_memory(budget)``
  (batches that do not fit unplanned are profiled from smaller ones) and checks its answer with real steps under
  the plan there (``verify``; the "checked" column: measured peak of the budget).
* ``a100-40gb``, ``rtx4090-24gb`` (``memopt.DeviceSpec.preset_names()``): simulated. The profiles are made here, the
  times scaled to the preset; the byte budget is the same, so the max batches match the emulated device's (up to the
  emulated device's verification), while the throughputs and the fastest batches differ. ``max_batch`` verifies
  nothing for a device the model is not on.

    python benchmarks/max_batch.py                              # 5 models x 3 settings (about 8 min on 2 loaded cores)
    python benchmarks/max_batch.py --quick                      # zoo gpt on the emulated device only (~30 s)
    python benchmarks/max_batch.py --models gpt2,vit_tiny --devices emulated --json rows.json
    python benchmarks/max_batch.py --profile-cost              # what profiling a step that does not fit costs

``--profile-cost`` (goal: at most 3x): per model, ``memopt.profile`` at the reference batch without
a limit (the step fits; measured) and inside ``memopt.limit_memory(SHARE x the unplanned peak)`` (it does not; the
profile is extrapolated from smaller batches), after one untimed profile, alternating the two, ``--repeats`` times
each (default 3); medians, their ratio, and where the extrapolated profile's time goes
(``meta["extrapolation"]["attempts"]``: the failed step, then each smaller batch tried). The smaller batches come from
the builder (``batch_fn``: the zoo's losses hold their targets) except for ``gpt2``, whose keyword inputs are sliced.

One torch thread unless ``--threads`` (see ``_common.set_threads``). Throughputs are predicted (profiled step times
extrapolated to the batch, then simulated under each plan), not measured; on this shared machine they are noisy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import torch  # noqa: E402

import memopt_nb as memopt  # noqa: E402

GOAL_RATIO = 1.25
GOAL_SECONDS = 60.0
GOAL_PROFILE_RATIO = 3.0
SHARE = 0.6
MODELS = ("gpt", "resnet", "vit", "gpt2", "vit_tiny")
DEVICES = ("emulated", "a100-40gb", "rtx4090-24gb")
#: the batch whose unplanned peak sets the budget (the zoo models' default batch; vit_tiny's default 4 is all fixed
#: state, so a batch where activations count too)
REFERENCE = {"gpt": 8, "resnet": 32, "vit": 16, "gpt2": 16, "vit_tiny": 16}
GPT2_SEQ = 64

Builder = Callable[[int], tuple[Any, ...]]


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def zoo_builder(name: str) -> Builder:
    def build(b: int) -> tuple[Any, ...]:
        z = memopt.zoo.build(name, batch_size=b)
        return z.model, z.inputs, z.loss_fn, adamw(z.model)
    return build


def gpt2_builder(b: int) -> tuple[Any, ...]:
    """transformers GPT-2 from a small config, as ``tests/test_does_not_fit.py`` builds it: keyword inputs."""
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 256, (b, GPT2_SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}, (lambda out: out.loss), adamw(model)


def builder(name: str) -> Builder:
    if name == "gpt2":
        return gpt2_builder
    if name in memopt.zoo.BUILDERS:
        return zoo_builder(name)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def reference_peak(build: Builder, batch: int) -> int:
    """The unplanned peak of one training step at ``batch``, measured (no limit)."""
    model, inputs, loss_fn, opt = build(batch)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    peak = memopt.measure(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt, steps=1).peak_bytes
    del model, opt
    gc.collect()
    return int(peak)


def run_one(name: str, build: Builder, budget: int, device: str) -> dict[str, Any]:
    """One ``max_batch`` call: its three answers as a row (or the error it raised)."""
    gc.collect()
    t0 = time.perf_counter()
    row: dict[str, Any] = {"model": name, "device": device, "budget_bytes": budget}
    try:
        if device == "emulated":
            with memopt.limit_memory(budget):
                res = memopt.max_batch(build, budget, verify=True)
        else:
            res = memopt.max_batch(build, budget, device=device)
    except (memopt.MemoptError, torch.OutOfMemoryError) as exc:
        row.update(error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0)
        return row
    row.update(res.to_dict())
    row["device"] = device  # res.device: "cpu (emulated device)" or the preset's name
    row["seconds"] = time.perf_counter() - t0
    row["ratio_batch"] = ratio(res.memopt.batch, res.baseline.batch)
    row["ratio_throughput"] = ratio(res.memopt.best_throughput, res.plain.best_throughput)
    return row


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}×"


def fmt_best(a: dict[str, Any]) -> str:
    if a.get("best_batch") is None:
        return "—"
    return f"{a['best_batch']} ({a['best_throughput']:,.0f})"


def table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["model", "device", "budget MiB", "best baseline", "max batch plain / baseline / memopt",
               "memopt ÷ baseline", "best batch (samples/s): plain", "baseline", "memopt",
               "memopt ÷ plain (best samples/s)", "checked", "call s"]
    out = []
    for r in rows:
        head = [r["model"], r["device"], f"{r['budget_bytes'] / _common.MiB:.1f}"]
        if "error" in r:
            out.append(head + [r["error"][:60], "", "", "", "", "", "", "", f"{r['seconds']:.1f}"])
            continue
        p, b, m = r["plain"], r["baseline"], r["memopt"]
        v = r.get("verified") or {}
        checked = f"{v['peak_bytes'] / _common.MiB:.1f} MiB at {v['batch']}" if v else "—"
        batches = " / ".join("—" if a["batch"] is None else str(a["batch"]) for a in (p, b, m))
        out.append(head + [b["method"], batches, fmt_ratio(r["ratio_batch"]), fmt_best(p), fmt_best(b), fmt_best(m),
                           fmt_ratio(r["ratio_throughput"]), checked, f"{r['seconds']:.1f}"])
    return _common.md_table(headers, out, align="llrlrrrrrrrr")


def model_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per model, the device settings side by side: the byte budget is the same for all, so the max batches
    are too (the first setting's are shown); what differs is the fastest batch and its throughput."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["model"], []).append(r)
    devices = list(dict.fromkeys(r["device"] for r in rows))
    headers = ["model (ref. batch)", "budget MiB", "best baseline", "max batch plain / baseline / memopt",
               "memopt ÷ baseline", "checked MiB",
               *[f"{d}: best batch (samples/s) plain → memopt" for d in devices[:1]],
               *[f"{d}: the same" for d in devices[1:]], "call s"]
    out = []
    for name, rs in by.items():
        first = next((r for r in rs if "error" not in r), None)
        if first is None:
            continue
        at = {r["device"]: r for r in rs}
        cells = [f"{name} ({first['reference_batch']})", f"{first['budget_bytes'] / _common.MiB:.1f}",
                 first["baseline"]["method"],
                 " / ".join("—" if first[k]["batch"] is None else str(first[k]["batch"])
                            for k in ("plain", "baseline", "memopt")),
                 fmt_ratio(first["ratio_batch"]),
                 f"{first['verified']['peak_bytes'] / _common.MiB:.1f}" if first.get("verified") else "—"]
        for d in devices:
            r = at.get(d)
            cells.append("—" if r is None or "error" in r else
                         f"{fmt_best(r['plain'])} → {fmt_best(r['memopt'])} {fmt_ratio(r['ratio_throughput'])}")
        cells.append(" / ".join(f"{at[d]['seconds']:.0f}" if d in at else "—" for d in devices))
        out.append(cells)
    return _common.md_table(headers, out, align="lrlrrr" + "r" * (len(devices) + 1))


def summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    ok = [r for r in rows if "error" not in r]
    ratios = [r["ratio_batch"] for r in ok if r["ratio_batch"] is not None]
    lines = []
    if ratios:
        med = _common.median(ratios)
        lines.append(f"memopt max batch ÷ best baseline max batch: median {med:.2f}× over {len(ratios)} rows "
                     f"(min {min(ratios):.2f}×, max {max(ratios):.2f}×) against the goal {GOAL_RATIO}× — "
                     f"{'met' if med >= GOAL_RATIO else 'NOT met'}; {sum(x >= GOAL_RATIO for x in ratios)} of "
                     f"{len(ratios)} rows at or above it"
                     + (f"; {len(ok) - len(ratios)} rows without a baseline that fits" if len(ok) > len(ratios)
                        else ""))
    faster = [r for r in ok if r["memopt"]["best_throughput"] is not None and (
        r["plain"]["best_throughput"] is None
        or r["memopt"]["best_throughput"] >= r["plain"]["best_throughput"] * (1 - 1e-9))]
    lines.append(f"memopt's best throughput ≥ plain training's: {len(faster)} of {len(ok)} rows")
    secs = [r["seconds"] for r in rows]
    if secs:
        zoo = [r["seconds"] for r in rows if r["model"] in ("gpt", "resnet", "vit")]
        lines.append(f"seconds per max_batch call: median {_common.median(secs):.1f}, max {max(secs):.1f} "
                     f"(zoo gpt, resnet, vit: max {max(zoo, default=math.nan):.1f}; goal ≤ {GOAL_SECONDS:.0f} s on "
                     "2 cores)")
    if len(ok) < len(rows):
        lines.append(f"{len(rows) - len(ok)} calls raised (see the table)")
    return lines


def _profile_once(model: torch.nn.Module, inputs: Any, loss_fn: Any, opt: torch.optim.Optimizer,
                  batch_fn: Callable[[int], Any] | None, limit: int | None) -> tuple[float, Any]:
    """Seconds of one ``memopt.profile`` call (inside ``limit_memory(limit)`` unless ``limit`` is None; entering the
    block, which indexes the live models once, is not timed: on CUDA it is one allocator setting) and the profile."""
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
    gc.collect()
    with memopt.limit_memory(limit) if limit is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        prof = memopt.profile(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt,
                              **({"batch_fn": batch_fn} if limit is not None else {}))
        secs = time.perf_counter() - t0
    return secs, prof


def profile_cost(name: str, build: Builder, share: float = SHARE, repeats: int = 3) -> dict[str, Any]:
    """``memopt.profile`` at the reference batch, where it fits (no limit) and where it does not (``limit_memory``),
    alternated ``repeats`` times: seconds of each, the ratio of the medians, and the extrapolated profile's attempts
    (median seconds per batch tried)."""
    ref = REFERENCE.get(name, 8)
    peak = reference_peak(build, ref)
    limit = int(share * peak)
    model, inputs, loss_fn, opt = build(ref)

    def smaller(b: int) -> tuple[Any, Any]:
        made = build(b)
        return made[1], made[2]

    batch_fn = None if name == "gpt2" else smaller
    row: dict[str, Any] = {"model": name, "batch": ref, "peak_bytes": peak, "limit_bytes": limit, "fits": [],
                           "does_not_fit": [], "sliced": batch_fn is None}
    attempts: dict[tuple[int, bool], list[float]] = {}
    order: list[tuple[int, bool]] = []
    _profile_once(model, inputs, loss_fn, opt, None, None)  # untimed: the process's first steps are slower
    for _ in range(repeats):
        secs, prof = _profile_once(model, inputs, loss_fn, opt, None, None)
        row["fits"].append(secs)
        row["measured_peak_bytes"] = prof.peak_bytes
        secs, prof = _profile_once(model, inputs, loss_fn, opt, batch_fn, limit)
        row["does_not_fit"].append(secs)
        if prof.meta.get("method") != "extrapolated":
            raise SystemExit(f"{name}: the profile under the limit was {prof.meta.get('method')!r}, not extrapolated")
        ext = prof.meta["extrapolation"]
        row["extrapolated_peak_bytes"] = prof.peak_bytes
        row["fitted_batches"], row["check_batch"] = ext["fitted_batches"], ext["check_batch"]
        for b, s, ok in ext["attempts"]:
            key = (int(b), bool(ok))
            if key not in attempts:
                order.append(key)
            attempts.setdefault(key, []).append(float(s))
    del model, opt
    gc.collect()
    row["fits_median"] = _common.median(row["fits"])
    row["does_not_fit_median"] = _common.median(row["does_not_fit"])
    row["ratio"] = row["does_not_fit_median"] / row["fits_median"]
    row["attempts"] = [{"batch": b, "fitted": ok, "seconds": _common.median(attempts[(b, ok)])} for b, ok in order]
    return row


def cost_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["model (batch)", "limit MiB (of peak)", "fits: profile s", "does not fit: profile s",
               "ratio", "where the time goes (batch: median s; ✗ ran out of memory)", "peak error"]
    out = []
    for r in rows:
        where = ", ".join(f"{a['batch']}{'' if a['fitted'] else '✗'}: {a['seconds']:.2f}" for a in r["attempts"])
        err = _common.rel_err(r["extrapolated_peak_bytes"], r["measured_peak_bytes"])
        out.append([f"{r['model']} ({r['batch']})",
                    f"{r['limit_bytes'] / _common.MiB:.1f} ({r['limit_bytes'] / r['peak_bytes']:.0%})",
                    f"{r['fits_median']:.2f} ({', '.join(f'{x:.2f}' for x in r['fits'])})",
                    f"{r['does_not_fit_median']:.2f} ({', '.join(f'{x:.2f}' for x in r['does_not_fit'])})",
                    f"{r['ratio']:.2f}×", where, f"{err:+.2f}%"])
    return _common.md_table(headers, out, align="lrrrrlr")


def cost_summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    ratios = [r["ratio"] for r in rows]
    if not ratios:
        return []
    over = [r["model"] for r in rows if r["ratio"] > GOAL_PROFILE_RATIO]
    return [f"profile where the step does not fit ÷ where it fits: median {_common.median(ratios):.2f}×, max "
            f"{max(ratios):.2f}× against the goal ≤ {GOAL_PROFILE_RATIO:.0f}× — "
            + ("met on every model" if not over else f"NOT met on {', '.join(over)}")]


def main_profile_cost(models: Sequence[str], share: float, repeats: int, json_path: str | None) -> list[dict[str, Any]]:
    t_start = time.perf_counter()
    print(f"# profiling a step that does not fit — {_common.environment_line()}")
    print(f"limit = {share} × the unplanned peak at the reference batch; AdamW; {repeats} alternated repeats\n",
          flush=True)
    rows = []
    for name in models:
        row = profile_cost(name, builder(name), share, repeats)
        rows.append(row)
        print(f"  {name}: fits {row['fits_median']:.2f} s, does not fit {row['does_not_fit_median']:.2f} s "
              f"({row['ratio']:.2f}×)", flush=True)
    print()
    print(cost_table(rows))
    print()
    for line in cost_summary(rows):
        print(line)
    print(f"[{time.perf_counter() - t_start:.0f} s]")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1, default=str))
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="zoo gpt on the emulated device only")
    ap.add_argument("--models", default=None, help=f"comma-separated, of {','.join(MODELS)} (default: all)")
    ap.add_argument("--devices", default=None, help=f"comma-separated, of {','.join(DEVICES)} or another preset "
                    f"name (default: all three)")
    ap.add_argument("--share", type=float, default=SHARE, help="budget = SHARE x the unplanned peak at the reference "
                    "batch (default 0.6)")
    ap.add_argument("--json", default=None, help="write the rows (MaxBatch.to_dict() plus the ratios) to this path")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0 = torch's default)")
    ap.add_argument("--profile-cost", action="store_true", help="time memopt.profile where the step fits and where "
                    "it does not (under limit_memory(SHARE x peak)) instead of max_batch")
    ap.add_argument("--repeats", type=int, default=3, help="--profile-cost: alternated repeats of each (default 3)")
    args = ap.parse_args(argv)
    _common.set_threads(args.threads)
    models = ["gpt"] if args.quick else [m.strip() for m in (args.models or ",".join(MODELS)).split(",") if m.strip()]
    if args.profile_cost:
        if args.repeats < 1:
            ap.error("--repeats must be at least 1")
        return main_profile_cost(models, args.share, args.repeats, args.json)
    devices = ["emulated"] if args.quick else [d.strip() for d in (args.devices or ",".join(DEVICES)).split(",")
                                               if d.strip()]
    for d in devices:
        if d != "emulated" and d not in memopt.DeviceSpec.preset_names():
            ap.error(f"unknown device {d!r}: 'emulated' or one of {', '.join(memopt.DeviceSpec.preset_names())}")
    t_start = time.perf_counter()
    print(f"# max batch ({'quick' if args.quick else 'default'} mode) — {_common.environment_line()}")
    print(f"budget = {args.share} × the unplanned peak at the reference batch; AdamW\n", flush=True)
    rows: list[dict[str, Any]] = []
    for name in models:
        build = builder(name)
        ref = REFERENCE.get(name, 8)
        peak = reference_peak(build, ref)
        budget = int(args.share * peak)
        print(f"  {name}: unplanned peak {peak / _common.MiB:.1f} MiB at batch {ref}, budget "
              f"{budget / _common.MiB:.1f} MiB", flush=True)
        for device in devices:
            row = run_one(name, build, budget, device)
            row["reference_batch"], row["reference_peak_bytes"] = ref, peak
            rows.append(row)
            got = row.get("error") or (f"max batch {row['plain']['batch']} / {row['baseline']['batch']} / "
                                       f"{row['memopt']['batch']}")
            print(f"    {device}: {got} ({row['seconds']:.1f} s)", flush=True)
    print()
    print(table(rows))
    print()
    if len(devices) > 1:
        print(model_table(rows))
        print()
    for line in summary(rows):
        print(line)
    print(f"[{time.perf_counter() - t_start:.0f} s]")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
