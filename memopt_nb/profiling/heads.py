"""What the step costs with its LM head chunked: the profile's head options (``profile(..., head="chunked")``).

The head and loss run after every unit's forward and before every unit's backward, so chunking them changes only
the code between units: for each number of chunks in :data:`HEAD_CHUNKS` the step is tracked and timed once more with
:class:`~memopt_nb.runtime.head.ChunkedHead` installed, and the profile keeps that step's segments (levels, peaks and
the times of the code outside units; the units' own times are the plain step's, so the options differ by the head
alone) and storage groups. An option whose step runs differently (other marks) is left out and ``meta["head_why"]``
says why. :func:`memopt_nb.core.heads.with_head` makes the profile of a plan that chunks the head from these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..core.errors import PlanError
from ..core.profile import Segment
from ..core.progress import advance, stage
from ..runtime.head import ChunkedHead, find_head
from .tracer import groups_from, segments_from, timed_step, tracked_step

__all__ = ["HEAD_CHUNKS", "measure_heads", "noting_head", "use_unit_times"]

#: the numbers of chunks a profile measures: more chunks hold less of the logits at a time and cost more calls. A
#: number, not a size, so that what a chunk holds grows with the batch as the rest does (profiles extrapolate in the
#: batch); not more, since chunks of a few tokens go through other matrix kernels and drift further from the head as
#: written (with 64 chunks of 2 tokens, AdamW's parameters drifted 1e-4 in three steps, against 5e-7 with 16 of 8)
HEAD_CHUNKS = (4, 16)


@contextlib.contextmanager
def noting_head(model: nn.Module, head_module: str | None, meta: dict[str, Any]) -> Iterator[None]:
    """While inside, a forward of the model's LM head (its output embeddings, or ``head_module``) records in ``meta``
    its name, the bytes of its logits and the vocabulary: what the floor names when the peak is there. Nothing for a
    model without one."""
    try:
        name, module = find_head(model, head_module)
    except PlanError:
        yield
        return

    def note(mod: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.dim() >= 2:
            meta.update(module=name, logits_bytes=int(out.numel() * out.element_size()), vocab=int(out.shape[-1]))

    handle = module.register_forward_hook(note)
    try:
        yield
    finally:
        handle.remove()


def measure_heads(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any, names: list[str],
                  device: torch.device, kwargs: Mapping[str, Any], head_module: str | None,
                  labels: list[Any], repeats: int) -> tuple[dict[str, dict[str, Any]], str]:
    """Per number of chunks (as a string key), the step's segments, storage groups and peak with the head chunked,
    and why an option is missing (``""`` when none is). ``labels``: the plain step's marks' labels. Runs inside the
    profile's preserved-state block; :func:`use_unit_times` then gives the units the plain step's times."""
    name, module = find_head(model, head_module)
    n = len(names)
    out: dict[str, dict[str, Any]] = {}
    why = []
    stage("head options", total=len(HEAD_CHUNKS))
    for chunks in HEAD_CHUNKS:
        with ChunkedHead(module, chunks):
            # untimed first: caches, and a loop that keeps its outputs (keep_outputs) then holds this head's output
            timed_step(model, inputs, loss_fn, optimizer, names, device, kwargs)
            marks, run, peak = tracked_step(model, inputs, loss_fn, optimizer, names, device, observe=True,
                                            recompute=False, kwargs=kwargs)
            if [m[0] for m in marks] != labels:
                why.append(f"{chunks} chunks: the step ran differently with the head chunked")
                advance()
                continue
            times = [timed_step(model, inputs, loss_fn, optimizer, names, device, kwargs)[1] for _ in range(repeats)]
        segs, _, _ = segments_from(marks, n)
        for i, seg in enumerate(segs):
            seg.time = statistics.median(t[i] for t in times)
        out[str(chunks)] = {"module": name, "chunks": chunks, "peak_bytes": int(peak),
                            "segments": [dataclasses.asdict(s) for s in segs],
                            "groups": [dataclasses.asdict(g) for g in groups_from(run)]}
        advance()
    return out, "; ".join(why)


def use_unit_times(options: dict[str, dict[str, Any]], segments: list[Segment]) -> None:
    """Give each option's unit segments the plain step's times (``segments``), so that options differ by the head."""
    for option in options.values():
        for seg, base in zip(option["segments"], segments, strict=True):
            if seg["kind"] in ("fwd", "bwd"):
                seg["time"] = base.time
