import dataclasses
import importlib
import json
import math

import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.harness.bench import run_bench
from memopt_nb.harness.evaluate import Evaluation, evaluate, fit_latency, fit_memory

evaluate_module = importlib.import_module("memopt_nb.harness.evaluate")  # the function has this name too


def verdict_class(verdict):
    """Which of the four verdicts a verdict is: exactly one (``"worth it"`` is also a substring of the second)."""
    classes = [v for v, ok in (("worth it", verdict.endswith(" — worth it")),
                               ("not worth it", verdict.endswith(" — not worth it")),
                               ("the only way", verdict.endswith(" — the only way to train here")),
                               ("nothing fits", verdict.startswith("nothing fits the budget"))) if ok]
    assert len(classes) == 1, verdict
    return classes[0]


def expected_verdict(ev):
    """The verdict class the figures call for: a plan is worth it when it trains faster than plain training at plain
    training's largest fitting batch and than plain training with gradient accumulation, at a batch plain training
    cannot fit (by more than the 2% the verdict allows for noise)."""
    plans = [r for k, r in ev.methods.items() if k not in ("none", "grad_accum") and any(r.feasible)]
    none = ev.methods.get("none")
    if none is None or not any(none.feasible):
        return "the only way" if plans else "nothing fits"
    plain_max = max(b for b, f in zip(none.batch_sizes, none.feasible) if f)
    ref = none.throughput[none.batch_sizes.index(plain_max)]
    accum = ev.methods.get("grad_accum")
    if accum is not None:
        ref = max([ref] + [t for t, f in zip(accum.throughput, accum.feasible) if f])
    best = max(plans, key=lambda r: max(t for t, f in zip(r.throughput, r.feasible) if f))
    best_tp = max(t for t, f in zip(best.throughput, best.feasible) if f)
    best_batch = max(b for b, t, f in zip(best.batch_sizes, best.throughput, best.feasible) if f and t == best_tp)
    return "worth it" if best_tp > 1.02 * ref and best_batch > plain_max else "not worth it"


def independent_figures(builder, batches, reference, percent, device=None):
    """Profiles made here, apart from evaluate(): the budget (``percent`` % of the unoptimized peak at ``reference``)
    and, per batch, a function giving a plan's simulated peak."""
    profiles = {}
    for b in sorted(set(batches) | {reference}):
        model, inputs, loss_fn = builder(b)[:3]
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        profiles[b] = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
    budget = profiles[reference].peak_bytes * percent // 100
    return budget, {b: (lambda plan, p=p: memopt.simulate(p, plan, device=device).peak_bytes)
                    for b, p in profiles.items()}


def zoo_builder(name):
    return lambda b: memopt.zoo.build(name, batch_size=b)


def check_consistency(ev, budget, peak_of):
    """Every figure against what was computed here: the budget, each plan's peak (simulated on a profile made here;
    on this CPU the measured peak is claimed equal to it) and whether it fits; the verdict's class."""
    assert ev.budget_bytes == budget
    none = ev.methods["none"]
    for name, r in ev.methods.items():
        assert len(r.feasible) == len(ev.batch_sizes)
        for b, ok, peak, tp, plan in zip(ev.batch_sizes, r.feasible, r.peak_bytes, r.throughput, r.plans or
                                         [None] * len(ev.batch_sizes)):
            if ok:
                assert tp is not None and tp > 0 and math.isfinite(tp)
            if name == "grad_accum":
                continue
            if plan is None:  # the method made no plan: nothing fits
                assert not ok and peak is None, (name, b)
                continue
            expected = peak_of[b](plan)
            assert peak == expected, (name, b, peak, expected)
            assert ok == (expected <= budget), (name, b, expected, budget)
        if name not in ("none",) and none.max_batch is not None and r.max_batch is not None:
            assert r.max_batch >= none.max_batch, name
        if r.max_throughput is not None:
            assert r.max_throughput == max(t for t, f in zip(r.throughput, r.feasible) if f)
    kind = verdict_class(ev.verdict)
    assert kind == expected_verdict(ev), ev.verdict
    assert ev.worth_it == (kind in ("worth it", "the only way"))


@pytest.mark.slow
@pytest.mark.parametrize("name,sizes", [("mlp", [128, 256, 512, 1024]), ("unet", [2, 4, 8])])
def test_evaluate_on_cpu_is_consistent(name, sizes):
    ev = evaluate(name, budget="60%", batch_sizes=sizes, search_timesteps=1500, steps=2)
    assert ev.source == "measured"
    ref = {"mlp": 1024, "unet": 8}[name]  # the zoo builders' default batch: what "60%" refers to
    check_consistency(ev, *independent_figures(zoo_builder(name), sizes, ref, 60))
    assert all(s == "measured" for r in ev.methods.values() for s, p in zip(r.source, r.plans) if p is not None)
    fit = ev.methods["none"].fit
    assert fit["alpha"] > 0 and 0.0 <= fit["r2_memory"] <= 1.0
    assert "<table>" in ev._repr_html_() and "data:image/png" in ev._repr_html_()
    json.dumps(ev.to_dict())


