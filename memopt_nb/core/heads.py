"""The profile of a step whose LM head is chunked, from the options a profile measured.

``memopt.profile(..., head="chunked")`` measures the step once more per number of chunks
(:mod:`memopt_nb.profiling.heads`) and keeps, per option, the segments and storage groups of that step in
``ModelProfile.heads``. A plan that chunks the head (``Plan.head``) is simulated, searched and checked on
:func:`with_head`'s profile: the plain profile with the code outside units as the chunked step ran it. The simulator,
the replay, the MILP and the agents need nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .errors import PlanError
from .profile import ModelProfile, Segment, StorageGroup

__all__ = ["head_options", "with_head"]


def head_options(profile: ModelProfile) -> list[int]:
    """The numbers of chunks ``profile`` measured for its head, fewest first (empty: the head is not an option)."""
    return sorted(int(k) for k in (getattr(profile, "heads", None) or {}))


def with_head(profile: ModelProfile, head: dict[str, Any] | None) -> ModelProfile:
    """``profile`` as the step runs with ``head`` (``{"module", "chunks"}``, a plan's :attr:`~Plan.head`); ``profile``
    itself for ``None`` or a profile that is already of that head."""
    if not head:
        return profile
    if (profile.meta.get("head") or {}).get("chunks") == head.get("chunks"):
        return profile
    option = (getattr(profile, "heads", None) or {}).get(str(head.get("chunks")))
    if option is None:
        have = ", ".join(map(str, head_options(profile))) or "none"
        raise PlanError(f"this plan chunks the LM head in {head.get('chunks')} chunks, which the profile did not "
                        f"measure (it measured: {have}); profile with memopt.profile(..., head='chunked')")
    segments = [Segment(**s) for s in option["segments"]]
    groups = [StorageGroup(**{**g, "savers": tuple(g["savers"]), "consumers": tuple(g["consumers"])})
              for g in option["groups"]]
    units = [dataclasses.replace(u, saved_bytes=sum(g.nbytes for g in groups if u.index in g.savers),
                                 interior_bytes=sum(g.nbytes for g in groups if g.savers == (u.index,)
                                                    and g.producer == u.index and not g.outside_saver))
             for u in profile.units]
    out = dataclasses.replace(
        profile, units=units, segments=segments, groups=groups, peak_bytes=int(option["peak_bytes"]),
        step_time=sum(s.time for s in segments), heads={},
        unattributed_bytes=max(0, int(option["peak_bytes"]) - profile.param_bytes - profile.grad_bytes
                               - profile.optimizer_state_bytes - profile.buffer_bytes
                               - sum(g.nbytes for g in groups if g.savers)),
        meta={**profile.meta, "head": {"module": option["module"], "chunks": int(option["chunks"])}})
    return out._adopt(profile)
