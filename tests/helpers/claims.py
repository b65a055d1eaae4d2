"""The tests docs/readme_claims.md lists as checking the README's claims must run, not skip: a skipped one checks
nothing. These pytest hooks (imported by ``tests/conftest.py``) note every test and test module that skips and every
test that runs; at the end of the session, a test the claims list names that skipped and ran no case (a parametrized
one may skip a case this machine cannot run, such as an LSTM kernel its CPU lacks, while its other cases check the
claim) fails the session under CI (``CI`` set, as ``.ci/run`` does), and is listed in the summary elsewhere (a missing
Chromium or GPU skips some tests on a developer's machine).

``MEMOPT_NB_CLAIMS`` names another claims file (``tests/test_readme.py`` checks these hooks on one of its own)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

__all__ = ["claimed_tests", "skipped_claims"]

CLAIMS = Path(__file__).resolve().parents[2] / "docs" / "readme_claims.md"
#: node id (a test, or a test module skipped whole) -> why it skipped, in this session
_SKIPPED: dict[str, str] = {}
#: the tests (without parameters) of which a case ran, in this session
_RAN: set[str] = set()
_FAILED_CLAIMS: list[str] = []


def claimed_tests(text: str) -> set[str]:
    """The tests a claims file names, as ``tests/<file>.py::<name>`` (without parameters)."""
    return {f"{path}::{name}" for path, name in re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)}


def _test_of(nodeid: str) -> str:
    return re.sub(r"\[.*\]$", "", nodeid)


def skipped_claims(skipped: dict[str, str], ran: set[str], claimed: set[str]) -> list[str]:
    """``node id: reason`` of each skip that left a claimed test without a case run: the test's own skips (when none
    of its cases ran), a test module skipped whole; in order."""
    out = []
    for nodeid, why in sorted(skipped.items()):
        test = _test_of(nodeid)
        if (test in claimed and test not in ran) or (
                "::" not in nodeid and any(c.startswith(nodeid + "::") and c not in ran for c in claimed)):
            out.append(f"{nodeid}: {why}")
    return out


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def pytest_runtest_logreport(report: Any) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED[report.nodeid] = _reason(report)
    elif report.when == "call":
        _RAN.add(_test_of(report.nodeid))


def pytest_collectreport(report: Any) -> None:
    if report.skipped:
        _SKIPPED[report.nodeid] = _reason(report)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """An xdist worker's skips, modules skipped while it collected included (the controller collects nothing)."""
    _SKIPPED.update(getattr(node, "workeroutput", {}).get("memopt_nb_skipped", {}))


def _strict() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: what it saw goes to the controller, which decides
        session.config.workeroutput["memopt_nb_skipped"] = dict(_SKIPPED)  # modules skipped while collecting too
        return
    claims = Path(os.environ.get("MEMOPT_NB_CLAIMS", CLAIMS))
    if not claims.is_file():  # a copy of the tests without the docs
        return
    _FAILED_CLAIMS[:] = skipped_claims(_SKIPPED, _RAN, claimed_tests(claims.read_text(encoding="utf-8")))
    if _FAILED_CLAIMS and _strict() and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FAILED_CLAIMS:
        return
    verdict = "fails the run under CI" if _strict() else "would fail the run under CI"
    terminalreporter.section("README claims not checked", sep="=", red=True, bold=True)
    terminalreporter.line(f"a test docs/readme_claims.md names ran no case ({verdict}): its claim went unchecked")
    for line in _FAILED_CLAIMS:
        terminalreporter.line(f"  {line}")
