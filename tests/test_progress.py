"""Progress of the long calls (memopt_nb.core.progress): the stages and counts profile, max_batch, measure, compare,
evaluate and the demo report, the command line's lines (silent for a short call, throttled otherwise) and the
notebook's bar (ends as text). Clocks are fake where times matter: nothing here asserts how long anything took."""

from __future__ import annotations

import functools

import pytest
import torch

import memopt_nb as memopt
import memopt_nb.core.progress as progress
import memopt_nb.harness.demo as demo_mod
from memopt_nb.__main__ import main
from memopt_nb.core.progress import ProgressLines, advance, listening, stage, task

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(seq_len=16, d_model=32, n_layers=2, n_heads=2, vocab=64)


def build(b: int):
    z = memopt.zoo.gpt(batch_size=b, **SIZES)
    return z.model, z.inputs, z.loss_fn


class Recorder:
    """A listener that keeps every event as ``(event, ((name, stage, total, done), ...))``."""

    def __init__(self) -> None:
        self.events: list[tuple[str, tuple[tuple[str, str, int | None, int], ...]]] = []
        self.outcomes: list[tuple[str, str | None]] = []

    def __call__(self, event, tasks) -> None:
        self.events.append((event, tuple((t.name, t.stage, t.total, t.done) for t in tasks)))
        if event == "end":
            self.outcomes.append((tasks[-1].name, tasks[-1].outcome))

    def stages(self, chain: tuple[str, ...]) -> list[tuple[str, int | None, int]]:
        """``(stage, total, done)`` of the innermost call at each of its stages and steps, for the calls ``chain``."""
        return [(c[-1][1], c[-1][2], c[-1][3]) for e, c in self.events
                if e in ("stage", "advance") and tuple(t[0] for t in c) == chain]

    def last(self, chain: tuple[str, ...]) -> dict[str, tuple[int | None, int]]:
        """Each stage of ``chain``'s innermost call, with its total and how many were done when it ended."""
        out: dict[str, tuple[int | None, int]] = {}
        for name, total, done in self.stages(chain):
            if name:
                out[name] = (total, done)
        return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    model, inputs, loss_fn = build(2)
    return model, inputs, loss_fn, torch.optim.Adam(model.parameters())


# ---------------------------------------------------------------------- what the long calls report
def test_profile_reports_its_stages_with_their_counts(small):
    model, inputs, loss_fn, opt = small
    rec = Recorder()
    with listening(rec):
        prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=2)
    assert rec.events[0] == ("start", (("profile", "", None, 0),)) and rec.outcomes == [("profile", "done")]
    stages = rec.last(("profile",))
    assert list(stages) == ["warm-up", "tracked steps", "timed steps", "optimizer steps"]
    assert stages["tracked steps"] == (2, 2) and stages["optimizer steps"] == (2, 2)
    # a step set aside as disturbed is measured again and not counted: all the kept steps are
    assert stages["timed steps"] == (2, 2) and prof.meta["timing"]["steps"] >= 2
    done = [d for s, _, d in rec.stages(("profile",)) if s == "timed steps"]
    assert done == sorted(done)  # counts only go up


def _bytes_only(x):
    """A profile's ``to_dict`` without what is measured by a clock (times, the meta's timing and dates)."""
    if isinstance(x, dict):
        return {k: _bytes_only(v) for k, v in x.items() if "time" not in k and k not in ("meta", "seconds")}
    if isinstance(x, (list, tuple)):
        return [_bytes_only(v) for v in x]
    return x


def test_a_listener_changes_nothing_a_profile_or_measurement_says(small):
    model, inputs, loss_fn, opt = small
    lines: list[str] = []
    quiet = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=2)
    with listening(ProgressLines(lines.append, delay=0.0, interval=0.0)):
        heard = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=2)
        measured = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=2)
    assert lines and _bytes_only(heard.to_dict()) == _bytes_only(quiet.to_dict())
    alone = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=2)
    assert (measured.peak_bytes, measured.losses) == (alone.peak_bytes, alone.losses)


def test_profile_with_fine_units_and_head_options_reports_merges_and_heads():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_layer=2, n_embd=32, n_head=2)).train()
    ids = torch.randint(0, 64, (2, 16))
    rec = Recorder()
    with listening(rec):
        prof = memopt.profile(model, input_ids=ids, labels=ids, loss_fn=lambda out: out.loss, units="fine",
                              head="chunked", repeats=1, optimizer=torch.optim.Adam(model.parameters()))
    stages = rec.last(("profile",))
    assert "merges" in stages and stages["merges"][0] == stages["merges"][1] >= 1 and prof.meta["split"]
    assert stages["head options"] == (2, 2)


