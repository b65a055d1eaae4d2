"""Static plots of profiles, plans and searches — each function returns a matplotlib ``Figure``.

They work anywhere (a notebook, a script, a headless CI job): figures are drawn with matplotlib's Agg renderer and
never registered with ``pyplot``, so nothing is shown twice and nothing leaks; in a notebook a returned figure renders
as a PNG, elsewhere save it with ``fig.savefig("x.png")``. Styling is seaborn's ``whitegrid``.

* :func:`memory_timeline` — device memory over one simulated training step (forward, then backward) for one or more
  plans, against the budget.
* :func:`unit_chart` — per unit: saved bytes (coloured by the plan's strategy, swap timing annotated) and forward /
  backward time. Without a plan it is the profile's per-unit memory/time chart.
* :func:`reward_curves` — mean episodic return of the strategy and the timing agent per PPO iteration.
* :func:`peak_curve` — best feasible peak found so far against the budget and the unoptimized peak.
* :func:`search_figure` — the live search dashboard's figure: the memory timeline, then the fastest plan's peak
  against the budget and its extra step time.
* :func:`agents_figure` — how the agents learn: rewards and the share of episodes within the budget.

``history`` arguments take the rows ``memopt.search`` passes to its callback, or a plan from ``memopt.search`` (its
``meta["history"]``). The evaluation plots of the evaluation API are not here yet (that API does not exist yet).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib as mpl
import matplotlib.patches  # noqa: F401 - mpl.patches
import matplotlib.ticker  # noqa: F401 - mpl.ticker
import numpy as np
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..core.budget import format_bytes, resolve_budget
from ..core.plan import DEFAULT_STRATEGIES, Plan
from ..core.strategies import REGISTRY, by_name
from ..harness.figures import figure_class, figure_png, new_figure, styled
from ..sim.simulator import SimResult, simulate

__all__ = [
    "BASE_COLOR", "BUDGET_COLOR", "PLAN_COLOR", "STRATEGY_COLORS", "MemoptFigure", "agents_figure", "figure_png",
    "memory_timeline",
    "new_figure", "peak_curve", "reward_curves", "search_figure", "smooth", "styled", "unit_chart",
]

_PALETTE = sns.color_palette("deep")
#: Colours of the strategies in every chart.
_STRATEGY_PALETTE = {"keep": 0, "recompute": 1, "swap": 2, "recompute_offload": 8, "selective": 6}
AGENT_COLORS = {"strategy": _PALETTE[4], "timing": _PALETTE[9]}
_FREE = iter((3, 5, 7, *range(len(_PALETTE))))  # the palette's colours no strategy or agent has, first
#: Colours of the strategies in every chart (every strategy of the registry; one without a colour of its own here
#: gets a free one of the palette).
STRATEGY_COLORS = {s.name: _PALETTE[_STRATEGY_PALETTE[s.name] if s.name in _STRATEGY_PALETTE else next(_FREE)]
                   for s in REGISTRY}
#: The same three roles have the same colour in every figure: the budget line, the unoptimized step, the plan.
BUDGET_COLOR = "#c0392b"
BASE_COLOR = "0.45"
PLAN_COLOR = _PALETTE[0]
#: Other plans drawn next to the plan (never grey or red, which mean unoptimized and budget).
_OTHER_COLORS = [_PALETTE[i] for i in (1, 2, 4, 5, 6, 8, 9)]


#: A matplotlib Figure that renders itself as a PNG in IPython/Jupyter even without a pyplot backend.
MemoptFigure = figure_class()


def _byte_scale(max_bytes: float) -> tuple[float, str]:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if max_bytes >= div:
            return float(div), unit
    return 1.0, "B"


def _history_rows(history: Any) -> list[dict[str, Any]]:
    if isinstance(history, Plan):
        history = history.meta.get("history")
        if history is None:
            raise ValueError("this plan has no search history (meta['history']); it was not made by memopt.search")
    if isinstance(history, Mapping):
        raise TypeError("history must be a list of rows from memopt.search's callback, not a single row")
    rows = list(history or [])
    for r in rows:
        if not isinstance(r, Mapping):
            raise TypeError(f"history rows must be dicts (memopt.search callback rows), got {type(r).__name__}")
    return rows


def _col(rows: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """One column of history rows as floats, ``None``/missing as NaN."""
    out = np.full(len(rows), np.nan)
    for i, r in enumerate(rows):
        v = r.get(key)
        if v is not None:
            try:
                out[i] = float(v)
            except (TypeError, ValueError):
                pass
    return out


def _legend_below(ax: Any, handles: Any = None, labels: Any = None, ncols: int = 2) -> None:
    """A legend under the axes, where it cannot cover a line (the budget, the unoptimized peak)."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=ncols, frameon=False,
                  fontsize=7)


