"""Measured memory: the CPU tracker agrees with torch's MemTracker, and plans save what they should."""

import pytest
import torch

import memopt_nb as memopt
from memopt_nb.core.plan import Plan
from memopt_nb.runtime.memory import StorageTracker
from memopt_nb.runtime.step import training_step


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "resnet", "mlp"])
def test_tracker_agrees_with_memtracker(name):
    from torch.distributed._tools.mem_tracker import MemTracker

    zm = memopt.zoo.build(name)
    opt = torch.optim.Adam(zm.model.parameters())
    training_step(zm.model, zm.inputs, zm.loss_fn, opt)  # optimizer state exists
    mt = MemTracker()
    mt.track_external(zm.model, opt, *zm.inputs)
    with mt:
        training_step(zm.model, zm.inputs, zm.loss_fn, opt)
    theirs = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    ours = StorageTracker("cpu")
    ours.track(zm.model, opt, list(zm.inputs))
    ours.reset_peak()
    with ours:
        training_step(zm.model, zm.inputs, zm.loss_fn, opt)
    assert abs(ours.peak - theirs) / theirs < 0.02, (ours.peak, theirs)


@pytest.mark.parametrize("name", ["gpt", "vit"])
def test_recompute_all_cuts_peak_by_40_percent(name, zoo_profiles):
    zm, opt, prof = zoo_profiles[name]
    base = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, steps=1)
    rc = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, steps=1,
                        plan=Plan.uniform(prof, "recompute"))
    assert rc.peak_bytes <= 0.6 * base.peak_bytes, (rc.peak_bytes, base.peak_bytes)


@pytest.mark.parametrize("name", memopt.zoo.MODELS)
def test_swap_all_moves_saved_bytes_off_the_device(name, zoo_profiles):
    zm, opt, prof = zoo_profiles[name]
    steps = 2
    m = memopt.measure(zm.model, *zm.inputs, loss_fn=zm.loss_fn, optimizer=opt, steps=steps, warmup=1,
                       plan=Plan.uniform(prof, "swap"))
    per_step = m.swap_stats["offloaded_bytes"] / (steps + 2)
    # bytes saved by units, except storages that code outside the units keeps using — saved by it for its own
    # backward (ResNet's stem ReLU output) or still referenced when the forward ends (the batch the caller holds,
    # U-Net's skip list): those stay on the device whatever the units do
    saved = sum(g.nbytes for g in prof.groups if g.savers and not g.outside_saver and g.free_pos is not None)
    assert per_step == m.swap_stats["prefetched_bytes"] / (steps + 2)
    assert per_step >= 0.9 * saved, (name, per_step / saved)


class _FakeAllocator:
    """Stands in for the CUDA caching allocator's counters (no GPU here): ``allocated`` and its peak since a reset."""

    def __init__(self, start: int) -> None:
        self.allocated = self.max = start

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.max = max(self.max, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def reset(device=None) -> None:
            self.max = self.allocated

        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.max)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def test_cuda_meter_counts_the_training_alone(monkeypatch):
    """CudaMeter leaves out what other tensors held on the device when it started (on a GPU, a leftover model made the
    whole-step peaks of benchmarks/cuda_check.py read 28 parameter sizes high), and rounds the tracked tensors up to
    the allocator's 512-byte blocks, so a step's peak reads the same with or without other tensors around."""
    from memopt_nb.runtime.memory import CudaMeter

    model = torch.nn.Linear(3, 5)  # weight 60 B, bias 20 B: one 512-byte block each
    model(torch.ones(2, 3)).sum().backward()  # grads: two more blocks
    x = torch.ones(200)  # 800 B: two blocks
    own = 4 * 512 + 1024
    peaks = []
    for other in (0, 3 * 2**20):
        fake = _FakeAllocator(own + other)
        fake.install(monkeypatch)
        meter = CudaMeter("cpu")  # the device type the tracked tensors live on
        meter.track(model, None, [x, x[10:]], {})  # a view: its storage once
        assert meter.tracked_bytes() == own
        with meter:
            assert meter.other == other
            assert meter.current == own
            fake.alloc(4096)
            meter.mark("forward")
            fake.free(4096)
            fake.alloc(1024)
        peaks.append(meter.peak)
        assert meter.marks == [("forward", own + 4096, own + 4096)]
        assert meter.current == own + 1024
    assert peaks == [own + 4096, own + 4096]

    fake = _FakeAllocator(own + 3000 + 2**20)  # 3,000 bytes the training holds that no tracked tensor reaches
    fake.install(monkeypatch)
    meter = CudaMeter("cpu")
    meter.track(model, None, [x], {})
    meter.track_bytes(3000)  # counted in 512-byte blocks, as the allocator holds it
    with meter:
        assert meter.other == 2**20 - 72 and meter.current == own + 3072

