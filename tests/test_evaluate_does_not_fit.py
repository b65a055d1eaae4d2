"""memopt.evaluate on a device that does not hold the larger batches' unplanned step (evaluate uses
max_batch's machinery instead of profiling each batch unplanned). Under memopt.limit_memory, the batches whose
unplanned step the line through the smaller ones predicts above the device are extrapolated, never run unplanned;
plans predicted to fit are measured there; rows that are predicted say so in their source."""

import importlib

import pytest
from helpers.does_not_fit import build

import memopt_nb as memopt
from memopt_nb.profiling import fallback

pytestmark = pytest.mark.usefixtures("one_thread")

evaluate_module = importlib.import_module("memopt_nb.harness.evaluate")  # the function has this name too

WANT = 16
SIZES = [2, 4, 8, WANT]
METHODS = ("none", "recompute_all", "optimal", "grad_accum")


def test_evaluate_under_a_limit_never_runs_what_does_not_fit(monkeypatch):
    model, inputs, loss_fn, opt = build(WANT)
    peak = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=1).peak_bytes
    limit = int(0.6 * peak)
    del model, opt

    def no_fallback(*args, **kwargs):  # memopt.profile only extrapolates itself after the unplanned step ran out
        raise AssertionError("evaluate ran an unplanned step that did not fit the device")

    measured, real_measure = [], evaluate_module.measure

    def measure(model, *args, plan=None, **kwargs):
        measured.append((args[0].shape[0], plan.method if plan is not None else None))
        return real_measure(model, *args, plan=plan, **kwargs)  # an out-of-memory error here fails the test too

    monkeypatch.setattr(fallback, "_extrapolated_profile", no_fallback)
    monkeypatch.setattr(evaluate_module, "measure", measure)
    monkeypatch.setattr(evaluate_module, "_RAN_OUT", "")  # any step that ran out would be seen below
    with memopt.limit_memory(limit) as lim:
        ev = memopt.evaluate(build, budget="50%", batch_sizes=SIZES, reference_batch=WANT, methods=METHODS,
                             steps=1, search_timesteps=256)
    assert lim.peak_bytes <= limit
    assert ev.source == "measured" and ev.profiled == {2: "measured", 4: "measured", 8: "measured",
                                                       WANT: "extrapolated"}
    assert abs(ev.budget_bytes - peak // 2) <= 0.02 * peak  # 50% of the extrapolated peak at batch 16
    i = SIZES.index(WANT)
    none = ev.methods["none"]
    assert not none.feasible[i] and none.source[i] == ("simulated (extrapolated profile), not run: above this "
                                                       "device's memory")
    assert abs(none.peak_bytes[i] - peak) <= 0.02 * peak  # predicted, labelled so
    assert all(s == "measured" for s in none.source[:i]) and none.max_batch == 4  # 8 fits the device, not the budget
    assert (WANT, None) not in measured and (WANT, "none") not in measured
    # plans predicted to fit the device at the batch that does not fit unplanned are measured there, inside it
    for name in ("recompute_all", "optimal"):
        r = ev.methods[name]
        assert r.plans[i] is not None and r.plans[i].predicted_peak_bytes <= limit
        assert r.source[i] == "measured" and r.peak_bytes[i] <= limit, (name, r.source[i], r.peak_bytes[i])
        assert (WANT, r.plans[i].method) in measured
    assert ev.methods["optimal"].feasible[i] and ev.methods["optimal"].max_batch == WANT
    assert ev.methods["grad_accum"].source == ["measured"] * len(SIZES)
    assert ev.to_dict()["profiled"][WANT] == "extrapolated"
    # outside the limit (the emulated device holds what the host holds) every batch is profiled, as before
    ev = memopt.evaluate(build, budget="50%", batch_sizes=[2, 4], methods=("none",), steps=1)
    assert ev.profiled == {2: "measured", 4: "measured", 8: "measured"}  # 8: the builder's default, the reference
