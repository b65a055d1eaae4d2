"""What the search dashboard says, in words: the live top line, the text lines printed outside a notebook, the
agents' section and the final summary, each formatted from the search's history rows or the returned plan (so that the
widget, the static output and the text mode say the same)."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable
from typing import Any

from ..core.budget import format_bytes

__all__ = ["AGENTS_TITLE", "STOP_HINT", "agents_html", "final_text", "img_html", "stats_html", "text_line",
           "top_line"]


def _fmt_ms(seconds: float | None) -> str:
    return "–" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.2f} ms"


def _fmt_num(x: Any) -> str:
    return "–" if x is None or not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:+.3g}"


def _fmt_bytes(x: Any) -> str:
    return "–" if x is None or not math.isfinite(float(x)) else format_bytes(x)


def _png_width(png: bytes) -> int:
    """The pixel width in a PNG's header."""
    return int.from_bytes(png[16:20], "big") if png[:8] == b"\x89PNG\r\n\x1a\n" else 0


def _pct(t: Any, base: Any) -> str:
    """``+7.0%``: how much slower a step of ``t`` seconds is than ``base``."""
    if not t or not base or not math.isfinite(t) or not math.isfinite(base):
        return "–"
    return f"{(t / base - 1) * 100:+.1f}%"


#: Under the top line while the search runs: how to stop it (Jupyter's ■ interrupts the kernel).
STOP_HINT = "■ stops the search and keeps the best plan so far"
#: Title of the collapsed section with the agents' curves.
AGENTS_TITLE = "how the agents learn"


def _fmt_clock(seconds: float | None) -> str:
    """``mm:ss`` (or ``h:mm:ss``), as tqdm shows elapsed time and time left."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60:02d}:{rest % 60:02d}"


def _rate_text(step: int, total: int | None, seconds: float, finished: bool = False) -> str:
    """tqdm's ``1,200/4,000 [00:07<00:16, 171 steps/s]``: done, elapsed < time left, rate."""
    rate = step / seconds if seconds > 0 and step > 0 else None
    left = None if finished or rate is None or not total else max(total - step, 0) / rate
    done = f"{step:,}" + (f"/{total:,}" if total and not finished else "")
    rate_s = f"{rate:,.0f} steps/s" if rate is not None else "? steps/s"
    tail = f"{_fmt_clock(seconds)}" + ("" if finished else f"<{_fmt_clock(left)}")
    return f"{done} timesteps [{tail}, {rate_s}]"


def top_line(r: dict[str, Any], total: int | None) -> str:
    """The live top line in the user's terms: the best plan so far's peak against the budget, its slowdown
    against no plan, the time elapsed and left."""
    step, seconds = int(r.get("global_step", 0)), float(r.get("seconds", 0.0))
    rate = step / seconds if seconds > 0 and step > 0 else None
    left = f", about {_fmt_clock(max(total - step, 0) / rate)} left" if rate and total else ""
    clock = f"{_fmt_clock(seconds)} elapsed{left}"
    budget, base_peak = _fmt_bytes(r.get("budget")), _fmt_bytes(r.get("base_peak"))
    if r.get("best_peak") is None or not math.isfinite(float(r["best_peak"])):
        return (f"no plan within the budget {budget} yet (no plan: {base_peak}) · {clock}")
    best_t, base_t = r.get("best_step_time"), r.get("base_step_time")
    return (f"best plan so far: predicted peak <b>{_fmt_bytes(r.get('best_peak'))}</b> / budget {budget} "
            f"(no plan: {base_peak}) · step <b>{_pct(best_t, base_t)}</b> vs no plan ({_fmt_ms(best_t)} vs "
            f"{_fmt_ms(base_t)}) · {clock}")


def stats_html(heading: str, row: dict[str, Any] | None, total: int | None, final: str | None = None) -> str:
    """The dashboard's top: its heading, then the final summary (``final``, once the search ended), or the live top
    line of the latest ``row`` and how to stop the search, or that it waits for the first PPO iteration."""
    head = f"<b>{html.escape(heading)}</b><br>"
    if final is not None:
        return head + "<br>".join(html.escape(t) for t in final.split("\n"))
    if row is None:
        return head + "<span>waiting for the first PPO iteration…</span>"
    return head + top_line(row, total) + f"<br><small>{html.escape(STOP_HINT)}</small>"


def agents_html(history: list[dict[str, Any]]) -> str:
    """The collapsed section's text: the agents' own figures, in the terms of reinforcement learning."""
    if not history:
        return ""
    r = history[-1]
    return (f"PPO iteration <b>{r['iteration']}</b>: average reward per episode (higher is better): strategy agent "
            f"{_fmt_num(r.get('reward_strategy'))}, timing agent {_fmt_num(r.get('reward_timing'))}; episodes "
            f"within the budget {r.get('feasible_fraction', 0):.0%}. The strategy agent decides what each unit "
            "does, the timing agent when its copies to and from the host run.")


