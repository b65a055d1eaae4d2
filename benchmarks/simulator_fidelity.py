"""Simulator fidelity on the CPU: ``memopt.simulate`` vs ``memopt.measure`` on the zoo and on third-party models.

Models: every zoo model, and four models this project did not write, built from small configs of Hugging Face
``transformers`` (random init, no download; see ``THIRD_PARTY``): GPT-2 (6 layers, 192 wide, batch 8 x 128 tokens,
``use_cache=False``), BERT (``BertForMaskedLM``, same size), ViT (``ViTForImageClassification``, ViT-tiny width, 6
layers, 32 px) and ConvNeXt (``ConvNextForImageClassification``, depths 2-2-4-2, 64 px; its ten blocks named as units).
GPT-2 runs with ``use_cache=False``: with the cache a recomputed forward appends to the returned KV cache a second
time (the cache is tested on its own: tests/test_third_party.py). HF models are called with positional inputs only
and trained on ``logits.float().pow(2).mean()``.

For each model (Adam optimizer) the script profiles one training step, then for the plans keep-all ("none"),
recompute-all, swap-all as ``save_on_cpu`` does it (baseline ``swap_all``: offload window 0, prefetch distance 0),
swap-all with window 1 / distance 1, sqrt(n) checkpointing (baseline ``sqrt_n``), a plan from ``memopt.search``
(``--timesteps``, budget halfway between the smallest peak any plan reaches and the keep-all peak) and, for the zoo,
``--random`` random mixed plans (random strategy, window and distance per unit, fixed seed) compares the simulated peak
and step time with the measured ones (``memopt.measure(..., steps=5)``; its step time is the median of the 5 timed
steps). Targets: peak within 2 %, step time within 20 %.

When a target is missed the script prints a breakdown of the step time: how far the profiled keep-all step already is
from the measured keep-all step (drift/noise between profiling and measuring), and for the plan the extra time over
keep-all the simulator predicts (recompute, host copies) vs the extra time measured, plus what the swap engine did.

    python benchmarks/simulator_fidelity.py            # all models, 1 random plan per zoo model (~10 min when quiet)
    python benchmarks/simulator_fidelity.py --models hf-gpt2,hf-bert,hf-vit,hf-convnext   # third-party only
    python benchmarks/simulator_fidelity.py --quick    # half the batch sizes, no search (~3 min)
    python benchmarks/simulator_fidelity.py --selective --models gpt,hf-gpt2,hf-vit   # + selective plans

``--selective`` profiles with ``selective=True`` and adds a plan per save-set (every unit that has it selective with
it, the others recomputed) and one with each unit's first Pareto save-set.

One torch thread by default (``--threads``; 0 = torch's default): on this shared 2-vCPU machine, 2-thread steps are at
times 10-50x slower for seconds to minutes, 1-thread steps are not. A model whose run looks disturbed anyway (judged
from the stability of the measurements, never from the targets; see ``attempt``) is run again, up to ``--retries``
times, and the table says which try it shows.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common
import numpy as np
import torch

import memopt_nb as memopt
from memopt_nb import solvers, zoo
from memopt_nb.core.plan import DEFAULT_STRATEGIES, DISTANCES, SAVE_SETS, WINDOWS

PEAK_TOL = 2.0  # percent
TIME_TOL = 20.0  # percent
SPREAD_MAX = 1.5  # a measure() whose timed steps differ more than this (max/min) ran while the machine was disturbed
DRIFT_MAX = 0.10  # relative change of the keep-all step (measured, or profiled) within one run: half TIME_TOL
CODE = {"keep": "K", "recompute": "R", "swap": "S"}


def random_plans(prof: memopt.ModelProfile, count: int, rng: np.random.Generator) -> list[tuple[str, memopt.Plan]]:
    """``count`` random plans that mix at least two strategies."""
    n = prof.n_units
    out = []
    while len(out) < count:
        strategies = [DEFAULT_STRATEGIES[i] for i in rng.integers(0, len(DEFAULT_STRATEGIES), n)]
        windows = [int(WINDOWS[i]) for i in rng.integers(0, len(WINDOWS), n)]
        dists = [int(DISTANCES[i]) for i in rng.integers(0, len(DISTANCES), n)]
        if len(set(strategies)) < 2:
            continue
        desc = " ".join(CODE[s] + (f"{w}{d}" if s == "swap" else "") for s, w, d in zip(strategies, windows, dists))
        plan = memopt.Plan.from_strategies(prof, strategies, offload_window=windows, prefetch_distance=dists,
                                           method=f"random-{len(out) + 1}")
        out.append((f"random-{len(out) + 1} [{desc}]", plan))
    return out


def _logits_loss(out: Any) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


def _hf_gpt2(batch: int) -> tuple[Any, tuple, Any, Any]:
    import transformers as tf

    cfg = tf.GPT2Config(n_layer=6, n_embd=192, n_head=6, vocab_size=2048, n_positions=128, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 2048, (batch, 128), generator=torch.Generator().manual_seed(0))
    return tf.GPT2LMHeadModel(cfg), (ids,), _logits_loss, "auto"


def _hf_bert(batch: int) -> tuple[Any, tuple, Any, Any]:
    import transformers as tf

    cfg = tf.BertConfig(hidden_size=192, num_hidden_layers=6, num_attention_heads=6, intermediate_size=768,
                        vocab_size=2048, max_position_embeddings=128)
    ids = torch.randint(0, 2048, (batch, 128), generator=torch.Generator().manual_seed(0))
    return tf.BertForMaskedLM(cfg), (ids,), _logits_loss, "auto"


def _hf_vit(batch: int) -> tuple[Any, tuple, Any, Any]:
    import transformers as tf

    cfg = tf.ViTConfig(image_size=32, patch_size=4, hidden_size=192, num_hidden_layers=6, num_attention_heads=3,
                       intermediate_size=768, num_labels=10)
    x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return tf.ViTForImageClassification(cfg), (x,), _logits_loss, "auto"


def _hf_convnext(batch: int) -> tuple[Any, tuple, Any, Any]:
    import transformers as tf

    depths = [2, 2, 4, 2]
    cfg = tf.ConvNextConfig(hidden_sizes=[24, 48, 96, 192], depths=depths, image_size=64, num_labels=10)
    x = torch.randn(batch, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    # "auto" would pick the four stages; its ten blocks are the natural units
    units = [f"convnext.encoder.stages.{s}.layers.{i}" for s, d in enumerate(depths) for i in range(d)]
    return tf.ConvNextForImageClassification(cfg), (x,), _logits_loss, units


#: third-party models: name -> (builder(batch) -> (model, inputs, loss_fn, units), default batch)
THIRD_PARTY = {"hf-gpt2": (_hf_gpt2, 8), "hf-bert": (_hf_bert, 8), "hf-vit": (_hf_vit, 16),
               "hf-convnext": (_hf_convnext, 16)}


def build(name: str, batch: int) -> tuple[Any, tuple, Any, Any]:
    """(model, inputs, loss_fn, units) of a zoo or third-party model."""
    if name in THIRD_PARTY:
        torch.manual_seed(0)
        return THIRD_PARTY[name][0](batch)
    model, inputs, loss_fn, _ = zoo.build(name, batch_size=batch)
    return model, tuple(inputs), loss_fn, "auto"


def default_batch(name: str) -> int:
    return THIRD_PARTY[name][1] if name in THIRD_PARTY else int(zoo.build(name).inputs[0].shape[0])


def selective_plans(prof: memopt.ModelProfile) -> list[tuple[str, memopt.Plan]]:
    """A plan per save-set (units without it recomputed) and one with each unit's first Pareto save-set."""
    out = []
    for name in SAVE_SETS:
        if any(name in u.save_sets for u in prof.units):
            out.append((f"selective:{name}", memopt.Plan.from_strategies(
                prof, [f"selective:{name}" if name in u.save_sets else "recompute" for u in prof.units])))
    if any(u.save_sets for u in prof.units):
        out.append(("selective (pareto)", memopt.Plan.from_strategies(
            prof, ["selective" if any(s["pareto"] for s in u.save_sets.values()) else "recompute"
                   for u in prof.units])))
    return out


