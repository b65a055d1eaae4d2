"""Known gap (found by benchmarks/whole_step.py --floor): on a transformers GPT-2, the predicted peak of recompute-all
is below the measured one (4.41 MiB predicted, 4.66 MiB measured on this config: 256 KiB), so the whole-step floor
plan, which recomputes every block, measures 8-12% above its 2.03 MiB prediction. Keep-all is exact; the state
placements add no error of their own (the gap is the same with every placement resident)."""

from __future__ import annotations

import pytest
import torch

import memopt_nb as memopt
from memopt_nb.plan import Plan


@pytest.mark.xfail(reason="recompute-all peak of transformers GPT-2 under-predicted by 256 KiB (issue 11 bench)",
                   strict=False)
def test_gpt2_recompute_all_peak_predicted_exactly():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=128, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))

    def loss_fn(out):
        return out.logits.float().pow(2).mean()

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, ids, loss_fn=loss_fn, optimizer=opt, repeats=1)
    plan = Plan.uniform(prof, "recompute")
    predicted = memopt.simulate(prof, plan).peak_bytes
    measured = memopt.measure(model, ids, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1).peak_bytes
    assert predicted == measured
