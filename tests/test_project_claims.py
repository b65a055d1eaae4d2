"""README claims about the package and its tools, read from the files that make them true.

- ``pip install -e .``: Python >= 3.10 and torch >= 2.5 required (pip keeps a newer torch, so your CUDA build stays);
  the ``test`` extra brings pytest, JupyterLab, transformers and accelerate.
- ``make test`` runs ``ruff check .`` and every test; ``make test-fast`` leaves out the ``slow`` marker; ``make test``
  and ``make demo`` build ``.venv`` with the CPU ``torch==2.13.0``; CI's ``.ci/run`` runs ``make test`` with Chromium.
- the search stops after 50 PPO iterations without a better plan by default; the GPU presets the README names exist;
  the demo's per-unit codes are the README's glossary.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import memopt_nb as memopt

ROOT = Path(__file__).resolve().parent.parent


def _make_target(name: str) -> str:
    text = (ROOT / "Makefile").read_text()
    m = re.search(rf"^{re.escape(name)}:(.*)\n((?:\t.*\n)+)", text, flags=re.M)
    assert m, f"no target {name} in the Makefile"
    return m.group(1) + "\n" + m.group(2)


def test_pyproject_requires_python_310_and_torch_25_and_the_test_extra():
    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is not in Python 3.10)
    assert re.search(r'^requires-python = ">=3.10"$', text, flags=re.M)
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, flags=re.M | re.S).group(1)
    assert '"torch>=2.5"' in deps
    extra = re.search(r"^test = \[(.*?)^\]", text, flags=re.M | re.S).group(1)
    for name in ("pytest", "jupyterlab", "transformers", "accelerate"):
        assert name in extra, name


def test_make_test_lints_and_runs_every_test_and_test_fast_leaves_out_slow():
    test = _make_target("test")
    assert "lint" in test.split("\n")[0] and "pytest" in test and test.rstrip().endswith(" tests")
    assert "not slow" not in test and "-k " not in test
    assert "ruff check ." in _make_target("lint")
    assert '-m "not slow"' in _make_target("test-fast")
    assert "torch==2.13.0" in (ROOT / "Makefile").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "chromium" in ci.lower()
    # both run two pytest-xdist workers by default, an idle one stealing the other's tests; JOBS=1 runs one process
    make = (ROOT / "Makefile").read_text()
    assert "JOBS ?= 2" in make and "-n $(JOBS) --dist worksteal" in make
    assert "$(XDIST)" in test and "$(XDIST)" in _make_target("test-fast")


def test_tests_that_need_every_zoo_profile_are_slow():
    """conftest marks every test using the ``zoo_profiles`` fixture slow, so make test-fast never builds it."""
    import re
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                          "not slow", "tests/test_plan.py"], cwd=ROOT, capture_output=True, text=True).stdout
    fast = {line.split("[")[0].split("::")[1] for line in out.splitlines() if "::" in line}
    using = set(re.findall(r"def (test_\w+)\([^)]*zoo_profiles", (ROOT / "tests" / "test_plan.py").read_text()))
    assert using and fast and not using & fast


def test_search_stops_after_50_iterations_without_improvement_by_default():
    import importlib

    search_mod = importlib.import_module("memopt_nb.planners.rl.search")  # the module, not the function

    assert inspect.signature(memopt.search).parameters["patience"].default == search_mod.PATIENCE == 50


def test_the_gpu_presets_the_readme_names_exist():
    names = memopt.DeviceSpec.preset_names()
    readme = (ROOT / "README.md").read_text()
    assert "a100-40gb" in names and "a100-40gb" in readme
    for gpu in ("A100", "V100", "H100", "H200", "RTX 4090"):  # "simulated GPU presets (A100, V100, H100, H200, ...)"
        key = gpu.lower().replace(" ", "")
        assert any(n.replace("-", "").startswith(key) for n in names), (gpu, names)


def test_demo_codes_are_the_glossarys():
    """K keep, R recompute, P selective, S*wd* swap, O*wd* recompute_offload with window w and distance d."""
    from memopt_nb.core.plan import Decision
    from memopt_nb.harness.demo import _short

    def code(strategy: str, w: int = 0, d: int = 0) -> str:
        extra = {"save_set": "matmuls", "save_ops": (("aten.mm", 0),)} if strategy == "selective" else {}
        return _short(Decision(unit="u", strategy=strategy, offload_window=w, prefetch_distance=d, **extra))

    assert [code("keep"), code("recompute"), code("selective")] == ["K", "R", "P"]
    assert code("swap", 1, 2) == "S12" and code("recompute_offload", 0, 3) == "O03"
