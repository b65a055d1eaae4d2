"""Inputs checked before they cost a run: ``max_batch``'s builder and optimizer, the magics' words and numbers, and no
third-party solver output in the user's cell.

Every refusal is one line, saying what was wrong and what works.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

import pytest
import torch
from IPython.core.error import UsageError

import memopt_nb as memopt
import memopt_nb.notebook.dashboard as dashboard_mod
from memopt_nb.core.budget import MIN_TYPED_BYTES, check_typed_budget, is_share, resolve_budget
from memopt_nb.core.errors import BudgetError, MemoptError
from memopt_nb.core.plan import optimizer_differences, optimizer_fingerprint
from memopt_nb.core.quiet import third_party_quiet
from memopt_nb.harness.maxbatch import NO_OPTIMIZER, optimizer_maker
from memopt_nb.harness.synthetic import chain_profile
from memopt_nb.planners import milp as milp_mod

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = dict(seq_len=16, d_model=32, n_layers=2, n_heads=2, vocab=64)


def build(b: int):
    z = memopt.zoo.gpt(batch_size=b, **SIZES)
    return z.model, z.inputs, z.loss_fn


def grouped_adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW as transformers' Trainer makes it: weight decay on matrices, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=3e-4)


def one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------------- max_batch: the builder
def test_a_builder_that_ignores_its_batch_is_refused_before_any_answer():
    # before: the line through equal profiles was flat, and "batch 1048576 fits"
    fixed = build(4)
    calls = []

    def ignores(b):
        calls.append(b)
        return fixed

    with pytest.raises(MemoptError) as err:
        memopt.max_batch(ignores, "3MB", optimizer=torch.optim.AdamW, verify=False)
    msg = one_line(err.value)
    assert "builder(8) made a step no larger than builder(2)" in msg and "ignore its batch argument" in msg
    assert "inputs of b samples" in msg  # what works
    assert max(calls) <= 8  # refused at the probes, never built at a huge batch


# ---------------------------------------------------------------------- max_batch: the optimizer
def test_without_an_optimizer_max_batch_refuses_before_profiling():
    # before: it planned for Adam silently, and the printed next step failed for an AdamW user
    calls = []

    def counted(b):
        calls.append(b)
        return build(b)

    with pytest.raises(MemoptError) as err:
        memopt.max_batch(counted, "3MB")
    msg = one_line(err.value)
    assert msg == NO_OPTIMIZER and "optimizer=torch.optim.AdamW" in msg and "return (model, inputs, loss_fn, " in msg
    assert calls == [2]  # one build, nothing profiled


@pytest.mark.parametrize("form", ["class", "factory", "instance"])
def test_optimizer_as_class_factory_or_instance_makes_the_users_optimizer(form):
    model = build(2)[0]
    given = {"class": torch.optim.AdamW, "factory": lambda ps: torch.optim.AdamW(ps, lr=3e-4, weight_decay=0.0),
             "instance": grouped_adamw(model)}[form]
    other = build(4)[0]
    opt = optimizer_maker(given)(other)
    assert type(opt) is torch.optim.AdamW
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in other.parameters()}
    if form == "instance":  # the same groups and settings, over the other build's parameters
        want = grouped_adamw(other)
        assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in want.param_groups]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.param_groups[0]["lr"] == 3e-4
        assert optimizer_differences(optimizer_fingerprint(want), optimizer_fingerprint(opt)) == []


@pytest.mark.parametrize("bad, words", [
    ("adamw", "optimizer= is a str"),
    (torch.nn.Linear, "optimizer= is the class Linear"),
    (lambda: None, "calling it on the model's parameters raised TypeError"),
    (lambda ps: 3, "it made an int"),
])
def test_what_is_no_optimizer_is_refused_naming_the_forms_that_work(bad, words):
    # before: optimizer=<an Adam object> raised a bare TypeError ("'Adam' object is not callable")
    with pytest.raises(MemoptError) as err:
        memopt.max_batch(build, "3MB", optimizer=bad, verify=False)
    msg = one_line(err.value)
    assert words in msg and "optimizer=torch.optim.AdamW" in msg and "optimizer=opt" in msg


def test_an_optimizer_over_another_model_is_refused_saying_what_works():
    other = torch.nn.Linear(3, 5)
    with pytest.raises(MemoptError) as err:
        optimizer_maker(torch.optim.SGD(other.parameters(), lr=0.1))(build(2)[0])
    msg = one_line(err.value)
    assert "this SGD holds parameters" in msg and "pass torch.optim.SGD or a function of the parameters" in msg


@pytest.mark.parametrize("budget", ["60%", 0.6, "0.6"])
def test_max_batch_refuses_a_share_of_the_peak(budget):
    with pytest.raises(BudgetError) as err:
        memopt.max_batch(build, budget, optimizer=torch.optim.AdamW)
    assert "needs an absolute budget" in one_line(err.value) and "'2GiB'" in str(err.value)


def test_the_plan_max_batch_makes_applies_to_the_users_grouped_adamw():
    """The user's own optimizer passed as it is: the plan is made for its class and groups, so the next step (build
    at the answer, the same optimizer over it, ``memopt.plan(fit.plan, model, optimizer=opt)``) runs."""
    model, inputs, loss_fn = build(16)
    peak = memopt.measure(model, *inputs, loss_fn=loss_fn, optimizer=grouped_adamw(model)).peak_bytes
    fit = memopt.max_batch(build, int(0.6 * peak), optimizer=grouped_adamw(build(2)[0]), verify=False)
    assert fit.optimizer == "AdamW" and "planned for AdamW" in repr(fit)
    assert fit.plan.moves_state, "the test needs a plan that moves the optimizer's state"
    train_at_the_answer(fit)


def train_at_the_answer(fit: memopt.MaxBatch) -> None:
    """The next step as the user takes it: the model built at the answer, their AdamW over it, one step under the
    plan."""
    model, inputs, loss_fn = build(fit.batch)
    opt = grouped_adamw(model)
    with memopt.plan(fit.plan, model, optimizer=opt):
        loss_fn(model(*inputs)).backward()
        opt.step()
        opt.zero_grad()
    assert opt.state  # it stepped


# ---------------------------------------------------------------------- budgets as typed
@pytest.mark.parametrize("text", ["60", "1", "100", "1023", "1e3"])
def test_a_typed_plain_number_too_small_for_bytes_is_refused(text):
    with pytest.raises(BudgetError) as err:
        check_typed_budget(text)
    msg = one_line(err.value)
    assert f"'{text}%'" in msg and f"'{text}MiB'" in msg and str(MIN_TYPED_BYTES) in msg


@pytest.mark.parametrize("text", ["0.6", "60%", "2GiB", "3000000", str(MIN_TYPED_BYTES), "lots"])
def test_other_typed_budgets_are_left_to_the_api_reading(text):
    check_typed_budget(text)  # does not raise: resolve_budget reads (or refuses) it as the API does


def test_a_share_is_what_resolve_budget_reads_as_one():
    for v in ("60%", 0.6, "0.6", " 6e-1 "):
        assert is_share(v) and resolve_budget(v, reference=1000) == 600
    for v in ("2GiB", 2_000_000, "2000000", 1.5, "lots", True, None):
        assert not is_share(v)


# ---------------------------------------------------------------------- the magics
@pytest.fixture(scope="module")
def ip(ipython_shell):
    shell = ipython_shell
    shell.run_line_magic("load_ext", "memopt_nb")
    shell.user_ns.update(build=build, grouped_adamw=grouped_adamw, torch=torch, memopt=memopt)
    model, inputs, loss_fn = build(4)
    shell.user_ns.update(model=model, x=inputs[0], loss_fn=loss_fn, opt=torch.optim.Adam(model.parameters()))
    shell.run_line_magic("memopt_profile", "model x --loss loss_fn --optimizer opt --repeats 1 -q -o prof")
    yield shell
    shell.run_line_magic("unload_ext", "memopt_nb")


class Started(Exception):
    """Raised in place of the search: the magic got as far as starting it."""


@pytest.fixture
def searches(monkeypatch):
    """The budget and keyword arguments of each search the magic starts (which then raises :class:`Started`)."""
    calls = []

    def fake(prof, budget, *a, **k):
        calls.append(dict(k, budget=budget))
        raise Started

    monkeypatch.setattr(dashboard_mod, "search", fake)
    return calls


@pytest.mark.parametrize("line, words", [
    ("prof --budget 3000000 parsecs", "did not expect parsecs"),
    ("--max-batch build --optimizer Adam --budget 3000000 parsecs", "did not expect parsecs"),
    ("prof --budget 60% --patience 0", "--patience 0: give the number of PPO iterations"),
    ("prof --budget 60% --patience -3", "--patience -3: give the number of PPO iterations"),
    ("prof --budget 60% --patience many", "or none to run every timestep"),
    ("prof --budg 60%", "did you mean --budget? There is no option --budg"),
    ("prof --budget 60% --time-lim 5", "did you mean --time-limit? There is no option --time-lim"),
    ("prof --budget 60", "('60%') or a size with its unit ('60MiB'"),
    ("prof --budget 1e3", "'1e3%'"),
    ("--max-batch build --optimizer Adam --budget 60", "('60%') or a size with its unit ('60MiB'"),
    ("prof --budget 60% --optimizer AdamW", "--optimizer applies to --max-batch only"),
    ("--max-batch build --optimizer nosuch --budget 3MB", "neither a variable in the notebook nor a torch.optim"),
    ("--max-batch build --optimizer x --budget 3MB", "--optimizer x: optimizer= is a Tensor"),
])
def test_plan_magic_mistakes_are_one_line_usage_errors(ip, searches, line, words):
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", line)
    msg = one_line(err.value)
    assert words in msg, msg
    assert searches == []


def test_profile_magic_does_not_take_los_for_loss(ip):
    # before: --los was taken as --loss
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_profile", "model x --los loss_fn -q -o never")
    assert "did you mean --loss? There is no option --los" in one_line(err.value)
    assert "never" not in ip.user_ns


@pytest.mark.parametrize("flag, expected", [("", {}), ("--patience 3", {"patience": 3}),
                                            ("--patience none", {"patience": None})])
def test_patience_reaches_the_search_as_given(ip, searches, flag, expected):
    with pytest.raises(Started):
        ip.run_line_magic("memopt_plan", f"prof --budget 90% --timesteps 64 {flag} -q -o p_pat")
    got = {k: v for k, v in searches[-1].items() if k == "patience"}
    assert got == expected


@pytest.mark.parametrize("text", ["0.6", "60%", "3000000", "2.5MiB"])
def test_plan_magic_reads_other_budgets_as_the_api_does(ip, searches, text):
    with pytest.raises(Started):
        ip.run_line_magic("memopt_plan", f"prof --budget {text} --timesteps 64 -q -o p_budget")
    prof = ip.user_ns["prof"]
    assert searches[-1]["budget"] == resolve_budget(text, reference=prof.peak_bytes)


def test_max_batch_magic_without_an_optimizer_asks_for_one_before_profiling(ip):
    calls = []
    ip.user_ns["counted"] = lambda b: calls.append(b) or build(b)
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("memopt_plan", "--max-batch counted --budget 3MB")
    msg = one_line(err.value)
    assert "say which optimizer you train with, e.g. --optimizer AdamW" in msg and "counted(batch_size)" in msg
    assert calls == [2]


def test_max_batch_magics_next_step_runs_for_an_adamw_user(ip, capsys):
    """What the magic prints after the answer works as printed, with the user's own (grouped) AdamW."""
    ip.user_ns["my_opt"] = grouped_adamw(build(2)[0])
    ip.run_line_magic("memopt_plan", "--max-batch build --optimizer my_opt --budget 2MB -o fit_adamw")
    out = capsys.readouterr().out
    fit = ip.user_ns["fit_adamw"]
    assert fit.optimizer == "AdamW" and fit.batch is not None, repr(fit)
    assert "with memopt.plan(fit_adamw.plan, model, optimizer=opt)" in out and f"build({fit.batch})" in out
    assert "your AdamW" in out
    train_at_the_answer(fit)


