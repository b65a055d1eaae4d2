"""Exceptions a user can act on.

Every error memopt_nb raises for a user's mistake is a subclass of :class:`MemoptError` (itself a ``ValueError``), and
its message says what was wrong and what would work. Notebook magics turn these into ``UsageError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["BudgetError", "MemoptError", "MemoptWarning", "PlanError", "ProfileError", "WrapOrderError",
           "at_least_text"]


class MemoptError(ValueError):
    """Base class of every user-facing memopt_nb error."""


class MemoptWarning(UserWarning):
    """Something a user should know that does not stop training: e.g. inputs larger than the plan was made for."""


class BudgetError(MemoptError):
    """A memory budget that cannot be parsed, or that no plan can meet.

    A budget below the smallest reachable peak carries what the user can act on as data, so that a caller can say it
    in the spelling of where the user is (a magic's ``--step-in-backward`` rather than ``step_in_backward=True``):

    Attributes:
        minimum_bytes: the smallest budget any plan in the space searched meets (``None`` for a budget that could
            not be read).
        budget_bytes: the budget asked for.
        options: what would lower that floor, each a ``str`` in Python spelling, with a ``magic`` attribute in the
            magics' spelling when it differs (see :class:`memopt_nb.floor.Advice`).
        context: why, in one sentence after the actionable one (the floor, the space and the device).
        detail: what the floor is made of, for the lines after it.
        peak_bytes: the unplanned peak a percentage budget is a share of (``None``: unknown); the minimum is then
            also said as a percentage.
    """

    def __init__(self, message: str, *, minimum_bytes: int | None = None, budget_bytes: int | None = None,
                 options: Sequence[str] = (), context: str = "", detail: str = "",
                 peak_bytes: int | None = None) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.peak_bytes = peak_bytes
        self.budget_bytes = budget_bytes
        self.options = list(options)
        self.context = context
        self.detail = detail

    def reworded(self, spelling: str = "python") -> str:
        """The message with the actionable sentence first, options spelt for ``"python"`` or ``"magic"``: at most
        two lines (what to ask for, then why), then the detail. Without a minimum, the message as raised."""
        if self.minimum_bytes is None:
            return str(self)
        need = at_least_text(self.minimum_bytes, spelling)
        if self.peak_bytes:  # the same minimum as a share of the unplanned peak, rounded up
            share = math.ceil(100 * self.minimum_bytes / self.peak_bytes)
            need += f" ({share}% of the unplanned peak)"
        opts = [getattr(o, spelling, None) or str(o) for o in self.options]
        first = f"Ask for at least {need}" + (f", or lower the floor: {'; '.join(opts)}." if opts else ".")
        return "\n".join(t for t in (first, self.context, self.detail) if t)


def at_least_text(minimum_bytes: int, spelling: str = "python") -> str:
    """A budget of at least ``minimum_bytes`` as the user would write it: ``64.59 MiB`` in Python, ``--budget 64.59MiB``
    in a magic (rounded up, so that asking for it is enough)."""
    n = float(minimum_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            break
        n /= 1024
    value = f"{math.ceil(n * 100) / 100:.2f}" if unit != "B" else f"{int(minimum_bytes)}"
    return f"--budget {value}{unit}" if spelling == "magic" else f"{value} {unit}"



class PlanError(MemoptError):
    """A plan that is malformed, corrupt, from a newer version, or made for another model."""


class ProfileError(MemoptError):
    """A model, input or unit selection that cannot be profiled as asked."""


class WrapOrderError(PlanError, ProfileError):
    """A DDP-wrapped or FSDP-sharded model where memopt needs the plain one, or a model sharded while a plan is applied.

    The order that works: profile and plan the plain model, wrap or shard it, then apply the plan to the wrapped model
    (see :mod:`memopt_nb.runtime.distributed`). It is a :class:`PlanError` and a :class:`ProfileError`, so either
    ``except`` catches it.
    """
