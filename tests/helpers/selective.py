"""What ops a unit's forward runs, recorded, for the tests of save-sets."""

from __future__ import annotations

from memopt_nb.profiling.opsets import OpRecorder
from memopt_nb.runtime.recompute import checkpointed


def _record(module, x):
    rec = OpRecorder()
    with rec:
        rec.begin(0)
        out = checkpointed(module, module.forward, (x,), {})
        rec.end()
    del out
    return rec.calls[0]
