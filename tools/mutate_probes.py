"""Deterministic probes for ``tools/mutate.py``: print what a part of memopt_nb computes on fixed inputs.

    python tools/mutate_probes.py simulate   # Simulator.evaluate / run / simulate_reference on fixed plans
    python tools/mutate_probes.py solvers    # every planner, min_peak, options and budget errors
    python tools/mutate_probes.py runtime    # plans applied to tiny models: measured peaks, parameters after steps
    python tools/mutate_probes.py rl         # PlanningTask's arrays and scores
    python tools/mutate_probes.py floor      # explain_floor / state_floor on chains with and without state
    python tools/mutate_probes.py ppo        # a short PPO run of both agents, GAE, risk-seeking advantages
    python tools/mutate_probes.py milp       # whole-step min_peak and optimal plans for every state placement
    python tools/mutate_probes.py state      # whole-step plans applied to uneven MLPs: peaks and trained state

Profiles are taken from small real models (seconds) with their measured times replaced by fixed ones, so the output
depends on the code only. A mutant that leaves the printed output unchanged is counted as equivalent.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import numpy as np
import torch

torch.set_num_threads(1)

import memopt_nb as memopt  # noqa: E402
from memopt_nb.core.device import DeviceSpec  # noqa: E402
from memopt_nb.core.plan import DISTANCES, WINDOWS, Plan  # noqa: E402
from memopt_nb.harness.synthetic import chain_profile  # noqa: E402

CPU_LIKE = DeviceSpec(name="cpu-like", kind="cpu", capacity_bytes=2**34, h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9,
                      compute_flops=1e11, copy_overlap=False)
SLOW_LINK = DeviceSpec.preset("a100-40gb").with_changes(name="a100-slow-link", h2d_bytes_per_s=2e9,
                                                        d2h_bytes_per_s=1e9)
SMALL = {"unet": (dict(widths=(8, 16, 32), image=16, batch_size=4), ["down.0", "down.2", "up.0", "up.1"]),
         "gpt": (dict(n_layers=3, batch_size=4, seq_len=32, d_model=32, n_heads=2), "auto")}


def fmt(x: Any) -> str:
    """A stable text form (floats to 10 significant digits, arrays as their values)."""
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.10g}"
    if isinstance(x, np.ndarray):
        return "[" + " ".join(fmt(v) for v in x.ravel().tolist()) + f"]{list(x.shape)}"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))) + "}"
    return repr(x)


def fixed_times(prof: memopt.ModelProfile) -> memopt.ModelProfile:
    for k, seg in enumerate(prof.segments):
        seg.time = 1e-3 * (1 + k % 5) * (2.0 if seg.kind == "bwd" else 1.0)
    for u in prof.units:
        u.fwd_time = prof.segments[u.fwd_segment].time
        u.bwd_time = prof.segments[u.bwd_segment].time
    prof.step_time = sum(s.time for s in prof.segments)
    # copy_overhead_s and copy_overlap are measured when the CPU device is detected: fixed here, or the output would
    # change from run to run
    prof.device = prof.device.with_changes(compute_flops=1e11, h2d_bytes_per_s=5e9, d2h_bytes_per_s=5e9,
                                           copy_overhead_s=2e-5, copy_overlap=True)
    return prof


def small_profiles() -> dict[str, Any]:
    out = {}
    for name, (kw, units) in SMALL.items():
        zm = memopt.zoo.build(name, **kw)
        opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
        prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1, units=units)
        out[name] = (zm, opt, fixed_times(prof))
    return out


def chains() -> dict[str, memopt.ModelProfile]:
    return {"chain5": chain_profile(5, seed=0, shared_boundaries=0.8), "chain7": chain_profile(7, seed=2),
            "chain12": chain_profile(12, seed=3)}


def arrays(n: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    s, w, d = rng.integers(0, 3, (count, n)), rng.integers(0, 3, (count, n)), rng.integers(0, 4, (count, n))
    grid = [(wi, di) for wi in WINDOWS for di in DISTANCES]
    s = np.concatenate([s, np.full((len(grid), n), 2)])
    w = np.concatenate([w, np.array([[wi] * n for wi, _ in grid])])
    d = np.concatenate([d, np.array([[di] * n for _, di in grid])])
    return s, w, d


def probe_simulate() -> None:
    from memopt_nb.sim.simulator import Simulator, simulate_reference

    profs = {**chains(), **{k: v[2] for k, v in small_profiles().items()}}
    for name, prof in profs.items():
        for device in (None, CPU_LIKE, "a100-40gb", SLOW_LINK):
            sim = Simulator(prof, device)
            s, w, d = arrays(prof.n_units, 24, 0)
            det = sim.evaluate(s, w, d, details=True)
            print(name, sim.device.name)
            for key in sorted(det):
                print(" ", key, fmt(det[key]))
            for b in (0, 5, len(s) - 1):
                ref = simulate_reference(sim, s[b].tolist(), w[b].tolist(), d[b].tolist())
                print("  ref", fmt({k: v for k, v in ref.items() if k not in ("rows", "copies")}))
            for strategy in ("keep", "recompute", "swap"):
                plan = Plan.uniform(prof, strategy, offload_window=0, prefetch_distance=2)
                r = sim.run(plan, budget=int(prof.peak_bytes * 0.7))
                print("  run", strategy, repr(r), r._repr_html_())
                print("   ", fmt({k: v for k, v in vars(r).items() if k != "timeline"}))
                print("    timeline", fmt([[row[k] for k in sorted(row)] for row in r.timeline]))
    prof = profs["chain5"]
    for bad in (np.zeros((1, 4)), np.zeros((2, 5))):
        try:
            Simulator(prof).evaluate(bad, np.zeros((1, 5)), np.zeros((1, 5)))
        except memopt.MemoptError as exc:
            print("error", type(exc).__name__, exc)


def probe_solvers() -> None:
    from memopt_nb import solvers
    from memopt_nb.planners.options import uniform_arrays, unit_options
    from memopt_nb.sim.simulator import Simulator

    profs = {"chain4": chain_profile(4, seed=1, shared_boundaries=0.6), "chain6": chain_profile(6, seed=5),
             **{k: v[2] for k, v in small_profiles().items()}}
    no_link = CPU_LIKE.with_changes(name="no-link", h2d_bytes_per_s=0.0, d2h_bytes_per_s=0.0)
    for name, prof in profs.items():
        for device in (None, CPU_LIKE, "a100-40gb", SLOW_LINK, no_link):
            sim = Simulator(prof, device)
            print(name, sim.device.name)
            print("  options", fmt([unit_options(sim, u) for u in range(sim.n)]))
            print("  options kr", fmt([unit_options(sim, u, ("keep", "recompute")) for u in range(sim.n)]))
            print("  uniform", fmt([uniform_arrays(sim, c, 2, 3) for c in range(3)]))
            for strategies in (("keep", "recompute", "swap"), ("keep", "recompute"), ("keep", "swap")):
                print("  min_peak", strategies, solvers.min_peak(prof, device=device, strategies=strategies))
            lo = solvers.min_peak(prof, device=device)
            for frac in (0.0, 0.15, 0.5, 0.9, 1.2):
                budget = int(lo + frac * (prof.peak_bytes - lo))
                for method, fn in [*solvers.BASELINES.items(), ("optimal", solvers.optimal)]:
                    p = fn(prof, budget, device=device)
                    print("  ", frac, method, p.strategies, p.offload_windows, p.prefetch_distances,
                          p.predicted_peak_bytes, fmt(p.predicted_step_time), p.feasible, p.method, p.budget_bytes)
                if prof.n_units <= 4:
                    p = solvers.brute_force(prof, budget, device=device)
                    print("  ", frac, "brute", p.strategies, p.predicted_peak_bytes, fmt(p.predicted_step_time))
            for budget in (lo - 1, "lots", "50%", "1GiB", None):
                try:
                    p = solvers.optimal(prof, budget, device=device, strategies=("keep", "recompute"))
                    print("  budget", budget, p.budget_bytes, p.strategies)
                except memopt.MemoptError as exc:
                    print("  budget", budget, type(exc).__name__, exc)
    try:
        solvers.brute_force(chain_profile(13, seed=0), None)
    except memopt.MemoptError as exc:
        print("error", exc)


def _digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().clone().numpy().tobytes())  # a copy: .numpy() pins its storage's size
    return h.hexdigest()[:16]


def probe_runtime() -> None:
    for name, (_, _, prof) in small_profiles().items():
        n = prof.n_units
        plans = [Plan.uniform(prof, s, offload_window=w, prefetch_distance=d)
                 for s in ("keep", "recompute", "swap") for w, d in ((0, 0), (1, 1), (2, 3))]
        plans.append(Plan.from_strategies(prof, [("swap", "recompute", "keep")[u % 3] for u in range(n)],
                                          offload_window=[u % 3 for u in range(n)],
                                          prefetch_distance=[(u + 1) % 4 for u in range(n)]))
        for plan in plans:
            zm = memopt.zoo.build(name, **SMALL[name][0])
            opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
            meas = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, steps=1)
            torch.manual_seed(0)
            with memopt.plan(plan, zm.model) as applied:
                for _ in range(2):
                    opt.zero_grad()
                    zm.loss_fn(zm.model(*zm.inputs)).backward()
                    opt.step()
                stats = getattr(applied, "stats", {})
                stats = stats() if callable(stats) else dict(stats)
            state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
            print(name, plan.strategies, plan.offload_windows, plan.prefetch_distances, "peak", meas.peak_bytes,
                  "params", _digest(zm.model.parameters()), "state", _digest(state),
                  "buffers", _digest(zm.model.buffers()),
                  "stats", fmt({k: v for k, v in stats.items() if "time" not in k and not k.endswith("_s")}))
            print("  forwards restored", all("forward" not in m.__dict__ for m in zm.model.modules()))
    probe_runtime_effects()


def _train_digest(model: torch.nn.Module, step: Any, plan: Plan | None, steps: int = 2) -> str:
    """``steps`` Adam steps of ``model`` (``step(model) -> loss``), under ``plan`` if given: losses and a digest."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    ctx = memopt.plan(plan, model) if plan is not None else None
    try:
        if ctx is not None:
            ctx.apply()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = step(model)
            loss.backward()
            opt.step()
            losses.append(fmt(loss.item()))
    except memopt.MemoptError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if ctx is not None:
            ctx.remove()
    return f"losses {losses} params {_digest(model.parameters())} buffers {_digest(model.buffers())}"


