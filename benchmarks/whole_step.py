"""Whole-step plans: the floor, the bench against the baselines and "offload everything", max batch.

    PYTHONPATH=$PWD python benchmarks/whole_step.py --floor      # floors, floor plans measured
    PYTHONPATH=$PWD python benchmarks/whole_step.py --bench      # methods at 3 budgets, CPU + GPU presets
    PYTHONPATH=$PWD python benchmarks/whole_step.py --bench --step-in-backward   # the same, search + MILP may step in
                                                                                 # backward (the opt-in space)
    PYTHONPATH=$PWD python benchmarks/whole_step.py --max-batch  # max batch per method (simulated)
    PYTHONPATH=$PWD python benchmarks/whole_step.py --stream     # state streamed per parameter vs per unit

Models: the zoo's fixed-state-heavy models (``memopt.zoo.STATE_HEAVY`` at their default batch), zoo ``gpt`` and ``mlp``
(small configs), a transformers GPT-2 from a small config (random init), and ``resnet18-split`` (resnet18 with the
blocks of ``layers.3`` split into conv1/bn1/conv2/bn2/short units), ``timm-resnet18`` / ``timm-convnext_atto`` /
``timm-vit_tiny`` (``tests/real_timm.py`` at the sizes ``tests/test_timm_models.py`` checks), all with Adam. Timings
use one torch thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from _common import small_gpt2  # noqa: E402

import memopt_nb as memopt  # noqa: E402
from memopt_nb import solvers  # noqa: E402
from memopt_nb.planners.floor import explain_floor  # noqa: E402

MiB = 2**20
GPUS = ("a100-40gb", "h100-80gb")


def split_units(model: nn.Module) -> list[str]:
    """resnet18's units with the two blocks of ``layers.3`` split into their convolutions, norms and shortcut."""
    names = []
    for name, _ in model.named_modules():
        parts = name.split(".")
        if len(parts) == 2 and parts[0] == "layers" and parts[1] != "3":
            continue
        if len(parts) == 3 and parts[0] == "layers" and parts[1] != "3":
            names.append(name)
        elif len(parts) == 4 and name.startswith("layers.3.") and parts[3] in ("conv1", "bn1", "conv2", "bn2", "short"):
            mod = model.get_submodule(name)
            if any(True for _ in mod.parameters()):
                names.append(name)
    return names


def build(name: str):
    """(model, inputs, loss_fn, units) for a model name."""
    if name == "gpt2":
        return (*small_gpt2(), "auto")
    if name.startswith("timm-"):  # tests/real_timm.py, at the sizes tests/test_timm_models.py checks
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        import real_timm

        kind = name.removeprefix("timm-")
        size = {"resnet18": dict(batch=8, image=64), "convnext_atto": dict(batch=4, image=64),
                "vit_tiny": dict(batch=4, image=96)}[kind]
        return (*getattr(real_timm, kind)(**size), "auto")
    if name == "resnet18-split":
        z = memopt.zoo.build("resnet18")
        return z.model, z.inputs, z.loss_fn, split_units(z.model)
    if name == "gpt":
        z = memopt.zoo.gpt(batch_size=4, seq_len=64, d_model=64, n_layers=4, n_heads=2, vocab=128)
    elif name == "mlp":
        z = memopt.zoo.mlp(batch_size=64, width=256, depth=8)
    else:
        z = memopt.zoo.build(name)
    return z.model, z.inputs, z.loss_fn, "auto"


def setup(name: str):
    model, inputs, loss_fn, units = build(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units=units, repeats=1)
    return model, inputs, loss_fn, opt, prof


def mib(b: float) -> str:
    return f"{b / MiB:.2f}"