# ---------------------------------------------------------------------- third-party output
def test_the_silencer_hides_c_level_writes_and_restores_output(capfd):
    libc = ctypes.CDLL(None)
    before = os.fstat(1).st_ino, os.fstat(2).st_ino
    print("visible before", flush=True)
    with third_party_quiet():
        os.write(1, b"hidden fd1\n")
        os.write(2, b"hidden fd2\n")
        libc.printf(b"hidden printf\n")  # buffered by C: flushed to nowhere before fd 1 is restored
        print("hidden print")
        print("hidden stderr", file=sys.stderr)
    os.write(1, b"visible after\n")
    libc.printf(b"visible printf\n")
    libc.fflush(None)
    out, err = capfd.readouterr()
    assert "hidden" not in out + err
    assert "visible before" in out and "visible after" in out and "visible printf" in out
    assert (os.fstat(1).st_ino, os.fstat(2).st_ino) == before


def test_the_silencer_lets_errors_through_and_shows_warnings_after(capfd):
    before = os.fstat(1).st_ino
    with pytest.raises(ValueError, match="ours"):
        with third_party_quiet():
            os.write(1, b"hidden\n")
            raise ValueError("ours")
    assert os.fstat(1).st_ino == before
    with pytest.warns(UserWarning, match="kept"):
        with third_party_quiet():
            warnings.warn("kept", UserWarning, stacklevel=1)
    os.write(1, b"still here\n")
    out, _ = capfd.readouterr()
    assert "hidden" not in out and "still here" in out


def test_the_solvers_c_output_does_not_reach_the_cell(capfd, monkeypatch):
    """Each HiGHS solve (``solvers.optimal``, ``min_peak``) runs inside the silencer: what it writes to the
    descriptors, as its ``printf`` does, is not seen."""
    real = milp_mod.milp
    solves = []

    def chatty(*a, **k):
        solves.append(1)
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        return real(*a, **k)

    monkeypatch.setattr(milp_mod, "milp", chatty)
    prof = chain_profile(5, seed=3)  # a new profile: its floor is solved, not read from the cache
    memopt.solvers.optimal(prof, "80%")
    out, err = capfd.readouterr()
    assert solves and "HighsMipSolverData" not in out + err