def test_measure_reports_its_steps(small):
    model, inputs, loss_fn, opt = small
    rec = Recorder()
    with listening(rec):
        memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=opt, steps=3, warmup=2)
    assert rec.last(("measure",)) == {"warm-up and memory steps": (3, 3), "timed steps": (3, 3)}
    assert [d for s, _, d in rec.stages(("measure",)) if s == "timed steps"] == [0, 1, 2, 3]


def test_compare_reports_its_pairs_and_the_measurements_in_them(small):
    model, inputs, loss_fn, opt = small
    prof = memopt.profile(model, *inputs, loss_fn=loss_fn, optimizer=opt, repeats=1)
    rec = Recorder()
    with listening(rec):
        memopt.compare(model, *inputs, loss_fn=loss_fn, optimizer=opt, plan=memopt.solvers.recompute_all(prof),
                       steps=2)
    assert rec.last(("compare",)) == {"paired steps": (2, 2)}
    assert rec.outcomes.count(("measure", "done")) == 4 and rec.outcomes[-1] == ("compare", "done")
    assert rec.last(("compare", "measure"))["timed steps"] == (1, 1)


def test_max_batch_reports_probes_profiles_and_the_check():
    model, inputs, loss_fn = build(8)
    peak = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=torch.optim.Adam(model.parameters())).peak_bytes
    rec = Recorder()
    with listening(rec):
        fit = memopt.max_batch(build, int(0.8 * peak), optimizer=torch.optim.Adam)
    stages = rec.last(("max_batch",))
    assert stages["probe profiles"] == (3, 3)
    assert list(stages)[-3:] == ["finding the largest batch a plan fits", "checking the answer under its plan",
                                 "predicting throughput per batch"]
    profiles = [c for e, c in rec.events if e == "start" and c[-1][0] == "profile"]
    assert len(profiles) == len(fit.profiled) and all(c[0][0] == "max_batch" for c in profiles)
    assert {c[0][1] for c in profiles} <= {"probe profiles", "profiles near plain training's largest batch"}
    checks = [c for e, c in rec.events if e == "start" and c[-1][0] == "measure"]
    assert checks and all(c[0][1] == "checking the answer under its plan" for c in checks) and fit.verified
    assert rec.outcomes[-1] == ("max_batch", "done")


def test_evaluate_reports_profiles_and_each_method_at_each_batch():
    rec = Recorder()
    with listening(rec):
        memopt.evaluate(build, "a100-40gb", budget="60%", methods=("none", "recompute_all", "grad_accum"),
                        batch_sizes=[2, 4], reference_batch=4, steps=1)
    stages = rec.last(("evaluate",))
    assert stages == {"profiles": (2, 2), "methods at each batch": (4, 4),
                      "gradient accumulation at each batch": (2, 2)}


def test_a_nested_call_of_the_same_name_is_part_of_the_outer_one_and_failures_say_so():
    rec = Recorder()

    @task("outer")
    def outer(n: int) -> int:
        stage("inner calls", total=n)
        for _ in range(n):
            inner()
            advance()
        return n

    @task("outer")
    def same() -> None:
        stage("the same call again")

    @task("inner")
    def inner() -> None:
        same_inside = task("inner")(lambda: stage("nested"))
        same_inside()

    @task("failing")
    def failing() -> None:
        raise ValueError("no")

    with listening(rec):
        assert outer(2) == 2
        same()
        with pytest.raises(ValueError):
            failing()
    assert [c for e, c in rec.events if e == "start"] == [
        (("outer", "", None, 0),),
        (("outer", "inner calls", 2, 0), ("inner", "", None, 0)),
        (("outer", "inner calls", 2, 1), ("inner", "", None, 0)),
        (("outer", "", None, 0),),  # same(): a call of its own, not inside another
        (("failing", "", None, 0),)]
    assert ("stage", (("outer", "inner calls", 2, 0), ("inner", "nested", None, 0))) in rec.events
    assert rec.outcomes == [("inner", "done"), ("inner", "done"), ("outer", "done"), ("outer", "done"),
                            ("failing", "failed")]


