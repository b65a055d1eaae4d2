"""The hooks a plan registers on the user's model, which copies of the model leave behind.

``copy.deepcopy(model)`` inside ``with memopt.plan(p):`` (``torch.optim.swa_utils.AveragedModel``, an EMA, a "best
model" snapshot) copies each module's hook dictionaries. A plain function would come along as it is, still bound to
the plan of the original model; a bound method would drag the plan's runtime, threads included, into the copy (and
fail to copy). Registered through :func:`uncopied`, a hook becomes an inert no-op in copies and pickles, so the copy is
an ordinary model (:class:`~memopt_nb.runtime.apply.PlannedForward` does the same for wrapped forwards).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["uncopied"]


def _inert(*args: Any, **kwargs: Any) -> None:
    """What a plan's hook is in a copy of the model: nothing."""
    return None


def _inert_hook() -> Callable[..., None]:
    return _inert


class _Uncopied:
    # no __slots__: torch marks state-dict hooks with attributes (``_from_public_api``)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _inert_hook, ()

    def __repr__(self) -> str:
        return f"<memopt plan hook {getattr(self.fn, '__qualname__', self.fn)!r}>"


def uncopied(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a hook that copies and pickles of the module it is registered on do not carry (an inert no-op)."""
    return _Uncopied(fn)
