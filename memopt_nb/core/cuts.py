"""Units merged back into the blocks ``units="fine"`` split them from: the profile of a cut with some blocks whole.

A fine profile decides on a transformer block's attention, norms and MLP layers one by one. Where a plan recomputes a
whole block, deciding on the block itself is better: its checkpoint holds the block's input only, where recomputing
each child holds every child's input. The profiler measures, in the same profile, what recomputing each split block
as one checkpoint peaks at (:mod:`memopt_nb.profiling.merges`: one more tracked step per level of nesting, marks at
the children's own boundaries); :func:`merge_units` turns the profile into one whose units are those blocks where
asked, with every other figure taken from the fine profile itself (the same run, the same times: no second profile's
noise). The planners and the runtime need nothing else: a merged block is a unit like any other.
:mod:`memopt_nb.planners.depths` searches which blocks to merge.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import ProfileError
from .heads import with_head
from .profile import ModelProfile, Segment, StorageGroup, UnitProfile

__all__ = ["merge_units", "mergeable", "outermost", "profile_for"]


def outermost(names: Iterable[str]) -> list[str]:
    """Those of the module ``names`` that no other of them contains, in their order."""
    names = list(names)
    return [b for b in names if not any(b.startswith(o + ".") for o in names)]


def mergeable(profile: ModelProfile) -> list[str]:
    """The blocks :func:`merge_units` can merge in ``profile`` (outermost first)."""
    return sorted(profile.merges, key=lambda b: (b.count("."), profile.merges[b]["units"][0]))


def _spans(profile: ModelProfile, blocks: list[str]) -> list[tuple[int, int, str]]:
    unknown = [b for b in blocks if b not in profile.merges]
    if unknown:
        have = mergeable(profile)
        hint = (f"; blocks that can be merged: {', '.join(have[:8])}{', …' if len(have) > 8 else ''}" if have else
                "; this profile has none (profile with units=\"fine\" to get blocks split and measured whole)")
        raise ProfileError(f"cannot merge {', '.join(map(repr, unknown))}{hint}")
    return sorted((profile.merges[b]["units"][0], profile.merges[b]["units"][1], b) for b in outermost(blocks))


def _relabel(label: str, index: Mapping[int, int]) -> str:
    return re.sub(r"(fwd_start|fwd_end|bwd_start|bwd_end|fwd|bwd) (\d+)$",
                  lambda m: f"{m.group(1)} {index.get(int(m.group(2)), int(m.group(2)))}", label)


def merge_units(profile: ModelProfile, blocks: Iterable[str]) -> ModelProfile:
    """``profile`` with each block in ``blocks`` one unit instead of the units it was split into.

    A block's forward is its first unit's forward to its last's, its backward the reverse; its peaks when recomputed
    were measured with the block checkpointed whole (:mod:`~memopt_nb.profiling.merges`); storages its own units and
    its own code between them make, save or read are its own, and it pins only what comes from outside it. Everything
    else is the fine profile's. Blocks nested in another block given are merged with it. A merged block's state is
    its units' summed; its part of the unit-by-unit optimizer step was measured (a profile without it: the units'
    seconds and peaks summed, a bound).
    """
    blocks = list(dict.fromkeys(blocks))
    spans = _spans(profile, blocks)
    if not spans:
        return ModelProfile.from_dict(profile.to_dict())._adopt(profile)
    units = profile.units
    new_of, members = _members(len(units), spans)
    seg_new, inside, new_segs = _merged_segments(profile, spans, new_of)
    groups = _merged_groups(profile, spans, new_of, seg_new, inside, len(new_segs))
    new_units: list[UnitProfile] = []
    fingerprint: list[dict[str, Any]] = []
    for i, (block, old) in enumerate(members):
        if block is None:
            src = units[old[0]]
            new_units.append(dataclasses.replace(
                copy.deepcopy(src), index=i, fwd_segment=seg_new[src.fwd_segment],
                bwd_segment=seg_new[src.bwd_segment]))
            fingerprint.append(copy.deepcopy(profile.fingerprint[old[0]]))
            continue
        new_units.append(_merged_unit(profile, block, old, i, seg_new, groups))
        fp = copy.deepcopy(profile.merges[block]["fingerprint"])
        reason = next((units[k].not_recomputable_reason for k in old if units[k].not_recomputable_reason), "")
        if reason:
            fp["not_recomputable"] = reason
        fingerprint.append(fp)
    meta, merges = _merged_meta(profile, [b for _, _, b in spans], new_of)
    out = dataclasses.replace(
        profile, units=new_units, segments=new_segs, groups=groups, fingerprint=tuple(fingerprint), meta=meta,
        merges=merges, step_segment=seg_new.get(profile.step_segment, -1) if profile.step_segment >= 0 else -1,
        excluded=copy.deepcopy(profile.excluded), device=profile.device,
        heads={})  # the head options' segments are the fine units' (profile_for chunks the head before merging)
    return out._adopt(profile)


def _members(n: int, spans: list[tuple[int, int, str]]) -> tuple[dict[int, int], list[tuple[str | None, list[int]]]]:
    """Units: old index -> new index, and each new unit's block (``None``: a unit kept as it was) and old indices."""
    new_of: dict[int, int] = {}
    members: list[tuple[str | None, list[int]]] = []
    starts = {s[0]: s for s in spans}
    u = 0
    while u < n:
        if u in starts:
            first, last, block = starts[u]
            for k in range(first, last + 1):
                new_of[k] = len(members)
            members.append((block, list(range(first, last + 1))))
            u = last + 1
        else:
            new_of[u] = len(members)
            members.append((None, [u]))
            u += 1
    return new_of, members


