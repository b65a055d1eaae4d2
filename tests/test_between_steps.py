"""What training loops do between steps, under plans that keep parameters on the host between steps.

An offloaded parameter's device storage is empty outside its unit's forward, backward and step. Before this was
guarded, an EMA (``ema.lerp_(p, ...)``), a weight-norm log (``p.norm()``) or ``copy.deepcopy(model)`` between steps read
that empty storage and the process died (SIGSEGV: a notebook's kernel restarts). Each habit below now runs under the
plan and gives exactly what it gives in plain training: losses, parameters and whatever the habit itself recorded,
bit for bit. A habit that cannot be served (a view that would outlive the parameter's memory) raises StateError.

The zoo MLP with every unit's parameters offloaded and with the mixed rows of ``test_whole_step_apply``, and
transformers GPT-2 (random init, small config) under ``torch.optim.swa_utils.AveragedModel``. Last, what fine-tuning
does inside the block: unfreezing or freezing half the parameters, or adding them as a new parameter group; and fp16
with ``torch.amp.GradScaler`` (refused by name under a step in backward); ``torch.compile`` (``aot_eager``) of a model
under a whole-step plan (swap refused by name there).
"""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import helpers.whole_step as ws
import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.core.errors import PlanError
from memopt_nb.core.plan import Plan
from memopt_nb.runtime.state import StateError, StepInBackwardError

pytestmark = pytest.mark.usefixtures("one_thread")

ALL_OFFLOADED = [("keep", "offload", "offload", "offload")]
ROWS = {"all_offloaded": ALL_OFFLOADED, "mixed": ws.MIXED}


def _ema(model, log, memo):
    ema = memo.setdefault("ema", [p.detach().clone() for p in model.parameters()])
    with torch.no_grad():
        for q, p in zip(ema, model.parameters(), strict=True):
            q.lerp_(p, 0.1)
    log.append(torch.stack([q.sum() for q in ema]))


def _norms(model, log, memo):
    log.append(torch.stack([p.norm() for p in model.parameters()]))


def _averaged(model, log, memo):
    avg = memo.get("avg")
    if avg is None:  # made inside the block: a deep copy of the planned model
        avg = memo["avg"] = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    avg.update_parameters(model)
    log.append(torch.stack([p.sum() for p in avg.parameters()]))


def _deepcopy(model, log, memo):
    twin = copy.deepcopy(model)
    assert all(type(p) is nn.Parameter for p in twin.parameters()), "the copy's parameters are plain ones"
    log.append(torch.stack([p.sum() for p in twin.parameters()]))


def _clamp_data(model, log, memo):  # WGAN's weight clipping
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)


def _scale_in_place(model, log, memo):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)


def _to_numpy(model, log, memo):
    log.append(torch.tensor([float(p.detach().cpu().numpy().sum()) for p in model.parameters()]))


def _pickled(model, log, memo):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    twin = torch.load(buf, weights_only=False)
    log.append(torch.stack([p.sum() for p in twin.parameters()]))


def _repr(model, log, memo):
    log.append(torch.tensor([len(repr(p)) for p in model.parameters()]))


def _to_own_device(model, log, memo):  # what accelerate's prepare() and many loops do: model.to(device)
    model.to(next(model.buffers(), torch.empty(0)).device)
    model.train()


def _foreach_ema(model, log, memo):  # timm's ModelEmaV3 way: one foreach over every parameter
    ema = memo.setdefault("ema", [p.detach().clone() for p in model.parameters()])
    with torch.no_grad():
        torch._foreach_lerp_(ema, list(model.parameters()), 0.1)
    log.append(torch.stack([q.sum() for q in ema]))


HABITS = {"ema": _ema, "foreach_ema": _foreach_ema, "weight_norms": _norms, "averaged_model": _averaged,
          "deepcopy": _deepcopy, "clamp_data": _clamp_data, "scale_in_place": _scale_in_place,
          "to_numpy": _to_numpy, "pickle": _pickled, "repr": _repr, "to_own_device": _to_own_device}


