"""Helpers shared by the benchmark scripts: import path, Markdown tables, small statistics.

Importing this module puts the repository root on ``sys.path`` so that ``python benchmarks/<name>.py`` works from the
repository root without installing the package.
"""

from __future__ import annotations

import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MiB = 2**20


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def rel_err(predicted: float, measured: float) -> float:
    """Signed relative error of a prediction, in percent of the measured value."""
    if measured == 0:
        return 0.0 if predicted == 0 else float("inf")
    return 100.0 * (predicted - measured) / measured


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub-flavoured Markdown table; ``align`` is one character per column (``l``, ``r`` or ``c``)."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(items: Sequence[str]) -> str:
        out = []
        for i, it in enumerate(items):
            out.append(it.rjust(widths[i]) if align[i] == "r" else it.ljust(widths[i]))
        return "| " + " | ".join(out) + " |"

    rule = []
    for i, w in enumerate(widths):
        w = max(w, 3)
        rule.append({"l": ":" + "-" * (w - 1), "r": "-" * (w - 1) + ":", "c": ":" + "-" * (w - 2) + ":"}[align[i]])
    return "\n".join([line(headers), "| " + " | ".join(rule) + " |"] + [line(r) for r in cells])


def set_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)`` unless ``threads`` is 0 (keep torch's default).

    Why one thread by default: on this shared 2-vCPU machine, steps with 2 OpenMP threads are sometimes 10-50x slower
    for seconds to minutes (a descheduled vCPU stalls every parallel region at its barrier), while one thread is
    unaffected. Pass ``--threads 0`` to a script to measure with torch's default instead.
    """
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def environment_line() -> str:
    import torch

    return (f"python {platform.python_version()}, torch {torch.__version__}, {torch.get_num_threads()} torch threads, "
            f"{platform.processor() or platform.machine()}")


def small_gpt2(batch: int = 4, seq: int = 32) -> tuple[Any, tuple[Any, ...], Any]:
    """A transformers GPT-2 from a small config (4 layers, width 64; random init, no download), a batch of token ids
    and a loss: ``(model, inputs, loss_fn)``. The whole-step benchmarks' third-party model."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=128, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(1))
    return model, (ids,), (lambda out: out.logits.float().pow(2).mean())
