"""memopt_nb.notebook.plots: every function returns a Figure that shows what it says, from the public API only."""

import math

import matplotlib
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

import memopt_nb as memopt
from memopt_nb.notebook import plots


@pytest.fixture(scope="module")
def prof():
    model, inputs, loss_fn, _ = memopt.zoo.gpt(batch_size=2, seq_len=32, d_model=32, n_layers=3, n_heads=2)
    opt = torch.optim.Adam(model.parameters())
    return memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)


def rows(n=6, with_nan=True, feasible_from=2):
    out = []
    for i in range(1, n + 1):
        out.append({
            "iteration": i, "global_step": 80 * i, "seconds": 0.1 * i,
            "reward_strategy": float("nan") if (with_nan and i == 1) else -10.0 + i,
            "reward_timing": 2.0 - 0.1 * i, "entropy_strategy": 1.0, "entropy_timing": 1.0,
            "best_step_time": None if i < feasible_from else 0.12 - 0.001 * i,
            "best_peak": None if i < feasible_from else 900.0 - 10 * i,
            "feasible_fraction": 0.5, "budget": 1000, "base_step_time": 0.1, "base_peak": 2000.0,
        })
    return out


def lines_with_label(ax, prefix):
    return [ln for ln in ax.get_lines() if ln.get_label().startswith(prefix)]


def test_figures_are_agg_and_render_to_png(prof):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    fig = plots.unit_chart(prof)
    assert isinstance(fig, Figure) and isinstance(fig, plots.MemoptFigure)
    png = plots.figure_png(fig)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == before  # not registered with pyplot: nothing shown twice, nothing leaks


def test_memory_timeline_draws_each_plan_and_the_budget(prof):
    keep = memopt.Plan.uniform(prof, "keep")
    rc = memopt.Plan.uniform(prof, "recompute")
    fig = plots.memory_timeline(prof, {"keep": keep, "recompute": rc}, budget="60%")
    ax = fig.axes[0]
    (k_line,) = lines_with_label(ax, "keep:")
    (r_line,) = lines_with_label(ax, "recompute:")
    sim_k = memopt.simulate(prof, keep)
    sim_r = memopt.simulate(prof, rc)
    # the curves are the simulator's timelines, scaled to the axis unit
    div = 2**20 if sim_k.peak_bytes >= 2**20 else 2**10
    assert np.allclose(k_line.get_ydata(), [r["bytes"] / div for r in sim_k.timeline])
    assert np.allclose(r_line.get_xdata(), [r["time"] * 1e3 for r in sim_r.timeline])
    assert max(k_line.get_ydata()) == pytest.approx(sim_k.peak_bytes / div)
    # the budget line sits at 60% of the profiled peak
    budget = [ln for ln in ax.get_lines() if ln.get_label().startswith("budget")]
    assert len(budget) == 1 and budget[0].get_ydata()[0] == pytest.approx(0.6 * prof.peak_bytes / div)
    assert "peak" in k_line.get_label() and memopt.format_bytes(sim_k.peak_bytes) in k_line.get_label()


def test_memory_timeline_accepts_simresults_lists_and_devices(prof):
    rc = memopt.Plan.uniform(prof, "recompute")
    sim = memopt.simulate(prof, rc, device="a100-40gb")
    fig = plots.memory_timeline(None, [sim], labels=["on a100"], budget=prof.peak_bytes)
    assert lines_with_label(fig.axes[0], "on a100:")
    fig2 = plots.memory_timeline(prof, rc, device="a100-40gb")
    x1 = lines_with_label(fig.axes[0], "on a100:")[0].get_xdata()
    x2 = lines_with_label(fig2.axes[0], "recompute_all:")[0].get_xdata()
    assert np.allclose(x1, x2)  # simulated for the same device
    with pytest.raises(ValueError, match="profile"):
        plots.memory_timeline(None, rc)
    with pytest.raises(ValueError, match="labels"):
        plots.memory_timeline(prof, [rc], labels=["a", "b"])
    with pytest.raises(TypeError):
        plots.memory_timeline(prof, ["not a plan"])
    with pytest.raises(memopt.BudgetError):
        plots.memory_timeline(prof, rc, budget="lots")


def test_unit_chart_colours_units_by_strategy_and_labels_swap_timing(prof):
    strategies = ["swap", "recompute", "keep"][: prof.n_units]
    plan = memopt.Plan.from_strategies(prof, strategies, offload_window=2, prefetch_distance=0)
    fig = plots.unit_chart(prof, plan)
    ax_mem, ax_time = fig.axes
    bars = [p for p in ax_mem.patches if p.get_fill()][: prof.n_units]
    for bar, s in zip(bars, strategies):
        assert matplotlib.colors.to_rgb(bar.get_facecolor()) == pytest.approx(plots.STRATEGY_COLORS[s], abs=1e-6)
    texts = [t.get_text() for t in ax_mem.texts]
    assert "w2 d0" in texts and len(texts) == strategies.count("swap")
    heights = [b.get_height() for b in bars]
    assert heights == pytest.approx([u.saved_bytes / 2**20 if max(x.saved_bytes for x in prof.units) >= 2**20
                                     else u.saved_bytes / 2**10 for u in prof.units])
    assert [t.get_text() for t in ax_time.get_xticklabels()] == prof.unit_names
    other = memopt.Plan.from_strategies(prof, ["keep"] * prof.n_units)
    other = memopt.Plan(decisions=other.decisions[:-1])
    with pytest.raises(ValueError, match="other units"):
        plots.unit_chart(prof, other)


