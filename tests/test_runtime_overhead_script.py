"""benchmarks/runtime_overhead.py's statistics: the pair order and the interval it quotes for a paired median.

The timings themselves are the benchmark's (never asserted here: the machine is shared); these tests check the
arithmetic that judges them.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ro():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling _common
    try:
        spec = importlib.util.spec_from_file_location("runtime_overhead_under_test",
                                                      ROOT / "benchmarks" / "runtime_overhead.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_pairs_alternate_their_order_so_drift_hits_both_sides(ro) -> None:
    calls: list[str] = []

    def side(name: str):
        def run() -> float:
            calls.append(name)
            return 1.0
        return run

    ta, tb = ro.interleaved(side("a"), side("b"), 4)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]  # warm-ups, then AB BA AB BA
    assert len(ta) == len(tb) == 4


def test_a_linear_drift_cancels_in_the_paired_median(ro) -> None:
    clock = [0.0]

    def side(cost: float):
        def run() -> float:
            clock[0] += 1.0
            return cost * (1.0 + 0.01 * clock[0])  # every step 1 % slower than the one before
        return run

    ta, tb = ro.interleaved(side(1.0), side(1.0), 40)
    ratios = sorted(b / a for a, b in zip(ta, tb))
    assert ro._common.median(ratios) == pytest.approx(1.0, abs=1e-3)  # A B, A B, ... would read about 1.008


def test_median_interval_is_the_order_statistics_interval(ro) -> None:
    assert ro.median_interval(list(range(1, 76))) == (29, 47)  # n = 75: k = 29 at 95 %
    lo, hi = ro.median_interval([5, 1, 4, 2, 3, 6])  # n = 6: the smallest n with a 95 % interval, min to max
    assert (lo, hi) == (1, 6)
    lo, hi = ro.median_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert lo != lo and hi != hi  # nan: five values have no 95 % interval
    assert ro.interval_text((lo, hi)) == "–" and ro.interval_text((0.99, 1.0312)) == "0.990–1.031"


def test_median_interval_covers_the_true_median_as_often_as_it_says(ro) -> None:
    rng = random.Random(0)
    for n in (25, 75):
        hits = 0
        for _ in range(1000):
            xs = [rng.lognormvariate(0.0, 0.3) for _ in range(n)]  # skewed like step times; true median 1.0
            lo, hi = ro.median_interval(xs)
            hits += lo <= 1.0 <= hi
        assert 0.93 <= hits / 1000 <= 0.99
