"""What a plan records of the model and optimizer it was made for, and how another one differs, in words.

A plan is applied only to what it was made for: per unit its name, module type (the plain one under FSDP2) and parameter
shapes (:func:`unit_fingerprint`); for the whole model a hash of its module tree with one per direct child and the
children of every module holding a unit (:func:`model_fingerprint`, so that a plan for 4 blocks is refused by a model
with 6); for a plan that moves optimizer state, the optimizer's class, hyper-parameters and parameter shapes per group
(:func:`optimizer_fingerprint`). The ``*_differences`` functions say what differs, and the ``_check_*`` ones refuse a
corrupt fingerprint read from JSON; :func:`check_plan_target` refuses a model or profile the plan was not made for.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import PlanError

__all__ = ["check_plan_target", "model_fingerprint", "optimizer_differences", "optimizer_fingerprint",
           "plain_module_type", "unit_fingerprint"]


def _fingerprint_matches(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.get("type") == b.get("type") and [list(s) for s in a.get("param_shapes", [])] == [
        list(s) for s in b.get("param_shapes", [])
    ]


def plain_module_type(module: Any) -> type:
    """The module's own class: FSDP2's ``fully_shard`` swaps it for a dynamic ``FSDP<Class>(FSDPModule, Class)``."""
    cls = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")  # nothing can be sharded unless something imported it
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        for base in cls.__mro__[1:]:
            if not issubclass(base, fsdp.FSDPModule):
                return base
    return cls


def unit_fingerprint(name: str, module: Any) -> dict[str, Any]:
    """What identifies a unit across runs: its name, module type (the plain one under FSDP2) and parameter shapes."""
    return {
        "name": name,
        "type": plain_module_type(module).__name__,
        "param_shapes": [list(p.shape) for p in module.parameters()],
    }


def _tree_rows(module: Any, prefix: str = "") -> list[list[Any]]:
    """Every module under ``module`` (itself included): qualified name, plain type and own parameters' shapes."""
    rows = []
    for name, m in module.named_modules():
        full = f"{prefix}.{name}" if prefix and name else (prefix or name)
        rows.append([full, plain_module_type(m).__name__,
                     [list(p.shape) for _, p in m.named_parameters(recurse=False)]])
    return rows


def _digest(rows: Any) -> str:
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()[:16]


def model_fingerprint(model: Any, unit_names: Sequence[str]) -> dict[str, Any]:
    """What identifies a whole model, for a plan made for some of its units.

    ``class`` (the model's type), ``modules`` and ``parameters`` (counts), ``tree`` (a hash of every module's name,
    type and own parameter shapes), ``parts`` (the same hash per direct child of the model, to name what differs) and
    ``containers`` (for each module holding a unit, the names of all its children: the candidate units, so that a plan
    for 4 blocks is refused by a model with 6).
    """
    rows = _tree_rows(model)
    modules = dict(model.named_modules())
    containers: dict[str, list[str]] = {}
    for name in unit_names:
        parent = name.rpartition(".")[0]
        if parent not in containers and parent in modules:
            containers[parent] = [n for n, _ in modules[parent].named_children()]
    return {
        "class": plain_module_type(model).__name__,
        "modules": len(rows),
        "parameters": int(sum(p.numel() for p in model.parameters())),
        "tree": _digest(rows),
        "parts": {name: _digest(_tree_rows(child, name)) for name, child in model.named_children()},
        "containers": containers,
    }


def _fingerprint_mismatch(names: Sequence[str], recorded: Sequence[Any]) -> str:
    """Why a plan's decisions and its recorded unit fingerprints disagree, naming the first unit that differs (a plan
    file edited by hand or corrupted): the user must know which unit to fix or that the file is not to be trusted."""
    if len(names) != len(recorded):
        return (f"corrupt plan: {len(names)} unit decisions but {len(recorded)} unit fingerprints (decisions: "
                f"{', '.join(map(repr, names[:6]))}{' …' if len(names) > 6 else ''}); save the plan again from its "
                "source, or profile the model and plan again")
    i = next(i for i, (a, b) in enumerate(zip(names, recorded, strict=True)) if a != b)
    return (f"corrupt plan: unit {i} is {names[i]!r} in the decisions but {recorded[i]!r} in the fingerprint the plan "
            "recorded for it (was the file edited?); make both name the same module of the model, or profile the "
            "model and plan again")


