"""The look and the rendering of every memopt figure: a styled matplotlib Figure with an Agg canvas, never registered
with ``pyplot``, that renders itself as a PNG in IPython/Jupyter. Here, below the notebook layer, so that the harness's
results (``Evaluation.figure``) draw in the same look; :mod:`memopt_nb.notebook.plots` re-exports them. matplotlib and
seaborn are imported when a figure is first drawn, not with the package."""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Iterator
from typing import Any

__all__ = ["figure_class", "figure_png", "new_figure", "styled"]


@functools.cache
def figure_class() -> type:
    """:class:`MemoptFigure`: a matplotlib Figure that renders itself as a PNG in IPython/Jupyter even without a pyplot
    backend (made on first use, so that importing memopt does not import matplotlib)."""
    from matplotlib.figure import Figure

    class MemoptFigure(Figure):
        """A matplotlib Figure that renders itself as a PNG in IPython/Jupyter even without a pyplot backend."""

        def _repr_png_(self) -> bytes:
            return figure_png(self)

    MemoptFigure.__module__ = "memopt_nb.notebook.plots"
    return MemoptFigure


def figure_png(fig: Any, dpi: float | None = None, fast: bool = False) -> bytes:
    """The figure as PNG bytes (what the dashboard's Image widget shows), cropped to what is drawn (legends under the
    axes included); ``fast`` compresses less (live frames)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if fig.canvas is None or not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    buf = io.BytesIO()
    # a tight box: legends under the axes are never cut off at the figure's edge
    fig.savefig(buf, format="png", dpi=dpi if dpi is not None else fig.dpi, facecolor=fig.get_facecolor(),
                bbox_inches="tight", pad_inches=0.08, pil_kwargs={"compress_level": 1 if fast else 6})
    return buf.getvalue()


@contextlib.contextmanager
def styled() -> Iterator[None]:
    """seaborn's ``whitegrid`` style, ``deep`` palette and a compact ``notebook`` context, only inside the block."""
    import matplotlib as mpl
    import seaborn as sns

    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.8), \
            mpl.rc_context({"axes.titlesize": 10, "legend.fontsize": 8, "legend.framealpha": 0.8,
                            "axes.prop_cycle": mpl.cycler(color=sns.color_palette("deep"))}):
        yield


def new_figure(nrows: int = 1, ncols: int = 1, figsize: tuple[float, float] = (7.0, 3.6), dpi: float = 90,
               **kwargs: Any) -> tuple[Any, Any]:
    """A styled :class:`MemoptFigure` with an Agg canvas and a grid of axes (``Figure.subplots`` semantics), for plots
    of your own in the same look: ``fig, (a, b) = new_figure(1, 2); a.plot(...); fig``. Draw inside ``with styled():``
    to keep seaborn's style for artists added later."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    with styled():
        fig = figure_class()(figsize=figsize, dpi=dpi, layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(nrows, ncols, squeeze=True, **kwargs)
    return fig, axes
