"""Out of memory mid-step under a plan loses nothing, and a refused step-in-backward loop leaves a consistent model.

A transformers GPT-2 (2 layers, AdamW, dropout on: the RNG matters) trains a warm-up step, accumulates 0 or 2
micro-batches under a plan, then runs out of memory in the next micro-batch's forward, backward or optimizer step
(the emulated limit is lowered at that point, so it fails there every time), with ``limit_memory`` outside the plan
(the README's nesting) or inside it. Afterwards parameters, gradients, optimizer state and RNG must equal plain
training's before that micro-batch, the error must carry the note, and the next micro-batch and step, under the same
limit where it is outside, must train bit for bit as plain training that skipped the failed micro-batch.
"""

import contextlib
import dataclasses
import itertools

import pytest
import torch

import memopt_nb as memopt
from memopt_nb.core.plan import Plan
from memopt_nb.runtime.limit import _STACK
from memopt_nb.runtime.state import StepInBackwardError

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

CFG = dict(vocab_size=1000, n_layer=2, n_embd=64, n_head=4, n_positions=64)
R = "resident"
PLANS = {  # per unit: (strategy, optimizer, grads, params)
    "activations": [("recompute", R, R, R), ("swap", R, R, R)],
    "offloaded": [("recompute", "offload", "offload", "offload"), ("swap", "offload", "offload", R)],
    "streamed": [("keep", "stream", "offload", R), ("recompute", "stream", "offload", "offload")],
}
ROOM = 1 << 30  # the limit while nothing should fail, before one is measured


def _batch(i):
    return torch.randint(0, CFG["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(100 + i))


def _build():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**CFG))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _micro(model, i):
    ids = _batch(i)
    model(input_ids=ids, labels=ids).loss.backward()  # in a function of its own: nothing of it outlives the call


def _step(opt):
    opt.step()
    opt.zero_grad()


def _state(model, opt):
    """Parameters, gradients, optimizer state (as plain tensors) and the RNG, to compare with torch.equal."""
    with memopt.runtime.limit.uncounted():
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        state = [{k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for s in opt.state.values()]
        return ([p.detach().clone() for p in model.parameters()], grads, state, torch.get_rng_state())


def _assert_equal(a, b):
    with memopt.runtime.limit.uncounted():  # reading the reference under a limit does not put it on the device
        _assert_equal_values(a, b)


def _assert_equal_values(a, b):
    for x, y in zip(a[0], b[0], strict=True):
        assert torch.equal(x, y), "a parameter differs"
    for x, y in zip(a[1], b[1], strict=True):
        assert (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)), "a gradient"
    assert len(a[2]) == len(b[2])
    for x, y in zip(a[2], b[2], strict=True):
        assert list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x), "optimizer state differs"
    assert torch.equal(a[3], b[3]), "RNG differs"


def _start(model, opt):
    torch.manual_seed(7)
    _micro(model, 0)  # the warm-up step: optimizer state exists
    _step(opt)


@pytest.fixture(scope="module")
def plans():
    model, opt = _build()
    ids = _batch(0)
    prof = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=lambda out: out.loss, optimizer=opt, repeats=1)
    base = Plan.uniform(prof, "keep")
    out = {}
    for name, rows in PLANS.items():
        decisions = tuple(dataclasses.replace(d, strategy=s, optimizer=o, grads=g, params=q)
                          for d, (s, o, g, q) in zip(base.decisions, rows, strict=True))
        out[name] = base.with_meta(decisions=decisions)
    return out


@pytest.fixture(scope="module")
def reference():
    """Plain training, per number of micro-batches accumulated: the state before the micro-batch that fails under
    the plan, and after skipping it, one more micro-batch and the step."""
    out = {}
    for k in (0, 2):
        model, opt = _build()
        _start(model, opt)
        for i in range(k):
            _micro(model, 1 + i)
        before = _state(model, opt)
        _micro(model, 9)
        _step(opt)
        out[k] = (before, _state(model, opt))
    return out


@pytest.fixture(scope="module")
def limits(plans):
    """Per plan, the limit its whole sequence (accumulation and step) fits in (its measured peak), and how many
    operators its optimizer step runs under the limit (to run out of memory two thirds of the way through)."""
    out = {}
    for name, plan in plans.items():
        model, opt = _build()
        _start(model, opt)
        with memopt.limit_memory(ROOM) as lim, memopt.plan(plan, model, optimizer=opt):
            for i in range(3):
                _micro(model, 1 + i)
            point = _Point(after=-1)  # counts, never fires
            point.arm()
            _step(opt)
            point.disarm()
        out[name] = (lim.peak_bytes, point.seen)
    return out


