"""A live dashboard for ``memopt.search``: stats, a progress bar and an image of the learning curves.

Use it as the search's callback, or let it run the search::

    dash = SearchDashboard(prof)                       # shows itself when the first PPO iteration is done
    p = memopt.search(prof, "60%", callback=dash)
    dash.finish(p)                                     # final frame, with the best plan's memory timeline

    p = live_search(prof, "60%")                       # the same in one call (what %memopt_plan does)

In a Jupyter kernel it is an ``ipywidgets.VBox`` that leads with the user's problem: an ``HTML`` top line (headed by
the device the plan is for) with the best plan so far's predicted peak against the budget, its slowdown against no
plan, the time elapsed and left, and that interrupting (■) stops the search and keeps the best plan; a
``FloatProgress`` with tqdm's rate beside it; an ``Image`` (a PNG drawn with matplotlib's Agg renderer) with the memory
timeline first (the unoptimized step against the budget; the returned plan's timeline is added in the final frame),
then the fastest plan's peak against the budget and its extra step time per PPO iteration; and, collapsed, an
``Accordion`` "how the agents learn" with both agents' rewards and the share of their episodes within the budget (drawn
only while it is open, and at the end). Text and picture are
redrawn together, from the same rows, synchronously from the callback — no ``Output`` widget and no threads, both of
which misbehave without a live frontend — at most every ``min_interval`` seconds (0.3 by default, longer if drawing
itself would take more than a quarter of the time), and always once more at the end. The final frame's numbers are the
returned plan's, the same as ``repr(plan)``. When the search ends the widget's output is replaced in place by one
ordinary output (as livelossplot leaves its last figure): the top line, the final picture at twice the resolution, the
summary and the agents' section as an HTML ``<details>`` (with the picture as ``image/png`` too): a saved notebook
reads the same reopened without a kernel, on GitHub or exported. When a notebook is executed headless (nbclient,
papermill) the widget state, image included, is saved in the notebook too. Outside a kernel (plain IPython, a script)
it prints text lines every few seconds.

``MEMOPT_NB_TIMESTEPS``: an environment variable with the number of PPO timesteps the ``%memopt_plan`` magic and the
tutorials use when none is given (CI sets it small); see :func:`timesteps_from_env`.
"""

from __future__ import annotations

import base64
import html
import os
import time
from collections.abc import Callable
from typing import Any

from ..core.device import DeviceSpec
from ..core.errors import MemoptError
from ..core.plan import Plan
from ..planners.rl.search import search
from ..sim.simulator import simulate
from .dashboard_text import (
    AGENTS_TITLE,
    STOP_HINT,
    _png_width,
    _rate_text,
    agents_html,
    final_text,
    img_html,
    stats_html,
    text_line,
)
from .plots import agents_figure, figure_png, search_figure

__all__ = ["AGENTS_TITLE", "STOP_HINT", "TIMESTEPS_ENV", "SearchDashboard", "in_notebook", "live_search",
           "timesteps_from_env"]

#: Environment variable with the default number of PPO timesteps for ``%memopt_plan`` and the tutorials.
TIMESTEPS_ENV = "MEMOPT_NB_TIMESTEPS"


