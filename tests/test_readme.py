"""The README's code runs as written.

Every ```python block of README.md is run, in order, in one IPython namespace (so the notebook walk-through's magics
run too), in a temporary directory. A block whose first line is ``# not run in tests: <why>`` (it needs a GPU or the
network) is skipped; any other block that raises fails the test, naming the block. docs/readme_claims.md lists each
README claim with the test or benchmark that checks it; every test and benchmark it names must exist, and must run:
under CI a named test that skips fails the run (``tests/helpers/claims.py``, checked here on a claims file of its own).
The tolerances of the peak claims (``tests/helpers/tolerances.py``) are quoted in the README as the tests use them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tolerances
from helpers.claims import claimed_tests, skipped_claims

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CLAIMS = ROOT / "docs" / "readme_claims.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
SKIP = re.compile(r"#\s*not run in tests:\s*(\S.*)")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of every ```python block, in order."""
    blocks = []
    for m in re.finditer(r"^```python[ \t]*\n(.*?)^```[ \t]*$", text, flags=re.M | re.S):
        blocks.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return blocks


def test_the_readme_is_a_short_guide():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 250


def test_skip_marks_give_a_reason():
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 8, "the README's ```python blocks were not found"
    for line, code in blocks:
        first = code.lstrip().splitlines()[0]
        if "not run in tests" in first:
            assert SKIP.fullmatch(first.strip()), f"README.md:{line}: write '# not run in tests: <why>'"


def test_every_test_and_benchmark_the_claims_list_names_exists():
    """docs/readme_claims.md (each README claim next to what checks it) names only tests defined in their files and
    benchmark scripts that exist and have a section in benchmarks/RESULTS.md."""
    text = CLAIMS.read_text(encoding="utf-8")
    tests = sorted(set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)))
    benchmarks = sorted(set(re.findall(r"\bbenchmarks/[\w/]+\.py\b", text)))
    assert len(tests) >= 30, f"only {len(tests)} tests named in {CLAIMS.name}"
    assert benchmarks, f"no benchmark named in {CLAIMS.name}"
    missing = []
    for path, name in tests:
        file = ROOT / path
        if not file.is_file():
            missing.append(f"{path} (no such file)")
        elif not re.search(rf"^\s*(?:async\s+)?def {name}\(|^\s*class {name}\b", file.read_text(encoding="utf-8"),
                           flags=re.M):
            missing.append(f"{path}::{name} (not defined there)")
    results = RESULTS.read_text(encoding="utf-8")
    for path in benchmarks:
        if not (ROOT / path).is_file():
            missing.append(f"{path} (no such file)")
        elif Path(path).name not in results:
            missing.append(f"{path} (no section in benchmarks/RESULTS.md)")
    assert not missing, f"{CLAIMS.name} names what does not exist:\n" + "\n".join(missing)


@pytest.mark.slow
def test_every_python_block_of_the_readme_runs(ipython_shell, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)  # the walk-through saves plan.json
    shell = ipython_shell
    names_before = set(shell.user_ns)
    loaded_before = "memopt_nb" in shell.extension_manager.loaded
    ran = 0
    try:
        for line, code in python_blocks(README.read_text(encoding="utf-8")):
            if SKIP.fullmatch(code.lstrip().splitlines()[0].strip()):
                continue
            result = shell.run_cell(code, store_history=False)
            if not result.success:
                error = result.error_in_exec or result.error_before_exec
                raise AssertionError(f"README.md:{line}: the block raised {error!r}:\n{code}") from error
            ran += 1
    finally:
        if not loaded_before and "memopt_nb" in shell.extension_manager.loaded:
            shell.run_line_magic("unload_ext", "memopt_nb")
        for name in set(shell.user_ns) - names_before:
            del shell.user_ns[name]
    assert ran >= 8


def test_each_tolerance_is_quoted_as_the_tests_use_it():
    """The README and the claims list say each peak tolerance in the words ``tests/helpers/tolerances.py`` gives it."""
    readme, claims = README.read_text(encoding="utf-8"), CLAIMS.read_text(encoding="utf-8")
    for name, words in tolerances.QUOTED.items():
        assert words in readme, f"README.md does not say {words!r} ({name} in tests/helpers/tolerances.py)"
        assert words in claims, f"{CLAIMS.name} does not say {words!r} ({name} in tests/helpers/tolerances.py)"


def test_a_claimed_test_that_skips_is_named_with_its_reason():
    claimed = claimed_tests("`tests/test_a.py::test_x`, `tests/test_b.py::test_y`")
    assert claimed == {"tests/test_a.py::test_x", "tests/test_b.py::test_y"}
    skipped = {"tests/test_a.py::test_x[cuda]": "no GPU", "tests/test_a.py::test_z": "other", "tests/test_b.py": "no b"}
    assert skipped_claims(skipped, set(), claimed) == ["tests/test_a.py::test_x[cuda]: no GPU", "tests/test_b.py: no b"]
    # a parametrized test whose other cases ran still checks its claim
    assert skipped_claims(skipped, {"tests/test_a.py::test_x"}, claimed) == ["tests/test_b.py: no b"]


CONFTEST = """from helpers.claims import (pytest_collectreport, pytest_runtest_logreport, pytest_sessionfinish,
                            pytest_terminal_summary, pytest_testnodedown)
"""
TESTS = """import pytest

def test_runs():
    pass

def test_skips():
    pytest.skip("nothing to check here")

@pytest.mark.parametrize("case", ["runs", "skips"])
def test_one_case_skips(case):
    if case == "skips":
        pytest.skip("not on this machine")
"""


@pytest.mark.parametrize("ci", ["true", ""])
def test_the_run_fails_under_ci_when_a_claimed_test_skips(tmp_path, ci):
    """A pytest run (the hooks ``tests/conftest.py`` installs, on a claims file naming a test that passes, one that
    skips one case of two and one that skips) exits 1 under CI, naming the skipped test and why; without CI it passes
    and says so. Without the skipped one named, it passes."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fake.py").write_text(TESTS)
    claims = tmp_path / "claims.md"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
           "MEMOPT_NB_CLAIMS": str(claims), "CI": ci}

    def run():
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                               "tests"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    claims.write_text("`tests/test_fake.py::test_runs`<br>`tests/test_fake.py::test_one_case_skips`")
    ok = run()
    assert ok.returncode == 0 and "README claims not checked" not in ok.stdout, ok.stdout + ok.stderr
    claims.write_text("`tests/test_fake.py::test_runs`<br>`tests/test_fake.py::test_skips`")
    out = run()
    assert out.returncode == (1 if ci else 0), out.stdout + out.stderr
    assert "README claims not checked" in out.stdout
    assert "tests/test_fake.py::test_skips: Skipped: nothing to check here" in out.stdout
