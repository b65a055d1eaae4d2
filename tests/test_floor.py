"""memopt_nb.floor: the smallest reachable peak, what bounds it, and advice that would lower it."""

import pytest
import torch
import torch.nn as nn

import memopt_nb as memopt
import memopt_nb.planners.floor
from memopt_nb.planners.floor import FIXED_STATE, KEPT_ACTIVATIONS, LARGEST_UNIT, explain_floor


class Blocks(nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, a)) for a, b in widths])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def profile_of(widths, batch, optimizer=True):
    torch.manual_seed(0)
    model = Blocks(widths)
    opt = torch.optim.AdamW(model.parameters()) if optimizer else None
    return memopt.profile(model, torch.randn(batch, widths[0][0]), optimizer=opt, repeats=1)


def test_parts_add_up_to_the_floor_and_name_the_largest():
    prof = profile_of([(64, 256)] * 4, 32)
    floor = explain_floor(prof)
    assert floor.floor_bytes == memopt.solvers.min_peak(prof, offload_state=False)  # activations only
    assert sum(floor.parts().values()) == floor.floor_bytes
    assert floor.bound == max(floor.parts(), key=floor.parts().get)
    # the state on the device where the floor's plan peaks (the optimizer step: with the step's own working set), not
    # the whole state at its end-of-step size
    parts = floor.peak_parts
    fixed = parts["parameters"] + parts["optimizer state"] + parts["gradients made so far"]
    assert floor.fixed_bytes == fixed + (parts["working set"] if floor.peak_phase == "optimizer step" else 0)
    assert memopt.format_bytes(floor.floor_bytes) in floor.text()


def test_weights_and_adam_state_bound_the_floor_of_a_wide_mlp_at_a_small_batch():
    # an MLP whose weights, gradients and AdamW state dwarf its activations
    floor = explain_floor(profile_of([(512, 512)] * 8, 8))
    assert floor.bound == FIXED_STATE
    assert "fixed state" in floor.bound_text()
    text = " ".join(floor.advice)
    assert "finer units" not in text  # units cannot help here: say so, advise only what would
    assert "FSDP2" in text


def test_one_huge_unit_bounds_the_floor_and_finer_units_are_advised():
    floor = explain_floor(profile_of([(16, 16), (16, 4096), (16, 16)], 512, optimizer=False))
    assert floor.bound == LARGEST_UNIT and floor.largest_unit == "blocks.1"
    assert any("finer units" in a and "blocks.1" in a for a in floor.advice)
    assert any("smaller batch" in a for a in floor.advice)


def test_kept_activations_advice_is_a_smaller_batch_only():
    f = memopt.planners.floor.Floor(floor_bytes=100, fixed_bytes=10, largest_unit="u", largest_unit_bytes=20,
                                    kept_bytes=70, bound=KEPT_ACTIVATIONS,
                                    advice=["a smaller batch (kept activations grow with it)"])
    assert "kept activations" in f.bound_text() and "70%" in f.bound_text()


@pytest.mark.slow
def test_budget_error_explains_the_floor():
    prof = profile_of([(512, 512)] * 8, 8)
    floor = explain_floor(prof, offload_state=True)  # the search's default space
    with pytest.raises(memopt.BudgetError) as err:
        memopt.search(prof, floor.floor_bytes - 1)
    msg = str(err.value)
    assert floor.bound_text() in msg and "FSDP2" in msg
    assert "add units" not in msg and "finer units" not in msg


def test_breakdown_names_where_the_floor_plan_peaks_and_its_parts_add_up():
    """A chain whose unit 0 has by far the largest working set (512 MiB when recomputed) that the floor's plan never
    recomputes: the breakdown names the segment where that plan peaks (not unit 0), and its parts add up to the
    floor exactly; that segment's peak under the MILP's plan is the floor."""
    import dataclasses

    import numpy as np

    from memopt_nb.core.space import PlanSpace
    from memopt_nb.harness.synthetic import chain_profile
    from memopt_nb.planners.floor import PEAK_PARTS
    from memopt_nb.planners.milp import cached_min_peak_plan
    from memopt_nb.sim.simulator import Simulator

    prof = chain_profile(4, seed=0)
    units = list(prof.units)
    units[0] = dataclasses.replace(units[0], rc_bwd_rel_peak=512 * 2**20)
    prof = dataclasses.replace(prof, units=units)
    floor = explain_floor(prof)
    assert floor.largest_unit == "blocks.3" and floor.peak_where == "the backward of blocks.3"
    assert floor.peak_phase == "backward"
    assert floor.breakdown_text().startswith("peak in the backward of blocks.3: parameters ")
    assert list(floor.peak_parts) == list(PEAK_PARTS) and sum(floor.peak_parts.values()) == floor.floor_bytes
    assert sum(floor.parts().values()) == floor.floor_bytes
    sim = Simulator(prof)
    value, arrays = cached_min_peak_plan(sim, PlanSpace.of(("keep", "recompute", "swap"), False, False))
    peaks = sim.evaluate(*(np.array([a]) for a in arrays[:3]), details=True)["peaks"][0]
    assert value == floor.floor_bytes == int(np.ceil(peaks[prof.units[3].bwd_segment]))
