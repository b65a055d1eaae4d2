"""benchmarks/cuda_check.py, the one script to run where there is a GPU: its logic tested on the CPU with ``--dry-run``.

The dry run builds every plan of the script and runs every check on the CPU at tiny sizes; bit equality must hold
there too. What only a GPU shows (side streams in a profiler trace, the CUDA tests) is skipped or counted as skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("cuda_check", ROOT / "benchmarks" / "cuda_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["cuda_check"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def cc():
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield _script()
    torch.use_deterministic_algorithms(deterministic)  # main() turns them on for the whole process


@pytest.mark.slow
def test_dry_run_checks_every_whole_step_plan_and_passes(cc, tmp_path: Path) -> None:
    rc = cc.main(["--dry-run", "--models", "mlp", "--whole-models", "mlp", "--optimizers", "adam", "sgd",
                  "--quick", "--search-timesteps", "200", "--no-fit-check", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cuda_check.json").read_text())
    assert result["failures"] == [] and rc == 0
    assert result["dry_run"] and "cpu" in result["device"]
    # every whole-step variant with Adam, the quick subset with SGD, each bit-equal with its bytes really moved
    eq = {(r["optimizer"], r["plan"]): r for r in result["whole_equal"]}
    assert {p for o, p in eq if o == "adam"} >= set(cc.VARIANTS)
    assert {p for o, p in eq if o == "sgd"} == set(cc.QUICK_VARIANTS)
    assert all(r["equal"] and r["moved_ok"] for r in eq.values())
    sib = eq[("adam", "all_step")]
    assert sib["state_counts"]["step"] > 0 and sib["stats"]["steps_in_backward"] == 3 * sib["state_counts"]["step"]
    assert eq[("adam", "all_offload")]["stats"]["state_d2h_bytes"] > 0
    assert eq[("adam", "all_offload")]["stats"]["param_h2d_bytes"] > 0
    assert eq[("adam", "mixed")]["stats"]["offloaded_bytes"] > 0
    # measured vs simulated for keep, each variant and the searched plan; the search's budget is below the
    # activation-only floor and the measured peak within it (the CPU meter is exact)
    mem = {r["plan"]: r for r in result["whole_memory"]}
    assert set(mem) == {"keep", *cc.VARIANTS, "search"}
    assert mem["all_offload"]["meas_peak_MiB"] < mem["keep"]["meas_peak_MiB"]
    (s,) = result["search"]
    assert s["budget_MiB"] < s["floor_activation_only_MiB"] and mem["search"]["within_budget"]
    assert result["streams"] == [{"skipped": "needs CUDA (a profiler trace of the side streams)"}]
    assert {r["plan"] for r in result["activation"]} == {"keep", "recompute", "swap", "mixed", "recompute_offload",
                                                         "mixed_ro", "selective", "mixed_sel", "fine_mixed", "search"}
    sel = {r["plan"]: r for r in result["activation"] if r["plan"] in ("selective", "mixed_sel")}
    assert all(abs(r["peak_err_pct"]) < 1e-9 for r in sel.values())  # the emulated device: exactly as predicted
    assert all(r["grads_equal"] for r in result["activation"] if r["plan"] != "search")
    ro = {r["plan"]: r for r in result["activation"] if r["plan"] in ("recompute_offload", "mixed_ro")}
    assert all(r["swap_stats"]["offloaded_bytes"] > 0 for r in ro.values())  # the inputs did leave
    (ov,) = result["overhead"]  # the runtime overheads, reported with their figures
    assert ov["model"] == "mlp" and all(r > 0 for k, r in ov.items() if k.startswith("ratio_"))
    text = (tmp_path / "cuda_check.md").read_text()
    assert "| mlp | adam (single) |" in text and "all checks passed" in text
    # the dry run's 5 pairs give no 95 % interval for the paired median, so none is printed
    assert "### Runtime overhead" in text and f"| {ov['ratio_d']:.3f} ({ov['paired_d']:.3f}) |" in text


def test_the_overhead_table_shows_the_paired_median_and_its_interval(cc) -> None:
    row = {"ratio_c": 1.0123, "paired_c": 1.0101, "ci_c": [0.995, 1.031]}
    assert cc._paired(row, "c") == "1.012 (1.010, 0.995–1.031)"
    assert cc._paired({**row, "ci_c": [float("nan")] * 2}, "c") == "1.012 (1.010)"
    assert cc._paired({"ratio_c": 1.0}, "c") == "1.000"  # a result file from before the paired columns


@pytest.mark.slow
def test_a_difference_is_reported_as_a_failure(cc) -> None:
    """The comparison is not vacuous: a run whose one parameter changed is reported, and so is a plan whose stats
    show nothing moved."""
    build = cc.builder("mlp", cc.Config(device=torch.device("cpu"), dry_run=True, quick=True, models=[],
                                        whole_models=["mlp"], batch=None, optimizers=["adam"]), whole=True)
    ref = cc.train(build, "adam", None, 2)
    got = cc.train(build, "adam", None, 2)
    assert cc.differences(ref, got) == []
    with torch.no_grad():
        next(got[0].parameters()).view(-1)[0] += 1e-6
    assert any(d.startswith("param ") for d in cc.differences(ref, got))
    import memopt_nb as memopt
    from memopt_nb.core.plan import Plan

    zm = build()
    prof = memopt.profile(zm.model, *zm.inputs, loss_fn=zm.loss_fn, repeats=1)
    plan = cc.whole_plan(Plan.uniform(prof, "keep"), cc.VARIANTS["all_step"])
    problems = cc.moved_problems({}, plan, 3)
    assert len(problems) == 3  # optimizer state, steps in backward, parameters (grads 'step' are not offloaded)
    assert cc.moved_problems({"state_d2h_bytes": 1, "state_h2d_bytes": 1, "param_h2d_bytes": 1,
                              "steps_in_backward": 3 * len(plan.units)}, plan, 3) == []


def test_trace_summary_and_junit_counts(cc, tmp_path: Path) -> None:
    """The two parsers of GPU-only output, on hand-made inputs shaped like torch.profiler's and pytest's."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 200, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 50, "dur": 100,
         "args": {"stream": 13}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 400, "dur": 10,
         "args": {"stream": 7}},
    ]}
    s = cc.trace_summary(trace)
    assert s["compute_stream"] == 7 and s["copies_total"] == 2 and s["copies_on_side_streams"] == 1
    assert s["copies_pinned"] == 1 and s["copy_us"] == 110 and s["copy_us_overlapping_kernels"] == 50
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite name="pytest">'
                   '<testcase classname="a" name="t1"/>'
                   '<testcase classname="a" name="t2"><failure message="x"/></testcase>'
                   '<testcase classname="a" name="t3"><skipped message="needs a CUDA device"/></testcase>'
                   '<testcase classname="a" name="t4"><error message="y"/></testcase>'
                   '</testsuite></testsuites>')
    assert cc.junit_counts(xml) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                                    "failed_ids": ["a::t2", "a::t4"]}