def probe_runtime_effects() -> None:
    """Recompute's side-effect handling (buffers, attributes, arguments, caches) and plan application's refusals."""
    from torch import nn

    from memopt_nb.core.plan import Decision

    def named_plan(names: list[str], strategy: str) -> Plan:
        return Plan(decisions=tuple(Decision(n, strategy) for n in names), method=f"{strategy}_all")

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return torch.tanh(self.lin(x)) * self.calls

    class Logging(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, log: list) -> torch.Tensor:
            log.append(x.shape[0])
            return torch.tanh(self.lin(x))

    class LoggingNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Logging(), Logging()

        def forward(self, x: torch.Tensor, log: list | None = None) -> torch.Tensor:
            log = [] if log is None else log
            return self.b(self.a(x, log), log).sum()

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    for api in ("old", "parametrizations"):
        norm = nn.utils.spectral_norm if api == "old" else nn.utils.parametrizations.spectral_norm
        names = ["0", "2", "4"]
        for strategy in (None, "recompute", "swap"):
            torch.manual_seed(0)
            net = nn.Sequential(*[m for _ in range(3) for m in (norm(nn.Linear(16, 16)), nn.Tanh())],
                                nn.Linear(16, 1))
            plan = named_plan(names, strategy) if strategy else None
            print("spectral", api, strategy, _train_digest(net, lambda m: m(x).pow(2).mean(), plan))
        prof = memopt.profile(net, x, units=names, repeats=1)
        print("  profile", [(u.recomputable, u.side_effects, u.not_recomputable_reason) for u in prof.units])
    y = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    for strategy in (None, "recompute", "swap"):
        torch.manual_seed(0)
        net = nn.Sequential(Counting(), Counting(), nn.Linear(8, 1))
        plan = named_plan(["0", "1"], strategy) if strategy else None
        print("counting", strategy, _train_digest(net, lambda m: m(y).sum(), plan, steps=3), net[0].calls,
              net[1].calls, sorted(k for k in net[0].__dict__ if not k.startswith("_")))
    torch.manual_seed(0)
    net = LoggingNet()
    prof = memopt.profile(net, y, units=["a", "b"], repeats=1)
    print("logging", [(u.recomputable, u.not_recomputable_reason) for u in prof.units])
    for plan in (Plan.uniform(prof, "recompute"), named_plan(["a", "b"], "recompute"), Plan.uniform(prof, "swap")):
        log: list = []
        print("  ", plan.strategies, _train_digest(net, lambda m, log=log: m(y, log), plan, steps=1), log)
    class Box:  # a plain object passed to a unit, whose attribute the forward replaces
        def __init__(self) -> None:
            self.count = 0

    class Boxed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, box: Box) -> torch.Tensor:
            box.count = box.count + 1
            return torch.tanh(self.lin(x)) * box.count

    class BoxedNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Boxed(), Boxed()

        def forward(self, x: torch.Tensor, box: Box) -> torch.Tensor:
            return self.b(self.a(x, box), box).sum()

    torch.manual_seed(0)
    net = BoxedNet()
    prof = memopt.profile(net, y, Box(), units=["a", "b"], repeats=1)
    print("boxed", [(u.recomputable, u.not_recomputable_reason) for u in prof.units])
    box = Box()
    print("  ", _train_digest(net, lambda m: m(y, box), named_plan(["a", "b"], "recompute"), steps=1), box.count)
    # plan application's refusals
    zm = memopt.zoo.build("gpt", **SMALL["gpt"][0])
    units = [n for n, _ in zm.model.named_modules() if n.startswith("blocks.") and n.count(".") == 1]
    for names in (["blocks", "blocks.0"], ["", "blocks.1"], ["blocks.0", "blocks.1"]):
        try:
            with memopt.plan(named_plan(names, "recompute"), zm.model):
                print("apply", names, "ok", [n for n, m in zm.model.named_modules() if "forward" in m.__dict__])
        except memopt.MemoptError as exc:
            print("apply", names, type(exc).__name__, exc)
    for flag in ("gradient_checkpointing", "grad_checkpointing", "is_gradient_checkpointing"):
        target = zm.model if flag == "is_gradient_checkpointing" else zm.model.blocks[1]
        setattr(target, flag, True)
        try:
            memopt.plan(named_plan(units, "recompute"), zm.model).apply().remove()
            print("flag", flag, "ok")
        except memopt.MemoptError as exc:
            print("flag", flag, type(exc).__name__, exc)
        delattr(target, flag)
    for args in ((named_plan(units, "keep"),), ("nope", zm.model), (named_plan(units, "keep"), "nope")):
        try:
            memopt.plan(*args)
            print("plan()", "ok")
        except memopt.MemoptError as exc:
            print("plan()", type(exc).__name__, exc)
    try:
        import transformers
    except ImportError:
        return
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    for strategy in (None, "recompute", "swap"):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
        lengths = []

        def step(m: Any, lengths: list = lengths) -> torch.Tensor:
            out = m(input_ids=ids, labels=ids)
            lengths.append(out.past_key_values)
            return out.loss

        plan = named_plan(["transformer.h.0", "transformer.h.1"], strategy) if strategy else None
        digest = _train_digest(model, step, plan)
        print("hf-gpt2", strategy, digest, [[layer.keys.shape[-2] for layer in c.layers] for c in lengths])


