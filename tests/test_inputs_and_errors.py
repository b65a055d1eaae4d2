"""Keyword inputs, a search that leaves the global RNGs alone, and user mistakes that become clear memopt errors with
nothing changed."""

import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.core.errors import BudgetError, ProfileError
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.runtime.step import training_step


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same_state(model, state):
    return all(torch.equal(v, state[k]) for k, v in model.state_dict().items()) and \
        all("forward" not in m.__dict__ for m in model.modules())


# ---------------------------------------------------------------------- keyword inputs on Hugging Face models
def _gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False)
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                                  vocab_size=128, max_position_embeddings=64)
    return transformers.BertForMaskedLM(cfg)


@pytest.mark.parametrize("build", [_gpt2, _bert], ids=["gpt2", "bert"])
def test_profile_and_measure_take_the_models_keyword_inputs(build):
    # before: TypeError: profile() got an unexpected keyword argument 'input_ids'
    model = build()
    ids = torch.randint(0, 128, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0  # a padded row
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    state = _state(model)
    prof = memopt.profile(model, **kw, loss_fn=lambda out: out.loss, optimizer=opt, repeats=1)
    assert prof.batch_size == 3  # from a keyword tensor: there is no positional one
    assert prof.n_units == 2 and all(".layer" in n or ".h." in n for n in prof.unit_names)
    assert prof.input_bytes == ids.nbytes + mask.nbytes  # labels share input_ids' storage
    base = memopt.measure(model, **kw, loss_fn=lambda out: out.loss, optimizer=opt, steps=1)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):  # same dropout draws as measure's first step
        expected = model(**kw).loss.item()
    assert base.losses[0] == pytest.approx(expected, rel=1e-6)  # the first step ran on exactly these inputs
    plan = memopt.Plan.uniform(prof, "recompute")
    under = memopt.measure(model, model_kwargs=kw, loss_fn=lambda out: out.loss, optimizer=opt, plan=plan, steps=1)
    assert under.losses == base.losses  # the dict form is the same call; recompute changes no value
    assert _same_state(model, state)


def test_training_step_passes_keywords_to_the_model():
    model = _gpt2()
    ids = torch.randint(0, 128, (2, 8))
    model.eval()  # no dropout: the two calls give the same loss
    loss = training_step(model, (), lambda out: out.loss, None, kwargs={"input_ids": ids, "labels": ids})
    with torch.no_grad():
        assert loss.item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-6)


