"""A step that does not fit, on models this project did not write: HF GPT-2 (6 layers, batch 16 x 128 tokens) and a
timm's ViT-Tiny (32 px images in 8 px patches, batch 64), AdamW, on a device of 60 % of their unplanned peak
(``memopt.limit_memory``).

For each: the unplanned step runs out of memory and leaves the parameters as they were; ``memopt.profile`` succeeds
(extrapolated from smaller batches) and predicts the unplanned peak within 2 % of the peak measured without the limit;
``memopt.search(prof)`` with no budget plans for the device and three steps under its plan run inside it, bit for bit
the losses, parameters and optimizer state of unplanned training without the limit; ``memopt.max_batch`` answers a
batch at least as big, and a step at it under its plan runs inside the limit.
"""

import gc

import pytest
import torch
from helpers.does_not_fit import assert_same, snapshot, train

import memopt_nb as memopt

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning")]

#: the share of the unplanned peak the emulated device holds
SHARE = 0.6
#: how far the extrapolated profile's unplanned peak may be from the one measured without the limit
PEAK_TOLERANCE = 0.02
#: PPO timesteps for the search: short, as the tests' other searches (the plan need only fit, not be the fastest)
TIMESTEPS = 1024


def does_not_fit(build, want, batch_fn=None):
    """The whole check for ``build(b) -> (model, inputs, loss_fn, optimizer)`` (the same weights at every call;
    ``inputs`` a dict of keyword or a tuple of positional inputs) at the batch ``want``. Returns what it measured."""
    model, inputs, loss_fn, opt = build(want)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    peak = memopt.measure(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt, steps=1).peak_bytes
    limit = int(SHARE * peak)
    del model, opt
    gc.collect()

    # the unplanned step does not fit, and changes nothing
    model, inputs, loss_fn, opt = build(want)
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})  # this batch: profile and train on it
    before = [p.detach().clone() for p in model.parameters()]
    with memopt.limit_memory(limit):
        with pytest.raises(torch.OutOfMemoryError):
            train(model, inputs, loss_fn, opt, 1)
    opt.zero_grad()  # the failed backward's partial gradients, as a loop that catches the error drops them
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert not opt.state

    # profile past the limit, plan for the device, train inside it
    with memopt.limit_memory(limit) as lim:
        prof = memopt.profile(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt, repeats=1,
                              batch_fn=batch_fn)
        assert prof.meta["method"] == "extrapolated" and prof.meta["extrapolation"]["requested_batch"] == want
        predicted = memopt.simulate(prof, memopt.solvers.none(prof)).peak_bytes
        for p in (prof.peak_bytes, predicted):
            assert abs(p - peak) <= PEAK_TOLERANCE * peak, (p, peak)
        plan = memopt.search(prof, total_timesteps=TIMESTEPS)  # no budget: what the device has free, the limit less
        # what the loss holds (its targets, not in the profile): nothing else is on the device
        src = plan.meta["budget_source"]
        assert src["capacity_bytes"] == limit and plan.budget_bytes == src["free_bytes"] >= limit - 64 * 1024
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        torch.manual_seed(1)
        with memopt.plan(plan):
            losses = train(model, inputs, loss_fn, opt, 3)
    assert lim.peak_bytes <= limit
    got = snapshot(model, opt)
    del model, opt
    gc.collect()
    ref_model, ref_inputs, ref_loss_fn, ref_opt = build(want)  # the same weights and batch, no limit, no plan
    torch.manual_seed(1)
    assert train(ref_model, ref_inputs, ref_loss_fn, ref_opt, 3) == losses
    assert_same(snapshot(ref_model, ref_opt), got)
    del ref_model, ref_opt
    gc.collect()

    # how big a batch fits the device, and a step at it under its plan inside the limit
    with memopt.limit_memory(limit):
        res = memopt.max_batch(build)
    assert res.budget_bytes == limit and res.batch >= want > res.plain.batch, repr(res)
    assert res.verified["batch"] == res.batch and res.verified["peak_bytes"] <= limit
    model, inputs, loss_fn, opt = build(res.batch)
    with memopt.limit_memory(limit) as lim, memopt.plan(res.plan, model, optimizer=opt):
        train(model, inputs, loss_fn, opt, 1)
    assert lim.peak_bytes <= limit
    return {"peak": peak, "limit": limit, "profiled_peak": prof.peak_bytes, "plan_peak": plan.predicted_peak_bytes,
            "max_batch": res.batch, "plain_max_batch": res.plain.batch, "max_batch_seconds": res.seconds}


# ---------------------------------------------------------------------- HF GPT-2, 6 layers, batch 16 x 128 tokens
def test_hf_gpt2_does_not_fit_then_trains_bit_for_bit():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=256, n_positions=128)

    def build(b):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, cfg.vocab_size, (b, 128), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        return model, inputs, lambda out: out.loss, torch.optim.AdamW(model.parameters(), lr=1e-3)

    out = does_not_fit(build, 16)  # profiled from slices of the inputs (the labels are an input)
    print("gpt2", out)


# ---------------------------------------------------------------------- timm's ViT-Tiny, batch 64
def test_vit_tiny_does_not_fit_then_trains_bit_for_bit():
    import real_timm

    def build(b):  # timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8): 16 patches + class token
        model, inputs, loss_fn = real_timm.vit_tiny(batch=b, image=32, patch=8)
        return model, inputs, loss_fn, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def batch_fn(b):  # the loss holds the targets: inputs and loss at batch b
        _, inputs, loss_fn, _ = build(b)
        return inputs, loss_fn

    out = does_not_fit(build, 64, batch_fn)
    print("vit_tiny", out)
