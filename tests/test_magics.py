"""The %memopt_profile / %%memopt_profile / %memopt_plan magics in an IPython shell."""

import math

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

import memopt_nb as memopt
import memopt_nb.notebook.dashboard as dashboard_mod  # where the magic's search is looked up
import memopt_nb.notebook.magics as magics_mod
from memopt_nb.core.cuts import outermost
from memopt_nb.notebook import magics
from memopt_nb.planners.floor import explain_floor


@pytest.fixture(scope="module")
def ip(ipython_shell):
    shell = ipython_shell
    shell.run_line_magic("load_ext", "memopt_nb")
    shell.run_cell(
        "import torch\nimport memopt_nb as memopt\n"
        "model, inputs, loss_fn, _ = memopt.zoo.gpt(batch_size=2, seq_len=32, d_model=32, n_layers=2, n_heads=2)\n"
        "(x,) = inputs\nopt = torch.optim.Adam(model.parameters())\nnot_a_model = 3\n"
    ).raise_error()
    yield shell
    shell.run_line_magic("unload_ext", "memopt_nb")


@pytest.fixture(scope="module")
def prof(ip):
    return ip.run_line_magic("memopt_profile", "model x --loss loss_fn --optimizer opt --repeats 1 -o prof")


@pytest.fixture(autouse=True)
def no_pager(monkeypatch):
    """Output must go through display/print: IPython's pager is lost when a notebook runs headless."""
    import IPython.core.page

    def refuse(*a, **k):
        raise AssertionError("the pager was used")

    monkeypatch.setattr(IPython.core.page, "page", refuse)


def test_magics_are_registered(ip):
    lines = ip.magics_manager.magics["line"]
    assert {"memopt_profile", "memopt_plan"} <= set(lines)
    assert "memopt_profile" in ip.magics_manager.magics["cell"]
    assert ip.extension_manager.load_extension("memopt_nb") == "already loaded"


def test_help_comes_from_magic_arguments(ip):
    doc = ip.find_line_magic("memopt_plan").__doc__
    assert "--budget" in doc and "--device" in doc and "--no-widget" in doc and "60%" in doc
    assert f"default: {magics.DEFAULT_PLAN_NAME}" in doc
    doc = ip.find_line_magic("memopt_profile").__doc__
    for opt in ("--loss", "--optimizer", "--units", "--selective", "-o", "-q", "--model", "--inputs"):
        assert opt in doc


def test_line_profile_stores_and_returns_a_profile(ip, prof):
    assert isinstance(prof, memopt.ModelProfile)
    assert ip.user_ns["prof"] is prof
    assert prof.unit_names == ["blocks.0", "blocks.1"]
    assert prof.optimizer_state_bytes > 0  # the optimizer was profiled with the model
    direct = memopt.profile(ip.user_ns["model"], ip.user_ns["x"], loss_fn=ip.user_ns["loss_fn"],
                            optimizer=ip.user_ns["opt"], repeats=1)
    assert direct.peak_bytes == prof.peak_bytes  # the magic profiles exactly what the API does


def test_star_inputs_optimizer_class_units_and_quiet(ip):
    out = ip.run_line_magic("memopt_profile", "model *inputs --loss loss_fn --optimizer Adam --units blocks.1 "
                                              "--repeats 1 -q -o p1")
    assert out is None
    p1 = ip.user_ns["p1"]
    assert p1.unit_names == ["blocks.1"] and p1.optimizer_state_bytes > 0
    assert p1.meta["selective"] is None


def test_selective_flag_measures_save_sets(ip):
    ip.run_line_magic("memopt_profile", "model x --loss loss_fn --repeats 1 --selective -q -o psel")
    psel = ip.user_ns["psel"]
    assert psel.meta["selective"]["measured"] is True
    assert any("matmuls" in u.save_sets for u in psel.units)


def test_trailing_semicolon_silences(ip):
    loud = ip.run_cell("%memopt_profile model x --repeats 1 -o p2")
    assert isinstance(loud.result, memopt.ModelProfile)
    quiet = ip.run_cell("%memopt_profile model x --repeats 1 -o p3;")
    quiet.raise_error()
    assert quiet.result is None and isinstance(ip.user_ns["p3"], memopt.ModelProfile)


