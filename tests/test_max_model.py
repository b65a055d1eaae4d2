"""``memopt.max_model``: the largest of a transformers GPT-2 family (by depth) that trains within a budget."""

from __future__ import annotations

import pytest
import torch

import memopt_nb as memopt

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SIZES = [1, 2, 4, 8, 16]
BUDGET = 6 * 2**20


def gpt2(n_layer: int):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=512, n_layer=n_layer, n_embd=64, n_head=4, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 512, (2, 32))
    return model, {"input_ids": ids, "labels": ids}, (lambda out: out.loss), torch.optim.AdamW(model.parameters())


@pytest.fixture(scope="module")
def answer() -> memopt.ModelSizes:
    return memopt.max_model(gpt2, SIZES, budget=BUDGET, time_limit=10)


def test_each_method_answers_the_largest_size_that_fits(answer: memopt.ModelSizes) -> None:
    largest = answer.largest
    assert largest["memopt"] is not None and largest["plain"] is not None
    assert SIZES.index(largest["plain"]) < SIZES.index(largest["memopt"]), answer.summary()
    for method, size in largest.items():
        if size is None:
            continue
        assert answer.row(size).fits[method]
        bigger = [r for r in answer.rows if SIZES.index(r.size) > SIZES.index(size)]
        assert all(not r.fits[method] for r in bigger), (method, size)
    plain = answer.row(largest["plain"])
    assert plain.peak_bytes <= BUDGET
    assert all(r.peak_bytes > BUDGET for r in answer.rows if SIZES.index(r.size) > SIZES.index(largest["plain"]))


def test_memopts_answer_ran_inside_the_budget_under_its_plan(answer: memopt.ModelSizes) -> None:
    row = answer.row(answer.largest["memopt"])
    assert row.verified is True
    assert row.measured_peak_bytes <= BUDGET
    assert row.state_bytes > BUDGET  # its state alone does not fit: the plan moves it
    assert answer.plan is not None and answer.plan.feasible
    assert row.step_time["memopt"] == answer.plan.predicted_step_time
    text = answer.summary()
    assert "memopt" in text and "verified" in text and "plain training does" in text


def test_a_preset_predicts_without_running() -> None:
    r = memopt.max_model(gpt2, [1, 2], budget=BUDGET, device="a100-40gb")
    mem = r.row(r.largest["memopt"])
    assert mem.verified is None and "a100" in r.device


@pytest.mark.parametrize("kwargs, words", [(dict(sizes=[], budget="1GiB"), "at least one size"),
                                           (dict(sizes=[1, 2], budget="60%"), "share of a peak")])
def test_wrong_arguments_say_what_works(kwargs: dict, words: str) -> None:
    with pytest.raises(memopt.MemoptError, match=words):
        memopt.max_model(gpt2, **kwargs)


def test_a_size_that_cannot_be_profiled_fits_no_method(monkeypatch) -> None:
    from memopt_nb.harness import maxmodel

    real = maxmodel.profile

    def profile(model, *args, **kwargs):
        if len(model.transformer.h) > 2:
            raise memopt.ProfileError("does not fit even state-streamed")
        return real(model, *args, **kwargs)

    monkeypatch.setattr(maxmodel, "profile", profile)
    r = memopt.max_model(gpt2, [1, 2, 4], budget=BUDGET, verify=False)
    assert r.largest["memopt"] == 2 and r.row(4).error and not any(r.row(4).fits.values())
