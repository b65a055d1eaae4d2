"""``memopt.compare``: a plan against no plan against the simulator's prediction, in one small table.

One :func:`~memopt_nb.runtime.measure.measure` call gives one number; a step time means little without the same step
measured without the plan beside it, on the same machine at the same moment, and without the prediction the plan was
chosen by. ``compare`` measures both, *paired and alternating* (no plan, plan, then plan, no plan, ...), so that a
machine that gets slower or faster while it runs (other work, thermal throttling) moves both sides alike, and reports
the median of the per-pair ratios with their spread rather than a ratio of two single figures::

    memopt.compare(model, x, loss_fn=loss_fn, optimizer=opt, plan=p, profile=prof)

It is a function of its own rather than a ``measure`` option because it returns something else (a table of two
measured rows and a predicted one, not a :class:`~memopt_nb.runtime.measure.Measurement`) and runs a different
schedule (one timed step per :func:`measure` call, alternating, each call restoring the model, so every timed step
starts from the same state).
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..core.budget import format_bytes
from ..core.errors import ProfileError
from ..core.plan import Plan
from ..core.progress import advance, stage, task
from ..runtime.measure import Measurement, measure
from ..sim.simulator import simulate

__all__ = ["CPU_CAVEAT", "Comparison", "compare"]

#: Said under every comparison measured on the CPU (the emulated device).
CPU_CAVEAT = ("measured on the CPU (the emulated device): step times there move by 10% or more from run to run, "
              "more on a shared machine (where fewer threads, torch.set_num_threads, steady them), and say little "
              "about a GPU: simulate the plan on a preset (memopt.simulate(profile, plan, device='a100-40gb')) or run "
              "benchmarks/cuda_check.py where one is lent; memory figures are exact")
#: A side whose slowest timed step is this many times its fastest was measured on a busy machine.
BUSY_SPREAD = 1.5


def _ms(seconds: float | None) -> str:
    """Milliseconds to three significant figures: no false precision."""
    if seconds is None:
        return "–"
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 1000 else f"{seconds:.3g} s"


def _ratio(x: float | None) -> str:
    """A ratio to three significant figures (``1.13×``, ``18.8×``)."""
    return "–" if x is None else (f"{x:.2f}×" if x < 10 else f"{x:.3g}×")


@dataclass
class Comparison:
    """Peak memory and step time with and without a plan, measured in alternating pairs, beside the prediction.

    Attributes:
        without: one :class:`Measurement` per pair without the plan; ``with_plan``: with it (same length).
        ratios: per pair, the step time with the plan over the one without it.
        predicted_peak_bytes / predicted_step_time: the simulator's figures for the plan; ``predicted_base_peak_bytes``
            / ``predicted_base_step_time``: for no plan (``None`` where neither a profile nor the plan records them).
        device: where it was measured; ``method``: the plan's method.
    """

    without: list[Measurement]
    with_plan: list[Measurement]
    ratios: list[float]
    predicted_peak_bytes: int | None = None
    predicted_step_time: float | None = None
    predicted_base_peak_bytes: int | None = None
    predicted_base_step_time: float | None = None
    device: str = "cpu"
    method: str = "plan"
    budget_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    # ------------------------------------------------------------------ figures
    @staticmethod
    def _times(ms: Sequence[Measurement]) -> list[float]:
        return [t for m in ms for t in m.step_times]

    @property
    def ratio(self) -> float:
        """The median of the per-pair step-time ratios (plan / no plan): the measured slowdown."""
        return statistics.median(self.ratios)

    @property
    def predicted_ratio(self) -> float | None:
        """The simulator's step time with the plan over without it (``None`` without both predictions)."""
        if self.predicted_step_time is None or not self.predicted_base_step_time:
            return None
        return self.predicted_step_time / self.predicted_base_step_time

    def rows(self) -> list[dict[str, str]]:
        """The table as strings: ``what``, ``peak``, ``step`` (median), ``spread`` (min–max), ``vs no plan``."""
        out = []
        for label, ms in (("no plan (measured)", self.without), (f"plan {self.method} (measured)", self.with_plan)):
            times = self._times(ms)
            peaks = sorted({m.peak_bytes for m in ms})
            peak = format_bytes(peaks[-1]) + (f" (varied from {format_bytes(peaks[0])})" if len(peaks) > 1 else "")
            is_plan = ms is self.with_plan
            vs = (f"{_ratio(self.ratio)} ({_ratio(min(self.ratios))}–{_ratio(max(self.ratios))})"
                  if is_plan else "1.00×")
            out.append({"what": label, "peak": peak, "step": _ms(statistics.median(times)),
                        "spread": f"{_ms(min(times))}–{_ms(max(times))}", "vs no plan": vs})
        if self.predicted_peak_bytes is not None or self.predicted_step_time is not None:
            out.append({"what": f"plan {self.method} (predicted)",
                        "peak": "–" if self.predicted_peak_bytes is None else format_bytes(self.predicted_peak_bytes),
                        "step": _ms(self.predicted_step_time), "spread": "–",
                        "vs no plan": _ratio(self.predicted_ratio)})
        return out

    @property
    def within_noise(self) -> bool:
        """Whether the paired ratios straddle 1 (some pairs faster with the plan, some slower): the measurement cannot
        tell the two apart. Needs 3 pairs or more; with fewer, nothing is said to be within noise."""
        return len(self.ratios) >= 3 and min(self.ratios) <= 1.0 <= max(self.ratios)

    def verdict(self) -> str:
        """One sentence: measured against predicted slowdown (or "within noise" when the pairs cannot tell the two
        apart), whether the plan is slower, and the peak against the budget."""
        spread = f"{_ratio(min(self.ratios))}–{_ratio(max(self.ratios))}"
        if self.within_noise:
            parts = [f"with and without the plan within noise of each other (paired ratios {spread}, median "
                     f"{_ratio(self.ratio)} of {len(self.ratios)} paired steps)"]
        else:
            slower = "slower" if self.ratio > 1 else "faster"
            parts = [f"the plan is {slower}: measured {_ratio(self.ratio)} the step without it (median of "
                     f"{len(self.ratios)} paired steps, {spread})"]
        if self.predicted_ratio is not None:
            parts.append(f"predicted {_ratio(self.predicted_ratio)}")
        peak = max(m.peak_bytes for m in self.with_plan)
        if self.budget_bytes:
            within = "within" if peak <= self.budget_bytes else "OVER"
            parts.append(f"peak {format_bytes(peak)} {within} the budget {format_bytes(self.budget_bytes)}")
        return "; ".join(parts) + "."

    def caveats(self) -> list[str]:
        """Plain words on how far to trust the times: the CPU's noise, a busy machine, too few pairs."""
        out = [CPU_CAVEAT] if self.device == "cpu" else []
        spread = max(max(t) / min(t) for t in (self._times(self.without), self._times(self.with_plan)))
        if spread > BUSY_SPREAD:
            out.append(f"the slowest timed step took {spread:.1f}× the fastest: the machine was busy, so read the "
                       "median of the paired ratios, not single times")
        return out + list(self.notes)

    # ------------------------------------------------------------------ display
    def __str__(self) -> str:
        rows = self.rows()
        cols = list(rows[0])
        width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
        lines = ["  ".join(c.ljust(width[c]) for c in cols)]
        lines += ["  ".join(r[c].ljust(width[c]) for c in cols) for r in rows]
        return "\n".join([*lines, self.verdict(), *(f"note: {c}" for c in self.caveats())])

    def __repr__(self) -> str:
        return f"<Comparison on {self.device}\n{self}>"

    def _repr_html_(self) -> str:
        rows = self.rows()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in r.values()) + "</tr>" for r in rows)
        notes = "".join(f"<br><small>{html.escape(c)}</small>" for c in self.caveats())
        return (f'<div><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
                f"{html.escape(self.verdict())}{notes}</div>")


