"""The profile as a table in a notebook: per unit time and memory, the hierarchy of split units, the totals, the
smallest peak any plan reaches and, where the device's capacity is known, how big a batch fits it (both from
:mod:`memopt_nb.planners.floor`)."""

from __future__ import annotations

import html

from ..core.budget import format_bytes
from ..core.profile import ModelProfile, UnitProfile
from ..planners.floor import estimate_batch, explain_floor

__all__ = ["PROFILE_LEGEND", "profile_html"]


def _floor_html(prof: ModelProfile, spelling: str = "python") -> str:
    """The smallest peak any plan reaches on the profiled device and what bounds it (:mod:`..planners.floor`), its
    advice spelt for ``"python"`` or the magics (``"magic"``)."""
    try:
        floor = explain_floor(prof, offload_state=True)  # the planners' default space
    except Exception as exc:  # noqa: BLE001 - a display must not fail
        return f"<p>smallest reachable peak: not computed ({html.escape(type(exc).__name__)}: " \
               f"{html.escape(str(exc))})</p>"
    advice = ("<br>To lower it: " + html.escape(floor.advice_text(spelling)) + ".") if floor.advice else ""
    try:  # where the device's capacity is known: how big a batch fits it, estimated
        est = estimate_batch(prof, floor)
    except Exception:  # noqa: BLE001 - a display must not fail
        est = None
    batch = f"<br><b>{html.escape(est.text(spelling))}</b>" if est is not None else ""
    return (f"<p><b>Smallest reachable peak (any plan): {format_bytes(floor.floor_bytes)}</b> = "
            f"{html.escape(floor.breakdown_text())}.<br>{html.escape(floor.bound_text())}{advice}{batch}</p>")


#: A split block's row, where the profile also measured it whole (``ModelProfile.merges``).
_WHOLE = ('; <span title="memopt.search_depths (%memopt_plan --mixed-depths) may plan it as one unit where that is '
          'enough">also measured whole</span>')


def profile_html(prof: ModelProfile, spelling: str = "python") -> str:
    """The profile as HTML (``ModelProfile._repr_html_``): summary, totals with a legend of their terms, the floor
    (advice spelt for ``"python"`` or the magics, ``"magic"``) and the per-unit table."""
    numbered = any(u.name != str(u.index) for u in prof.units)  # nn.Sequential children: the name is the index
    split = prof.meta.get("split") or {}
    parents: list[str] = []
    cells = []
    for depth, name, index in prof.hierarchy():
        parents = parents[:depth]
        label = name[len(parents[-1]) + 1:] if parents else name
        if index is None:
            cells.append(f'<tr><td colspan="{10 if numbered else 9}" style="text-align:left;padding-left:'
                         f'{1.2 * depth:.1f}em"><b>{html.escape(label)}</b> ({html.escape(split.get(name, ""))}, '
                         "split into the units below" + (_WHOLE if name in prof.merges else "") + ")</td></tr>")
            parents.append(name)
        else:
            cells.append(_unit_row(prof.units[index], numbered, depth, label, _time_title(prof, prof.units[index])))
    rows = "".join(cells)
    totals = (f"params {format_bytes(prof.param_bytes)} · optimizer state "
              f"{format_bytes(prof.optimizer_state_bytes)} · not in units {format_bytes(prof.unattributed_bytes)}"
              f" · units cover {prof.coverage:.0%} of saved bytes<br><small>{html.escape(PROFILE_LEGEND)}</small>")
    excluded = ""
    if prof.excluded:
        excluded = "<p>excluded: " + "; ".join(html.escape(f"{e['name']} ({e['reason']})")
                                               for e in prof.excluded) + "</p>"
    head = ("<th>#</th>" if numbered else "") + (
        "<th>unit</th><th>type</th><th>fwd ms</th><th>bwd ms</th>"
        '<th title="activations the unit saves for backward">saved</th>'
        '<th title="saved bytes that recomputing the unit frees (made and used only inside it)">freed by '
        "recompute</th><th>output</th><th>params</th>"
        '<th title="random ops (dropout): recompute replays their random numbers; running stats (BatchNorm): '
        'recompute does not update them twice">notes</th>')
    return (
        f"<div><b>{html.escape(prof.summary())}</b>{_timing_html(prof)}<p>{totals}</p>{_floor_html(prof, spelling)}"
        f"{excluded}<table><thead>"
        f"<tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
    )



