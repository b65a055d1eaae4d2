"""``recompute_offload``: recompute a unit and send the inputs its checkpoint keeps to the host.

What must hold: training is bit-identical to no plan (dropout, BatchNorm, Hugging Face GPT-2 with its KV cache, ViT);
the inputs really leave (the swap engine offloads them and brings all back, none on demand); the measured peak on the
emulated device is the simulator's prediction for every offload window and prefetch distance; and the strategy lowers
the floor below what keep / recompute / swap reach where kept inputs bound it.
"""

import helpers.third_party as third
import pytest
import torch

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.plan import STRATEGIES, Decision, Plan

RO = "recompute_offload"
# the small zoo models' checks (every timing, BatchNorm, dropout, the floor) are in test_runtime_small.py


@pytest.mark.slow
@pytest.mark.parametrize("units", ["auto", "fine"])
def test_hf_gpt2_with_its_cache(units):
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    step = third.gpt2_cache_step(ids)

    prof = memopt.profile(third.gpt2(transformers), loss_fn=lambda o: o.loss, units=units, repeats=1, input_ids=ids,
                          labels=ids)
    names = [u.name for u in prof.units]
    ref = third.train(lambda: third.gpt2(transformers), step)
    for cycle in ([RO], [RO, "swap", "keep", "recompute"]):
        plan = Plan(decisions=tuple(Decision(u, cycle[i % len(cycle)]) for i, u in enumerate(names)), method="ro")
        got = third.train(lambda: third.gpt2(transformers), step, lambda m, p=plan: p)
        third.assert_same(ref, got, (units, cycle))
        assert got["extras"] == ref["extras"]  # the returned cache is not extended twice


def test_recompute_offload_lowers_a_third_party_floor():
    """Transformers GPT-2 split into fine units: recompute keeps every small unit's input, which bounds the floor;
    recompute_offload sends them to the host, so the floor drops."""
    transformers = pytest.importorskip("transformers")
    import helpers.fine_units as fine

    prof = memopt.profile(third.gpt2(transformers), loss_fn=lambda o: o.loss, units="fine", repeats=1,
                          input_ids=fine.IDS, labels=fine.IDS)
    old = solvers.min_peak(prof, strategies=("keep", "recompute", "swap"), offload_state=False)
    new = solvers.min_peak(prof, strategies=STRATEGIES, offload_state=False)
    assert new < old


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "vit"])
def test_third_party_fine_units_measured_as_predicted(model):
    """Hugging Face GPT-2 (KV cache, dropout) and ViT profiled with units='fine': a plan mixing recompute_offload with
    the other strategies trains bit-identically and its measured peak is the simulator's."""
    transformers = pytest.importorskip("transformers")
    import helpers.fine_units as fine

    if model == "gpt2":
        build, step, inputs = (lambda: third.gpt2(transformers)), fine.gpt2_step, dict(input_ids=fine.IDS,
                                                                                         labels=fine.IDS)
    else:
        build, step, inputs = (lambda: fine.vit(transformers)), fine.vit_step, dict(pixel_values=fine.PIXELS,
                                                                                      labels=fine.LABELS)
    torch.manual_seed(0)
    net = build()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    prof = memopt.profile(net, loss_fn=lambda o: o.loss, optimizer=opt, units="fine", repeats=1, **inputs)
    cycle = [RO, "keep", RO, "swap", "recompute"]
    plan = Plan.from_strategies(prof, [cycle[i % len(cycle)] for i in range(prof.n_units)], offload_window=1,
                                prefetch_distance=1)
    ref = third.train(build, step)
    third.assert_same(ref, third.train(build, step, lambda m: plan), (model, "fine", "ro"))
    m = memopt.measure(net, loss_fn=lambda o: o.loss, optimizer=opt, plan=plan, steps=1, **inputs)
    assert m.swap_stats["offloaded_bytes"] > 0
    assert m.peak_bytes == memopt.simulate(prof, plan).peak_bytes