def optimizer_fingerprint(optimizer: Any) -> dict[str, Any]:
    """What identifies an optimizer for a plan that moves its state: class, and per parameter group its
    hyper-parameters (numbers, bools and strings only) and parameter shapes."""
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in sorted(g.items()) if k != "params" and isinstance(v, (bool, int, float, str))}
        hyper.update({k: list(v) for k, v in sorted(g.items())
                      if isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v)})
        groups.append({"hyper": hyper, "param_shapes": [list(p.shape) for p in g["params"]]})
    return {"class": type(optimizer).__name__, "groups": groups}


def _layout_value(v: Any) -> Any:
    """What of a hyper-parameter can change the optimizer's state or code path: flags and names, and whether a number
    is zero (SGD keeps a momentum buffer only when ``momentum != 0``); a scheduler may change the numbers themselves."""
    if isinstance(v, bool) or isinstance(v, str) or v is None:
        return v
    if isinstance(v, (int, float)):
        return v == 0
    if isinstance(v, list):
        return [_layout_value(x) for x in v]
    return v


def _added_number(a: Mapping[str, Any], b: Mapping[str, Any], key: str) -> bool:
    """Whether ``key`` is in one group's hyper-parameters only, holding a number: what an LR scheduler adds to every
    group it drives (``initial_lr``; ``max_lr`` / ``min_lr`` for the cyclic ones), made before or after profiling.
    A number changes neither the state an optimizer keeps nor its code path (flags and names do)."""
    if (key in a) == (key in b):
        return False
    v = a[key] if key in a else b[key]
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def optimizer_differences(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    """What differs between the optimizer a plan was made for (``want``) and this one (``have``), in words.

    Learning rates and other numbers a scheduler may change are not compared, only whether they are zero; a number
    only one side has (``initial_lr``, which a scheduler adds) is not a difference."""
    if want.get("class") != have.get("class"):
        return [f"the plan was made for {want.get('class')}; this optimizer is {have.get('class')}"]
    wg, hg = want.get("groups", []), have.get("groups", [])
    if len(wg) != len(hg):
        return [f"the plan was made for an optimizer with {len(wg)} parameter group(s); this one has {len(hg)}"]
    out = []
    for i, (a, b) in enumerate(zip(wg, hg, strict=True)):
        if a.get("param_shapes") != b.get("param_shapes"):
            out.append(f"parameter group {i} holds other parameters ({len(a.get('param_shapes', []))} in the plan, "
                       f"{len(b.get('param_shapes', []))} here, or other shapes)")
        ha, hb = a.get("hyper", {}), b.get("hyper", {})
        diff = sorted(k for k in set(ha) | set(hb) if _layout_value(ha.get(k)) != _layout_value(hb.get(k))
                      and not _added_number(ha, hb, k))
        if diff:
            out.append(f"parameter group {i}: " + ", ".join(f"{k} {ha.get(k)!r} in the plan, {hb.get(k)!r} here"
                                                            for k in diff[:4]))
    return out


def _children_text(parent: str, children: Sequence[str]) -> str:
    prefix = f"{parent}." if parent else ""
    if children and all(c.isdigit() for c in children) and [int(c) for c in children] == list(range(len(children))):
        return f"{prefix}0–{len(children) - 1}" if len(children) > 1 else f"{prefix}0"
    shown = ", ".join(prefix + c for c in children[:4])
    return shown + (", …" if len(children) > 4 else "")


def _model_differences(want: Mapping[str, Any], have: Mapping[str, Any]) -> list[str]:
    """What differs between the model a plan was made for (``want``) and this one (``have``), in words."""
    if want.get("tree") == have.get("tree"):
        return []
    out = []
    if want.get("class") != have.get("class"):
        out.append(f"the plan was made for a {want.get('class')}; this model is a {have.get('class')}")
    for parent, children in want.get("containers", {}).items():
        got = have.get("containers", {}).get(parent)
        where = f"`{parent}`" if parent else "the model itself"
        if got is None:
            out.append(f"the plan was made for a model whose {where} holds its units; this model has no {where}")
        elif list(got) != list(children):
            out.append(f"the plan was made for a model with {len(children)} blocks in {where} "
                       f"({_children_text(parent, children)}); this model has {len(got)} "
                       f"({_children_text(parent, got)})")
    if not out:
        wp, hp = want.get("parts", {}), have.get("parts", {})
        differ = [n for n in wp if wp[n] != hp.get(n)] + [n for n in hp if n not in wp]
        out.append(
            "the model's module tree differs from the one the plan was made for"
            + (f", in {', '.join(f'`{n}`' for n in differ)}" if differ else "")
            + f" (module types or parameter shapes; plan: {want.get('modules')} modules, {want.get('parameters'):,} "
            f"parameters; this model: {have.get('modules')} modules, {have.get('parameters'):,} parameters)"
        )
    return out


def _check_model_fingerprint(data: Any) -> dict[str, Any] | None:
    """``data`` as a model fingerprint read from JSON, or :class:`PlanError` naming the field that is wrong."""
    if data is None:
        return None
    problem = None
    if not isinstance(data, dict):
        problem = f"it is {type(data).__name__}, not an object"
    else:
        for key, kind in (("class", str), ("tree", str), ("modules", int), ("parameters", int), ("parts", dict),
                          ("containers", dict)):
            if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
                problem = f"{key!r} is {data.get(key)!r}, not {'an' if kind is int else 'a'} {kind.__name__}"
                break
        else:
            if not all(isinstance(v, str) for v in data["parts"].values()):
                problem = "'parts' must map names to hashes"
            elif not all(isinstance(v, list) and all(isinstance(c, str) for c in v)
                         for v in data["containers"].values()):
                problem = "'containers' must map names to lists of child names"
    if problem:
        raise PlanError(f"corrupt plan: model_fingerprint: {problem}; re-create the plan from a profile (or delete "
                        "the model_fingerprint entry to check only the units)")
    return dict(data)


def _check_unit_fingerprint(entries: Any) -> tuple[dict[str, Any], ...]:
    """The per-unit fingerprint read from JSON, or :class:`PlanError` naming the entry that is wrong."""
    if entries is None:
        return ()
    if not isinstance(entries, list):
        raise PlanError(f"corrupt plan: fingerprint must be a list of units, got {type(entries).__name__}")
    for i, f in enumerate(entries):
        ok = (isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("type"), str)
              and isinstance(f.get("param_shapes"), list)
              and all(isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                       for n in shape) for shape in f["param_shapes"]))
        if not ok:
            raise PlanError(f"corrupt plan: fingerprint entry {i} must be {{\"name\": str, \"type\": str, "
                            f"\"param_shapes\": [[int, ...], ...]}}, got {f!r}"[:400])
    return tuple(entries)


