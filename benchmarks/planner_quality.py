"""Planner quality: the dual-agent PPO search against the exact optimum and the best baseline.

Suite: every zoo model (profiled here, on the CPU) and synthetic chains of 12, 24, 48 and 64 units, each on the
profiled device and on two GPU presets, at budgets 40%, 55%, 70% and 85% of the way from the minimum feasible peak to
the unoptimized peak. Per case: the agents' plan alone and polished, divided by the exact optimum's step time (MILP;
where it hit its time limit the incumbent is used and its proven lower bound is shown), divided by the best feasible
baseline's, feasibility and search wall time.

    python benchmarks/planner_quality.py            # full suite (about an hour on 2 cores)
    python benchmarks/planner_quality.py --quick    # a few cases
    python benchmarks/planner_quality.py --whole-step  # over the enlarged space (state placements)
    python benchmarks/planner_quality.py --wide        # over every activation strategy
    python benchmarks/planner_quality.py --depth       # 48 to 384 units: the agents, the search and the MILP at depth

``--whole-step``: the same comparison over the enlarged space (``offload_state=True``: per unit also where its
optimizer state, gradients and parameters live) on cases that have state: the fixed-state-heavy zoo models with Adam
and synthetic chains whose units have parameters, gradients and Adam-like state (``chain_profile(state_bytes=...)``),
at budgets between the whole-step floor and the unoptimized peak. Next to the agents: uniform random sampling over the
same space given 4x the plan evaluations the agents made (best feasible plan found). ``--whole-step
--step-in-backward`` widens that space by the opt-in step in backward (gradients ``"step"``) for all three.

``--wide``: the same comparison over the wider activation space (``strategies=STRATEGIES``: keep,
recompute, swap, recompute_offload with its timings, selective with each Pareto save-set), activations only
(``offload_state=False``), on synthetic chains with synthetic save-sets
(:func:`memopt_nb.harness.synthetic.with_save_sets`),
at budgets between that space's floor and the unoptimized peak; ``--wide --offload-state`` adds state placements too
(the chains then have parameters, gradients and Adam-like state). ``--wide --hf vit`` (or ``gpt2``) adds a model this
project did not write: the transformers model of ``benchmarks/fine_units.py`` (ViT-Tiny at batch 32, GPT-2 6×192 at
batch 8 × 128), profiled here with ``units="fine"`` and ``selective=True`` (measured save-sets), SGD, on the CPU
(the emulated device it was profiled on) and the A100 preset.

``--depth``: how the planners scale with the number of units: synthetic chains of ``--sizes`` units (default 48, 96,
192, 384) and, with ``--hf gpt2-24,gpt2-48``, transformers GPT-2s of 24 and 48 layers (n_embd 128, batch 8 x 128)
profiled with ``units="fine"`` (7 units per layer); activations only (``--offload-state`` adds state placements) at
25 % and 60 % of the way from the floor. Per case: the agents alone, the search's plan and random sampling with 4x the
agents' evaluations, each divided by the MILP's plan after ``--time-limit`` seconds (its incumbent where it proves
nothing), with the search's and the MILP's seconds.

``--depth-gpt2``: the GPT-2 of ``--layers`` layers (default 24) at the budget halfway between its fine and block
floors: the search against the MILP, then two steps trained under the search's plan (see :func:`depth_gpt2`).

``--depth-default``: the search as a user runs it at depth: the same GPT-2 with Adam, ``units="fine"``,
``memopt.search(prof, "50%", seed=0)`` with every default (state placements in the space); its seconds, where its
polish spent them, and its plan (:func:`depth_default`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import memopt_nb as memopt  # noqa: E402
from memopt_nb import solvers  # noqa: E402
from memopt_nb.core.plan import DEFAULT_STRATEGIES, STRATEGIES  # noqa: E402
from memopt_nb.core.space import PlanSpace
from memopt_nb.harness.synthetic import chain_profile, with_save_sets  # noqa: E402
from memopt_nb.planners.options import evaluate_arrays, unit_options, unit_states  # noqa: E402

FRACTIONS = (0.40, 0.55, 0.70, 0.85)


def zoo_profile(name: str, repeats: int = 3):
    zm = memopt.zoo.build(name)
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    return memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=repeats)


def random_sampling(sim, budget: int, evaluations: int, seed: int = 0, batch: int = 4096, *,
                    offload_state=True, strategies=DEFAULT_STRATEGIES, step_in_backward: bool = False
                    ) -> tuple[float, float]:
    """Best feasible step time of ``evaluations`` uniform random plans over the same space as the search (every
    activation option of ``strategies`` and every offered placement per unit), and the feasible fraction."""
    rng = np.random.default_rng(seed)
    opts = [np.array(unit_options(sim, u, strategies)) for u in range(sim.n)]
    sts = [np.array(x) for x in unit_states(
        sim, PlanSpace.of(offload_state=offload_state, step_in_backward=step_in_backward))]
    best, feasible, done = math.inf, 0, 0
    while done < evaluations:
        b = min(batch, evaluations - done)
        pick = [o[rng.integers(0, len(o), b)] for o in opts]
        c = np.stack([p[:, 0] for p in pick], axis=1)
        w = np.stack([p[:, 1] for p in pick], axis=1)
        d = np.stack([p[:, 2] for p in pick], axis=1)
        st = np.stack([x[rng.integers(0, len(x), b)] for x in sts], axis=1)
        peak, tm = evaluate_arrays(sim, c, w, d, st)
        ok = peak <= budget
        feasible += int(ok.sum())
        if ok.any():
            best = min(best, float(tm[ok].min()))
        done += b
    return best, feasible / max(done, 1)


def run_whole_step_case(label: str, prof, device, frac: float, time_limit: float, timesteps: int | None, *,
                        offload_state=True, strategies=DEFAULT_STRATEGIES, step_in_backward: bool = False,
                        order: str = "state") -> dict:
    space = {"offload_state": offload_state, "strategies": strategies}
    if step_in_backward:
        space["step_in_backward"] = True
    sim = memopt.Simulator(prof, device)
    lo = solvers.min_peak(sim, **space)
    budget = int(lo + frac * (prof.peak_bytes - lo))
    t0 = time.perf_counter()
    try:
        opt = solvers.optimal(sim, budget, time_limit=time_limit, **space)
    except memopt.BudgetError:  # no plan within the time limit (hundreds of units): ratios are then ÷ the search's
        opt = None
    opt_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = memopt.search(prof, budget, device, total_timesteps=timesteps, seed=0, order=order, **space)
    search_s = time.perf_counter() - t0
    agents = plan.meta["agents_step_time"] or math.inf
    ref = opt.predicted_step_time if opt is not None else plan.predicted_step_time
    evals = 4 * 2 * max(1, int(plan.meta["timesteps_run"]) // sim.n)  # an episode evaluates its plan and its defaults
    rand, rand_ok = random_sampling(sim, budget, evals, **space)
    gap = opt.meta.get("mip_gap") if opt is not None else None
    return {
        "case": label, "device": sim.device.name, "budget": frac, "units": prof.n_units,
        "agents_vs_opt": agents / ref, "polished_vs_opt": plan.predicted_step_time / ref,
        "random_vs_opt": rand / ref, "random_feasible": rand_ok, "evals": evals, "feasible": bool(plan.feasible),
        "search_s": search_s, "opt_s": opt_s, "proven": opt is not None and bool(opt.meta["proven_optimal"]),
        "gap": float(gap) if gap is not None else math.nan, "milp_plan": opt is not None,
    }


def whole_step(time_limit: float, timesteps: int | None, quick: bool, chains: tuple[int, ...] = (24, 48, 64),
               zoo_devices: tuple[str | None, ...] = (None, "a100-40gb"), wide: bool = False,
               offload_state: bool = True, hf: tuple[str, ...] = (), step_in_backward: bool = False,
               order: str = "state") -> None:
    real: set[str] = set()
    if wide:  # every activation strategy, on chains with save-sets (and transformers models, measured)
        space = {"offload_state": offload_state, "strategies": STRATEGIES}
        cases = [(f"chain{n}+sel" + ("+state" if offload_state else ""),
                  with_save_sets(chain_profile(n, seed=n, state_bytes=16 * 2**20 if offload_state else 0), seed=n))
                 for n in ((12, 24) if quick else chains)]
        for name in hf:
            from fine_units import build, optimizer_for

            model, kw, loss_fn = build(name)
            prof = memopt.profile(model, loss_fn=loss_fn, optimizer=optimizer_for(model, adam=offload_state),
                                  units="fine", repeats=3, selective=True, **kw)
            cases.append((f"hf-{name} fine", prof))
            real.add(f"hf-{name} fine")
    else:
        space = {"offload_state": True, "strategies": DEFAULT_STRATEGIES, "step_in_backward": step_in_backward}
        cases = [(name, zoo_profile(name, repeats=1)) for name in memopt.zoo.STATE_HEAVY]
        chains = (12, 24) if quick else chains
        cases += [(f"chain{n}+state", chain_profile(n, seed=n, state_bytes=16 * 2**20)) for n in chains]
    fractions = (0.25, 0.6)
    rows = []
    print("| case | device | budget | units | agents ÷ opt | polished ÷ opt | random (4x evals) ÷ opt "
          "| random feasible | feasible | search s | MILP s | MILP proven (gap) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, prof in cases:
        devices = ("a100-40gb",) if label.startswith("chain") else (None, "a100-40gb") if label in real else zoo_devices
        for device in devices:
            for frac in fractions:
                r = run_whole_step_case(label, prof, device, frac, time_limit, timesteps, order=order, **space)
                rows.append(r)
                proven = "yes" if r["proven"] else f"no (gap {r['gap']:.2%})"
                print(f"| {r['case']} | {r['device']} | {r['budget']:.0%} | {r['units']} | {r['agents_vs_opt']:.4f} | "
                      f"{r['polished_vs_opt']:.4f} | {r['random_vs_opt']:.4f} | {r['random_feasible']:.1%} | "
                      f"{'yes' if r['feasible'] else 'NO'} | {r['search_s']:.1f} | {r['opt_s']:.1f} | {proven} |",
                      flush=True)
    a = [r["agents_vs_opt"] for r in rows]
    p = [r["polished_vs_opt"] for r in rows]
    rd = [r["random_vs_opt"] for r in rows]
    s48 = [r["search_s"] for r in rows if r["units"] >= 48]
    print()
    print(f"cases {len(rows)}; feasible {sum(r['feasible'] for r in rows)}/{len(rows)}")
    print(f"agents ÷ optimum: median {statistics.median(a):.4f} (target ≤ 1.02), worst {max(a):.4f} (target ≤ 1.05)")
    print(f"polished ÷ optimum: median {statistics.median(p):.4f}, worst {max(p):.4f}")
    print(f"random sampling (4x evaluations) ÷ optimum: median {statistics.median(rd):.4f}, worst {max(rd):.4f}")
    if s48:
        print(f"search time at ≥ 48 units: median {statistics.median(s48):.1f} s, max {max(s48):.1f} s "
              f"(target ≤ 60 s at 48)")
    print(f"MILP proven optimal in {sum(r['proven'] for r in rows)}/{len(rows)} cases (ratios use the incumbent "
          f"otherwise)")


def feasible_baselines(sim, budget: int) -> list:
    """The plans of the classic baselines that fit ``budget`` (those outside the profile's space, e.g. selective
    without save-sets, left out)."""
    out = []
    for fn in solvers.BASELINES.values():
        try:
            plan = fn(sim, budget)
        except memopt.MemoptError:
            continue
        if plan.feasible:
            out.append(plan)
    return out


def gpt2_fine(layers: int = 24):
    """The deep GPT-2 of ``--depth`` (random init, no download), profiled with ``units="fine"``."""
    model, inputs, loss_fn, opt = gpt2_deep(layers)
    return memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)


def gpt2_deep(layers: int = 24):
    """The deep GPT-2 of ``--depth`` (random init, no download): model, batch, loss and SGD, the same each call."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=128, n_head=4, n_positions=128, vocab_size=1000)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 1000, (8, 128))
    return model, {"input_ids": ids, "labels": ids}, (lambda o: o.loss), torch.optim.SGD(model.parameters(), lr=1e-3)


