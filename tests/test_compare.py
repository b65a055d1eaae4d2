"""memopt.compare: a plan against no plan against the prediction, measured in alternating pairs, as one table."""

import pytest
import torch

import memopt_nb as memopt
from memopt_nb.harness.compare import CPU_CAVEAT, Comparison
from memopt_nb.runtime.measure import Measurement


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model, inputs, loss_fn, _ = memopt.zoo.gpt(batch_size=2, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    opt = torch.optim.Adam(model.parameters())
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
    return model, inputs, loss_fn, opt, prof


def fake(times, peak):
    return [Measurement(peak_bytes=peak, step_time=t, step_times=[t], losses=[1.0], device="cpu", method="m")
            for t in times]


@pytest.mark.slow
def test_compare_measures_both_sides_in_pairs_beside_the_prediction(small):
    model, inputs, loss_fn, opt, prof = small
    plan = memopt.solvers.recompute_all(prof)
    before = [p.detach().clone() for p in model.parameters()]
    c = memopt.compare(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, profile=prof)
    assert len(c.without) == len(c.with_plan) == len(c.ratios) == 5
    assert all(m.method == "none" for m in c.without) and all(m.method == "recompute_all" for m in c.with_plan)
    sim = memopt.simulate(prof, plan)
    assert c.predicted_peak_bytes == sim.peak_bytes and c.with_plan[0].peak_bytes == sim.peak_bytes  # exact memory
    assert c.with_plan[0].peak_bytes < c.without[0].peak_bytes
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # measuring leaves the model as it was
    text = str(c)
    assert text.splitlines()[0].split() == ["what", "peak", "step", "spread", "vs", "no", "plan"]
    assert "no plan (measured)" in text and "plan recompute_all (predicted)" in text and CPU_CAVEAT in text
    html = c._repr_html_()
    assert html.count("<tr>") == 4 and "<th>spread</th>" in html and "of 5 paired steps" in html


def test_the_table_has_no_false_precision_and_says_the_ratio_spread():
    c = Comparison(without=fake([0.100, 0.110, 0.090, 0.1, 0.1], 2**20), with_plan=fake([0.12, 0.13, 0.1, 0.2, 0.11],
                   2**19), ratios=[1.2, 1.1818, 1.111, 2.0, 1.1], predicted_peak_bytes=2**19,
                   predicted_step_time=0.115, predicted_base_step_time=0.1, method="memopt-ppo", budget_bytes=600_000)
    rows = {r["what"]: r for r in c.rows()}
    assert rows["no plan (measured)"]["step"] == "100 ms" and rows["no plan (measured)"]["spread"] == "90 ms–110 ms"
    assert rows["plan memopt-ppo (measured)"]["vs no plan"] == "1.18× (1.10×–2.00×)"
    assert rows["plan memopt-ppo (predicted)"]["vs no plan"] == "1.15×"
    from memopt_nb.harness.compare import _ms

    assert _ms(2.8173) == "2.82 s" and _ms(0.0123456) == "12.3 ms"  # three significant figures, never more
    assert any("the slowest timed step took 2.0× the fastest" in n for n in c.caveats())  # 0.2 s vs 0.1 s
    assert c.verdict() == ("the plan is slower: measured 1.18× the step without it (median of 5 paired steps, "
                           "1.10×–2.00×); predicted 1.15×; peak 512.00 KiB within the budget 585.94 KiB.")
    assert not c.within_noise


def test_pairs_that_straddle_one_are_within_noise_and_fewer_than_three_never_are():
    c = Comparison(without=fake([0.1] * 4, 2**20), with_plan=fake([0.1] * 4, 2**19), ratios=[0.93, 1.04, 1.1, 0.98])
    assert c.within_noise
    assert c.verdict().startswith("with and without the plan within noise of each other (paired ratios 0.93×–1.10×")
    faster = Comparison(without=fake([0.1] * 3, 2**20), with_plan=fake([0.1] * 3, 2**19), ratios=[0.8, 0.9, 0.85])
    assert not faster.within_noise and faster.verdict().startswith("the plan is faster: measured 0.85×")
    two = Comparison(without=fake([0.1] * 2, 2**20), with_plan=fake([0.1] * 2, 2**19), ratios=[0.9, 1.1])
    assert not two.within_noise


def test_compare_refuses_what_it_cannot_compare(small):
    model, inputs, loss_fn, opt, prof = small
    with pytest.raises(memopt.ProfileError, match="plan="):
        memopt.compare(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan="recompute")
    with pytest.raises(memopt.ProfileError, match="paired steps"):
        memopt.compare(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=memopt.solvers.none(prof), steps=0)


def test_few_pairs_say_so_and_a_plan_alone_gives_the_prediction(small):
    model, inputs, loss_fn, opt, prof = small
    plan = memopt.search(prof, "90%", total_timesteps=64)
    c = memopt.compare(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=2)
    assert c.predicted_step_time == plan.predicted_step_time and c.predicted_base_step_time
    assert any("only 2 paired steps" in n for n in c.caveats())
