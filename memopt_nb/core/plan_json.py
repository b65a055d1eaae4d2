"""A plan as versioned JSON: the dictionary :meth:`Plan.to_dict <memopt_nb.core.plan.Plan.to_dict>` writes, and the
checks :meth:`Plan.from_dict <memopt_nb.core.plan.Plan.from_dict>` and :meth:`Plan.load
<memopt_nb.core.plan.Plan.load>` run on what they read: every field is checked, so a plan that loads also displays and
applies, and each refusal says what was wrong."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import PlanError
from .fingerprint import _check_model_fingerprint, _check_unit_fingerprint

__all__ = ["FORMAT", "SCHEMA_VERSION", "checked_fields", "parse_plan_json", "plan_dict", "read_plan_file"]

SCHEMA_VERSION = 2
FORMAT = "memopt_nb.plan"


def _check_field(data: Mapping[str, Any], key: str, ok: Callable[[Any], bool], want: str) -> Any:
    value = data.get(key)
    if value is not None and not ok(value):
        raise PlanError(f"corrupt plan: {key} must be {want} or null, got {value!r}"[:300])
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def plan_dict(plan: Any) -> dict[str, Any]:
    """``plan`` as the JSON-ready dictionary of the current schema (``meta`` made JSON-safe: NaN becomes null)."""
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "method": plan.method,
        "seed": plan.seed,
        "budget_bytes": plan.budget_bytes,
        "device": plan.device,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_step_time": plan.predicted_step_time,
        "feasible": plan.feasible,
        "decisions": [d.to_dict() for d in plan.decisions],
        "fingerprint": [dict(f) for f in plan.fingerprint],
        "model_fingerprint": plan.model_fingerprint,
        "step_in_backward": plan.step_in_backward,
        "optimizer_fingerprint": plan.optimizer_fingerprint,
        "head": plan.head,
        "meta": _jsonable(plan.meta),
    }


def checked_fields(data: Any) -> dict[str, Any]:
    """The plan's fields read from ``data`` (a dictionary from JSON), each checked: the ``Plan`` keyword arguments,
    with ``decisions`` still a list of dictionaries. Raises :class:`PlanError` saying what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError("not a memopt_nb plan (missing \"format\": \"memopt_nb.plan\")")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise PlanError("corrupt plan: schema_version is missing or not an int")
    if version > SCHEMA_VERSION:
        raise PlanError(
            f"this plan was written by a newer memopt_nb (schema {version}); this version reads schema "
            f"{SCHEMA_VERSION} — upgrade memopt_nb to load it"
        )
    if not isinstance(data.get("decisions"), list) or not all(isinstance(d, dict) for d in data["decisions"]):
        raise PlanError("corrupt plan: decisions must be a list of {\"unit\": ..., \"strategy\": ...} objects")
    number = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)  # noqa: E731
    fields = {
        "budget_bytes": _check_field(data, "budget_bytes", lambda v: _is_int(v) and v > 0,
                                     "a positive int of bytes"),
        "device": _check_field(data, "device", lambda v: isinstance(v, dict), "an object"),
        "method": _check_field(data, "method", lambda v: isinstance(v, str), "a string") or "manual",
        "seed": _check_field(data, "seed", _is_int, "an int"),
        "predicted_peak_bytes": _check_field(data, "predicted_peak_bytes", lambda v: _is_int(v) and v >= 0,
                                             "an int of bytes"),
        "predicted_step_time": _check_field(data, "predicted_step_time", number, "a number of seconds"),
        "feasible": _check_field(data, "feasible", lambda v: isinstance(v, bool), "true or false"),
        "meta": _check_field(data, "meta", lambda v: isinstance(v, dict), "an object") or {},
        "step_in_backward": _check_field(data, "step_in_backward", lambda v: isinstance(v, bool),
                                         "true or false") or False,
        "optimizer_fingerprint": _check_field(data, "optimizer_fingerprint", lambda v: isinstance(v, dict),
                                              "an object"),
        "head": _check_field(data, "head", lambda v: isinstance(v, dict), "an object"),
    }
    fields["fingerprint"] = _check_unit_fingerprint(data.get("fingerprint"))
    fields["model_fingerprint"] = _check_model_fingerprint(data.get("model_fingerprint"))
    return {**fields, "meta": dict(fields["meta"]), "decisions": data["decisions"]}


def parse_plan_json(text: str) -> Any:
    """``json.loads(text)``; :class:`PlanError` saying where when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"corrupt plan file: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def read_plan_file(path: str | Path) -> str:
    """The text of the plan file at ``path``; :class:`PlanError` for a path that is missing or a directory, or a
    file that cannot be read or is not UTF-8."""
    path = Path(path)
    if not path.exists():
        raise PlanError(f"no plan file at {path}")
    if path.is_dir():
        raise PlanError(f"{path} is a directory; give the path of a plan's JSON file (written by plan.save(path))")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"{path} is not a memopt_nb plan: not UTF-8 text (byte {exc.start}); a plan is the JSON "
                        "file written by plan.save(path)") from None
    except OSError as exc:
        raise PlanError(f"cannot read the plan file {path}: {exc.strerror or exc}") from None