def test_a_check_that_raises_is_a_failure_and_the_run_goes_on(cc, tmp_path: Path, monkeypatch) -> None:
    """One broken check (as a CUDA-only error would be) is recorded, the other sections still run, exit status 1."""
    def broken(name, cfg, failures):
        raise RuntimeError("deterministic algorithm missing (simulated)")

    monkeypatch.setattr(cc, "whole_model", broken)
    rc = cc.main(["--dry-run", "--models", "--whole-models", "mlp", "--no-fit-check", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "cuda_check.json").read_text())
    assert rc == 1 and result["whole_equal"] == [] and result["activation"] == []
    assert result["failures"] == ["whole-step mlp: RuntimeError: deterministic algorithm missing (simulated)"]
    assert "1 check(s) failed" in (tmp_path / "cuda_check.md").read_text()


@pytest.mark.slow
def test_the_activation_section_checks_a_plan_on_finer_units(cc) -> None:
    """Finer units (``units="fine"``) on a model whose blocks split (the zoo GPT: 6 blocks, 24 fine units): the plan
    mixing every strategy on them is bit-identical to plain training, as predicted to the byte, and really offloads."""
    cfg = cc.Config(device=torch.device("cpu"), dry_run=True, quick=True, models=["gpt"], whole_models=[], batch=None,
                    optimizers=["adam"], measure_steps=2, search_timesteps=200)
    failures: list[str] = []
    rows = {r["plan"]: r for r in cc.activation_model("gpt", cfg, failures)}
    assert failures == []
    fine, keep = rows["fine_mixed"], rows["keep"]
    assert fine["units"] > keep["units"]
    assert fine["grads_equal"] and abs(fine["peak_err_pct"]) < 1e-9
    assert fine["swap_stats"]["offloaded_bytes"] > 0


