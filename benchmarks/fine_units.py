"""The wider activation space: finer units (``units="fine"``) and ``recompute_offload``, against the old
space (blocks as units; keep / recompute / swap): floor, a plan below the old floor trained, throughput, max batch.

Models this project did not write, built from configs (random init, no download): Hugging Face GPT-2 with 6 layers of
width 192 at batch 8 x 128 tokens, and Hugging Face ViT-Tiny (12 layers of width 192, 224 px, patch 16) at batch 32 —
the configurations benchmarks/RESULTS.md reports. Plain SGD (no optimizer state) unless ``--adam``.

    python benchmarks/fine_units.py                # all sections, about 5 minutes on 2 CPU cores
    python benchmarks/fine_units.py --floor --train
    python benchmarks/fine_units.py --timm-vit 32,64,96   # timm's ViT-Tiny: fine vs block floor per batch

Sections:
Spaces: ``old`` = blocks (``units="auto"``) with keep / recompute / swap; ``fine`` = ``units="fine"`` with the same
strategies; ``blocks+ro`` and ``fine+ro`` = each with ``recompute_offload`` too; ``blocks+sel`` = blocks with
``selective`` too (the profiles are made with ``selective=True``); ``blocks+all`` and ``fine+all`` = every strategy
(``strategies=STRATEGIES``).

* ``--floor``: the activation-only floor (the smallest peak any plan of the space reaches, exact MILP) and what
  bounds it.
* ``--train``: the fastest ``fine+ro`` plan (MILP) at 0.95x the old floor trains bit-identically to no plan (2 SGD
  steps, dropout on) and its measured peak (the emulated CPU device) is within budget.
* ``--bench``: simulated step time of the fastest plan (MILP) of each space against the best baseline (recompute-all,
  sqrt(n), swap-all, Capuchin, selective layer, recompute_offload_all, torchtitan's op-level SAC) on blocks, at
  budgets from the old floor up, on the profiled CPU and an A100-40GB preset.
* ``--max-batch``: per model, the largest batch whose plan fits the memory plain training needs at its base batch
  (8 for both), for the best baseline on blocks and for the floors of the old and new spaces.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import memopt_nb as memopt  # noqa: E402
from memopt_nb import solvers  # noqa: E402
from memopt_nb.core.plan import DEFAULT_STRATEGIES, STRATEGIES  # noqa: E402
from memopt_nb.planners.floor import explain_floor  # noqa: E402

BASELINES = ("recompute_all", "sqrt_n", "swap_all", "capuchin", "selective_layer", "recompute_offload_all", "op_sac")
DEVICES = (None, "a100-40gb")
FRACTIONS = (0.0, 0.25, 0.5)
RO = (*DEFAULT_STRATEGIES, "recompute_offload")
SEL = (*DEFAULT_STRATEGIES, "selective")
#: space -> (units, strategies)
SPACES = {"old": ("auto", DEFAULT_STRATEGIES), "fine": ("fine", DEFAULT_STRATEGIES),
          "blocks+ro": ("auto", RO), "fine+ro": ("fine", RO), "blocks+sel": ("auto", SEL),
          "blocks+all": ("auto", STRATEGIES), "fine+all": ("fine", STRATEGIES)}


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def build(name: str, batch: int | None = None):
    """(model, keyword inputs, loss_fn) for ``gpt2`` or ``vit``; random init from a seeded config."""
    import transformers

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=6, n_embd=192, n_head=3, vocab_size=1024, bos_token_id=0,
                                      eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg).train()
        ids = torch.randint(0, 1024, (batch or 8, 128), generator=gen)
        return model, {"input_ids": ids, "labels": ids}, (lambda out: out.loss)
    cfg = transformers.ViTConfig(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768,
                                 image_size=224, patch_size=16, num_labels=10)
    model = transformers.ViTForImageClassification(cfg).train()
    b = batch or 32
    return model, {"pixel_values": torch.randn(b, 3, 224, 224, generator=gen),
                   "labels": torch.randint(0, 10, (b,), generator=gen)}, (lambda out: out.loss)


def optimizer_for(model, adam: bool):
    return torch.optim.AdamW(model.parameters(), lr=1e-4) if adam else torch.optim.SGD(model.parameters(), lr=1e-3)


def profiles(name: str, adam: bool, batch: int | None = None, selective: bool = True):
    model, kw, loss_fn = build(name, batch)
    opt = optimizer_for(model, adam)
    out = {units: memopt.profile(model, loss_fn=loss_fn, optimizer=opt, units=units, repeats=3, selective=selective,
                                 **kw)
           for units in ("auto", "fine")}
    return model, kw, loss_fn, opt, out


def floor_section(names, adam):
    print("| model | space | units | activation-only floor MiB | ÷ old floor | bound (fixed / largest unit / kept) "
          "MiB |")
    print("|---|---|---|---|---|---|")
    ratios = {}
    for name in names:
        *_, profs = profiles(name, adam)
        old = solvers.min_peak(profs["auto"], offload_state=False)
        for space, (units, strategies) in SPACES.items():
            prof = profs[units]
            f = explain_floor(prof, offload_state=False, strategies=strategies)
            ratios[(name, space)] = f.floor_bytes / old
            print(f"| {name} | {space} | {prof.n_units} | {mib(f.floor_bytes)} | {f.floor_bytes / old:.3f} | "
                  f"{f.bound} ({mib(f.fixed_bytes)} / {mib(f.largest_unit_bytes)} {f.largest_unit} / "
                  f"{mib(f.kept_bytes)}) |", flush=True)
    return ratios


def train_steps(model, kw, loss_fn, adam, plan=None, steps=2):
    model = copy.deepcopy(model)
    opt = optimizer_for(model, adam)
    torch.manual_seed(123)
    losses = []
    ctx = memopt.plan(plan, model) if plan is not None else None
    if ctx is not None:
        ctx.apply()
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(**kw))
            loss.backward()
            losses.append(loss.detach().clone())
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            opt.step()
    finally:
        if ctx is not None:
            ctx.remove()
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def train_section(names, adam):
    print("| model | budget = 0.95 × old floor, MiB | plan (fine+ro) | predicted peak MiB | measured peak MiB "
          "| within budget | bit-identical (2 steps: loss, grads, params) |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        model, kw, loss_fn, opt, profs = profiles(name, adam)
        budget = int(0.95 * solvers.min_peak(profs["auto"], offload_state=False))
        plan = solvers.optimal(profs["fine"], budget, offload_state=False, strategies=RO, time_limit=60)
        m = memopt.measure(model, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **kw)
        ref, got = train_steps(model, kw, loss_fn, adam), train_steps(model, kw, loss_fn, adam, plan)
        same = all(torch.equal(a, b) for xs, ys in zip(ref, got) for a, b in zip(xs, ys, strict=True))
        print(f"| {name} | {mib(budget)} | {' '.join(f'{k} {v}' for k, v in plan.counts().items())} | "
              f"{mib(plan.predicted_peak_bytes)} | {mib(m.peak_bytes)} | {'yes' if m.peak_bytes <= budget else 'NO'} "
              f"| {'yes' if same else 'NO'} |", flush=True)


def best_baseline(prof, budget, device):
    best = None
    for key in BASELINES:
        try:
            p = solvers.BASELINES[key](prof, budget, device)
        except memopt.BudgetError:
            continue
        if p.feasible and (best is None or p.predicted_step_time < best[1].predicted_step_time):
            best = (key, p)
    return best


def plain_time(prof, device) -> float:
    """The simulated step time without a plan: the unit each space's plan times are divided by, so that spaces
    profiled separately (their timings measured at different moments of a shared machine) compare as overheads."""
    sim = memopt.Simulator(prof, device)
    zeros = [[0] * prof.n_units]
    return float(sim.evaluate(zeros, [[1] * prof.n_units], [[1] * prof.n_units])[1][0])


def bench_section(names, adam):
    print("step time ÷ the step without a plan (each space on its own profile), simulated\n")
    print("| model | device | budget MiB | best baseline (blocks) | " + " | ".join(f"{k} (MILP)" for k in SPACES)
          + " | fine+ro ÷ best baseline (throughput) | fine+ro ÷ old MILP | best space ÷ best baseline |")
    print("|---|---|---|---|" + "---|" * len(SPACES) + "---|---|---|")
    rows = []
    for name in names:
        *_, profs = profiles(name, adam)
        for device in DEVICES:
            old = solvers.min_peak(profs["auto"], device, offload_state=False)
            peak = profs["auto"].peak_bytes
            for frac in FRACTIONS:
                budget = int(old + frac * (peak - old))
                bc = best_baseline(profs["auto"], budget, device)
                t = {}  # step time ÷ the same profile's step without a plan
                for space, (units, strategies) in SPACES.items():
                    p = solvers.optimal(profs[units], budget, device, offload_state=False, strategies=strategies,
                                        time_limit=30)
                    if p.feasible:
                        t[space] = p.predicted_step_time / plain_time(profs[units], device)
                base = bc[1].predicted_step_time / plain_time(profs["auto"], device) if bc else float("nan")
                new = t.get("fine+ro", float("nan"))
                best = min(t.values())
                rows.append((base / new, base / best))
                dev = memopt.Simulator(profs["auto"], device).device.name
                cells = " | ".join(f"{t[k]:.3f}" if k in t else "—" for k in SPACES)
                print(f"| {name} | {dev} | {mib(budget)} | "
                      f"{f'{bc[0]} {base:.3f}' if bc else 'none fits'} | {cells} | {base / new:.3f} | "
                      f"{t.get('old', float('nan')) / new:.3f} | {base / best:.3f} |", flush=True)
    for i, what in enumerate(("fine+ro", "best space")):
        ok = [r[i] for r in rows if r[i] == r[i]]
        print(f"\n{what} ÷ best baseline: min {min(ok):.3f}, median {statistics.median(ok):.3f} over {len(ok)} "
              f"budgets")


BASE_BATCH = {"gpt2": 8, "vit": 8}


def max_batch_section(names, adam):
    """Per model: the largest batch (in steps of half the base batch) whose plan fits the memory plain
    training needs at the base batch, for the best baseline on blocks and for the floors of the old and new spaces."""
    ratios = []
    for name in names:
        base = BASE_BATCH[name]
        model, kw, loss_fn = build(name, base)
        opt = optimizer_for(model, adam)
        budget = memopt.measure(model, loss_fn=loss_fn, optimizer=opt, steps=1, **kw).peak_bytes
        del model, opt
        print(f"\n{name}: budget = plain training's measured peak at batch {base} = {mib(budget)} MiB")
        print("| batch | best baseline (blocks) | its peak MiB | old floor MiB | fine+ro floor MiB | fits: baseline / "
              "old / fine+ro |")
        print("|---|---|---|---|---|---|")
        best = {"baseline": base, "old": base, "new": base}
        step = max(1, base // 2)
        batch = base
        while True:
            batch += step
            *_, profs = profiles(name, adam, batch, selective=False)
            bc = None
            for key in BASELINES:
                if key == "op_sac":  # needs save-sets; it never reaches below recompute-all's peak
                    continue
                p = solvers.BASELINES[key](profs["auto"], None)
                if bc is None or p.predicted_peak_bytes < bc[1].predicted_peak_bytes:
                    bc = (key, p)
            floors = {"old": solvers.min_peak(profs["auto"], offload_state=False),
                      "new": solvers.min_peak(profs["fine"], offload_state=False, strategies=RO)}
            fits = {"baseline": bc[1].predicted_peak_bytes <= budget, **{k: v <= budget for k, v in floors.items()}}
            for k, ok in fits.items():
                if ok:
                    best[k] = max(best[k], batch)
            print(f"| {batch} | {bc[0]} | {mib(bc[1].predicted_peak_bytes)} | {mib(floors['old'])} | "
                  f"{mib(floors['new'])} | {' / '.join('yes' if fits[k] else 'no' for k in fits)} |", flush=True)
            del profs
            if not fits["new"]:
                break
        ratios.append(best["new"] / best["baseline"])
        print(f"\n{name} max batch: best baseline {best['baseline']}, old space {best['old']}, fine+ro {best['new']} "
              f"(fine+ro ÷ best baseline {ratios[-1]:.2f}; batches tried in steps of {step})")
    print(f"\nmax batch, fine+ro ÷ best baseline: median {statistics.median(ratios):.3f} over {len(ratios)} models")


def timm_vit_section(batches: list[int]) -> None:
    """``--timm-vit``: timm's ViT-Tiny (``tests/real_timm.py``, 12 blocks, 96 px, SGD) at each batch: the
    activation-only floor of fine units with every strategy but selective against the block floor with keep /
    recompute / swap, and where the fine floor's plan peaks."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import real_timm

    from memopt_nb.core.plan import STRATEGIES
    from memopt_nb.planners.floor import explain_floor

    every = tuple(s for s in STRATEGIES if s != "selective")
    print("| batch | block floor | fine floor | fine ÷ block | where the fine floor's plan peaks |")
    print("|---|---|---|---|---|")
    for b in batches:
        floors = {}
        for units in ("auto", "fine"):
            model, inputs, loss_fn = real_timm.vit_tiny(batch=b, image=96)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, units=units, repeats=1)
            strategies = every if units == "fine" else ("keep", "recompute", "swap")
            floors[units] = (solvers.min_peak(prof, None, strategies, offload_state=False), prof, strategies)
        (block, _, _), (fine, prof, strategies) = floors["auto"], floors["fine"]
        where = explain_floor(prof, floor_bytes=fine, strategies=strategies, offload_state=False).breakdown_text()
        print(f"| {b} | {block / 2**20:.2f} MiB | {fine / 2**20:.2f} MiB | {fine / block:.3f} | {where} |", flush=True)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("floor", "train", "bench", "max-batch"):
        ap.add_argument(f"--{flag}", action="store_true")
    ap.add_argument("--adam", action="store_true", help="AdamW instead of SGD (the fixed state then grows 2x)")
    ap.add_argument("--models", default="gpt2,vit")
    ap.add_argument("--timm-vit", default="", help="batches, e.g. 32,64,96: timm's ViT-Tiny fine vs block floor "
                    "(only this section)")
    args = ap.parse_args(argv)
    if args.timm_vit:
        torch.set_num_threads(1)
        timm_vit_section([int(b) for b in args.timm_vit.split(",")])
        return
    every = not (args.floor or args.train or args.bench or args.max_batch)
    names = args.models.split(",")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    t0 = time.time()
    print(f"# fine units — {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
          f"{'AdamW' if args.adam else 'SGD'}\n")
    if every or args.floor:
        floor_section(names, args.adam)
        print()
    if every or args.train:
        train_section(names, args.adam)
        print()
    if every or args.bench:
        bench_section(names, args.adam)
        print()
    if every or args.max_batch:
        max_batch_section(names, args.adam)
    print(f"\n({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main(sys.argv[1:])
