"""``%memopt_profile`` and ``%memopt_plan``: profile and plan from a notebook cell (``%load_ext memopt_nb``).

Line magic — profile objects already in the notebook::

    %memopt_profile model x --loss loss_fn --optimizer opt -o prof
    %memopt_profile model *inputs --loss loss_fn --optimizer Adam -q -o prof
    %memopt_profile hf_model input_ids=ids attention_mask=mask labels=ids --loss "lambda out: out.loss" -o prof

Cell magic — run the cell, then profile the model it defines::

    %%memopt_profile --model model --inputs x --loss loss_fn --optimizer opt -o prof
    model = MyNet()
    x = torch.randn(32, 3, 32, 32)
    ...

Plan — run ``memopt.search`` with the live dashboard and store the plan (in ``plan`` unless ``-o`` says otherwise)::

    %memopt_plan prof --budget 60%
    %memopt_plan prof --budget 2GiB --device a100-40gb --timesteps 20000 --seed 1 -o p
    %memopt_plan prof --budget 40% --offload-state optimizer,grads --step-in-backward
    %memopt_plan prof --budget 60% --strategies keep,recompute

Mistakes (an unknown name, an object that is not an ``nn.Module``, a bad budget, a budget below the smallest peak
any plan reaches, an abbreviated option, a word the magic does not expect) raise ``UsageError`` with the reason and no
traceback. ``--budget`` reads a plain number as the Python API does (below 1 a share of the peak, else bytes), and
refuses one below 1024, which as bytes no step fits (``--budget 60``: write ``60%`` or ``60MiB``). A trailing ``;``
hides what the magic returns (the profile's table, the plan and its "stored" line), as it does for any Python
expression; ``%memopt_plan``'s dashboard still shows, since it is the search's progress (``-q`` hides it too). While the
extension is loaded a ``ModelProfile`` displays as its table, the smallest peak any plan reaches and what bounds it,
and a per-unit memory/time chart.
``%unload_ext memopt_nb`` removes the magics and that display hook again.
"""

from __future__ import annotations

import base64
import difflib
import keyword
import re
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from IPython.core import magic_arguments as ma
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.utils.process import arg_split

from ..core.budget import MIN_TYPED_BYTES, check_typed_budget, format_bytes, is_share, resolve_budget
from ..core.device import DeviceSpec
from ..core.errors import BudgetError, MemoptError, PlanError
from ..core.plan import DEFAULT_STRATEGIES, STATE_PIECES, STRATEGIES, Plan
from ..core.profile import ModelProfile
from ..harness.compare import Comparison, compare
from ..harness.maxbatch import NO_OPTIMIZER, MaxBatch, max_batch, optimizer_maker
from ..planners.checks import default_budget
from ..planners.depths import search_depths
from ..planners.floor import estimate_batch, explain_floor
from ..planners.options import allowed_strategies
from ..planners.rl.search import search
from ..profiling.profile import profile as profile_model
from .dashboard import SearchDashboard, in_notebook, timesteps_from_env
from .plots import figure_png, unit_chart

try:
    from IPython.core.magic import output_can_be_silenced
except ImportError:  # pragma: no cover - IPython < 8.13
    def output_can_be_silenced(func: Any) -> Any:
        return func

__all__ = ["DEFAULT_PLAN_NAME", "MemoptMagics", "load_ipython_extension", "unload_ipython_extension"]

#: Where ``%memopt_plan`` stores its plan in the notebook's namespace when ``-o`` is not given.
DEFAULT_PLAN_NAME = "plan"
#: where ``%memopt_plan --max-batch`` stores its answer unless ``-o`` says otherwise
DEFAULT_FIT_NAME = "fit"

_LINE_MAGICS = ("memopt_profile", "memopt_plan")
_CELL_MAGICS = ("memopt_profile",)
_state: dict[int, dict[str, Any]] = {}
#: The attribute ``%memopt_profile`` sets on the profiles it makes: how it called the model, for ``%memopt_plan
#: --measure`` — weak references to the model and optimizer (a kept profile must not keep a deleted model's memory
#: alive) and the input and loss expressions, read again from the notebook then; its presence also makes the
#: profile's display spell advice as magic options (``--units fine``).
MAGIC_CALL = "_memopt_magic_call"


# ====================================================================== helpers
def _strip_semicolon(line: str) -> tuple[str, bool]:
    """The magic's arguments without a trailing ``;`` (which silences the result), and whether there was one."""
    stripped = line.rstrip()
    if stripped.endswith(";"):
        return stripped[:-1].rstrip(), True
    return line, False


def _unquote(text: str | None) -> str | None:
    """IPython splits magic arguments keeping quotes (``'a b'`` stays quoted); drop one matching pair."""
    if text is not None and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _article(name: str) -> str:
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


_OPTION = re.compile(r"^--?[A-Za-z][A-Za-z0-9_-]*")
_SIZE_UNITS = {"b", "kb", "mb", "gb", "tb", "kib", "mib", "gib", "tib", "k", "m", "g", "%"}
_NUMBER = re.compile(r"^[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?$", re.IGNORECASE)
#: Options whose value is a size ("20MB"): a unit split from it by a space is pointed out (elsewhere ``m`` or ``b``
#: may well be an input's name).
_SIZE_OPTIONS = ("--budget",)
_EXAMPLES = {"memopt_plan": "%memopt_plan prof --budget 60%", "memopt_profile": "%memopt_profile model x -o prof"}