def probe_rl() -> None:
    from memopt_nb.planners.task import PlanningTask

    profs = {**chains(), **{k: v[2] for k, v in small_profiles().items()}}
    for name, prof in profs.items():
        for device in (None, "a100-40gb", CPU_LIKE):
            lo = memopt.solvers.min_peak(prof, device=device)
            task = PlanningTask(prof, int(lo + 0.4 * (prof.peak_bytes - lo)), device=device)
            print(name, device)
            for key, value in sorted(vars(task).items()):
                if isinstance(value, (np.ndarray, int, float, np.floating, np.integer, list, tuple, dict)):
                    print(" ", key, fmt(value))
            s, w, d = arrays(task.n, 12, 1)
            if hasattr(task, "evaluate"):
                peak, t = task.evaluate(s, w, d)
                print("  evaluate", fmt(peak), fmt(t))
                for fn in ("overhead", "penalty"):
                    if hasattr(task, fn):
                        print(" ", fn, fmt(getattr(task, fn)(t if fn == "overhead" else peak)))


def probe_floor() -> None:
    """:func:`explain_floor` and :func:`state_floor` on chains with and without state, every strategy space."""
    from memopt_nb.planners.floor import explain_floor, state_floor

    profs = {"chain5": chain_profile(5, seed=3), "chain5-state": chain_profile(5, seed=3, state_bytes=8 * 2**20),
             "chain8-big-state": chain_profile(8, seed=2, state_bytes=96 * 2**20, spread=2.0),
             "chain4-one-huge": chain_profile(4, seed=7, spread=3.0),
             **{k: v[2] for k, v in small_profiles().items()}}
    spaces = [("keep", "recompute", "swap"), ("keep", "recompute"), ("keep", "swap"),
              ("keep", "recompute", "swap", "recompute_offload")]
    for name, prof in profs.items():
        for device in (None, "a100-40gb", SLOW_LINK):
            for strategies in spaces:
                for offload_state, sib in ((False, False), (True, False), (True, True), ({"optimizer"}, False),
                                           ({"grads", "params"}, True)):
                    try:
                        if offload_state:
                            print(name, device, strategies, sorted(offload_state) if isinstance(offload_state, set) else
                                  offload_state, sib, "state_floor",
                                  state_floor(prof, device, strategies, offload_state=offload_state,
                                              step_in_backward=sib))
                        f = explain_floor(prof, device, strategies=strategies, offload_state=offload_state,
                                          step_in_backward=sib)
                        print(" ", f.floor_bytes, fmt(f.parts()), f.bound_text())
                        print(" ", f.text(), "|", f.text("magic"))
                    except memopt.MemoptError as exc:
                        print("  error", type(exc).__name__, exc)
            for floor_mib in (1, 40, 400):
                f = explain_floor(prof, device, floor_bytes=floor_mib * 2**20)
                print(" given", floor_mib, fmt(f.parts()), f.text())