def test_reward_curves_skip_nan_and_show_both_agents():
    h = rows()
    fig = plots.reward_curves(h)
    ax = fig.axes[0]
    (s,) = lines_with_label(ax, "strategy agent")
    (t,) = lines_with_label(ax, "timing agent")
    assert list(s.get_xdata()) == [2, 3, 4, 5, 6]  # iteration 1 had no finished episode
    assert list(s.get_ydata()) == pytest.approx(list(plots.smooth([math.nan, -8.0, -7.0, -6.0, -5.0, -4.0])[1:]))
    assert len(t.get_xdata()) == 6
    with pytest.raises(TypeError):
        plots.reward_curves(h[0])
    with pytest.raises(TypeError):
        plots.reward_curves([1, 2])


def test_reward_curves_are_smoothed_with_the_raw_values_faint_behind():
    h = rows(40, with_nan=False)
    noisy = [(-1.0) ** i * 3.0 + 0.1 * i for i in range(40)]
    for r, v in zip(h, noisy):
        r["reward_strategy"] = v
    ax = plots.reward_curves(h).axes[0]
    (smoothed,) = lines_with_label(ax, "strategy agent")
    raw = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == noisy]
    assert len(raw) == 1 and raw[0].get_alpha() < 0.5 and raw[0].get_color() == smoothed.get_color()
    assert raw[0].get_label().startswith("_")  # not in the legend
    tv = lambda y: float(np.abs(np.diff(y)).sum())  # noqa: E731
    assert tv(smoothed.get_ydata()) < 0.3 * tv(noisy)
    assert plots.smooth([1.0, 2.0, 3.0], weight=0.0) == pytest.approx([1.0, 2.0, 3.0])
    assert plots.smooth([5.0] * 50)[-1] == pytest.approx(5.0)  # debiased: a constant stays that constant


def test_peak_curve_draws_best_peak_budget_and_base():
    fig = plots.peak_curve(rows(feasible_from=3))
    ax = fig.axes[0]
    (best,) = lines_with_label(ax, "peak of the fastest plan within the budget")
    assert list(best.get_xdata()) == [3, 4, 5, 6]
    (budget,) = lines_with_label(ax, "budget")
    (base,) = lines_with_label(ax, "unoptimized")
    # the largest value (2000 B) sets the unit: KiB
    assert ax.get_ylabel() == "peak (KiB)"
    assert budget.get_ydata()[0] == pytest.approx(1000 / 1024) and base.get_ydata()[0] == pytest.approx(2000 / 1024)
    assert best.get_ydata()[-1] == pytest.approx(840 / 1024)
    fig = plots.peak_curve(rows(feasible_from=99))
    assert any("no plan within the budget yet" in t.get_text() for t in fig.axes[0].texts)


def overlaps(fig, artist, ax):
    fig.canvas.draw()
    a = artist.get_window_extent()
    b = ax.get_window_extent()
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_legends_and_notes_do_not_cover_the_plot(prof):
    keep = memopt.simulate(prof, memopt.Plan.uniform(prof, "keep"))
    fig = plots.search_figure(rows(), unoptimized=keep)
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            assert not overlaps(fig, legend, ax), ax.get_title()
        for t in ax.texts:  # a note inside the axes would sit on the curves
            assert t.get_text() in (" forward", " backward"), t.get_text()
    fig = plots.memory_timeline(prof, {"unoptimized": memopt.Plan.uniform(prof, "keep"),
                                       "plan": memopt.Plan.uniform(prof, "recompute")}, budget="60%")
    assert not overlaps(fig, fig.axes[0].get_legend(), fig.axes[0])


def test_the_same_colours_in_every_figure(prof):
    to_rgb = matplotlib.colors.to_rgb
    keep, rc = memopt.Plan.uniform(prof, "keep"), memopt.Plan.uniform(prof, "recompute")
    ax = plots.memory_timeline(prof, {"unoptimized": keep, "plan": rc}, budget="60%").axes[0]
    dash = plots.search_figure(rows(), unoptimized=memopt.simulate(prof, keep), best=memopt.simulate(prof, rc),
                               budget=0.6 * prof.peak_bytes)
    tl = dash.axes[0]
    peaks = dash.axes[1]
    for axis, base_label, plan_label in ((ax, "unoptimized:", "plan:"), (tl, "unoptimized:", "returned plan:")):
        assert to_rgb(lines_with_label(axis, base_label)[0].get_color()) == to_rgb(plots.BASE_COLOR)
        assert to_rgb(lines_with_label(axis, plan_label)[0].get_color()) == to_rgb(plots.PLAN_COLOR)
        assert to_rgb(lines_with_label(axis, "budget")[0].get_color()) == to_rgb(plots.BUDGET_COLOR)
    assert to_rgb(lines_with_label(peaks, "budget")[0].get_color()) == to_rgb(plots.BUDGET_COLOR)
    assert to_rgb(lines_with_label(peaks, "unoptimized")[0].get_color()) == to_rgb(plots.BASE_COLOR)
    assert to_rgb(lines_with_label(peaks, "peak of the fastest")[0].get_color()) == to_rgb(plots.PLAN_COLOR)
    # a plan that keeps every unit is the unoptimized step, whatever it is called
    ax = plots.memory_timeline(prof, [keep, rc]).axes[0]
    assert to_rgb(ax.get_lines()[0].get_color()) == to_rgb(plots.BASE_COLOR)