def parse_magic_line(func: Any, line: str) -> Any:
    """``magic_arguments.parse_argstring`` with errors written for people rather than argparse's words.

    An option the magic does not have names the closest one ("did you mean --budget?") before argparse would report
    it as unrecognized, or report a required option as missing when it was only misspelt; a size split by a space
    (``--budget 20 MB``) says to write ``20MB``; a missing required option names it with an example. Every error is a
    ``UsageError`` whose first sentence says what to type.
    """
    parser = func.parser
    name = parser.prog or func.__name__
    usage = f"see %{name}? for every option"
    known = sorted(parser._option_string_actions)
    try:
        tokens = arg_split(line, strict=False)
    except ValueError:
        tokens = line.split()
    for tok in tokens:
        match = _OPTION.match(tok)
        if match is None:
            continue
        opt = tok.split("=", 1)[0]
        if opt in known:
            continue
        longs = {k.lstrip("-"): k for k in known if k.startswith("--")}
        starts = [k for k in longs if k.startswith(opt.lstrip("-"))] if opt.startswith("--") else []
        close = starts if len(starts) == 1 else difflib.get_close_matches(opt.lstrip("-"), list(longs), n=1,
                                                                          cutoff=0.6)
        if close:  # options are never abbreviated: --los is not taken for --loss
            raise UsageError(f"%{name}: did you mean {longs[close[0]]}? There is no option {opt} (options are "
                             f"written in full; {usage})")
        raise UsageError(f"%{name}: there is no option {opt}; {usage}")
    for i, tok in enumerate(tokens):
        if i >= 2 and tok.lower() in _SIZE_UNITS and _NUMBER.match(tokens[i - 1]) and tokens[i - 2] in _SIZE_OPTIONS:
            raise UsageError(f"write {tokens[i - 2]} {tokens[i - 1]}{tok}, without a space between the number and "
                             f"the unit ({tokens[i - 2]} {tokens[i - 1]} {tok} reads {tok} as another argument)")
    try:
        return ma.parse_argstring(func, line)
    except UsageError as exc:
        msg = str(exc)
        required = re.match(r"the following arguments are required: (.*)", msg)
        if required:
            what = required.group(1)
            example = _EXAMPLES.get(name, f"%{name} ...")
            raise UsageError(f"%{name} needs {what}, e.g. {example} ({usage})") from None
        extra = re.match(r"unrecognized arguments: (.*)", msg)
        if extra:
            raise UsageError(f"%{name}: did not expect {extra.group(1)}; quote an expression that contains spaces, "
                             f"or {usage}") from None
        bad = re.match(r"argument (\S+?)(?:/\S+)?: invalid (\w+) value: (.*)", msg)
        if bad:
            kind = "a whole number" if bad.group(2) == "int" else f"{_article(bad.group(2))} value"
            raise UsageError(f"{bad.group(1)} {bad.group(3)}: give {kind} ({usage})") from None
        expected = re.match(r"argument (\S+?)(?:/\S+)?: expected one argument", msg)
        if expected:
            raise UsageError(f"{expected.group(1)} needs a value after it ({usage})") from None
        raise UsageError(f"%{name}: {msg} ({usage})") from None


def _exact_options(func: Any) -> Any:
    """Options are written in full: argparse's prefix matching (``--los`` taken for ``--loss``) is off."""
    func.parser.allow_abbrev = False
    return func


def _check_output_name(name: str | None) -> None:
    if name is not None and (not name.isidentifier() or keyword.iskeyword(name)):
        raise UsageError(f"-o {name!r}: the output name must be a Python identifier, e.g. -o prof")


def _optimizer_classes() -> dict[str, type]:
    return {name.lower(): cls for name, cls in vars(torch.optim).items()
            if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer}


def _parse_offload_state(text: str) -> bool | set[str]:
    """``--offload-state``: ``all``, ``none`` or a comma-separated list of the pieces (see ``memopt.search``)."""
    value = (_unquote(text.strip()) or "").strip().lower()
    if value == "all":
        return True
    if value == "none":
        return False
    pieces = [p.strip() for p in value.split(",")]
    unknown = [p for p in pieces if p not in STATE_PIECES]
    if not value or unknown:
        what = f"unknown {', '.join(repr(p) for p in unknown)}" if value else "empty"
        raise UsageError(f"--offload-state {text!r}: {what}; give all (the default), none (activations only) or a "
                         f"comma-separated list of {', '.join(STATE_PIECES)}, e.g. --offload-state optimizer,grads")
    return set(pieces)


def _parse_strategies(text: str) -> tuple[str, ...]:
    """``--strategies``: a comma-separated list of the activation strategies the search may use (see
    ``memopt.search``)."""
    value = (_unquote(text.strip()) or "").strip()
    try:
        return allowed_strategies([p.strip() for p in value.split(",")] if value else [])
    except PlanError:
        unknown = [repr(p.strip()) for p in value.split(",") if p.strip().lower() not in STRATEGIES]
        what = f"unknown {', '.join(unknown)}" if value else "empty"
        raise UsageError(f"--strategies {text!r}: {what}; give a comma-separated list of {', '.join(STRATEGIES)} "
                         f"(default: {','.join(DEFAULT_STRATEGIES)}), e.g. --strategies keep,recompute") from None


