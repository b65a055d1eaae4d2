"""The strategy registry (memopt_nb/core/strategies.py): what derives from it agrees with it everywhere."""

from __future__ import annotations

import numpy as np
import pytest

from memopt_nb.core.errors import PlanError
from memopt_nb.core.strategies import (
    CODES,
    DEFAULT_STRATEGIES,
    NAMES,
    OFFLOADING,
    PLACES,
    RECOMPUTING,
    REGISTRY,
    STATE_CHOICES,
    STATE_PIECES,
    STRATEGIES,
    by_code,
    by_name,
    code_of,
    save_set_of,
)
from memopt_nb.planners.options import N_OPTIONS, OPTION_BASE, TIMINGS, code_options, option_codes


def test_codes_are_consecutive_and_round_trip():
    assert sorted(NAMES) == list(range(len(NAMES)))
    for s in REGISTRY:
        assert CODES[s.name] == s.code and by_name(s.name) is s
        for j, code in enumerate(s.codes):
            assert NAMES[code] == s.name and by_code(code) == (s, j)
            variant = s.variants[j] if s.variants else ""
            assert code_of(s.name, variant) == code and save_set_of(code) == variant


@pytest.mark.parametrize("bad", [-1, len(NAMES)])
def test_a_code_outside_the_registry_is_refused(bad):
    with pytest.raises(PlanError, match="codes are 0"):
        by_code(bad)


def test_derived_names_follow_the_flags():
    assert STRATEGIES == tuple(s.name for s in REGISTRY)
    assert set(OFFLOADING) == {s.name for s in REGISTRY if s.offloads}
    assert set(RECOMPUTING) == {s.name for s in REGISTRY if s.recomputes}
    assert set(DEFAULT_STRATEGIES) == {s.name for s in REGISTRY if s.default}
    assert len({s.letter for s in REGISTRY}) == len(REGISTRY)  # the demo's per-unit codes can be read back
    assert all(not (s.timed and s.variants) for s in REGISTRY)  # an option is a timing or a variant, not both


def test_state_choices_are_the_places_of_each_piece():
    assert STATE_CHOICES[0] == ("resident",) * 3
    names = {p.name: p for p in PLACES}
    for choice in STATE_CHOICES:
        for piece, place in zip(STATE_PIECES, choice, strict=True):
            assert piece in names[place].pieces


def test_option_numbering_round_trips_and_follows_the_registry():
    total = max(OPTION_BASE[s.code] + (len(TIMINGS) if s.timed else len(s.codes)) for s in REGISTRY)
    codes, w, d = option_codes(np.arange(total))
    assert list(code_options(codes, w, d)) == list(range(total))
    for s in REGISTRY:
        b = OPTION_BASE[s.code]
        if s.timed:
            assert set(codes[b:b + len(TIMINGS)]) == {s.code}
            assert list(zip(w[b:b + len(TIMINGS)], d[b:b + len(TIMINGS)], strict=True)) == list(TIMINGS)
        else:
            assert list(codes[b:b + len(s.codes)]) == list(s.codes)
            assert {(int(a), int(c)) for a, c in zip(w[b:b + len(s.codes)], d[b:b + len(s.codes)], strict=True)} == {
                s.timing}
    assert N_OPTIONS == max(OPTION_BASE[s.code] + (len(TIMINGS) if s.timed else 1) for s in REGISTRY if s.default)


def test_every_strategy_has_a_mechanism_a_colour_and_a_letter():
    from memopt_nb.harness.demo import CODES_LEGEND
    from memopt_nb.notebook.plots import STRATEGY_COLORS
    from memopt_nb.runtime.apply import MECHANISMS

    assert set(MECHANISMS) == set(STRATEGIES)
    assert set(STRATEGY_COLORS) == set(STRATEGIES)
    assert len(set(map(tuple, STRATEGY_COLORS.values()))) == len(STRATEGIES)
    for s in REGISTRY:
        assert f"{s.letter} {s.name}" in CODES_LEGEND


def test_the_simulator_refuses_a_code_outside_the_registry():
    from memopt_nb.harness.synthetic import chain_profile
    from memopt_nb.sim.simulator import Simulator

    sim = Simulator(chain_profile(4))
    ones = np.ones((1, sim.n), dtype=np.int64)
    with pytest.raises(PlanError, match="not a strategy"):
        sim.evaluate(ones * len(NAMES), ones, ones)


def test_a_plan_is_exact_where_its_strategies_are():
    from memopt_nb.core.plan import Decision, Plan

    for s in REGISTRY:
        extra = {"save_set": s.variants[0], "save_ops": (("aten.mm.default", 0),)} if s.variants else {}
        plan = Plan(decisions=(Decision("u", s.name, **extra),), method="one")
        assert plan.exact == s.exact
