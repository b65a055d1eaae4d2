"""Progress of memopt's long calls (profile, max_batch, measure, compare, evaluate, the demo) for whoever shows it.

A long call says where it stands *between* its steps, never inside a timed one::

    @task("profile")                        # the call: a listener sees it start and end
    def profile(...):
        stage("timed steps", total=repeats)  # what it does now, and how many of it
        for _ in range(repeats):
            one_step()
            advance()                        # one more done

Calls nest (``max_batch`` profiles and measures; a nested call of the same name, such as a profile extrapolated from
smaller batches, is part of the outer one): a listener is given the chain of running calls, outermost first. Nothing
listens by default, and then each of these calls costs a context-variable lookup; a listener never changes what a call
computes or measures.

Who listens: :class:`ProgressLines` prints lines on standard error once a call has run ~5 s, at most one every ~2 s
(``python -m memopt_nb`` installs it; ``MEMOPT_NB_PROGRESS=lines`` installs it for any script), and in a Jupyter kernel
:class:`memopt_nb.notebook.progress.ProgressBar` shows a bar that ends as one line of text (installed when memopt is
imported there; ``MEMOPT_NB_PROGRESS=off`` turns it off). Both say how long the stage running has left from the time
its finished steps took — "about", and nothing before the first step is done or once the last one is.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["PROGRESS_ENV", "Listener", "ProgressLines", "ProgressListener", "Task", "advance", "describe",
           "format_seconds", "listening", "progress_mode", "set_default_listener", "stage", "task"]

#: Environment variable: ``lines`` prints progress lines on standard error in any process, ``off`` shows none (not
#: even the notebook's bar); unset or ``auto``: the bar in a Jupyter kernel, lines under ``python -m memopt_nb``.
PROGRESS_ENV = "MEMOPT_NB_PROGRESS"


@dataclass(eq=False)
class Task:
    """One running long call as listeners see it: its name, its stage, how many of the stage's steps are done out of
    ``total`` (``None``: not known in advance), and at the end its ``outcome`` (``"done"``, ``"failed"`` or
    ``"interrupted"``)."""

    name: str
    stage: str = ""
    total: int | None = None
    done: int = 0
    outcome: str | None = None
    _listener: Any = field(default=None, repr=False)


#: ``listener(event, tasks)``: ``event`` is ``"start"``, ``"stage"``, ``"advance"`` or ``"end"`` of ``tasks[-1]``;
#: ``tasks`` the running calls, outermost first. Called synchronously, between the call's steps.
Listener = Callable[[str, tuple[Task, ...]], None]



def progress_mode() -> str:
    """What ``$MEMOPT_NB_PROGRESS`` asks for: ``"lines"``, ``"off"`` (also ``0``, ``no``, ``false``) or ``"auto"``
    (unset, or anything else)."""
    raw = os.environ.get(PROGRESS_ENV, "").strip().lower()
    if raw in ("off", "0", "no", "false", "none"):
        return "off"
    return "lines" if raw == "lines" else "auto"


_UNSET: Any = object()
_listener: contextvars.ContextVar[Any] = contextvars.ContextVar("memopt_nb_progress_listener", default=_UNSET)
_tasks: contextvars.ContextVar[tuple[Task, ...]] = contextvars.ContextVar("memopt_nb_progress_tasks", default=())
_default: list[Listener | None] = [None]

F = TypeVar("F", bound=Callable[..., Any])


def set_default_listener(listener: Listener | None) -> Listener | None:
    """Make ``listener`` hear every long call of the process where no :func:`listening` says otherwise (``None``:
    nobody); returns the one it replaces."""
    previous, _default[0] = _default[0], listener
    return previous


@contextlib.contextmanager
def listening(listener: Listener | None) -> Iterator[Listener | None]:
    """Inside, long calls report to ``listener`` (``None``: to nobody, whatever the default is)."""
    token = _listener.set(listener)
    try:
        yield listener
    finally:
        _listener.reset(token)


def _current() -> Listener | None:
    listener = _listener.get()
    return _default[0] if listener is _UNSET else listener


def _emit(event: str, tasks: tuple[Task, ...]) -> None:
    listener = tasks[-1]._listener
    if listener is None:
        return
    try:
        listener(event, tasks)
    except Exception as exc:  # showing progress must never break the call it shows
        for t in tasks:
            t._listener = None
        warnings.warn(f"memopt's progress display failed and is off for this call: {type(exc).__name__}: {exc}",
                      RuntimeWarning, stacklevel=3)


def task(name: str) -> Callable[[F], F]:
    """Decorate a long call: while it runs, :func:`stage` and :func:`advance` report to the listener of the moment
    under ``name``. Without a listener, or inside a running call of the same name, the function is called as it is."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            running = _tasks.get()
            listener = _current()
            if listener is None or (running and running[-1].name == name):
                return fn(*args, **kwargs)
            me = Task(name, _listener=listener)
            chain = (*running, me)
            token = _tasks.set(chain)
            outcome = "failed"
            try:
                _emit("start", chain)
                result = fn(*args, **kwargs)
                outcome = "done"
                return result
            except KeyboardInterrupt:
                outcome = "interrupted"
                raise
            finally:
                me.outcome = outcome
                try:
                    _emit("end", chain)
                finally:
                    _tasks.reset(token)

        return run  # type: ignore[return-value]

    return wrap


