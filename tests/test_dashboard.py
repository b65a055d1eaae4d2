"""memopt_nb.notebook.dashboard: throttled synchronous redraws, a final frame, text fallback, no Output/threads."""

import base64
import html
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
    assert kinds == [widgets.HTML, widgets.HBox, widgets.Image, widgets.Accordion]
    assert [type(c) for c in d.widget.children[1].children] == [widgets.FloatProgress, widgets.HTML]
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

    def slow_png(fig, dpi=None, fast=False):
        clock.t += 1.0  # drawing "takes" one second of the fake clock
        return real(fig, dpi=dpi, fast=fast)

    monkeypatch.setattr(dash_mod, "figure_png", slow_png)
    d = SearchDashboard(mode="widget", min_interval=0.3, max_overhead=0.25, clock=clock)
    for i in range(20):
        clock.t += 0.5
        d(row(i + 1))
    # every draw costs 1 s, so the interval becomes 4 s: drawing stays at ~25% of the time
    assert d._image_interval == pytest.approx(4.0)
    assert 3 <= d.frames <= 6


def test_stats_show_progress_rate_and_time_left_and_the_fastest_plan():
    d = SearchDashboard(mode="widget", total_timesteps=800, title="my search")
    d(row(3))  # 240 of 800 timesteps after 3.0 s: 80 steps/s, 560 left -> 7 s
    assert "my search" in d.stats.value
    assert d.rate.value == "240/800 timesteps [00:03&lt;00:07, 80 steps/s]"
    assert memopt.format_bytes(900) in d.stats.value and "+100.0%" in d.stats.value
    assert d.progress.value == pytest.approx(0.3) and d.progress.bar_style == "info"
    assert dash_mod._rate_text(0, None, 0.0) == "0 timesteps [00:00<?, ? steps/s]"
    assert dash_mod._rate_text(3744, 3744, 4000.0, finished=True) == "3,744 timesteps [1:06:40, 1 steps/s]"


def test_text_and_picture_are_redrawn_together(monkeypatch):
    clock = Clock()
    real = dash_mod.figure_png

    def slow_png(fig, dpi=None, **kw):
        clock.t += 1.0  # drawing "takes" one second: the picture's interval stretches to 4 s
        return real(fig, dpi=dpi, **kw)

    monkeypatch.setattr(dash_mod, "figure_png", slow_png)
    d = SearchDashboard(mode="widget", min_interval=0.3, max_overhead=0.25, clock=clock, total_timesteps=80 * 21)
    stats, images = [], []
    d.stats.observe(lambda ch: stats.append(ch["new"]), "value")
    d.image.observe(lambda ch: images.append(ch["new"]), "value")
    for i in range(21):
        clock.t += 0.5
        d(row(i + 1))
        # what you read is what you see: the stats name the last iteration the picture shows
        (line,) = [ln for ln in d._fig.axes[1].get_lines() if ln.get_label().startswith("peak of the fastest")]
        shown = max(line.get_xdata())
        assert f"PPO iteration <b>{int(shown)}</b>" in d.agents_text.value
    assert len(stats) == len(images) == d.frames and 3 <= d.frames <= 7


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
    tl = [a for a in d._fig.axes if a.get_title().startswith("memory over one step")][0]
    best = [ln for ln in tl.get_lines() if ln.get_label().startswith("returned plan:")]
    assert len(best) == 1 and memopt.format_bytes(plan.predicted_peak_bytes) in best[0].get_label()
    base = [ln for ln in tl.get_lines() if ln.get_label().startswith("unoptimized:")][0]
    assert max(base.get_ydata()) > max(best[0].get_ydata())
    rewards = d._agents_fig.axes[0]  # drawn at the end for the collapsed section
    assert {ln.get_label() for ln in rewards.get_lines()} >= {"strategy agent", "timing agent"}
    assert d.agents.selected_index is None and d.agents_image.value[:4] == b"\x89PNG"


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
    assert len(lines) == 4  # the heading naming the device, then t = 0, 5, 10
    assert lines[0] == (f"[memopt.search] memopt.search for {prof.device.name} (an interrupt, Ctrl-C, stops it and "
                        "keeps the best plan so far)")
    assert lines[1].startswith("[memopt.search] iter    1") and "best peak" in lines[1]
    plan = memopt.Plan.uniform(prof, "recompute")
    d.finish(plan)
    assert len(lines) == 6  # the last row (not printed yet), then the summary
    assert "iter   12" in lines[4] and lines[5].startswith("done: ") and plan.summary() in lines[5]
    assert d.frames == 0  # text mode never renders images


def test_auto_mode_outside_a_kernel_is_text(capsys, prof, budget):
    assert not in_notebook()
    plan = live_search(prof, budget, total_timesteps=96)
    out = capsys.readouterr().out
    assert "[memopt.search] iter" in out and "done: " in out
    assert plan.meta["requested_timesteps"] == 96


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
    assert "no plan within the budget 1000 B yet" in d.stats.value and "–" in d.agents_text.value
    assert np.isnan(r["reward_strategy"])


