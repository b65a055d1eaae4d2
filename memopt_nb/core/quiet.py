"""Keep what third-party libraries print out of the user's cell: :func:`third_party_quiet`.

A compiled library such as the HiGHS solver behind SciPy's ``milp`` writes debugging lines with C's ``printf``, to file
descriptor 1, past Python's ``sys.stdout``: ``contextlib.redirect_stdout`` does not see them, and in Jupyter the kernel
forwards that descriptor to the running cell. Around a call into such a library, the descriptors 1 and 2 point at the
null device, C's own buffers are flushed before they are pointed back (a line ``printf`` buffered would otherwise reach
the cell later), and Python's streams are swapped too (a library's ``print``). Python warnings raised inside are shown
after the output is restored, and exceptions pass through untouched: memopt's own errors are never hidden.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import sys
import warnings
from collections.abc import Iterator

__all__ = ["third_party_quiet"]

_LIBC: object | None = None


def _flush_c() -> None:
    """Flush every C ``FILE`` buffer of the process (``fflush(NULL)``); nothing where the C library is not found."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(None)
        except OSError:  # pragma: no cover - no C library to load by that name (Windows)
            _LIBC = False
    if _LIBC:
        with contextlib.suppress(AttributeError, OSError):
            _LIBC.fflush(None)  # type: ignore[attr-defined]


def _flush_python() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()


@contextlib.contextmanager
def third_party_quiet() -> Iterator[None]:
    """Inside, output written to file descriptors 1 and 2 (a C library's ``printf``) and to ``sys.stdout`` /
    ``sys.stderr`` goes nowhere; on exit, also after an exception, every descriptor and stream is exactly as before.

    Use it around a call into third-party code only, never around memopt's own messages. What was already written
    before it is flushed first, so none of it is lost. Python warnings raised inside are shown once it is left. A
    descriptor that is not open is left alone. The descriptors are the process's: another thread writing to them
    meanwhile is silenced as well (memopt runs its solvers on the calling thread, with nothing else printing).
    """
    _flush_python()
    _flush_c()
    saved: list[tuple[int, int]] = []
    caught: list[warnings.WarningMessage] = []
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:  # pragma: no cover - no null device
        null = -1
    try:
        if null >= 0:
            for fd in (1, 2):
                try:
                    copy = os.dup(fd)
                except OSError:  # not open: nothing to silence there
                    continue
                saved.append((fd, copy))
                os.dup2(null, fd)
        with warnings.catch_warnings(record=True) as caught_here, \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                yield
            finally:
                caught = list(caught_here)
    finally:
        _flush_c()  # what the library buffered goes to the null device, not to the restored descriptor
        for fd, copy in reversed(saved):
            os.dup2(copy, fd)
            os.close(copy)
        if null >= 0:
            os.close(null)
        for w in caught:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
