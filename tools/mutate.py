"""A small mutation tester: do the tests notice when the code is wrong?

For each source file it lists *mutants* — copies with one small change (a comparison flipped, an integer or an index
off by one, ``and``/``or`` swapped, ``max``/``min`` swapped, an arithmetic operator changed, a ``not`` dropped, a
statement replaced by ``pass``) — and, for a sample of them:

1. runs a *probe* command (cheap and deterministic, e.g. simulating fixed plans and printing the results) with the
   mutant in place. A mutant whose probe output is the same as the original's changes no output we look at: it is
   counted as *equivalent* and left out of the score. A probe that fails or prints something else means the mutant
   changes behaviour;
2. runs the test command with that mutant in place: *killed* if it fails (or times out), *survived* if it passes.

The score is killed / (killed + survived). Everything runs in a temporary copy of the repository (git's tracked and
untracked-but-not-ignored files), with ``PYTHONPATH`` pointing there and byte-code writing off; the working tree is
never modified. Before any mutant, the probe and the tests run once on the unmodified copy: the tests must pass.

    python tools/mutate.py --files memopt_nb/sim/simulator.py \\
        --tests "python -m pytest -q -x -p no:cacheprovider tests/test_simulate.py -k 'chains or small'" \\
        --probe "python tools/mutate_probes.py simulate" --max-mutants 30 --seed 0 --timeout 300

``--files`` takes several files (or globs); each gets its own sample and row. ``--list`` prints the mutants and stops.
``--json PATH`` writes every result. Commands are run with ``bash -c`` from the copy's root, ``python`` meaning the
interpreter running this script.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CMP_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_CMP_FLIP = {ast.Lt: ast.Gt, ast.Gt: ast.Lt, ast.LtE: ast.GtE, ast.GtE: ast.LtE}
_BIN_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
             ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd}
_FUNC_SWAP = {"max": "min", "min": "max", "maximum": "minimum", "minimum": "maximum", "amax": "amin", "amin": "amax",
              "any": "all", "all": "any", "argmax": "argmin", "argmin": "argmax"}


@dataclasses.dataclass
class Mutant:
    """One change: replace ``source[start:end]`` with ``text``."""

    file: str
    line: int
    kind: str
    start: int
    end: int
    old: str
    text: str

    def apply(self, source: str) -> str:
        return source[: self.start] + self.text + source[self.end:]

    def describe(self) -> str:
        old = " ".join(self.old.split())
        new = " ".join(self.text.split())
        return f"{self.file}:{self.line} [{self.kind}] {_short(old)} -> {_short(new)}"


def _short(s: str, n: int = 70) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


class _Sites(ast.NodeVisitor):
    """Walks a module and yields (node, kind, replacement node or text) for every mutation it can make."""

    def __init__(self) -> None:
        self.out: list[tuple[ast.AST, str, ast.AST | str]] = []

    # -- parts never mutated: docstrings, imports, annotations, f-strings, __all__
    def visit_Import(self, node: ast.Import) -> None:
        return

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        return

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return

    def _body(self, body: list[ast.stmt]) -> None:
        for i, stmt in enumerate(body):
            if i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # docstring
            if isinstance(stmt, (ast.Expr, ast.Assign, ast.AugAssign, ast.Return, ast.Raise,
                                 ast.If, ast.For, ast.While, ast.With, ast.Try, ast.Delete, ast.Assert)):
                if not (isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                             for t in stmt.targets)):
                    self.out.append((stmt, "drop statement", "pass"))

    def generic_visit(self, node: ast.AST) -> None:
        for name in ("body", "orelse", "finalbody"):
            body = getattr(node, name, None)
            if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
                self._body(body)
        super().generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(d)
        self._body(node.body)
        for stmt in node.body:
            self.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._body(node.body)
        for stmt in node.body:
            self.visit(stmt)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_Assign(self, node: ast.Assign) -> None:
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        for t in node.targets:
            if isinstance(t, ast.Subscript):
                self.visit(t)
        self.visit(node.value)

    def visit_arg(self, node: ast.arg) -> None:
        return

    # -- operators
    def visit_Compare(self, node: ast.Compare) -> None:
        for i, op in enumerate(node.ops):
            for table, kind in ((_CMP_SWAP, "comparison"), (_CMP_FLIP, "comparison flipped")):
                new = table.get(type(op))
                if new is not None:
                    ops = list(node.ops)
                    ops[i] = new()
                    self.out.append((node, kind, ast.Compare(node.left, ops, node.comparators)))
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        new = _BIN_SWAP.get(type(node.op))
        if new is not None:
            self.out.append((node, "arithmetic", ast.BinOp(node.left, new(), node.right)))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        new = _BIN_SWAP.get(type(node.op))
        if new is not None:
            self.out.append((node, "arithmetic", ast.AugAssign(node.target, new(), node.value)))
        if isinstance(node.target, ast.Subscript):
            self.visit(node.target)
        self.visit(node.value)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        new = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self.out.append((node, "and/or", ast.BoolOp(new, node.values)))
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, (ast.Not, ast.USub, ast.Invert)):
            self.out.append((node, "drop unary", node.operand))
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if isinstance(v, bool):
            self.out.append((node, "boolean", ast.Constant(not v)))
        elif isinstance(v, int):
            self.out.append((node, "integer +1", ast.Constant(v + 1)))
            self.out.append((node, "integer -1", ast.Constant(v - 1)))

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        if name in _FUNC_SWAP:
            new_f: ast.expr = (ast.Name(_FUNC_SWAP[name], ast.Load()) if isinstance(f, ast.Name)
                               else ast.Attribute(f.value, _FUNC_SWAP[name], ast.Load()))
            self.out.append((node, "max/min", ast.Call(new_f, node.args, node.keywords)))
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        for p in parts:
            for bound in ([p.lower, p.upper] if isinstance(p, ast.Slice) else [p]):
                if bound is None or isinstance(bound, (ast.Constant, ast.Slice)):
                    continue  # constants are mutated as integers already
                for delta, kind in ((1, "index +1"), (-1, "index -1")):
                    op = ast.Add() if delta > 0 else ast.Sub()
                    self.out.append((bound, kind, ast.BinOp(bound, op, ast.Constant(1))))
        self.generic_visit(node)


def _offsets(source: str) -> list[int]:
    starts, pos = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(pos)
        pos += len(line)
    starts.append(pos)
    return starts


def _char(source_bytes_lines: list[bytes], starts: list[int], line: int, col: int) -> int:
    # ast column offsets count UTF-8 bytes
    return starts[line - 1] + len(source_bytes_lines[line - 1][:col].decode("utf-8"))


def mutants_of(path: str, root: Path = ROOT) -> list[Mutant]:
    """Every mutant of the file at ``path`` (relative to ``root``), in source order."""
    source = (root / path).read_text()
    tree = ast.parse(source)
    sites = _Sites()
    sites.visit(tree)
    starts = _offsets(source)
    blines = [line.encode("utf-8") for line in source.splitlines(keepends=True)]
    out, seen = [], set()
    for node, kind, new in sites.out:
        if getattr(node, "end_lineno", None) is None:
            continue
        a = _char(blines, starts, node.lineno, node.col_offset)
        b = _char(blines, starts, node.end_lineno, node.end_col_offset)
        if isinstance(node, ast.stmt):
            text = new if isinstance(new, str) else ast.unparse(new)
        else:
            text = "(" + (new if isinstance(new, str) else ast.unparse(new)) + ")"
        old = source[a:b]
        key = (a, b, text)
        if key in seen:
            continue
        seen.add(key)
        m = Mutant(path, node.lineno, kind, a, b, old, text)
        try:
            ast.parse(m.apply(source))
        except SyntaxError:
            continue
        out.append(m)
    return out


# ---------------------------------------------------------------------- running
def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for f in files:
        if not f or not (ROOT / f).is_file():
            continue
        target = dst / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)


def _run(cmd: str, cwd: Path, timeout: float) -> tuple[int, str]:
    env = dict(os.environ, PYTHONPATH=str(cwd), PYTHONDONTWRITEBYTECODE="1", PYTHONHASHSEED="0")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    try:
        p = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                           start_new_session=True)
        return p.returncode, p.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, out


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # "equivalent", "killed", "timeout", "survived"
    seconds: float


def run_file(path: str, tests: str, probe: str | None, max_mutants: int, seed: int, timeout: float,
             work: Path, match: list[str] | None = None) -> tuple[int, list[Outcome]]:
    all_mutants = mutants_of(path, work)  # from the copy: the working tree may change while this runs
    rng = random.Random(f"{seed}:{path}")
    sample = all_mutants if len(all_mutants) <= max_mutants else sorted(
        rng.sample(all_mutants, max_mutants), key=lambda m: m.start)
    if match:
        sample = [m for m in sample if any(x in m.describe() for x in match)]
    target = work / path
    original = target.read_text()
    base_probe = None
    if probe:
        rc, base_probe = _run(probe, work, timeout)
        if rc != 0:
            raise SystemExit(f"the probe fails on the unmodified code (exit {rc}): {probe}")
    rc, out = _run(tests, work, timeout)
    if rc != 0:
        raise SystemExit(f"the tests fail on the unmodified code (exit {rc}): {tests}\n{out[-2000:]}")
    results = []
    for i, m in enumerate(sample):
        t0 = time.perf_counter()
        try:
            target.write_text(m.apply(original))
            status = None
            if probe:
                rc, got = _run(probe, work, timeout)
                if rc == 0 and got == base_probe:
                    status = "equivalent"
            if status is None:
                rc, _ = _run(tests, work, timeout)
                status = "timeout" if rc == -1 else "killed" if rc != 0 else "survived"
        finally:
            target.write_text(original)
        results.append(Outcome(m, status, time.perf_counter() - t0))
        print(f"  [{i + 1}/{len(sample)}] {status:10s} {results[-1].seconds:5.1f}s  {m.describe()}", flush=True)
    return len(all_mutants), results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="+", required=True, help="source files (globs allowed), relative to the repo root")
    ap.add_argument("--tests", help="shell command that runs the tests (exit 0 = pass)")
    ap.add_argument("--probe", help="shell command whose stdout shows behaviour; unchanged output = equivalent mutant")
    ap.add_argument("--max-mutants", type=int, default=30, help="sample size per file (default 30)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per probe or test run (default 300)")
    ap.add_argument("--match", action="append", help="of the sample, run only mutants whose description contains this "
                    "text (repeatable; e.g. to rerun the survivors of an earlier run)")
    ap.add_argument("--list", action="store_true", help="list the mutants of each file and stop")
    ap.add_argument("--json", help="write every outcome to this file")
    args = ap.parse_args(argv)
    files: list[str] = []
    for pattern in args.files:
        hits = sorted(glob.glob(pattern, root_dir=ROOT)) or [pattern]
        files += [h for h in hits if h.endswith(".py") and (ROOT / h).is_file()]
    if not files:
        ap.error("no Python source file matched --files")
    if args.list:
        for f in files:
            ms = mutants_of(f)
            print(f"{f}: {len(ms)} mutants")
            for m in ms:
                print("  " + m.describe())
        return 0
    if not args.tests:
        ap.error("--tests is required (unless --list)")
    rows, everything = [], []
    with tempfile.TemporaryDirectory(prefix="memopt-mutate-") as tmp:
        work = Path(tmp)
        _copy_tree(work)
        for f in files:
            print(f"{f}:", flush=True)
            total, results = run_file(f, args.tests, args.probe, args.max_mutants, args.seed, args.timeout, work,
                                      args.match)
            everything += results
            count = {s: sum(r.status == s for r in results) for s in ("equivalent", "killed", "timeout", "survived")}
            changing = count["killed"] + count["timeout"] + count["survived"]
            score = (count["killed"] + count["timeout"]) / changing if changing else float("nan")
            rows.append((f, total, len(results), count, score))
    print()
    head = f"{'file':34s} {'mutants':>7s} {'sampled':>7s} {'equiv.':>6s} {'killed':>6s} {'timeout':>7s} " \
           f"{'survived':>8s} {'killed %':>8s}"
    print(head)
    print("-" * len(head))
    for f, total, n, c, score in rows:
        print(f"{f:34s} {total:7d} {n:7d} {c['equivalent']:6d} {c['killed']:6d} {c['timeout']:7d} {c['survived']:8d} "
              f"{100 * score:7.1f}%")
    survivors = [r for r in everything if r.status == "survived"]
    if survivors:
        print("\nsurviving mutants (output-changing on the probe, no test failed):")
        for r in survivors:
            print("  " + r.mutant.describe())
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{**dataclasses.asdict(r.mutant), "status": r.status, "seconds": round(r.seconds, 2)} for r in everything],
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