class _Point:
    """Lowers the innermost limit to what the device holds ``after`` allocations past the moment it is armed, so the
    next one runs out of memory there."""

    def __init__(self, after):
        self.after, self.armed, self.fired, self.seen = after, False, False, 0

    def arm(self, *args):
        if self.armed:
            return
        self.armed = True
        tracker = _STACK[-1]._tracker
        check, left = tracker.check, [self.after]

        def counting(storages, what):
            self.seen += 1
            if left[0] == 0 and not self.fired:
                self.fired = True
                self.saved = tracker.limit
                tracker.limit = tracker.current
            left[0] -= 1
            return check(storages, what)

        tracker.check = counting
        self.tracker = tracker

    def disarm(self):
        if self.armed:
            del self.tracker.check
            if self.fired:
                self.tracker.limit = self.saved


def _arm(point, where, model, opt):
    """Hooks that arm ``point`` in the failing micro-batch's forward, backward or optimizer step."""
    if where == "forward":
        return [model.transformer.h[1].register_forward_pre_hook(point.arm)]
    if where == "backward":  # in unit 0's backward, after unit 1's gradients are accumulated (and offloaded)
        return [model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: point.arm())]
    return [opt.register_step_pre_hook(point.arm)]


NESTINGS = ("limit outside plan", "plan outside limit")
#: one case per nesting, plan, point and accumulation each (the whole matrix is slow: a limit's entry collects garbage)
FAST = {(NESTINGS[0], "activations", "forward", 2), (NESTINGS[0], "offloaded", "backward", 2),
        (NESTINGS[0], "streamed", "step", 2), (NESTINGS[1], "activations", "step", 0),
        (NESTINGS[1], "offloaded", "forward", 0), (NESTINGS[1], "streamed", "backward", 0)}
CASES = [pytest.param(*case, marks=() if case in FAST else pytest.mark.slow, id="-".join(map(str, case)))
         for case in itertools.product(NESTINGS, PLANS, ("forward", "backward", "step"), (0, 2))]


