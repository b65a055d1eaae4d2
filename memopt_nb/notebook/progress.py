"""A progress bar in the notebook for memopt's long calls: :class:`ProgressBar`.

``memopt.profile``, ``max_batch``, ``measure``, ``compare``, ``evaluate`` and the magics that call them report their
stages between steps (:mod:`memopt_nb.core.progress`); in a Jupyter kernel this listener shows them, installed when
memopt is imported there (:func:`notebook_listener`; ``MEMOPT_NB_PROGRESS=off`` turns it off). Nothing shows for a call
shorter than ``delay`` (2 s). Then one ``FloatProgress`` and label per running call (``max_batch 1/3 probe profiles``,
under it ``profile 2/3 timed steps, about 4 s left``), redrawn at the call's steps, at most every ``min_interval``
seconds (a stage's start and end always). When the call ends, every bar is set to its end (full and green when it
is done) and the widget's output is replaced in place by one line of text (``memopt.profile done in 37 s``), so that
a saved notebook reads the same reopened without a kernel, on GitHub or exported.
"""

from __future__ import annotations

import html
import importlib.util
import time
from collections.abc import Callable
from typing import Any

from ..core.progress import ProgressListener, Task
from .dashboard import in_notebook

__all__ = ["ProgressBar", "notebook_listener"]

#: bar style at the end of a call, by its outcome
_END_STYLE = {"done": "success", "interrupted": "warning", "failed": "danger"}


class ProgressBar(ProgressListener):
    """The notebook's progress listener (see the module). ``display``: shows the widget and returns a handle to
    update its output with (default ``IPython.display.display(..., display_id=True)``); ``clock``: the time source.

    Attributes: ``widget`` (the ``VBox`` of the last call shown, ``None`` before), ``bars`` and ``labels`` (its
    rows), ``final`` (the text the last call ended with), ``draws`` (redraws)."""

    def __init__(self, *, delay: float = 2.0, min_interval: float = 0.2, clock: Callable[[], float] = time.monotonic,
                 display: Callable[[Any], Any] | None = None) -> None:
        super().__init__(clock)
        self.delay = float(delay)
        self.min_interval = float(min_interval)
        self._display = display
        self.widget: Any = None
        self.bars: list[Any] = []
        self.labels: list[Any] = []
        self.final: str | None = None
        self.draws = 0
        self._handle: Any = None
        self._shown = False
        self._last: float | None = None

    def update(self, event: str, tasks: tuple[Task, ...], now: float) -> None:
        if len(tasks) == 1 and event == "start":
            self._shown, self._last, self._handle = False, None, None
        if event == "end":
            if len(tasks) == 1 and self._shown:
                self._finish(tasks[0], now)
            return
        if event == "start":  # its first stage follows at once
            return
        if not self._shown and self.elapsed(tasks[0], now) < self.delay:
            return
        me = tasks[-1]
        ends_stage = event == "advance" and me.total is not None and me.done >= me.total
        if event == "advance" and not ends_stage and self._last is not None and now - self._last < self.min_interval:
            return  # a new stage, and the end of one, always show: no estimate stays up after its stage
        self._last = now
        self._draw(tasks, now)

    def _row(self) -> None:
        import ipywidgets as widgets

        bar = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, bar_style="info",
                                    layout=widgets.Layout(width="30%"))
        label = widgets.HTML(value="")
        self.bars.append(bar)
        self.labels.append(label)
        self.widget.children = (*self.widget.children, widgets.HBox([bar, label]))

    def _draw(self, tasks: tuple[Task, ...], now: float) -> None:
        if not self._shown:
            import ipywidgets as widgets

            self.widget, self.bars, self.labels = widgets.VBox([]), [], []
        while len(self.bars) < len(tasks):
            self._row()
        with self.widget.hold_sync():
            for i, (bar, label, row) in enumerate(zip(self.bars, self.labels, self.widget.children, strict=True)):
                row.layout.display = None if i < len(tasks) else "none"
                if i >= len(tasks):
                    continue
                t = tasks[i]
                bar.value = min(1.0, t.done / t.total) if t.total else 0.0
                text = self.text([t], now)
                if i == 0:
                    text += f" · {self._clock_text(self.elapsed(t, now))} elapsed"
                label.value = html.escape(text)
        self.draws += 1
        if not self._shown:
            self._shown = True
            self._handle = self._show(self.widget)

    @staticmethod
    def _clock_text(seconds: float) -> str:
        s = int(seconds)
        return f"{s // 60:02d}:{s % 60:02d}"

    def _show(self, widget: Any) -> Any:
        if self._display is not None:
            return self._display(widget)
        from IPython.display import display

        return display(widget, display_id=True)

    def _finish(self, root: Task, now: float) -> None:
        """Every bar to its end and the label to the final text; then the output becomes that text."""
        self.final = f"memopt.{self.final_text(root, now)}"
        style = _END_STYLE.get(root.outcome or "", "danger")
        with self.widget.hold_sync():
            for i, (bar, label, row) in enumerate(zip(self.bars, self.labels, self.widget.children, strict=True)):
                if root.outcome == "done":
                    bar.value = 1.0
                bar.bar_style = style
                label.value = html.escape(self.final) if i == 0 else ""
                row.layout.display = None if i == 0 else "none"
        if self._handle is not None and hasattr(self._handle, "update"):
            self._handle.update({"text/plain": self.final, "text/html": f"<small>{html.escape(self.final)}</small>"},
                                raw=True)
        self._shown = False


_LISTENER: list[Any] = []


def notebook_listener() -> ProgressBar | None:
    """The process's :class:`ProgressBar` in a Jupyter kernel with ipywidgets, else ``None`` (decided once)."""
    if not _LISTENER:
        ok = in_notebook() and importlib.util.find_spec("ipywidgets") is not None
        _LISTENER.append(ProgressBar() if ok else None)
    return _LISTENER[0]
