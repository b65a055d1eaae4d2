"""``python -m memopt_nb demo``: profile a built-in model, plan under a budget below its peak, train under the plan."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..core.budget import format_bytes
from ..core.plan import Plan
from ..core.progress import advance, stage, task
from ..core.strategies import REGISTRY, by_name
from ..planners.milp import min_peak
from ..planners.rl.search import search
from ..profiling.profile import profile
from ..runtime.apply import AppliedPlan
from ..runtime.measure import measure
from ..sim.simulator import simulate
from .zoo import build

__all__ = ["CODES_LEGEND", "progress", "run_demo", "run_whole_step_demo"]


def _train(model_name: str, steps: int, plan: Plan | None, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    zm = build(model_name, seed=seed)
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    ctx = AppliedPlan(plan, zm.model, opt) if plan is not None else None
    torch.manual_seed(seed)
    losses = []
    if ctx:
        ctx.apply()
    try:
        for _ in range(steps):
            loss = zm.loss_fn(zm.model(*zm.inputs))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    finally:
        if ctx:
            ctx.remove()
    return losses, [p.detach().clone() for p in zm.model.parameters()]


def _train_state(model_name: str, steps: int, plan: Plan | None, seed: int) -> list[torch.Tensor]:
    """Train ``steps`` steps; return every parameter, buffer and optimizer-state tensor afterwards."""
    zm = build(model_name, seed=seed)
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    torch.manual_seed(seed)
    ctx = AppliedPlan(plan, zm.model, opt) if plan is not None else None
    if ctx:
        ctx.apply()
    try:
        for _ in range(steps):
            zm.loss_fn(zm.model(*zm.inputs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        if ctx:
            ctx.remove()
    state = [t.detach().clone() for t in zm.model.state_dict().values()]
    return state + [t.clone() for s in opt.state_dict()["state"].values() for t in s.values() if torch.is_tensor(t)]


def progress(out: Callable[[str], None] = print, every: float = 5.0) -> Callable[[dict], None]:
    """A search ``callback`` that prints one line every ``every`` seconds: elapsed time, the share of the step budget
    run, and the best plan so far as slowdown and peak against the budget — so a terminal never sits silent."""
    last = [-every]

    def show(row: dict) -> None:
        if row["seconds"] - last[0] < every:
            return
        last[0] = row["seconds"]
        done = row["global_step"] / max(row["total_timesteps"], 1)
        best = "no plan within the budget yet"
        if row.get("best_step_time") is not None:
            best = (f"best plan {row['best_step_time'] / row['base_step_time']:.2f}x the unplanned step, peak "
                    f"{row['best_peak'] / row['budget']:.0%} of the budget")
        out(f"  {row['seconds']:5.0f} s  {done:4.0%} of the search's steps  {best}")

    return show


@task("demo")
def run_whole_step_demo(model: str = "vit_tiny", state_over_budget: float = 2.2, steps: int = 3, seed: int = 0,
                        out: Callable[[str], None] = print) -> dict[str, object]:
    """A model whose parameters + gradients + Adam state are ``state_over_budget`` × the budget trains under a
    searched whole-step plan; parameters, buffers and optimizer state are compared with plain training."""
    zm = build(model, seed=seed)
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    out(f"memopt_nb whole-step demo: built-in '{model}' model, {sum(p.numel() for p in zm.model.parameters()):,} "
        "parameters, Adam")
    stage("profiling")
    prof = profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt)
    state = prof.param_bytes + prof.grad_bytes + prof.optimizer_state_bytes
    budget = int(state / state_over_budget)
    out(f"  parameters + gradients + Adam state: {format_bytes(state)} ({state / prof.peak_bytes:.0%} of the peak), "
        f"{state / budget:.1f}x the budget of {format_bytes(budget)}")
    out(f"  smallest peak with activations only: {format_bytes(min_peak(prof, offload_state=False))}; "
        f"with whole-step plans: {format_bytes(min_peak(prof, offload_state=True))}")
    out("searching a plan with the two PPO agents (Ctrl-C stops and keeps the best plan) ...")
    stage("searching a plan")
    plan = search(prof, budget, offload_state=True, callback=progress(out))
    out(f"  stopped: {plan.meta.get('stopped')}; {plan.meta.get('search_seconds', 0):.0f} s in all")
    stage("measuring without and with the plan", total=2)
    base = measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, steps=steps)
    advance()
    under = measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, steps=steps)
    advance()
    stage("training without and with the plan")
    matched = all(torch.equal(a, b) for a, b in zip(_train_state(model, steps, None, seed),
                                                      _train_state(model, steps, plan, seed), strict=True))
    out(f"  {plan.summary()}")
    out(f"  unoptimized peak (measured): {format_bytes(base.peak_bytes)}")
    out(f"  predicted peak under plan:   {format_bytes(plan.predicted_peak_bytes or 0)}")
    out(f"  measured peak under plan:    {format_bytes(under.peak_bytes)}"
        f"  ({'within' if under.peak_bytes <= budget else 'OVER'} budget)")
    out(f"  step time ratio (plan/none): {under.step_time / base.step_time:.2f}x")
    out(f"  parameters, buffers and Adam state after {steps} steps: "
        f"{'identical, bit for bit' if matched else 'DIFFERENT'}")
    return {"state": state, "budget": budget, "measured_peak": under.peak_bytes, "matched": matched, "plan": plan,
            "within_budget": under.peak_bytes <= budget}


#: What the per-unit codes of the demo's plan line mean, printed under it.
CODES_LEGEND = ("per unit, in forward order: " + ", ".join(f"{s.letter} {s.name}" for s in REGISTRY)
                + f"; the two digits after {' or '.join(s.letter for s in REGISTRY if s.timed)} are the offload window "
                "and prefetch distance (S11: window 1, distance 1)")


def _short(d: object) -> str:
    s = by_name(d.strategy)
    return s.letter + (f"{d.offload_window}{d.prefetch_distance}" if s.timed else "")


@task("demo")
def run_demo(model: str = "gpt", budget_fraction: float = 0.6, steps: int = 3, seed: int = 0,
             planner: Callable | None = None, out: Callable[[str], None] = print) -> dict[str, object]:
    """Run the demo and return its figures (also printed through ``out``)."""
    zm = build(model, seed=seed)
    opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
    out(f"memopt_nb demo: built-in '{model}' model, {sum(p.numel() for p in zm.model.parameters()):,} parameters")
    stage("profiling")
    prof = profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt)
    out(f"profiled {prof.n_units} units ({', '.join(prof.unit_names[:3])}, ...) on {prof.device.name}")
    lowest = min_peak(prof)
    budget = max(int(budget_fraction * prof.peak_bytes), lowest)
    if planner is None:  # the default search, printing its progress
        planner = functools.partial(search, callback=progress(out))
    out(f"searching a plan under {budget / prof.peak_bytes:.0%} of the peak with the two PPO agents (Ctrl-C stops and "
        "keeps the best plan) ...")
    stage("searching a plan")
    plan = planner(prof, budget)
    if plan.meta.get("stopped"):
        out(f"  stopped: {plan.meta['stopped']}")
    sim = simulate(prof, plan)
    stage("measuring without and with the plan", total=2)
    base = measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, steps=steps)
    advance()
    under = measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, steps=steps)
    advance()
    stage("training without and with the plan", total=2)
    ref_losses, ref_params = _train(model, steps, None, seed)
    advance()
    plan_losses, plan_params = _train(model, steps, plan, seed)
    advance()
    matched = all(torch.equal(a, b) for a, b in zip(ref_losses, plan_losses)) and all(
        torch.equal(a, b) for a, b in zip(ref_params, plan_params))
    ratio = under.step_time / base.step_time
    counts = plan.counts()
    took = plan.meta.get("search_seconds")
    counted = ", ".join(f"{s.name} {counts[s.name]}" for s in REGISTRY if s.default or counts[s.name])
    out(f"plan ({plan.method}{f', {took:.0f} s' if took else ''}): {counted}  — "
        f"{' '.join(_short(d) for d in plan.decisions)}")
    out(f"  {CODES_LEGEND}")
    if plan.moves_state:
        sc = plan.state_counts()
        out(f"  state: optimizer offloaded {sc['optimizer']}, gradients offloaded {sc['grads']}, stepped in backward "
            f"{sc['step']}, parameters offloaded {sc['params']} (of {len(plan.decisions)} units)")
    out(f"  unoptimized peak (measured): {format_bytes(base.peak_bytes)}")
    out(f"  budget:                      {format_bytes(budget)} ({budget / prof.peak_bytes:.0%} of the peak)")
    out(f"  predicted peak under plan:   {format_bytes(sim.peak_bytes)}")
    out(f"  measured peak under plan:    {format_bytes(under.peak_bytes)}"
        f"  ({'within' if under.peak_bytes <= budget else 'OVER'} budget)")
    out(f"  step time ratio (plan/none): {ratio:.2f}x  ({under.step_time * 1e3:.1f} ms vs "
        f"{base.step_time * 1e3:.1f} ms, medians of {steps})")
    out(f"  loss matched over {steps} training steps: {'yes, bit for bit' if matched else 'NO'}"
        f"  (losses {', '.join(f'{x.item():.4f}' for x in plan_losses)})")
    if prof.device.kind == "cpu":
        out("  note: on this CPU the training device is emulated; the saving is real on CUDA.")
    return {"unoptimized_peak": base.peak_bytes, "budget": budget, "predicted_peak": sim.peak_bytes,
            "measured_peak": under.peak_bytes, "step_time_ratio": ratio, "loss_matched": matched, "plan": plan}