@pytest.mark.parametrize(("nesting", "kind", "where", "k"), CASES)
def test_out_of_memory_mid_step_puts_everything_back_and_training_goes_on_bit_for_bit(
        nesting, kind, where, k, plans, reference, limits):
    plan, (limit, step_ops) = plans[kind], limits[kind]
    model, opt = _build()
    _start(model, opt)
    point = _Point(after={"forward": 3, "backward": 1, "step": 2 * step_ops // 3}[where])
    outer = memopt.limit_memory(limit) if nesting == "limit outside plan" else contextlib.nullcontext()
    with outer:
        with pytest.raises(torch.OutOfMemoryError) as info:
            with contextlib.ExitStack() as stack:
                stack.enter_context(memopt.plan(plan, model, optimizer=opt))
                if nesting == "plan outside limit":
                    stack.enter_context(memopt.limit_memory(limit))
                for i in range(k):
                    _micro(model, 1 + i)
                handles = _arm(point, where, model, opt)
                try:
                    _micro(model, 8)
                    _step(opt)
                finally:
                    for h in handles:
                        h.remove()
                    point.disarm()
        assert point.fired
        note = "\n".join(getattr(info.value, "__notes__", []))
        assert f"out of memory in the {'optimizer step' if where == 'step' else where}" in note
        assert "as before the step" in note and "memopt.max_batch" in note
        assert ", at " in note and ", line " in note  # where, the frames being dropped with what they held
        before, after = reference[k]
        _assert_equal(before, _state(model, opt))
        assert all(type(p) is torch.nn.Parameter and p.untyped_storage().nbytes() == p.nbytes
                   for p in model.parameters())
        # the next micro-batch and the step, under the same limit where it is outside the plan
        inner = memopt.limit_memory(limit) if nesting == "plan outside limit" else contextlib.nullcontext()
        with memopt.plan(plan, model, optimizer=opt), inner:
            _micro(model, 9)
            _step(opt)
    _assert_equal(after, _state(model, opt))


def test_out_of_memory_in_the_step_after_a_step_in_backward_puts_back_the_units_stepped_too(plans, reference,
                                                                                           limits):
    """The blocks step inside backward (grads='step'), the parameters outside them in opt.step(), which runs out of
    memory partway: the blocks are put back from the plan's undo copies, the rest from the copies taken as the step
    began."""
    plan = plans["offloaded"]
    sib = plan.with_meta(decisions=tuple(dataclasses.replace(d, grads="step") for d in plan.decisions),
                         step_in_backward=True)
    model, opt = _build()
    _start(model, opt)
    point = _Point(after=20)
    with memopt.limit_memory(limits["offloaded"][0]):
        with pytest.raises(torch.OutOfMemoryError) as info:
            with memopt.plan(sib, model, optimizer=opt) as applied:
                _micro(model, 8)
                assert applied.state._stepped
                handle = opt.register_step_pre_hook(point.arm)
                try:
                    _step(opt)
                finally:
                    handle.remove()
                    point.disarm()
        assert point.fired and "as before the step" in "\n".join(info.value.__notes__)
        before, after = reference[0]
        _assert_equal(before, _state(model, opt))
        with memopt.plan(sib, model, optimizer=opt):
            _micro(model, 9)
            _step(opt)
    _assert_equal(after, _state(model, opt))


def test_a_training_forward_never_backpropagated_does_not_hide_the_micro_batches_after_it(plans):
    """A forward with gradients enabled whose output is dropped (a look at the logits between micro-batches) is not
    a micro-batch of its own: the next one's gradients are still kept before the one after it runs out of memory."""
    model, opt = _build()
    _start(model, opt)
    point = _Point(after=3)
    handle = None
    with memopt.limit_memory(ROOM), pytest.raises(torch.OutOfMemoryError):
        with memopt.plan(plans["activations"], model, optimizer=opt):
            _micro(model, 1)
            model(input_ids=_batch(5))  # dropped
            _micro(model, 2)
            expected = _state(model, opt)
            handle = model.transformer.h[1].register_forward_pre_hook(point.arm)
            _micro(model, 8)
    handle.remove()
    point.disarm()
    _assert_equal(expected, _state(model, opt))


def test_out_of_memory_in_backward_puts_back_the_running_statistics_its_forward_changed():
    """BatchNorm's running statistics change in the forward: running out of memory later, in the backward, puts them
    back with the gradients accumulated before."""
    zm = memopt.zoo.resnet(batch_size=4, widths=(8, 16), blocks_per_stage=2)
    model, opt = zm.model, torch.optim.AdamW(zm.model.parameters(), lr=1e-2)
    prof = memopt.profile(model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
    zm.loss_fn(model(*zm.inputs)).backward()  # a micro-batch accumulated before the one that fails
    buffers = [b.clone() for b in model.buffers()]
    grads = [p.grad.clone() for p in model.parameters()]
    point = _Point(after=1)
    middle = list(model.parameters())[len(list(model.parameters())) // 2]
    handle = middle.register_hook(lambda g: point.arm())  # halfway through backward
    with memopt.limit_memory(ROOM), pytest.raises(torch.OutOfMemoryError) as info:
        with memopt.plan(memopt.solvers.recompute_all(prof)):
            zm.loss_fn(model(*zm.inputs)).backward()
    handle.remove()
    point.disarm()
    assert "in the backward" in "\n".join(info.value.__notes__)
    assert buffers and all(torch.equal(a, b) for a, b in zip(buffers, model.buffers(), strict=True))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters(), strict=True))


# ---------------------------------------------------------------------- refusals leave a consistent model
def _refuse(model, how):
    """After one micro-batch whose backward stepped the blocks (grads='step'), what a loop may not do."""
    ids = _batch(2)
    if how == "accumulate":  # a second micro-batch: refused at its forward
        model(input_ids=ids, labels=ids).loss.backward()
    elif how == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    else:  # a second backward through the same graph
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward(retain_graph=True)
        loss.backward()


@pytest.mark.parametrize("undo", [True, False])
@pytest.mark.parametrize("how", ["accumulate", "clip", "second backward"])
def test_a_refusal_under_a_step_in_backward_leaves_the_model_before_or_after_a_whole_step(how, undo, plans,
                                                                                          monkeypatch):
    """The blocks step inside backward; the tied embedding outside them steps in opt.step(). A refused loop (gradient
    accumulation, clipping, a second backward) must not leave the blocks stepped and the embedding not: with the undo
    copies the blocks are put back (the model equals plain training's before that micro-batch's step, gradients
    cleared), without them the step is completed (it equals plain training's after stepping that micro-batch alone),
    and the error says which. The loop can then go on as plain training does."""
    monkeypatch.setattr(memopt.runtime.state, "UNDO_STEPS_IN_BACKWARD", undo)
    plan = plans["offloaded"]
    sib = plan.with_meta(decisions=tuple(dataclasses.replace(d, grads="step") for d in plan.decisions),
                         step_in_backward=True)
    model, opt = _build()
    _start(model, opt)
    with memopt.plan(sib, model, optimizer=opt) as applied:
        if how == "second backward":
            ids = _batch(1)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward(retain_graph=True)
        else:
            _micro(model, 1)
        assert applied.state._stepped  # the blocks were stepped in backward, the embedding was not
        rng = torch.get_rng_state()
        with pytest.raises(StepInBackwardError) as info:
            if how == "second backward":
                loss.backward()
            else:
                _refuse(model, how)
        text = str(info.value)
        assert "'transformer.h.0', 'transformer.h.1'" in text
        assert ("the model is as before that step" if undo else "the model is as after a complete step") in text
        got = _state(model, opt)
        torch.set_rng_state(rng)
        _micro(model, 3)  # the loop goes on: one micro-batch, one step
        _step(opt)
    ref, ref_opt = _build()
    _start(ref, ref_opt)
    if not undo:  # the step was completed on the first micro-batch's gradients alone
        _micro(ref, 1)
        _step(ref_opt)
    _assert_equal(_state(ref, ref_opt)[:3] + (got[3],), got)
    assert all(g is None for g in got[1])
    torch.set_rng_state(rng)
    _micro(ref, 3)
    _step(ref_opt)
    _assert_equal(_state(ref, ref_opt), _state(model, opt))
