"""memopt_nb.notebook.dashboard: throttled synchronous redraws, a final frame, text fallback, no Output/threads."""

import threading

import ipywidgets as widgets
import numpy as np
import pytest
import torch

import memopt_nb as memopt
from memopt_nb.notebook import dashboard as dash_mod
from memopt_nb.notebook.dashboard import SearchDashboard, in_notebook, live_search, timesteps_from_env


@pytest.fixture(scope="module")
def prof():
    model, inputs, loss_fn, _ = memopt.zoo.gpt(batch_size=2, seq_len=32, d_model=32, n_layers=2, n_heads=2)
    opt = torch.optim.Adam(model.parameters())
    return memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)


@pytest.fixture(scope="module")
def budget(prof):
    lo = memopt.solvers.min_peak(prof)
    return int(lo + 0.5 * (prof.peak_bytes - lo))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def row(i, budget=1000):
    return {"iteration": i, "global_step": 80 * i, "seconds": float(i), "reward_strategy": -5.0 + i,
            "reward_timing": float("nan") if i == 1 else 1.0, "entropy_strategy": 1.0, "entropy_timing": 1.0,
            "best_step_time": 0.2, "best_peak": 900.0, "feasible_fraction": 1.0, "budget": budget,
            "base_step_time": 0.1, "base_peak": 2000.0}


def test_widget_is_html_progress_image_without_output_widget():
    d = SearchDashboard(mode="widget")
    kinds = [type(c) for c in d.widget.children]
    assert isinstance(d.widget, widgets.VBox)
    assert kinds == [widgets.HTML, widgets.FloatProgress, widgets.Image]
    assert not any(isinstance(c, widgets.Output) for c in d.widget.children)


def test_redraws_are_throttled_and_the_final_frame_is_always_drawn():
    clock = Clock()
    d = SearchDashboard(mode="widget", min_interval=3.0, max_overhead=None, clock=clock, total_timesteps=80 * 21)
    changes = []
    d.image.observe(lambda ch: changes.append(ch), "value")
    for i in range(21):  # one row per second of the fake clock
        clock.t = float(i)
        d(row(i + 1))
    assert d.frames == 7  # t = 0, 3, 6, ..., 18
    assert len(changes) == 7
    assert d.progress.value == pytest.approx(19 / 21)  # stats are throttled too: last updated at t = 18
    d.finish(None)
    assert d.frames == 8 and len(changes) == 8
    assert d.progress.value == 1.0
    assert d.image.value[:8] == b"\x89PNG\r\n\x1a\n"
    assert d.progress.bar_style == "danger"  # no plan came back


def test_slow_drawing_stretches_the_interval(monkeypatch):
    clock = Clock()
    real = dash_mod.figure_png

    def slow_png(fig, dpi=None):
        clock.t += 1.0  # drawing "takes" one second of the fake clock
        return real(fig, dpi=dpi)

    monkeypatch.setattr(dash_mod, "figure_png", slow_png)
    d = SearchDashboard(mode="widget", min_interval=0.3, max_overhead=0.25, clock=clock)
    for i in range(20):
        clock.t += 0.5
        d(row(i + 1))
    # every draw costs 1 s, so the interval becomes 4 s: drawing stays at ~25% of the time
    assert d._image_interval == pytest.approx(4.0)
    assert 3 <= d.frames <= 6


def test_stats_show_progress_and_best_plan():
    d = SearchDashboard(mode="widget", total_timesteps=800, title="my search")
    d(row(3))
    assert "my search" in d.stats.value and "240 / 800" in d.stats.value
    assert memopt.format_bytes(900) in d.stats.value and "+100.0%" in d.stats.value
    assert d.progress.value == pytest.approx(0.3) and d.progress.bar_style == "info"


def test_a_search_with_the_dashboard(prof, budget):
    before = threading.active_count()
    d = SearchDashboard(prof, mode="widget", total_timesteps=144)
    values = []
    d.image.observe(lambda ch: values.append(ch["new"]), "value")
    plan = d.run(prof, budget, total_timesteps=144, seed=0)
    assert threading.active_count() == before  # no drawing threads
    assert isinstance(plan, memopt.Plan) and plan.feasible
    assert d.history == plan.meta["history"] and len(d.history) >= 2
    assert d.frames >= 2 and len(values) == d.frames  # first row and the final frame at least
    assert d.progress.value == 1.0 and d.progress.bar_style == "success"
    assert "done:" in d.stats.value
    # the final frame has the best plan's timeline, whose peak is the plan's predicted peak
    tl = [a for a in d._fig.axes if a.get_title().startswith("memory timeline")][0]
    best = [ln for ln in tl.get_lines() if ln.get_label().startswith("best plan:")]
    assert len(best) == 1 and memopt.format_bytes(plan.predicted_peak_bytes) in best[0].get_label()
    base = [ln for ln in tl.get_lines() if ln.get_label().startswith("unoptimized:")][0]
    assert max(base.get_ydata()) > max(best[0].get_ydata())
    rewards = d._fig.axes[0]
    assert {ln.get_label() for ln in rewards.get_lines()} >= {"strategy agent", "timing agent"}