def test_pytest_runs_every_test_that_needs_cuda(cc) -> None:
    """``--pytest`` runs ``-k cuda`` over :data:`PYTEST_FILES`: every test skipped without a CUDA device (the habits
    between steps and mixed precision included) must sit in one of those files and have "cuda" in its name, or no GPU
    run ever covers it. Read from the test files' source, without collecting them."""
    import ast
    import inspect

    assert inspect.signature(cc.pytest_section).parameters["select"].default == "cuda"
    needs_cuda = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                    "skipif" in ast.unparse(d) and "cuda.is_available" in ast.unparse(d) for d in node.decorator_list):
                needs_cuda[node.name] = f"tests/{path.name}"
    assert any(n.startswith("test_cuda_habit_") for n in needs_cuda)
    assert any(n.startswith("test_cuda_autocast_") for n in needs_cuda)
    missed = {n: f for n, f in needs_cuda.items() if f not in cc.PYTEST_FILES or "cuda" not in n}
    assert missed == {}


def test_the_cuda_tests_compare_bit_for_bit_with_deterministic_algorithms(cc, monkeypatch, tmp_path) -> None:
    """``--pytest`` starts its pytest with ``MEMOPT_NB_DETERMINISTIC=1`` and cuBLAS's fixed workspace, and the suite's
    conftest turns deterministic algorithms on when it sees it (checked here in this process, then put back)."""
    import subprocess

    from helpers.determinism import ENV, deterministic_from_env

    seen = {}

    def run(cmd, **kw):
        seen.update(kw["env"])
        return subprocess.CompletedProcess(cmd, 0, "1 passed", "")

    monkeypatch.setattr(cc.subprocess, "run", run)
    cc.pytest_section(cc.config_from_args(cc.parse_args(["--dry-run"])), [], tmp_path)
    assert seen[ENV] == "1" and seen["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"

    before = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv(ENV, "1")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        assert deterministic_from_env() and torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before)
    monkeypatch.setenv(ENV, "0")
    assert not deterministic_from_env()


@pytest.mark.slow  # profiles past a limit and answers max_batch: a minute or two on 2 cores
def test_the_does_not_fit_check_passes_on_the_emulated_device(cc) -> None:
    """Check 11 on the CPU: the unplanned step runs out of memory inside the limit, the profile is extrapolated to
    the unplanned peak, the plan trains bit-equal inside the limit and max_batch answers a bigger batch."""
    cfg = cc.config_from_args(cc.parse_args(["--dry-run"]))
    failures: list[str] = []
    got = cc.does_not_fit_section(cfg, failures)
    assert failures == []
    assert got["unplanned_oom"] and got["method"] == "extrapolated" and got["bit_equal"]
    assert got["limited_peak"] <= got["limit"] < got["unplanned_peak"]
    assert got["max_batch"] >= got["batch"] > got["plain_max_batch"]