def _merged_segments(profile: ModelProfile, spans: list[tuple[int, int, str]], new_of: Mapping[int, int]
                     ) -> tuple[dict[int, int], set[int], list[Segment]]:
    """Segments: each block's forward and backward become one segment. Old segment -> new one, the old boundaries
    strictly inside a merged stretch, and the new segments."""
    units, segs = profile.units, profile.segments
    ranges: dict[int, int] = {}  # first old segment of a merged stretch -> its last
    for first, last, _ in spans:
        ranges[units[first].fwd_segment] = units[last].fwd_segment
        ranges[units[last].bwd_segment] = units[first].bwd_segment
    seg_new: dict[int, int] = {}
    inside: set[int] = set()
    new_segs: list[Segment] = []
    k = 0
    while k < len(segs):
        end = ranges.get(k, k)
        part = segs[k:end + 1]
        for j in range(k, end + 1):
            seg_new[j] = len(new_segs)
            if j > k:
                inside.add(j)
        s0 = part[0]
        unit = new_of[s0.unit] if s0.kind in ("fwd", "bwd") else -1
        label = f"{s0.kind} {unit}" if s0.kind in ("fwd", "bwd") else _relabel(s0.label, new_of)
        new_segs.append(Segment(s0.kind, unit, label, sum(s.time for s in part), s0.start_level,
                                max(s.start_level + s.rel_peak for s in part) - s0.start_level))
        k = end + 1
    return seg_new, inside, new_segs


def _merged_groups(profile: ModelProfile, spans: list[tuple[int, int, str]], new_of: Mapping[int, int],
                   seg_new: Mapping[int, int], inside: set[int], n_new_segs: int) -> list[StorageGroup]:
    """The storage groups in the merged units' terms: a block's own code's storages become its own."""
    units, segs = profile.units, profile.segments

    def bnd(b: int | None) -> int | None:
        if b is None:
            return None
        if b >= len(segs):
            return n_new_segs + (b - len(segs))
        return seg_new[b] + 1 if b in inside else seg_new[b]

    def seg(k: int | None) -> int | None:
        return None if k is None else seg_new[k]

    fwd_span = {new_of[f]: (units[f].fwd_segment, units[l_].fwd_segment) for f, l_, _ in spans}
    bwd_span = {new_of[f]: (units[l_].bwd_segment, units[f].bwd_segment) for f, l_, _ in spans}
    groups: list[StorageGroup] = []
    for g in profile.groups:
        producer = new_of.get(g.producer, -1)
        if g.producer == -1 and g.made_pos is not None:  # made by a merged block's own code between its units
            producer = next((p for p, (f0, f1) in fwd_span.items() if f0 <= g.made_pos <= f1), -1)
        savers = {new_of[s] for s in g.savers}
        outside, release = g.outside_saver, g.outside_release
        if outside and release is not None:  # saved by a merged block's own code (its backward lets go within it)
            owner = next((p for p, (b0, b1) in bwd_span.items() if b0 <= release <= b1), None)
            if owner is not None:
                savers.add(owner)
                outside, release = False, None
        consumers = {new_of[c] for c in g.consumers} - ({producer} if producer >= 0 else set())
        if not savers and not consumers and not outside:
            continue
        groups.append(StorageGroup(
            nbytes=g.nbytes, count=g.count, producer=producer, savers=tuple(sorted(savers)),
            consumers=tuple(sorted(consumers)), outside_saver=outside, free_pos=bnd(g.free_pos),
            outside_release=seg(release), release_pos=bnd(g.release_pos), death_seg=seg(g.death_seg),
            late_bytes=g.late_bytes, made_pos=bnd(g.made_pos) if producer == -1 else None))
    return groups