# ---------------------------------------------------------------------- one source of numbers, the device, the end
class FakeHandle:
    def __init__(self):
        self.updates = []

    def update(self, obj, raw=False, metadata=None):
        self.updates.append((obj, raw))
        self.metadata = metadata


@pytest.fixture
def displayed(monkeypatch):
    """Record what the dashboard displays (as a kernel would receive it)."""
    import IPython.display

    shown, handle = [], FakeHandle()

    def fake_display(*objs, raw=False, display_id=None, **kw):
        shown.append((objs, raw, display_id))
        return handle if display_id else None

    monkeypatch.setattr(IPython.display, "display", fake_display)
    return shown, handle


def test_the_end_leaves_the_picture_and_the_summary_as_ordinary_outputs(prof, budget, displayed):
    shown, handle = displayed
    d = SearchDashboard(prof, mode="widget", device="a100-40gb")
    plan = d.run(prof, budget, "a100-40gb", total_timesteps=96, seed=0)
    (first, rest) = shown[0], shown[1:]
    assert first[0] == (d.widget,) and first[2] is True  # the live widget, with a display id
    (update, raw), = handle.updates  # replaced in place by one output: the final dashboard
    assert raw and base64.b64decode(update["image/png"]) == d.png == d.image.value
    assert rest == []  # nothing else: one output
    text = update["text/plain"]
    assert text.endswith(d._final_text()) and "for a100-40gb" in text
    assert "done: " in text and plan.summary() in text
    page = update["text/html"]
    assert html.escape(d._final_text().split("\n")[0]) in page
    assert page.count("<img") == 2 and "<details><summary>how the agents learn</summary>" in page
    assert page.index("memory timeline") < page.index("<details>")  # the memory first, the agents collapsed
    assert handle.metadata == {"image/png": {"width": dash_mod._png_width(d.png) // 2}}  # 2x pixels, shown at 1x


def test_the_device_is_named_in_the_heading_the_summary_and_the_plan(prof, budget):
    d = SearchDashboard(prof, mode="widget", device="a100-40gb", static=False)
    plan = d.run(prof, budget, "a100-40gb", total_timesteps=96, seed=0)
    assert f"memopt.search for a100-40gb (profiled on {prof.device.name})" in d.stats.value
    assert "done: Plan[memopt-ppo] for a100-40gb" in d.stats.value
    assert "for a100-40gb" in repr(plan) and "for a100-40gb" in plan._repr_html_()
    assert "for a100-40gb" in d._fig._suptitle.get_text()


def test_stats_summary_and_figure_show_the_returned_plan(prof, budget):
    d = SearchDashboard(prof, mode="widget", static=False)
    plan = d.run(prof, budget, total_timesteps=144, seed=0)
    fb = memopt.format_bytes
    # once done, the stats are the returned plan's figures, the same the plan's repr and the figure show
    assert f"predicted peak {fb(plan.predicted_peak_bytes)}" in d.stats.value
    assert f"step {plan.predicted_step_time * 1e3:.2f} ms" in d.stats.value
    assert "fastest plan within the budget so far" not in d.stats.value
    star = [ln for ln in d._fig.axes[1].get_lines() if ln.get_label().startswith("returned plan:")]
    assert len(star) == 1 and fb(plan.predicted_peak_bytes) in star[0].get_label()
    # "done" comes with the timesteps that ran, not "x / y"
    run = plan.meta["timesteps_run"]
    assert run == plan.meta["total_timesteps"] == d.history[-1]["global_step"]
    assert f"{run:,} timesteps in" in d.stats.value and d.rate.value.startswith(f"{run:,} timesteps [")
    rate = f"{run / plan.meta['search_seconds']:,.0f} steps/s"  # one figure for the rate, too
    assert rate in d.rate.value and rate in d.stats.value
    if plan.meta["polish"] == "ran" and not plan.meta["polish_moves"]:
        assert "could not improve it" in d.stats.value


def test_an_interrupted_search_reads_interrupted_and_shows_no_polish(prof, budget):
    class Interrupting(SearchDashboard):
        def __call__(self, row):
            super().__call__(row)
            if len(self.history) == 2:
                raise KeyboardInterrupt

    d = Interrupting(prof, mode="widget", static=False)
    plan = d.run(prof, budget, total_timesteps=2000, seed=0)
    assert plan.meta["interrupted"] and plan.meta["polish"] == "skipped: interrupted"
    assert plan.meta["polished_step_time"] is None and plan.meta["polish_moves"] == 0
    assert d.progress.description == "interrupted" and d.progress.bar_style == "warning"
    assert d.progress.value < 1.0  # the bar shows how far the search got
    assert "done" not in d.stats.value and "interrupted: Plan[" in d.stats.value
    assert f"interrupted after {plan.meta['timesteps_run']:,} of {plan.meta['total_timesteps']:,}" in d.stats.value
    assert "polish)" not in d.stats.value and "not polished (skipped: interrupted)" in d.stats.value
    assert d._fig._suptitle.get_text().endswith(": interrupted")


def test_the_polish_time_is_only_reported_when_the_polish_ran(prof, budget):
    plan = memopt.search(prof, budget, total_timesteps=96, seed=0, polish_plan=False)
    assert plan.meta["polish"] == "off" and plan.meta["polished_step_time"] is None
    d = SearchDashboard(prof, mode="none")
    d.finish(plan)
    assert "polish" not in d._final_text()


def test_a_plan_polished_from_a_baseline_says_so(prof, budget):
    """When the polish's fastest result started from a baseline's plan, the summary names that start rather than
    crediting the agents' plan with the changes."""
    plan = memopt.search(prof, budget, total_timesteps=96, seed=0)
    d = SearchDashboard(prof, mode="none")
    plan.meta.update(polish="ran", polish_start="sqrt_n", polish_moves=3)
    d.finish(plan)
    text = d._final_text()
    assert "starting from the sqrt_n baseline's plan" in text and "after 3 change(s)" in text
    assert "then changed" not in text
    for start in ("agents", "agents_placed", "polished_placed_again"):  # the agents' plan, its state placed again
        plan.meta.update(polish_start=start)
        d.finish(plan)
        assert "then changed 3 unit decision(s)" in d._final_text()
    plan.meta.update(polish_start="plain_placed_again")
    d.finish(plan)
    assert "starting from keep-all with its best state placement" in d._final_text()


def test_a_plan_for_another_device_warns_once_when_applied():
    model, inputs, loss_fn, _ = memopt.zoo.gpt(batch_size=2, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, repeats=1)
    gpu_plan = memopt.solvers.recompute_all(prof, device="a100-40gb")
    with pytest.warns(UserWarning, match="made for a100-40gb but the model is on the CPU"):
        with memopt.plan(gpu_plan, model):
            loss_fn(model(*inputs)).backward()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with memopt.plan(gpu_plan, model):  # once per plan
            loss_fn(model(*inputs)).backward()
        with memopt.plan(memopt.solvers.recompute_all(prof), model):  # made for this device: no warning
            loss_fn(model(*inputs)).backward()


def test_the_plan_table_says_swap_timing_in_words(prof):
    p = memopt.Plan.from_strategies(prof, ["swap"] * prof.n_units, offload_window=0, prefetch_distance=0)
    text = p._repr_html_()
    assert ("copy to host done before the next forward; copy back when its backward starts (window 0, prefetch 0)"
            in text)
    p = memopt.Plan.from_strategies(prof, ["swap"] * prof.n_units, offload_window=2, prefetch_distance=1)
    assert "may overlap the next 2 forwards; copy back starts 1 unit ahead in backward" in p._repr_html_()


def test_the_top_line_speaks_peak_budget_slowdown_and_time():
    clock = Clock()
    d = SearchDashboard(mode="widget", clock=clock, total_timesteps=800, title="my search")
    r = row(3)
    r.update(best_step_time=0.107, base_step_time=0.1, seconds=3.0, global_step=240)
    d(r)
    top = d.stats.value
    assert "best plan so far: predicted peak <b>900 B</b> / budget 1000 B (no plan: 1.95 KiB)" in top
    assert "step <b>+7.0%</b> vs no plan (107.00 ms vs 100.00 ms)" in top and "00:03 elapsed, about 00:07 left" in top
    assert dash_mod.STOP_HINT in top and "reward" not in top and "agent" not in top
    # the agents' figures are in the collapsed section, not drawn while it is closed
    assert d.agents.selected_index is None and d.agents.get_title(0) == "how the agents learn"
    assert "strategy agent" in d.agents_text.value and d.agents_image.value == b""
    d.agents.selected_index = 0  # opening it draws the curves so far
    assert d.agents_image.value[:4] == b"\x89PNG"


def test_the_final_picture_is_drawn_at_twice_the_resolution(prof, budget):
    d = SearchDashboard(prof, mode="widget", static=False)
    d.run(prof, budget, total_timesteps=96, seed=0)
    width = dash_mod._png_width(d.png)
    assert width >= 2 * 10 * d.dpi * 0.9  # a 10-inch figure at twice the live frames' dpi
    assert d.image.layout.width == f"{width // 2}px"


def test_the_magic_does_not_show_the_plan_twice(prof, budget):
    d = SearchDashboard(prof, mode="none", show_plan=False)
    plan = memopt.search(prof, budget, total_timesteps=96, seed=0)
    d.finish(plan)
    text = d._final_text()
    assert plan.summary() not in text and "Plan[" not in text
    assert text.startswith(f"done: predicted peak {memopt.format_bytes(plan.predicted_peak_bytes)} / budget")
    assert "vs no plan" in text and "(no plan: –)" not in text
