"""How the magics read their command lines: IPython's argument parser made strict (options in full, no word left
unread, a size's unit split from it pointed out) and each option's own reader, each raising ``UsageError`` that says
what was wrong and what would work."""

from __future__ import annotations

import difflib
import keyword
import re
from typing import Any

import torch
from IPython.core import magic_arguments as ma
from IPython.core.error import UsageError
from IPython.utils.process import arg_split

from ..core.errors import PlanError
from ..core.plan import DEFAULT_STRATEGIES, STATE_PIECES, STRATEGIES
from ..planners.options import allowed_strategies

__all__ = ["parse_magic_line"]


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
