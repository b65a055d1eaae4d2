"""How the magics read their command lines: the arguments ``%memopt_profile`` and ``%memopt_plan`` take (with their
help), IPython's argument parser made strict (options in full, no word left unread, a size's unit split from it
pointed out) and each option's own reader, each raising ``UsageError`` that says what was wrong and what would work."""

from __future__ import annotations

import difflib
import keyword
import re
from typing import Any

import torch
from IPython.core import magic_arguments as ma
from IPython.core.error import UsageError
from IPython.utils.process import arg_split

from ..core.budget import MIN_TYPED_BYTES
from ..core.device import DeviceSpec
from ..core.errors import PlanError
from ..core.plan import DEFAULT_STRATEGIES, STATE_PIECES, STRATEGIES
from ..planners.options import allowed_strategies

__all__ = ["DEFAULT_FIT_NAME", "DEFAULT_PLAN_NAME", "parse_magic_line", "plan_arguments", "profile_arguments"]


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


#: Where ``%memopt_plan`` stores its plan in the notebook's namespace when ``-o`` is not given.
DEFAULT_PLAN_NAME = "plan"
#: where ``%memopt_plan --max-batch`` stores its answer unless ``-o`` says otherwise
DEFAULT_FIT_NAME = "fit"


def _stacked(*decorators: Any) -> Any:
    """The decorators as one, in the order they would be written above a magic (the first outermost)."""
    def apply(func: Any) -> Any:
        for d in reversed(decorators):
            func = d(func)
        return func
    return apply


#: ``%memopt_profile``'s arguments (IPython's magic_arguments, options in full)
profile_arguments = _stacked(
    _exact_options,
    ma.magic_arguments(),
    ma.argument("target", nargs="*", metavar="MODEL INPUT",
                help="the model's name, then its example inputs (names or expressions; *name unpacks a tuple, "
                     "key=expr is a keyword input, **name unpacks a dict of them)"),
    ma.argument("--model", help="name of the nn.Module (cell magic: default is the one module the cell defines)"),
    ma.argument("--inputs", nargs="+", metavar="INPUT", help="example inputs (instead of positional ones)"),
    ma.argument("--loss", metavar="EXPR", help="loss function loss_fn(output) -> scalar (default: output.sum())"),
    ma.argument("--optimizer", metavar="NAME",
                help="your optimizer's variable name, or a torch.optim class (Adam, SGD, ...) built on the model"),
    ma.argument("--units", metavar="UNITS",
                help="'auto' (default: the blocks of ModuleList/Sequential containers), 'fine' (those blocks split "
                     "into their submodules where that lowers the largest unit), a depth in the module tree, or "
                     "comma-separated module names"),
    ma.argument("--repeats", type=int, default=3, help="timed steps; times are medians (default 3)"),
    ma.argument("--selective", action="store_true",
                help="also measure each unit's save-sets for selective checkpointing (then %%memopt_plan "
                     "--strategies may include selective)"),
    ma.argument("--autocast", metavar="DTYPE",
                help="mixed precision as your loop uses it: bf16 or fp16 (forward and loss under torch.autocast, "
                     "backward and optimizer step outside)"),
    ma.argument("--head", choices=["chunked"],
                help="'chunked': also measure the LM head and its loss computed a chunk of tokens at a time (the "
                     "logits never whole; not bit-identical: the gradients are summed in another order), which "
                     "%%memopt_plan may then choose"),
    ma.argument("--head-module", metavar="NAME",
                help="the nn.Linear to chunk (default: the model's output embeddings)"),
    ma.argument("--keep-outputs", action="store_true",
                help="profile the loop that keeps the model's output through backward, as the transformers "
                     "documentation's does (outputs = model(**batch); outputs.loss.backward())"),
    ma.argument("-o", "--output", metavar="NAME", help="store the ModelProfile in the notebook as NAME"),
    ma.argument("-q", "--quiet", action="store_true", help="do not display the profile"),
)

