"""The loop around the steps lives under the device's limit too: leaving ``with memopt.plan(p):``, state dicts and
checkpoints inside and after the block never bring more to the device than it holds.

A transformers GPT-2 whose parameters, gradients and AdamW state are twice ``memopt.limit_memory``: profiled outside
the limit, a whole-step plan searched for it, three steps bit-identical to plain training of the same model outside
the limit; ``model.state_dict()`` and ``torch.save(opt.state_dict())`` inside the block and leaving it stay under the
limit (the limit's own meter), the state that does not fit stays on the host and keeps training, and the checkpoint
loads back into a fresh model and optimizer with the trained values.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io

import pytest
import torch

import memopt_nb as memopt
from memopt_nb.core.errors import MemoptWarning
from memopt_nb.core.plan import optimizer_fingerprint
from memopt_nb.runtime.state import StateError, parked_manager

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]

CONFIG = dict(vocab_size=1024, n_layer=8, n_embd=256, n_head=4, n_positions=64)
BATCH = (2, 32)


def _build(config: dict = CONFIG) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _inputs(config: dict = CONFIG) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, config["vocab_size"], BATCH, generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _step(model, opt, inputs) -> float:
    loss = model(**inputs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _train(model, opt, inputs, steps: int) -> list[float]:
    """``steps`` plain training steps, dropout drawn from the same seed on every call."""
    torch.manual_seed(steps)
    return [_step(model, opt, inputs) for _ in range(steps)]


def _state_bytes(model) -> int:
    """Parameters, gradients and AdamW's two moments."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_gpt2_twice_the_limit_trains_saves_and_leaves_the_block_inside_it():
    inputs = _inputs()
    ref_model, ref_opt = _build()  # plain training of the same model outside the limit
    ref_losses = _train(ref_model, ref_opt, inputs, 3)
    ref_at_save = (ref_model.state_dict(), ref_opt.state_dict())
    ref_at_save = {k: v.clone() for k, v in ref_at_save[0].items()}, copy.deepcopy(ref_at_save[1])
    ref_losses += _train(ref_model, ref_opt, inputs, 1) + _train(ref_model, ref_opt, inputs, 1)

    model, opt = _build()
    limit = _state_bytes(model) // 2
    prof = memopt.profile(model, model_kwargs=inputs, loss_fn=lambda out: out.loss, optimizer=opt, repeats=1)
    plan = memopt.search(prof, limit, total_timesteps=1024)  # profiled outside the limit, planned for it
    assert plan.moves_state and plan.predicted_peak_bytes <= limit
    del prof
    gc.collect()

    model_buf, opt_buf = io.BytesIO(), io.BytesIO()
    with memopt.limit_memory(limit) as lim:
        with pytest.warns(MemoptWarning, match="bring_back"), memopt.plan(plan) as applied:
            losses = _train(model, opt, inputs, 3)
            level = lim.current_bytes
            torch.save(model.state_dict(), model_buf)
            torch.save(opt.state_dict(), opt_buf)
            assert lim.current_bytes == level  # the host copies are host memory, not the device's
        assert lim.peak_bytes <= limit
        # what did not fit stays on the host, placed as under the plan: the device holds what it held between steps
        mgr = parked_manager(opt)
        assert mgr is not None and mgr is parked_manager(model) and applied.stats["parked_bytes"] > 0
        assert lim.current_bytes <= level + 64 * 1024
        with pytest.raises(StateError, match="does not fit the device"):
            memopt.bring_back(opt)  # refused, nothing changed
        losses += _train(model, opt, inputs, 1)  # a plain step outside the block: the parked state moves as planned
        with pytest.warns(MemoptWarning), memopt.plan(plan):  # the same plan takes the parked state over as it is
            losses += _train(model, opt, inputs, 1)
        assert lim.peak_bytes <= limit
    assert losses == ref_losses
    assert memopt.bring_back(model) > 0  # outside the limit: it all comes back
    assert parked_manager(opt) is None and not any(k in opt.__dict__ for k in ("step", "state_dict"))
    assert _same(opt.state_dict(), ref_opt.state_dict()) and _same(model.state_dict(), ref_model.state_dict())
    assert memopt.bring_back(opt) == 0

    # the checkpoint saved inside the block loads into a fresh model and optimizer with the values trained then
    fresh_model, fresh_opt = _build()
    for buf in (model_buf, opt_buf):
        buf.seek(0)
    fresh_model.load_state_dict(torch.load(model_buf, weights_only=True))
    fresh_opt.load_state_dict(torch.load(opt_buf, weights_only=True))
    assert _same(fresh_model.state_dict(), ref_at_save[0]) and _same(fresh_opt.state_dict(), ref_at_save[1])


def _offload_all(plan, opt):
    """``plan`` with every unit's parameters, gradients and optimizer state on the host between steps."""
    decisions = tuple(dataclasses.replace(d, optimizer="offload", grads="offload", params="offload")
                      for d in plan.decisions)
    return plan.with_meta(decisions=decisions, optimizer_fingerprint=optimizer_fingerprint(opt))


SMALL = dict(vocab_size=256, n_layer=2, n_embd=64, n_head=4, n_positions=64)


def test_state_dicts_of_offloaded_parameters_are_host_copies_and_load_back():
    inputs = _inputs(SMALL)
    model, opt = _build(SMALL)
    prof = memopt.profile(model, model_kwargs=inputs, loss_fn=lambda out: out.loss, optimizer=opt, repeats=1)
    plan = _offload_all(memopt.solvers.none(prof), opt)
    ref_model, ref_opt = _build(SMALL)
    ref_losses = _train(ref_model, ref_opt, inputs, 2)
    with memopt.limit_memory(10 * _state_bytes(model)) as lim, memopt.plan(plan) as applied:
        assert _train(model, opt, inputs, 2) == ref_losses
        level = lim.current_bytes
        sd, osd = model.state_dict(), opt.state_dict()
        assert lim.current_bytes == level
        assert _same(sd, ref_model.state_dict()) and _same(osd, ref_opt.state_dict())
        model.load_state_dict(sd)  # loading back what was saved changes nothing
        opt.load_state_dict(osd)
        assert _same(osd, ref_opt.state_dict())  # the caller's dict keeps its values
        assert _train(model, opt, inputs, 1) == _train(ref_model, ref_opt, inputs, 1)
    # it all fits: leaving the block brings it back, counted by the limit as it comes
    assert applied.stats.get("parked_bytes") is None and parked_manager(opt) is None
    assert _same(model.state_dict(), ref_model.state_dict()) and _same(opt.state_dict(), ref_opt.state_dict())


def test_leaving_the_block_is_counted_by_the_emulated_limit():
    inputs = _inputs(SMALL)
    model, opt = _build(SMALL)
    prof = memopt.profile(model, model_kwargs=inputs, loss_fn=lambda out: out.loss, optimizer=opt, repeats=1)
    plan = _offload_all(memopt.solvers.none(prof), opt)
    with memopt.limit_memory(10 * _state_bytes(model)) as lim:
        with memopt.plan(plan) as applied:
            _train(model, opt, inputs, 1)
            before = lim.current_bytes
            host = applied.state.host_bytes()
        assert host > 0 and lim.current_bytes >= before + host - 64 * 1024  # what came back is the device's
    gc.collect()