def probe_ppo() -> None:
    """A short PPO run of both agents on small tasks (episodes, iteration stats, the agents' weights), GAE and the
    risk-seeking advantages on fixed inputs."""
    from memopt_nb.planners.rl import ppo
    from memopt_nb.planners.rl.env import MemoryPlanningEnv
    from memopt_nb.planners.task import PlanningTask

    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
    dones = (torch.rand(6, 4, generator=g) < 0.3).float()
    adv, ret = ppo.compute_gae(rewards, values, dones, torch.randn(4, generator=g), torch.zeros(4), 0.97, 0.9)
    print("gae", fmt(adv.numpy()), fmt(ret.numpy()))
    for q in (0.1, 0.25, 0.5, 0.75, 1.0):
        adv, w = ppo.risk_seeking_advantages(torch.tensor([3.0, -1.0, 2.0, 7.0, 0.5, 2.0]), q, num_steps=2)
        print("risk", q, fmt(adv.numpy()), fmt(w.numpy()))
    torch.set_num_threads(1)
    cases = [("chain5", chain_profile(5, seed=3), False, {}),
             ("chain6-state", chain_profile(6, seed=4, state_bytes=16 * 2**20), True,
              dict(risk_quantile=0.25, risk_agents=("strategy",))),
             ("chain6-state-all", chain_profile(6, seed=4, state_bytes=16 * 2**20), True,
              dict(risk_quantile=0.5, update_epochs=2, num_minibatches=2))]
    for name, prof, state, extra in cases:
        lo = memopt.solvers.min_peak(prof, offload_state=state)
        task = PlanningTask(prof, int(lo + 0.3 * (prof.peak_bytes - lo)), offload_state=state)
        config = ppo.PPOConfig(num_envs=4, total_timesteps=4 * (task.n + 1) * 4, seed=1, **extra)
        episodes, iters = [], []
        agents = ppo.train(MemoryPlanningEnv.vector(task, config.num_envs), config,
                           on_episode=episodes.append, on_iteration=iters.append)
        print(name, len(episodes), "episodes")
        for info in episodes:
            print(" ", fmt({k: v for k, v in sorted(info.items()) if isinstance(v, (int, float, list, tuple))}))
        for row in iters:
            print("  iter", fmt({k: v for k, v in sorted(row.items()) if "time" not in k and "sps" not in k}))
        for agent_name, agent in sorted(agents.items()):
            print("  agent", agent_name, _digest(agent.parameters()))


