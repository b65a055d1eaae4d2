"""benchmarks/max_batch.py --quick: one max_batch call (zoo gpt, the emulated device) makes a table row with every
column, the summary against the 1.25x goal, and the JSON rows. The numbers themselves are the benchmark's (this
machine is shared); the test checks their shape and the invariants max_batch promises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mb():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its sibling _common
    try:
        spec = importlib.util.spec_from_file_location("max_batch_under_test", ROOT / "benchmarks" / "max_batch.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.slow
def test_quick_run_prints_the_table_and_the_summary(mb, tmp_path, capsys) -> None:
    rows = mb.main(["--quick", "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    for column in ("| model", "max batch plain / baseline / memopt", "memopt ÷ baseline",
                   "best batch (samples/s): plain", "memopt ÷ plain (best samples/s)", "checked", "call s"):
        assert column in out
    assert len(rows) == 1 and "error" not in rows[0], rows
    r = rows[0]
    assert (r["model"], r["device"]) == ("gpt", "emulated")
    table_rows = [line for line in out.splitlines() if line.startswith("| gpt ")]
    assert len(table_rows) == 1 and "emulated" in table_rows[0]
    plain, base, plan = r["plain"]["batch"], r["baseline"]["batch"], r["memopt"]["batch"]
    assert plain is not None and plan is not None and plain <= plan
    assert base is None or base <= plan
    assert r["verified"]["batch"] == plan and r["verified"]["peak_bytes"] <= r["budget_bytes"]
    assert "median" in out and "goal 1.25×" in out and "seconds per max_batch call" in out
    assert json.loads((tmp_path / "rows.json").read_text())[0]["memopt"]["batch"] == plan
    # several device settings: one row per model, the settings side by side
    both = mb.model_table([r, {**r, "device": "a100-40gb", "verified": {}}])
    lines = both.splitlines()
    assert len(lines) == 3 and "emulated: best batch" in lines[0] and "a100-40gb: the same" in lines[0]
    assert lines[2].startswith("| gpt (8)") and f"{plain} / " in lines[2]


def test_unknown_device_is_refused(mb) -> None:
    with pytest.raises(SystemExit):
        mb.main(["--models", "gpt", "--devices", "tpu"])


@pytest.mark.slow
def test_profile_cost_times_both_profiles_and_says_where_the_time_goes(mb, tmp_path, capsys) -> None:
    rows = mb.main(["--profile-cost", "--quick", "--repeats", "1", "--json", str(tmp_path / "cost.json")])
    out = capsys.readouterr().out
    for column in ("| model (batch)", "fits: profile s", "does not fit: profile s", "ratio", "where the time goes",
                   "peak error"):
        assert column in out
    (r,) = rows
    assert (r["model"], r["batch"]) == ("gpt", 8) and len(r["fits"]) == len(r["does_not_fit"]) == 1
    assert r["limit_bytes"] == int(0.6 * r["peak_bytes"]) and r["ratio"] == r["does_not_fit"][0] / r["fits"][0]
    # the profile under the limit was extrapolated: the step asked for ran out of memory first, then smaller batches
    first, *probes = r["attempts"]
    assert (first["batch"], first["fitted"]) == (8, False) and [a["batch"] for a in probes if a["fitted"]] == [4, 2, 1]
    assert r["fitted_batches"] == [2, 4] and r["check_batch"] == 1
    assert abs(r["extrapolated_peak_bytes"] - r["measured_peak_bytes"]) <= 0.02 * r["measured_peak_bytes"]
    assert "profile where the step does not fit ÷ where it fits: median" in out and "goal ≤ 3×" in out
    assert json.loads((tmp_path / "cost.json").read_text())[0]["ratio"] == pytest.approx(r["ratio"])