def _parse_patience(text: str | None) -> dict[str, Any]:
    """``--patience``: the search's ``patience=`` as keywords: a whole number of at least 1, ``none`` (every timestep
    runs), or nothing given (the search's default)."""
    if text is None:
        return {}
    value = (_unquote(text.strip()) or "").strip().lower()
    if value == "none":
        return {"patience": None}
    if value.isdigit() and int(value) >= 1:
        return {"patience": int(value)}
    raise UsageError(f"--patience {text}: give the number of PPO iterations without a better plan after which the "
                     "search stops, at least 1 (default 50), or none to run every timestep; e.g. --patience 20")


def _read_budget(raw: str, reference: int | None) -> int:
    """``--budget`` in bytes: read as the Python API reads a budget (:func:`memopt_nb.resolve_budget`; ``reference``:
    the unoptimized peak a share is taken of), a plain number below 1024 refused (:func:`check_typed_budget`)."""
    text = (_unquote(raw.strip()) or "").strip()
    try:  # the one budget parser of the API: "60%" of the profiled peak, "2GiB", bytes
        budget = resolve_budget(text, reference=reference)
        check_typed_budget(text)
    except MemoptError as exc:
        raise UsageError(f"--budget {raw}: {exc}") from None
    return budget


def _parse_units(text: str | None) -> Any:
    text = _unquote(text)
    if text is None or text.strip() in ("", "auto"):
        return "auto"
    if text.strip() == "fine":
        return "fine"
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise UsageError(f"--units {text!r}: give 'auto', 'fine', a depth (an int) or comma-separated module names")
    return names


def _profile_display(prof: ModelProfile) -> None:
    """How a ModelProfile displays while the extension is loaded: its table, then the per-unit chart."""
    from IPython.display import Image, display

    spelling = "magic" if hasattr(prof, MAGIC_CALL) else "python"
    try:
        found = explain_floor(prof, offload_state=True)  # the planners' default space
        floor = found.text(spelling)
        est = estimate_batch(prof, found)  # where the device's capacity is known
        floor += f"\n{est.text(spelling)}" if est is not None else ""
    except Exception as exc:  # noqa: BLE001 - a display must not fail
        floor = f"smallest reachable peak: not computed ({type(exc).__name__}: {exc})"
    if not in_notebook():
        print(repr(prof))
        print(floor)
        return
    display({"text/html": prof._repr_html_(spelling), "text/plain": f"{prof!r}\n{floor}"}, raw=True)
    try:
        fig = unit_chart(prof)
    except ValueError:  # a profile without units: the table says it all
        return
    display(Image(data=figure_png(fig), format="png"))


def profile_chart_html(prof: ModelProfile) -> str:
    """The profile's table and its per-unit chart as one HTML string (an inline PNG), e.g. for reports."""
    png = base64.b64encode(figure_png(unit_chart(prof))).decode("ascii")
    return prof._repr_html_() + f'<img alt="per-unit memory and time" src="data:image/png;base64,{png}">'


