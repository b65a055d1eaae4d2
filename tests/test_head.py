"""The LM head and loss as a plan option, and the loop that keeps its outputs, on transformers models with their real
vocabularies (GPT-2: 50257, Llama: 32000; small bodies, random init, nothing downloaded).

* the chunked head (``runtime/head``): the loss is bit-identical to the plain head's, the gradients differ in the last
  bits only, the logits compute exactly when something else reads them, the head is put back exactly;
* ``profile(..., head="chunked")``: each option's profile predicts the measured peak to the byte, under activation
  and whole-step plans; planners choose it only when asked and where it pays; a plan at 50 % trains inside
  ``limit_memory`` of its budget, also in the loop that keeps ``outputs``;
* ``keep_outputs=True``: the transformers documentation's loop is profiled as it runs and fits its prediction; a plan
  profiled without it warns once, naming what the loop keeps.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

import memopt_nb as memopt
from memopt_nb.core.errors import MemoptWarning, PlanError, ProfileError
from memopt_nb.core.heads import with_head
from memopt_nb.profiling.heads import HEAD_CHUNKS
from memopt_nb.runtime.head import ChunkedHead, LazyLogits, chunked_cross_entropy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

#: fp32 AdamW lr 1e-3, 3 steps: the chunked head's gradients are summed in another order (README)
LOSS_RTOL = 1e-5
PARAM_ATOL = 1e-5


def _gpt2(layers: int = 2, width: int = 64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg), cfg.vocab_size


def _llama(layers: int = 2, width: int = 64):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=2 * width,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg), cfg.vocab_size


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _ids(vocab: int, batch: int = 2, seq: int = 32, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _loss(out):
    return out.loss


# ---------------------------------------------------------------------- the mechanism
@pytest.mark.parametrize("name", sorted(MODELS))
def test_chunked_head_loss_is_bit_identical_and_gradients_close(name):
    model, vocab = MODELS[name]()
    other = copy.deepcopy(model)
    ids = _ids(vocab)
    plain = model(input_ids=ids, labels=ids)
    plain.loss.backward()
    with ChunkedHead(other.get_output_embeddings(), 4):
        out = other(input_ids=ids, labels=ids)
        assert isinstance(out.logits, LazyLogits) and out.logits.shape == plain.logits.shape
        out.loss.backward()
        assert torch.equal(out.logits.float(), plain.logits.float())  # computed on use, exactly as the plain head
    assert torch.equal(out.loss, plain.loss)
    worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), other.parameters()))
    assert 0 < worst < 1e-5 or worst == 0
    assert "forward" not in other.get_output_embeddings().__dict__  # put back exactly


def test_user_losses_on_lazy_logits():
    """A loss the user writes with F.cross_entropy (shifted, flattened) or chunked_cross_entropy runs chunked; any other
    read of the logits computes them, with their graph."""
    model, vocab = _gpt2()
    ids = _ids(vocab)
    ref = model(input_ids=ids).logits
    want = F.cross_entropy(ref[:, :-1, :].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    head = model.get_output_embeddings()
    with ChunkedHead(head, 3):
        logits = model(input_ids=ids).logits
        shifted = logits[:, :-1, :]
        assert isinstance(shifted, LazyLogits) and isinstance(shifted.reshape(-1, vocab), LazyLogits)
        got = F.cross_entropy(shifted.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        assert torch.equal(got, want)
        assert torch.equal(chunked_cross_entropy(shifted, ids[:, 1:]), want)
        none = F.cross_entropy(logits.view(-1, vocab), ids.view(-1), reduction="none")
        assert torch.equal(none, F.cross_entropy(ref.view(-1, vocab), ids.view(-1), reduction="none"))
        probs = logits.softmax(-1)  # not a loss: the full logits, with a graph to the head
        assert type(probs) is torch.Tensor and probs.requires_grad
        probs[0, 0, 0].backward()
        assert head.weight.grad is not None
        with torch.no_grad():
            assert type(model(input_ids=ids).logits) is torch.Tensor  # eval: as written


def test_chunked_head_refuses_a_bad_head_or_option():
    model, vocab = _gpt2()
    ids = _ids(vocab)
    with pytest.raises(ProfileError, match="head='chunked'"):
        memopt.profile(model, input_ids=ids, labels=ids, loss_fn=_loss, head="fused")
    with pytest.raises(ProfileError, match="nn.Linear"):
        memopt.profile(model, input_ids=ids, labels=ids, loss_fn=_loss, head="chunked", head_module="transformer.ln_f")
    with pytest.raises(PlanError, match="chunks"):
        ChunkedHead(model.get_output_embeddings(), 0)


# ---------------------------------------------------------------------- profile, plan, apply
@pytest.fixture(scope="module", params=sorted(MODELS))
def profiled(request):
    model, vocab = MODELS[request.param]()
    ids = _ids(vocab, batch=8, seq=64)  # the logits (512 tokens x vocab) outweigh the embeddings' state
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt, head="chunked", repeats=1)
    return request.param, model, opt, ids, prof


def _plan(prof, chunks, strategy="keep", **state):
    base = memopt.Plan.uniform(prof, strategy)
    if state:
        base = dataclasses.replace(base, decisions=tuple(dataclasses.replace(d, **state) for d in base.decisions))
    plan = dataclasses.replace(base, head={"module": prof.heads[str(chunks)]["module"], "chunks": chunks})
    plan._model_ref, plan._optimizer_ref = prof._model_ref, prof._optimizer_ref
    return plan


def test_head_options_are_measured_and_lower_the_floor(profiled):
    name, model, opt, ids, prof = profiled
    assert sorted(map(int, prof.heads)) == list(HEAD_CHUNKS), prof.meta.get("head_why")
    plain = memopt.solvers.min_peak(prof, head=False)
    chunked = memopt.solvers.min_peak(prof)
    logits = prof.meta["lm_head"]["logits_bytes"]
    assert logits == ids.numel() * prof.meta["lm_head"]["vocab"] * 4
    assert plain - chunked >= 2 * logits, (name, chunked, plain, logits)  # logits, log-softmax, their gradients
    assert chunked <= 0.5 * prof.peak_bytes
    # a profile made from an option is that option; the options' profiles are not the plain one
    hp = with_head(prof, {"module": "lm_head", "chunks": 16})
    assert hp.meta["head"]["chunks"] == 16 and hp.peak_bytes < prof.peak_bytes and not hp.heads
    assert with_head(hp, {"module": "lm_head", "chunks": 16}) is hp


@pytest.mark.parametrize("plan_args", [(4, "keep", {}), (16, "recompute", {}), (16, "swap", {}),
                                       (16, "keep", {"optimizer": "offload", "grads": "offload"}),
                                       (4, "recompute", {"optimizer": "stream"})],
                         ids=["keep4", "recompute16", "swap16", "offload16", "stream4"])
def test_predicted_peak_is_measured_with_the_head_chunked(profiled, plan_args):
    name, model, opt, ids, prof = profiled
    plan = _plan(prof, *plan_args[:2], **plan_args[2])
    predicted = memopt.simulate(prof, plan).peak_bytes
    measured = memopt.measure(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt, plan=plan).peak_bytes
    assert predicted == measured, (name, plan_args, predicted, measured)


def test_planners_choose_the_head_only_where_asked(profiled):
    name, model, opt, ids, prof = profiled
    floor_plain = memopt.solvers.min_peak(prof, head=False)
    budget = (floor_plain + memopt.solvers.min_peak(prof)) // 2  # only a chunked head fits
    p = memopt.solvers.optimal(prof, budget=budget)
    assert p.head is not None and not p.exact and p.feasible and p.predicted_peak_bytes <= budget
    assert p.meta["head_choice"]["as written"] is None
    with pytest.raises(memopt.BudgetError):
        memopt.solvers.optimal(prof, budget=budget, head=False)
    q = memopt.search(prof, budget=budget, total_timesteps=512, seed=0)
    assert q.head is not None and q.predicted_peak_bytes <= budget
    assert memopt.Plan.from_json(q.to_json()).head == q.head
    # a profile made without head="chunked" never gives such a plan
    assert memopt.solvers.optimal(dataclasses.replace(prof, heads={}), budget="100%").head is None


@pytest.mark.slow
@pytest.mark.parametrize("keep", [False, True], ids=["loss_only", "keeps_outputs"])
def test_plan_at_half_the_peak_trains_inside_its_budget(profiled, keep):
    """The head option's promise: a plan at 50 % trains 3 steps inside limit_memory(budget), in the loss-only loop
    (``loss = model(...).loss``) and, profiled with keep_outputs=True, in the loop that keeps ``outputs``; the first
    loss bit-identical, losses and parameters as plain training's within the stated tolerance."""
    name, model, opt, ids, prof = profiled
    if keep:
        prof = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt, head="chunked",
                              keep_outputs=True, repeats=1)
    plan = memopt.search(prof, budget="50%", total_timesteps=512, seed=0)
    assert plan.head is not None and plan.predicted_peak_bytes <= plan.budget_bytes
    assert memopt.measure(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt,
                          plan=plan).peak_bytes == plan.predicted_peak_bytes
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_opt.load_state_dict(opt.state_dict())
    ref_losses = []
    for _ in range(3):
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    mine = copy.deepcopy(model)
    mine_opt = torch.optim.AdamW(mine.parameters(), lr=1e-3)
    mine_opt.load_state_dict(opt.state_dict())
    losses = []
    with memopt.limit_memory(plan.budget_bytes) as lim, memopt.plan(plan, mine, optimizer=mine_opt), \
            warnings.catch_warnings():
        warnings.simplefilter("error", MemoptWarning)  # the loop is the one profiled: nothing to warn about
        for _ in range(3):
            if keep:
                outputs = mine(input_ids=ids, labels=ids)
                loss = outputs.loss
            else:
                loss = mine(input_ids=ids, labels=ids).loss
            loss.backward()
            mine_opt.step()
            mine_opt.zero_grad()
            losses.append(loss.item())
    assert lim.peak_bytes <= plan.budget_bytes
    assert losses[0] == ref_losses[0]  # the first step's loss is bit-identical
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) < LOSS_RTOL
    assert max((p - q).abs().max().item() for p, q in zip(mine.parameters(), ref.parameters())) < PARAM_ATOL


