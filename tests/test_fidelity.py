"""The copy-cost model (DeviceSpec.copy_seconds with a per-storage term) and fidelity on a model this project did not
write (Hugging Face GPT-2 from a tiny config)."""

import math

import numpy as np
import pytest
import torch
from helpers import tolerances

import memopt_nb as memopt
from memopt_nb import solvers, zoo
from memopt_nb.core.device import DeviceSpec
from memopt_nb.core.errors import MemoptError
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.runtime.detect import _calibrate_copy_overhead, _usable_cores
from memopt_nb.sim.simulator import Simulator, simulate_reference


def _cpu(overhead: float, overlap: bool) -> DeviceSpec:
    return DeviceSpec(name="cpu-like", kind="cpu", capacity_bytes=2**34, h2d_bytes_per_s=4e9, d2h_bytes_per_s=5e9,
                      compute_flops=1e11, copy_overlap=overlap, copy_overhead_s=overhead)


def _swap_all_storages(prof) -> int:
    """Storages a swap-all plan moves, from the profile's groups: every group some unit saves that nothing but autograd
    refers to at some unit boundary (code outside units saves none of them); with every unit swapped each such group's
    owner swaps and no recomputed unit pins it."""
    return sum(g.count for g in prof.groups if g.savers and g.free_pos is not None and not g.outside_saver)


@pytest.fixture(scope="module")
def mlp_profile():
    zm = zoo.build("mlp", batch_size=64)
    opt = torch.optim.Adam(zm.model.parameters())
    return memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, repeats=1)


@pytest.mark.parametrize("overlap", [False, True])
def test_per_storage_cost_adds_count_times_overhead_each_way(mlp_profile, overlap):
    overhead = 37e-6
    count = _swap_all_storages(mlp_profile)
    assert count > 0
    plan = memopt.Plan.uniform(mlp_profile, "swap", offload_window=0, prefetch_distance=0)
    base = memopt.simulate(mlp_profile, plan, device=_cpu(0.0, overlap))
    with_cost = memopt.simulate(mlp_profile, plan, device=_cpu(overhead, overlap))
    assert with_cost.step_time - base.step_time == pytest.approx(2 * count * overhead, rel=1e-9)
    assert with_cost.peak_bytes == base.peak_bytes  # time only
    # the reference simulator agrees on the same formula
    sim = Simulator(mlp_profile, _cpu(overhead, overlap))
    s, w, d = sim.encode(plan)
    ref = simulate_reference(sim, s[0], w[0], d[0])
    assert ref["time"] == pytest.approx(with_cost.step_time, rel=1e-9)


def test_per_storage_cost_counts_only_what_is_offloaded(mlp_profile):
    keep = memopt.Plan.uniform(mlp_profile, "keep")
    rc = memopt.Plan.uniform(mlp_profile, "recompute")
    for plan in (keep, rc):
        a = memopt.simulate(mlp_profile, plan, device=_cpu(0.0, False))
        b = memopt.simulate(mlp_profile, plan, device=_cpu(1e-3, False))
        assert a.step_time == b.step_time


def test_copy_seconds_formula():
    dev = _cpu(10e-6, False)
    assert dev.copy_seconds(4e9, 0, "h2d") == pytest.approx(1.0)
    assert dev.copy_seconds(5e9, 0, "d2h") == pytest.approx(1.0)
    assert dev.copy_seconds(0, 3, "d2h") == pytest.approx(30e-6)
    assert dev.copy_seconds(2e9, 5) == pytest.approx(2e9 / 5e9 + 2e9 / 4e9 + 2 * 5 * 10e-6)
    arr = dev.copy_seconds(np.array([0.0, 1e9]), np.array([1.0, 2.0]), "d2h")
    assert arr == pytest.approx([10e-6, 0.2 + 20e-6])
    with pytest.raises(MemoptError, match="direction"):
        dev.copy_seconds(1, 1, "sideways")
    for bad in (-1e-6, math.inf, "5us"):
        with pytest.raises(MemoptError, match="copy_overhead_s"):
            _cpu(bad, False)


