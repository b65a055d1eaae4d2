"""A model whose own training state (parameters, gradients, AdamW state) is twice the device: profiled, planned with
no budget and trained inside the limit.

transformers GPT-2 8 × 256 (random init) inside ``memopt.limit_memory`` = ½ × (parameters + gradients + AdamW state):
``memopt.profile`` makes a state-streamed profile (``meta["state_streamed"]``) without the limit ever being exceeded,
whose bytes are those of the plain step's profile made outside the limit; ``memopt.search(prof)`` with no budget plans
for the limit, and three AdamW steps under the plan are bit-identical to plain training of a copy outside the limit,
with the limit's measured peak within it through the steps, ``model.state_dict()`` and ``torch.save`` of both state
dicts inside the plan's block, and leaving the block (the state the device cannot hold stays on the host until
``memopt.bring_back``); the checkpoint saved inside holds the trained values. ``memopt.max_batch`` of ViT-Tiny's
blocks at ¾ of their training state (plain training never fits) answers a batch whose step runs inside the limit under
its plan.
"""

import copy
import io

import pytest
import torch

import memopt_nb as memopt

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

#: PPO timesteps: short (the plan need only fit, not be the fastest)
TIMESTEPS = 512


def gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=1024, n_layer=8, n_embd=256, n_head=4))
    ids = torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


def state_bytes(model):
    """Parameters, gradients and AdamW's two moments: four times the parameters' bytes."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def loss_fn(out):
    return out.loss


def train(model, opt, inputs, steps=3):
    """Three AdamW steps; the losses."""
    torch.manual_seed(5)  # GPT-2's dropout: the same draws for both runs
    return [one_step(model, opt, inputs) for _ in range(steps)]


def one_step(model, opt, inputs):
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.fixture(scope="module")
def big():
    model, inputs = gpt2()
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    limit = state_bytes(model) // 2
    buf = io.BytesIO()
    with memopt.limit_memory(limit) as lim:
        prof = memopt.profile(model, model_kwargs=inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
        profile_peak = lim.peak_bytes
        plan = memopt.search(prof, total_timesteps=TIMESTEPS)
        with memopt.plan(plan):
            losses = train(model, opt, inputs)
            step_peak = lim.peak_bytes
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            save_peak = lim.peak_bytes
        exit_peak = lim.peak_bytes
    memopt.bring_back(opt)  # outside the limit: all of it fits
    return {"model": model, "ref": ref, "inputs": inputs, "limit": limit, "prof": prof, "plan": plan,
            "profile_peak": profile_peak, "step_peak": step_peak, "save_peak": save_peak, "exit_peak": exit_peak,
            "losses": losses, "opt": opt, "checkpoint": buf}


def test_profile_is_state_streamed_inside_the_limit(big):
    prof = big["prof"]
    assert prof.meta["state_streamed"] is True
    assert "state-streamed" in prof.meta["state_streamed_why"]
    assert big["profile_peak"] <= big["limit"]
    assert prof.peak_bytes > big["limit"]  # the plain step's peak: what plain training would need


def test_streamed_bytes_are_the_plain_profiles(big):
    """Outside the limit the step fits and is profiled as always: the streamed profile's bytes are the same."""
    model, inputs = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plain = memopt.profile(model, model_kwargs=inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
    prof = big["prof"]
    assert "state_streamed" not in plain.meta
    for field in ("param_bytes", "grad_bytes", "optimizer_state_bytes", "buffer_bytes", "start_level", "input_bytes"):
        assert getattr(prof, field) == getattr(plain, field), field
    step = plain.step_segment
    assert [(s.label, s.start_level) for s in prof.segments] == [(s.label, s.start_level) for s in plain.segments]
    for i, (a, b) in enumerate(zip(prof.segments, plain.segments, strict=True)):
        if i != step:
            assert a.rel_peak == b.rel_peak, a.label
    # the step over every parameter at once never ran: its peak comes from the units' steps (one parameter at a
    # time here, AdamW's default on the CPU: the largest one's)
    assert prof.peak_bytes == max(s.start_level + s.rel_peak for s in prof.segments)
    assert prof.peak_bytes == plain.peak_bytes
    for a, b in zip(prof.units, plain.units, strict=True):
        for field in ("saved_bytes", "interior_bytes", "input_bytes", "output_bytes", "grad_bytes",
                      "optimizer_bytes", "optimizer_storages", "grads_done_extra"):
            assert getattr(a, field) == getattr(b, field), (a.name, field)
        assert [r["optimizer_bytes"] for r in a.param_steps] == [r["optimizer_bytes"] for r in b.param_steps]
    assert [(g.nbytes, g.savers) for g in prof.groups] == [(g.nbytes, g.savers) for g in plain.groups]


def test_plan_for_the_limit_trains_bit_identically_inside_it(big):
    plan = big["plan"]
    assert plan.budget_bytes <= big["limit"]
    assert big["step_peak"] <= big["limit"]
    ref_opt = torch.optim.AdamW(big["ref"].parameters(), lr=1e-3)
    ref_losses = train(big["ref"], ref_opt, big["inputs"])
    assert all(torch.equal(a, b) for a, b in zip(big["losses"], ref_losses, strict=True))
    for a, b in zip(big["model"].parameters(), big["ref"].parameters(), strict=True):
        assert torch.equal(a, b)
    for p, q in zip(big["model"].parameters(), big["ref"].parameters(), strict=True):
        sa, sb = big["opt"].state[p], ref_opt.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_checkpoint_inside_the_block_and_leaving_it_stay_inside_the_limit(big):
    assert big["save_peak"] <= big["limit"] and big["exit_peak"] <= big["limit"]
    big["checkpoint"].seek(0)
    ck = torch.load(big["checkpoint"], weights_only=True)
    for (name, a), b in zip(ck["model"].items(), big["model"].state_dict().values(), strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b), name
    fresh, _ = gpt2()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh.load_state_dict(ck["model"])
    fresh_opt.load_state_dict(ck["opt"])
    for p, q in zip(fresh.parameters(), big["model"].parameters(), strict=True):
        sa, sb = fresh_opt.state[p], big["opt"].state[q]
        assert all(torch.equal(sa[k], sb[k]) for k in sb)


def vit_builder(b):
    """ViT-Tiny's blocks (memopt's zoo) on 16 patches and a class token: ``(model, inputs, loss_fn, AdamW)``."""
    z = memopt.zoo.vit_tiny(batch_size=b, image=32, patch=8, seed=0)
    return z.model, z.inputs, z.loss_fn, torch.optim.AdamW(z.model.parameters(), lr=1e-3)


@pytest.mark.slow
def test_max_batch_below_the_training_state_answers_a_batch_whose_step_runs_inside_it():
    """Plain training never fits: every profile is state-streamed. The answer's step, run again under its plan,
    stays inside the limit."""
    limit = int(0.75 * state_bytes(vit_builder(1)[0]))
    with memopt.limit_memory(limit):
        res = memopt.max_batch(vit_builder, optimizer=torch.optim.AdamW)
    assert res.plain.batch is None
    assert res.batch is not None and res.batch >= 1
    assert res.verified["batch"] == res.batch and res.verified["peak_bytes"] <= limit
    model, inputs, loss_fn, opt = vit_builder(res.batch)
    with memopt.plan(res.plan, model, optimizer=opt), memopt.limit_memory(limit) as lim:
        for _ in range(2):
            loss_fn(model(*inputs)).backward()
            opt.step()
            opt.zero_grad()
        peak = lim.peak_bytes
    assert peak <= limit
