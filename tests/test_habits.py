"""Training habits of people who did not write this project, each compared with the same training without a plan.

Each habit either trains exactly as it does without a plan (losses, parameters, buffers, optimizer state bit for bit)
or is refused with a memopt error that says what to do, before anything changed. The habits: a graph built inside
``with memopt.plan(p):`` and backpropagated after it, with parameters offloaded; peft's LoRA adapters (a frozen base
layer inside an offloaded unit); an optimizer the profile did not see (``AdamW(fused=True)``, as
``transformers.Trainer`` builds by default); the first profile of a process and torch's global random stream; an
exception in the middle of a backward that steps units; an LR scheduler made after profiling; a loss function that
calls another model (a GAN's discriminator); a plan file edited by hand and a budget written as ``1.5``.
"""

from __future__ import annotations

import contextlib
import json
import os

import helpers.whole_step as ws
import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.core.errors import BudgetError, PlanError
from memopt_nb.core.plan import Plan
from memopt_nb.runtime import detect as device_module
from memopt_nb.runtime.state import StepInBackwardError

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIMIZER_OFFLOADED = [("keep", "offload", "resident", "resident")]


def _mlp():
    return ws._build("mlp")


# ---------------------------------------------------------------------- 4: profile and the global random stream
def test_the_first_profile_of_a_process_leaves_the_global_random_stream_where_it_was(monkeypatch):
    """Device detection (the first profile's) draws random matrices; "profile, then train" must draw the same dropout
    masks as "train"."""
    monkeypatch.setattr(device_module, "_CPU_CACHE", {})  # as in a fresh process: the device is measured again
    zm = _mlp()
    torch.manual_seed(0)
    expected = torch.rand(8)
    torch.manual_seed(0)
    memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, repeats=1)
    assert torch.equal(torch.rand(8), expected)


# ---------------------------------------------------------------------- 6: a scheduler made after profiling
def _scheduled(planned: bool):
    zm = _mlp()
    model = zm.model
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    plan = None
    if planned:
        prof = memopt.profile(model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
        plan = ws._whole(Plan.uniform(prof, "keep"), OPTIMIZER_OFFLOADED, opt=opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # after profiling: adds initial_lr
    return ws.train_loop(model, opt, plan, lambda m: zm.loss_fn(m(*zm.inputs)), after_step=lambda m: sched.step())


def test_a_scheduler_made_after_profiling_is_accepted_and_trains_as_without_the_plan():
    ref, got = _scheduled(False), _scheduled(True)
    ws._assert_same_training(ref, got)
    assert got[2]["stats"]["state_d2h_bytes"] > 0
    assert got[1].param_groups[0]["lr"] == pytest.approx(1e-3 / 8)


def test_another_optimizer_is_still_refused_by_its_difference():
    zm = _mlp()
    opt = torch.optim.SGD(zm.model.parameters(), lr=1e-3, momentum=0.9)
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
    plan = ws._whole(Plan.uniform(prof, "keep"), OPTIMIZER_OFFLOADED, opt=opt)
    other = torch.optim.SGD(zm.model.parameters(), lr=1e-3, momentum=0.0)
    torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(PlanError, match="momentum 0.9 in the plan, 0.0 here"):
        memopt.plan(plan, zm.model, optimizer=other).apply()


# ---------------------------------------------------------------------- 7: a loss that calls another model
class _Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.fc(x)))))


@pytest.mark.parametrize("call", ["profile", "measure", "measure_no_warmup"])
def test_profiling_a_generator_judged_by_a_discriminator_leaves_the_discriminator_as_it_was(call):
    zm = _mlp()  # the generator: its output (10 features) is what the discriminator judges
    torch.manual_seed(0)
    disc = _Discriminator()
    disc.fc.weight.grad = torch.full_like(disc.fc.weight, 0.5)  # a gradient the loop has not cleared yet
    held = disc.fc.weight.grad
    disc.bn.eval()  # and a submodule in another mode than its parent
    before = {k: v.clone() for k, v in disc.state_dict().items()}
    loss_fn = lambda out: disc(out).mean()  # noqa: E731
    if call == "profile":
        memopt.profile(zm.model, *zm.inputs, loss_fn=loss_fn, repeats=1)
    else:
        opt = torch.optim.Adam(zm.model.parameters())
        memopt.measure(zm.model, *zm.inputs, loss_fn=loss_fn, optimizer=opt, steps=1,
                       warmup=0 if call == "measure_no_warmup" else 1)
    after = disc.state_dict()
    assert list(before) == list(after)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed"
    assert disc.fc.weight.grad is held and torch.equal(held, torch.full_like(held, 0.5))
    assert all(p.grad is None for n, p in disc.named_parameters() if n != "fc.weight")
    assert disc.training and not disc.bn.training