def depth_default(layers: int = 24) -> None:
    """``--depth-default``: the default search (state placements included) on the deep GPT-2 with Adam."""
    model, inputs, loss_fn, _ = gpt2_deep(layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    prof = memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    print(f"profile: {prof.n_units} units in {time.perf_counter() - t0:.1f} s", flush=True)
    t0 = time.perf_counter()
    plan = memopt.search(prof, "50%", seed=0)
    m, took = plan.meta, time.perf_counter() - t0
    print(f"| layers | units | search s | heuristic polish s | starts polished | skipped | plan ms | no plan ms |\n"
          f"|---|---|---|---|---|---|---|---|\n"
          f"| {layers} | {prof.n_units} | {took:.1f} | {m.get('polish_heuristic_seconds', 0):.1f} | "
          f"{', '.join(m.get('polish_heuristic_starts', []))} | {', '.join(m.get('polish_heuristic_skipped', []))} | "
          f"{plan.predicted_step_time * 1e3:.2f} | {prof.step_time * 1e3:.2f} |")
    print(plan.summary())


def depth_gpt2(time_limit: float, timesteps: int | None, layers: int = 24) -> None:
    """``--depth-gpt2``: the GPT-2 of ``layers`` layers with ``units="fine"`` at the budget halfway between its
    activation-only fine floor (every activation strategy the profile allows) and its block floor (``units="auto"``,
    keep / recompute / swap): the search's plan and seconds against the MILP's plan after ``time_limit`` s, then two
    training steps under the search's plan inside ``limit_memory(budget)``, compared bit for bit with two steps
    without a plan."""
    strategies = tuple(s for s in STRATEGIES if s != "selective")
    model, inputs, loss_fn, opt = gpt2_deep(layers)
    t0 = time.perf_counter()
    fine = memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units="fine", repeats=1)
    fine_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    block = memopt.profile(model, **inputs, loss_fn=loss_fn, optimizer=opt, units="auto", repeats=1)
    block_s = time.perf_counter() - t0
    lo = solvers.min_peak(fine, None, strategies, offload_state=False)
    hi = solvers.min_peak(block, None, DEFAULT_STRATEGIES, offload_state=False)
    budget = (lo + hi) // 2
    print(f"units: fine {fine.n_units} (profiled in {fine_s:.1f} s), auto {block.n_units} ({block_s:.1f} s)")
    print(f"floors: fine {lo / 2**20:.2f} MiB, block {hi / 2**20:.2f} MiB; budget {budget / 2**20:.2f} MiB")
    t0 = time.perf_counter()
    plan = memopt.search(fine, budget, strategies=strategies, offload_state=False, total_timesteps=timesteps, seed=0)
    search_s = time.perf_counter() - t0
    sim = memopt.Simulator(fine)
    base = feasible_baselines(sim, budget)
    best = min(base, key=lambda b: b.predicted_step_time, default=None)
    print(f"no plan: {fine.step_time * 1e3:.1f} ms, {fine.peak_bytes / 2**20:.2f} MiB; best baseline within the "
          "budget: " + (f"{best.method} {best.predicted_step_time * 1e3:.1f} ms" if best else "none"))
    print("| plan | simulated step | peak | seconds | note |")
    print("|---|---|---|---|---|")
    agents = plan.meta.get("agents_step_time")
    print(f"| search | {plan.predicted_step_time * 1e3:.1f} ms | {plan.predicted_peak_bytes / 2**20:.2f} MiB | "
          f"{search_s:.1f} | agents alone {'no plan within the budget' if agents is None else f'{agents * 1e3:.1f} ms'}"
          f"; stopped: {plan.meta.get('stopped')}; polish from {plan.meta.get('polish_start')} |", flush=True)
    t0 = time.perf_counter()
    try:
        opt_plan = solvers.optimal(fine, budget, strategies=strategies, offload_state=False, time_limit=time_limit)
    except memopt.BudgetError as e:  # no incumbent within the time limit
        print(f"| MILP | – | – | {time.perf_counter() - t0:.1f} | no plan: {e} |")
    else:
        gap = opt_plan.meta.get("mip_gap")
        print(f"| MILP | {opt_plan.predicted_step_time * 1e3:.1f} ms | {opt_plan.predicted_peak_bytes / 2**20:.2f} MiB "
              f"| {time.perf_counter() - t0:.1f} | proven {bool(opt_plan.meta.get('proven_optimal'))}"
              f"{'' if gap is None else f', gap {gap:.2%}'} |")
        print(f"search ÷ MILP: {plan.predicted_step_time / opt_plan.predicted_step_time:.4f}")

    def train(m, o, steps=2):
        losses = []
        for _ in range(steps):
            loss = loss_fn(m(**inputs))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        return losses

    torch.manual_seed(1)
    with memopt.plan(plan), memopt.limit_memory(budget) as lim:
        got = train(model, opt)
    measured = lim.peak_bytes
    ref_model, _, _, ref_opt = gpt2_deep(layers)
    torch.manual_seed(1)
    want = train(ref_model, ref_opt)
    same = got == want and all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(),
                                                                   strict=True))
    print(f"2 steps under the plan: losses and parameters bit-identical: {same}; measured peak "
          f"{measured / 2**20:.2f} MiB (predicted {plan.predicted_peak_bytes / 2**20:.2f}, budget "
          f"{budget / 2**20:.2f})")


