"""The training loop of the tests that plan at depth (transformers GPT-2 at fine units)."""

from __future__ import annotations


def train(model, inputs, opt, steps=2):
    losses = []
    for _ in range(steps):
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