def test_search_figure_panels_and_redraw_into_the_same_figure(prof):
    keep = memopt.simulate(prof, memopt.Plan.uniform(prof, "keep"))
    rc = memopt.Plan.uniform(prof, "recompute")
    best = memopt.simulate(prof, rc)
    fig = plots.search_figure(rows(), unoptimized=keep)
    assert isinstance(fig, Figure)
    titles = [a.get_title() for a in fig.axes]
    assert titles[0].startswith("memory over one step: unoptimized (the plan is added")  # the memory first
    assert titles[1].startswith("peak memory of the fastest plan found")
    assert not any("agent" in t for t in titles)  # the agents' curves are agents_figure's
    same = plots.search_figure(rows(8), unoptimized=keep, best=best, fig=fig, plan=rc, title="done")
    assert same is fig
    titles = [a.get_title() for a in fig.axes]
    assert "memory over one step: unoptimized vs returned plan" in titles
    assert len([a for a in fig.axes if a.get_title()]) == 3  # cleared, not stacked
    (s,) = lines_with_label(plots.agents_figure(rows(8)).axes[0], "strategy agent")
    assert len(s.get_xdata()) == 7
    # the returned plan is marked with its own predicted figures, the same numbers the summary states
    assert not lines_with_label(fig.axes[1], "returned plan:")  # a plan without predictions has nothing to mark
    planned = memopt.solvers.recompute_all(prof)
    plots.search_figure(rows(8), unoptimized=keep, best=best, fig=fig, plan=planned, title="done")
    (star,) = lines_with_label(fig.axes[1], "returned plan:")
    div = 2**20 if max(planned.predicted_peak_bytes, 2000) >= 2**20 else 2**10
    assert star.get_ydata()[0] == pytest.approx(planned.predicted_peak_bytes / div)
    assert memopt.format_bytes(planned.predicted_peak_bytes) in star.get_label()
    (star_t,) = lines_with_label(fig.axes[2], "returned plan:")
    assert star_t.get_ydata()[0] == pytest.approx((planned.predicted_step_time / 0.1 - 1) * 100)
    assert fig._suptitle.get_text() == "done"


def test_history_from_a_plan(prof):
    plan = memopt.Plan.uniform(prof, "keep")
    with pytest.raises(ValueError, match="history"):
        plots.reward_curves(plan)
    plan.meta["history"] = rows(3)
    assert all(math.isfinite(y) for y in lines_with_label(plots.reward_curves(plan).axes[0], "timing")[0].get_ydata())


def test_iteration_axes_have_whole_numbers_even_at_the_first_iteration(prof):
    keep = memopt.simulate(prof, memopt.Plan.uniform(prof, "keep"))
    for fig in (plots.search_figure(rows(1), unoptimized=keep), plots.agents_figure(rows(1))):
        fig.canvas.draw()
        for ax in fig.axes:
            if ax.get_xlabel() != "PPO iteration":
                continue
            lo, hi = ax.get_xlim()
            assert lo < 1 < hi and hi - lo >= 1, (lo, hi)
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_the_step_time_axis_starts_at_zero(prof):
    history = rows(6)
    for i, r in enumerate(history):
        r["best_step_time"] = 0.151 + 0.001 * i  # +51% .. +56%: must not fill the axis
        r["base_step_time"] = 0.1
    fig = plots.search_figure(history, unoptimized=memopt.simulate(prof, memopt.Plan.uniform(prof, "keep")))
    lo, hi = fig.axes[2].get_ylim()
    assert lo == 0 and hi >= 56


def test_the_saved_picture_keeps_the_legends_whole(prof):
    import io

    from PIL import Image

    keep = memopt.simulate(prof, memopt.Plan.uniform(prof, "keep"))
    rc = memopt.simulate(prof, memopt.Plan.uniform(prof, "recompute"))
    fig = plots.search_figure(rows(8), unoptimized=keep, best=rc, budget=0.6 * prof.peak_bytes)
    png = plots.figure_png(fig, dpi=100)
    w, h = Image.open(io.BytesIO(png)).size
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.get_tightbbox(renderer)  # inches: everything drawn, legends included
    assert w >= box.width * 100 - 2 and h >= box.height * 100 - 2
