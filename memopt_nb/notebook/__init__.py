"""The notebook layer of memopt_nb: IPython magics, a live search dashboard and static plots.

* :mod:`~memopt_nb.notebook.magics` — ``%memopt_profile`` / ``%%memopt_profile`` and ``%memopt_plan``, registered by
  ``%load_ext memopt_nb``.
* :mod:`~memopt_nb.notebook.dashboard` — :class:`SearchDashboard` (ipywidgets in Jupyter, text lines elsewhere) and
  :func:`live_search`; ``$MEMOPT_NB_TIMESTEPS`` sets the default search length of the magic and the tutorials.
* :mod:`~memopt_nb.notebook.progress` — :class:`~memopt_nb.notebook.progress.ProgressBar`, the progress of profile,
  max_batch, measure, compare and evaluate in a Jupyter kernel (installed when memopt is imported there).
* :mod:`~memopt_nb.notebook.plots` — matplotlib/seaborn figures of memory timelines, per-unit plans and search
  curves, usable outside widgets.

This layer only uses the public ``memopt_nb`` API.
"""

from .dashboard import TIMESTEPS_ENV, SearchDashboard, in_notebook, live_search, timesteps_from_env
from .plots import (
    agents_figure,
    figure_png,
    memory_timeline,
    new_figure,
    peak_curve,
    reward_curves,
    search_figure,
    styled,
    unit_chart,
)

__all__ = [
    "TIMESTEPS_ENV", "SearchDashboard", "agents_figure", "figure_png", "in_notebook", "live_search", "memory_timeline",
    "new_figure", "peak_curve", "reward_curves", "search_figure", "styled", "timesteps_from_env", "unit_chart",
]