def test_budget_errors_surface_before_anything_is_shown(prof):
    lines = []
    d = SearchDashboard(prof, mode="widget", out=lines.append)
    with pytest.raises(memopt.BudgetError, match="smallest peak"):
        d.run(prof, 1000, total_timesteps=160)
    assert not d._shown and d.frames == 0 and not lines


def test_an_error_mid_search_marks_the_dashboard(prof, budget):
    class Failing(SearchDashboard):
        def __call__(self, row):
            super().__call__(row)
            if len(self.history) == 2:
                raise RuntimeError("boom")

    d = Failing(prof, mode="widget")
    with pytest.raises(RuntimeError, match="boom"):
        d.run(prof, budget, total_timesteps=400)
    assert d.progress.bar_style == "danger" and "boom" in d.stats.value


def test_interrupted_and_infeasible_plans_are_flagged(prof):
    keep = memopt.Plan.uniform(prof, "keep")
    d = SearchDashboard(prof, mode="widget")
    d(row(1))
    d.finish(keep.with_meta(meta={"interrupted": True}))
    assert d.progress.bar_style == "warning" and "interrupted" in d.stats.value
    d = SearchDashboard(prof, mode="widget")
    d(row(1))
    d.finish(keep.with_meta(meta={"no_feasible_plan": True}))
    assert d.progress.bar_style == "danger" and "NO feasible plan" in d.stats.value


def test_text_mode_prints_throttled_lines_and_a_summary(prof, budget):
    clock = Clock()
    lines = []
    d = SearchDashboard(prof, mode="text", text_interval=5.0, clock=clock, out=lines.append)
    assert d.widget is None
    for i in range(12):
        clock.t = float(i)
        d(row(i + 1))
    assert len(lines) == 3  # t = 0, 5, 10
    assert lines[0].startswith("[memopt.search] iter    1") and "best peak" in lines[0]
    plan = memopt.Plan.uniform(prof, "recompute")
    d.finish(plan)
    assert len(lines) == 5  # the last row (not printed yet), then the summary
    assert "iter   12" in lines[3] and lines[4].startswith("done: ") and plan.summary() in lines[4]
    assert d.frames == 0  # text mode never renders images


def test_auto_mode_outside_a_kernel_is_text(capsys, prof, budget):
    assert not in_notebook()
    plan = live_search(prof, budget, total_timesteps=96)
    out = capsys.readouterr().out
    assert "[memopt.search] iter" in out and "done: " in out
    assert plan.meta["total_timesteps"] == 96


def test_none_mode_is_silent(capsys):
    d = SearchDashboard(mode="none")
    d(row(1))
    d.finish(None)
    assert capsys.readouterr().out == "" and d.frames == 0 and len(d.history) == 1


def test_timesteps_from_env(monkeypatch):
    monkeypatch.delenv("MEMOPT_NB_TIMESTEPS", raising=False)
    assert timesteps_from_env() is None and timesteps_from_env(7) == 7
    monkeypatch.setenv("MEMOPT_NB_TIMESTEPS", " 1200 ")
    assert timesteps_from_env() == 1200
    for bad in ("many", "-3", "0"):
        monkeypatch.setenv("MEMOPT_NB_TIMESTEPS", bad)
        with pytest.raises(ValueError, match="MEMOPT_NB_TIMESTEPS"):
            timesteps_from_env()


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        SearchDashboard(mode="fancy")


def test_nan_rewards_do_not_break_the_image():
    d = SearchDashboard(mode="widget")
    r = row(1)
    r.update(reward_strategy=float("nan"), reward_timing=float("nan"), best_peak=None, best_step_time=None)
    d(r)
    assert d.frames == 1 and d.image.value[:4] == b"\x89PNG"
    assert "–" in d.stats.value
    assert np.isnan(r["reward_strategy"])
