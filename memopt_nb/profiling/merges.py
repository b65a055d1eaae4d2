"""What a block ``units="fine"`` split into units costs as one unit again: its peaks when recomputed as one
checkpoint, measured at its units' own marks in one more tracked step per level of nesting, and its part of the
unit-by-unit optimizer step (what
:func:`memopt_nb.core.cuts.merge_units` needs besides the fine profile)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..core.plan import unit_fingerprint
from ..core.progress import advance, stage
from .tracer import chunked_step, tracked_step
from .units import unusable

__all__ = ["measure_merges"]


def _candidates(model: nn.Module, names: list[str], split: Mapping[str, str], info: Mapping[str, dict],
                why: dict[str, str]) -> dict[str, list[int]]:
    """The split modules that can be one unit again, with their units' indices; ``why`` gets the others' reasons."""
    modules = dict(model.named_modules())
    out: dict[str, list[int]] = {}
    for block in sorted(split, key=lambda b: (b.count("."), b)):
        kids = [i for i, n in enumerate(names) if n.startswith(block + ".")]
        if len(kids) < 2:
            continue
        reason = unusable(info[block]) if block in info else "not seen in the forward"
        if reason is None and kids != list(range(kids[0], kids[-1] + 1)):
            reason = "its units do not run one after another"
        if reason is None:
            inside = {id(p) for i in kids for p in modules[names[i]].parameters()}
            if {id(p) for p in modules[block].parameters()} != inside:
                reason = "it has parameters outside its units"
        if reason is None:
            out[block] = kids
        else:
            why[block] = reason
    return out


def measure_merges(model: nn.Module, inputs: Sequence[Any], loss_fn: Any, optimizer: Any, names: list[str],
                   device: torch.device, kwargs: Mapping[str, Any] | None, split: Mapping[str, str],
                   info: Mapping[str, dict], ref_marks: list, fwd_seg: Mapping[int, int],
                   bwd_seg: Mapping[int, int]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Per split module that can be a unit again: its first and last unit, its peaks above the start of its forward
    and backward when it is recomputed as one checkpoint, its own part of the unit-by-unit optimizer step (seconds,
    peak above the level before it), its inputs and its fingerprint. Also returns why the others
    cannot be merged. Modules nested in one another are measured in separate steps, one per level."""
    why: dict[str, str] = {}
    cands = _candidates(model, names, split, info, why)
    levels: dict[int, list[str]] = {}
    for block in cands:
        depth = sum(1 for other in cands if block.startswith(other + "."))
        levels.setdefault(depth, []).append(block)
    labels = [m[0] for m in ref_marks]
    out: dict[str, dict[str, Any]] = {}
    stage("merges", total=len(levels))
    for depth in sorted(levels):
        blocks = levels[depth]
        marks, run, _ = tracked_step(model, inputs, loss_fn, optimizer, names, device, observe=False,
                                     recompute=False, kwargs=kwargs, blocks=blocks)
        if [m[0] for m in marks] != labels:
            why.update({b: "the step ran differently with it checkpointed whole" for b in blocks})
            advance()
            continue
        # the block's own part of the unit-by-unit optimizer step (what its state placements cost at the step)
        steps = (chunked_step(model, inputs, loss_fn, optimizer, [list(model.get_submodule(b).parameters())
                                                                  for b in blocks], device, kwargs)
                 if optimizer is not None else None)
        for i, block in enumerate(blocks):
            first, last = cands[block][0], cands[block][-1]
            f0, f1, b0, b1 = fwd_seg[first], fwd_seg[last], bwd_seg[last], bwd_seg[first]
            before = marks[b0][2] - marks[b0 - 1][1]  # the code before its units' backward: no recomputation there
            ref_before = ref_marks[b0][2] - ref_marks[b0 - 1][1]
            if before > ref_before:
                why[block] = "its recomputation starts in its own code before its units' backward"
                continue
            mod = model.get_submodule(block)
            shapes, nbytes = run.block_io.get(block, ([], 0))
            out[block] = {
                "type": type(mod).__name__,
                "units": [first, last],
                "rc_fwd_rel_peak": int(max(0, max(marks[k + 1][2] for k in range(f0, f1 + 1)) - marks[f0][1])),
                "rc_bwd_rel_peak": int(max(0, max(marks[k + 1][2] for k in range(b0, b1 + 1)) - marks[b0][1])),
                "input_shapes": shapes,
                "input_bytes": int(nbytes),
                "fingerprint": unit_fingerprint(block, mod),
                **({"step_time": steps[0][i + 1], "step_rel_peak": int(steps[1][i + 1])} if steps else {}),
                # the candidate units beside it, as a plan's model fingerprint records them
                "siblings": [c for c, _ in model.get_submodule(block.rpartition(".")[0]).named_children()],
            }
        advance()
    return out, why