def smooth(y: Any, weight: float | None = None) -> np.ndarray:
    """Debiased exponential moving average of ``y`` skipping NaNs (TensorBoard's smoothing); ``weight`` defaults to
    one that grows with the number of points (0 up to 5 points, 0.49 for 10, 0.84 for 100, at most 0.9)."""
    y = np.asarray(y, dtype=float)
    if weight is None:
        weight = 0.0 if len(y) <= 5 else min(0.9, 1.0 - 1.6 / np.sqrt(len(y)))
    out = np.full_like(y, np.nan)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(y):
        if np.isfinite(v):
            acc = weight * acc + (1 - weight) * v
            norm = weight * norm + (1 - weight)
            out[i] = acc / norm
    return out


def _axes_or_new(ax: Any, figsize: tuple[float, float]) -> tuple[Figure, Any]:
    if ax is not None:
        return ax.figure, ax
    return new_figure(1, 1, figsize=figsize)


# ====================================================================== memory timeline
def _as_results(profile: Any, plans: Any, device: Any, labels: Sequence[str] | None) -> list[tuple[str, Any]]:
    if isinstance(plans, (Plan, SimResult)):
        items = [(None, plans)]
    elif isinstance(plans, Mapping):
        items = list(plans.items())
    else:
        items = [(None, p) for p in plans]
    if not items:
        raise ValueError("memory_timeline needs at least one plan or SimResult")
    if labels is not None:
        if len(labels) != len(items):
            raise ValueError(f"got {len(labels)} labels for {len(items)} plans")
        items = [(lab, p) for lab, (_, p) in zip(labels, items)]
    out = []
    for label, p in items:
        if isinstance(p, Plan):
            if profile is None:
                raise ValueError("pass the profile to simulate plans, or pass SimResults from memopt.simulate")
            sim = simulate(profile, p, device=device)
            label = label or p.method
        elif isinstance(p, SimResult):
            sim = p
            label = label or "plan"
        else:
            raise TypeError(f"memory_timeline takes Plans or SimResults, got {type(p).__name__}")
        out.append((str(label), sim, _role_color(p, label)))
    return out


def _role_color(p: Any, label: Any) -> Any:
    """Grey for the unoptimized step (every unit kept), ``None`` (decided by position) for other plans."""
    if isinstance(p, Plan) and all(s == "keep" for s in p.strategies):
        return BASE_COLOR
    if str(label).lower() in ("unoptimized", "no plan", "keep"):
        return BASE_COLOR
    return None


def _colors_for(results: Sequence[tuple[str, Any, Any]]) -> list[Any]:
    """Each result's colour: its role colour if it has one; the first other plan gets the plan colour."""
    others = iter([PLAN_COLOR] + _OTHER_COLORS * 3)
    return [c if c is not None else next(others) for _, _, c in results]