def test_evaluate_simulated_on_a_preset_is_labelled():
    ev = evaluate("mlp", device="v100-16gb", budget="60%", batch_sizes=[256, 512, 1024],
                  methods=("none", "recompute_all", "optimal"), steps=1)
    assert ev.source == "simulated" and ev.device == "v100-16gb"
    assert all(s == "simulated" for r in ev.methods.values() for s in r.source)
    check_consistency(ev, *independent_figures(zoo_builder("mlp"), [256, 512, 1024], 1024, 60, "v100-16gb"))
    # the minimum peak bounds every plan (simulated figures: the same model), and the optimum fits where it fits
    for i, b in enumerate(ev.batch_sizes):
        floor = ev.min_peak_bytes[b]
        for r in ev.methods.values():
            if r.peak_bytes[i] is not None and r.method != "grad_accum":
                assert r.peak_bytes[i] >= floor, (r.method, b)
        assert ev.methods["optimal"].feasible[i] == (floor <= ev.budget_bytes), b


class Wide(nn.Module):
    """Four blocks that widen 128 → 512 inside: the memory of a batch is real (measured), mostly activations inside
    the blocks, which recompute or swap can free; the time of a step is given by an injected clock."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU())
                                     for _ in range(4)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def plateau_builder(batch_size=1024):
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(batch_size, 128)
    return model, (x,), lambda out: out.square().mean()


def injected_clock(monkeypatch, latency):
    """evaluate() measures memory for real but takes step times from ``latency(batch, plan)``: no wall clock decides.

    A plan's step costs a third of a unit's share more per recomputed unit and a tenth per swapped one; gradient
    accumulation costs its micro-batches' steps."""
    real = evaluate_module.measure

    def measure(model, *inputs, plan=None, **kw):
        m = real(model, *inputs, plan=plan, **{**kw, "steps": 1})
        c = plan.counts() if plan is not None else {"recompute": 0, "swap": 0}
        n = len(plan.decisions) if plan is not None else 1
        t = latency(inputs[0].shape[0]) * (1 + (c["recompute"] / 3 + c["swap"] / 10) / n)
        return dataclasses.replace(m, step_time=t, step_times=[t])

    def accum_step_time(model, inputs, loss_fn, opt, accum, repeats=3, autocast=None):
        args, _kwargs = inputs  # (positional inputs, keyword inputs) of one micro-batch
        return accum * latency(args[0].shape[0])

    monkeypatch.setattr(evaluate_module, "measure", measure)
    monkeypatch.setattr(evaluate_module, "_accum_step_time", accum_step_time)


METHODS = ("none", "recompute_all", "swap_all", "grad_accum")
SIZES = [256, 512, 1024]  # at 75% of the peak at 1024, plain training fits 512, recompute-all 1024


def test_verdict_says_not_worth_it_when_throughput_has_plateaued(monkeypatch):
    injected_clock(monkeypatch, lambda b: 1e-4 * b)  # time per sample constant: throughput flat at every batch
    ev = evaluate(plateau_builder, budget="75%", batch_sizes=SIZES, methods=METHODS, steps=1)
    check_consistency(ev, *independent_figures(plateau_builder, SIZES, 1024, 75))
    assert ev.methods["none"].max_batch == 512 and ev.methods["recompute_all"].max_batch == 1024
    assert verdict_class(ev.verdict) == "not worth it" and not ev.worth_it
    assert "throughput has plateaued at batch 256" in ev.verdict
    assert "plans raise the max batch (to 1024 with " in ev.verdict


def test_verdict_says_worth_it_when_a_bigger_batch_is_faster(monkeypatch):
    injected_clock(monkeypatch, lambda b: 0.05 + 1e-6 * b)  # a fixed cost per step: bigger batches are faster
    ev = evaluate(plateau_builder, budget="75%", batch_sizes=SIZES, methods=METHODS, steps=1)
    check_consistency(ev, *independent_figures(plateau_builder, SIZES, 1024, 75))
    assert verdict_class(ev.verdict) == "worth it" and ev.worth_it
    # both plans fit 1024; by this clock a swap costs less than a recomputation
    assert ev.best_method == "swap_all" and ev.methods["swap_all"].best_batch == 1024


