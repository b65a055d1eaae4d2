"""Which modules are units: the containers' children by default, or the largest blocks split into their children
(``units="fine"``), or the names a user gives."""

from __future__ import annotations

import difflib
from typing import Any

import torch.nn as nn

from ..core.errors import ProfileError

__all__ = ["FINE_MAX_CHILD", "FINE_MAX_UNITS", "FINE_MIN_COVER", "select_units"]


def _container_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of ModuleList/Sequential containers, outermost first, expanding nested containers."""
    out: list[tuple[str, nn.Module]] = []
    # module-level recursion: a nested function that calls itself is a reference cycle, which would keep the model
    # (and its device memory) alive after the caller drops it, until Python's gc ran
    _visit_containers(model, {m: n for n, m in model.named_modules()}, out)
    return out


def _is_container(m: nn.Module) -> bool:
    # a list of blocks, not a short sequence of plain layers (conv, norm, activation)
    return (isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2
            and any(len(list(c.children())) > 0 for c in m.children()))


def _visit_containers(m: nn.Module, names: dict[nn.Module, str], out: list[tuple[str, nn.Module]]) -> None:
    if _is_container(m):
        for child in m.children():
            if _is_container(child):
                _visit_containers(child, names, out)
            else:
                out.append((names[child], child))
        return
    for child in m.children():
        _visit_containers(child, names, out)


def select_units(model: nn.Module, units: Any, info: dict[str, dict[str, Any]],
                 split: dict[str, str] | None = None,
                 why: dict[str, str] | None = None) -> tuple[list[str], list[dict]]:
    """Pick unit names; returns (names in forward order, excluded with reasons). For ``units="fine"``, ``split``
    receives each module split into its children -> its class name, and ``why`` each block's reason to be split or
    kept whole."""
    all_names = [n for n, _ in model.named_modules() if n]
    if units == "fine":
        blocks, excluded = select_units(model, "auto", info)
        return _split_largest(model, blocks, info, split if split is not None else {},
                              why if why is not None else {}), excluded
    if isinstance(units, str) and units != "auto":
        units = [units]
    if units == "auto":
        candidates = [n for n, _ in _container_children(model)]
        usable = [n for n in candidates if info[n]["calls"] == 1 and info[n]["backward"]]
        if len(usable) < 2 or len(usable) > 64:
            best = None
            for depth in range(1, 6):
                names = [n for n in all_names if n.count(".") == depth - 1]
                ok = [n for n in names if info[n]["calls"] == 1 and info[n]["backward"]]
                cover = sum(info[n]["saved"] for n in ok)
                score = (4 <= len(ok) <= 64, cover, -abs(len(ok) - 16))
                if ok and (best is None or score > best[0]):
                    best = (score, names)
            if best is not None and (len(usable) < 2 or best[0][0]):
                candidates = best[1]
    elif isinstance(units, int) and not isinstance(units, bool):
        if units < 1:
            raise ProfileError(f"units as a depth must be >= 1, got {units}")
        candidates = [n for n in all_names if n.count(".") == units - 1]
        if not candidates:
            raise ProfileError(f"the model has no modules at depth {units}")
    elif isinstance(units, (list, tuple)):
        candidates = []
        for n in units:
            if not isinstance(n, str):
                raise ProfileError(f"unit names must be strings, got {n!r}")
            if n not in info:
                close = difflib.get_close_matches(n, all_names, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise ProfileError(f"the model has no module named {n!r}{hint}")
            candidates.append(n)
        for i, a in enumerate(candidates):
            for b in candidates[i + 1:]:
                if b.startswith(a + ".") or a.startswith(b + ".") or a == b:
                    raise ProfileError(f"units {a!r} and {b!r} overlap; give modules that do not contain each other")
    else:
        raise ProfileError(f"units must be 'auto', 'fine', an int depth or a list of module names, got {units!r}")
    chosen, excluded = [], []
    for n in candidates:
        calls = info[n]["calls"]
        if calls == 0:
            excluded.append({"name": n, "reason": "not called in forward"})
        elif calls > 1:
            excluded.append({"name": n, "reason": f"called {calls} times per forward"})
        elif not info[n]["backward"]:
            excluded.append({"name": n, "reason": "its output needs no gradient"})
        else:
            chosen.append(n)
    chosen.sort(key=lambda n: info[n]["order"])
    if not chosen:
        raise ProfileError("no usable units: " + "; ".join(f"{e['name']} ({e['reason']})" for e in excluded)
                           if excluded else "the model has no module to plan on; pass units=[...]")
    return chosen, excluded


#: ``units="fine"``: at most this many units (``None``: as many as the model has), a split only when its children cover
#: this share of the parent's saved bytes (what they leave is saved by the parent's own code between them, which no plan
#: then manages) and its largest child saves at most this share of the parent (else the split does not lower the
#: working set that bounds the floor).
FINE_MAX_UNITS: int | None = None
FINE_MIN_COVER = 0.98
FINE_MAX_CHILD = 0.8


def _is_noop(module: nn.Module, info: dict[str, Any]) -> bool:
    """A child that saves nothing for backward and holds no parameters (``Identity``, dropout with ``p=0``, a
    parameter-free reshape): as a unit it would give a plan nothing to decide, so it stays in the code between units."""
    return info["saved"] == 0 and next(module.parameters(), None) is None


def _why_not(saved: int, usable: list[str], info: dict[str, dict[str, Any]], n_units: int) -> str | None:
    """Why the unit that saves ``saved`` bytes is not split into ``usable`` (``None``: it is split)."""
    if saved == 0:
        return "saves nothing for backward"
    if not usable:
        return "no child runs once per forward with a gradient and saves or holds anything"
    cover = sum(info[k]["saved"] for k in usable)
    if cover < FINE_MIN_COVER * saved:
        return (f"its children save {cover / saved:.0%} of its saved bytes; the rest is its own code between them, "
                "which no plan would manage")
    largest = max(info[k]["saved"] for k in usable)
    if largest > FINE_MAX_CHILD * saved:
        return f"its largest child saves {largest / saved:.0%} of it: splitting would hardly lower the floor"
    if FINE_MAX_UNITS is not None and n_units - 1 + len(usable) > FINE_MAX_UNITS:
        return f"splitting it would pass FINE_MAX_UNITS ({FINE_MAX_UNITS})"
    return None


def _split_largest(model: nn.Module, units: list[str], info: dict[str, dict[str, Any]],
                   split: dict[str, str], why: dict[str, str]) -> list[str]:
    """``units="fine"``: repeatedly replace the unit that saves the most bytes by its children, while it can be split.

    The floor of a plan (see :mod:`memopt_nb.planners.floor`) is bounded by the working set of the largest unit: its
    saved bytes come back, or are recomputed, all at once. Splitting it into its direct submodules lowers that, and
    gives the planner finer choices (recompute a layer norm, keep a matmul's output). A unit is split when every one of
    its direct children that runs once with gradient becomes a unit, those children together save at least
    ``FINE_MIN_COVER`` of its saved bytes, the largest saves at most ``FINE_MAX_CHILD`` of them (and the total stays
    within ``FINE_MAX_UNITS`` where one is set). Children that save nothing and hold no parameters (:func:`_is_noop`)
    are not units. Splitting stops at the first largest unit that cannot be split: splitting a smaller one would not
    lower the floor. Units never nest; the result may mix depths (a block kept whole next to split ones). ``why``
    receives, for every block of the result and every module split, the reason it was split or kept whole.
    """
    modules = dict(model.named_modules())
    units = list(units)
    while True:
        largest = max(units, key=lambda n: info[n]["saved"])
        saved = info[largest]["saved"]
        kids = [f"{largest}.{c}" for c, _ in modules[largest].named_children()]
        usable = [k for k in kids if info[k]["calls"] == 1 and info[k]["backward"]
                  and not _is_noop(modules[k], info[k])]
        reason = _why_not(saved, usable, info, len(units))
        if reason is not None:
            why[largest] = "kept whole: " + reason
            break
        at = units.index(largest)
        units[at:at + 1] = sorted(usable, key=lambda n: info[n]["order"])
        split[largest] = type(modules[largest]).__name__
        dropped = len(kids) - len(usable)
        why[largest] = f"split into {len(usable)} units" + (
            f" ({dropped} children that save and hold nothing, or do not run once with a gradient, left out)"
            if dropped else "")
    for u in units:
        if u not in why and not any(u.startswith(s + ".") for s in split):
            why[u] = f"kept whole: {largest!r}, which saves more, cannot be split, so splitting this would not lower " \
                     "the floor"
    return units