def test_cell_magic_profiles_the_model_the_cell_defines(ip):
    cell = ("net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())"
            " for _ in range(3)])\nbatch = torch.randn(8, 16)\n")
    res = ip.run_cell_magic("memopt_profile", "--inputs batch -o cprof --repeats 1", cell)
    assert isinstance(res, memopt.ModelProfile) and ip.user_ns["cprof"] is res
    assert res.n_units == 3 and isinstance(ip.user_ns["net"], torch.nn.Sequential)
    # with --model, and the line's trailing ';' silences the cell magic too
    res = ip.run_cell_magic("memopt_profile", "--model net2 --inputs batch --repeats 1 -o cprof2;",
                            "net2 = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())\n")
    assert res is None and ip.user_ns["cprof2"].n_units == 2


def test_cell_magic_mistakes(ip):
    with pytest.raises(UsageError, match="several modules"):
        ip.run_cell_magic("memopt_profile", "--inputs batch", "a = torch.nn.Linear(16, 2)\nb = torch.nn.Linear(16, 2)")
    with pytest.raises(UsageError, match="no torch.nn.Module"):
        ip.run_cell_magic("memopt_profile", "--inputs batch", "y = 1")
    with pytest.raises(ZeroDivisionError):  # errors in the user's own code are not hidden
        ip.run_cell_magic("memopt_profile", "--inputs batch", "1 / 0")


@pytest.mark.parametrize("line, message", [
    ("", "give the model"),
    ("nosuchmodel x", "no variable named 'nosuchmodel'"),
    ("modle x", "did you mean model"),
    ("not_a_model x", "'not_a_model' is an int, not a torch.nn.Module"),
    ("model", "example inputs"),
    ("model nosuchinput", "no variable named 'nosuchinput'"),
    ("model *not_a_model", "cannot be unpacked"),
    ("model 'x +'", "not a Python name or expression"),
    ("model x --loss not_a_model", "not a function"),
    ("model x --optimizer adamx", "neither a variable in the notebook nor a torch.optim class"),
    ("model x --optimizer not_a_model", "not a torch.optim.Optimizer"),
    ("model x --units nosuch.module", "memopt.profile"),
    ("model x --repeats 0", "--repeats"),
    ("model x -o 1abc", "identifier"),
    ("model x --bogus", "there is no option --bogus"),
])
def test_profile_mistakes_are_usage_errors(ip, line, message):
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_profile", line)
    assert message in str(err.value)


def test_plan_stores_under_the_default_name(ip, prof, capsys):
    lo = memopt.solvers.min_peak(prof)
    budget = int(lo + 0.5 * (prof.peak_bytes - lo))
    ip.user_ns.pop(magics.DEFAULT_PLAN_NAME, None)
    p = ip.run_line_magic("memopt_plan", f"prof --budget {budget} --timesteps 96 --no-widget")
    assert isinstance(p, memopt.Plan) and ip.user_ns[magics.DEFAULT_PLAN_NAME] is p
    assert p.budget_bytes == budget and p.feasible and p.predicted_peak_bytes <= budget
    assert p.meta["total_timesteps"] == 96 and p.seed == 0
    out = capsys.readouterr().out
    assert "[memopt.search] iter" in out and "stored as `plan`" in out
    hist = p.meta["history"]
    assert hist and all(math.isfinite(r["best_peak"]) for r in hist if r["best_peak"] is not None)


def test_plan_percentage_device_seed_env_and_output(ip, prof, monkeypatch):
    lo = memopt.solvers.min_peak(prof)
    pct = math.ceil(100 * (lo + 0.5 * (prof.peak_bytes - lo)) / prof.peak_bytes)
    monkeypatch.setenv("MEMOPT_NB_TIMESTEPS", "96")
    res = ip.run_cell(f"%memopt_plan prof --budget {pct}% --device a100-40gb --seed 3 -o p_gpu --no-widget;")
    res.raise_error()
    assert res.result is None  # silenced
    p = ip.user_ns["p_gpu"]
    assert p.budget_bytes == int(prof.peak_bytes * pct / 100)
    assert p.device["name"] == "a100-40gb" and p.seed == 3 and p.meta["total_timesteps"] == 96