class _Scaled(nn.Module):
    """A model with keywords named like profile()'s and measure()'s options."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))

    def forward(self, x, *, scale=1.0, device=None, steps=1):
        for _ in range(steps):
            x = self.blocks(x) * scale
        return x


def test_a_model_keyword_named_like_an_option_goes_in_model_kwargs():
    model = _Scaled()
    x = torch.randn(4, 8)
    state = _state(model)
    a = memopt.profile(model, x, model_kwargs={"device": "ignored", "steps": 1}, scale=2.0, repeats=1)
    assert a.batch_size == 4 and a.n_units == 3
    m1 = memopt.measure(model, x, model_kwargs={"steps": 2}, steps=1)
    m2 = memopt.measure(model, x, model_kwargs={"steps": 1}, steps=1)
    assert m1.losses[0] != m2.losses[0]  # `steps` reached the model, not measure()
    with pytest.raises(ProfileError, match="given both as a keyword and in model_kwargs"):
        memopt.profile(model, x, scale=2.0, model_kwargs={"scale": 3.0})
    with pytest.raises(ProfileError, match="model_kwargs must be a dict"):
        memopt.measure(model, x, model_kwargs=[("scale", 2.0)])
    assert _same_state(model, state)


def test_a_keyword_the_model_does_not_take_is_refused_before_anything_runs():
    model = _Scaled()
    x = torch.randn(4, 8)
    opt = torch.optim.Adam(model.parameters())
    state = _state(model)
    with pytest.raises(ProfileError) as err:
        memopt.profile(model, x, optimiser=opt)
    msg = str(err.value)
    assert "optimiser" in msg and "did you mean optimizer=" in msg and "scale" in msg  # names what works
    with pytest.raises(ProfileError, match="takes no keyword 'mask'"):
        memopt.measure(model, x, mask=x)
    assert not opt.state and _same_state(model, state)
    gpt2 = _gpt2()  # its forward takes **kwargs: a misspelt option would vanish into them
    ids = torch.randint(0, 128, (2, 8))
    with pytest.raises(ProfileError, match="did you mean loss_fn="):
        memopt.profile(gpt2, input_ids=ids, loss=lambda out: out.logits.sum())


def test_profile_without_any_input_names_both_forms():
    with pytest.raises(ProfileError, match="input_ids=ids"):
        memopt.profile(_Scaled())


# ---------------------------------------------------------------------- search leaves the global RNGs alone
def test_search_leaves_the_global_rng_states_as_it_found_them():
    # before: torch's global RNG state had moved (the agents' networks are initialized from it)
    prof = chain_profile(6, seed=1)
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    t, n, r = torch.get_rng_state(), np.random.get_state(), random.getstate()
    plan = memopt.search(prof, "60%", total_timesteps=256, seed=0)
    assert plan.feasible is not None
    assert torch.equal(torch.get_rng_state(), t)
    after = np.random.get_state()
    assert after[0] == n[0] and np.array_equal(after[1], n[1]) and after[2:] == n[2:]
    assert random.getstate() == r


# ---------------------------------------------------------------------- measure's own options
@pytest.mark.parametrize("option,value", [("steps", "3"), ("steps", 0), ("steps", 2.0), ("steps", True),
                                          ("warmup", -1), ("warmup", "1"), ("warmup", None)])
def test_measure_refuses_bad_steps_and_warmup_with_nothing_changed(option, value):
    # before: steps="3" raised TypeError ('<' between str and int); warmup=-1 silently skipped the warm-up
    model = _Scaled()
    x = torch.randn(4, 8)
    opt = torch.optim.Adam(model.parameters())
    state = _state(model)
    with pytest.raises(ProfileError) as err:
        memopt.measure(model, x, optimizer=opt, **{option: value})
    assert f"{option} must be an int" in str(err.value) and f"e.g. {option}=" in str(err.value)
    assert not opt.state and _same_state(model, state)


def test_measure_warmup_zero_is_still_allowed():
    m = memopt.measure(_Scaled(), torch.randn(4, 8), warmup=0, steps=1)
    assert len(m.losses) == 2  # the memory step and one timed step


# ---------------------------------------------------------------------- budgets through the API
@pytest.mark.parametrize("budget", ["1e999", float("inf"), "0.4B"])
def test_search_refuses_an_unreadable_budget_before_training(budget):
    prof = chain_profile(6, seed=1)
    with pytest.raises(BudgetError, match="512MiB"):
        memopt.search(prof, budget, total_timesteps=64)


def test_search_reads_a_fraction_as_a_share():
    # before: 0.6 became a budget of 0 bytes (refused as below the smallest peak)
    prof = chain_profile(6, seed=1)
    plan = memopt.search(prof, 0.6, total_timesteps=128, seed=0)
    assert plan.budget_bytes == int(prof.peak_bytes * 0.6) == memopt.resolve_budget("60%", prof.peak_bytes)


# ---------------------------------------------------------------------- the magics: keyword inputs, one budget parser
@pytest.fixture(scope="module")
def ip(ipython_shell):
    shell = ipython_shell
    shell.run_line_magic("load_ext", "memopt_nb")
    yield shell
    shell.run_line_magic("unload_ext", "memopt_nb")


def test_magics_take_keyword_inputs_and_read_a_budget_fraction_as_the_api_does(ip):
    import math

    from IPython.core.error import UsageError

    ip.user_ns.update(hf=_gpt2(), ids=torch.randint(0, 128, (2, 16)))
    ip.user_ns["batch"] = {"attention_mask": torch.ones(2, 16, dtype=torch.long)}
    prof = ip.run_line_magic("memopt_profile", 'hf input_ids=ids **batch labels=ids --loss "lambda out: out.loss" '
                                               "--repeats 1 -q -o kprof")
    assert prof is None and ip.user_ns["kprof"].batch_size == 2
    prof = ip.user_ns["kprof"]
    with pytest.raises(UsageError, match="not a dict of keyword inputs"):
        ip.run_line_magic("memopt_profile", "hf input_ids=ids **ids")
    lo = memopt.solvers.min_peak(prof)
    frac = math.ceil(1000 * (lo + 0.5 * (prof.peak_bytes - lo)) / prof.peak_bytes) / 1000
    if frac >= 1:
        pytest.skip("no plan lowers this profile's peak")
    # before: '--budget 0.6' was 0 bytes
    p = ip.run_line_magic("memopt_plan", f"kprof --budget {frac} --timesteps 64 --no-widget -o kplan")
    assert p.budget_bytes == memopt.resolve_budget(frac, prof.peak_bytes) == int(prof.peak_bytes * frac)
    for bad, words in (("1e999", "finite"), ("0.4B", "less than one byte"), ("inf", "cannot read")):
        with pytest.raises(UsageError) as err:
            ip.run_line_magic("memopt_plan", f"kprof --budget {bad} --timesteps 64 --no-widget -o kplan2")
        assert words in str(err.value) and "512MiB" in str(err.value)
    assert "kplan2" not in ip.user_ns


def test_evaluate_takes_a_builder_whose_inputs_are_keywords():
    # before: tuple(dict) passed the dict's keys as positional inputs
    def builder(batch_size=2):
        model = _gpt2()
        ids = torch.randint(0, 128, (batch_size, 16))
        return model, {"input_ids": ids, "labels": ids}, (lambda out: out.loss)

    ev = memopt.evaluate(builder, budget="2GiB", batch_sizes=[2], methods=("none", "recompute_all", "grad_accum"),
                         steps=1)
    assert ev.source == "measured"
    assert all(r.feasible == [True] and r.source == ["measured"] and r.peak_bytes[0] > 0 for r in ev.methods.values())