def attempt(name: str, batch: int, n_random: int, seed: int, timesteps: int,
            selective: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """Profile, then simulate and measure every plan; returns the rows and the reasons the run looks disturbed.

    Disturbance is judged from stability alone, never from the targets: a ``measure`` whose slowest timed step is more
    than ``SPREAD_MAX`` times its fastest, keep-all measured again at the end more than ``DRIFT_MAX`` away from the
    first time, or a second profile taken after all measurements whose step time is more than ``DRIFT_MAX`` away from
    the one the simulation used.
    """
    model, inputs, loss_fn, units = build(name, batch)
    opt = torch.optim.Adam(model.parameters())
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units=units, selective=selective)
    plans = [
        ("keep-all", memopt.Plan.uniform(prof, "keep")),
        ("recompute-all", memopt.Plan.uniform(prof, "recompute")),
        ("swap-all w0 d0", solvers.swap_all(prof)),
        ("swap-all w1 d1", memopt.Plan.uniform(prof, "swap", offload_window=1, prefetch_distance=1)),
        ("sqrt-n", solvers.sqrt_n(prof)),
    ]
    if timesteps > 0:
        lo = solvers.min_peak(prof)
        budget = int(lo + 0.5 * (prof.peak_bytes - lo))
        found = memopt.search(prof, budget, total_timesteps=timesteps, seed=seed)
        desc = " ".join(CODE[d.strategy] + (f"{d.offload_window}{d.prefetch_distance}" if d.strategy == "swap" else "")
                        for d in found.decisions)
        plans.append((f"searched [{desc}]", found))
    if name not in THIRD_PARTY:
        plans += random_plans(prof, n_random, np.random.default_rng(seed))
    if selective:
        plans += selective_plans(prof)
    rows = []
    for label, plan in plans:
        sim = memopt.simulate(prof, plan)
        meas = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=5)
        rows.append({
            "model": name, "batch": batch, "plan": label, "sim": sim, "meas": meas,
            "peak_err": _common.rel_err(sim.peak_bytes, meas.peak_bytes),
            "time_err": _common.rel_err(sim.step_time, meas.step_time),
            "spread": max(meas.step_times) / min(meas.step_times), "bw": prof.device.d2h_bytes_per_s,
        })
    reasons = []
    for r in rows:
        if r["spread"] > SPREAD_MAX:
            reasons.append(f"{r['plan'].split(' [')[0]}: timed steps {min(r['meas'].step_times) * 1e3:.0f}-"
                           f"{max(r['meas'].step_times) * 1e3:.0f} ms")
    again = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=5)
    first = rows[0]["meas"].step_time
    if abs(again.step_time / first - 1) > DRIFT_MAX:
        reasons.append(f"keep-all {first * 1e3:.1f} ms at the start, {again.step_time * 1e3:.1f} ms at the end")
    prof2 = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units=units)
    if abs(prof2.step_time / prof.step_time - 1) > DRIFT_MAX:
        reasons.append(f"profiled step {prof.step_time * 1e3:.1f} ms, re-profiled {prof2.step_time * 1e3:.1f} ms")
    for r in rows:
        r["profile_step"], r["reprofile_step"], r["keep_again"] = prof.step_time, prof2.step_time, again.step_time
    return rows, reasons