def probe_milp() -> None:
    """Whole-step MILPs: min_peak and optimal plans with each state placement allowed, on chains with state."""
    from memopt_nb import solvers

    profs = {"chain4-state": chain_profile(4, seed=1, state_bytes=24 * 2**20),
             "chain6-state": chain_profile(6, seed=5, state_bytes=8 * 2**20, spread=2.0),
             "chain5": chain_profile(5, seed=3)}
    spaces = [(True, False), (True, True), ({"optimizer"}, False), ({"grads"}, True), ({"params"}, False),
              (False, True)]
    for name, prof in profs.items():
        for device in (None, SLOW_LINK):
            for offload_state, sib in spaces:
                for strategies in (("keep", "recompute", "swap"), ("keep", "recompute")):
                    try:
                        lo = solvers.min_peak(prof, device=device, strategies=strategies, offload_state=offload_state,
                                              step_in_backward=sib)
                    except memopt.MemoptError as exc:
                        print(name, "error", type(exc).__name__, exc)
                        continue
                    print(name, getattr(device, "name", device), offload_state, sib, strategies, "min_peak", lo)
                    for frac in (0.0, 0.1, 0.4, 0.8):
                        budget = int(lo + frac * (prof.peak_bytes - lo))
                        p = solvers.optimal(prof, budget, device=device, strategies=strategies,
                                            offload_state=offload_state, step_in_backward=sib)
                        print("  ", frac, [(d.strategy, d.optimizer, d.grads, d.params) for d in p.decisions],
                              p.offload_windows, p.prefetch_distances, p.step_in_backward, p.predicted_peak_bytes,
                              fmt(p.predicted_step_time), p.feasible)