def _run(build, forward_loss, plan_for, habit, steps: int = 3):
    """``steps`` AdamW steps, ``habit`` after each ``opt.step()``; plainly (``plan_for`` None) or under its plan."""
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    log, memo = [], {}
    model, _, record = ws.train_loop(model, opt, plan_for(opt) if plan_for is not None else None, forward_loss, steps,
                                     after_step=lambda m: habit(m, log, memo))
    return model, record["losses"], log, record["stats"]


def _assert_same(ref, got) -> None:
    (m0, l0, g0, _), (m1, l1, g1, _) = ref, got
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True)), "losses differ"
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True)), "what the habit recorded differs"
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert type(b) is nn.Parameter and not hasattr(b, "_memopt_offload"), f"{n} still wears the plan's class"
        assert torch.equal(a, b), f"parameter {n} differs"


def _mlp(device: str = "cpu"):
    return memopt.zoo.build("mlp", seed=0, device=device, **ws.SMALL["mlp"]).model


def _mlp_loss_on(device: str):
    """The zoo MLP's batch and loss on ``device``, as ``forward_loss(model)``."""
    zm = memopt.zoo.build("mlp", seed=0, device=device, **ws.SMALL["mlp"])
    return lambda model: zm.loss_fn(model(*zm.inputs))


_mlp_loss = _mlp_loss_on("cpu")


@pytest.mark.parametrize("rows", list(ROWS))
@pytest.mark.parametrize("habit", list(HABITS))
def test_a_habit_between_steps_gives_what_plain_training_gives(habit, rows):
    prof = ws._profile("mlp")

    def plan_for(opt):
        return ws._whole(Plan.uniform(prof, "keep"), ROWS[rows], opt=opt)

    ref = _run(_mlp, _mlp_loss, None, HABITS[habit])
    got = _run(_mlp, _mlp_loss, plan_for, HABITS[habit])
    _assert_same(ref, got)
    assert got[3]["param_h2d_bytes"] > 0  # the plan did keep parameters on the host
    if habit in ("ema", "foreach_ema", "weight_norms", "averaged_model", "scale_in_place"):
        assert got[3]["param_reads_between_steps"] > 0  # ... and the habit read them through the guard


def test_a_view_of_an_offloaded_parameter_is_refused_and_training_goes_on_unchanged():
    prof = ws._profile("mlp")
    calls = []

    def view_then_norm(model, log, memo):
        p = next((p for p in model.parameters() if type(p) is not nn.Parameter), None)
        if p is not None:  # under the plan, between steps: a parameter on the host
            with pytest.raises(StateError, match="view of memory the plan frees"):
                p.view(-1)
            with pytest.raises(StateError, match="p.copy_"):
                p.data = torch.zeros_like(p)
            with pytest.raises(StateError, match="clone"):
                p.numpy()
            calls.append(1)
        _norms(model, log, memo)

    ref = _run(_mlp, _mlp_loss, None, view_then_norm)
    got = _run(_mlp, _mlp_loss, lambda opt: ws._whole(Plan.uniform(prof, "keep"), ALL_OFFLOADED, opt=opt),
               view_then_norm)
    assert len(calls) == 3
    _assert_same(ref, got)


def test_a_copy_made_inside_the_block_carries_none_of_the_plans_hooks():
    prof = ws._profile("mlp")
    zm = ws._build("mlp")
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-2)
    plan = ws._whole(Plan.uniform(prof, "recompute"), ws.MIXED_STEP, step_in_backward=True, opt=opt)
    with memopt.plan(plan, zm.model, optimizer=opt):
        twin = copy.deepcopy(zm.model)  # before any step: a bound method of the runtime once made this fail
        blob = pickle.dumps(twin)
    hooks = [getattr(h, "hook", h)  # torch's _WrappedHook holds the hook as .hook
             for m in twin.modules()
             for d in (m._forward_pre_hooks, m._forward_hooks, m._state_dict_hooks, m._load_state_dict_pre_hooks)
             for h in d.values()]
    assert hooks and all(getattr(h, "__name__", "") == "_inert" for h in hooks), [
        h for h in hooks if getattr(h, "__name__", "") != "_inert"]
    assert all(type(p) is nn.Parameter for p in twin.parameters())
    twin2 = pickle.loads(blob)
    torch.manual_seed(3)
    a = zm.loss_fn(twin(*zm.inputs))
    torch.manual_seed(3)
    b = zm.loss_fn(twin2(*zm.inputs))
    a.backward()  # an ordinary model: trains without the plan
    assert torch.equal(a, b) and all(p.grad is not None for p in twin.parameters())