def test_nobody_listening_costs_nothing_and_changes_nothing():
    calls = []

    @task("quiet")
    def quiet() -> str:
        stage("a stage", total=1)
        advance()
        calls.append(1)
        return "result"

    with listening(None):
        assert quiet() == "result"
    stage("outside any call")  # no call running: nothing, no error
    advance()
    assert calls == [1] and progress._tasks.get() == ()


def test_a_failing_listener_does_not_break_the_call():
    def broken(event, tasks):
        raise RuntimeError("display gone")

    @task("work")
    def work() -> int:
        stage("steps", total=2)
        advance()
        advance()
        return 7

    with listening(broken), pytest.warns(RuntimeWarning, match="display gone"):
        assert work() == 7


# ---------------------------------------------------------------------- the command line's lines
def run_fake(listener, clock: FakeClock, durations: list[float], name: str = "profile",
             stage_name: str = "timed steps") -> None:
    """A call of ``len(durations)`` steps, each taking its seconds on ``clock``."""
    @task(name)
    def call() -> None:
        stage(stage_name, total=len(durations))
        for d in durations:
            clock.now += d
            advance()
        clock.now += 0.5  # after the last step

    with listening(listener):
        call()


def run_nested(listener, clock: FakeClock, durations: list[float]) -> None:
    """``max_batch`` of two probes, each a call :func:`run_fake` makes of ``durations``."""
    @task("max_batch")
    def outer() -> None:
        stage("probe profiles", total=2)
        for _ in range(2):
            run_fake(listener, clock, durations)
            advance()

    with listening(listener):
        outer()


def test_a_call_shorter_than_the_delay_prints_nothing():
    clock, lines = FakeClock(), []
    run_fake(ProgressLines(lines.append, clock=clock), clock, [1.0] * 4)  # 4.5 s in all
    assert lines == []


def test_a_long_call_prints_throttled_lines_with_an_honest_estimate():
    clock, lines = FakeClock(), []
    run_fake(ProgressLines(lines.append, clock=clock, delay=5.0, interval=2.0), clock, [1.5] * 9)
    # steps end at 1.5, 3.0, ... 13.5 s: silent until 5 s, then at most one line every 2 s, then the end
    assert lines == ["memopt: profile 4/9 timed steps, about 7.5 s left",
                     "memopt: profile 6/9 timed steps, about 4.5 s left",
                     "memopt: profile 8/9 timed steps, about 1.5 s left",
                     "memopt: profile done in 14 s"]


def test_the_estimate_is_never_negative_nor_shown_once_the_stage_is_done():
    clock, lines = FakeClock(), []
    run_fake(ProgressLines(lines.append, clock=clock, delay=0.0, interval=0.0), clock, [3.0, 6.0, 0.0])
    assert lines == ["memopt: profile 0/3 timed steps", "memopt: profile 1/3 timed steps, about 6.0 s left",
                     "memopt: profile 2/3 timed steps, about 4.5 s left", "memopt: profile 3/3 timed steps",
                     "memopt: profile done in 9.5 s"]
    assert not any("-" in line for line in lines)


def test_nested_calls_show_as_one_line_and_only_the_outermost_says_it_is_done():
    clock, lines = FakeClock(), []
    run_nested(ProgressLines(lines.append, clock=clock, delay=5.0, interval=2.0), clock, [4.0, 4.0])
    # an estimate counts down while a step is under way: 8.5 s per probe, 4 s into the second
    assert lines == ["memopt: max_batch 0/2 probe profiles › profile 2/2 timed steps",
                     "memopt: max_batch 1/2 probe profiles, about 4.5 s left › profile 1/2 timed steps, about 4.0 s "
                     "left",
                     "memopt: max_batch 1/2 probe profiles, about 0.5 s left › profile 2/2 timed steps",
                     "memopt: max_batch done in 17 s"]


def test_lines_go_to_stderr_by_default(capsys):
    clock = FakeClock()
    run_fake(ProgressLines(clock=clock, delay=0.0), clock, [1.0])
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == "memopt: profile done in 1.5 s"


def test_the_demo_reports_its_phases():
    rec = Recorder()
    lines: list[str] = []
    with listening(rec):
        res = demo_mod.run_demo("mlp", steps=1, planner=lambda prof, budget: memopt.solvers.optimal(prof, budget),
                                out=lines.append)
    assert res["loss_matched"] is True
    assert rec.last(("demo",)) == {"profiling": (None, 0), "searching a plan": (None, 0),
                                   "measuring without and with the plan": (2, 2),
                                   "training without and with the plan": (2, 2)}
    assert ("profile", "done") in rec.outcomes and rec.outcomes[-1] == ("demo", "done")


