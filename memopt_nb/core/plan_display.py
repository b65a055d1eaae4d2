"""How a plan reads: one line (:meth:`PlanDisplay.summary`, also its ``repr``) and a table per unit in a notebook
(``_repr_html_``): strategy, swap timing in words and where the unit's state lives."""

from __future__ import annotations

import html

from .budget import format_bytes
from .strategies import OFFLOADING, REGISTRY

__all__ = ["PlanDisplay"]


class PlanDisplay:
    """The display half of :class:`~memopt_nb.core.plan.Plan` (a mixin: it reads the plan's decisions, counts, budget
    and predictions)."""

    def summary(self) -> str:
        """One line: method, the device it is for, strategy counts and predictions."""
        c = self.counts()
        name = (self.device or {}).get("name")
        device = f" for {name}" if name else ""
        counted = ", ".join(f"{s.name} {c[s.name]}" for s in REGISTRY if s.default or c[s.name])  # opt-in: if used
        parts = [f"Plan[{self.method}]{device}: {len(self.decisions)} units: {counted}"]
        sc = self.state_counts()
        moved = [f"{k} {v}" for k, v in (("optimizer offloaded", sc["optimizer"]),
                                         ("grads offloaded", sc["grads"]), ("stepped in backward", sc["step"]),
                                         ("params offloaded", sc["params"])) if v]
        streamed = sum(d.optimizer == "stream" for d in self.decisions)
        if streamed:
            moved[0] += f" ({streamed} streamed a parameter at a time)"
        if moved:
            parts.append("state: " + ", ".join(moved))
        if self.head:
            parts.append(f"LM head {self.head['module']} in {self.head['chunks']} chunks (not bit-identical: "
                         "gradients summed in another order)")
        if self.budget_bytes:
            parts.append(f"budget {format_bytes(self.budget_bytes)}")
        if self.predicted_peak_bytes is not None:
            parts.append(f"predicted peak {format_bytes(self.predicted_peak_bytes)}")
        if self.predicted_step_time is not None:
            parts.append(f"step {self.predicted_step_time * 1e3:.2f} ms")
        if self.feasible is False:
            parts.append("INFEASIBLE")
        if self.meta.get("interrupted"):
            parts.append("interrupted")
        return ", ".join(parts)

    def _repr_html_(self) -> str:
        rows = []
        for d in self.decisions:
            timing = ""
            if d.strategy in OFFLOADING:
                w, k = d.offload_window, d.prefetch_distance
                out = ("copy to host done before the next forward" if w == 0 else
                       f"copy to host may overlap the next {w} forward{'s' if w > 1 else ''}")
                back = ("copy back when its backward starts" if k == 0 else
                        f"copy back starts {k} unit{'s' if k > 1 else ''} ahead in backward")
                timing = f"{out}; {back} (window {w}, prefetch {k})"
            state = ", ".join(f"{k} {v}" for k, v in zip(("optimizer", "grads", "params"), d.placement, strict=True)
                              if v != "resident") or "resident"
            if d.strategy == "selective":
                timing = f"saves {html.escape(d.save_set)} ({len(d.save_ops)} op outputs)"
            rows.append(f"<tr><td>{html.escape(d.unit)}</td><td>{d.strategy}</td><td>{timing}</td>"
                        f"<td>{state}</td></tr>")
        return (
            f"<div><b>{html.escape(self.summary())}</b><table><thead><tr><th>unit</th><th>strategy</th>"
            '<th title="swapped units only: offload window (forwards the copy to host may overlap) and prefetch '
            f'distance (units ahead the copy back starts)">swap timing</th>'
            '<th title="where the unit\'s optimizer state, gradients and parameters live">state</th></tr></thead>'
            f'<tbody>{"".join(rows)}'
            "</tbody></table></div>"
        )