def test_transformers_gpt2_with_an_averaged_model_made_inside_the_block():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def build():
        return transformers.GPT2LMHeadModel(cfg)

    def loss(model):
        return model(input_ids=ids, labels=ids).loss

    torch.manual_seed(0)
    model = build()
    prof = memopt.profile(model, loss_fn=lambda out: out.loss, repeats=1, input_ids=ids, labels=ids)
    rows = [("keep", "offload", "offload", "offload") if u.param_bytes else ("keep", "resident", "resident",
                                                                            "resident") for u in prof.units]

    def plan_for(opt):
        return ws._whole(Plan.uniform(prof, "keep"), rows, opt=opt)

    ref = _run(build, loss, None, _averaged)
    got = _run(build, loss, plan_for, _averaged)
    _assert_same(ref, got)
    assert got[3]["param_reads_between_steps"] > 0


def test_a_foreach_over_every_parameter_brings_one_unit_back_at_a_time(monkeypatch):
    """An EMA as one ``torch._foreach_lerp_`` over all parameters must not bring every offloaded unit back at once:
    the plan's budget may be below the parameters' size."""
    from memopt_nb.runtime.state import StateManager

    depth, deepest = [0], [0]
    original = StateManager._reading

    def counting(self, u):
        cm = original(self, u)

        class Counted:
            def __enter__(self_):
                depth[0] += 1
                deepest[0] = max(deepest[0], depth[0])
                return cm.__enter__()

            def __exit__(self_, *exc):
                depth[0] -= 1
                return cm.__exit__(*exc)

        return Counted()

    monkeypatch.setattr(StateManager, "_reading", counting)
    prof = ws._profile("mlp")
    got = _run(_mlp, _mlp_loss, lambda opt: ws._whole(Plan.uniform(prof, "keep"), ALL_OFFLOADED, opt=opt),
               _foreach_ema)
    assert got[3]["param_reads_between_steps"] >= 3 * sum(1 for u in prof.units if u.param_bytes) > 3
    assert deepest[0] == 1
    _assert_same(_run(_mlp, _mlp_loss, None, _foreach_ema), got)


