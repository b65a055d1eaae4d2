import pytest

from memopt_nb.core.budget import format_bytes, parse_bytes, resolve_budget
from memopt_nb.core.errors import BudgetError


@pytest.mark.parametrize("text,expected", [
    ("1.5GiB", int(1.5 * 2**30)), ("800MB", 800 * 10**6), ("512MiB", 512 * 2**20), ("123", 123),
    (4096, 4096), ("2g", 2 * 2**30), (" 10 kB ", 10_000),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "1.5 GiBs", "-3MB", "", 0, -5, True, None, float("nan")])
def test_parse_bytes_rejects(bad):
    with pytest.raises(BudgetError) as err:
        parse_bytes(bad)
    assert "byte" in str(err.value)


def test_percent_budget():
    assert resolve_budget("60%", reference=1000) == 600
    with pytest.raises(BudgetError, match="percentage"):
        resolve_budget("60%")
    with pytest.raises(BudgetError):
        resolve_budget("abc%", reference=10)


def test_format_bytes():
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(10) == "10 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


@pytest.mark.parametrize("bad", ["1e999", float("inf"), "1e300TiB", 10**400, "2EiB", 2**61],
                         ids=["1e999", "inf", "1e300TiB", "10**400", "2EiB", "2**61"])
def test_overflowing_budgets_are_refused_as_budget_errors(bad):
    # before: OverflowError ("cannot convert float infinity to integer", "int too large to convert to float")
    for parse in (parse_bytes, lambda v: resolve_budget(v, reference=10**9)):
        with pytest.raises(BudgetError) as err:
            parse(bad)
        assert "512MiB" in str(err.value)  # says what would work
        assert len(str(err.value)) < 400  # a 400-digit int is not echoed whole


@pytest.mark.parametrize("fraction", [0.6, "0.6", " 0.6 ", "6e-1"])
def test_a_fraction_is_a_share_of_the_reference_never_zero_bytes(fraction):
    # before: int(0.6) == 0 bytes
    assert resolve_budget(fraction, reference=1000) == 600
    assert resolve_budget(fraction, reference=1000) == resolve_budget("60%", reference=1000)
    with pytest.raises(BudgetError) as err:  # no reference: refused with a hint, not read as bytes
        resolve_budget(fraction)
    assert "'512MiB'" in str(err.value) and "fraction" in str(err.value)


@pytest.mark.parametrize("tiny", ["0.4B", "0.0000001KiB", 0.4, "0.4"])
def test_less_than_one_byte_is_refused(tiny):
    # before: parse_bytes returned 0
    with pytest.raises(BudgetError) as err:
        parse_bytes(tiny)
    assert "byte" in str(err.value) and "512MiB" in str(err.value)


def test_a_share_that_rounds_to_zero_bytes_is_refused():
    # before: resolve_budget("60%", reference=1) == 0
    with pytest.raises(BudgetError, match="less than one byte"):
        resolve_budget("60%", reference=1)
    with pytest.raises(BudgetError, match="less than one byte"):
        resolve_budget("0.5", reference=1)
    assert resolve_budget("0.5", reference=2) == 1


@pytest.mark.parametrize("text,expected", [("11.5", 11), ("1", 1), (" 2_0 ".replace("_", ""), 20), ("100%", 1000),
                                           ("1000%", 10_000)])
def test_bytes_and_percentages_keep_their_meaning(text, expected):
    assert resolve_budget(text, reference=1000) == expected


def test_a_budget_a_uniform_plan_meets_is_accepted_without_solving_the_floor(monkeypatch):
    """At a few hundred units the floor's MILP takes tens of seconds; where recompute-all, swap-all (or another
    uniform plan of the space) already fits, the budget is feasible and the MILP is not solved. Below the floor the
    refusal is as before."""
    import importlib

    import memopt_nb as memopt
    from memopt_nb.core.space import PlanSpace
    from memopt_nb.harness.synthetic import chain_profile
    from memopt_nb.planners import milp
    from memopt_nb.sim.simulator import Simulator

    checks = importlib.import_module("memopt_nb.planners.checks")
    prof = chain_profile(12, seed=1)
    sim = Simulator(prof, "a100-40gb")
    space = PlanSpace.of(offload_state=False)
    floor = milp.solve_min_peak(sim, space)
    rc = memopt.simulate(prof, memopt.Plan.uniform(prof, "recompute"), "a100-40gb").peak_bytes
    solved = []
    monkeypatch.setattr(checks, "cached_min_peak", lambda s, sp: solved.append(1) or floor)
    assert checks.check_budget(sim, rc, space) == rc and not solved
    with pytest.raises(memopt.BudgetError):
        checks.check_budget(sim, floor - 1, space)
    assert solved