def run_model(name: str, batch: int, n_random: int, seed: int, retries: int, timesteps: int,
              selective: bool = False) -> list[dict[str, Any]]:
    for i in range(retries + 1):
        rows, reasons = attempt(name, batch, n_random, seed, timesteps, selective)
        for r in rows:
            r["attempt"], r["disturbed"] = i + 1, bool(reasons)
            print(f"  {name:11s} try {i + 1} {r['plan'][:40]:40s} peak {r['peak_err']:+6.2f} %   time "
                  f"{r['time_err']:+7.1f} %   (timed steps max/min {r['spread']:.2f})", flush=True)
        if not reasons:
            return rows
        print(f"  {name}: try {i + 1} disturbed ({'; '.join(reasons)})"
              + (" - running the model again" if i < retries else " - keeping this try, marked disturbed"),
              flush=True)
    return rows


def fidelity_table(rows: list[dict[str, Any]]) -> str:
    out = []
    for r in rows:
        sim, meas = r["sim"], r["meas"]
        ok = abs(r["peak_err"]) <= PEAK_TOL and abs(r["time_err"]) <= TIME_TOL
        out.append([
            r["model"], r["plan"], f"{sim.peak_bytes / _common.MiB:.2f}", f"{meas.peak_bytes / _common.MiB:.2f}",
            f"{r['peak_err']:+.2f}", f"{sim.step_time * 1e3:.1f}", f"{meas.step_time * 1e3:.1f}",
            f"{r['time_err']:+.1f}", f"{r['spread']:.2f}",
            f"{r['attempt']}" + (" (disturbed)" if r["disturbed"] else ""),
            "ok" if ok else "MISS",
        ])
    return _common.md_table(["model", "plan", "sim peak MiB", "measured peak MiB", "peak err %", "sim ms",
                             "measured ms", "time err %", "steps max/min", "try", "target"], out, "llrrrrrrrrc")


