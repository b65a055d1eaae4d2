import numpy as np
import pytest

import memopt_nb as memopt
from memopt_nb.plan import Plan
from memopt_nb.simulate import Simulator, simulate_reference
from memopt_nb.synthetic import chain_profile


@pytest.mark.parametrize("case", ["gpt", "resnet", "unet", "chain12", "chain48"])
def test_batched_simulator_equals_reference(case, zoo_profiles):
    prof = chain_profile(int(case[5:]), seed=3) if case.startswith("chain") else zoo_profiles[case][2]
    for device in (None, "a100-40gb", "v100-16gb"):
        sim = Simulator(prof, device)
        rng = np.random.default_rng(0)
        B, n = 64, prof.n_units
        s, w, d = rng.integers(0, 3, (B, n)), rng.integers(0, 3, (B, n)), rng.integers(0, 4, (B, n))
        peak, t = sim.evaluate(s, w, d)
        for b in range(B):
            ref = simulate_reference(sim, s[b], w[b], d[b])
            assert ref["peak"] == pytest.approx(peak[b], rel=1e-12)
            assert ref["time"] == pytest.approx(t[b], rel=1e-12)


def random_plans(prof, k, seed):
    rng = np.random.default_rng(seed)
    n = prof.n_units
    for _ in range(k):
        yield Plan.from_strategies(prof, list(rng.choice(["keep", "recompute", "swap"], n)),
                                   offload_window=[int(x) for x in rng.integers(0, 3, n)],
                                   prefetch_distance=[int(x) for x in rng.integers(0, 4, n)])


@pytest.mark.parametrize("name", memopt.zoo.MODELS)
def test_simulated_peak_matches_measured(name, zoo_profiles):
    """CPU memory is deterministic, so the bound can be tight; the benchmark reports the exact errors."""
    zm, opt, prof = zoo_profiles[name]
    plans = [Plan.uniform(prof, s) for s in ("keep", "recompute", "swap")] + list(random_plans(prof, 3, 0))
    for plan in plans:
        sim = memopt.simulate(prof, plan)
        meas = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, plan=plan, steps=1)
        assert abs(sim.peak_bytes - meas.peak_bytes) <= 0.03 * meas.peak_bytes, (name, plan.strategies)


def test_other_device_rescales_time(zoo_profiles):
    _, _, prof = zoo_profiles["gpt"]
    plan = Plan.uniform(prof, "recompute")
    here = memopt.simulate(prof, plan)
    a100 = memopt.simulate(prof, plan, device="a100-40gb")
    ratio = prof.device.compute_flops / memopt.DeviceSpec.preset("a100-40gb").compute_flops
    assert a100.compute_time == pytest.approx(here.compute_time * ratio, rel=1e-9)
    assert a100.peak_bytes == here.peak_bytes
    custom = memopt.simulate(prof, plan, device=prof.device.with_changes(time_scale=0.5))
    assert custom.step_time == pytest.approx(here.step_time * 0.5, rel=1e-9)


def test_sim_result_fields(zoo_profiles):
    _, _, prof = zoo_profiles["resnet"]
    plan = Plan.uniform(prof, "swap", offload_window=1, prefetch_distance=2)
    r = memopt.simulate(prof, plan, device="v100-16gb", budget=10**12)
    assert r.feasible is True
    assert r.bytes_offloaded > 0 and r.bytes_offloaded == r.bytes_prefetched
    assert r.step_time == pytest.approx(r.compute_time + r.stall_time, rel=1e-9)
    assert len(r.timeline) == 2 * len(prof.segments)
    assert max(row["bytes"] for row in r.timeline) == pytest.approx(r.peak_bytes, rel=1e-9)


def test_unknown_preset_lists_names(zoo_profiles):
    _, _, prof = zoo_profiles["mlp"]
    with pytest.raises(memopt.MemoptError, match="a100-40gb"):
        memopt.simulate(prof, Plan.uniform(prof, "keep"), device="tpu-v9")