def test_old_device_json_loads_with_no_per_storage_cost():
    data = _cpu(25e-6, True).to_dict()
    assert DeviceSpec.from_dict(data) == _cpu(25e-6, True)
    data.pop("copy_overhead_s")  # a profile saved before the field existed
    old = DeviceSpec.from_dict(data)
    assert old.copy_overhead_s == 0.0
    assert old.copy_seconds(5e9, 100, "d2h") == pytest.approx(1.0)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_exact_solver_matches_brute_force_with_per_storage_cost(overlap, seed):
    # an overhead large against the 2 ms units, so that it changes which plan is fastest
    prof = chain_profile(4, seed=seed, device=_cpu(150e-6, overlap))
    lo = solvers.min_peak(prof)
    budget = int(lo + 0.3 * (prof.peak_bytes - lo))
    exact = solvers.optimal(prof, budget)
    oracle = solvers.brute_force(prof, budget)
    assert exact.feasible and oracle.feasible
    assert exact.predicted_step_time == pytest.approx(oracle.predicted_step_time, rel=1e-9)
    assert exact.meta["milp_step_time"] == pytest.approx(exact.predicted_step_time, rel=1e-6)


def test_detected_cpu_device_has_calibrated_copy_cost():
    spec = DeviceSpec.detect("cpu")
    assert 0.0 <= spec.copy_overhead_s < 0.01
    assert spec.copy_overlap == (torch.get_num_threads() < _usable_cores())
    state = torch.get_rng_state()
    value = _calibrate_copy_overhead(spec.d2h_bytes_per_s)
    assert 0.0 <= value < 0.01
    assert torch.equal(state, torch.get_rng_state())  # calibration leaves the random state alone


# ---------------------------------------------------------------------- a model this project did not write
@pytest.fixture(scope="module")
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # use_cache=False: a recomputed forward would append to the returned KV cache a second time (the cache is
    # tested on its own: test_third_party.py)
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=128, n_positions=64, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(model.parameters())

    def loss_fn(out):
        return out.logits.float().pow(2).mean()

    prof = memopt.profile(model, ids, loss_fn=loss_fn, optimizer=opt, repeats=1)
    return model, ids, loss_fn, opt, prof


@pytest.mark.parametrize("strategy", ["keep", "recompute", "swap"])
def test_hf_gpt2_peak_predicted_within_2_percent(hf_gpt2, strategy):
    model, ids, loss_fn, opt, prof = hf_gpt2
    assert prof.n_units == 3 and all(".h." in name for name in prof.unit_names)
    plan = memopt.Plan.uniform(prof, strategy, offload_window=0, prefetch_distance=0)
    sim = memopt.simulate(prof, plan)
    meas = memopt.measure(model, ids, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1)
    assert abs(sim.peak_bytes - meas.peak_bytes) <= tolerances.GPT2_REL * meas.peak_bytes
    if strategy != "keep":
        assert sim.peak_bytes < prof.peak_bytes  # the plan changes something the prediction has to follow


# ---------------------------------------------------------------------- GPT-2 with its KV cache (use_cache=True)
@pytest.fixture(scope="module")
def hf_gpt2_cache():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # use_cache=True (the default): the output carries a KV cache that every block extends and the loss drops; a
    # recomputed block keeps the cache as it was before its forward (the K/V of the blocks before it) for its replay
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=2, vocab_size=128, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    assert cfg.use_cache
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.Adam(model.parameters())

    def loss_fn(out):
        return out.logits.float().pow(2).mean()

    prof = memopt.profile(model, ids, loss_fn=loss_fn, optimizer=opt, repeats=1)
    return model, ids, loss_fn, opt, prof


@pytest.mark.parametrize("strategies", [("recompute",) * 3, ("recompute", "keep", "recompute"),
                                        ("keep", "recompute", "keep")])
def test_hf_gpt2_with_kv_cache_recompute_peak_is_exact(hf_gpt2_cache, strategies):
    """The KV cache is let go of when the loss drops the output; a recomputed block holds the cache's K/V of earlier
    blocks until its backward, and nothing more (it used to hold the live cache, every block's K/V, to its backward)."""
    model, ids, loss_fn, opt, prof = hf_gpt2_cache
    assert prof.n_units == 3
    plan = memopt.Plan.from_strategies(prof, list(strategies))
    sim = memopt.simulate(prof, plan)
    meas = memopt.measure(model, ids, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1)
    assert sim.peak_bytes == meas.peak_bytes
    assert sim.peak_bytes < prof.peak_bytes
    # the reference replay agrees with the compiled simulator
    sim_c = Simulator(prof)
    s, w, d = sim_c.encode(plan)
    assert simulate_reference(sim_c, s[0], w[0], d[0])["peak"] == sim.peak_bytes
    # the cache's tensors are inputs of the blocks after the one that makes them, let go of after the forward
    late = [g for g in prof.groups if g.free_pos is None and g.release_pos is not None and g.consumers]
    assert late and all(g.release_pos > prof.units[-1].fwd_segment + 1 for g in late)