def breakdown(rows: list[dict[str, Any]], misses: list[dict[str, Any]]) -> str:
    """Where the step time of each missed plan is off (see the module docstring)."""
    keep = {r["model"]: r for r in rows if r["plan"] == "keep-all"}
    out = []
    for r in misses:
        k = keep[r["model"]]
        sim, meas = r["sim"], r["meas"]
        sim_extra = sim.step_time - k["sim"].step_time
        meas_extra = meas.step_time - k["meas"].step_time
        copy_ms = sim.copy_time * 1e3
        st = meas.swap_stats
        times = meas.step_times
        out.append([
            r["model"], r["plan"].split(" [")[0], f"{k['sim'].step_time * 1e3:.1f}", f"{k['meas'].step_time * 1e3:.1f}",
            f"{r['reprofile_step'] * 1e3:.1f}", f"{sim.recompute_time * 1e3:.1f}",
            f"{copy_ms:.1f} ({sim.storages_offloaded})", f"{sim.stall_time * 1e3:.1f}", f"{sim_extra * 1e3:+.1f}",
            f"{meas_extra * 1e3:+.1f}", f"{min(times) * 1e3:.0f}–{max(times) * 1e3:.0f}",
            f"{st.get('offloaded_bytes', 0) / _common.MiB:.1f}" if st else "-",
            f"{st.get('offload_wait_s', 0) * 1e3:.1f} / {st.get('prefetch_wait_s', 0) * 1e3:.1f}" if st else "-",
            f"{int(st.get('on_demand', 0))}" if st else "-",
        ])
    return _common.md_table(
        ["model", "plan", "sim keep-all ms", "meas keep-all ms", "re-profiled keep-all ms", "sim recompute ms",
         "sim copy ms (storages)", "sim stall ms", "sim extra vs keep ms", "meas extra vs keep ms",
         "meas step range ms", "offloaded MiB (7 steps)", "offload / prefetch wait ms (7 steps)", "on-demand fetches"],
        out, "llrrrrrrrrrrrr")