# ---------------------------------------------------------------------- the loop that keeps its outputs
def _docs_loop(model, opt, ids, steps=2):
    for _ in range(steps):
        outputs = model(input_ids=ids, labels=ids)
        loss = outputs.loss
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture(scope="module")
def kept_profile():
    model, vocab = _gpt2()
    ids = _ids(vocab, batch=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt, keep_outputs=True,
                          repeats=1)
    return model, vocab, ids, opt, kept


@pytest.mark.parametrize("strategy", ["keep", "swap", pytest.param("recompute", marks=pytest.mark.xfail(
    strict=True, reason="known gap: with the output kept, recomputing a GPT-2 block in backward peaks one layer's KV "
                        "cache (64 KiB) above the prediction; cause not found"))])
def test_keep_outputs_profiles_the_docs_loop(kept_profile, strategy):
    model, vocab, ids, opt, kept = kept_profile
    plain = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt, repeats=1)
    logits = 4 * 32 * vocab * 4
    assert kept.meta["keep_outputs"] and kept.peak_bytes >= plain.peak_bytes + logits
    plan = memopt.Plan.uniform(kept, strategy)
    assert plan.meta["keep_outputs"]
    predicted = memopt.simulate(kept, plan).peak_bytes
    assert predicted == memopt.measure(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt,
                                       plan=plan).peak_bytes
    with memopt.limit_memory(predicted) as lim, memopt.plan(plan), warnings.catch_warnings():
        warnings.simplefilter("error", MemoptWarning)  # profiled as it runs: nothing to warn about
        _docs_loop(model, opt, ids, steps=3)
    assert lim.peak_bytes <= predicted