# ------------------------------------------------------------------ the floor
def floor_table(names: list[str]) -> None:
    print("| model | units | unoptimized peak MiB (measured) | activation-only floor | whole-step floor "
          "| + step in backward | floor plan predicted MiB | measured MiB | exact? |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        model, inputs, loss_fn, opt, prof = setup(name)
        plain = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=1).peak_bytes
        act = solvers.min_peak(prof, offload_state=False)
        whole = solvers.min_peak(prof, offload_state=True)
        sib = solvers.min_peak(prof, offload_state=True, step_in_backward=True)
        for in_bwd in (False, True):
            fl = explain_floor(prof, offload_state=True, step_in_backward=in_bwd)
            pred = memopt.simulate(prof, fl.plan).peak_bytes
            meas = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=fl.plan, steps=1).peak_bytes
            exact = "yes" if pred == meas else f"no ({(pred - meas) / meas:+.2%})"
            head = (f"| {name} | {prof.n_units} | {mib(plain)} (profile {mib(prof.peak_bytes)}) | "
                    f"{act / plain:.3f} | {whole / plain:.3f} | {sib / plain:.3f} |" if not in_bwd
                    else "| ↳ floor plan with step in backward | | | | | |")
            print(f"{head} {mib(pred)} | {mib(meas)} | {exact} |", flush=True)


