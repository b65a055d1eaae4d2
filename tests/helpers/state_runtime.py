"""Training with the optimizer state, gradients and parameters at each placement, and the exact comparison with training
without a plan."""

from __future__ import annotations

import torch

from helpers.whole_step import _same
from memopt_nb import zoo
from memopt_nb.runtime.state import Placement, StateManager


def _kernel(kind: bool | str) -> dict:
    """foreach=False (single-tensor), True (foreach) or "fused" (the fused CPU kernels)."""
    return {"foreach": kind is True, "fused": True if kind == "fused" else None}


OPTIMIZERS = {
    "adam": lambda ps, k: torch.optim.Adam(ps, lr=1e-2, **_kernel(k)),
    "adamw": lambda ps, k: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **_kernel(k)),
    "sgd": lambda ps, k: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3, **_kernel(k)),
}
PLACEMENTS = {
    "state": Placement(optimizer="offload"),
    "grads": Placement(grads="offload"),
    "params": Placement(params="offload"),
    "step": Placement(grads="step"),
    "all_offload": Placement("offload", "offload", "offload"),
    "state_step_params": Placement("offload", "step", "offload"),
    "stream": Placement(optimizer="stream"),
    "stream_all": Placement("stream", "offload", "offload"),
    "stream_step_params": Placement("stream", "step", "offload"),
}


def _mlp(batch: int = 16, width: int = 32, depth: int = 3, device: str = "cpu") -> zoo.ZooModel:
    return zoo.mlp(batch_size=batch, width=width, depth=depth, seed=0, device=device)


def _train(opt_name: str, foreach: bool, placement: Placement | None, steps: int = 3, set_to_none: bool = True,
           device: str = "cpu", make_opt=None):
    zm = _mlp(device=device)
    model = zm.model
    opt = make_opt(model.parameters()) if make_opt else OPTIMIZERS[opt_name](model.parameters(), foreach)
    torch.manual_seed(123)  # dropout
    mgr = StateManager(model, opt, list(model.blocks), placement, step_in_backward=True) if placement else None
    sd_inside = None
    if mgr is not None:
        mgr.apply()
    try:
        for _ in range(steps):
            zm.loss_fn(model(*zm.inputs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
        sd_inside = opt.state_dict()
    finally:
        if mgr is not None:
            mgr.remove()
    return model, opt, sd_inside, mgr


def _assert_same_training(ref, got) -> None:
    m0, o0, sd0, _ = ref
    m1, o1, sd1, _ = got
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert torch.equal(a, b), f"parameter {n} differs"
    for (n, a), (_, b) in zip(m0.named_buffers(), m1.named_buffers(), strict=True):
        assert torch.equal(a, b), f"buffer {n} differs"
    assert _same(sd0, sd1), "opt.state_dict() inside the block differs from plain training"
    assert _same(o0.state_dict(), o1.state_dict()), "opt.state_dict() after the block differs from plain training"
