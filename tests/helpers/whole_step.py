"""Training under a plan and without one, compared: the zoo configurations, optimizers and whole-step placements the
tests use, the loop, and the exact comparisons of losses, gradients, parameters, buffers and optimizer state."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.core.plan import Plan, optimizer_fingerprint
from memopt_nb.runtime.state import HostTensor

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}
SMALL = {  # small zoo configurations: seconds per test
    "mlp": dict(batch_size=8, width=32, depth=4),
    "gpt": dict(batch_size=2, seq_len=16, d_model=32, n_layers=4, n_heads=2, vocab=64),
    "resnet": dict(batch_size=4, widths=(8, 16), blocks_per_stage=2),
    "vit": dict(batch_size=4, d_model=32, n_layers=4, n_heads=2),
}


# per unit, cycled: (strategy, optimizer, grads, params)
MIXED = [("recompute", "offload", "offload", "resident"), ("swap", "resident", "resident", "offload"),
         ("keep", "offload", "offload", "offload"), ("recompute", "resident", "offload", "offload")]
MIXED_STEP = [("recompute", "offload", "step", "resident"), ("swap", "offload", "resident", "offload"),
              ("keep", "resident", "step", "offload"), ("swap", "offload", "offload", "resident")]


def _build(name: str):
    return memopt.zoo.build(name, seed=0, **SMALL[name])


_PROFILES: dict[str, memopt.ModelProfile] = {}


def _profile(name: str) -> memopt.ModelProfile:
    if name not in _PROFILES:
        zm = _build(name)
        _PROFILES[name] = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, repeats=1)
    return _PROFILES[name]


def _whole(plan: Plan, rows: list[tuple[str, str, str, str]], step_in_backward: bool = False, opt=None) -> Plan:
    """``plan`` with per-unit (strategy, optimizer, grads, params) taken from ``rows`` (cycled)."""
    decisions = tuple(dataclasses.replace(d, strategy=s, optimizer=o, grads=g, params=q)
                      for d, (s, o, g, q) in zip(plan.decisions, (rows[i % len(rows)] for i in range(len(plan.units))),
                                                 strict=True))
    out = plan.with_meta(decisions=decisions, step_in_backward=step_in_backward,
                         optimizer_fingerprint=optimizer_fingerprint(opt) if opt is not None else None)
    assert out.moves_state == any(r[1:] != ("resident",) * 3 for r in rows)
    return out


def _same(a: object, b: object) -> bool:
    """Equal values and structure, dict key order included; tensors bit-equal."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _readable_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient a loop may read (not those already applied by a step in backward), as plain tensors."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is None or (isinstance(g, HostTensor) and g._stepped):
            continue
        out[n] = g.clone()
    return out


def train_loop(model: nn.Module, opt: torch.optim.Optimizer, plan: Plan | None, forward_loss, steps: int = 3,
               pass_optimizer: bool = True, after_step=None):
    """``steps`` steps of ``forward_loss(model).backward()``, ``opt.step()``, ``opt.zero_grad()`` (then
    ``after_step(model)`` if given) under ``plan`` if given (dropout seeded alike): the model, the optimizer and a
    record of what each step produced, which :func:`_assert_same_training` compares."""
    torch.manual_seed(11)  # dropout
    record = {"losses": [], "grads": [], "sd_inside": None, "stats": {}}
    applied = memopt.plan(plan, model, optimizer=opt if pass_optimizer else None) if plan is not None else None
    if applied is not None:
        applied.apply()
    try:
        for _ in range(steps):
            loss = forward_loss(model)
            loss.backward()
            record["losses"].append(loss.detach().clone())
            record["grads"].append(_readable_grads(model))
            opt.step()
            opt.zero_grad()
            if after_step is not None:
                after_step(model)
        record["sd_inside"] = opt.state_dict()
    finally:
        if applied is not None:
            applied.remove()
            record["stats"] = applied.stats
    return model, opt, record


def _assert_same_training(ref, got, stepped: bool = False) -> None:
    (m0, o0, r0), (m1, o1, r1) = ref, got
    assert all(torch.equal(a, b) for a, b in zip(r0["losses"], r1["losses"], strict=True)), "losses differ"
    for step, (g0, g1) in enumerate(zip(r0["grads"], r1["grads"], strict=True)):
        if stepped:  # only gradients the loop may still read: those of units not stepped in backward
            assert set(g1) < set(g0) and g1, f"step {step}: no readable gradients, or more than plain training has"
            g0 = {k: g0[k] for k in g1}
        assert _same(g0, g1), f"gradients after backward {step} differ"
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert type(b) is nn.Parameter and torch.equal(a, b), f"parameter {n} differs"
    for (n, a), (_, b) in zip(m0.named_buffers(), m1.named_buffers(), strict=True):
        assert torch.equal(a, b), f"buffer {n} differs"
    assert _same(r0["sd_inside"], r1["sd_inside"]), "opt.state_dict() inside the block differs"
    assert _same(o0.state_dict(), o1.state_dict()), "opt.state_dict() after the block differs"
    for st in o1.state.values():
        assert not any(isinstance(v, HostTensor) for v in st.values())


def _assert_moved(stats: dict, plan: Plan, prof=None) -> None:
    """The plan really did what it says (a plan doing nothing would also train identically). With ``prof``, a unit
    without trainable parameters (an activation split off by state) has nothing to step in backward."""
    c = plan.state_counts()
    if prof is not None:
        c["step"] = sum(d.grads == "step" and u.grad_bytes > 0 for d, u in zip(plan.decisions, prof.units, strict=True))
    if c["optimizer"]:
        assert stats["state_d2h_bytes"] > 0 and stats["state_h2d_bytes"] > 0
    if c["grads"]:
        assert stats["grad_d2h_bytes"] > 0
    if c["step"]:
        assert stats["steps_in_backward"] == 3 * c["step"]
    if c["params"]:
        assert stats["param_h2d_bytes"] > 0
    if "swap" in plan.strategies:
        assert stats["offloaded_bytes"] > 0
