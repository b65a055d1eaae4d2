"""Predicted vs measured peak for whole-step plans (optimizer state, gradients, parameters placed per unit).

For each model, each placement (applied to every unit) and each activation plan (keep-all, recompute-all): the peak
``memopt.simulate`` predicts from the profile, and the peak of a real training step measured with the CPU meter while
:class:`memopt_nb.runtime.state.StateManager` applies the placements and the activation plan is applied.

    PYTHONPATH=$PWD python benchmarks/state_fidelity.py [--models mlp,gpt,gpt2] [--floor]

``--floor``: on a state-heavy MLP (8 Linear blocks, batch 64, Adam), the smallest predicted peak over plans with
every placement allowed (offload_state=True; and with step in backward) over the unoptimized peak, measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import small_gpt2

import memopt_nb as memopt
from memopt_nb import zoo
from memopt_nb.core.budget import format_bytes
from memopt_nb.core.plan import STATE_CHOICES, Plan
from memopt_nb.runtime.apply import AppliedPlan
from memopt_nb.runtime.memory import meter_for
from memopt_nb.runtime.step import preserved_state, training_step

PLACEMENTS = {
    "optimizer offload": ("offload", "resident", "resident"),
    "grads offload": ("resident", "offload", "resident"),
    "params offload": ("resident", "resident", "offload"),
    "step in backward": ("resident", "step", "resident"),
    "all together": ("offload", "offload", "offload"),
    "all + step in backward": ("offload", "step", "offload"),
}


def with_placements(plan: Plan, placements: list[tuple[str, str, str]]) -> Plan:
    """``plan`` with per-unit placements (step_in_backward set when any unit steps in backward)."""
    decisions = tuple(dataclasses.replace(d, optimizer=o, grads=g, params=p)
                      for d, (o, g, p) in zip(plan.decisions, placements, strict=True))
    sib = any(g == "step" for _, g, _ in placements)
    out = dataclasses.replace(plan, decisions=decisions, step_in_backward=sib)
    out._model_ref, out._optimizer_ref = plan._model_ref, plan._optimizer_ref
    return out


def measure_state(model: nn.Module, inputs: tuple, loss_fn, optimizer: torch.optim.Optimizer, plan: Plan,
                  warmup: int = 1) -> int:
    """Peak bytes of one training step under ``plan``'s activation strategies and placements (as memopt.measure)."""
    device = next(model.parameters()).device
    with preserved_state(model, optimizer):
        with AppliedPlan(plan, model, optimizer):  # memopt.plan: activation strategies and state placements
            for _ in range(warmup - 1):
                training_step(model, inputs, loss_fn, optimizer)
            meter = meter_for(device)
            meter.track(model, optimizer, list(inputs))
            with meter:
                if warmup > 0:
                    training_step(model, inputs, loss_fn, optimizer)
                meter.reset_peak()
                training_step(model, inputs, loss_fn, optimizer)
            return int(meter.peak)


def build(name: str):
    if name == "mlp":
        z = zoo.mlp(batch_size=64, width=128, depth=4)
        return z.model, z.inputs, z.loss_fn
    if name == "gpt":
        z = zoo.gpt(batch_size=2, seq_len=32, d_model=64, n_layers=3, n_heads=2, vocab=128)
        return z.model, z.inputs, z.loss_fn
    if name == "gpt2":
        return small_gpt2()
    if name == "heavy-mlp":
        return heavy_mlp()
    raise SystemExit(f"unknown model {name}")


def heavy_mlp(blocks: int = 8, width: int = 512, batch: int = 64):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks)])
    x = torch.randn(batch, width)
    y = torch.randn(batch, width)
    return model, (x,), (lambda out: F.mse_loss(out, y))


def table(names: list[str]) -> list[tuple]:
    rows = []
    for name in names:
        model, inputs, loss_fn = build(name)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
        for strategy in ("keep", "recompute"):
            base = Plan.uniform(prof, strategy)
            for label, pl in {"resident": STATE_CHOICES[0], **PLACEMENTS}.items():
                plan = with_placements(base, [pl] * prof.n_units)
                sim = memopt.simulate(prof, plan)
                meas = measure_state(model, inputs, loss_fn, opt, plan)
                rows.append((name, strategy, label, sim.peak_bytes, meas, sim.peak_phase))
                print(f"{name:6s} {strategy:9s} {label:24s} predicted {sim.peak_bytes:>10d} measured {meas:>10d} "
                      f"diff {sim.peak_bytes - meas:>+8d} ({(sim.peak_bytes - meas) / meas:+.3%}) peak in "
                      f"{sim.peak_phase}", flush=True)
    return rows


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,gpt2")
    ap.add_argument("--floor", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.models:
        table(args.models.split(","))
    if args.floor:
        floor_figures()


def floor_figures() -> None:
    from memopt_nb.planners.floor import explain_floor

    model, inputs, loss_fn = heavy_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
    plain = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=1).peak_bytes
    print(f"heavy MLP: unoptimized peak measured {plain} B ({format_bytes(plain)}); activation-only floor "
          f"{explain_floor(prof).floor_bytes} B")
    for sib in (False, True):
        fl = explain_floor(prof, offload_state=True, step_in_backward=sib)
        plan = fl.plan
        meas = measure_state(model, inputs, loss_fn, opt, plan)
        print(f"  offload_state=True step_in_backward={sib}: floor predicted {fl.floor_bytes} B "
              f"({format_bytes(fl.floor_bytes)}, {fl.floor_bytes / plain:.3f}x), that plan measured {meas} B "
              f"({meas / plain:.3f}x); plan: {sorted(set(plan.strategies))}, placements "
              f"{sorted(set(plan.placements))}")
        print("   ", fl.breakdown_text())


if __name__ == "__main__":
    main(sys.argv[1:])
