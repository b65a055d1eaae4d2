"""Every tutorial (and benchmark notebook, once there are any) executes headless with nbclient at a small search budget.

The search budget comes from ``MEMOPT_NB_TIMESTEPS`` (default here: 2000 PPO timesteps; set it to run the notebooks
longer). Each run must raise no error, print finite results in its ``summary`` cell and, where it shows the dashboard,
save the widget state — Image included — in the notebook.
"""

import base64
import json
import math
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "tutorials").glob("*.ipynb")) + sorted((ROOT / "notebooks").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
CI_TIMESTEPS = "2000"


@pytest.fixture
def notebook_env(monkeypatch):
    monkeypatch.setenv("MEMOPT_NB_TIMESTEPS", os.environ.get("MEMOPT_NB_TIMESTEPS", CI_TIMESTEPS))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def execute(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def summary_of(nb) -> dict | None:
    for cell in nb.cells:
        if "summary" in cell.get("metadata", {}).get("tags", []):
            text = "".join(o["text"] for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")
            return json.loads(text)
    return None


def numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from numbers(v)


def test_there_are_tutorials():
    names = [p.name for p in NOTEBOOKS]
    assert {"01_quickstart.ipynb", "02_strategy_and_timing.ipynb", "03_evaluate.ipynb",
            "04_more_than_one_device.ipynb"} <= set(names)
    assert "benchmarks.ipynb" in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, notebook_env):
    nb = execute(path)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and "Traceback" in o.text]

    summary = summary_of(nb)
    if path.parent.name == "tutorials":
        assert summary is not None, "tutorials end with a cell tagged 'summary' that prints JSON"
    if summary is not None:
        vals = [v for x in summary.values() for v in numbers(x)]
        assert vals and all(math.isfinite(v) for v in vals), summary

    views = [o["data"][WIDGET_VIEW]["model_id"] for o in outputs if WIDGET_VIEW in o.get("data", {})]
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    assert all(mid in state for mid in views), "every displayed widget has its state saved in the notebook"
    if path.name in ("01_quickstart.ipynb", "02_strategy_and_timing.ipynb"):
        assert views, "the tutorial shows the live dashboard"
    images = [m for m in state.values() if m["model_name"] == "ImageModel"]
    assert len(images) >= len(views)
    for m in images:
        (buf,) = [b for b in m.get("buffers", []) if b["path"] == ["value"]]
        assert base64.b64decode(buf["data"])[:8] == b"\x89PNG\r\n\x1a\n"
    bars = [m["state"] for m in state.values() if m["model_name"] == "FloatProgressModel"]
    assert all(b["value"] == 1.0 and b["bar_style"] == "success" for b in bars), bars

    if path.name == "01_quickstart.ipynb":
        assert summary["loss_matched"] is True
        assert summary["within_budget"] is True and summary["measured_peak"] <= summary["budget"]
        assert abs(summary["budget"] - 0.6 * summary["profiled_peak"]) <= 1
        assert summary["predicted_peak"] <= summary["budget"] and summary["iterations"] >= 1
    if path.name == "02_strategy_and_timing.ipynb":
        assert summary["gpu_plan_feasible"] and summary["here_plan_feasible"]
        assert summary["gpu_plan_peak"] <= summary["budget"]
        # nothing beats the exact optimum for the same device and budget
        assert summary["gpu_plan_step_time"] >= summary["optimum_step_time"] * (1 - 1e-9)
        assert summary["here_plan_step_time_on_gpu"] >= summary["optimum_step_time"] * (1 - 1e-9)
        assert len(summary["swap_all_stalls_ms"]) == 12
    if path.name == "03_evaluate.ipynb":
        assert summary["flat_worth_it"] is False
        assert summary["gpu_source"] == "simulated"
        assert summary["best_plan_max_batch"] >= summary["plain_max_batch"]
        assert ("worth it" in summary["cpu_verdict"]) and 0.0 <= summary["r2_memory_plain"] <= 1.0
    if path.name == "benchmarks.ipynb":
        assert summary["cases"] >= 2 and summary["seconds"] > 0
