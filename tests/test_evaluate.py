import json
import math

import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
from memopt_nb.bench import run_bench
from memopt_nb.evaluate import evaluate, fit_latency, fit_memory


def check_consistency(ev):
    none = ev.methods["none"]
    for name, r in ev.methods.items():
        assert len(r.feasible) == len(ev.batch_sizes)
        for ok, peak, tp in zip(r.feasible, r.peak_bytes, r.throughput):
            if ok:
                assert tp is not None and tp > 0 and math.isfinite(tp)
                if name != "grad_accum":
                    assert peak is not None and peak <= ev.budget_bytes
        if name not in ("none",) and none.max_batch is not None and r.max_batch is not None:
            assert r.max_batch >= none.max_batch, name
        if r.max_throughput is not None:
            assert r.max_throughput == max(t for t, f in zip(r.throughput, r.feasible) if f)
    assert ev.verdict and any(w in ev.verdict for w in ("worth it", "only way", "nothing fits"))


@pytest.mark.parametrize("name,sizes", [("mlp", [128, 256, 512, 1024]), ("unet", [2, 4, 8])])
def test_evaluate_on_cpu_is_consistent(name, sizes):
    ev = evaluate(name, budget="60%", batch_sizes=sizes, search_timesteps=1500, steps=2)
    assert ev.source == "measured"
    check_consistency(ev)
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
    check_consistency(ev)
    # the minimum peak bounds every plan (simulated figures: the same model), and the optimum fits where it fits
    for i, b in enumerate(ev.batch_sizes):
        floor = ev.min_peak_bytes[b]
        for r in ev.methods.values():
            if r.peak_bytes[i] is not None and r.method != "grad_accum":
                assert r.peak_bytes[i] >= floor, (r.method, b)
        assert ev.methods["optimal"].feasible[i] == (floor <= ev.budget_bytes), b


class Wide(nn.Module):
    """Each sample costs the same compute whatever the batch: throughput is flat from the smallest batch on."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(4)])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def plateau_builder(batch_size=1024):
    torch.manual_seed(0)
    model = Wide()
    x = torch.randn(batch_size, 512)
    return model, (x,), lambda out: out.square().mean()


def test_verdict_says_not_worth_it_when_throughput_has_plateaued():
    ev = evaluate(plateau_builder, budget="80%", batch_sizes=[512, 1024, 2048],
                  methods=("none", "recompute_all", "swap_all", "grad_accum"), steps=3)
    check_consistency(ev)
    assert ev.methods["none"].max_batch == 512
    assert not ev.worth_it
    assert "not worth it" in ev.verdict


def test_fits_recover_known_models():
    b = [1, 2, 4, 8, 16]
    f = fit_memory(b, [3 * x + 10 for x in b])
    assert f["alpha"] == pytest.approx(3) and f["beta"] == pytest.approx(10) and f["r2_memory"] == pytest.approx(1)
    lat = [max(0.04, 0.01 * x) + 0.002 for x in b]
    g = fit_latency(b, lat)
    assert g["k"] == pytest.approx(0.01, rel=1e-6) and g["c"] == pytest.approx(0.002, abs=1e-6)
    assert g["r2_latency"] == pytest.approx(1.0)


def test_bad_inputs():
    with pytest.raises(memopt.MemoptError, match="unknown zoo model"):
        evaluate("nope")
    with pytest.raises(memopt.MemoptError, match="unknown method"):
        evaluate("mlp", methods=("magic",))


def test_bench_quick_writes_consistent_files(tmp_path):
    suite = {"models": ("mlp",), "devices": (None, "a100-40gb"), "multipliers": (0.125, 0.25, 0.5),
             "search_timesteps": 1200}
    res = run_bench(out=tmp_path, suite=suite, progress=lambda m: None)
    for f in ("bench.md", "bench.json", "bench.png"):
        assert (tmp_path / f).stat().st_size > 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["cases"]) == 2 and data == json.loads(json.dumps(res, default=str))
    for ev in data["evaluations"]:
        none = ev["methods"]["none"]
        for name, r in ev["methods"].items():
            if none["max_batch"] and r["max_batch"] and name != "none":
                assert r["max_batch"] >= none["max_batch"]
            for ok, tp, peak in zip(r["feasible"], r["throughput"], r["peak_bytes"]):
                if ok:
                    assert tp > 0 and math.isfinite(tp)
                    if name != "grad_accum":
                        assert peak <= ev["budget_bytes"]
    for h in data["cases"]:
        if "next_batch" in h:  # a batch above every baseline's max: fits no plan if its minimum exceeds the budget
            ppo_fits = (h["ppo_max_batch"] or 0) >= h["next_batch"]
            assert not ppo_fits or h["min_peak_over_budget"] <= 1.0
    assert "| mlp |" in (tmp_path / "bench.md").read_text()
