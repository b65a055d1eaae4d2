"""Every tutorial (and benchmark notebook) executes headless with nbclient at a small search budget.

The search budget comes from ``MEMOPT_NB_TIMESTEPS`` (default here: 2000 PPO timesteps; set it to run the notebooks
longer). Each run must raise no error and, where it shows the dashboard, save the widget state — Image included — and
leave the final picture and summary as ordinary outputs. The figures the tests check come from a summary cell the test
appends: its code is in the notebook's metadata (``metadata.memopt_nb.test_summary``), so the tutorials end with next
steps for a reader, not with the test suite's JSON.

The tutorials are stored executed (``tools/store_tutorials.py`` runs them as these tests do and keeps that summary in
``metadata.memopt_nb.stored_summary``): a fast test checks that they are, and the slow one fails when a fresh run's key
figures drift from the stored ones.
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
TUTORIALS = sorted((ROOT / "tutorials").glob("*.ipynb"))
NOTEBOOKS = TUTORIALS + sorted((ROOT / "notebooks").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
CI_TIMESTEPS = "2000"
#: README: the example's per-rank peak is "predicted by per_rank + simulate within 0.01% on every rank"
#: (tests/test_distributed.py asserts that). Tutorial 04's searched FSDP2 plan measured 0.043% over its prediction (both
#: ranks alike): the tutorial is held to 0.1% and the gap is an open question (README).
PER_RANK_BOUND = 1e-3

EXACT, REL = 0.0, 0.01
#: The stored summary's figures (``metadata.memopt_nb.stored_summary``) a fresh run must reproduce, each with its
#: relative tolerance (0: exactly). Only figures that do not depend on this machine's clock: byte counts of a profile
#: and the budgets and floors derived from them, which batch sizes fit, and flags saying a plan kept training exact or
#: within its budget. Left out are times, speeds, throughputs, verdicts and reward values, and everything about a plan
#: that a search or solver chose by step time (its peaks, its unit counts, the search's iterations, the error of its
#: prediction): step times are measured, so on a busier or another machine the same search may pick another plan.
#: Two runs on one loaded 2-core machine agreed exactly on every figure here, while tutorial 02's searched
#: plan peak moved 14% (22.8 -> 25.9 MB): the 1% on bytes is room for another host's torch, not noise observed.
STORED_KEYS = {
    "01_quickstart.ipynb": {"budget": REL, "profiled_peak": REL, "within_budget": EXACT, "loss_matched": EXACT,
                            "oom": EXACT, "plain_max_batch": EXACT, "max_batch": EXACT},
    "02_strategy_and_timing.ipynb": {"budget": REL, "gpu_plan_feasible": EXACT, "here_plan_feasible": EXACT},
    "03_evaluate.ipynb": {"plain_max_batch": EXACT, "best_plan_max_batch": EXACT, "r2_memory_plain": REL,
                          "gpu_source": EXACT},
    "04_more_than_one_device.ipynb": {"per_rank_peak_no_plan_fsdp": REL, "params_equal": EXACT},
    "05_when_the_optimizer_state_is_the_problem.ipynb": {
        "state_bytes": REL, "budget": REL, "profiled_peak": REL, "activations_only_floor": REL,
        "whole_step_floor": REL, "params_equal": EXACT, "losses_equal": EXACT, "moves_state": EXACT,
        "clip_refused": EXACT, "sib_floor": REL, "sib_budget": REL, "sib_feasible": EXACT},
    "06_when_activations_are_the_problem.ipynb": {"old_floor": REL, "new_floor": REL, "budget": REL, "equal": EXACT,
                                                   "sel_equal": EXACT, "ck_fine_floor": REL, "ck_blocks_floor": REL,
                                                   "ck_budget": REL, "mixed_feasible": EXACT, "mixed_equal": EXACT},
    "07_when_the_head_is_the_problem.ipynb": {"peak": REL, "kept_peak": REL, "floor_as_written": REL,
                                              "floor_kept_as_written": REL, "floor_chunked": REL, "budget": REL,
                                              "chunked": EXACT, "exact": EXACT, "within_budget": EXACT,
                                              "first_loss_equal": EXACT},
    "08_when_the_model_is_bigger_than_the_device.ipynb": {
        "param_bytes": REL, "state_bytes": REL, "limit": REL, "profiled_peak": REL, "plain_fits": EXACT,
        "state_streamed": EXACT, "peak_within_limit": EXACT, "losses_equal": EXACT, "params_equal": EXACT,
        "largest_memopt": EXACT, "largest_plain": EXACT, "largest_offload_everything": EXACT},
}


def drifted(stored: dict, fresh: dict, keys: dict[str, float]) -> list[tuple[str, object, object]]:
    """The keys whose fresh value is not the stored one, as ``(key, stored, fresh)``: numbers (not booleans) may differ
    by their key's relative tolerance, anything else (flags, words, a key missing on one side) must be equal."""
    out = []
    for key, rel in keys.items():
        a, b = stored.get(key, "<missing>"), fresh.get(key, "<missing>")
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b))
        same = (abs(a - b) <= rel * max(abs(a), abs(b))) if numeric else (type(a) is type(b) and a == b)
        if not same:
            out.append((key, a, b))
    return out