def test_fits_recover_known_models():
    b = [1, 2, 4, 8, 16]
    f = fit_memory(b, [3 * x + 10 for x in b])
    assert f["alpha"] == pytest.approx(3) and f["beta"] == pytest.approx(10) and f["r2_memory"] == pytest.approx(1)
    lat = [max(0.04, 0.01 * x) + 0.002 for x in b]
    g = fit_latency(b, lat)
    assert g["k"] == pytest.approx(0.01, rel=1e-6) and g["c"] == pytest.approx(0.002, abs=1e-6)
    assert g["r2_latency"] == pytest.approx(1.0)
    # times that fall as the batch grows (noise): the plateau over the whole range, never worse than their mean
    noisy = fit_latency([128, 256, 512, 1024], [0.9, 0.5, 0.7, 0.4])
    assert noisy["k"] == 0.0 and noisy["c"] == pytest.approx(0.625) and noisy["r2_latency"] >= 0.0


def test_poor_fits_are_named_with_the_result_not_raised():
    ev = Evaluation(model="m", device="cpu", source="measured", budget_bytes=1, batch_sizes=[1, 2], methods={},
                    verdict="v — not worth it", worth_it=False, best_method=None,
                    warnings=["none: r2 of latency fit is 0.87 (< 0.9); read its fitted model with care",
                              "swap_all: r2 of memory fit is 0.50 (< 0.9); read its fitted model with care",
                              "sqrt_n: r2 of latency fit is 0.02 (< 0.9); read its fitted model with care"])
    note = ev.fit_note()
    assert note.endswith("latency of none 0.87, sqrt_n 0.02; memory of swap_all 0.50"), note
    assert "busy machine" in note and "⚠" in ev._repr_html_()
    assert Evaluation(**{**ev.__dict__, "warnings": []}).fit_note() == ""


def test_bad_inputs():
    with pytest.raises(memopt.MemoptError, match="unknown zoo model"):
        evaluate("nope")
    with pytest.raises(memopt.MemoptError, match="unknown method"):
        evaluate("mlp", methods=("magic",))


@pytest.mark.slow
def test_bench_quick_writes_consistent_files(tmp_path):
    suite = {"models": ("mlp",), "devices": (None, "a100-40gb"), "multipliers": (0.125, 0.25, 0.5),
             "search_timesteps": 1200}
    res = run_bench(out=tmp_path, suite=suite, progress=lambda m: None)
    for f in ("bench.md", "bench.json", "bench.png"):
        assert (tmp_path / f).stat().st_size > 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["cases"]) == 2 and data == json.loads(json.dumps(res, default=str))
    # figures computed here, apart from the bench: profiles of the same model at each batch and at the reference
    # batch (1024, the zoo default) the 50% budget refers to
    profiles = {}
    for b in (128, 256, 512, 1024):
        zm = memopt.zoo.build("mlp", batch_size=b)
        opt = torch.optim.Adam(zm.model.parameters(), lr=1e-3)
        profiles[b] = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)
    budget = profiles[1024].peak_bytes * 50 // 100
    for ev in data["evaluations"]:
        assert ev["budget_bytes"] == budget and ev["batch_sizes"] == [128, 256, 512]
        device = None if ev["source"] == "measured" else ev["device"]
        none = ev["methods"]["none"]
        for i, b in enumerate(ev["batch_sizes"]):
            floor = memopt.solvers.min_peak(profiles[b], device)
            assert ev["min_peak_bytes"][str(b)] == floor
            # plain training's peak is the profile's, measured or simulated; it fits where that is within the budget
            assert none["peak_bytes"][i] == profiles[b].peak_bytes
            assert none["feasible"][i] == (profiles[b].peak_bytes <= budget)
            for name, r in ev["methods"].items():
                if r["feasible"][i]:
                    assert r["throughput"][i] > 0 and math.isfinite(r["throughput"][i])
                if name == "grad_accum":
                    continue
                assert r["feasible"][i] == (r["peak_bytes"][i] is not None and r["peak_bytes"][i] <= budget)
                if floor > budget:  # no plan reaches below the minimum peak
                    assert not r["feasible"][i], (name, b)
        for name, r in ev["methods"].items():
            if none["max_batch"] and r["max_batch"] and name != "none":
                assert r["max_batch"] >= none["max_batch"]
    for h in data["cases"]:
        if "next_batch" in h:  # a batch above every baseline's max: fits no plan if its minimum exceeds the budget
            ppo_fits = (h["ppo_max_batch"] or 0) >= h["next_batch"]
            assert not ppo_fits or h["min_peak_over_budget"] <= 1.0
    assert "| mlp |" in (tmp_path / "bench.md").read_text()
