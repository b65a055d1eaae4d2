"""Execute the tutorials and store them with their outputs, so that a reader sees them run without running them.

What: each tutorial in ``tutorials/`` (or those named on the command line) is executed exactly as
``tests/test_notebooks.py`` executes it: nbclient, ``MEMOPT_NB_TIMESTEPS=2000`` (the tests' ``CI_TIMESTEPS``),
``MPLBACKEND=Agg``, the repository root on ``PYTHONPATH``, and the hidden summary cell (its code is kept in
``metadata.memopt_nb.test_summary``) appended. The notebook is then written back with its outputs, but without the
appended summary cell, the state of widgets no output displays, or a PNG its output's HTML already embeds
(:func:`slim`); the dict that cell printed is kept in ``metadata.memopt_nb.stored_summary``. Cell
``metadata.execution`` timestamps are dropped, so that storing again only changes what the run changed.

Why: the tutorials are read on GitHub and in JupyterLab before anyone runs them, so they are stored executed. The slow
test (``tests/test_notebooks.py::test_notebook_executes``) re-executes each tutorial and fails if a key figure that does
not depend on this machine's clock (bytes, peaks, budgets, floors, batch sizes, flags) drifted from
``stored_summary``: run this tool again after changing a tutorial or what it shows, and commit the notebooks.

Nothing is written for a notebook whose run raised an error (or printed a traceback), whose summary is missing, or whose
cells were edited while it ran.

How to run (from the repository root, with the project's interpreter; a few minutes per tutorial on 2 busy cores)::

    python tools/store_tutorials.py                  # every tutorial, in place
    python tools/store_tutorials.py 01 03_evaluate   # those named (a file name, its stem, or a prefix such as 01)
    python tools/store_tutorials.py --out /tmp/x 02  # write to /tmp/x instead (to compare with what is stored)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_notebooks import (  # noqa: E402
    CI_TIMESTEPS,
    TUTORIALS,
    WIDGET_STATE,
    WIDGET_VIEW,
    execute,
    summary_of,
)


def set_environment() -> None:
    """The environment of the tests' ``notebook_env`` fixture, at the CI search budget (what the tests re-execute)."""
    if os.environ.get("MEMOPT_NB_TIMESTEPS", CI_TIMESTEPS) != CI_TIMESTEPS:
        print(f"MEMOPT_NB_TIMESTEPS={os.environ['MEMOPT_NB_TIMESTEPS']} ignored: tutorials are stored at "
              f"{CI_TIMESTEPS}, as the tests run them", file=sys.stderr)
    os.environ["MEMOPT_NB_TIMESTEPS"] = CI_TIMESTEPS
    os.environ["MPLBACKEND"] = "Agg"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def select(names: list[str]) -> list[Path]:
    """The tutorials named (file name, stem or prefix of it, or a path), in order; all of them if none is named."""
    if not names:
        return list(TUTORIALS)
    chosen = []
    for name in names:
        stem = Path(name).name.removesuffix(".ipynb")
        hits = [p for p in TUTORIALS if p.stem == stem] or [p for p in TUTORIALS if p.stem.startswith(stem)]
        if len(hits) != 1:
            raise SystemExit(f"{name!r} names {len(hits)} tutorials; one of: {', '.join(p.name for p in TUTORIALS)}")
        chosen += [p for p in hits if p not in chosen]
    return chosen


def problems(nb: nbformat.NotebookNode) -> list[str]:
    """What makes a run unfit to store: error outputs, tracebacks printed to a stream."""
    found = []
    for i, cell in enumerate(nb.cells):
        for o in cell.get("outputs", []):
            if o.output_type == "error":
                found.append(f"cell {i}: {o.ename}: {o.evalue}")
            elif o.output_type == "stream" and "Traceback" in o.text:
                found.append(f"cell {i}: a traceback in {o.name}")
    return found


