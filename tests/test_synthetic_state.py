"""chain_profile(state_bytes=...): synthetic chains whose units have parameters, gradients and optimizer state."""

from __future__ import annotations

import memopt_nb as memopt
from memopt_nb import solvers
from memopt_nb.core.plan import Plan
from memopt_nb.core.space import PlanSpace
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners.options import unit_states


def test_default_chain_has_no_unit_state():
    p = chain_profile(8, seed=3)
    assert all(u.grad_bytes == 0 and u.param_bytes == 0 for u in p.units)
    assert p.step_segment == -1
    assert unit_states(memopt.Simulator(p), PlanSpace()) == [[0]] * 8


def test_default_chain_draws_unchanged_by_the_option():
    a, b = chain_profile(8, seed=5), chain_profile(8, seed=5, state_bytes=4 * 2**20)
    assert [u.fwd_time for u in a.units] == [u.fwd_time for u in b.units]
    assert [u.interior_bytes for u in a.units] == [u.interior_bytes for u in b.units]


def test_state_chain_is_consistent_and_has_placements():
    p = chain_profile(8, seed=3, state_bytes=8 * 2**20)
    assert all(u.grad_bytes > 0 and u.optimizer_bytes == 2 * u.grad_bytes for u in p.units)
    assert memopt.simulate(p, Plan.uniform(p, "keep")).peak_bytes == p.peak_bytes
    offered = unit_states(memopt.Simulator(p), PlanSpace())
    assert all(len(o) > 1 for o in offered)
    assert solvers.min_peak(p, offload_state=True) < solvers.min_peak(p, offload_state=False)