# ---------------------------------------------------------------------- 8: a plan file edited by hand; budget 1.5
def test_a_plan_file_with_an_edited_unit_name_is_refused_naming_the_unit(tmp_path):
    prof = ws._profile("mlp")
    path = tmp_path / "plan.json"
    Plan.uniform(prof, "recompute").save(path)
    data = json.loads(path.read_text())
    data["decisions"][2]["unit"] = "blocks.9"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as err:
        Plan.load(path)
    assert "'blocks.9'" in str(err.value) and "'blocks.2'" in str(err.value) and "unit 2" in str(err.value)


@pytest.mark.parametrize(("budget", "meant"), [(1.5, "150%"), ("2.0", "200%"), (10.0, "1000%")])
def test_a_budget_written_as_a_share_above_one_is_refused_with_what_was_meant(budget, meant):
    prof = ws._profile("mlp")
    with pytest.raises(BudgetError) as err:
        memopt.search(prof, budget=budget)
    assert f"did you mean '{meant}'" in str(err.value)
    assert "floor" not in str(err.value)
    with pytest.raises(BudgetError, match="did you mean"):
        memopt.solvers.optimal(prof, budget=budget)


@contextlib.contextmanager
def _nothing():
    yield None


# ---------------------------------------------------------------------- 3: an optimizer the profile did not see
def _profiled_mlp(rows, step_in_backward: bool = False):
    zm = _mlp()
    seen = torch.optim.AdamW(zm.model.parameters(), lr=1e-2)
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=seen, repeats=1)
    plan = ws._whole(Plan.uniform(prof, "keep"), rows, step_in_backward=step_in_backward, opt=seen)
    return zm, seen, plan


@pytest.mark.parametrize("rows", ["mixed", "mixed_step"])
@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}, {}], ids=["fused", "foreach", "single"])
def test_an_optimizer_made_after_profiling_is_refused_before_it_steps(kernel, rows):
    """``AdamW(fused=True)`` made after profiling and stepped under ``with memopt.plan(p):`` (which manages the
    optimizer the profile saw) trained differently from the second step on; it is refused at its first step, with
    nothing stepped (units already stepped in backward put back), and the loop goes on without the plan as if the
    refused step had not been tried."""
    step = rows == "mixed_step"
    zm, seen, plan = _profiled_mlp(ws.MIXED_STEP if step else ws.MIXED, step_in_backward=step)
    model = zm.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **kernel)
    with pytest.raises(PlanError) as err:
        with memopt.plan(plan):
            zm.loss_fn(model(*zm.inputs)).backward()
            opt.step()
    text = str(err.value)
    assert "optimizer=opt" in text and "optimizers=(opt, None)" in text and "'blocks.0'" in text
    assert ("fused=True" in text) == ("fused" in kernel)
    for n, p in model.named_parameters():
        assert type(p) is nn.Parameter and torch.equal(p, before[n]), f"{n} was changed"
    assert not opt.state and not seen.state
    opt.step()  # the refused step, now without the plan (plain training's gradients are there, except stepped ones)
    ref = _mlp()
    ref_opt = torch.optim.AdamW(ref.model.parameters(), lr=1e-2, **kernel)
    ref.loss_fn(ref.model(*ref.inputs)).backward()
    if step:  # the units stepped in backward have no gradient left: plain training restricted to the others
        for p, q in zip(ref.model.parameters(), model.parameters(), strict=True):
            if q.grad is None:
                p.grad = None
    ref_opt.step()
    for (n, a), (_, b) in zip(ref.model.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_the_optimizer_the_plan_was_made_for_trains_fused_as_without_the_plan():
    def run(planned: bool):
        zm = _mlp()
        opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-2, fused=True)
        plan = None
        if planned:
            prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
            plan = ws._whole(Plan.uniform(prof, "keep"), ws.MIXED, opt=opt)
        return ws.train_loop(zm.model, opt, plan, lambda m: zm.loss_fn(m(*zm.inputs)))

    ws._assert_same_training(run(False), run(True))