#: ``%memopt_plan``'s arguments (IPython's magic_arguments, options in full)
plan_arguments = _stacked(
    _exact_options,
    ma.magic_arguments(),
    ma.argument("profile", metavar="PROFILE", nargs="?",
                help="name of a ModelProfile in the notebook (from %%memopt_profile)"),
    ma.argument("--budget",
                help="memory budget: a size with its unit ('2GiB', '800MB'), a share of the unoptimized peak ('60%%', "
                     "or a fraction below 1 such as 0.6), or a plain number of bytes of at least "
                     f"{MIN_TYPED_BYTES} (a smaller plain number, such as 60, is refused: write 60%% or 60MiB) "
                     "(default: what the device can still give the step, its capacity or memopt.limit_memory's "
                     "limit less what other tensors hold there, printed first; on the emulated device outside "
                     "limit_memory, required)"),
    ma.argument("--max-batch", metavar="BUILDER",
                help="answer how big a batch fits instead: BUILDER is a function in the notebook, "
                     "builder(batch_size) -> (model, inputs, loss_fn[, optimizer]); shows the largest batch any "
                     "plan fits, the fastest batch, and plain training and the best classic baseline beside them "
                     "(memopt.max_batch); stored as `fit` unless -o says otherwise"),
    ma.argument("--optimizer", metavar="NAME",
                help="with --max-batch: the optimizer you train with, which the plans are made for: a torch.optim "
                     "class (AdamW), or the name of a class, of a function params -> optimizer or of your optimizer "
                     "(its class and settings) in the notebook; default: the one BUILDER returns, else refused"),
    ma.argument("--device", metavar="PRESET",
                help="plan for a GPU preset instead of the profiled device: " + ", ".join(
                    DeviceSpec.preset_names())),
    ma.argument("--timesteps", type=int, metavar="N",
                help="PPO timesteps (default: $MEMOPT_NB_TIMESTEPS if set, else the search's default)"),
    ma.argument("--seed", type=int, default=0, help="random seed; the same seed gives the same plan (default 0)"),
    ma.argument("--time-limit", type=float, metavar="SECONDS", default=None,
                help="stop the search, polish included, after this many seconds (default: no limit; the plan "
                     "then depends on the machine's speed)"),
    ma.argument("--patience", metavar="N", default=None,
                help="stop once the best plan has not improved in N PPO iterations, N at least 1 (default: the "
                     "search's, 50); none: run every timestep"),
    ma.argument("--offload-state", metavar="WHAT", default="all",
                help="what of the training state the plan may move off the device: all (default: optimizer state, "
                     "gradients and parameters), none (activations only), or a comma-separated list of optimizer, "
                     "grads, params"),
    ma.argument("--step-in-backward", action="store_true",
                help="also allow stepping a unit's parameters inside backward (grads='step'); the training loop may "
                     "then no longer accumulate gradients over several backwards or clip their global norm"),
    ma.argument("--strategies", metavar="LIST", default="keep,recompute,swap",
                help="the activation strategies the plan may use, comma-separated (default: keep,recompute,swap); "
                     "e.g. keep,recompute for checkpointing only, or add recompute_offload or selective (opt-in; "
                     "selective needs a profile made with selective=True)"),
    ma.argument("--mixed-depths", action="store_true",
                help="with a profile made with --units fine: also plan its whole blocks and cuts that mix whole "
                     "blocks with split ones, and keep the fastest plan that fits (memopt.search_depths; a whole "
                     "block's checkpoint holds only its input, so blocks may fit where their units do not)"),
    ma.argument("-o", "--output", metavar="NAME", default=None,
                help=f"store the plan in the notebook as NAME (default: {DEFAULT_PLAN_NAME}; with --max-batch the "
                     f"answer, default {DEFAULT_FIT_NAME})"),
    ma.argument("--measure", nargs="?", type=int, const=5, default=None, metavar="PAIRS",
                help="after the search, run the step with and without the plan in alternating pairs (5 unless "
                     "PAIRS says otherwise) and show both beside the prediction (memopt.compare); needs a profile "
                     "made by %%memopt_profile"),
    ma.argument("--no-widget", action="store_true", help="print text progress lines instead of the live dashboard"),
    ma.argument("-q", "--quiet", action="store_true",
                help="show nothing: no dashboard, no result (the plan is still stored)"),
)