# ------------------------------------------------------------------ the bench
def refused_or(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None where it refuses the budget (below the floor of its own space)."""
    try:
        return fn(*args, **kwargs)
    except memopt.BudgetError:
        return None


def methods(sim: memopt.Simulator, prof, budget: int, device, timesteps: int | None, time_limit: float,
            search: bool = True, step_in_backward: bool = False) -> dict:
    """Every method's plan at ``budget``; ``step_in_backward`` gives the search and the MILP the opt-in step in
    backward too (the baselines are the same either way: those that step in backward always do)."""
    out = {}
    if search:
        t0 = time.perf_counter()
        out["memopt-ppo"] = memopt.search(prof, budget, device, total_timesteps=timesteps, seed=0, offload_state=True,
                                          step_in_backward=step_in_backward)
        out["memopt-ppo"].meta["wall_s"] = time.perf_counter() - t0
    out["optimal"] = solvers.optimal(sim, budget, time_limit=time_limit, offload_state=True,
                                     step_in_backward=step_in_backward)
    for n, fn in solvers.CLASSIC_BASELINES.items():
        out[f"{n}"] = refused_or(fn, sim, budget)
        out[f"{n}+state"] = refused_or(fn, sim, budget, offload_state=True)
    for n, fn in solvers.STATE_BASELINES.items():
        out[n] = refused_or(fn, sim, budget)
    out["offload_everything"] = solvers.offload_everything(sim, budget)
    return out


def bench(names: list[str], fractions: tuple[float, ...], timesteps: int | None, time_limit: float,
          measure: bool, step_in_backward: bool = False) -> None:
    summary = []
    print("| model | device | budget MiB (frac) | method | feasible | predicted step ms | predicted peak MiB "
          "| measured step ms | measured peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        model, inputs, loss_fn, opt, prof = setup(name)
        for device in (None, *GPUS):
            sim = memopt.Simulator(prof, device)
            lo = solvers.min_peak(sim, offload_state=True)
            for frac in fractions:
                budget = int(lo + frac * (prof.peak_bytes - lo))
                res = methods(sim, prof, budget, device, timesteps, time_limit, step_in_backward=step_in_backward)
                meas = {}
                if measure and device is None:
                    for key in ("memopt-ppo", "offload_everything"):
                        p = res[key]
                        m = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=p, steps=3)
                        meas[key] = m
                for key, p in res.items():
                    if p is None:
                        print(f"| {name} | {sim.device.name} | {mib(budget)} ({frac:.0%}) | {key} | refused (budget "
                              f"below its floor) | | | | |")
                        continue
                    m = meas.get(key)
                    ms = f"{m.step_time * 1e3:.2f}" if m else ""
                    mp = f"{mib(m.peak_bytes)}{' (over budget)' if m.peak_bytes > budget else ''}" if m else ""
                    print(f"| {name} | {sim.device.name} | {mib(budget)} ({frac:.0%}) | {key} | "
                          f"{'yes' if p.feasible else 'NO'} | {p.predicted_step_time * 1e3:.3f} | "
                          f"{mib(p.predicted_peak_bytes)} | {ms} | {mp} |", flush=True)
                base = [(k, p) for k, p in res.items() if p is not None and p.feasible
                        and k not in ("memopt-ppo", "optimal", "offload_everything")]
                best_k, best = min(base, key=lambda kp: kp[1].predicted_step_time) if base else ("—", None)
                ppo, oe = res["memopt-ppo"], res["offload_everything"]
                row = {"model": name, "device": sim.device.name, "frac": frac, "best": best_k,
                       "ppo_vs_best": (best.predicted_step_time / ppo.predicted_step_time) if best else math.nan,
                       "ppo_vs_opt": res["optimal"].predicted_step_time / ppo.predicted_step_time,
                       "ppo_vs_oe": (oe.predicted_step_time / ppo.predicted_step_time) if oe.feasible else math.nan,
                       "search_s": ppo.meta["wall_s"], "ppo_feasible": ppo.feasible, "oe_feasible": oe.feasible}
                if "memopt-ppo" in meas:
                    row["meas_ppo_vs_oe"] = meas["offload_everything"].step_time / meas["memopt-ppo"].step_time
                    row["meas_peak_ok"] = meas["memopt-ppo"].peak_bytes <= budget
                summary.append(row)
    print()
    print("| model | device | budget frac | best baseline | plan ÷ best baseline (throughput) | plan ÷ optimal "
          "| plan ÷ offload everything (simulated) | (measured, CPU) | measured peak ≤ budget | search s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        mo = f"{r['meas_ppo_vs_oe']:.3f}" if "meas_ppo_vs_oe" in r else ""
        ok = ("yes" if r["meas_peak_ok"] else "NO") if "meas_peak_ok" in r else ""
        print(f"| {r['model']} | {r['device']} | {r['frac']:.0%} | {r['best']} | {r['ppo_vs_best']:.3f} | "
              f"{r['ppo_vs_opt']:.3f} | {r['ppo_vs_oe']:.3f} | {mo} | {ok} | {r['search_s']:.1f} |")
    gpu = [r["ppo_vs_oe"] for r in summary if r["device"] in GPUS and not math.isnan(r["ppo_vs_oe"])]
    vb = [r["ppo_vs_best"] for r in summary if not math.isnan(r["ppo_vs_best"])]
    print()
    print(f"plan ÷ best baseline throughput: min {min(vb):.3f}, median {statistics.median(vb):.3f} (goal ≥ 1.0 "
          f"everywhere; below 1 in {sum(v < 1 - 1e-9 for v in vb)} of {len(vb)})")
    if gpu:
        print(f"plan ÷ offload-everything on GPU presets (simulated): min {min(gpu):.3f}, median "
              f"{statistics.median(gpu):.3f} (goal ≥ 1.3; below in {sum(v < 1.3 for v in gpu)} of {len(gpu)})")


# ------------------------------------------------------------------ state streamed per parameter
def without_streaming(prof):
    """``prof`` as a profile without per-parameter steps: no unit may stream (``UnitProfile.param_steps``)."""
    units = [dataclasses.replace(u, param_steps=[]) for u in prof.units]
    return dataclasses.replace(prof, units=units)


def stream_table(names: list[str], time_limit: float) -> None:
    """Per model, side by side: the whole-step floor and the exact plan at a budget with units moving their optimizer
    state whole only, and with streaming too; the streamed floor plan and a plan only streaming reaches, measured."""
    print("| model | units | params per unit (max) | floor ÷ peak, whole units | streamed | + step in backward, whole "
          "| streamed | floor plan: streamed units | predicted MiB | measured MiB | between the floors: MILP ms "
          "(measured peak ≤ budget) | at 50 %: MILP ms whole → streamed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        model, inputs, loss_fn, opt, prof = setup(name)
        whole = without_streaming(prof)
        peak = prof.peak_bytes
        f = {}
        for sib in (False, True):
            f[sib] = (solvers.min_peak(whole, offload_state=True, step_in_backward=sib),
                      solvers.min_peak(prof, offload_state=True, step_in_backward=sib))
        fl = explain_floor(prof, offload_state=True)
        pred = memopt.simulate(prof, fl.plan).peak_bytes
        meas = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=fl.plan, steps=1).peak_bytes
        streamed = sum(d.optimizer == "stream" for d in fl.plan.decisions)
        between = ""
        if f[False][1] < f[False][0]:
            budget = (f[False][0] + f[False][1]) // 2
            p = solvers.optimal(prof, budget, time_limit=time_limit, offload_state=True)
            m = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=p, steps=1).peak_bytes
            between = f"{p.predicted_step_time * 1e3:.2f} ({'yes' if m <= budget else 'NO'})"
        half = peak // 2
        at = []
        for q in (whole, prof):
            p = refused_or(solvers.optimal, q, half, time_limit=time_limit, offload_state=True)
            at.append(f"{p.predicted_step_time * 1e3:.2f}" if p is not None and p.feasible else "no plan")
        most = max(len(u.param_steps) for u in prof.units)
        print(f"| {name} | {prof.n_units} | {most} | {f[False][0] / peak:.3f} | {f[False][1] / peak:.3f} | "
              f"{f[True][0] / peak:.3f} | {f[True][1] / peak:.3f} | {streamed} | {mib(pred)} | {mib(meas)} | "
              f"{between or '–'} | {at[0]} → {at[1]} |", flush=True)


# ------------------------------------------------------------------ max batch
def max_batch(names: list[str], batches: tuple[int, ...], timesteps: int | None, time_limit: float) -> None:
    """Budget = the unoptimized peak at the first batch; per method the largest batch whose plan fits it, and the
    simulated throughput (samples/s) there, on the CPU and the GPU presets. The plan column is the exact optimum
    (MILP over the enlarged space); PPO is left out here to keep the run short (the bench compares it with the
    optimum)."""
    print("| model | device | budget MiB | method | max batch | samples/s at max batch (simulated) |")
    print("|---|---|---|---|---|---|")
    for name in names:
        profs = {}
        for b in batches:
            zm = memopt.zoo.build(name, batch_size=b)
            opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
            profs[b] = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
        budget = profs[batches[0]].peak_bytes
        for device in (None, *GPUS):
            best: dict[str, tuple[int, float]] = {}
            for b in batches:
                sim = memopt.Simulator(profs[b], device)
                try:
                    lo = solvers.min_peak(sim, offload_state=True)
                except memopt.MemoptError:
                    lo = math.inf
                if lo > budget:
                    continue
                res = methods(sim, profs[b], budget, device, timesteps, time_limit, search=False)
                for k, p in res.items():
                    if p is not None and p.feasible:
                        best[k] = (b, b / p.predicted_step_time)
            for k in ["optimal", *[f"{n}{s}" for n in solvers.CLASSIC_BASELINES for s in ("", "+state")],
                      *solvers.STATE_BASELINES, "offload_everything"]:
                mb, tp = best.get(k, (None, math.nan))
                print(f"| {name} | {memopt.Simulator(profs[batches[0]], device).device.name} | {mib(budget)} | {k} | "
                      f"{mb if mb else f'< {batches[0]}'} | {tp:,.1f} |", flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floor", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--max-batch", action="store_true")
    ap.add_argument("--stream", action="store_true", help="optimizer state streamed per parameter vs moved per unit")
    ap.add_argument("--models", default=None, help="comma-separated (default per part)")
    ap.add_argument("--timesteps", type=int, default=None, help="PPO timesteps per search (default: memopt's own, "
                    "memopt_nb.planners.rl.search.default_timesteps)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="MILP time limit (s)")
    ap.add_argument("--fractions", default="0.1,0.4,0.7", help="budgets, from the whole-step floor (0) to the "
                    "unoptimized peak (1)")
    ap.add_argument("--batches", default="4,8,16,32")
    ap.add_argument("--no-measure", action="store_true")
    ap.add_argument("--step-in-backward", action="store_true", help="--bench: the search and the MILP may also step "
                    "in backward (opt-in), the space of the step-in-backward baselines")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} torch thread(s)")
    if args.floor:
        floor_table((args.models or "resnet18,resnet18-split,vit_tiny,convnext_atto,gpt,mlp,gpt2").split(","))
    if args.bench:
        bench((args.models or "resnet18,vit_tiny,convnext_atto,gpt,mlp").split(","),
              tuple(float(x) for x in args.fractions.split(",")), args.timesteps, args.time_limit,
              not args.no_measure, step_in_backward=args.step_in_backward)
    if args.stream:
        stream_table((args.models or "resnet18,convnext_atto,vit_tiny,gpt,gpt2").split(","), args.time_limit)
    if args.max_batch:
        max_batch((args.models or ",".join(memopt.zoo.STATE_HEAVY)).split(","),
                  tuple(int(x) for x in args.batches.split(",")), args.timesteps, args.time_limit)


if __name__ == "__main__":
    main(sys.argv[1:])
