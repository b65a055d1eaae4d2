"""transformers GPT-2 from a small config (random init): its build, a training step that returns the cache, the loop
that trains it under a plan, and the exact comparison."""

from __future__ import annotations

import torch

import memopt_nb as memopt


def train(build, step, plan_for=None, steps=3, seed=0):
    """Train ``build()`` for ``steps`` Adam steps; ``step(model) -> (loss, extra)``. Returns everything to compare.

    ``extra`` is anything else to compare; a callable is called after backward (what backward left behind).
    """
    torch.manual_seed(seed)
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctx = memopt.plan(plan_for(model), model) if plan_for is not None else None
    losses, extras = [], []
    if ctx is not None:
        ctx.apply()
    try:
        torch.manual_seed(seed + 1)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss, extra = step(model)
            loss.backward()
            losses.append(loss.detach().clone())
            extras.append(extra() if callable(extra) else extra)
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            opt.step()
    finally:
        if ctx is not None:
            ctx.remove()
    return {
        "losses": losses, "extras": extras, "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": [{k: v.clone() for k, v in s.items()} for s in opt.state.values()],
    }


def assert_same(ref, got, what):
    assert len(ref["losses"]) == len(got["losses"])
    for a, b in zip(ref["losses"], got["losses"]):
        assert torch.equal(a, b), (what, "loss", a.item(), b.item())
    for key in ("grads", "params", "buffers"):
        assert ref[key].keys() == got[key].keys(), (what, key)
        for k in ref[key]:
            assert torch.equal(ref[key][k], got[key][k]), (what, key, k)
    for sa, sb in zip(ref["opt"], got["opt"], strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (what, "optimizer state", k)


# ====================================================================== Hugging Face transformers
def gpt2(transformers):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


GPT2_BLOCKS = ["transformer.h.0", "transformer.h.1"]


def gpt2_cache_step(ids):
    """A GPT-2 training step whose extra is the returned cache's lengths after backward (extended once, not twice)."""

    def step(model):
        out = model(input_ids=ids, labels=ids)
        cache = out.past_key_values
        return out.loss, lambda: [layer.keys.shape[-2] for layer in cache.layers]

    return step