def test_transformers_trainer_with_its_default_optimizer_is_refused_saying_how_to_pass_one():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tempfile

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=gen)} for _ in range(4)]
    for row in data:
        row["labels"] = row["input_ids"].clone()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    profiled = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = data[0]["input_ids"][None].repeat(2, 1)
    prof = memopt.profile(model, loss_fn=lambda out: out.loss, optimizer=profiled, repeats=1, input_ids=ids,
                          labels=ids)
    rows = [("keep", "offload", "offload", "offload") if u.param_bytes else ("keep",) + ("resident",) * 3
            for u in prof.units]
    plan = ws._whole(Plan.uniform(prof, "keep"), rows, opt=profiled)
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], max_steps=2,
                                          per_device_train_batch_size=2, use_cpu=True, save_strategy="no",
                                          logging_strategy="no", seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)  # its own optimizer, made in train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=r"optimizers=\(opt, None\)"):
        with memopt.plan(plan):
            trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---------------------------------------------------------------------- 5: an exception mid-backward, step in backward
class _Stop(Exception):
    pass


def _skipping_a_bad_batch(planned: bool, where: str, leave: bool = False, rows: str = "mixed_step",
                          skip: bool = True):
    """Three AdamW steps of the zoo MLP; the second one's backward raises (in ``blocks.1``'s backward, after
    ``blocks.3`` and ``blocks.2``; or at the input layer, after every block) and the loop skips that batch with
    ``opt.zero_grad()``. Under the plan, units 0 and 2 step in backward (``MIXED_STEP``: unit 0's state offloaded,
    unit 2's parameters; ``rows="mixed"``: none steps in backward). ``leave``: the exception leaves the block instead
    (the loop stops there). ``skip=False``: no ``zero_grad()`` after the failure, the next batch accumulates onto
    what the failed backward left (only without a step in backward)."""
    zm = _mlp()
    model = zm.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    armed = [False]

    def fail(*args):
        if armed[0]:
            raise _Stop("bad batch")

    if where == "block":
        handle = model.blocks[1].register_full_backward_hook(fail)
    else:
        handle = model.inp.weight.register_hook(fail)
    step = rows == "mixed_step"
    plan = ws._whole(Plan.uniform(ws._profile("mlp"), "keep"), ws.MIXED_STEP if step else ws.MIXED,
                     step_in_backward=step, opt=opt)
    applied = memopt.plan(plan, model, optimizer=opt) if planned else contextlib.nullcontext()
    torch.manual_seed(11)
    losses = []
    with contextlib.suppress(_Stop), applied:
        for i in range(3):
            armed[0] = i == 1
            loss = zm.loss_fn(model(*zm.inputs))
            losses.append(loss.detach().clone())
            try:
                loss.backward()
                opt.step()
            except _Stop:
                if leave:
                    raise
                if not skip:
                    continue
            opt.zero_grad()
    handle.remove()
    return model, opt, losses, applied.stats if planned else None