def check_plan_target(plan: Any, target: Any) -> None:
    """Raise :class:`PlanError` unless ``plan`` was made for ``target`` (an ``nn.Module`` or a ModelProfile): what
    :meth:`Plan.validate <memopt_nb.core.plan.Plan.validate>` checks."""
    import torch.nn as nn

    if isinstance(target, nn.Module):
        modules = dict(target.named_modules())
        problems = []
        if plan.model_fingerprint:
            problems += _model_differences(plan.model_fingerprint, model_fingerprint(target, plan.units))
        for i, d in enumerate(plan.decisions):
            mod = modules.get(d.unit)
            if mod is None:
                problems.append(f"unit {d.unit!r}: no such module")
                continue
            if plan.fingerprint:
                want = plan.fingerprint[i]
                have = unit_fingerprint(d.unit, mod)
                if not _fingerprint_matches(want, have):
                    problems.append(
                        f"unit {d.unit!r}: plan {want['type']} {want['param_shapes']}, "
                        f"model {have['type']} {have['param_shapes']}"
                    )
        if problems:
            raise PlanError("this plan was made for another model: " + "; ".join(problems)
                            + ". Profile this model and make a plan for it")
        return
    fp = getattr(target, "fingerprint", None)
    if fp is None:
        raise PlanError(f"can validate a plan against an nn.Module or a ModelProfile, not {type(target).__name__}")
    have = {f["name"]: f for f in fp}
    problems = []
    for i, d in enumerate(plan.decisions):
        if d.unit not in have:
            problems.append(f"unit {d.unit!r}: not a unit of the profile")
        elif plan.fingerprint and not _fingerprint_matches(plan.fingerprint[i], have[d.unit]):
            problems.append(f"unit {d.unit!r}: module type or parameter shapes differ")
    if [f["name"] for f in fp] != plan.units and not problems:
        problems.append(f"unit order differs (profile: {[f['name'] for f in fp]}, plan: {plan.units})")
    have_model = (getattr(target, "meta", None) or {}).get("model_fingerprint")
    if plan.model_fingerprint and have_model:
        problems = _model_differences(plan.model_fingerprint, have_model) + problems
    if problems:
        raise PlanError("this plan was made for another model: " + "; ".join(problems))