def text_line(r: dict[str, Any], total: int | None) -> str:
    """One text line: the best plan so far in the user's terms, progress, then the agents' rewards."""
    return (f"[memopt.search] iter {r['iteration']:>4}  best peak {_fmt_bytes(r.get('best_peak'))} / budget "
            f"{_fmt_bytes(r.get('budget'))}, step {_pct(r.get('best_step_time'), r.get('base_step_time'))} vs no "
            f"plan  {_rate_text(int(r['global_step']), total, float(r['seconds']))}  agents' reward: strategy "
            f"{_fmt_num(r.get('reward_strategy'))}, timing {_fmt_num(r.get('reward_timing'))}")


def final_text(plan: Any, error: BaseException | None = None, *, show_plan: bool = True,
               history: list[dict[str, Any]] | None = None,
               unoptimized_peak: Callable[[], Any] = lambda: None) -> str:
    """The summary: every figure in it comes from the returned plan (or the search's own totals)."""
    if error is not None:
        return f"search failed: {type(error).__name__}: {error}"
    p = plan
    if p is None:
        return "search finished without a plan"
    m = p.meta
    interrupted = bool(m.get("interrupted"))
    base_t = m.get("base_step_time")
    state = "interrupted" if interrupted else "done"
    if show_plan:
        lines = [f"{state}: {p.summary()}"]
        if p.predicted_step_time is not None and base_t:
            lines.append(f"step time {_pct(p.predicted_step_time, base_t)} vs the unoptimized step "
                         f"({_fmt_ms(base_t)})")
    else:  # the plan itself shows under the dashboard: say what it means, not the plan again
        rows = history or m.get("history") or [{}]
        base_peak = m.get("base_peak") or rows[-1].get("base_peak")
        if base_peak is None:
            base_peak = unoptimized_peak()
        lines = [f"{state}: predicted peak {_fmt_bytes(p.predicted_peak_bytes)} / budget "
                 f"{_fmt_bytes(p.budget_bytes)} (no plan: {_fmt_bytes(base_peak)}) · step "
                 f"{_pct(p.predicted_step_time, base_t)} vs no plan ({_fmt_ms(p.predicted_step_time)} vs "
                 f"{_fmt_ms(base_t)})"]
    stopped = m.get("stopped")
    if stopped and stopped != "all timesteps run" and not interrupted:
        lines.append(f"the agents stopped: {stopped} (--patience / --time-limit change when)")
    if m.get("no_feasible_plan"):
        lines.append("NO feasible plan found: this is the least infeasible one; raise the budget or the timesteps")
    polish = m.get("polish")
    agents = m.get("agents_step_time")
    start = m.get("polish_start", "agents")
    from_agents = start == "agents" or start.startswith(("agents_placed", "polished_placed"))
    if m.get("agents_found_no_plan"):
        lines.append(f"no plan of the agents fitted the budget; the one they came closest with was repaired "
                     f"({m.get('repair_moves', 0)} change(s)) and polished: {_fmt_ms(p.predicted_step_time)}")
    elif polish == "ran" and not from_agents:
        origin = ("keep-all with its best state placement" if start.startswith("plain_placed")
                  else f"the {start} baseline's plan")
        lines.append(f"the agents' best plan took {_fmt_ms(agents)}; a local search (polish) found a faster one "
                     f"starting from {origin}: {_fmt_ms(p.predicted_step_time)} after {m.get('polish_moves', 0)} "
                     "change(s)")
    elif polish == "ran" and m.get("polish_moves"):
        lines.append(f"the agents' best plan took {_fmt_ms(agents)}; a local search (polish) then changed "
                     f"{m['polish_moves']} unit decision(s), giving {_fmt_ms(p.predicted_step_time)}")
    elif polish == "ran":
        lines.append("the agents' best plan is returned as found: a local search (polish) could not improve it")
    elif isinstance(polish, str) and polish.startswith("skipped") and not m.get("no_feasible_plan"):
        lines.append(f"the agents' best plan, not polished ({polish})")
    run = m.get("timesteps_run")
    total = m.get("total_timesteps")
    secs = m.get("search_seconds")
    if run is not None and secs:
        if interrupted:
            lines.append(f"interrupted after {run:,} of {total:,} timesteps in {secs:.1f} s: the best plan so "
                         "far")
        else:
            lines.append(f"{run:,} timesteps in {secs:.1f} s ({run / secs:,.0f} steps/s)")
    elif secs is not None:
        lines.append(f"{secs:.1f} s" + ("; interrupted: the best plan so far" if interrupted else ""))
    elif interrupted:
        lines.append("interrupted: the best plan so far")
    return "\n".join(lines)


def img_html(png: bytes | None, alt: str) -> str:
    """An ``<img>`` with ``png`` inline, shown at half its pixel width (it is drawn at twice the resolution)."""
    if png is None:
        return ""
    data = base64.b64encode(png).decode("ascii")
    return f'<img alt="{alt}" width="{_png_width(png) // 2}" style="max-width:100%" ' \
           f'src="data:image/png;base64,{data}">'
