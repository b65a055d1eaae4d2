"""PlanSpace: the plan space parsed once from the planners' keyword arguments."""

from __future__ import annotations

import pytest

from memopt_nb.core.errors import PlanError
from memopt_nb.core.plan import STATE_CHOICES, STATE_PIECES, state_choices
from memopt_nb.core.space import PlanSpace


@pytest.mark.parametrize("offload_state", [True, False, {"optimizer"}, "optimizer,grads", {"params"}])
@pytest.mark.parametrize("step_in_backward", [False, True])
def test_placements_are_the_state_choices_of_the_arguments(offload_state, step_in_backward):
    space = PlanSpace.of(offload_state=offload_state, step_in_backward=step_in_backward)
    want = state_choices(offload_state, step_in_backward=step_in_backward)
    assert [STATE_CHOICES[c] for c in space.placements] == list(want)
    assert space.placements[0] == 0 and space.moves_state == (len(want) > 1)
    # the space round-trips through its own offload_state
    assert PlanSpace.of(space.strategies, space.offload_state, step_in_backward) == space


def test_strategies_are_canonical_and_spaces_compare_by_value():
    a = PlanSpace.of("swap,keep,recompute,keep")
    assert a.strategies == ("keep", "recompute", "swap") and a == PlanSpace() and hash(a) == hash(PlanSpace())
    assert a.offload == frozenset(STATE_PIECES)
    b = a.replace(offload_state=False)
    assert b.placements == (0,) and not b.moves_state and b != a and b.strategies == a.strategies
    assert a.replace(strategies=("keep", "recompute")).strategies == ("keep", "recompute")


@pytest.mark.parametrize("kwargs", [{"strategies": ()}, {"strategies": ("keep", "teleport")},
                                    {"offload_state": {"weights"}}, {"step_in_backward": "yes"}])
def test_a_bad_argument_is_refused_once_where_it_is_given(kwargs):
    with pytest.raises(PlanError):
        PlanSpace.of(**kwargs)


def test_replace_names_what_it_does_not_know():
    with pytest.raises(TypeError, match="unknown"):
        PlanSpace().replace(budget=3)