def test_a_plan_profiled_without_kept_outputs_warns_once_naming_them():
    model, vocab = _gpt2()
    ids = _ids(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prof = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=_loss, optimizer=opt, repeats=1)
    with memopt.plan(memopt.Plan.uniform(prof, "recompute")), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _docs_loop(model, opt, ids, steps=3)
    mine = [w for w in caught if issubclass(w.category, MemoptWarning)]
    assert len(mine) == 1 and "output.logits" in str(mine[0].message) and "keep_outputs=True" in str(mine[0].message)
    with memopt.plan(memopt.Plan.uniform(prof, "recompute")), warnings.catch_warnings():
        warnings.simplefilter("error", MemoptWarning)
        for _ in range(2):  # the loop that lets go of its output: no warning
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()


# ---------------------------------------------------------------------- the magics
def test_the_profile_magic_takes_the_head_and_kept_outputs(ipython_shell):
    from IPython.core.error import UsageError

    shell = ipython_shell
    shell.run_line_magic("load_ext", "memopt_nb")
    try:
        model, vocab = _gpt2()
        shell.user_ns.update(lm=model, lm_ids=_ids(vocab), lm_opt=torch.optim.AdamW(model.parameters()))
        shell.run_line_magic("memopt_profile", "lm input_ids=lm_ids labels=lm_ids --loss 'lambda o: o.loss' "
                                               "--optimizer lm_opt --head chunked --keep-outputs --repeats 1 "
                                               "-o lm_prof -q")
        prof = shell.user_ns["lm_prof"]
        assert sorted(map(int, prof.heads)) == list(HEAD_CHUNKS) and prof.meta["keep_outputs"] is True
        with pytest.raises(UsageError, match="--head chunked"):
            shell.run_line_magic("memopt_profile", "lm input_ids=lm_ids labels=lm_ids --loss 'lambda o: o.loss' "
                                                   "--head-module lm_head -q")
        with pytest.raises(UsageError):
            shell.run_line_magic("memopt_profile", "lm input_ids=lm_ids --head fused -q")
    finally:
        shell.run_line_magic("unload_ext", "memopt_nb")