def extra_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Measured extra time over keep-all vs the extra the simulator predicts, for swap-only and recompute-only plans."""
    keep = {r["model"]: r for r in rows if r["plan"] == "keep-all"}
    swap, rc = [], []
    for r in rows:
        sim_extra = r["sim"].step_time - keep[r["model"]]["sim"].step_time
        meas_extra = r["meas"].step_time - keep[r["model"]]["meas"].step_time
        if sim_extra <= 0:
            continue
        if r["sim"].bytes_offloaded and r["sim"].recompute_time == 0:
            swap.append(meas_extra / sim_extra)
        elif r["sim"].recompute_time and not r["sim"].bytes_offloaded:
            rc.append(meas_extra / sim_extra)
    out = []
    for label, ratios in (("swap-only", swap), ("recompute-only", rc)):
        if ratios:
            out.append(f"{label} plans ({len(ratios)}): measured extra time over keep-all = "
                       f"{_common.median(ratios):.2f} x the extra the simulator predicts (median; range "
                       f"{min(ratios):.2f} to {max(ratios):.2f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="half the batch sizes and one random plan")
    ap.add_argument("--models", default=",".join(list(zoo.MODELS) + list(THIRD_PARTY)),
                    help="comma-separated zoo and third-party models (default: all)")
    ap.add_argument("--random", type=int, default=None, help="random mixed plans per zoo model (default 1, quick 0)")
    ap.add_argument("--timesteps", type=int, default=None, help="PPO timesteps of the searched plan (default 3000, "
                    "quick 0 = no searched plan)")
    ap.add_argument("--batch-scale", type=float, default=None, help="multiply the zoo's default batch sizes "
                    "(default 1, quick 0.5)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random plans")
    ap.add_argument("--retries", type=int, default=2, help="re-runs of a model whose run looks disturbed (default 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0 = torch's default)")
    ap.add_argument("--selective", action="store_true", help="profile with selective=True and add selective plans")
    args = ap.parse_args()
    _common.set_threads(args.threads)
    n_random = args.random if args.random is not None else (0 if args.quick else 1)
    timesteps = args.timesteps if args.timesteps is not None else (0 if args.quick else 3000)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    t_start = time.perf_counter()
    print(f"# simulator fidelity ({'quick' if args.quick else 'default'} mode) — {_common.environment_line()}")
    print(f"targets: peak within {PEAK_TOL:g} %, step time within {TIME_TOL:g} %; error = (sim - measured) / "
          "measured\n", flush=True)
    rows: list[dict[str, Any]] = []
    for i, name in enumerate(models):
        scale = args.batch_scale if args.batch_scale is not None else (0.5 if args.quick else 1.0)
        batch = max(1, round(default_batch(name) * scale))
        rows += run_model(name, batch, n_random, args.seed + i, args.retries, timesteps, args.selective)
    print()
    print(fidelity_table(rows))
    print()
    print("batch sizes: " + ", ".join(f"{m} {next(r['batch'] for r in rows if r['model'] == m)}" for m in models)
          + "; plans in brackets: K keep, R recompute, S<window><distance> swap; hf-gpt2 with use_cache=False")
    peak_miss = [r for r in rows if abs(r["peak_err"]) > PEAK_TOL]
    time_miss = [r for r in rows if abs(r["time_err"]) > TIME_TOL]
    misses = [r for r in rows if abs(r["peak_err"]) > PEAK_TOL or abs(r["time_err"]) > TIME_TOL]
    if misses:
        print("\n## breakdown of the misses\n")
        print(breakdown(rows, misses))
        print("\nsim copy ms = DeviceSpec.copy_seconds of what the plan offloads, both ways (bytes / measured memmove "
              "bandwidth + copy_overhead_s per storage); with copy_overlap only the per-storage part and the stalls "
              "add to the step; meas extra = measured plan step - measured keep-all step; waits = time the training "
              "thread blocked on the copy threads, summed over measure()'s 7 steps.")
    for line in extra_summary(rows):
        print(line)
    wp = max(rows, key=lambda r: abs(r["peak_err"]))
    wt = max(rows, key=lambda r: abs(r["time_err"]))
    short = lambda r: f"{r['model']} {r['plan'].split(' [')[0]}"  # noqa: E731
    retried = sorted({r["model"] for r in rows if r["attempt"] > 1})
    disturbed = sorted({r["model"] for r in rows if r["disturbed"]})
    print()
    print(f"re-run because a try looked disturbed: {', '.join(retried) or 'none'}; still disturbed after "
          f"{args.retries} re-runs: {', '.join(disturbed) or 'none'}")
    print(f"summary: {len(rows)} (model, plan) pairs; peak within {PEAK_TOL:g} %: {len(rows) - len(peak_miss)}/"
          f"{len(rows)} (worst {wp['peak_err']:+.2f} %, {short(wp)}); step time within {TIME_TOL:g} %: "
          f"{len(rows) - len(time_miss)}/{len(rows)} (worst {wt['time_err']:+.1f} %, {short(wt)}) — "
          f"{'ALL TARGETS MET' if not misses else 'TARGETS MISSED'} [{time.perf_counter() - t_start:.0f} s]")


if __name__ == "__main__":
    main()