def stored_form(ran: nbformat.NotebookNode, summary: dict) -> nbformat.NotebookNode:
    """The executed notebook as it is stored: the summary cell taken off, its dict in the metadata, no timestamps."""
    nb = copy.deepcopy(ran)
    last = nb.cells[-1]
    assert "summary" in last.get("metadata", {}).get("tags", []), "the appended summary cell is the last one"
    nb.cells.pop()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # nbclient's timestamps: new on every run
    slim(nb)  # (also: python tools/store_tutorials.py --slim, on the stored notebooks without running them)
    nb.metadata.setdefault("memopt_nb", {})["stored_summary"] = summary
    return nb


def slim(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Leave out what a reader never sees, in place: the saved state of widgets no stored output displays (the
    dashboard leaves its final picture as an ordinary output), and a PNG that the same output's HTML already embeds
    (the dashboard's final frame: HTML with the picture and its summary)."""
    shown = set()
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data:
                shown.add(data[WIDGET_VIEW]["model_id"])
            png = data.get("image/png")
            if png and "".join(png.split()) in "".join(data.get("text/html", "").split()):
                del data["image/png"]
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state")
    if state is not None:
        for model_id in [m for m in state if m not in shown and not _used_by(m, state, shown)]:
            del state[model_id]
        if not state:
            nb.metadata.pop("widgets")
    return nb


def _used_by(model_id: str, state: dict, shown: set) -> bool:
    """Whether a displayed widget refers to ``model_id`` (a child, a layout, a style): ``IPY_MODEL_<id>``."""
    ref = f"IPY_MODEL_{model_id}"
    return any(ref in str(state[m].get("state", {})) for m in shown if m in state)


def store(path: Path, out: Path | None) -> tuple[bool, float]:
    original = nbformat.read(path, as_version=4)
    t0 = time.monotonic()
    try:
        ran = execute(path, copy.deepcopy(original))
    except Exception as exc:  # noqa: BLE001 - nbclient's CellExecutionError and kernel deaths alike: report, go on
        print(f"{path.name}: FAILED after {time.monotonic() - t0:.0f} s, nothing written: {exc}"[:3000])
        return False, time.monotonic() - t0
    seconds = time.monotonic() - t0
    bad = problems(ran)
    summary = summary_of(ran)
    if not isinstance(summary, dict):
        bad.append("no summary dict printed by the appended summary cell")
    if bad:
        print(f"{path.name}: FAILED after {seconds:.0f} s, nothing written:\n  " + "\n  ".join(bad))
        return False, seconds
    nb = stored_form(ran, summary)
    target = (out / path.name) if out is not None else path
    if out is None:
        now = nbformat.read(path, as_version=4)  # others may edit a tutorial while it runs: never overwrite that
        if [c.source for c in now.cells] != [c.source for c in original.cells] or (
                now.metadata.get("memopt_nb", {}).get("test_summary")
                != original.metadata.get("memopt_nb", {}).get("test_summary")):
            print(f"{path.name}: edited while it ran, nothing written; run it again")
            return False, seconds
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    print(f"{path.name}: ran in {seconds:.0f} s, stored in {target} ({target.stat().st_size / 1024:.0f} KB); "
          f"summary {json.dumps(summary)}", flush=True)
    return True, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="tutorials to store (default: all); a file name, its stem or prefix")
    parser.add_argument("--out", type=Path, help="write the executed notebooks to this folder, not in place")
    parser.add_argument("--slim", action="store_true", help="do not run anything: leave out of the stored notebooks "
                        "what a reader never sees (see slim())")
    args = parser.parse_args(argv)
    paths = select(args.names)
    if args.slim:
        for path in paths:
            before = path.stat().st_size
            nbformat.write(slim(nbformat.read(path, as_version=4)), path)
            print(f"{path.name}: {before / 1024:.0f} KB -> {path.stat().st_size / 1024:.0f} KB")
        return 0
    set_environment()
    results = {p.name: store(p, args.out) for p in paths}
    for name, (ok, seconds) in results.items():
        print(f"  {'stored' if ok else 'FAILED':6s} {seconds:6.0f} s  {name}")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