def _draw_timeline(ax: Any, results: Sequence[tuple[str, Any, Any]], budget: float | None) -> None:
    peak_all = max([float(s.peak_bytes) for _, s, _ in results] + [float(budget or 0)])
    div, unit = _byte_scale(peak_all)
    colors = _colors_for(results)
    for i, (label, sim, _) in enumerate(results):
        rows = sim.timeline
        if not rows:
            continue
        t = np.array([r["time"] for r in rows]) * 1e3
        b = np.array([r["bytes"] for r in rows]) / div
        color = colors[i]
        ax.plot(t, b, "-", color=color, lw=1.6, label=f"{label}: peak {format_bytes(sim.peak_bytes)}")
        k = int(np.argmax(b))
        ax.plot([t[k]], [b[k]], "o", color=color, ms=4)
        if i == 0:
            bwd = [r["time"] * 1e3 for r in rows if r.get("phase") == "backward"]
            if bwd:
                ax.axvspan(bwd[0], t[-1], color="0.5", alpha=0.07, lw=0)
                ax.text(bwd[0], 0.02, " backward", transform=ax.get_xaxis_transform(), fontsize=7, color="0.35")
                ax.text(t[0], 0.02, " forward", transform=ax.get_xaxis_transform(), fontsize=7, color="0.35")
    if budget:
        ax.axhline(budget / div, color=BUDGET_COLOR, ls="--", lw=1.2, label=f"budget {format_bytes(budget)}")
    ax.set_xlabel("simulated time in the step (ms)")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_ylim(bottom=0)
    _legend_below(ax, ncols=min(3, len(results) + (1 if budget else 0)))


def memory_timeline(profile: Any, plans: Any, *, device: Any = None, budget: Any = None,
                    labels: Sequence[str] | None = None, ax: Any = None, title: str | None = None) -> Figure:
    """Device memory over one training step (forward, then backward) of one or more plans, and the budget line.

    Args:
        profile: the :class:`~memopt_nb.ModelProfile` the plans were made for (not needed if you pass SimResults).
        plans: a ``Plan`` or ``SimResult``, a list of them, or a ``{label: plan}`` dict. Plans are simulated with
            ``memopt.simulate(profile, plan, device)``.
        device: device to simulate for (default: the profiled one), e.g. ``"a100-40gb"``.
        budget: the budget line (bytes or ``"2GiB"``; ``"60%"`` of the profile's peak); default: the first plan's.
        labels: legend labels (default: each plan's method).
        ax: draw into this Axes instead of a new figure.
    """
    results = _as_results(profile, plans, device, labels)
    if budget is None:
        budget = results[0][1].budget_bytes
    else:
        if profile is None and isinstance(budget, str) and budget.strip().endswith("%"):
            raise ValueError("a percentage budget needs the profile")
        budget = resolve_budget(budget, reference=profile.peak_bytes if profile is not None else None)
    fig, ax = _axes_or_new(ax, (7.0, 3.8))
    with styled():
        _draw_timeline(ax, results, budget)
        ax.set_title(title or "memory over one training step")
    return fig


