"""A machine under load, on purpose: :func:`cpu_burners` runs processes that spin on the CPU beside a block, so that a
test or benchmark can check that a planner's answer does not depend on how fast the machine is (HiGHS and the agents
run slower, so anything the clock decided would change)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["cpu_burners"]

# a loop that ends on its own, so that a burner that could not be killed does not outlive its caller by long
_BURN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def cpu_burners(count: int = 2, seconds: float = 3600.0) -> Iterator[None]:
    """``count`` processes spinning on the CPU while the block runs (each ends by itself after ``seconds``); killed
    when it is left, also on an exception."""
    procs = [subprocess.Popen([sys.executable, "-c", _BURN.format(seconds=float(seconds))]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)