@pytest.fixture
def notebook_env(monkeypatch):
    monkeypatch.setenv("MEMOPT_NB_TIMESTEPS", os.environ.get("MEMOPT_NB_TIMESTEPS", CI_TIMESTEPS))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def with_summary_cell(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Append the test hook kept in the notebook's metadata as a cell tagged ``summary``."""
    source = nb.metadata.get("memopt_nb", {}).get("test_summary")
    if source:
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["tags"] = ["summary"]
        nb.cells.append(cell)
    return nb


def execute(path: Path, nb: nbformat.NotebookNode | None = None) -> nbformat.NotebookNode:
    nb = with_summary_cell(nb if nb is not None else nbformat.read(path, as_version=4))
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


def outputs_of(cell):
    return [o for o in cell.get("outputs", [])]


def text_of(cell) -> str:
    parts = []
    for o in outputs_of(cell):
        if o.output_type == "stream":
            parts.append(o.text)
        elif "data" in o:
            parts.append(o["data"].get("text/plain", ""))
    return "\n".join(parts)


def test_there_are_tutorials():
    names = [p.name for p in NOTEBOOKS]
    assert {"01_quickstart.ipynb", "02_strategy_and_timing.ipynb", "03_evaluate.ipynb",
            "04_more_than_one_device.ipynb", "05_when_the_optimizer_state_is_the_problem.ipynb",
            "06_when_activations_are_the_problem.ipynb"} <= set(names)
    assert "benchmarks.ipynb" in names


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorials_end_with_next_steps_and_keep_test_hooks_out_of_sight(path):
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[-1].cell_type == "markdown" and nb.cells[-1].source.startswith("## Next steps")
    visible = "\n".join(c.source for c in nb.cells)
    assert "test suite reads" not in visible and "json.dumps(summary" not in visible
    assert not [c for c in nb.cells if "summary" in c.get("metadata", {}).get("tags", [])]
    assert "summary" in nb.metadata["memopt_nb"]["test_summary"]


@pytest.mark.parametrize("path", TUTORIALS, ids=[p.name for p in TUTORIALS])
def test_tutorials_are_stored_with_outputs(path):
    """Stored executed (tools/store_tutorials.py), in one clean run: every code cell ran, in order, most show
    something, none raised, the dashboard's widgets have their state, and the run's summary is kept."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"not one run from the top: {counts} (tools/store_tutorials.py)"
    assert sum(bool(c.outputs) for c in code) >= len(code) / 2, "most code cells show their outputs"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and "Traceback" in o.text]
    views = [o["data"][WIDGET_VIEW]["model_id"] for o in outputs if WIDGET_VIEW in o.get("data", {})]
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    assert all(mid in state for mid in views), "every displayed widget has its state saved in the notebook"
    assert not [c for c in nb.cells if "execution" in c.metadata], "no run's timestamps (they change every run)"
    stored = nb.metadata["memopt_nb"].get("stored_summary")
    assert isinstance(stored, dict) and stored, "the run's summary is kept in metadata.memopt_nb.stored_summary"
    assert set(STORED_KEYS[path.name]) <= set(stored), "the figures the slow test compares are stored"


def test_drifted_names_what_moved_and_keeps_noise():
    stored = {"budget": 1000, "floor": 500, "fits": True, "source": "simulated", "batch": 512, "time": 1.0}
    assert drifted(stored, dict(stored, time=9.0), {"budget": REL, "fits": EXACT, "batch": EXACT}) == []
    assert drifted(stored, dict(stored, budget=1009), {"budget": REL}) == []  # under 1%: noise
    assert drifted(stored, dict(stored, budget=1011), {"budget": REL}) == [("budget", 1000, 1011)]
    assert drifted(stored, dict(stored, batch=1024), {"batch": EXACT}) == [("batch", 512, 1024)]
    assert drifted(stored, dict(stored, fits=False), {"fits": EXACT}) == [("fits", True, False)]
    assert drifted(stored, dict(stored, fits=1), {"fits": EXACT}) == [("fits", True, 1)]  # a flag stays a flag
    assert drifted(stored, dict(stored, source="measured"), {"source": EXACT}) == [("source", "simulated", "measured")]
    fresh = dict(stored)
    del fresh["floor"]
    assert drifted(stored, fresh, {"floor": REL, "budget": REL}) == [("floor", 500, "<missing>")]


def verdict_says(verdict: str, worth_it: bool) -> None:
    """The verdict's conclusion, read exactly: it ends with "— worth it" or "— not worth it" (or, where plain training
    does not fit at all, says a plan is the only way to train), and agrees with the flag."""
    if worth_it:
        assert verdict.endswith("— worth it") or verdict.endswith("the only way to train here"), verdict
        assert "not worth it" not in verdict, verdict
    else:
        assert verdict.endswith("— not worth it") or verdict.startswith("nothing fits"), verdict


@pytest.mark.slow  # every notebook end to end in a kernel: minutes
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, notebook_env):
    nb = execute(path)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and "Traceback" in o.text]

    summary = summary_of(nb)
    if path.parent.name == "tutorials":
        assert summary is not None, "tutorials keep a summary for the tests in metadata.memopt_nb.test_summary"
    if summary is not None:
        vals = [v for x in summary.values() for v in numbers(x)]
        assert vals and all(math.isfinite(v) for v in vals), summary

    views = [o["data"][WIDGET_VIEW]["model_id"] for o in outputs if WIDGET_VIEW in o.get("data", {})]
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    assert all(mid in state for mid in views), "every displayed widget has its state saved in the notebook"
    images = [m for m in state.values() if m["model_name"] == "ImageModel"]
    for m in images:
        (buf,) = [b for b in m.get("buffers", []) if b["path"] == ["value"]]
        assert base64.b64decode(buf["data"])[:8] == b"\x89PNG\r\n\x1a\n"
    bars = [m["state"] for m in state.values() if m["model_name"] == "FloatProgressModel"]
    assert all(b["value"] == 1.0 and b["bar_style"] == "success" for b in bars), bars

    plan_cells = [c for c in nb.cells if c.cell_type == "code" and c.source.lstrip().startswith("%memopt_plan")
                  and "--no-widget" not in c.source]
    if path.name in ("01_quickstart.ipynb", "02_strategy_and_timing.ipynb"):
        assert plan_cells and images, "the tutorial shows the live dashboard"
    for cell in plan_cells:
        # the search's end left the dashboard's final picture and its summary as one ordinary output, and the cell's
        # result is the plan, shown once
        pngs = [o for o in outputs_of(cell) if "image/png" in o.get("data", {})]
        assert len(pngs) == 1 and base64.b64decode(pngs[0]["data"]["image/png"])[:4] == b"\x89PNG"
        assert pngs[0]["data"]["image/png"] in [m["buffers"][0]["data"] for m in images]  # the widget's last frame
        text = text_of(cell)
        assert "done: predicted peak " in text and text.count("Plan[memopt-ppo] for ") == 1
        assert not [o for o in outputs_of(cell) if WIDGET_VIEW in o.get("data", {})]

    if path.name == "01_quickstart.ipynb":
        # the step at the batch wanted runs out of memory on a device of 60 % of its peak and changes nothing; the
        # profile, extrapolated, predicts that peak; the plan trains inside the device as without a limit; max_batch
        # answers a batch above the one wanted, and a step there under its plan runs inside the device
        assert summary["oom"] is True and summary["unchanged"] is True and summary["extrapolated"] is True
        assert summary["budget"] == summary["limit"] and abs(summary["limit"] - 0.6 * summary["unlimited_peak"]) <= 1
        assert abs(summary["profiled_peak"] - summary["unlimited_peak"]) <= 0.02 * summary["unlimited_peak"]
        assert summary["loss_matched"] is True
        assert summary["within_budget"] is True and summary["measured_peak"] <= summary["budget"]
        assert summary["predicted_peak"] <= summary["budget"] and summary["iterations"] >= 1
        assert summary["plain_max_batch"] < summary["want"] <= summary["max_batch"]
        assert summary["max_batch_within_limit"] is True and summary["max_batch_peak"] <= summary["limit"]
    if path.name == "02_strategy_and_timing.ipynb":
        assert summary["gpu_plan_feasible"] and summary["here_plan_feasible"]
        assert summary["gpu_plan_peak"] <= summary["budget"]
        # nothing beats the exact optimum for the same device and budget
        assert summary["gpu_plan_step_time"] >= summary["optimum_step_time"] * (1 - 1e-9)
        assert summary["here_plan_step_time_on_gpu"] >= summary["optimum_step_time"] * (1 - 1e-9)
        assert len(summary["swap_all_stalls_ms"]) == 12
    if path.name == "03_evaluate.ipynb":
        # Only what does not depend on this machine's wall clock is decided here: which batches fit (memory) and
        # that each verdict's words agree with its flag. Whether a plan pays off on this CPU is measured, and shown
        # to the reader, not asserted.
        assert summary["gpu_source"] == "simulated"
        assert summary["best_plan_max_batch"] >= summary["plain_max_batch"]
        assert 0.0 <= summary["r2_memory_plain"] <= 1.0
        verdict_says(summary["cpu_verdict"], summary["cpu_worth_it"])
        verdict_says(summary["gpu_verdict"], summary["gpu_worth_it"])
        verdict_says(summary["flat_verdict"], summary["flat_worth_it"])
    if path.name == "04_more_than_one_device.ipynb":
        assert summary["params_equal"] is True  # every rank of both shardings, compared with torch.equal
        errors = [e for per_sharding in summary["prediction_error"] for e in per_sharding]
        assert len(errors) == 4 and all(abs(e) <= PER_RANK_BOUND for e in errors), errors
    if path.name == "06_when_activations_are_the_problem.ipynb":
        assert summary["new_floor"] < summary["budget"] < summary["old_floor"]  # below what the old space reaches
        assert summary["equal"] is True and summary["sel_equal"] is True
        assert summary["measured_peak"] == summary["predicted_peak"] <= summary["budget"]
        # a wider space is never slower (the MILP is exact here); whether selective pays is measured, so not asserted
        assert summary["sel_time"] <= summary["old_time"] * (1 + 1e-9)
        # mixed depths: checkpointing only, a whole block reaches lower than its units one by one; the plan chosen is
        # a mixed one (some blocks whole, not all), faster than the fine units' and the whole blocks' plans, as the
        # tutorial says; it trains exactly and peaks where predicted
        assert summary["ck_blocks_floor"] < summary["ck_fine_floor"] < summary["ck_budget"]
        assert summary["mixed_feasible"] is True and summary["mixed_equal"] is True
        depths = summary["mixed_depths"]
        assert depths["chosen"] == "mixed" and 0 < depths["merged_blocks"] < 4, depths
        assert summary["mixed_time"] == depths["mixed_step_time"]
        assert summary["mixed_time"] < min(depths["fine_step_time"], depths["blocks_step_time"]), depths
        assert summary["mixed_measured_peak"] == summary["mixed_predicted_peak"] <= summary["ck_budget"]
    if path.name == "07_when_the_head_is_the_problem.ipynb":
        # the head bounds the blocks' floor; chunked, the floor is below half the peak of the loop that keeps its
        # outputs; the plan at 50 % chunks the head, says it is not exact, trains that loop inside its budget with
        # the first loss bit-identical and the parameters within the README's tolerance
        assert summary["floor_as_written"] > 0.8 * summary["peak"]
        assert summary["floor_chunked"] < summary["budget"] < summary["floor_kept_as_written"]
        assert summary["chunked"] is True and summary["exact"] is False
        assert summary["within_budget"] is True and summary["measured_peak"] <= summary["budget"]
        assert summary["first_loss_equal"] is True and summary["drift"] < 1e-5 and summary["curve_worst"] < 1e-3
    if path.name == "08_when_the_model_is_bigger_than_the_device.ipynb":
        # the training state is twice the device: plain training does not fit, the profile is state-streamed and
        # its peak (the plain step's) above the limit; the plan is for the limit's free memory; profiling, training,
        # saving, leaving the block and resuming stay inside it, bit-identical to plain training outside it
        assert summary["state_bytes"] >= 2 * summary["limit"] and summary["plain_fits"] is False
        assert summary["state_streamed"] is True and summary["profiled_peak"] > summary["limit"]
        assert summary["budget"] <= summary["free_bytes"] <= summary["limit"]
        assert summary["peak_within_limit"] is True
        assert max(summary["profile_peak"], summary["first_peak"], summary["resumed_peak"]) <= summary["limit"]
        assert summary["losses_equal"] is True and summary["params_equal"] is True
        # max_model: memopt trains a deeper model than plain training, and its answer ran inside the budget
        assert summary["largest_plain"] is not None and summary["largest_memopt"] > summary["largest_plain"], summary
        assert summary["memopt_verified"] is True
    if path.name == "05_when_the_optimizer_state_is_the_problem.ipynb":
        assert summary["state_bytes"] >= 2 * summary["budget"]  # the model's state is over twice the budget
        assert summary["activations_only_floor"] > summary["budget"] >= summary["whole_step_floor"]
        assert summary["params_equal"] is True and summary["losses_equal"] is True and summary["moves_state"]
        assert summary["measured_peak"] <= summary["budget"] and summary["predicted_peak"] <= summary["budget"]
        assert summary["clip_refused"] is True and summary["sib_steps"] >= 1 and summary["sib_feasible"] is True
        # streaming brings the whole-step floor down to (or near) step in backward's; the budget is just above it
        assert summary["sib_floor"] <= summary["whole_step_floor"] < summary["sib_budget"] < summary["budget"]
    if path.name == "benchmarks.ipynb":
        assert summary["cases"] >= 2 and summary["seconds"] > 0

    if path.parent.name == "tutorials":
        # the stored outputs still show what a run shows (tools/store_tutorials.py stores them again)
        stored = nbformat.read(path, as_version=4).metadata["memopt_nb"]["stored_summary"]
        moved = drifted(stored, summary, STORED_KEYS[path.name])
        assert not moved, f"(key, stored, fresh) drifted; python tools/store_tutorials.py {path.stem}: {moved}"


def test_verdict_check_reads_the_conclusion_not_a_substring():
    verdict_says("recompute_all raises the max batch from 256 to 1024 ... — worth it", True)
    with pytest.raises(AssertionError):
        verdict_says("no plan beats plain training ... — not worth it", True)  # "worth it" is in it, too
    with pytest.raises(AssertionError):
        verdict_says("recompute_all raises the max batch ... — worth it", False)


@pytest.mark.slow  # a kernel, a profile and a search
def test_a_plan_for_a_preset_device_saved_and_read_back(tmp_path, notebook_env):
    """A notebook planning with ``--device a100-40gb``: saved and read back, the plan cell holds a PNG and names the
    device, and the profile's output states its floor as memopt formats it."""
    import memopt_nb as memopt

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("%load_ext memopt_nb\nimport torch\nimport memopt_nb as memopt"),
        nbformat.v4.new_code_cell(
            "%%memopt_profile --model model --inputs idx --loss loss_fn --optimizer opt --repeats 1 -o prof\n"
            "model, (idx,), loss_fn, _ = memopt.zoo.gpt(batch_size=2, seq_len=32, d_model=32, n_layers=2, n_heads=2)\n"
            "opt = torch.optim.Adam(model.parameters())"),
        nbformat.v4.new_code_cell("%memopt_plan prof --budget 80% --device a100-40gb --timesteps 96 -o p"),
        nbformat.v4.new_code_cell("prof.save('prof.json')\nprint(memopt.solvers.min_peak(prof))"),
    ]
    path = tmp_path / "device.ipynb"
    nbformat.write(nb, path)
    ran = execute(path, nbformat.read(path, as_version=4))
    nbformat.write(ran, path)
    back = nbformat.read(path, as_version=4)
    profile_cell, plan_cell, floor_cell = back.cells[1], back.cells[2], back.cells[3]
    assert not [o for c in back.cells for o in outputs_of(c) if o.output_type == "error"]

    pngs = [o for o in outputs_of(plan_cell) if "image/png" in o.get("data", {})]
    assert len(pngs) == 1 and base64.b64decode(pngs[0]["data"]["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"
    text = text_of(plan_cell)
    assert "done: predicted peak " in text and text.count("Plan[memopt-ppo] for a100-40gb") == 1  # the plan, once
    assert "<details><summary>how the agents learn</summary>" in pngs[0]["data"]["text/html"]
    assert "memopt.search for a100-40gb" in pngs[0]["data"]["text/plain"]  # the picture's heading, in words

    prof = memopt.ModelProfile.load(tmp_path / "prof.json")
    floor = int(text_of(floor_cell).strip())
    assert floor == memopt.solvers.min_peak(prof)  # the profile read back has the kernel's floor
    stated = memopt.format_bytes(floor)
    shown = [o["data"] for o in outputs_of(profile_cell) if "data" in o]
    assert any(f"Smallest reachable peak (any plan): {stated}" in d.get("text/html", "") for d in shown)
    assert any(f"Smallest reachable peak: {stated}" in d.get("text/plain", "") for d in shown)