@pytest.mark.parametrize("line, message", [
    ("prof", "%memopt_plan needs --budget, e.g. %memopt_plan prof --budget 60%"),
    ("nosuch --budget 60%", "no variable named 'nosuch'"),
    ("model --budget 60%", "'model' is a GPT, not a ModelProfile"),
    ("prof --budget lots", "cannot read 'lots'"),
    ("prof --budget 0", "positive"),
    ("prof --budget 2000%", "percentage"),
    ("prof --budget 60% --device tpu-v9", "unknown device preset 'tpu-v9'"),
    ("prof --budget 60% --timesteps 0", "--timesteps must be a positive"),
    ("prof --budget 60% --timesteps many", "--timesteps 'many': give a whole number"),
    ("prof --budget 60% -o for", "identifier"),
])
def test_plan_mistakes_are_usage_errors(ip, prof, line, message):
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", line)
    assert message in str(err.value)


@pytest.mark.parametrize("magic, line, message", [
    ("memopt_profile", "model x --optimiser opt", "%memopt_profile: did you mean --optimizer? There is no option "
                                                  "--optimiser"),
    ("memopt_plan", "prof --budjet 60%", "%memopt_plan: did you mean --budget? There is no option --budjet"),
    ("memopt_plan", "prof --budget 20 MB", "write --budget 20MB, without a space between the number and the unit"),
    ("memopt_plan", "prof --budget 1.5 GiB --timesteps 96", "write --budget 1.5GiB, without a space"),
    ("memopt_plan", "prof --budget 60 %", "write --budget 60%, without a space"),
    ("memopt_plan", "prof --budget 60% --timesteps", "--timesteps needs a value after it"),
    ("memopt_plan", "prof --budget 60% --seed 1 stray", "%memopt_plan: did not expect stray"),
])
def test_typos_get_words_for_people(ip, prof, monkeypatch, magic, line, message):
    calls = []
    monkeypatch.setattr(dashboard_mod, "search", lambda *a, **k: calls.append(k))
    with pytest.raises(UsageError) as err:
        ip.run_line_magic(magic, line)
    msg = str(err.value)
    assert msg.startswith(message), msg
    assert "required" not in msg and "unrecognized arguments" not in msg and msg.count("\n") < 2
    assert calls == []


def test_a_unit_after_a_number_is_only_a_typo_for_a_size(ip):
    ip.user_ns["m"] = ip.user_ns["x"]  # an input named like a unit, after a numeric option, is an input
    with pytest.raises(UsageError, match="did not expect m"):
        ip.run_line_magic("memopt_profile", "model x --repeats 1 m -q")


def test_an_abbreviated_option_is_refused_naming_the_option(ip, prof, monkeypatch):
    # before: argparse took --budg for --budget (and --los for --loss); options are now written in full
    calls = spy_on_search(monkeypatch)
    with pytest.raises(UsageError, match="did you mean --budget"):
        ip.run_line_magic("memopt_plan", "prof --budg 90% --timesteps 96 -q -o p_abbrev")
    assert not calls and "p_abbrev" not in ip.user_ns


def test_budget_below_the_minimum_states_the_minimum(ip, prof):
    lo = memopt.solvers.min_peak(prof)
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", f"prof --budget {lo - 1} --timesteps 96")
    assert memopt.format_bytes(lo) in str(err.value) and str(lo) in str(err.value)
    with pytest.raises(UsageError, match="smallest peak"):
        ip.run_line_magic("memopt_plan", "prof --budget 1%")


def test_bad_env_timesteps_is_a_usage_error(ip, prof, monkeypatch):
    monkeypatch.setenv("MEMOPT_NB_TIMESTEPS", "lots")
    with pytest.raises(UsageError, match="MEMOPT_NB_TIMESTEPS"):
        ip.run_line_magic("memopt_plan", "prof --budget 90%")