def test_the_command_line_prints_progress_on_stderr(monkeypatch, capsys):
    quick = functools.partial(demo_mod.run_demo, planner=lambda prof, budget: memopt.solvers.optimal(prof, budget))
    monkeypatch.setattr(demo_mod, "run_demo", quick)
    monkeypatch.setattr(progress, "ProgressLines", functools.partial(ProgressLines, delay=0.0, interval=0.0))
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    assert main(["demo", "--model", "mlp", "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert "memopt: demo: profiling › profile 0/3 timed steps" in lines
    assert "memopt: demo 2/2 measuring without and with the plan" in lines and lines[-1].startswith("memopt: demo done")
    assert "memopt:" not in out and "loss matched" in out
    # MEMOPT_NB_PROGRESS=off: the same long call prints nothing on stderr
    clock = FakeClock()

    def fake_demo(*args, **kwargs):
        run_fake(progress._current(), clock, [1.0, 1.0], name="demo", stage_name="phases")
        return {"loss_matched": True}

    monkeypatch.setattr(demo_mod, "run_demo", fake_demo)
    assert main(["demo"]) == 0 and "memopt: demo 2/2 phases" in capsys.readouterr().err
    monkeypatch.setenv(progress.PROGRESS_ENV, "off")
    assert main(["demo"]) == 0 and capsys.readouterr().err == ""


# ---------------------------------------------------------------------- the notebook's bar
def test_the_bar_shows_after_its_delay_and_ends_as_text():
    pytest.importorskip("ipywidgets")
    from memopt_nb.notebook.progress import ProgressBar

    class Handle:
        def __init__(self) -> None:
            self.updates: list[dict] = []

        def update(self, data, raw=False):
            self.updates.append(data)

    shown: list = []
    handle = Handle()
    clock = FakeClock()
    bar = ProgressBar(clock=clock, delay=2.0, min_interval=0.0, display=lambda w: (shown.append(w), handle)[1])
    run_fake(bar, clock, [0.5, 0.5])  # 1.5 s: never shown
    assert shown == [] and bar.widget is None and bar.final is None
    run_nested(bar, clock, [1.5, 1.5])
    assert len(shown) == 1 and shown[0] is bar.widget and len(bar.bars) == 2
    assert bar.final == "memopt.max_batch done in 7.0 s"
    # every bar at its end, green; the first label says it; the output became that text
    assert all(b.value == 1.0 and b.bar_style == "success" for b in bar.bars)
    assert bar.labels[0].value == bar.final and bar.widget.children[1].layout.display == "none"
    assert handle.updates == [{"text/plain": bar.final, "text/html": f"<small>{bar.final}</small>"}]


def test_the_bar_skips_steps_between_redraws_but_never_a_stage_start_or_end():
    pytest.importorskip("ipywidgets")
    from memopt_nb.notebook.progress import ProgressBar

    clock = FakeClock()
    bar = ProgressBar(clock=clock, delay=0.0, min_interval=10.0, display=lambda w: None)
    labels: list[str] = []

    @task("profile")
    def call() -> None:
        for name in ("tracked steps", "timed steps"):
            stage(name, total=4)
            for _ in range(4):
                clock.now += 1.0
                advance()
                labels.append(bar.labels[0].value)

    with listening(bar):
        call()
    assert bar.draws == 4  # each stage's start and end
    assert labels[3] == "profile 4/4 tracked steps · 00:04 elapsed" and labels[-1].startswith("profile 4/4 timed steps")
    assert all("left" not in label for label in labels[:3])  # the steps between: not redrawn


def test_an_interrupted_call_leaves_its_bar_where_it_stopped():
    pytest.importorskip("ipywidgets")
    from memopt_nb.notebook.progress import ProgressBar

    clock = FakeClock()
    bar = ProgressBar(clock=clock, delay=0.0, min_interval=0.0, display=lambda w: None)

    @task("profile")
    def stopped() -> None:
        stage("timed steps", total=4)
        clock.now += 1.0
        advance()
        raise KeyboardInterrupt

    with listening(bar), pytest.raises(KeyboardInterrupt):
        stopped()
    assert bar.final == "memopt.profile interrupted after 1.0 s"
    assert bar.bars[0].value == 0.25 and bar.bars[0].bar_style == "warning"


def test_the_notebook_listener_is_off_outside_a_kernel():
    from memopt_nb.notebook.progress import notebook_listener

    assert notebook_listener() is None
