"""memopt's own threads (the swap engine's copy threads, a whole-step plan's movers), for tests that check a plan
leaves none behind."""

from __future__ import annotations

import gc
import threading
import time

__all__ = ["memopt_threads"]


def memopt_threads(besides: frozenset[threading.Thread] = frozenset(), wait: float = 2.0) -> list[threading.Thread]:
    """memopt's threads running now, but those in ``besides`` (what other tests left, taken at the start of the
    test). Garbage is collected first, and threads given up to ``wait`` seconds to end: a plan whose block ended with
    its state parked on the host keeps its movers until its model and optimizer are let go and collected."""
    gc.collect()
    deadline = time.monotonic() + wait
    while True:
        live = [t for t in threading.enumerate() if t.name.startswith("memopt-") and t not in besides]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.02)