def timesteps_from_env(default: int | None = None) -> int | None:
    """``int(os.environ["MEMOPT_NB_TIMESTEPS"])`` if set (and non-empty), else ``default`` (``None``: the search's
    own default). Raises ``ValueError`` naming the variable if it is not a positive integer."""
    raw = os.environ.get(TIMESTEPS_ENV, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{TIMESTEPS_ENV}={raw!r} is not an integer number of PPO timesteps") from None
    if value <= 0:
        raise ValueError(f"{TIMESTEPS_ENV}={raw!r} must be a positive number of PPO timesteps")
    return value


def in_notebook() -> bool:
    """Whether we run inside a Jupyter kernel (ipykernel), where widgets can be shown."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython is a dependency
        return False
    ip = get_ipython()
    return ip is not None and any(c.__name__ == "ZMQInteractiveShell" for c in type(ip).__mro__)


class SearchDashboard:
    """Live view of a ``memopt.search``; call it with each history row (it is the search's ``callback``).

    Args:
        profile: the profile being planned for; needed for the memory-timeline panel (optional otherwise).
        device: the device planned for (as given to ``memopt.search``), used to simulate the timelines and named in
            every line that shows a plan.
        total_timesteps: the search's ``total_timesteps``, for the progress bar until the first row says what PPO
            really runs (unknown: the bar fills at the end).
        mode: ``"auto"`` (widgets in a Jupyter kernel, text lines elsewhere), ``"widget"``, ``"text"`` or ``"none"``.
        min_interval: seconds between redraws at most; the first row and :meth:`finish` always draw. The stats text
            and the picture are redrawn together, from the same rows.
        max_overhead: keep the time spent drawing below this share of the search (stretches the interval); ``None``
            to draw every ``min_interval`` regardless.
        text_interval: seconds between text lines in ``"text"`` mode.
        title: shown above the stats.
        clock: the time source (tests pass a fake one).
        dpi: resolution of the live frames; the final picture is drawn at twice that (sharp on a high-resolution
            display, shown at the live frames' size).
        show_plan: put the returned plan's summary in the final text; ``%memopt_plan`` turns it off when the cell's
            result (the plan itself) shows it right under the dashboard, so a cell shows the plan once.
        static: when the search ends, replace the widget by one ordinary output — the top line and summary, the final
            picture and the agents' section collapsed (HTML, with the picture as PNG too) — so that the notebook reads
            the same reopened without a kernel, on GitHub or exported (the widget state is still saved with the
            notebook).

    Attributes: ``history`` (rows seen), ``frames`` (images rendered), ``lines`` (text lines printed), ``widget``
    (the ``VBox``, widget mode only), ``agents`` (its collapsed ``Accordion``), ``plan`` (set by :meth:`finish`),
    ``png`` (the last picture), ``agents_png`` (the last picture of the agents' curves), ``device_name`` (the device
    planned for).
    """

    def __init__(self, profile: Any = None, *, device: Any = None, total_timesteps: int | None = None,
                 mode: str = "auto", min_interval: float = 0.3, max_overhead: float | None = 0.25,
                 text_interval: float = 2.0, title: str | None = None, clock: Callable[[], float] = time.monotonic,
                 dpi: float = 90, out: Callable[[str], None] = print, static: bool = True,
                 show_plan: bool = True) -> None:
        if mode not in ("auto", "widget", "text", "none"):
            raise ValueError(f"mode must be 'auto', 'widget', 'text' or 'none', got {mode!r}")
        if mode == "auto":
            mode = "widget" if in_notebook() else "text"
        self.mode = mode
        self.profile = profile
        self.device = device
        self.total_timesteps = total_timesteps
        self.min_interval = float(min_interval)
        self.max_overhead = max_overhead
        self.text_interval = float(text_interval)
        self.title = title
        self.clock = clock
        self.dpi = dpi
        self.out = out
        self.static = static
        self.show_plan = show_plan
        self.agents_png: bytes | None = None
        self._agents_fig: Any = None
        self.history: list[dict[str, Any]] = []
        self.frames = 0
        self.lines = 0
        self.plan: Any = None
        self.widget: Any = None
        self.png: bytes | None = None
        self._error: BaseException | None = None
        self._shown = False
        self._handle: Any = None
        self._finished = False
        self._last_draw: float | None = None
        self._image_interval = self.min_interval
        self._last_text: float | None = None
        self._printed: Any = None
        self._fig: Any = None
        self._unoptimized: Any = None
        self._best_sim: Any = None
        if mode == "widget":
            self._build_widget()

    @property
    def device_name(self) -> str | None:
        """The name of the device the search plans for (the profiled one unless ``device`` says otherwise)."""
        if self.device is not None:
            dev = self.device
            if isinstance(dev, str):
                try:
                    dev = DeviceSpec.preset(dev)
                except MemoptError:
                    return dev
            return getattr(dev, "name", str(dev))
        if self.profile is not None:
            return self.profile.device.name
        if self.plan is not None:
            return (self.plan.device or {}).get("name")
        return None

    # ------------------------------------------------------------------ widgets
    def _build_widget(self) -> None:
        import ipywidgets as widgets

        self.stats = widgets.HTML(value=self._stats_html())
        self.progress = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, description="search", bar_style="info",
                                              layout=widgets.Layout(width="50%"))
        self.rate = widgets.HTML(value="")
        self.image = widgets.Image(format="png", layout=widgets.Layout(width="auto", max_width="100%"))
        self.agents_text = widgets.HTML(value="")
        self.agents_image = widgets.Image(format="png", layout=widgets.Layout(width="auto", max_width="100%"))
        self.agents = widgets.Accordion(children=[widgets.VBox([self.agents_text, self.agents_image])],
                                        selected_index=None)
        self.agents.set_title(0, AGENTS_TITLE)
        # drawn only while open: opening it draws the curves so far at once
        self.agents.observe(lambda change: self._draw_agents() if change["new"] is not None else None,
                            "selected_index")
        self.widget = widgets.VBox([self.stats, widgets.HBox([self.progress, self.rate]), self.image, self.agents])

    def _show(self) -> None:
        if self._shown:
            return
        self._shown = True
        if self.mode == "widget":
            from IPython.display import display

            self._handle = display(self.widget, display_id=True)

    # ------------------------------------------------------------------ the callback
    def __call__(self, row: dict[str, Any]) -> None:
        """Record one history row from ``memopt.search`` and redraw if enough time has passed."""
        self.history.append(dict(row))
        if self.mode == "none":
            return
        now = self.clock()
        if self.mode == "text":
            if self._last_text is None:
                self._print_header()
            if self._last_text is None or now - self._last_text >= self.text_interval:
                self._last_text = now
                self._print_line(self.history[-1])
            return
        if self._last_draw is None or now - self._last_draw >= self._image_interval:
            self._redraw()
        self._show()

    def finish(self, plan: Any = None, error: BaseException | None = None) -> None:
        """Draw the final frame (the best plan's memory timeline, simulated from ``plan``) and its summary; in a
        notebook, then leave the picture and the summary as ordinary cell outputs."""
        self.plan = plan
        self._error = error
        self._finished = True
        if plan is not None and self.profile is not None:
            try:
                self._best_sim = simulate(self.profile, plan, device=self.device)
            except MemoptError:
                self._best_sim = None
        if self.mode == "none":
            return
        if self.mode == "text":
            if self._last_text is None:
                self._print_header()
            if self.history and self._printed is not self.history[-1]:
                self._print_line(self.history[-1])
            self.out(self._final_text(error))
            self.lines += 1
            return
        self._redraw()
        self._show()
        if self.static:
            self._leave_static()

    def run(self, profile: Any, budget: Any, device: Any = None, **search_kwargs: Any) -> Any:
        """``memopt.search(profile, budget, device, callback=self, **search_kwargs)``, then :meth:`finish`.

        Errors the search raises before it starts (a budget below the minimum, a bad budget) propagate before anything
        is shown.
        """
        if self.profile is None:
            self.profile = profile
        if device is not None:
            self.device = device
        if self.total_timesteps is None:
            self.total_timesteps = search_kwargs.get("total_timesteps")
        try:
            plan = search(profile, budget, device, callback=self, **search_kwargs)
        except BaseException as exc:
            if self._shown:
                self.finish(None, error=exc)
            raise
        self.finish(plan)
        return plan

    # ------------------------------------------------------------------ what is shown
    def _total(self) -> int | None:
        if self.history and self.history[-1].get("total_timesteps"):
            return int(self.history[-1]["total_timesteps"])
        return self.total_timesteps

    def _interrupted(self) -> bool:
        return self.plan is not None and bool(self.plan.meta.get("interrupted"))

    def _heading(self) -> str:
        where = f"memopt.search for {self.device_name}" if self.device_name else "memopt.search"
        if self.profile is not None and self.device_name != self.profile.device.name:
            where += f" (profiled on {self.profile.device.name})"
        return f"{self.title} — {where}" if self.title else where

    def _unoptimized_sim(self) -> Any:
        if self._unoptimized is None and self.profile is not None:
            keep = Plan.uniform(self.profile, "keep")
            self._unoptimized = simulate(self.profile, keep, device=self.device)
        return self._unoptimized

    def _redraw(self) -> None:
        """Stats, progress and picture together, from the same rows (what you read is what you see)."""
        t0 = self.clock()
        self._last_draw = t0
        budget = self.history[-1]["budget"] if self.history else getattr(self.plan, "budget_bytes", None)
        state = ("interrupted" if self._interrupted() else "done") if self._finished else "searching"
        if self._error is not None:
            state = "failed"
        title = f"{self._heading()}: {state}"
        self._fig = search_figure(self.history, unoptimized=self._unoptimized_sim(), best=self._best_sim,
                                  budget=budget, fig=self._fig, plan=self.plan, title=title)
        png = figure_png(self._fig, dpi=self.dpi * (2 if self._finished else 1), fast=not self._finished)
        self.png = png
        total = self._total()
        last = self.history[-1] if self.history else {}
        step = int(last.get("global_step", 0))
        with self.widget.hold_sync():
            if self._finished and not self._interrupted() and self._error is None:
                self.progress.value = 1.0
            elif total:
                self.progress.value = min(1.0, step / total)
            self.progress.description = state if self._finished else "search"
            if self._finished:
                bad = self._error is not None or self.plan is None or bool(self.plan.meta.get("no_feasible_plan"))
                self.progress.bar_style = "danger" if bad else ("warning" if self._interrupted() else "success")
            seconds = float(last.get("seconds", 0.0))
            meta = getattr(self.plan, "meta", {})
            if self._finished and meta.get("timesteps_run") is not None and meta.get("search_seconds"):
                step, seconds = int(meta["timesteps_run"]), float(meta["search_seconds"])  # the summary's figures
            self.rate.value = html.escape(_rate_text(step, total, seconds, finished=self._finished))
            self.stats.value = self._stats_html(self._error)
            if self._finished:  # twice the resolution, shown at the live frames' size
                self.image.layout.width = f"{_png_width(png) // 2}px"
            self.image.value = png
            self.agents_text.value = agents_html(self.history)
            if self._finished or self.agents.selected_index is not None:
                self._draw_agents()
        self.frames += 1
        cost = self.clock() - t0
        if self.max_overhead:
            self._image_interval = max(self.min_interval, cost / self.max_overhead)

    def _draw_agents(self) -> None:
        """The agents' curves (the collapsed section's picture), from the same rows as the rest."""
        if not self.history or self.widget is None:
            return
        self._agents_fig = agents_figure(self.history, fig=self._agents_fig)
        self.agents_png = figure_png(self._agents_fig, dpi=self.dpi * (2 if self._finished else 1),
                                     fast=not self._finished)
        if self._finished:
            self.agents_image.layout.width = f"{_png_width(self.agents_png) // 2}px"
        self.agents_image.value = self.agents_png

    def static_html(self) -> str:
        """The final dashboard as one HTML block: the top line and summary, the picture (at twice the resolution,
        shown at half its pixel width) and the agents' section, collapsed (``<details>``)."""
        agents = (f"<details><summary>{AGENTS_TITLE}</summary>{agents_html(self.history)}<br>"
                  f"{img_html(self.agents_png, 'rewards and episodes within the budget per PPO iteration')}</details>"
                  if self.history else "")
        return (f"<div>{self._stats_html(self._error)}<br>{img_html(self.png, 'memory timeline, peak and step time')}"
                f"{agents}</div>")

    def _leave_static(self) -> None:
        """Replace the widget's output by one ordinary output: the final dashboard as HTML (the picture as PNG too)."""
        if self._handle is None or self.png is None:
            return
        text = self._final_text(self._error)
        self._handle.update({"text/html": self.static_html(), "image/png": base64.b64encode(self.png).decode("ascii"),
                             "text/plain": f"{self._heading()}\n{text}"},
                            metadata={"image/png": {"width": _png_width(self.png) // 2}}, raw=True)

    def _stats_html(self, error: BaseException | None = None) -> str:
        final = self._final_text(error) if self._finished else None
        return stats_html(self._heading(), self.history[-1] if self.history else None, self._total(), final)

    def _print_header(self) -> None:
        self.out(f"[memopt.search] {self._heading()} (an interrupt, Ctrl-C, stops it and keeps the best plan so far)")
        self.lines += 1

    def _print_line(self, r: dict[str, Any]) -> None:
        self._printed = r
        self.out(text_line(r, self._total()))
        self.lines += 1

    def _final_text(self, error: BaseException | None = None) -> str:
        """The summary: every figure in it comes from the returned plan (or the search's own totals)."""
        return final_text(self.plan, error, show_plan=self.show_plan, history=self.history,
                          unoptimized_peak=lambda: getattr(self._unoptimized_sim(), "peak_bytes", None))


def live_search(profile: Any, budget: Any, device: Any = None, *, total_timesteps: int | None = None, seed: int = 0,
                mode: str = "auto", title: str | None = None, show_plan: bool = True, **search_kwargs: Any) -> Any:
    """``memopt.search`` with a :class:`SearchDashboard`; returns the plan.

    ``total_timesteps`` defaults to ``$MEMOPT_NB_TIMESTEPS`` if set, else the search's own default.
    """
    steps = total_timesteps if total_timesteps is not None else timesteps_from_env()
    dash = SearchDashboard(profile, device=device, total_timesteps=steps, mode=mode, title=title, show_plan=show_plan)
    return dash.run(profile, budget, device, total_timesteps=steps, seed=seed, **search_kwargs)