# ====================================================================== per-unit chart
def unit_chart(profile: Any, plan: Any = None, *, title: str | None = None) -> Figure:
    """Per unit: saved bytes and forward/backward time; with a plan, bars are coloured by strategy, swapped units
    are labelled with their offload window ``w`` and prefetch distance ``d``, and selective units with their save-set.

    Each memory bar is what the unit saves for backward (``saved_bytes``); its hatched part is what recomputing the unit
    frees (``interior_bytes``).
    """
    units = list(profile.units)
    if not units:
        raise ValueError("the profile has no units")
    if plan is not None:
        if list(plan.units) != [u.name for u in units]:
            raise ValueError("the plan was made for other units than this profile's: "
                             f"{plan.units[:3]}... vs {[u.name for u in units][:3]}...")
        strategies = plan.strategies
    else:
        strategies = [None] * len(units)
    n = len(units)
    fig, (ax_m, ax_t) = new_figure(2, 1, figsize=(max(6.5, min(12.0, 0.45 * n + 3)), 4.4), sharex=True)
    x = np.arange(n)
    saved = np.array([u.saved_bytes for u in units], dtype=float)
    interior = np.array([u.interior_bytes for u in units], dtype=float)
    div, unit = _byte_scale(max(saved.max(), 1.0))
    with styled():
        colors = [STRATEGY_COLORS.get(s, _PALETTE[0]) if s else _PALETTE[0] for s in strategies]
        ax_m.bar(x, saved / div, color=colors, alpha=0.9)
        ax_m.bar(x, interior / div, fill=False, hatch="///", edgecolor="white", lw=0)
        ax_m.set_ylabel(f"saved ({unit})")
        handles = [mpl.patches.Patch(facecolor="0.6", hatch="///", edgecolor="white", label="freed by recompute")]
        if plan is not None:
            for i, d in enumerate(plan.decisions):
                if by_name(d.strategy).timed:
                    ax_m.text(i, saved[i] / div, f"w{d.offload_window} d{d.prefetch_distance}", ha="center",
                              va="bottom", fontsize=7)
                elif d.strategy == "selective":  # which save-set it keeps
                    ax_m.text(i, saved[i] / div, d.save_set, ha="center", va="bottom", fontsize=7)
            used = set(plan.strategies) | set(DEFAULT_STRATEGIES)
            handles = [mpl.patches.Patch(color=c, label=s) for s, c in STRATEGY_COLORS.items() if s in used] + handles
            name = (plan.device or {}).get("name")
            ax_m.set_title(title or f"plan per unit ({plan.method}{' for ' + name if name else ''})\nswapped units: "
                           "w = forwards the copy to host may overlap, d = units ahead the copy back starts",
                           fontsize=8)
        else:
            ax_m.set_title(title or "per unit: saved activations (hatched: freed by recompute) and time")
        ax_m.legend(handles=handles, loc="upper right", ncols=len(handles))
        ax_m.set_ylim(top=max(saved.max() / div, 1e-9) * 1.3)
        fwd = np.array([u.fwd_time for u in units]) * 1e3
        bwd = np.array([u.bwd_time for u in units]) * 1e3
        ax_t.bar(x - 0.2, fwd, width=0.4, color=_PALETTE[7], label="forward")
        ax_t.bar(x + 0.2, bwd, width=0.4, color=_PALETTE[5], label="backward")
        ax_t.set_ylabel("time (ms)")
        ax_t.legend(loc="upper right", ncols=2)
        ax_t.set_xticks(x)
        ax_t.set_xticklabels([u.name for u in units], rotation=45 if n > 6 else 0, ha="right" if n > 6 else "center",
                             fontsize=7)
    return fig


