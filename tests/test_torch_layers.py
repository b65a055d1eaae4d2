"""Every plan feature on models built from torch's own layers that the zoo does not use, and on two more transformers
vision models (random init from small configs).

* ``nn.LSTM`` and ``nn.GRU`` (their weights also listed in a flat ``_flat_weights``; stacked layers with dropout);
* ``nn.utils.parametrizations.weight_norm`` (the weight is computed from ``original0`` / ``original1`` in every
  forward);
* ``nn.TransformerEncoder`` with a padding mask, and ``nn.MultiheadAttention`` called as self-attention,
  ``attn(y, y, y)``: its forward takes the packed in-projection only when ``query is key is value``, so a recomputation
  must get one tensor back where the first forward got one (``recompute_offload`` once gave it three);
* convolutions in ``channels_last`` with GroupNorm: the weights, their gradients and Adam's state are dense but not
  contiguous (they were once refused for offload, and their state left on the device);
* transformers ResNet (BatchNorm, whose running statistics a recomputation must not update twice), Swin (window
  attention, relative position bias, dropout), Bart (encoder-decoder, embeddings shared by both stacks and the head),
  CLIP (two towers, a contrastive loss, ``logit_scale`` outside every unit) and Whisper (a convolutional front end,
  cross-attention, the decoder's cache).

Each trains 3 Adam steps with and without a plan and compares losses, gradients, parameters, buffers and optimizer
state bit for bit; the measured peak is the simulator's, to the byte, but for two known misses pinned in
:data:`KNOWN_MISSES`.
"""

import helpers.whole_step as ws
import pytest
import torch
from helpers.torch_layers import MODELS, _plans

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.plan import Plan
from memopt_nb.runtime.storages import dense, exclusive

pytestmark = pytest.mark.usefixtures("one_thread")


#: (model, plan): measured peak minus predicted, bytes — the simulator's known misses, pinned so that any change shows.
#: Both are a unit stepped in backward that is also recomputed: the state table adds the step's spike as a delta over
#: the *keep* profile's backward peak, and a recomputed unit's own backward peaks lower or higher than keep's plus its
#: saved bytes (weight_norm: its norm is not alive at the recomputation's peak; see the xfail test below).
KNOWN_MISSES = {("weight_norm", "whole_step"): 256, ("hf_bart", "whole_step"): -8128}


def _train(name: str, plan: Plan | None, steps: int = 3):
    """``steps`` Adam steps of a fresh model ``name`` (under ``plan`` if given), in ``test_whole_step_apply``'s form."""
    build, args, kwargs, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build()
    return ws.train_loop(model, ws.OPTIMIZERS["adam"](model.parameters()), plan,
                         lambda m: loss_fn(m(*args, **kwargs)), steps)


_CACHE: dict = {}


def _profile(name: str):
    if name not in _CACHE:
        build, args, kwargs, loss_fn = MODELS[name]
        torch.manual_seed(0)
        model = build()
        opt = ws.OPTIMIZERS["adam"](model.parameters())
        prof = memopt.profile(model, *args, loss_fn=loss_fn, optimizer=opt, repeats=1, **kwargs)
        _CACHE[name] = (model, opt, prof, _train(name, None))
    return _CACHE[name]


@pytest.mark.parametrize("name", list(MODELS))
def test_every_kind_of_plan_trains_bit_identically_and_peaks_where_predicted(name):
    model, opt, prof, ref = _profile(name)
    build, args, kwargs, loss_fn = MODELS[name]
    assert prof.n_units >= 2 and all(u.recomputable for u in prof.units)
    for what, plan in _plans(prof, opt).items():
        got = _train(name, plan)
        ws._assert_same_training(ref, got, stepped=what == "whole_step")
        if what.startswith("whole"):
            ws._assert_moved(got[2]["stats"], plan)
        elif what == "swap":
            assert got[2]["stats"]["offloaded_bytes"] > 0
        m = memopt.measure(model, *args, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **kwargs)
        predicted = memopt.simulate(prof, plan).peak_bytes
        assert m.peak_bytes - predicted == KNOWN_MISSES.get((name, what), 0), (what, m.peak_bytes, predicted)


