"""The model, loop and snapshots of the tests of steps that do not fit the device: a small GPT built at any batch,
training a few steps, and the exact comparison of two snapshots."""

from __future__ import annotations

import torch

import memopt_nb as memopt


def build(b, seed=0):
    """Tiny GPT, AdamW: (model, inputs, loss_fn, optimizer) at batch ``b`` (the same weights for a seed)."""
    z = memopt.zoo.gpt(batch_size=b, seq_len=32, d_model=48, n_layers=4, n_heads=4, vocab=128, seed=seed)
    return z.model, z.inputs, z.loss_fn, torch.optim.AdamW(z.model.parameters(), lr=1e-3)


def train(model, inputs, loss_fn, opt, steps):
    losses = []
    for _ in range(steps):
        loss = loss_fn(model(**inputs) if isinstance(inputs, dict) else model(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def snapshot(model, opt):
    params = [p.detach().clone() for p in model.parameters()]
    grads = [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()]
    return params, grads, state


def assert_same(before, after):
    for a, b in zip(before[0], after[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(before[1], after[1], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert len(before[2]) == len(after[2])
    for sa, sb in zip(before[2], after[2], strict=True):
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