# ====================================================================== search curves
def _iteration_axis(ax: Any, it: np.ndarray) -> None:
    """PPO iterations on the x axis: whole numbers only, from 1, never a zoomed-in ``0.945…1.050`` around one point."""
    finite = it[np.isfinite(it)]
    hi = float(finite.max()) if len(finite) else 1.0
    hi = max(hi, 2.0)
    pad = 0.04 * (hi - 1.0)
    ax.set_xlim(1.0 - pad, hi + pad)
    ax.xaxis.set_major_locator(mpl.ticker.MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("PPO iteration")


def _draw_rewards(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    it = _col(rows, "iteration")
    for agent in ("strategy", "timing"):
        y = _col(rows, f"reward_{agent}")
        ok = np.isfinite(y)
        color = AGENT_COLORS[agent]
        if ok.sum() > 5:  # raw values faint behind the smoothed curve
            ax.plot(it[ok], y[ok], "-", color=color, lw=0.8, alpha=0.25)
        ys = smooth(y)
        ax.plot(it[ok], ys[ok], "-", marker="." if ok.sum() < 30 else None, color=color, lw=1.6,
                label=f"{agent} agent" + (" (smoothed; raw faint)" if ok.sum() > 5 and agent == "timing" else ""))
    _iteration_axis(ax, it)
    ax.set_ylabel("reward per episode")
    ax.set_title("how well each agent does (higher is better)")
    _legend_below(ax)


def _draw_peaks(ax: Any, rows: Sequence[Mapping[str, Any]], budget: float | None = None, plan: Any = None) -> None:
    it = _col(rows, "iteration")
    peak = _col(rows, "best_peak")
    budgets = _col(rows, "budget")
    base = _col(rows, "base_peak")
    budget = budget if budget is not None else (budgets[-1] if len(budgets) and np.isfinite(budgets[-1]) else None)
    final = getattr(plan, "predicted_peak_bytes", None)
    ref = [v for v in (np.nanmax(peak) if np.isfinite(peak).any() else np.nan, budget or np.nan,
                       base[-1] if len(base) else np.nan, final if final is not None else np.nan) if np.isfinite(v)]
    div, unit = _byte_scale(max(ref) if ref else 1.0)
    ok = np.isfinite(peak)
    ax.plot(it[ok], peak[ok] / div, "-", drawstyle="steps-post", color=PLAN_COLOR, lw=1.6,
            marker="." if ok.sum() < 30 else None, label="peak of the fastest plan within the budget so far")
    if budget:
        ax.axhline(budget / div, color=BUDGET_COLOR, ls="--", lw=1.2, label=f"budget {format_bytes(budget)}")
    if len(base) and np.isfinite(base[-1]):
        ax.axhline(base[-1] / div, color=BASE_COLOR, ls=":", lw=1.2, label="unoptimized peak")
    if final is not None and len(it):
        ax.plot([it[-1]], [final / div], "*", color=PLAN_COLOR, ms=11, mec="white",
                label=f"returned plan: {format_bytes(final)}")
    if len(it) and not ok.any():
        ax.text(0.5, 0.5, "no plan within the budget yet", transform=ax.transAxes, ha="center", va="center",
                color="0.4")
    _iteration_axis(ax, it)
    ax.set_ylabel(f"peak ({unit})")
    ax.set_ylim(bottom=0, top=(max(ref) / div if ref else 1.0) * 1.08)
    ax.set_title("peak memory of the fastest plan found (it may rise\nwhen a faster plan uses more of the budget)",
                 fontsize=8)
    _legend_below(ax, ncols=1)


def _draw_step_time(ax: Any, rows: Sequence[Mapping[str, Any]], plan: Any = None) -> None:
    """The fastest plan's extra step time over no plan, on an axis from zero (a change from +51% to +57% looks as
    small as it is)."""
    it = _col(rows, "iteration")
    best = _col(rows, "best_step_time")
    base = _col(rows, "base_step_time")
    overhead = (best / base - 1.0) * 100
    ok = np.isfinite(overhead)
    ax.plot(it[ok], overhead[ok], "-", drawstyle="steps-post", color=PLAN_COLOR, lw=1.6,
            marker="." if ok.sum() < 30 else None, label="fastest plan within the budget so far")
    t = getattr(plan, "predicted_step_time", None)
    marked = []
    if t is not None and len(base) and np.isfinite(base[-1]) and len(it):
        marked.append((t / base[-1] - 1.0) * 100)
        ax.plot([it[-1]], marked, "*", color=PLAN_COLOR, ms=11, mec="white",
                label=f"returned plan: {marked[0]:+.1f}%")
    _iteration_axis(ax, it)
    ax.set_ylabel("slower than no plan (%)")
    values = [v for v in [*overhead[ok], *marked] if np.isfinite(v)]
    top = max(values + [1.0])
    ax.set_ylim(bottom=min(values + [0.0]), top=top * 1.15)
    ax.set_title("extra step time of the fastest plan within the budget", fontsize=8)
    _legend_below(ax, ncols=1)


def _draw_feasible(ax: Any, rows: Sequence[Mapping[str, Any]]) -> None:
    """The share of each iteration's episodes that ended within the budget."""
    it = _col(rows, "iteration")
    frac = _col(rows, "feasible_fraction") * 100
    ax.plot(it, frac, color=_PALETTE[7], lw=1.4, marker="." if len(it) < 30 else None,
            label="episodes within the budget")
    _iteration_axis(ax, it)
    ax.set_ylim(0, 105)
    ax.set_ylabel("within the budget (%)")
    ax.set_title("share of the agents' episodes within the budget", fontsize=8)
    _legend_below(ax, ncols=1)


def agents_figure(history: Any, *, fig: Figure | None = None, dpi: float = 90) -> Figure:
    """How the agents learn: both agents' reward per episode and the share of episodes within the budget per PPO
    iteration (the dashboard's collapsed section)."""
    rows = _history_rows(history)
    with styled():
        if fig is None:
            fig = MemoptFigure(figsize=(10.0, 3.0), dpi=dpi)
            FigureCanvasAgg(fig)
        else:
            fig.clear()
        fig.subplots_adjust(left=0.07, right=0.97, top=0.88, bottom=0.3, wspace=0.25)
        a, b = fig.subplots(1, 2)
        _draw_rewards(a, rows)
        _draw_feasible(b, rows)
    return fig


def reward_curves(history: Any, *, ax: Any = None) -> Figure:
    """Mean episodic return of the strategy agent and the timing agent per PPO iteration.

    Iterations in which no episode finished (NaN returns) are left out of the lines.
    """
    rows = _history_rows(history)
    fig, ax = _axes_or_new(ax, (6.0, 3.2))
    with styled():
        _draw_rewards(ax, rows)
    return fig


def peak_curve(history: Any, *, budget: Any = None, ax: Any = None) -> Figure:
    """The best feasible peak found so far per PPO iteration, against the budget and the unoptimized peak."""
    rows = _history_rows(history)
    fig, ax = _axes_or_new(ax, (6.0, 3.2))
    with styled():
        _draw_peaks(ax, rows, None if budget is None else float(resolve_budget(budget)))
    return fig


def search_figure(history: Any, *, unoptimized: Any = None, best: Any = None, budget: float | None = None,
                  fig: Figure | None = None, title: str | None = None, plan: Any = None) -> Figure:
    """The live dashboard's figure, in the user's terms: the memory timeline on top (the unoptimized step, the budget
    and, at the end, the returned plan), then the fastest plan's peak against the budget and its extra step time per
    PPO iteration. The agents' own curves are :func:`agents_figure`.

    Args:
        history: rows from ``memopt.search``'s callback (or its plan).
        unoptimized: ``SimResult`` of the unoptimized step (every unit kept), drawn in the timeline panel.
        best: ``SimResult`` of the returned plan, drawn over it (the dashboard passes it in its final frame).
        budget: bytes; default: the budget in the history rows.
        fig: redraw into this figure (cleared first) instead of making a new one.
        title: a title over the panels.
        plan: the returned plan: its predicted peak and step time are marked (a star) on the curves, so the figure
            shows the same numbers as the summary.

    Axes, in order: the timeline, the peak, the step time.
    """
    rows = _history_rows(history)
    if budget is None:
        b = _col(rows, "budget")
        budget = float(b[-1]) if len(b) and np.isfinite(b[-1]) else None
    with styled():
        if fig is None:
            # A fixed layout (room for the legends under the axes): constrained layout would cost as much as the
            # drawing itself on every live frame.
            fig = MemoptFigure(figsize=(10.0, 6.6), dpi=90)
            FigureCanvasAgg(fig)
        else:
            fig.clear()
        fig.subplots_adjust(left=0.07, right=0.97, top=0.91, bottom=0.13, hspace=0.62, wspace=0.25)
        grid = fig.add_gridspec(2, 2)
        ax = fig.add_subplot(grid[0, :])
        peaks = fig.add_subplot(grid[1, 0])
        steps = fig.add_subplot(grid[1, 1])
        results = []
        if unoptimized is not None:
            results.append(("unoptimized", unoptimized, BASE_COLOR))
        if best is not None:
            results.append(("returned plan", best, PLAN_COLOR))
        if results:
            _draw_timeline(ax, results, budget)
            if best is None:
                ax.set_title("memory over one step: unoptimized (the plan is added at the end)", fontsize=9)
            else:
                ax.set_title("memory over one step: " + " vs ".join(lab for lab, _, _ in results), fontsize=9)
        else:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "memory timeline: pass the profile", transform=ax.transAxes, ha="center")
        _draw_peaks(peaks, rows, budget, plan)
        _draw_step_time(steps, rows, plan)
        if title:
            fig.suptitle(title, fontsize=10)
    return fig