def _merged_meta(profile: ModelProfile, merged_names: list[str], new_of: Mapping[int, int]
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The merged profile's meta (what is merged, what is split, the modules holding units) and its merges (those
    not inside a merged block, renumbered)."""

    def within(name: str) -> bool:  # a merged block, or a module inside one
        return any(name == b or name.startswith(b + ".") for b in merged_names)

    meta = copy.deepcopy(profile.meta)
    meta["merged"] = sorted(set(meta.get("merged") or []) | set(merged_names))
    meta["split"] = {k: v for k, v in (meta.get("split") or {}).items() if not within(k)}
    fp = meta.get("model_fingerprint")
    if isinstance(fp, dict) and isinstance(fp.get("containers"), dict):  # the modules holding units now
        fp["containers"] = {k: v for k, v in fp["containers"].items() if not within(k)}
        for b in merged_names:
            if "siblings" in profile.merges[b]:
                fp["containers"][b.rpartition(".")[0]] = list(profile.merges[b]["siblings"])
    merges = {}
    for name, m in profile.merges.items():
        if within(name):
            continue
        m = copy.deepcopy(m)
        m["units"] = [new_of[m["units"][0]], new_of[m["units"][1]]]
        merges[name] = m
    return meta, merges


def _merged_unit(profile: ModelProfile, block: str, old: list[int], index: int, seg_new: Mapping[int, int],
                 groups: list[StorageGroup]) -> UnitProfile:
    units, segs = profile.units, profile.segments
    m = profile.merges[block]
    first, last = units[old[0]], units[old[-1]]
    parts = [units[k] for k in old]
    rows = [r for u in parts for r in u.param_steps]
    stream = (all(u.param_steps or not u.grad_bytes for u in parts) and rows and all("order" in r for r in rows))
    # where its last gradient is accumulated: the unit with gradients that runs its backward last (the first one)
    done = next((u for u in parts if u.grad_bytes), None)
    end_level = segs[first.bwd_segment + 1].start_level if first.bwd_segment + 1 < len(segs) else 0
    gde = (segs[done.bwd_segment + 1].start_level + done.grads_done_extra - end_level
           if done is not None and done.bwd_segment + 1 < len(segs) else 0)
    effects = [u.side_effects for u in parts if u.side_effects]
    return UnitProfile(
        name=block, index=index, type=m["type"],
        fwd_time=sum(segs[k].time for k in range(first.fwd_segment, last.fwd_segment + 1)),
        bwd_time=sum(segs[k].time for k in range(last.bwd_segment, first.bwd_segment + 1)),
        saved_bytes=sum(g.nbytes for g in groups if index in g.savers),
        interior_bytes=sum(g.nbytes for g in groups
                           if g.savers == (index,) and g.producer == index and not g.outside_saver),
        input_bytes=int(m["input_bytes"]), output_bytes=last.output_bytes,
        param_bytes=sum(u.param_bytes for u in parts), has_rng=any(u.has_rng for u in parts),
        has_running_stats=any(u.has_running_stats for u in parts),
        recomputable=all(u.recomputable for u in parts), swappable=all(u.swappable for u in parts),
        fwd_segment=seg_new[first.fwd_segment], bwd_segment=seg_new[last.bwd_segment],
        rc_fwd_rel_peak=int(m["rc_fwd_rel_peak"]), rc_bwd_rel_peak=int(m["rc_bwd_rel_peak"]),
        input_shapes=copy.deepcopy(m["input_shapes"]), output_shapes=copy.deepcopy(last.output_shapes),
        side_effects="; ".join(dict.fromkeys(effects)),
        not_recomputable_reason=next((u.not_recomputable_reason for u in parts if u.not_recomputable_reason), ""),
        grad_bytes=sum(u.grad_bytes for u in parts), optimizer_bytes=sum(u.optimizer_bytes for u in parts),
        param_storages=sum(u.param_storages for u in parts), grad_storages=sum(u.grad_storages for u in parts),
        optimizer_storages=sum(u.optimizer_storages for u in parts),
        step_time=float(m.get("step_time", sum(u.step_time for u in parts))),
        step_rel_peak=int(m.get("step_rel_peak", sum(u.step_rel_peak for u in parts))),
        param_steps=sorted(copy.deepcopy(rows), key=lambda r: r["order"]) if stream else [],
        params_offloadable=all(u.params_offloadable for u in parts), save_sets={}, grads_done_extra=int(gde),
    )


def profile_for(profile: ModelProfile, plan: Any) -> ModelProfile:
    """The profile ``plan`` was made for: ``profile`` itself, or, for a plan that chunks the LM head (``plan.head``)
    and merged blocks of this fine profile (``plan.meta["merged"]``), ``profile`` with that head and those blocks
    merged."""
    profile = with_head(profile, getattr(plan, "head", None))
    merged = (getattr(plan, "meta", None) or {}).get("merged") or []
    if not merged or list(getattr(plan, "units", [])) == profile.unit_names:
        return profile
    todo = [b for b in merged if b in profile.merges]
    return merge_units(profile, todo) if todo else profile