def probe_state() -> None:
    """Whole-step plans (every state placement, keep and recompute) applied to uneven MLPs with Adam and SGD: the
    measured peak and the parameters and optimizer state after two steps."""
    import dataclasses

    import torch.nn as nn
    import torch.nn.functional as F

    placements = [("resident", "resident", "resident"), ("offload", "resident", "resident"),
                  ("resident", "offload", "resident"), ("resident", "resident", "offload"),
                  ("offload", "offload", "offload"), ("resident", "step", "resident"), ("offload", "step", "offload")]
    for widths in ((64, 64, 64, 1024, 64), (64, 1024, 1024, 64, 64), (32, 48, 16, 48)):
        for opt_name in ("adam", "sgd"):
            torch.manual_seed(0)
            model = nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])])
            x, y = torch.randn(4, widths[0]), torch.randn(4, widths[-1])
            make = (lambda ps: torch.optim.Adam(ps, lr=1e-2)) if opt_name == "adam" else (
                lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9))
            opt = make(model.parameters())
            loss_fn = lambda out, y=y: F.mse_loss(out, y)  # noqa: E731
            prof = memopt.profile(model, x, loss_fn=loss_fn, optimizer=opt, repeats=1)
            start = {k: v.clone() for k, v in model.state_dict().items()}
            for strategy in ("keep", "recompute"):
                for pl in placements:
                    base = Plan.uniform(prof, strategy)
                    decisions = tuple(dataclasses.replace(d, optimizer=pl[0], grads=pl[1], params=pl[2])
                                      for d in base.decisions)
                    plan = dataclasses.replace(base, decisions=decisions, step_in_backward=pl[1] == "step")
                    plan._model_ref, plan._optimizer_ref = base._model_ref, base._optimizer_ref
                    model.load_state_dict(start)
                    opt = make(model.parameters())
                    try:
                        meas = memopt.measure(model, x, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1)
                        model.load_state_dict(start)
                        opt = make(model.parameters())
                        with memopt.plan(plan, model, optimizer=opt):
                            for _ in range(2):
                                opt.zero_grad()
                                loss_fn(model(x)).backward()
                                opt.step()
                        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
                        print(widths, opt_name, strategy, pl, "peak", meas.peak_bytes, "params",
                              _digest(model.parameters()), "state", _digest(state),
                              "devices", sorted({str(p.device) for p in model.parameters()}))
                    except memopt.MemoptError as exc:
                        print(widths, opt_name, strategy, pl, "error", type(exc).__name__, exc)


PROBES = {"simulate": probe_simulate, "solvers": probe_solvers, "runtime": probe_runtime, "rl": probe_rl,
          "floor": probe_floor, "ppo": probe_ppo, "milp": probe_milp, "state": probe_state}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PROBES:
        sys.exit(f"usage: python tools/mutate_probes.py {{{','.join(PROBES)}}}")
    PROBES[sys.argv[1]]()