# ====================================================================== the magics
@magics_class
class MemoptMagics(Magics):
    """The memopt_nb magics; registered by ``%load_ext memopt_nb``."""

    # ------------------------------------------------------------------ namespace access
    def _eval(self, expr: str, what: str) -> Any:
        """Evaluate a name or expression in the notebook's namespace; a user's mistake becomes a UsageError."""
        expr = _unquote(expr) or ""
        ns = self.shell.user_ns
        if expr.isidentifier() and expr not in ns and expr not in self.shell.user_global_ns:
            close = difflib.get_close_matches(expr, [k for k in ns if not k.startswith("_")], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; define it in a cell first"
            raise UsageError(f"{what}: no variable named {expr!r} in the notebook{hint}")
        try:
            return eval(expr, self.shell.user_global_ns, ns)  # noqa: S307 - the user's own notebook code
        except SyntaxError:
            raise UsageError(f"{what}: {expr!r} is not a Python name or expression (quote expressions that contain "
                             f"spaces)") from None
        except Exception as exc:
            raise UsageError(f"{what}: evaluating {expr!r} failed: {type(exc).__name__}: {exc}") from None

    def _model(self, name: str) -> torch.nn.Module:
        obj = self._eval(name, "model")
        if not isinstance(obj, torch.nn.Module):
            raise UsageError(f"model: {name!r} is {_article(type(obj).__name__)}, not a torch.nn.Module")
        return obj

    def _inputs(self, exprs: list[str]) -> tuple[list[Any], dict[str, Any]]:
        """Positional and keyword inputs: ``x``, ``*xs`` (a tuple), ``name=expr`` and ``**batch`` (a dict)."""
        if not exprs:
            raise UsageError("give the model's example inputs: %memopt_profile MODEL INPUT... (e.g. "
                             "%memopt_profile model x, *inputs to unpack a tuple, input_ids=ids for a keyword, or "
                             "**batch to unpack a dict)")
        out: list[Any] = []
        kw: dict[str, Any] = {}
        for e in exprs:
            e = _unquote(e) or ""
            name, eq, rest = e.partition("=")
            if e.startswith("**"):
                value = self._eval(e[2:], "input")
                if not isinstance(value, Mapping):
                    kind = _article(type(value).__name__)
                    raise UsageError(f"input {e!r}: {e[2:]!r} is {kind}, not a dict of keyword inputs")
                kw.update(value)
            elif eq and name.isidentifier() and not rest.startswith("="):
                kw[name] = self._eval(rest, f"input {name}=")
            elif e.startswith("*"):
                value = self._eval(e[1:], "input")
                try:
                    out.extend(list(value))
                except TypeError:
                    kind = _article(type(value).__name__)
                    raise UsageError(f"input {e!r}: {e[1:]!r} is {kind}, which cannot be unpacked with *") from None
            else:
                out.append(self._eval(e, "input"))
        return out, kw

    def _loss(self, expr: str | None) -> Any:
        if expr is None:
            return None
        fn = self._eval(expr, "--loss")
        if not callable(fn):
            kind = _article(type(fn).__name__)
            raise UsageError(f"--loss: {expr!r} is {kind}, not a function loss_fn(output) -> scalar")
        return fn

    def _optimizer_arg(self, name: str) -> Any:
        """``--optimizer NAME``: the notebook's object of that name (an optimizer, a class, a function), else the
        torch.optim class of that name (``Adam``, ``adamw``)."""
        name = _unquote(name) or ""
        if name in self.shell.user_ns or not name.isidentifier():
            return self._eval(name, "--optimizer")
        classes = _optimizer_classes()
        cls = classes.get(name.lower())
        if cls is None:
            raise UsageError(f"--optimizer: {name!r} is neither a variable in the notebook nor a torch.optim "
                             f"class; use your optimizer's variable name or one of {', '.join(sorted(classes))}")
        return cls

    def _optimizer(self, name: str | None, model: torch.nn.Module) -> Any:
        if name is None:
            return None
        obj = self._optimizer_arg(name)
        if isinstance(obj, torch.optim.Optimizer):
            return obj
        if not (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)):
            kind = _article(type(obj).__name__)
            raise UsageError(f"--optimizer: {name!r} is {kind}, not a torch.optim.Optimizer "
                             "(or the name of an optimizer class such as Adam)")
        try:
            return obj(model.parameters())
        except Exception as exc:
            raise UsageError(f"--optimizer: could not create {obj.__name__}(model.parameters()): {exc}; create it "
                             "in a cell and pass its name") from None

    # ------------------------------------------------------------------ %memopt_profile
    @_exact_options
    @ma.magic_arguments()
    @ma.argument("target", nargs="*", metavar="MODEL INPUT",
                 help="the model's name, then its example inputs (names or expressions; *name unpacks a tuple, "
                      "key=expr is a keyword input, **name unpacks a dict of them)")
    @ma.argument("--model", help="name of the nn.Module (cell magic: default is the one module the cell defines)")
    @ma.argument("--inputs", nargs="+", metavar="INPUT", help="example inputs (instead of positional ones)")
    @ma.argument("--loss", metavar="EXPR", help="loss function loss_fn(output) -> scalar (default: output.sum())")
    @ma.argument("--optimizer", metavar="NAME",
                 help="your optimizer's variable name, or a torch.optim class (Adam, SGD, ...) built on the model")
    @ma.argument("--units", metavar="UNITS",
                 help="'auto' (default: the blocks of ModuleList/Sequential containers), 'fine' (those blocks split "
                      "into their submodules where that lowers the largest unit), a depth in the module tree, or "
                      "comma-separated module names")
    @ma.argument("--repeats", type=int, default=3, help="timed steps; times are medians (default 3)")
    @ma.argument("--selective", action="store_true",
                 help="also measure each unit's save-sets for selective checkpointing (then %%memopt_plan "
                      "--strategies may include selective)")
    @ma.argument("--autocast", metavar="DTYPE",
                 help="mixed precision as your loop uses it: bf16 or fp16 (forward and loss under torch.autocast, "
                      "backward and optimizer step outside)")
    @ma.argument("--head", choices=["chunked"],
                 help="'chunked': also measure the LM head and its loss computed a chunk of tokens at a time (the "
                      "logits never whole; not bit-identical: the gradients are summed in another order), which "
                      "%%memopt_plan may then choose")
    @ma.argument("--head-module", metavar="NAME",
                 help="the nn.Linear to chunk (default: the model's output embeddings)")
    @ma.argument("--keep-outputs", action="store_true",
                 help="profile the loop that keeps the model's output through backward, as the transformers "
                      "documentation's does (outputs = model(**batch); outputs.loss.backward())")
    @ma.argument("-o", "--output", metavar="NAME", help="store the ModelProfile in the notebook as NAME")
    @ma.argument("-q", "--quiet", action="store_true", help="do not display the profile")
    @output_can_be_silenced
    @line_cell_magic
    def memopt_profile(self, line: str, cell: str | None = None) -> Any:
        """Profile one training step of a model per unit: forward/backward time and saved activations, and its peak.

        Line magic: ``%memopt_profile MODEL INPUT... [--loss EXPR] [--optimizer NAME] [--units U] [--selective]
        [--autocast bf16|fp16] [--head chunked] [--keep-outputs] [-o NAME] [-q]``
        profiles objects already in the notebook. Cell magic: ``%%memopt_profile --model NAME --inputs NAME...``
        runs the cell first (its names stay defined; its last expression is not displayed), then profiles the model
        it defines. Returns the ``ModelProfile`` (shown as a table with a
        per-unit memory/time chart; ``-q`` or a trailing ``;`` hides it, ``-o NAME`` stores it).
        """
        line, silenced = _strip_semicolon(line)
        args = parse_magic_line(self.memopt_profile, line)
        _check_output_name(args.output)
        target = list(args.target)
        if args.model is not None:
            model_name = args.model
        elif target:
            model_name = target.pop(0)
        else:
            model_name = None
        input_exprs = list(args.inputs or []) + target
        if cell is not None:
            model_name = self._run_cell(cell, model_name)
        elif model_name is None:
            raise UsageError("give the model to profile: %memopt_profile MODEL INPUT... (see %memopt_profile?)")
        model = self._model(model_name)
        inputs, input_kwargs = self._inputs(input_exprs)
        loss_fn = self._loss(args.loss)
        optimizer = self._optimizer(args.optimizer, model)
        units = _parse_units(args.units)
        if args.repeats < 1:
            raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
        if args.head_module and not args.head:
            raise UsageError("--head-module names the head to chunk; add --head chunked (or leave --head-module out)")
        try:
            prof = profile_model(model, *inputs, loss_fn=loss_fn, optimizer=optimizer, units=units,
                                  repeats=args.repeats, model_kwargs=input_kwargs, selective=args.selective,
                                  autocast=args.autocast, head=args.head, head_module=args.head_module,
                                  keep_outputs=args.keep_outputs)
        except MemoptError as exc:
            raise UsageError(f"memopt.profile: {exc}") from None
        setattr(prof, MAGIC_CALL, {"model": weakref.ref(model), "inputs": input_exprs, "loss": args.loss,
                                   "optimizer": None if optimizer is None else weakref.ref(optimizer),
                                   "autocast": args.autocast})
        if args.output:
            self.shell.user_ns[args.output] = prof
        if args.quiet or silenced:
            return None
        return prof

    def _run_cell(self, cell: str, model_name: str | None) -> str:
        """Run the cell in the notebook's namespace (user errors propagate); return the model's name."""
        ns = self.shell.user_ns
        before = {k: id(v) for k, v in ns.items()}
        code = self.shell.transform_cell(cell)
        exec(compile(code, "<%%memopt_profile cell>", "exec"), self.shell.user_global_ns, ns)  # noqa: S102
        if model_name is not None:
            return model_name
        new = [k for k, v in ns.items() if isinstance(v, torch.nn.Module) and before.get(k) != id(v)
               and not k.startswith("_")]
        if len(new) == 1:
            return new[0]
        if not new:
            raise UsageError("the cell defined no torch.nn.Module; name the model with --model NAME")
        raise UsageError(f"the cell defined several modules ({', '.join(sorted(new))}); say which to profile with "
                         "--model NAME")

    # ------------------------------------------------------------------ %memopt_plan
    @_exact_options
    @ma.magic_arguments()
    @ma.argument("profile", metavar="PROFILE", nargs="?",
                 help="name of a ModelProfile in the notebook (from %%memopt_profile)")
    @ma.argument("--budget",
                 help="memory budget: a size with its unit ('2GiB', '800MB'), a share of the unoptimized peak ('60%%', "
                      "or a fraction below 1 such as 0.6), or a plain number of bytes of at least "
                      f"{MIN_TYPED_BYTES} (a smaller plain number, such as 60, is refused: write 60%% or 60MiB) "
                      "(default: what the device can still give the step, its capacity or memopt.limit_memory's "
                      "limit less what other tensors hold there, printed first; on the emulated device outside "
                      "limit_memory, required)")
    @ma.argument("--max-batch", metavar="BUILDER",
                 help="answer how big a batch fits instead: BUILDER is a function in the notebook, "
                      "builder(batch_size) -> (model, inputs, loss_fn[, optimizer]); shows the largest batch any "
                      "plan fits, the fastest batch, and plain training and the best classic baseline beside them "
                      "(memopt.max_batch); stored as `fit` unless -o says otherwise")
    @ma.argument("--optimizer", metavar="NAME",
                 help="with --max-batch: the optimizer you train with, which the plans are made for: a torch.optim "
                      "class (AdamW), or the name of a class, of a function params -> optimizer or of your optimizer "
                      "(its class and settings) in the notebook; default: the one BUILDER returns, else refused")
    @ma.argument("--device", metavar="PRESET",
                 help="plan for a GPU preset instead of the profiled device: " + ", ".join(
                     DeviceSpec.preset_names()))
    @ma.argument("--timesteps", type=int, metavar="N",
                 help="PPO timesteps (default: $MEMOPT_NB_TIMESTEPS if set, else the search's default)")
    @ma.argument("--seed", type=int, default=0, help="random seed; the same seed gives the same plan (default 0)")
    @ma.argument("--time-limit", type=float, metavar="SECONDS", default=None,
                 help="stop the search, polish included, after this many seconds (default: no limit; the plan "
                      "then depends on the machine's speed)")
    @ma.argument("--patience", metavar="N", default=None,
                 help="stop once the best plan has not improved in N PPO iterations, N at least 1 (default: the "
                      "search's, 50); none: run every timestep")
    @ma.argument("--offload-state", metavar="WHAT", default="all",
                 help="what of the training state the plan may move off the device: all (default: optimizer state, "
                      "gradients and parameters), none (activations only), or a comma-separated list of optimizer, "
                      "grads, params")
    @ma.argument("--step-in-backward", action="store_true",
                 help="also allow stepping a unit's parameters inside backward (grads='step'); the training loop may "
                      "then no longer accumulate gradients over several backwards or clip their global norm")
    @ma.argument("--strategies", metavar="LIST", default="keep,recompute,swap",
                 help="the activation strategies the plan may use, comma-separated (default: keep,recompute,swap); "
                      "e.g. keep,recompute for checkpointing only, or add recompute_offload or selective (opt-in; "
                      "selective needs a profile made with selective=True)")
    @ma.argument("--mixed-depths", action="store_true",
                 help="with a profile made with --units fine: also plan its whole blocks and cuts that mix whole "
                      "blocks with split ones, and keep the fastest plan that fits (memopt.search_depths; a whole "
                      "block's checkpoint holds only its input, so blocks may fit where their units do not)")
    @ma.argument("-o", "--output", metavar="NAME", default=None,
                 help=f"store the plan in the notebook as NAME (default: {DEFAULT_PLAN_NAME}; with --max-batch the "
                      f"answer, default {DEFAULT_FIT_NAME})")
    @ma.argument("--measure", nargs="?", type=int, const=5, default=None, metavar="PAIRS",
                 help="after the search, run the step with and without the plan in alternating pairs (5 unless "
                      "PAIRS says otherwise) and show both beside the prediction (memopt.compare); needs a profile "
                      "made by %%memopt_profile")
    @ma.argument("--no-widget", action="store_true", help="print text progress lines instead of the live dashboard")
    @ma.argument("-q", "--quiet", action="store_true",
                 help="show nothing: no dashboard, no result (the plan is still stored)")
    @output_can_be_silenced
    @line_magic
    def memopt_plan(self, line: str) -> Any:
        """Search a memory plan with the two PPO agents (``memopt.search``), watching them learn in a live dashboard.

        ``%memopt_plan PROFILE [--budget 60%] [--device PRESET] [--timesteps N] [--seed S] [--patience N|none]
        [--offload-state all|none|optimizer,grads,params] [--step-in-backward] [--strategies keep,recompute,swap]
        [-o NAME] [--no-widget] [-q]``

        ``--budget`` is read as ``memopt.search`` reads a budget: a size with its unit (``2GiB``, ``800MB``), a share
        of the unoptimized peak (``60%``, or a fraction below 1 such as ``0.6``), or a plain number of bytes; a plain
        number below 1024 (``--budget 60``) is refused rather than read as a few bytes: write ``60%`` or ``60MiB``.
        Options are written in full (``--budg`` is refused, naming ``--budget``), and a word the magic does not expect
        is refused rather than ignored. Without ``--budget`` the plan is for what the device can still give the step
        (:func:`memopt_nb.planners.checks.default_budget`: its capacity, or the limit of ``memopt.limit_memory``,
        less what other tensors in the notebook hold there), and a first line says how much ("planning for 207.00 MiB
        free of 258.00 MiB (51.00 MiB held by other tensors)"); on a preset (``--device``), its capacity.

        ``%memopt_plan --max-batch BUILDER --optimizer AdamW [--budget 2GiB] [--device PRESET] [...]`` answers "how
        big a batch fits, how fast?" instead (:func:`memopt_nb.max_batch`, with the exact planner): the largest batch
        any plan fits under the budget (default: what the device can still give, as above, said in its notes), the
        batch with the highest predicted throughput, and the same for plain training and the best classic baseline.
        ``BUILDER`` is ``builder(batch_size) -> (model, inputs, loss_fn[, optimizer])``; ``--optimizer`` names the
        optimizer you train with (a torch.optim class, or your optimizer or a function ``params -> optimizer`` in the
        notebook), which the plans are made for, unless ``BUILDER`` returns it. The answer is stored as ``fit`` (its
        plan: ``fit.plan``; apply it with ``memopt.plan(fit.plan, model, optimizer=opt)``).

        ``--offload-state`` says what of the training state the plan may place on the host (``all`` by default,
        ``none`` for activations only, or a comma-separated list); ``--step-in-backward`` also allows running a unit's
        optimizer step inside backward, after which the loop may no longer accumulate or clip gradients.
        ``--strategies`` restricts the activation strategies (e.g. ``keep,recompute``: checkpointing only; the budget is
        then checked against that space's floor).

        The dashboard shows both agents' rewards, the fastest plan's peak against the budget and, at the end, the
        memory timeline of the returned plan against the unoptimized step; when the search ends it stays in the cell as
        a picture with its summary. The plan is stored in the notebook as ``plan`` (or ``-o NAME``) and returned; apply
        it with ``with memopt.plan(plan): ...``. A trailing ``;`` hides the returned plan and the "stored" line (the
        dashboard still shows: it is the search's progress); ``-q`` hides the dashboard as well.
        """
        line, silenced = _strip_semicolon(line)
        args = parse_magic_line(self.memopt_plan, line)
        if args.max_batch is not None:
            return self._max_batch(args, silenced)
        if args.profile is None:
            raise UsageError("%memopt_plan needs a profile: %memopt_plan prof --budget 60% (make prof with "
                             "%memopt_profile), or --max-batch BUILDER to ask how big a batch fits")
        if args.optimizer is not None:
            raise UsageError("--optimizer applies to --max-batch only: a profile already holds the optimizer it was "
                             "made with (%memopt_profile ... --optimizer NAME); leave it out")
        stop = {"time_limit": args.time_limit, **_parse_patience(args.patience)}
        args.output = args.output or DEFAULT_PLAN_NAME
        _check_output_name(args.output)
        prof = self._eval(args.profile, "profile")
        if not isinstance(prof, ModelProfile):
            kind = _article(type(prof).__name__)
            raise UsageError(f"profile: {args.profile!r} is {kind}, not a ModelProfile; make one "
                             "with %memopt_profile MODEL INPUT... -o prof")
        device = None
        if args.device is not None:
            try:
                device = DeviceSpec.preset(args.device)
            except MemoptError as exc:
                raise UsageError(f"--device: {exc}") from None
        budget = _read_budget(args.budget, prof.peak_bytes) if args.budget is not None else None
        free = default_budget(prof, device) if budget is None else None
        if free is not None and not free.known:
            raise UsageError("%memopt_plan needs --budget, e.g. %memopt_plan prof --budget 60% (outside "
                             "memopt.limit_memory the emulated device's capacity is the host's memory; on a GPU, a "
                             "preset or inside the limit, leaving --budget out plans for what the device can give)")
        offload_state = _parse_offload_state(args.offload_state)
        strategies = _parse_strategies(args.strategies)
        call = getattr(prof, MAGIC_CALL, None)
        if args.measure is not None:  # before the search: what --measure needs must still be there after it
            if call is None:
                raise UsageError("--measure needs a profile made by %memopt_profile in this session (it knows the "
                                 "model's inputs and loss); otherwise call memopt.compare(model, *inputs, plan=plan, "
                                 "profile=prof, loss_fn=..., optimizer=...)")
            if args.measure < 1:
                raise UsageError(f"--measure {args.measure}: give at least 1 pair of steps (5 or more to read a "
                                 "spread)")
            if call["model"]() is None or (call["optimizer"] is not None and call["optimizer"]() is None):
                raise UsageError("--measure: the profiled model or optimizer no longer exists; profile it again")
        if args.timesteps is not None and args.timesteps <= 0:
            raise UsageError(f"--timesteps must be a positive number of PPO timesteps, got {args.timesteps}")
        try:
            steps = args.timesteps if args.timesteps is not None else timesteps_from_env()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        mode = "none" if args.quiet else ("text" if args.no_widget else "auto")
        title = f"{prof.meta.get('model_class', 'model')}: {prof.n_units} units, unoptimized peak " \
                f"{format_bytes(prof.peak_bytes)}"
        # the cell's result is the plan itself, right under the dashboard: the dashboard then does not repeat it
        dash = SearchDashboard(prof, device=device, total_timesteps=steps, mode=mode, title=title,
                               show_plan=silenced or args.quiet)
        if args.mixed_depths and not prof.merges:
            raise UsageError("--mixed-depths needs a profile whose blocks were split and measured whole: "
                             "%memopt_profile ... --units fine")
        if free is not None and not args.quiet:
            print(f"memopt: {free.line()}", flush=True)  # no --budget: what the device can still give the step
        try:
            space = dict(offload_state=offload_state, step_in_backward=args.step_in_backward, strategies=strategies)
            if args.mixed_depths:
                plan = _mixed_depths(dash, prof, budget, device, steps, args.seed, space, stop, quiet=args.quiet)
            else:
                plan = dash.run(prof, budget, device, total_timesteps=steps, seed=args.seed, **space, **stop)
        except BudgetError as exc:
            if exc.minimum_bytes is not None:  # below the floor: what to ask for first, in the magic's spelling
                raise UsageError(exc.reworded("magic")) from None
            said = f"--budget {args.budget}" if free is None else f"memopt: {free.line()}"
            raise UsageError(f"{said}: {exc}") from None
        except MemoptError as exc:
            raise UsageError(str(exc)) from None
        self.shell.user_ns[args.output] = plan
        if args.measure is not None:
            self._compare(plan, prof, call, args.measure, quiet=args.quiet)
        if silenced or args.quiet:
            return None
        space = "" if strategies == DEFAULT_STRATEGIES else f" (activation strategies: {', '.join(strategies)})"
        print(f"memopt: plan stored as `{args.output}`{space}; apply it with `with memopt.plan({args.output}): ...`")
        return plan


    def _max_batch(self, args: Any, silenced: bool) -> MaxBatch | None:
        """``%memopt_plan --max-batch BUILDER``: :func:`memopt_nb.max_batch` with the magic's plan space."""
        from IPython.display import display

        for flag, value in (("--timesteps", args.timesteps), ("--measure", args.measure),
                            ("--time-limit", args.time_limit), ("--patience", args.patience)):
            if value is not None:
                raise UsageError(f"{flag} does not apply to --max-batch (it plans each batch with the exact "
                                 "optimum); leave it out, or plan one batch with %memopt_plan PROFILE --budget ...")
        output = args.output or DEFAULT_FIT_NAME
        _check_output_name(output)
        builder = self._eval(args.max_batch, "--max-batch")
        if not callable(builder):
            raise UsageError(f"--max-batch: {args.max_batch!r} is {_article(type(builder).__name__)}, not a function "
                             "builder(batch_size) -> (model, inputs, loss_fn)")
        budget: Any = None
        share = args.budget is not None and is_share((_unquote(args.budget.strip()) or "").strip())
        if args.profile is not None and not share:  # e.g. "--budget 3000000 parsecs": parsecs is no profile
            raise UsageError(f"%memopt_plan --max-batch: did not expect {args.profile} (a PROFILE is used with "
                             "--max-batch only as what a percentage budget is a share of); leave it out, or give "
                             "--budget as a size such as 2GiB")
        if share and args.profile is None:
            raise UsageError(f"--budget {args.budget}: a percentage needs a profile to be a share of "
                             "(%memopt_plan prof --max-batch BUILDER --budget 60%); or give bytes such as "
                             "2GiB, or leave --budget out for what the device can still give")
        if args.budget is not None:
            reference = None
            if share:
                prof = self._eval(args.profile, "profile")
                if not isinstance(prof, ModelProfile):
                    raise UsageError(f"profile: {args.profile!r} is {_article(type(prof).__name__)}, not a "
                                     "ModelProfile")
                reference = prof.peak_bytes
            budget = _read_budget(args.budget, reference)
        optimizer = self._optimizer_arg(args.optimizer) if args.optimizer is not None else None
        try:
            optimizer_maker(optimizer)  # what is no optimizer is refused before anything is built
        except MemoptError as exc:
            raise UsageError(f"--optimizer {args.optimizer}: {exc}") from None
        device = None
        if args.device is not None:
            try:
                device = DeviceSpec.preset(args.device)
            except MemoptError as exc:
                raise UsageError(f"--device: {exc}") from None
        try:
            fit = max_batch(builder, budget, device, optimizer, strategies=_parse_strategies(args.strategies),
                            offload_state=_parse_offload_state(args.offload_state),
                            step_in_backward=args.step_in_backward, seed=args.seed)
        except MemoptError as exc:
            if str(exc) == NO_OPTIMIZER:
                raise UsageError(f"--max-batch: say which optimizer you train with, e.g. --optimizer AdamW (a "
                                 f"torch.optim class, or the name of your optimizer or of a function params -> "
                                 f"optimizer in the notebook), or let {args.max_batch}(batch_size) return (model, "
                                 "inputs, loss_fn, optimizer): its state is part of every peak, and a plan that moves "
                                 "state applies to that optimizer only") from None
            raise UsageError(f"--max-batch: {exc}") from None
        self.shell.user_ns[output] = fit
        if silenced or args.quiet:
            return None
        display(fit) if in_notebook() else print(repr(fit))
        print(f"memopt: stored as `{output}`; train batch {fit.batch} with `with memopt.plan({output}.plan, model, "
              f"optimizer=opt): ...`, the model built at that batch ({args.max_batch}({fit.batch})) and opt your "
              f"{fit.optimizer or 'optimizer'} over its parameters (the plan was made for it)")
        return None

    def _compare(self, plan: Plan, prof: ModelProfile, call: dict[str, Any], pairs: int,
                 quiet: bool = False) -> Comparison:
        """``%memopt_plan --measure``: the plan against no plan against the prediction, shown under the search."""
        from IPython.display import display

        model = call["model"]()
        optimizer = call["optimizer"]() if call["optimizer"] is not None else None
        if model is None or (call["optimizer"] is not None and optimizer is None):
            raise UsageError("--measure: the profiled model or optimizer no longer exists; profile it again")
        inputs, kwargs = self._inputs(call["inputs"])
        try:
            comparison = compare(model, *inputs, plan=plan, profile=prof, loss_fn=self._loss(call["loss"]),
                                        optimizer=optimizer, steps=pairs, autocast=call["autocast"],
                                        model_kwargs=kwargs)
        except MemoptError as exc:
            raise UsageError(f"--measure: {exc}") from None
        self.shell.user_ns["_memopt_comparison"] = comparison
        if not quiet:
            if in_notebook():
                display(comparison)
            else:
                print(comparison)
        return comparison