@pytest.mark.parametrize("rows", ["mixed_step", "mixed"])
@pytest.mark.parametrize("where", ["block", "input"])
def test_an_exception_mid_backward_puts_back_the_units_stepped_and_the_batch_can_be_skipped(where, rows):
    (m0, o0, l0, _), (m1, o1, l1, stats) = (_skipping_a_bad_batch(False, where, rows=rows),
                                            _skipping_a_bad_batch(True, where, rows=rows))
    assert stats.get("steps_in_backward_undone", 0) == (0 if rows == "mixed" else 1 if where == "block" else 2)
    assert stats["grad_d2h_bytes"] > 0 and stats["param_h2d_bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True)) and len(l1) == 3
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert type(b) is nn.Parameter and torch.equal(a, b), f"parameter {n} differs"
    assert ws._same(o0.state_dict(), o1.state_dict())


@pytest.mark.parametrize("where", ["block", "input"])
def test_after_an_exception_mid_backward_the_next_batch_may_accumulate_onto_what_it_left(where):
    """Without a step in backward, a failed backward leaves partial gradients (some offloaded); plain training's next
    backward adds to them, and so does the plan's (its end-of-backward bookkeeping is redone for the failed one)."""
    (m0, o0, l0, _), (m1, o1, l1, stats) = (_skipping_a_bad_batch(False, where, rows="mixed", skip=False),
                                            _skipping_a_bad_batch(True, where, rows="mixed", skip=False))
    assert stats["grad_d2h_bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True)) and len(l1) == 3
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert type(b) is nn.Parameter and torch.equal(a, b), f"parameter {n} differs"
    assert ws._same(o0.state_dict(), o1.state_dict())


def test_without_the_undo_copies_a_failed_backward_still_refuses_zero_grad(monkeypatch):
    """``UNDO_STEPS_IN_BACKWARD = False`` (no host copies before a step in backward): the units a failed backward
    stepped stay updated, and ``opt.zero_grad()`` says so instead of silently skipping the batch."""
    from memopt_nb.runtime import state

    monkeypatch.setattr(state, "UNDO_STEPS_IN_BACKWARD", False)
    with pytest.raises(StepInBackwardError, match="already stepped"):
        _skipping_a_bad_batch(True, "input")


def test_an_exception_mid_backward_leaving_the_block_leaves_the_model_as_plain_training_does():
    (m0, o0, _, _), (m1, o1, l1, stats) = (_skipping_a_bad_batch(False, "input", leave=True),
                                            _skipping_a_bad_batch(True, "input", leave=True))
    assert stats["steps_in_backward_undone"] == 2 and len(l1) == 2
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert type(b) is nn.Parameter and torch.equal(a, b), f"parameter {n} differs"
    assert ws._same(o0.state_dict(), o1.state_dict())
    o1.zero_grad()  # and the loop may go on without the plan


def _failed_then_skipped(planned: bool):
    """A backward that raises after every block (units 0 and 2 stepped in it), then, under the plan, ``opt.step()``
    and a forward without ``zero_grad()`` (refused), then the batch skipped and one good step."""
    zm = _mlp()
    model = zm.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = model.inp.weight.register_hook(lambda g: (_ for _ in ()).throw(_Stop("bad batch")))
    plan = ws._whole(Plan.uniform(ws._profile("mlp"), "keep"), ws.MIXED_STEP, step_in_backward=True, opt=opt)
    torch.manual_seed(11)  # dropout
    with memopt.plan(plan, model, optimizer=opt) if planned else contextlib.nullcontext():
        with pytest.raises(_Stop):
            zm.loss_fn(model(*zm.inputs)).backward()
        handle.remove()
        if planned:
            with pytest.raises(StepInBackwardError, match=r"failed partway.*opt.zero_grad\(\)"):
                opt.step()
            with pytest.raises(StepInBackwardError, match="failed partway"):
                model(*zm.inputs)
        opt.zero_grad()
        zm.loss_fn(model(*zm.inputs)).backward()
        opt.step()
    return model, opt


def test_after_a_failed_backward_a_step_or_forward_without_zero_grad_is_refused_saying_so():
    (m0, o0), (m1, o1) = _failed_then_skipped(False), _failed_then_skipped(True)
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert ws._same(o0.state_dict(), o1.state_dict())


# ---------------------------------------------------------------------- 2: LoRA adapters in offloaded units
class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # post-norm: the frozen base weight is the last thing the block's backward needs, after every gradient
        return self.norm(x + self.drop(torch.nn.functional.gelu(self.proj(x))))


class _Net(nn.Module):
    def __init__(self, d: int = 32, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _lora(device: str = "cpu"):
    """peft's LoRA (rank 4) on every block's ``proj``: the base weights frozen, the adapters trained. ``lora_B``
    starts at random, not peft's zeros, so that the first step already changes both adapters."""
    try:
        import peft
    except ImportError:  # make install installs it; under CI a missing peft fails instead of skipping
        if os.environ.get("CI"):
            raise
        pytest.skip("peft is not installed")
    torch.manual_seed(0)
    model = peft.get_peft_model(_Net(), peft.LoraConfig(r=4, lora_alpha=4, target_modules=["proj"], lora_dropout=0.0,
                                                        init_lora_weights="gaussian"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    model = model.to(device)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1)).to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, x, opt


def _lora_loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


LORA_ROWS = {
    "params_offloaded": ([("keep", "resident", "resident", "offload")], False),
    "all_offloaded_recompute": ([("recompute", "offload", "offload", "offload")], False),
    "mixed": (ws.MIXED, False),
    "mixed_step": (ws.MIXED_STEP, True),
}


@pytest.mark.parametrize("rows", list(LORA_ROWS))
def test_lora_adapters_with_parameters_offloaded_train_as_without_the_plan(rows, device="cpu"):
    """The frozen base weight of an offloaded unit was freed as soon as the adapter's gradients were complete, while
    backward still needed it for the input's gradient ("setStorage ... out of bounds for storage of size 0")."""
    placement, step = LORA_ROWS[rows]

    def run(planned: bool):
        model, x, opt = _lora(device)
        plan = None
        if planned:
            prof = memopt.profile(model, x, loss_fn=_lora_loss, optimizer=opt, repeats=1)
            plan = ws._whole(Plan.uniform(prof, "keep"), placement, step_in_backward=step, opt=opt)
        return ws.train_loop(model, opt, plan, lambda m: _lora_loss(m(x)))

    ref, got = run(False), run(True)
    ws._assert_same_training(ref, got, stepped=step)
    assert got[2]["stats"]["param_h2d_bytes"] > 0
    base = [p for n, p in got[0].named_parameters() if ".base_layer." in n]
    assert base and not any(p.requires_grad for p in base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", list(LORA_ROWS))
def test_cuda_lora_adapters_with_parameters_offloaded_train_as_without_the_plan(rows):  # pragma: no cover - GPU
    """The LoRA test on CUDA: frozen base weights brought back on the side stream (``benchmarks/cuda_check.py
    --pytest``)."""
    test_lora_adapters_with_parameters_offloaded_train_as_without_the_plan(rows, device="cuda")


def test_the_exact_planners_lora_plan_trains_as_without_it_at_the_predicted_peak():
    model, x, opt = _lora()
    prof = memopt.profile(model, x, loss_fn=_lora_loss, optimizer=opt, repeats=1)
    plan = memopt.solvers.optimal(prof, budget="50%")
    assert plan.state_counts()["params"] > 0
    measured = memopt.measure(model, x, loss_fn=_lora_loss, optimizer=opt, plan=plan, steps=2)
    assert measured.peak_bytes == plan.predicted_peak_bytes
    ref = _lora()
    got = _lora()
    ws._assert_same_training(ws.train_loop(ref[0], ref[2], None, lambda m: _lora_loss(m(ref[1]))),
                             ws.train_loop(got[0], got[2], plan, lambda m: _lora_loss(m(got[1]))))


# ---------------------------------------------------------------------- 1: graph built in the block, backward after
GRAPH_ROWS = {
    "params_offloaded": ([("keep", "resident", "resident", "offload")], False),
    "recompute_params_offloaded": ([("recompute", "resident", "resident", "offload")], False),
    "all_offloaded": ([("keep", "offload", "offload", "offload")], False),
    "mixed": (ws.MIXED, False),
    "mixed_step": (ws.MIXED_STEP, True),
}


def _backward_after_the_block(name: str, rows, step: bool, planned: bool):
    """Two AdamW steps, each with the forward (the graph) built inside ``with memopt.plan(p):`` and ``backward()`` and
    ``opt.step()`` after the block; then a third, plain step (the model must still be usable)."""
    zm = ws._build(name)
    model = zm.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = ws._whole(Plan.uniform(ws._profile(name), "keep"), rows, step_in_backward=step, opt=opt)
    torch.manual_seed(11)  # dropout
    losses, stats = [], {}
    for _ in range(2):
        with memopt.plan(plan, model, optimizer=opt) if planned else contextlib.nullcontext() as applied:
            loss = zm.loss_fn(model(*zm.inputs))
        if applied is not None:
            stats = applied.stats
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    losses.append(zm.loss_fn(model(*zm.inputs)).detach())
    return model, opt, losses, stats


@pytest.mark.parametrize(("name", "rows"), [("mlp", r) for r in GRAPH_ROWS] + [("gpt", "mixed")])
def test_a_graph_built_in_the_block_is_backpropagated_after_it_as_without_the_plan(name, rows):
    """With parameters offloaded this raised "cannot schedule new futures after shutdown" from the backward after the
    block (the plan's hooks on the graph still ran, on a closed copy engine) and left the model unusable."""
    import threading

    placement, step = GRAPH_ROWS[rows]
    threads = threading.active_count()
    (m0, o0, l0, _), (m1, o1, l1, stats) = (_backward_after_the_block(name, placement, step, False),
                                            _backward_after_the_block(name, placement, step, True))
    assert stats.get("param_h2d_bytes", 0) > 0 or stats.get("state_d2h_bytes", 0) > 0
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True)), "losses differ"
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert type(b) is nn.Parameter and torch.equal(a, b), f"parameter {n} differs"
    assert ws._same(o0.state_dict(), o1.state_dict())
    assert threading.active_count() == threads  # no copy thread left behind


def test_a_refused_accumulation_says_which_units_were_stepped_and_puts_them_back():
    """Gradient accumulation under a step in backward is refused at the second forward; the first backward has
    already stepped the blocks on its gradients alone. The refusal puts them back first (parameters and optimizer
    state as before that step, gradients cleared) and says so, naming them."""
    zm = _mlp()
    model = zm.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = ws._whole(Plan.uniform(ws._profile("mlp"), "keep"), ws.MIXED_STEP, step_in_backward=True, opt=opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with memopt.plan(plan, model, optimizer=opt) as applied:
        zm.loss_fn(model(*zm.inputs)).backward()
        with pytest.raises(StepInBackwardError) as err:
            zm.loss_fn(model(*zm.inputs)).backward()
        assert "'blocks.0', 'blocks.2'" in str(err.value) and "as before that step" in str(err.value)
        assert applied.state.undo_steps_in_backward() == 0  # nothing left to put back
        assert all(p.grad is None for p in model.parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not opt.state
