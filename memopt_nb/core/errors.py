"""Exceptions a user can act on.

Every error memopt_nb raises for a user's mistake is a subclass of :class:`MemoptError` (itself a ``ValueError``), and
its message says what was wrong and what would work. Notebook magics turn these into ``UsageError``.
"""

from __future__ import annotations


class MemoptError(ValueError):
    """Base class of every user-facing memopt_nb error."""


class BudgetError(MemoptError):
    """A memory budget that cannot be parsed, or that no plan can meet."""


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