# ====================================================================== extension entry points
def load_ipython_extension(ip: Any) -> None:
    """Register the magics and the ModelProfile display (``%load_ext memopt_nb``)."""
    ip.register_magics(MemoptMagics)
    key = id(ip)
    if key not in _state:
        formatter = ip.display_formatter.ipython_display_formatter
        previous = formatter.for_type(ModelProfile, _profile_display)
        _state[key] = {"previous": previous}


def unload_ipython_extension(ip: Any) -> None:
    """Remove everything :func:`load_ipython_extension` added (``%unload_ext memopt_nb``)."""
    manager = ip.magics_manager
    for name in _LINE_MAGICS:
        if getattr(manager.magics["line"].get(name), "__self__", None).__class__ is MemoptMagics:
            manager.magics["line"].pop(name, None)
    for name in _CELL_MAGICS:
        if getattr(manager.magics["cell"].get(name), "__self__", None).__class__ is MemoptMagics:
            manager.magics["cell"].pop(name, None)
    manager.registry.pop(MemoptMagics.__name__, None)
    state = _state.pop(id(ip), None)
    formatter = ip.display_formatter.ipython_display_formatter
    formatter.pop(ModelProfile, None)
    if state is not None and state["previous"] is not None:
        formatter.for_type(ModelProfile, state["previous"])


