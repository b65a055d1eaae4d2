"""The plan space: which activation strategies and which placements of the optimizer state, gradients and
parameters a plan may use, parsed once from what the user gives (``strategies=``, ``offload_state=``,
``step_in_backward=``) and passed to the planners as one :class:`PlanSpace`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from .errors import PlanError
from .plan import DEFAULT_STRATEGIES, STATE_CHOICES, STATE_PIECES, STRATEGIES, state_choices
from .strategies import PLACE_OF

__all__ = ["OffloadState", "PlanSpace", "allowed_strategies"]

#: What ``offload_state=`` takes: ``True`` (every piece may move), ``False`` (activations only), or a set (or a
#: comma-separated string) of :data:`~memopt_nb.core.plan.STATE_PIECES`.
OffloadState = bool | str | Iterable[str]


def allowed_strategies(strategies: str | Iterable[str] = DEFAULT_STRATEGIES) -> tuple[str, ...]:
    """The activation strategies ``strategies=`` allows, in the canonical order of
    :data:`~memopt_nb.core.plan.STRATEGIES` (order and duplicates of the argument do not matter).

    ``strategies``: a non-empty set of ``"keep"``, ``"recompute"``, ``"swap"``, ``"recompute_offload"``,
    ``"selective"``, or the same as a comma-separated string (``"keep,recompute"``). The planners' default is
    :data:`~memopt_nb.core.plan.DEFAULT_STRATEGIES` (keep, recompute, swap: ``"recompute_offload"`` and
    ``"selective"`` are opt-in; ``"selective"`` needs a profile made with ``selective=True``). A unit none of them fits
    (say only ``"swap"`` allowed and the unit cannot be swapped) keeps its activations. Anything else raises
    :class:`~memopt_nb.core.errors.PlanError` naming the allowed strategies.
    """
    if isinstance(strategies, str):
        strategies = strategies.split(",")
    try:
        names = [s.strip().lower() if isinstance(s, str) else s for s in strategies]
    except TypeError:
        raise PlanError(f"strategies must be a set of {', '.join(STRATEGIES)}; got {strategies!r}") from None
    unknown = [repr(s) for s in names if s not in STRATEGIES]
    if unknown or not names:
        what = f"unknown {', '.join(unknown)}" if unknown else "none given"
        raise PlanError(f"strategies: {what}; give a non-empty set of {', '.join(STRATEGIES)} (e.g. "
                        f"strategies=(\"keep\", \"recompute\") for checkpointing only)")
    return tuple(s for s in STRATEGIES if s in names)


@dataclass(frozen=True)
class PlanSpace:
    """What a plan may decide: ``strategies`` for activations, the state ``offload`` may move, ``step_in_backward``.

    Build one with :meth:`of` from the planners' keyword arguments (a bad value raises
    :class:`~memopt_nb.core.errors.PlanError` there, once). :attr:`placements` are the indices into
    :data:`~memopt_nb.core.plan.STATE_CHOICES` the space allows, all-resident (0) first.
    """

    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    offload: frozenset[str] = frozenset(STATE_PIECES)
    step_in_backward: bool = False

    @classmethod
    def of(cls, strategies: str | Iterable[str] = DEFAULT_STRATEGIES, offload_state: OffloadState = True,
           step_in_backward: bool = False) -> PlanSpace:
        """The space of ``strategies=``, ``offload_state=`` and ``step_in_backward=`` as the planners take them."""
        choices = state_choices(offload_state, step_in_backward=step_in_backward)  # PlanError on a bad value
        moved = frozenset(piece for choice in choices for piece, place in zip(STATE_PIECES, choice, strict=True)
                          if PLACE_OF[place].moves)
        return cls(allowed_strategies(strategies), moved, step_in_backward)

    @cached_property
    def placements(self) -> tuple[int, ...]:
        return tuple(STATE_CHOICES.index(c) for c in state_choices(set(self.offload),
                                                                   step_in_backward=self.step_in_backward))

    @property
    def offload_state(self) -> set[str]:
        """The ``offload_state=`` value of this space (a set of pieces; empty: activations only)."""
        return set(self.offload)

    @property
    def moves_state(self) -> bool:
        """Whether any placement other than all-resident is allowed."""
        return len(self.placements) > 1

    def replace(self, **changes: Any) -> PlanSpace:
        """This space with ``strategies=``, ``offload_state=`` or ``step_in_backward=`` changed (parsed as in
        :meth:`of`)."""
        args = {"strategies": self.strategies, "offload_state": set(self.offload),
                "step_in_backward": self.step_in_backward}
        unknown = set(changes) - set(args)
        if unknown:
            raise TypeError(f"PlanSpace.replace: unknown {sorted(unknown)}")
        return PlanSpace.of(**{**args, **changes})