def depth(time_limit: float, timesteps: int | None, sizes: tuple[int, ...], hf: tuple[str, ...],
          offload_state: bool) -> None:
    cases = [(f"chain{n}" + ("+state" if offload_state else ""),
              chain_profile(n, seed=n, state_bytes=16 * 2**20 if offload_state else 0)) for n in sizes]
    for name in hf:  # gpt2-24, gpt2-48: GPT-2 with that many layers
        cases.append((f"hf-{name} fine", gpt2_fine(int(name.removeprefix("gpt2-")))))
    space = {"offload_state": offload_state, "strategies": DEFAULT_STRATEGIES}
    print("| case | units | budget | agents ÷ MILP | search ÷ MILP | random (4x evals) ÷ MILP | search s | MILP s "
          "| MILP proven (gap) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, prof in cases:
        device = "a100-40gb" if label.startswith("chain") else None
        for frac in (0.25, 0.6):
            r = run_whole_step_case(label, prof, device, frac, time_limit, timesteps, **space)
            proven = ("yes" if r["proven"] else f"no (gap {r['gap']:.2%})" if r["milp_plan"] else
                      f"no plan in {time_limit:.0f} s (ratios ÷ the search's plan)")
            print(f"| {r['case']} | {r['units']} | {r['budget']:.0%} | {r['agents_vs_opt']:.4f} | "
                  f"{r['polished_vs_opt']:.4f} | {r['random_vs_opt']:.4f} | {r['search_s']:.1f} | {r['opt_s']:.1f} "
                  f"| {proven} |", flush=True)


def run_case(label: str, prof, device, frac: float, time_limit: float, timesteps: int | None) -> dict:
    sim = memopt.Simulator(prof, device)
    lo = solvers.min_peak(sim)
    budget = int(lo + frac * (prof.peak_bytes - lo))
    t0 = time.perf_counter()
    opt = solvers.optimal(sim, budget, time_limit=time_limit)
    opt_s = time.perf_counter() - t0
    feasible = feasible_baselines(sim, budget)
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
    ap.add_argument("--whole-step", action="store_true", help="over the enlarged space (state placements), cases "
                    "with state")
    ap.add_argument("--wide", action="store_true", help="over every activation strategy, chains with "
                    "save-sets")
    ap.add_argument("--step-in-backward", action="store_true", help="--whole-step: the opt-in step in backward too "
                    "(search, MILP and random sampling)")
    ap.add_argument("--offload-state", action="store_true", help="--wide: with state placements too")
    ap.add_argument("--order", default="state", choices=("state", "forward"), help="--whole-step / --wide: the "
                    "order the agents decide the units in (memopt.search's order=)")
    ap.add_argument("--hf", default="", help="--wide: transformers models too, e.g. vit,gpt2 (fine units, measured "
                    "save-sets)")
    ap.add_argument("--chains", default="24,48,64", help="--whole-step / --wide: synthetic chain sizes")
    ap.add_argument("--zoo-devices", default="cpu,a100-40gb", help="--whole-step: devices for the zoo cases "
                    "(cpu: the profiled one)")
    ap.add_argument("--depth", action="store_true", help="48 to 384 units: agents, search, MILP and random sampling")
    ap.add_argument("--sizes", default="48,96,192,384", help="--depth: synthetic chain sizes")
    ap.add_argument("--depth-gpt2", action="store_true", help="the 24-layer GPT-2 with fine units halfway between "
                    "its fine and block floors: search vs MILP, then 2 steps trained under the plan")
    ap.add_argument("--layers", type=int, default=24, help="--depth-gpt2: GPT-2's layers")
    ap.add_argument("--depth-default", action="store_true", help="the default search (state placements too) on the "
                    "GPT-2 of --layers layers with Adam and fine units, at 50 %%: its seconds and plan")
    args = ap.parse_args()
    if args.depth_default:
        torch.set_num_threads(1)
        depth_default(args.layers)
        return
    if args.depth_gpt2:
        torch.set_num_threads(1)
        depth_gpt2(args.time_limit, args.timesteps, args.layers)
        return
    if args.depth:
        torch.set_num_threads(1)
        depth(args.time_limit, args.timesteps, tuple(int(x) for x in args.sizes.split(",") if x),
              tuple(x for x in args.hf.split(",") if x), args.offload_state)
        return
    if args.whole_step or args.wide:
        torch.set_num_threads(1)
        whole_step(args.time_limit, args.timesteps, args.quick, tuple(int(x) for x in args.chains.split(",") if x),
                   tuple(None if d == "cpu" else d for d in args.zoo_devices.split(",")), wide=args.wide,
                   offload_state=args.offload_state, hf=tuple(x for x in args.hf.split(",") if x),
                   step_in_backward=args.step_in_backward, order=args.order)
        return
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