def _mixed_depths(dash: SearchDashboard, prof: ModelProfile, budget: int, device: Any, steps: int | None, seed: int,
                  space: dict[str, Any], stop: dict[str, Any], quiet: bool) -> Plan:
    """``%memopt_plan --mixed-depths``: :func:`memopt_nb.search_depths`, the fine units searched in the dashboard and
    the other cuts with a line each."""
    def planner(p: ModelProfile, b: Any, d: Any) -> Plan:
        if p is prof:
            return dash.run(p, b, d, total_timesteps=steps, seed=seed, **space, **stop)
        if not quiet:
            merged = len(p.meta.get("merged") or [])
            print(f"memopt: searching {p.n_units} units ({merged} blocks whole)…", flush=True)
        return search(p, b, d, total_timesteps=steps, seed=seed, **space, **stop)

    plan = search_depths(prof, budget, device, planner=planner, seed=seed, **space)
    depths = plan.meta.get("depths") or {}
    if not quiet and "chosen" in depths:
        ms = {k: (f"{depths[f'{k}_step_time'] * 1e3:.1f} ms" if depths.get(f"{k}_step_time") is not None
                  else "none fits") for k in ("fine", "blocks", "mixed")}
        print(f"memopt: units {ms['fine']}, whole blocks {ms['blocks']}, mixed {ms['mixed']}: kept the "
              f"{depths['chosen']} plan ({depths['merged_blocks']} blocks whole)")
    return plan