def _timing_html(prof: ModelProfile) -> str:
    """How the times were measured and, when the machine was too busy to trust them, the profile's warning
    (``meta["timing"]``, ``meta["time_warning"]``: :mod:`memopt_nb.profiling.timing`); nothing for an older profile."""
    timing = prof.meta.get("timing")
    if not isinstance(timing, dict):
        return ""
    pooled = timing.get("pooled") or []
    clock = "CPU time of the step's thread, " if timing.get("clock") == "cpu" else ""
    how = (f"<p><small>Times: {clock}medians of {timing.get('steps', 0) - timing.get('set_aside', 0)} timed steps "
           f"without stalls; {sum(len(g) for g in pooled)} identical units in {len(pooled)} groups share one time "
           "(hover a time for its spread).</small></p>")
    warning = prof.meta.get("time_warning")
    return how + (f'<p style="color:#a33"><b>&#9888; Busy machine:</b> {html.escape(warning)}</p>' if warning else "")


def _time_title(prof: ModelProfile, u: UnitProfile) -> tuple[str, str]:
    """The tooltips of a unit's forward and backward times: their samples' spread, and the units pooled with it."""
    timing = prof.meta.get("timing")
    spread = (timing.get("units") or {}).get(u.name) if isinstance(timing, dict) else None
    if not spread:
        return "", ""
    group = next((g for g in timing.get("pooled") or [] if u.name in g), None)
    same = f"; the median of {len(group)} identical units' samples" if group else ""
    return tuple(f' title="spread {s:.0%} (interquartile range over median){same}"' for s in spread[:2])


def _unit_row(u: UnitProfile, numbered: bool, depth: int = 0, label: str | None = None,
              titles: tuple[str, str] = ("", "")) -> str:
    pad = f' style="padding-left:{1.2 * depth:.1f}em" title="{html.escape(u.name)}"' if depth else ""
    return (
        "<tr>" + (f"<td>{u.index}</td>" if numbered else "") +
        f"<td{pad}>{html.escape(label if label is not None else u.name)}</td><td>{html.escape(u.type)}</td>"
        f"<td{titles[0]}>{u.fwd_time * 1e3:.2f}</td><td{titles[1]}>{u.bwd_time * 1e3:.2f}</td>"
        f"<td>{format_bytes(u.saved_bytes)}</td>"
        f"<td>{format_bytes(u.interior_bytes)}</td><td>{format_bytes(u.output_bytes)}</td>"
        f"<td>{format_bytes(u.param_bytes)}</td>"
        f"<td>{', '.join(f for f, on in (('random ops', u.has_rng), ('running stats', u.has_running_stats)) if on)}"
        f"{_effects_html(u)}</td></tr>")


#: What the terms of a profile's display mean, shown under its totals.
PROFILE_LEGEND = (
    "not in units: activations saved outside every unit (embeddings, head, loss), which every plan keeps; units cover "
    "N% of saved bytes: the share of the step's saved activations a plan can act on; notes: random ops (dropout: "
    "recompute replays the same random numbers), running stats (BatchNorm: not updated twice), state (the forward "
    "changes module state, which recompute restores)")


def _effects_html(u: UnitProfile) -> str:
    out = ""
    if u.side_effects:
        out += f' <span title="{html.escape(u.side_effects)}">state</span>'
    if not u.recomputable:
        reason = u.not_recomputable_reason or "marked so"
        out += f" <b>not recomputable</b>: {html.escape(reason)}"
    return out
