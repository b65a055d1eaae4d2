"""With no budget, plans are made for what the device can still give the step, not its whole capacity.

The user's model, its AdamW state, a saved copy of its parameters and an unrelated tensor stay on the device (the
emulated one, ``memopt.limit_memory`` at 60 % of the step's unplanned peak). ``memopt.search(prof)`` and
``memopt.solvers.optimal(prof)`` with no budget plan for the limit less what those other tensors hold, say so in
``plan.meta["budget_source"]``, and two steps under each plan run inside the limit with the tensors still alive; a plan
for the whole limit does not. ``memopt.max_batch(builder, optimizer=AdamW)`` with no budget answers a batch whose step
runs there too, and its notes say what it planned for. With nothing else held, the budget is the limit, as before.
"""

import gc

import pytest
import torch
from helpers.does_not_fit import train
from IPython.core.error import UsageError

import memopt_nb as memopt
from memopt_nb.planners.checks import default_budget

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

#: the share of the unplanned peak the emulated device holds
SHARE = 0.6
#: the unrelated tensor the notebook keeps on the device, as a share of the limit
OTHER_SHARE = 0.1
#: PPO timesteps: short (the plan need only fit, not be the fastest)
TIMESTEPS = 512


def gpt2_builder(n_layer=3, n_embd=64, seq=64, vocab=1000):
    """transformers GPT-2 (random init): ``build(b) -> (model, inputs, loss_fn, AdamW)``, the same weights each call;
    the labels are an input, so the loss holds no tensor of its own."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab, n_positions=seq)

    def build(b):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, vocab, (b, seq), generator=torch.Generator().manual_seed(1))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        return model, inputs, lambda out: out.loss, torch.optim.AdamW(model.parameters(), lr=1e-3)

    return build


def vit_builder(b):
    z = memopt.zoo.vit_tiny(batch_size=b, image=64, patch=8, seed=0)  # ViT-Tiny's blocks, 64 patches + class token
    return z.model, z.inputs, z.loss_fn, torch.optim.AdamW(z.model.parameters(), lr=1e-3)


def vit_batch_fn(b):  # the loss holds the targets: inputs and loss at batch b
    _, inputs, loss_fn, _ = vit_builder(b)
    return inputs, loss_fn


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def split(inputs):
    return ((), inputs) if isinstance(inputs, dict) else (inputs, {})


def unplanned_peak(build, want):
    model, inputs, loss_fn, opt = build(want)
    args, kwargs = split(inputs)
    peak = memopt.measure(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt, steps=1).peak_bytes
    del model, opt
    gc.collect()
    return peak


def with_other_tensors_held(build, want, batch_fn=None):
    """The whole check at batch ``want``: the user's trained model, its AdamW state, a copy of its parameters and an
    unrelated tensor on the device; plans with no budget, and steps under them, inside the limit."""
    limit = int(SHARE * unplanned_peak(build, want))
    model, inputs, loss_fn, opt = build(want)
    args, kwargs = split(inputs)
    train(model, inputs, loss_fn, opt, 1)  # trained (outside the limit): its AdamW state exists
    with memopt.limit_memory(limit) as lim:
        saved = [p.detach().clone() for p in model.parameters()]  # reads the model: the limit counts its state too
        other = torch.zeros(int(OTHER_SHARE * limit) // 4)
        prof = memopt.profile(model, *args, model_kwargs=kwargs, loss_fn=loss_fn, optimizer=opt, repeats=1,
                              batch_fn=batch_fn)
        free = default_budget(prof)
        # what the others hold, and no more: the model's own state and the inputs are in the profile already
        others = nbytes(saved) + nbytes([other])
        assert others <= free.held_bytes <= others + 64 * 1024, (free, others)
        assert free.capacity_bytes == limit and free.free_bytes == limit - free.held_bytes

        plans = {"search": memopt.search(prof, total_timesteps=TIMESTEPS), "optimal": memopt.solvers.optimal(prof)}
        for name, plan in plans.items():
            assert plan.budget_bytes == free.free_bytes and plan.predicted_peak_bytes <= free.free_bytes, name
            assert plan.meta["budget_source"] == free.to_meta() and "held by other tensors" in free.line()
            with memopt.plan(plan):
                train(model, inputs, loss_fn, opt, 2)  # no OutOfMemoryError: the others are still alive
        assert lim.peak_bytes <= limit

        # the control: a plan for the whole limit, as before, runs out of memory with the others alive
        whole = memopt.solvers.optimal(prof, limit)
        assert whole.predicted_peak_bytes > free.free_bytes
        with pytest.raises(torch.OutOfMemoryError), memopt.plan(whole):
            train(model, inputs, loss_fn, opt, 1)
        opt.zero_grad()

        res = memopt.max_batch(build, optimizer=torch.optim.AdamW)
        # the builder's model is a new one: the user's model and its AdamW state are held by others there too
        assert res.budget_bytes < free.free_bytes
        assert any(n.startswith("planning for ") and "held by other tensors" in n for n in res.notes), res.notes
        assert res.verified["batch"] == res.batch and res.verified["peak_bytes"] <= res.budget_bytes
        m, ins, lf, o = build(res.batch)
        with memopt.plan(res.plan, m, optimizer=o):
            train(m, ins, lf, o, 2)
        assert saved[0].data_ptr() and other.numel()  # held through every step above
    assert lim.peak_bytes <= limit
    return {"limit": limit, "held": free.held_bytes, "max_batch": res.batch}


def test_gpt2_plans_for_what_is_free():
    with_other_tensors_held(gpt2_builder(), 16)


@pytest.mark.slow
def test_gpt2_6x192_plans_for_what_is_free():
    print(with_other_tensors_held(gpt2_builder(n_layer=6, n_embd=192, seq=128), 16))


@pytest.mark.slow
def test_vit_tiny_plans_for_what_is_free():
    print(with_other_tensors_held(vit_builder, 64, vit_batch_fn))


def test_with_nothing_else_held_the_budget_is_the_limit():
    """Nothing but the step's own tensors on the device: the budget is the limit, as it was."""
    build = gpt2_builder(n_layer=2, n_embd=64, seq=32, vocab=256)
    limit = int(SHARE * unplanned_peak(build, 8))
    model, inputs, loss_fn, opt = build(8)
    with memopt.limit_memory(limit):
        prof = memopt.profile(model, model_kwargs=inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
        free = default_budget(prof)
        assert (free.free_bytes, free.held_bytes, free.capacity_bytes) == (limit, 0, limit)
        assert free.line().endswith("(nothing else held on it)")
        plan = memopt.solvers.optimal(prof)
        assert plan.budget_bytes == limit and plan.meta["budget_source"]["free_bytes"] == limit
        # a preset is planned for its capacity, whatever this device holds
        held = torch.zeros(limit // 8)
        gpu = memopt.solvers.optimal(prof, device="a100-40gb")
        assert gpu.budget_bytes == memopt.DeviceSpec.preset("a100-40gb").capacity_bytes
        assert gpu.meta["budget_source"]["source"] == "capacity" and held.numel()
    # outside every limit the emulated device's capacity is the host's memory, nothing known to be held: as before
    free = default_budget(prof)
    assert (free.free_bytes, free.held_bytes, free.source) == (limit, 0, "capacity")


def test_plan_magic_without_a_budget_plans_for_what_is_free(ipython_shell, capsys):
    """``%memopt_plan prof`` with no ``--budget`` inside the limit: the first line says what it plans for, and the plan
    is made for it; outside the limit, a profile of the emulated device's host memory still needs ``--budget``."""
    ip = ipython_shell
    ip.run_line_magic("load_ext", "memopt_nb")
    try:
        ip.run_cell(
            "import torch\nimport memopt_nb as memopt\n"
            "z = memopt.zoo.gpt(batch_size=4, seq_len=32, d_model=32, n_layers=2, n_heads=2)\n"
            "opt = torch.optim.Adam(z.model.parameters())\n"
            "lim = memopt.limit_memory(2 * memopt.measure(z.model, *z.inputs, loss_fn=z.loss_fn, optimizer=opt)"
            ".peak_bytes)\n"
            "with lim:\n"
            "    pf = memopt.profile(z.model, *z.inputs, loss_fn=z.loss_fn, optimizer=opt, repeats=1)\n"
            "    held = torch.zeros(lim.limit_bytes // 16)\n"
            "    free = memopt.planners.checks.default_budget(pf)\n"
            "    %memopt_plan pf --timesteps 96 --no-widget -o pfree\n"
        ).raise_error()
        out = capsys.readouterr().out
        free, plan = ip.user_ns["free"], ip.user_ns["pfree"]
        assert free.held_bytes >= 4 * ip.user_ns["held"].numel() and free.free_bytes < free.capacity_bytes
        assert f"memopt: {free.line()}" in out and "held by other tensors" in out
        assert plan.budget_bytes == free.free_bytes and plan.meta["budget_source"]["line"] == free.line()
        ip.run_line_magic("memopt_profile", "z.model *z.inputs --loss z.loss_fn --optimizer opt --repeats 1 -q -o host")
        with pytest.raises(UsageError, match="needs --budget"):
            ip.run_line_magic("memopt_plan", "host --timesteps 96")
    finally:
        ip.run_line_magic("unload_ext", "memopt_nb")
