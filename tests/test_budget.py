import pytest

from memopt_nb.budget import format_bytes, parse_bytes, resolve_budget
from memopt_nb.errors import BudgetError


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