def stage(name: str, total: int | None = None) -> None:
    """The running call starts its stage ``name`` of ``total`` steps (``None``: not known); nothing if none runs."""
    running = _tasks.get()
    if not running or running[-1]._listener is None:
        return
    me = running[-1]
    me.stage, me.total, me.done = name, (int(total) if total is not None else None), 0
    _emit("stage", running)


def advance(steps: int = 1) -> None:
    """``steps`` more of the running stage are done; nothing if no call runs."""
    running = _tasks.get()
    if not running or running[-1]._listener is None:
        return
    running[-1].done += steps
    _emit("advance", running)


def format_seconds(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``2 min 05 s``, ``1 h 03 min``: a duration as a person reads it."""
    s = max(0.0, float(seconds))
    if s < 9.95:
        return f"{s:.1f} s"
    whole = int(round(s))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    return f"{whole // 3600} h {whole % 3600 // 60:02d} min"


def describe(t: Task, left: float | None = None) -> str:
    """``profile 3/9 timed steps, about 12 s left``, ``profile: warm-up``, ``max_batch 5 smallest peaks``."""
    if not t.stage:
        text = t.name
    elif t.total is not None:
        text = f"{t.name} {min(t.done, t.total)}/{t.total} {t.stage}"
    elif t.done:
        text = f"{t.name} {t.done} {t.stage}"
    else:
        text = f"{t.name}: {t.stage}"
    return text + (f", about {format_seconds(left)} left" if left is not None else "")


class ProgressListener:
    """What every listener needs: when each running call and its stage started, on ``clock``, and how long the stage
    has left (:meth:`left`). Subclasses draw in :meth:`update`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._start: dict[int, float] = {}
        self._stage_start: dict[int, float] = {}
        self._advanced: dict[int, float] = {}

    def __call__(self, event: str, tasks: tuple[Task, ...]) -> None:
        now = self.clock()
        me = tasks[-1]
        if event == "start":
            self._start[id(me)] = now
        if event in ("start", "stage"):
            self._stage_start[id(me)] = self._advanced[id(me)] = now
        elif event == "advance":
            self._advanced[id(me)] = now
        try:
            self.update(event, tasks, now)
        finally:
            if event == "end":
                for times in (self._start, self._stage_start, self._advanced):
                    times.pop(id(me), None)

    def elapsed(self, t: Task, now: float) -> float:
        """Seconds since ``t`` started."""
        return max(0.0, now - self._start.get(id(t), now))

    def left(self, t: Task, now: float) -> float | None:
        """About how many seconds ``t``'s stage has left: the seconds its finished steps took each, for every step to
        go, less what the step under way has already had (not below nothing). ``None`` for a stage of unknown length,
        before its first step is done, once its last one is, and when the step under way has outlasted the others and
        it is the last: nothing can be said then."""
        if t.total is None or t.done <= 0 or t.done >= t.total:
            return None
        advanced = self._advanced.get(id(t), now)
        per_step = max(0.0, advanced - self._stage_start.get(id(t), advanced)) / t.done
        left = per_step * (t.total - t.done - 1) + max(0.0, per_step - max(0.0, now - advanced))
        return left if left > 0 else None

    def text(self, tasks: Sequence[Task], now: float) -> str:
        """The running calls, outermost first: ``max_batch 1/3 probe profiles › profile 2/3 timed steps, about 4 s
        left``."""
        return " › ".join(describe(t, self.left(t, now)) for t in tasks)

    def final_text(self, t: Task, now: float) -> str:
        """``profile done in 37 s`` (or ``failed after``, ``interrupted after``)."""
        how = "done in" if t.outcome == "done" else f"{t.outcome or 'stopped'} after"
        return f"{t.name} {how} {format_seconds(self.elapsed(t, now))}"

    def update(self, event: str, tasks: tuple[Task, ...], now: float) -> None:
        """Show ``event`` of ``tasks[-1]``; ``now`` is this listener's clock."""


class ProgressLines(ProgressListener):
    """Progress as lines on standard error: ``memopt: profile 3/9 timed steps, about 12 s left``.

    Silent until the outermost call has run ``delay`` seconds (short calls print nothing), then at most one line every
    ``interval`` seconds, and when a call that printed ends, one line saying so (``memopt: profile done in 37 s``).
    Lines are printed at the call's steps, so a long step shows the line from before it until it ends.

    Args:
        out: where each line goes (default: ``print`` to ``sys.stderr`` as it is at that moment).
        delay, interval: seconds, as above. clock: the time source (tests pass a fake one).
    """

    def __init__(self, out: Callable[[str], None] | None = None, *, delay: float = 5.0, interval: float = 2.0,
                 clock: Callable[[], float] = time.monotonic, prefix: str = "memopt") -> None:
        super().__init__(clock)
        self.out = out
        self.delay = float(delay)
        self.interval = float(interval)
        self.prefix = prefix
        self.lines: list[str] = []
        self._last: float | None = None

    def _write(self, line: str) -> None:
        line = f"{self.prefix}: {line}"
        self.lines.append(line)
        if self.out is not None:
            self.out(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def update(self, event: str, tasks: tuple[Task, ...], now: float) -> None:
        root = tasks[0]
        if len(tasks) == 1 and event == "start":
            self._last = None
        if event == "end":
            if len(tasks) == 1 and self._last is not None:
                self._write(self.final_text(root, now))
                self._last = None
            return
        if event == "start":  # its first stage follows at once
            return
        if self.elapsed(root, now) < self.delay or (self._last is not None and now - self._last < self.interval):
            return
        self._last = now
        self._write(self.text(tasks, now))