def test_profile_display_in_a_notebook_is_table_and_chart(prof, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(magics, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: shown.append(obj))
    magics._profile_display(prof)
    bundle, image = shown
    assert "blocks.0" in bundle["text/html"] and "fwd ms" in bundle["text/html"]
    floor = memopt.format_bytes(memopt.solvers.min_peak(prof))
    assert f"Smallest reachable peak (any plan): {floor}" in bundle["text/html"]
    assert f"Smallest reachable peak: {floor}" in bundle["text/plain"] and "bounded by" in bundle["text/plain"]
    assert isinstance(image, IPython.display.Image) and image.data[:4] == b"\x89PNG"
    assert magics.profile_chart_html(prof).count("data:image/png;base64,") == 1


def test_profile_display_in_a_terminal_is_text(prof, capsys):
    magics._profile_display(prof)
    first, second = capsys.readouterr().out.strip().split("\n")
    assert first == repr(prof)
    assert second.startswith(f"Smallest reachable peak: {memopt.format_bytes(memopt.solvers.min_peak(prof))} (")


def test_unload_removes_everything_and_reload_works(ip, prof):
    from memopt_nb.notebook.magics import MemoptMagics

    fmt = ip.display_formatter.ipython_display_formatter
    assert fmt.lookup_by_type(memopt.ModelProfile) is magics._profile_display
    ip.run_line_magic("unload_ext", "memopt_nb")
    try:
        assert "memopt_profile" not in ip.magics_manager.magics["line"]
        assert "memopt_plan" not in ip.magics_manager.magics["line"]
        assert "memopt_profile" not in ip.magics_manager.magics["cell"]
        assert MemoptMagics.__name__ not in ip.magics_manager.registry
        with pytest.raises(KeyError):
            fmt.lookup_by_type(memopt.ModelProfile)
        with pytest.raises(UsageError):
            ip.run_line_magic("memopt_profile", "model x")
        with capture_output() as cap:
            ip.display_formatter.format(prof)
        assert not cap.outputs  # back to the plain rich repr
    finally:
        ip.run_line_magic("load_ext", "memopt_nb")
    assert "memopt_plan" in ip.magics_manager.magics["line"]
    assert fmt.lookup_by_type(memopt.ModelProfile) is magics._profile_display


def test_plan_semicolon_hides_the_result_and_quiet_hides_everything(ip, prof, capsys):
    lo = memopt.solvers.min_peak(prof)
    budget = int(lo + 0.5 * (prof.peak_bytes - lo))
    res = ip.run_cell(f"%memopt_plan prof --budget {budget} --timesteps 96 --no-widget -o p_semi;")
    res.raise_error()
    out = capsys.readouterr().out
    assert res.result is None and isinstance(ip.user_ns["p_semi"], memopt.Plan)
    assert "[memopt.search] iter" in out and "done: " in out  # the progress still shows, as the README says
    assert "stored as" not in out
    res = ip.run_cell(f"%memopt_plan prof --budget {budget} --timesteps 96 -q -o p_quiet")
    res.raise_error()
    assert res.result is None and capsys.readouterr().out == "" and isinstance(ip.user_ns["p_quiet"], memopt.Plan)


def test_plan_magic_reads_its_budget_with_the_api_parser(ip, prof, monkeypatch):
    calls = []
    real = memopt.resolve_budget

    def spy(value, reference=None):
        calls.append((value, reference))
        return real(value, reference=reference)

    monkeypatch.setattr(magics_mod, "resolve_budget", spy)
    lo = memopt.solvers.min_peak(prof)
    pct = math.ceil(100 * (lo + 0.5 * (prof.peak_bytes - lo)) / prof.peak_bytes)
    ip.run_line_magic("memopt_plan", f"prof --budget {pct}% --timesteps 96 -q -o p_spy")
    p = ip.user_ns["p_spy"]
    assert calls[0] == (f"{pct}%", prof.peak_bytes)
    assert p.budget_bytes == real(f"{pct}%", reference=prof.peak_bytes)


def test_budget_below_the_floor_says_what_bounds_it(ip, prof):
    lo = memopt.solvers.min_peak(prof)
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", f"prof --budget {lo - 1} --timesteps 96")
    floor = explain_floor(prof, offload_state=True)  # the magic's default space
    msg = str(err.value)
    assert floor.bound_text() in msg and floor.breakdown_text() in msg
    assert all(a.magic in msg for a in floor.advice)
    assert "add units" not in msg


def test_the_budget_error_says_what_to_ask_for_first_in_the_magics_spelling(ip, prof):
    lo = memopt.solvers.min_peak(prof)
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", f"prof --budget {lo - 1} --timesteps 96")
    first, *rest = str(err.value).split("\n")
    need = first.split("--budget ")[1].split(" ")[0].rstrip(",")
    assert first.startswith("Ask for at least --budget ") and lo <= memopt.resolve_budget(need) < lo + 2**20 // 100
    share = int(first.split("(")[1].split("%")[0])  # the minimum as a share of the unplanned peak, rounded up
    assert share - 1 < 100 * lo / prof.peak_bytes <= share
    assert "--step-in-backward" in first and "step_in_backward=True" not in str(err.value)
    assert len(rest) == 2 and str(lo) in rest[0]  # why, then the detail
    with pytest.raises(memopt.BudgetError) as api:  # the same error from Python speaks Python
        memopt.search(prof, lo - 1, total_timesteps=96)
    first = str(api.value).split("\n")[0]
    assert first.startswith("Ask for at least ") and "step_in_backward=True" in first and "--" not in first
    assert api.value.minimum_bytes == lo and api.value.budget_bytes == lo - 1


def test_a_profile_made_by_the_magic_gives_advice_in_the_magics_spelling(ip, prof, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(magics, "in_notebook", lambda: True)
    monkeypatch.setattr(IPython.display, "display", lambda obj, **k: shown.append(obj))
    magics._profile_display(prof)
    text = shown[0]["text/plain"] + shown[0]["text/html"]
    assert "--step-in-backward" in text and "step_in_backward=True" not in text
    api_prof = memopt.profile(ip.user_ns["model"], ip.user_ns["x"], loss_fn=ip.user_ns["loss_fn"],
                              optimizer=ip.user_ns["opt"], repeats=1)
    shown.clear()
    magics._profile_display(api_prof)
    assert "step_in_backward=True" in shown[0]["text/plain"]
    assert "not in units: activations saved outside every unit" in shown[0]["text/html"]
    assert shown[0]["text/html"].count(f"peak {memopt.format_bytes(api_prof.peak_bytes)}") == 1


def spy_on_search(monkeypatch):
    """The keyword arguments of every ``memopt.search`` call the magic makes (the search still runs)."""
    calls = []
    real = dashboard_mod.search

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(dashboard_mod, "search", spy)
    return calls


@pytest.mark.parametrize("flags, offload_state, step", [
    ("", True, False),
    ("--offload-state all", True, False),
    ("--offload-state none", False, False),
    ("--offload-state optimizer", {"optimizer"}, False),
    ("--offload-state 'grads, params' --step-in-backward", {"grads", "params"}, True),
    ("--offload-state OPTIMIZER,grads,params", {"optimizer", "grads", "params"}, False),
])
def test_plan_offload_state_flags_reach_the_search(ip, prof, monkeypatch, flags, offload_state, step):
    calls = spy_on_search(monkeypatch)
    ip.run_line_magic("memopt_plan", f"prof --budget 90% --timesteps 96 -q -o p_state {flags}")
    assert calls[0]["offload_state"] == offload_state and calls[0]["step_in_backward"] is step
    assert ip.user_ns["p_state"].step_in_backward is step


OFFLOAD_NAMES = ("all", "none", "optimizer, grads, params")
STRATEGY_NAMES = ("keep, recompute, swap",)


@pytest.mark.parametrize("flag, value, message, names", [
    ("--offload-state", "everything", "unknown 'everything'", OFFLOAD_NAMES),
    ("--offload-state", "optimizer,activations", "unknown 'activations'", OFFLOAD_NAMES),
    ("--offload-state", "optimizer,", "unknown ''", OFFLOAD_NAMES),
    ("--offload-state", "''", "empty", OFFLOAD_NAMES),
    ("--strategies", "keep,teleport", "unknown 'teleport'", STRATEGY_NAMES),
    ("--strategies", "keep,", "unknown ''", STRATEGY_NAMES),
    ("--strategies", "''", "empty", STRATEGY_NAMES),
])
def test_plan_space_flag_mistakes_are_usage_errors(ip, prof, monkeypatch, flag, value, message, names):
    calls = []
    monkeypatch.setattr(dashboard_mod, "search", lambda *a, **k: calls.append(k))
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", f"prof --budget 90% --timesteps 96 {flag} {value}")
    msg = str(err.value)
    assert message in msg and all(n in msg for n in names)
    assert calls == []


@pytest.mark.parametrize("flags, strategies", [
    ("", ("keep", "recompute", "swap")),
    ("--strategies keep,recompute", ("keep", "recompute")),
    ("--strategies 'swap, keep'", ("keep", "swap")),
    ("--strategies keep,recompute_offload", ("keep", "recompute_offload")),
])
def test_plan_strategies_flag_reaches_the_search_and_the_result(ip, prof, monkeypatch, capsys, flags, strategies):
    calls = spy_on_search(monkeypatch)
    ip.run_line_magic("memopt_plan", f"prof --budget 90% --timesteps 96 --no-widget -o p_strat {flags}")
    p = ip.user_ns["p_strat"]
    assert calls[0]["strategies"] == strategies and p.meta["allowed_strategies"] == list(strategies)
    assert set(p.strategies) <= set(strategies)
    out = capsys.readouterr().out
    shown = f"(activation strategies: {', '.join(strategies)})"
    assert (shown in out) is (strategies != ("keep", "recompute", "swap")) and "stored as `p_strat`" in out


def test_a_budget_below_the_floor_of_the_space_searched_states_that_floor(ip, prof):
    whole, keep = memopt.solvers.min_peak(prof), memopt.solvers.min_peak(prof, strategies=("keep",))
    assert whole < keep
    budget = (whole + keep) // 2
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", f"prof --budget {budget} --timesteps 96 --strategies keep")
    msg = str(err.value)
    floor = explain_floor(prof, offload_state=True, strategies=("keep",))
    assert "using only keep" in msg and memopt.format_bytes(keep) in msg and floor.breakdown_text() in msg
    assert "allow every activation strategy" in msg and memopt.format_bytes(whole) in msg


def test_plan_measure_shows_plan_vs_no_plan_vs_prediction(ip, prof, capsys):
    ip.run_line_magic("memopt_plan", "prof --budget 90% --timesteps 96 --no-widget --measure 2 -o p_meas")
    out = capsys.readouterr().out
    assert "no plan (measured)" in out and "(predicted)" in out and "median of 2 paired steps" in out
    c = ip.user_ns["_memopt_comparison"]
    assert len(c.ratios) == 2 and c.predicted_peak_bytes == ip.user_ns["p_meas"].predicted_peak_bytes
    ip.user_ns["api_prof"] = memopt.profile(ip.user_ns["model"], ip.user_ns["x"], loss_fn=ip.user_ns["loss_fn"],
                                            optimizer=ip.user_ns["opt"], repeats=1)
    with pytest.raises(UsageError, match="--measure needs a profile made by %memopt_profile"):
        ip.run_line_magic("memopt_plan", "api_prof --budget 90% --timesteps 96 --measure")


def test_a_profile_made_by_the_magic_does_not_keep_the_model_alive(ip):
    import gc
    import weakref

    ip.run_cell("tmp_model, (tmp_x,), tmp_loss, _ = memopt.zoo.gpt(batch_size=1, seq_len=8, d_model=16, n_layers=2, "
                "n_heads=2)").raise_error()
    alive = weakref.ref(ip.user_ns["tmp_model"])
    ip.run_line_magic("memopt_profile", "tmp_model tmp_x --loss tmp_loss --repeats 1 -q -o tmp_prof")
    ip.run_cell("del tmp_model, tmp_loss, _").raise_error()
    gc.collect()
    assert alive() is None
    with pytest.raises(UsageError, match="no longer exists"):
        ip.run_line_magic("memopt_plan", "tmp_prof --budget 90% --timesteps 64 -q --measure")


def test_the_stop_options_reach_the_search_and_a_bad_one_is_refused(ip, prof, monkeypatch):
    calls = spy_on_search(monkeypatch)
    ip.run_line_magic("memopt_plan", "prof --budget 90% --timesteps 96 --patience 3 --time-limit 30 -q -o p_stop")
    assert calls[-1]["patience"] == 3 and calls[-1]["time_limit"] == 30.0
    ip.run_line_magic("memopt_plan", "prof --budget 90% --timesteps 96 -q -o p_stop")
    assert "patience" not in calls[-1] and calls[-1]["time_limit"] is None  # the search's own defaults
    with pytest.raises(UsageError, match="time_limit"):
        ip.run_line_magic("memopt_plan", "prof --budget 90% --timesteps 96 --time-limit -1 -q -o p_stop")


# ---------------------------------------------------------------------- %memopt_plan --max-batch
BUILD = ("def build(b):\n"
         "    z = memopt.zoo.gpt(batch_size=b, seq_len=16, d_model=32, n_layers=3, n_heads=2, vocab=64)\n"
         "    return z.model, z.inputs, z.loss_fn\n")


@pytest.mark.slow
def test_max_batch_magic_answers_as_max_batch_does(ip, capsys):
    """``%memopt_plan --max-batch build --budget B``: the answer memopt.max_batch gives, stored as ``fit``, with its
    summary (the largest batch a plan fits, plain training's) printed; the same call in Python agrees."""
    ip.run_cell(BUILD).raise_error()
    z = memopt.zoo.gpt(batch_size=16, seq_len=16, d_model=32, n_layers=3, n_heads=2, vocab=64)
    budget = int(0.6 * memopt.measure(z.model, *z.inputs, loss_fn=z.loss_fn,
                                      optimizer=torch.optim.Adam(z.model.parameters())).peak_bytes)
    capsys.readouterr()
    assert ip.run_line_magic("memopt_plan", f"--max-batch build --optimizer Adam --budget {budget}") is None
    out = capsys.readouterr().out
    fit = ip.user_ns["fit"]
    assert isinstance(fit, memopt.MaxBatch) and fit.budget_bytes == budget
    assert f"batch {fit.batch} fits with a plan" in out and "plain training" in out and "stored as `fit`" in out
    ref = memopt.max_batch(ip.user_ns["build"], budget, optimizer=torch.optim.Adam)
    assert (fit.batch, fit.plain.batch) == (ref.batch, ref.plain.batch)  # (best_batch: from measured times)
    assert fit.batch > fit.plain.batch and fit.plan.predicted_peak_bytes <= budget


@pytest.mark.parametrize("line, expected", [
    ("--max-batch nosuch --budget 1MiB", "no variable named 'nosuch'"),
    ("--max-batch not_a_model --budget 1MiB", "'not_a_model' is an int, not a function builder(batch_size)"),
    ("--max-batch build --budget 60%", "a percentage needs a profile"),
    ("--max-batch build --budget 1MiB --timesteps 96", "--timesteps does not apply to --max-batch"),
    ("--budget 60%", "%memopt_plan needs a profile"),
])
def test_max_batch_magic_mistakes(ip, line, expected):
    ip.run_cell(BUILD).raise_error()
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", line)
    assert expected in str(err.value)


def test_mixed_depths_plans_whole_blocks_where_the_fine_units_do_not_fit(ip, prof, capsys):
    """Checkpointing only, a fine profile's units each pin their input when recomputed: below their floor the budget is
    refused, naming ``--mixed-depths``; with it, whole blocks are planned where that is enough."""
    ip.run_line_magic("memopt_profile", "model x --loss loss_fn --optimizer opt --repeats 1 --units fine -q -o pfine")
    fine = ip.user_ns["pfine"]
    assert fine.merges
    space = ("keep", "recompute")
    blocks = memopt.merge_units(fine, outermost(fine.merges))
    lo = memopt.solvers.min_peak(blocks, None, space, offload_state=False)
    hi = memopt.solvers.min_peak(fine, None, space, offload_state=False)
    assert lo < hi
    line = (f"pfine --budget {(lo + hi) // 2} --strategies keep,recompute --offload-state none --timesteps 96 "
            "--no-widget")
    with pytest.raises(UsageError, match="--mixed-depths"):
        ip.run_line_magic("memopt_plan", line)
    p = ip.run_line_magic("memopt_plan", line + " --mixed-depths -o pmixed")
    assert p is ip.user_ns["pmixed"] and p.feasible and p.meta["merged"]
    assert p.meta["depths"]["fine_step_time"] is None
    assert "whole blocks" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--units fine"):
        ip.run_line_magic("memopt_plan", "prof --budget 60% --mixed-depths")