# ---------------------------------------------------------------------- fine-tuning inside the block
def _fine_tuning(change: str, rows, step_in_backward: bool):
    """Four AdamW steps of the zoo MLP; before the third, ``change`` (half the parameters: unfrozen, frozen, or added to
    the optimizer as a new group). Returns a function running it plainly (``planned=False``) or under ``rows``."""
    prof = ws._profile("mlp")

    def run(planned: bool):
        zm = ws._build("mlp")
        params = list(zm.model.parameters())
        half, rest = params[: len(params) // 2], params[len(params) // 2:]
        if change == "unfreeze":
            for p in half:
                p.requires_grad_(False)
        opt = torch.optim.AdamW(half if change == "add_group" else params, lr=1e-2)
        plan = (ws._whole(Plan.uniform(prof, "keep"), rows, step_in_backward=step_in_backward, opt=opt)
                if planned else None)
        done = [0]

        def after_step(model):
            done[0] += 1
            if done[0] == 2:
                if change == "unfreeze":
                    for p in half:
                        p.requires_grad_(True)
                elif change == "freeze":
                    for p in half:
                        p.requires_grad_(False)
                else:
                    opt.add_param_group({"params": rest, "lr": 5e-3})

        return ws.train_loop(zm.model, opt, plan, lambda m: zm.loss_fn(m(*zm.inputs)), 4, after_step=after_step)

    return run


@pytest.mark.parametrize("rows", ["all_offloaded", "mixed", "mixed_step"])
@pytest.mark.parametrize("change", ["unfreeze", "freeze", "add_group"])
def test_freezing_unfreezing_or_adding_a_group_inside_the_block_trains_as_without_it(change, rows):
    """Gradual unfreezing and new parameter groups, as fine-tuning does; ``opt.state_dict()`` compared with key order
    (offloading a frozen parameter's state once added an empty entry plain training does not have)."""
    table = {**ROWS, "mixed_step": ws.MIXED_STEP}
    run = _fine_tuning(change, table[rows], step_in_backward=rows == "mixed_step")
    ws._assert_same_training(run(False), run(True), stepped=rows == "mixed_step")


def _scaled_training(rows, step_in_backward: bool, planned: bool):
    """Four steps of fp16 autocast with ``torch.amp.GradScaler`` (unscale, clip, step, update) on the zoo MLP."""
    zm = ws._build("mlp")
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    plan = None
    if planned:
        prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1,
                              autocast=torch.float16)
        plan = ws._whole(Plan.uniform(prof, "recompute"), rows, step_in_backward=step_in_backward, opt=opt)
    torch.manual_seed(11)
    losses = []
    with memopt.plan(plan, zm.model, optimizer=opt) if planned else contextlib.nullcontext():
        for _ in range(4):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = zm.loss_fn(zm.model(*zm.inputs))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(zm.model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach())
    return losses, list(zm.model.parameters()), opt.state_dict(), scaler.state_dict()


@pytest.mark.parametrize("rows", ["all_offloaded", "mixed"])
def test_fp16_with_a_grad_scaler_trains_as_without_the_plan(rows):
    ref = _scaled_training(ROWS[rows], False, planned=False)
    got = _scaled_training(ROWS[rows], False, planned=True)
    assert all(torch.equal(a, b) for a, b in zip(ref[0], got[0], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1], strict=True))
    assert ws._same(ref[2], got[2]) and ref[3] == got[3]


def test_a_grad_scaler_with_a_step_in_backward_is_refused_by_name():
    with pytest.raises(StepInBackwardError, match="GradScaler cannot be used with a step in backward"):
        _scaled_training(ws.MIXED_STEP, True, planned=True)


def test_transformers_trainer_under_a_whole_step_plan_trains_as_without_it():
    """``with memopt.plan(p): trainer.train()`` — transformers' Trainer (through accelerate: ``model.to(device)``,
    gradient accumulation, ``clip_grad_norm_``, ``model.zero_grad()``) given the optimizer the plan was made for."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tempfile

    cfg = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 64, (16,), generator=gen)} for _ in range(8)]
    for row in data:
        row["labels"] = row["input_ids"].clone()

    def train(planned: bool):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        args = transformers.TrainingArguments(
            output_dir=tempfile.mkdtemp(), report_to=[], max_steps=3, per_device_train_batch_size=2, use_cpu=True,
            save_strategy="no", logging_strategy="no", gradient_accumulation_steps=2, max_grad_norm=1.0, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
        stats = {}
        if planned:
            ids = data[0]["input_ids"][None].repeat(2, 1)
            prof = memopt.profile(model, loss_fn=lambda out: out.loss, optimizer=opt, repeats=1, input_ids=ids,
                                  labels=ids)
            rows = [("recompute", "offload", "offload", "offload") if u.param_bytes else
                    ("recompute", "resident", "resident", "resident") for u in prof.units]
            with memopt.plan(ws._whole(Plan.uniform(prof, "keep"), rows, opt=opt), model, optimizer=opt) as applied:
                trainer.train()
            stats = applied.stats
        else:
            trainer.train()
        return model, opt, stats

    (m0, o0, _), (m1, o1, stats) = train(False), train(True)
    assert stats["param_h2d_bytes"] > 0 and stats["state_d2h_bytes"] > 0 and stats["grad_d2h_bytes"] > 0
    for (n, a), (_, b) in zip(m0.named_parameters(), m1.named_parameters(), strict=True):
        assert type(b) is nn.Parameter and torch.equal(a, b), n
    assert ws._same(o0.state_dict(), o1.state_dict())


#: test_whole_step_apply's mixed rows with recompute where they swap: what a compiled model may run
COMPILABLE = [("recompute" if r[0] == "swap" else r[0], *r[1:]) for r in ws.MIXED]


def _compiled_training(rows, planned: bool):
    prof = ws._profile("mlp")
    compiled = {}

    def forward_loss(model):
        if id(model) not in compiled:
            compiled[id(model)] = torch.compile(model, backend="aot_eager")
        zm = ws._build("mlp")
        return zm.loss_fn(compiled[id(model)](*zm.inputs))

    torch._dynamo.reset()
    zm = ws._build("mlp")
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-2)
    plan = ws._whole(Plan.uniform(prof, "keep"), rows, opt=opt) if planned else None
    return ws.train_loop(zm.model, opt, plan, forward_loss)


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["all_offloaded", "compilable"])
def test_a_model_compiled_with_aot_eager_trains_under_a_whole_step_plan_as_without_it(rows):
    """``torch.compile(model, backend="aot_eager")`` with parameters, gradients and state offloaded (and recompute):
    dynamo traces the hooks that bring parameters back and free them; the guard's class is off while a unit runs."""
    table = {"all_offloaded": ALL_OFFLOADED, "compilable": COMPILABLE}
    got = _compiled_training(table[rows], True)
    ws._assert_same_training(_compiled_training(table[rows], False), got)
    assert got[2]["stats"]["param_h2d_bytes"] > 0


