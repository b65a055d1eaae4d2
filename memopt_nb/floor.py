"""Why a profile's memory cannot go lower: the smallest peak any plan reaches, split into what holds it up.

A per-unit plan (keep, recompute or swap each unit's saved activations) lowers the activation memory of a training
step. It cannot touch what every step holds regardless of the plan, and it cannot split a unit. The smallest peak any
plan reaches (:func:`memopt_nb.solvers.min_peak`, "the floor") is therefore roughly the sum of three parts:

* **fixed state** — parameters, gradients, optimizer state and buffers, held through the step;
* **the largest unit's working set** — the memory one unit needs while it is recomputed and back-propagated;
* **kept activations** — the rest: unit inputs that recompute needs, activations no plan frees, and what code
  outside the units holds.

:func:`explain_floor` computes the split and names the largest part (what *bounds* the floor), with advice that would
lower that part. The split is an estimate from the profile's totals; the floor itself is exact (the MILP's minimum).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .budget import format_bytes

__all__ = ["FIXED_STATE", "KEPT_ACTIVATIONS", "LARGEST_UNIT", "Floor", "explain_floor"]

#: Names of the three parts (the values of :attr:`Floor.bound`).
FIXED_STATE = "fixed state"
LARGEST_UNIT = "largest unit"
KEPT_ACTIVATIONS = "kept activations"


@dataclass
class Floor:
    """The smallest reachable peak and what it is made of (bytes).

    Attributes:
        floor_bytes: the smallest peak any plan reaches (:func:`memopt_nb.solvers.min_peak`).
        fixed_bytes: parameters + gradients + optimizer state + buffers (capped at the floor).
        largest_unit: the unit with the largest working set; largest_unit_bytes: that working set (capped at what is
            left of the floor after the fixed state).
        kept_bytes: the rest of the floor: kept unit inputs, activations no plan frees, code outside units.
        bound: the largest of the three parts: ``"fixed state"``, ``"largest unit"`` or ``"kept activations"``.
        advice: what would lower the floor (only options that help with this bound).
    """

    floor_bytes: int
    fixed_bytes: int
    largest_unit: str | None
    largest_unit_bytes: int
    kept_bytes: int
    bound: str
    advice: list[str] = field(default_factory=list)

    def parts(self) -> dict[str, int]:
        """``{part name: bytes}`` of the three parts, in the order they are explained."""
        return {FIXED_STATE: self.fixed_bytes, LARGEST_UNIT: self.largest_unit_bytes,
                KEPT_ACTIVATIONS: self.kept_bytes}

    def bound_text(self) -> str:
        """One sentence: what bounds the floor, with the part's size and share."""
        fb = format_bytes
        share = self.parts()[self.bound] / max(self.floor_bytes, 1)
        if self.bound == FIXED_STATE:
            what = (f"the fixed state — parameters, gradients and optimizer state, held through the whole step — "
                    f"{fb(self.fixed_bytes)} ({share:.0%})")
        elif self.bound == LARGEST_UNIT:
            what = (f"the largest unit's working set ({self.largest_unit}: what it needs while recomputed and "
                    f"back-propagated) — {fb(self.largest_unit_bytes)} ({share:.0%})")
        else:
            what = (f"the kept activations — unit inputs recompute needs and activations no plan frees — "
                    f"{fb(self.kept_bytes)} ({share:.0%})")
        return f"The floor is bounded by {what}."

    def breakdown_text(self) -> str:
        """The three parts in one line."""
        fb = format_bytes
        unit = f" ({self.largest_unit})" if self.largest_unit else ""
        return (f"fixed state {fb(self.fixed_bytes)} + largest unit{unit} {fb(self.largest_unit_bytes)} + kept "
                f"activations {fb(self.kept_bytes)}")

    def text(self) -> str:
        """Floor, what bounds it, and what would lower it, as a short paragraph."""
        advice = " To lower it: " + "; ".join(self.advice) + "." if self.advice else ""
        return (f"Smallest reachable peak: {format_bytes(self.floor_bytes)} ({self.breakdown_text()}). "
                f"{self.bound_text()}{advice}")


def _working_set(unit: Any) -> int:
    return int(max(unit.rc_fwd_rel_peak, unit.rc_bwd_rel_peak, unit.saved_bytes))


def explain_floor(profile: Any, device: Any = None, *, floor_bytes: int | None = None,
                  strategies: Sequence[str] = ("keep", "recompute", "swap")) -> Floor:
    """Split the smallest reachable peak of ``profile`` (on ``device``) into fixed state, the largest unit's working set
    and kept activations, and say which bounds it and what would lower it.

    ``floor_bytes``: the floor if already known (else :func:`memopt_nb.solvers.min_peak` computes it).
    """
    if floor_bytes is None:
        from .solvers import min_peak

        floor_bytes = min_peak(profile, device, strategies)
    floor = int(floor_bytes)
    fixed = int(profile.param_bytes + profile.grad_bytes + profile.optimizer_state_bytes + profile.buffer_bytes)
    fixed = min(fixed, floor)
    units = list(profile.units)
    if units:
        big = max(units, key=_working_set)
        name, work = big.name, min(_working_set(big), floor - fixed)
    else:
        name, work = None, 0
    kept = max(floor - fixed - work, 0)
    parts = {FIXED_STATE: fixed, LARGEST_UNIT: work, KEPT_ACTIVATIONS: kept}
    bound = max(parts, key=lambda k: parts[k])
    activations = work + kept
    advice: list[str] = []
    if bound == FIXED_STATE:
        advice.append("no per-unit plan lowers the fixed state: shard it across devices (FSDP2, see "
                      "memopt.distributed.per_rank and tutorial 04)")
        if activations >= 0.1 * floor:
            advice.append("a smaller batch (activations are the other "
                          f"{format_bytes(activations)})")
    elif bound == LARGEST_UNIT:
        advice.append(f"finer units: split {name} into its children (profile with --units naming them, or a deeper "
                      "--units level)")
        advice.append("a smaller batch")
    else:
        advice.append("a smaller batch (kept activations grow with it)")
    return Floor(floor_bytes=floor, fixed_bytes=fixed, largest_unit=name, largest_unit_bytes=work, kept_bytes=kept,
                 bound=bound, advice=advice)
