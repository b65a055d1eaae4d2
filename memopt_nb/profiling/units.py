"""Which modules are units: the containers' children by default, or the largest blocks split into their children
(``units="fine"``), or the names a user gives."""

from __future__ import annotations

import difflib
from typing import Any

import torch
import torch.nn as nn

from ..core.errors import ProfileError

__all__ = ["unusable", "FINE_MAX_CHILD", "FINE_MAX_UNITS", "FINE_MIN_COVER", "STATE_MAX_SHARE", "STATE_UNEVEN",
           "module_state_bytes", "select_units"]


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


def unusable(d: dict[str, Any]) -> str | None:
    """Why a module (its ``discover`` record) cannot be a unit, or ``None``."""
    if d["calls"] == 0:
        return "not called in forward"
    if d["calls"] > 1:
        return f"called {d['calls']} times per forward"
    if not d["backward"]:
        return "its output needs no gradient"
    if d.get("inplace"):
        return "changes its input in place (a recompute would need the input as it was)"
    if d.get("input_changed"):
        return "its input is changed in place after it runs (a recompute would need the input as it was)"
    return None


def select_units(model: nn.Module, units: Any, info: dict[str, dict[str, Any]],
                 split: dict[str, str] | None = None,
                 why: dict[str, str] | None = None,
                 state: dict[str, int] | None = None) -> tuple[list[str], list[dict]]:
    """Pick unit names; returns (names in forward order, excluded with reasons). For ``units="fine"``, ``split``
    receives each module split into its children -> its class name, and ``why`` each block's reason to be split or
    kept whole. ``state``: per module name, the bytes of its trainable parameters with their gradients and
    optimizer state; with it, ``"auto"`` and ``"fine"`` also split a unit whose state bounds a whole-step plan
    (:func:`_split_by_state`)."""
    all_names = [n for n, _ in model.named_modules() if n]
    split = split if split is not None else {}
    why = why if why is not None else {}
    if units in ("auto", "fine"):
        chosen, excluded = _select(model, "auto", info, all_names)
        if units == "fine":
            chosen = _split_largest(model, chosen, info, split, why)
        if state is not None:
            chosen = _split_by_state(model, chosen, info, state, split, why)
        return chosen, excluded
    return _select(model, units, info, all_names)


def _select(model: nn.Module, units: Any, info: dict[str, dict[str, Any]],
            all_names: list[str]) -> tuple[list[str], list[dict]]:
    if isinstance(units, str) and units != "auto":
        units = [units]
    if units == "auto":
        candidates = [n for n, _ in _container_children(model)]
        usable = [n for n in candidates if unusable(info[n]) is None]
        if len(usable) < 2 or len(usable) > 64:
            best = None
            for depth in range(1, 6):
                names = [n for n in all_names if n.count(".") == depth - 1]
                ok = [n for n in names if unusable(info[n]) is None]
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
        reason = unusable(info[n])
        if reason is None:
            chosen.append(n)
        else:
            excluded.append({"name": n, "reason": reason})
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
        usable = [k for k in kids if unusable(info[k]) is None and not _is_noop(modules[k], info[k])]
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


#: A unit whose state (trainable parameters, their gradients and optimizer state) is more than this share of the
#: model's, more than ``STATE_UNEVEN`` times the units' mean and more than any unit saves for backward, is split into
#: its children (``"auto"`` and ``"fine"``).
STATE_MAX_SHARE = 1 / 8
STATE_UNEVEN = 2.0


def _state_children(modules: dict[str, nn.Module], name: str) -> list[str]:
    """The direct children of ``name``, a list or dict of modules replaced by its members (at any depth)."""
    out = []
    for c, m in modules[name].named_children():
        k = f"{name}.{c}"
        if isinstance(m, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            out.extend(_state_children(modules, k))
        else:
            out.append(k)
    return out


def _split_by_state(model: nn.Module, units: list[str], info: dict[str, dict[str, Any]], state: dict[str, int],
                    split: dict[str, str], why: dict[str, str]) -> list[str]:
    """Split the unit with the most state into its children while that state bounds a whole-step plan.

    A whole-step plan moves a unit's parameters, gradients and optimizer state as one piece, and the optimizer step
    needs all of one unit's on the device at once: a unit that holds much of the model's parameters (a timm ResNet's
    last stage, a ConvNeXt's widest stage) sets the floor however the rest is placed — the size-based wrap policy
    FSDP uses for the same reason. The largest unit by state is split while it holds more than ``STATE_MAX_SHARE`` of
    the model's state, more than ``STATE_UNEVEN`` times an average unit's (blocks of one size, as a transformer's,
    stay whole: each then holds only its share) and more than the most any unit saves for backward (below that,
    splitting it would not lower the floor), and its children (lists of modules expanded) hold at least
    ``FINE_MIN_COVER`` of its parameters' state, each less than all of it. Children that cannot be units (see
    :func:`unusable`, e.g. an in-place activation) or save and hold nothing stay in the parent's code between units.
    """
    modules = dict(model.named_modules())
    total = state.get("", 0)
    units = list(units)
    while units and total > 0:
        largest = max(units, key=lambda n: state.get(n, 0))
        have = state.get(largest, 0)
        most_saved = max(info[u]["saved"] for u in units)
        mean = sum(state.get(u, 0) for u in units) / len(units)
        if have <= STATE_MAX_SHARE * total or have <= STATE_UNEVEN * mean or have <= most_saved:
            break
        kids = _state_children(modules, largest)
        usable = [k for k in kids if unusable(info[k]) is None and not _is_noop(modules[k], info[k])]
        held = sum(state.get(k, 0) for k in usable)
        reason = None
        if not usable:
            reason = "it has no child that runs once per forward with a gradient and saves or holds anything"
        elif held < FINE_MIN_COVER * have:
            reason = (f"its children hold {held / have:.0%} of its parameters' state; the rest are its own "
                      "parameters, which would stay on the device")
        elif max(state.get(k, 0) for k in usable) >= have:
            reason = "one child holds all of its state: splitting would not lower the floor"
        if reason is not None:
            why[largest] = f"kept whole although it holds {have / total:.0%} of the model's state: {reason}"
            break
        at = units.index(largest)
        units[at:at + 1] = sorted(usable, key=lambda n: info[n]["order"])
        split[largest] = type(modules[largest]).__name__
        saved = info[largest]["saved"]
        left = saved - sum(info[k]["saved"] for k in usable)
        why[largest] = (f"split into {len(usable)} units by state: it held {have / total:.0%} of the model's "
                        "parameters, gradients and optimizer state, which a whole-step plan moves as one piece"
                        + (f" ({left / saved:.0%} of its saved bytes stay with its own code between them)"
                           if saved and left > 0.02 * saved else ""))
    return units


def module_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Per module name (``""``: the model), the bytes of its trainable parameters, their gradients and the state
    ``optimizer`` holds for them (as it is after a step)."""
    per: dict[int, int] = {}
    for p in model.parameters():
        if p.requires_grad and id(p) not in per:
            st = optimizer.state.get(p, {}) if optimizer is not None else {}
            per[id(p)] = 2 * p.nbytes + sum(t.nbytes for t in st.values() if isinstance(t, torch.Tensor))
    return {name: sum(per.get(id(p), 0) for p in m.parameters()) for name, m in model.named_modules()}