@pytest.mark.slow
def test_swap_under_torch_compile_is_refused_by_name():
    """It used to fail in backward with the swap engine's in-place hint, which blamed the user's code."""
    with pytest.raises(PlanError, match="cannot move the tensors a compiled graph saves"):
        _compiled_training(ws.MIXED, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("habit", ["ema", "foreach_ema", "averaged_model", "deepcopy", "to_numpy", "clamp_data"])
def test_cuda_habit_between_steps_gives_what_plain_training_gives(habit):  # pragma: no cover - needs a GPU
    """The CPU test's habits on CUDA: parameters brought back on the side streams, ``.cpu()`` of ``p.detach()`` a real
    copy; unverified until a GPU run (``benchmarks/cuda_check.py --pytest``)."""
    zm = memopt.zoo.build("mlp", seed=0, device="cuda", **ws.SMALL["mlp"])
    opt = torch.optim.AdamW(zm.model.parameters(), lr=1e-2)
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)

    def plan_for(o):
        return ws._whole(Plan.uniform(prof, "keep"), ALL_OFFLOADED, opt=o)

    ref = _run(lambda: _mlp("cuda"), _mlp_loss_on("cuda"), None, HABITS[habit])
    got = _run(lambda: _mlp("cuda"), _mlp_loss_on("cuda"), plan_for, HABITS[habit])
    _assert_same(ref, got)
    assert got[3]["param_h2d_bytes"] > 0


def test_moving_the_model_to_its_own_device_brings_no_parameter_back():
    """``model.to(device)`` every step (some loops do) must not bring every unit's parameters back each time; a real
    conversion (``p.to(torch.float64)``) still reads them."""
    prof = ws._profile("mlp")
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with memopt.plan(ws._whole(Plan.uniform(prof, "keep"), ALL_OFFLOADED, opt=opt), model, optimizer=opt) as applied:
        _mlp_loss(model).backward()
        opt.step()
        opt.zero_grad()
        p = next(p for p in model.parameters() if type(p) is not nn.Parameter)
        before = applied.state.stats["param_reads_between_steps"]
        assert model.to("cpu") is model and p.to("cpu") is p and p.cpu() is p and p.to(p.dtype) is p
        assert applied.state.stats["param_reads_between_steps"] == before
        wide = p.to(torch.float64)
        assert applied.state.stats["param_reads_between_steps"] == before + 1
    assert wide.dtype == torch.float64 and torch.equal(wide, p.to(torch.float64))