@pytest.mark.xfail(strict=True, reason="known simulator miss: the measured peak is 256 B (0.1 %) above the prediction")
def test_weight_norm_swap_then_recompute_stepped_in_backward_peaks_where_predicted():
    """The smallest plan found with the miss: a weight-normed unit swapped, the next recomputed with its optimizer
    state offloaded and its step in backward. The peak is in that step (Adam on the second unit); the simulator puts
    it 256 bytes lower. Each decision alone, or the second unit kept, is predicted exactly."""
    model, opt, prof, _ = _profile("weight_norm")
    build, args, kwargs, loss_fn = MODELS["weight_norm"]
    rows = [("keep", "resident", "resident", "resident")] * prof.n_units
    rows[5] = ("swap", "resident", "resident", "resident")
    rows[6] = ("recompute", "offload", "step", "resident")
    plan = ws._whole(Plan.uniform(prof, "keep"), rows, step_in_backward=True, opt=opt)
    m = memopt.measure(model, *args, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **kwargs)
    assert m.peak_bytes == memopt.simulate(prof, plan).peak_bytes


@pytest.mark.parametrize("name", ["self_attention", "channels_last"])
def test_the_exact_planners_plan_trains_identically_within_its_budget(name):
    model, opt, prof, ref = _profile(name)
    build, args, kwargs, loss_fn = MODELS[name]
    keep = memopt.simulate(prof, Plan.uniform(prof, "keep")).peak_bytes
    floor = solvers.min_peak(prof)
    budget = int(floor + 0.3 * (keep - floor))
    plan = solvers.optimal(prof, budget, strategies=("keep", "recompute", "swap", "recompute_offload"),
                           time_limit=20)
    ws._assert_same_training(ref, _train(name, plan))
    m = memopt.measure(model, *args, loss_fn=loss_fn, optimizer=opt, plan=plan, steps=1, **kwargs)
    assert m.peak_bytes == memopt.simulate(prof, plan).peak_bytes <= budget


def test_self_attention_recomputed_from_offloaded_inputs_takes_the_packed_projection():
    """``attn(y, y, y)``: the recomputation gets one tensor back for the three arguments (else MultiheadAttention's
    forward would take the separate projections and checkpoint would refuse the different saved tensors)."""
    model, opt, prof, ref = _profile("self_attention")
    plan = Plan.uniform(prof, "recompute_offload")
    got = _train("self_attention", plan)
    ws._assert_same_training(ref, got)
    assert got[2]["stats"]["offloaded_bytes"] == 3 * memopt.simulate(prof, plan).bytes_offloaded > 0


def test_channels_last_weights_and_their_state_can_leave_the_device():
    model, opt, prof, _ = _profile("channels_last")
    conv = model.blocks[1][0].weight
    assert not conv.is_contiguous() and dense(conv) and exclusive(conv)
    assert all(u.params_offloadable for u in prof.units)
    plan = ws._whole(Plan.uniform(prof, "keep"), [("keep", "offload", "offload", "offload")], opt=opt)
    got = _train("channels_last", plan)
    stats = got[2]["stats"]
    ws._assert_moved(stats, plan)
    assert stats.get("state_left_resident", 0) == 0 and stats.get("grads_left_resident", 0) == 0


def test_dense_is_any_order_of_the_dimensions_without_gaps_or_overlaps():
    t = torch.empty(2, 3, 4, 5)
    assert dense(t) and dense(t.permute(0, 2, 3, 1)) and dense(t.to(memory_format=torch.channels_last))
    assert dense(t[:1]) and dense(torch.empty(1, 1)) and dense(torch.empty(0, 3))
    assert not dense(t[:, :, ::2]) and not dense(t[:, :1]) and not dense(t[:, 1:])
    assert not dense(torch.empty(4).expand(3, 4))
    assert not exclusive(t[:, 1:]) and not exclusive(t[:1])  # dense, but not the whole of its storage