@task("compare")
def compare(model: nn.Module, *inputs: Any, plan: Plan, profile: Any = None,
            loss_fn: Callable[[Any], torch.Tensor] | None = None, optimizer: torch.optim.Optimizer | None = None,
            steps: int = 5, warmup: int = 1, model_kwargs: Mapping[str, Any] | None = None,
            autocast: torch.dtype | str | None = None, **kwargs: Any) -> Comparison:
    """Measure training steps with and without ``plan`` in alternating pairs and put the prediction beside them.

    ``steps`` pairs (at least 5 for a median with a spread worth reading; 1 is allowed for a quick look): each pair is
    one :func:`measure` call without the plan and one with it, in alternating order (no plan first in even pairs,
    the plan first in odd ones), each with ``warmup`` untimed steps, one metered step and one timed step, the model
    and optimizer restored after each. The prediction comes from ``profile`` (simulated, for the device the plan is
    for) or else from the plan itself (``plan.predicted_*`` and the unoptimized step the search recorded).

    Inputs, ``loss_fn``, ``optimizer``, ``autocast`` and model keywords are as for :func:`measure`.
    """
    if not isinstance(plan, Plan):
        raise ProfileError(f"compare() needs plan=<a memopt Plan>, got {type(plan).__name__}; for one measurement "
                           "without a plan use memopt.measure")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ProfileError(f"steps must be an int, the number of paired steps (at least 1, 5 or more to read a "
                           f"spread), got {steps!r}")
    common = dict(loss_fn=loss_fn, optimizer=optimizer, steps=1, warmup=warmup, model_kwargs=model_kwargs,
                  autocast=autocast, **kwargs)
    without: list[Measurement] = []
    with_plan: list[Measurement] = []
    stage("paired steps", total=steps)
    for i in range(steps):
        order = (None, plan) if i % 2 == 0 else (plan, None)
        for p in order:
            m = measure(model, *inputs, plan=p, **common)
            (with_plan if p is not None else without).append(m)
        advance()
    ratios = [b.step_time / a.step_time for a, b in zip(without, with_plan, strict=True)]
    pred = _prediction(plan, profile)
    notes = []
    if steps < 5:
        notes.append(f"only {steps} paired step{'s' if steps > 1 else ''}: take 5 or more for a spread worth reading")
    return Comparison(without=without, with_plan=with_plan, ratios=ratios, device=without[0].device,
                      method=plan.method, budget_bytes=plan.budget_bytes or None, notes=notes, **pred)


def _prediction(plan: Plan, profile: Any) -> dict[str, Any]:
    """The simulator's peak and step time with the plan and without one (from the profile, on the profiled device,
    else what the plan recorded)."""
    if profile is not None:
        sim = simulate(profile, plan)  # on the profiled device: where the steps beside it are measured
        base = simulate(profile, Plan.uniform(profile, "keep"))
        return {"predicted_peak_bytes": int(sim.peak_bytes), "predicted_step_time": float(sim.step_time),
                "predicted_base_peak_bytes": int(base.peak_bytes), "predicted_base_step_time": float(base.step_time)}
    meta = plan.meta or {}
    return {"predicted_peak_bytes": plan.predicted_peak_bytes, "predicted_step_time": plan.predicted_step_time,
            "predicted_base_peak_bytes": meta.get("base_peak"), "predicted_base_step_time": meta.get("base_step_time")}
