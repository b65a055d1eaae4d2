"""``opt.step()`` under a whole-step plan: in parts, unit by unit (a parameter at a time where the state streams),
each part's state and parameters coming in while the one before steps (see :mod:`memopt_nb.runtime.state`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .slots import HostTensor, Slot

__all__ = ["Stepping"]


class Stepping:
    """The optimizer step run part by part with the user's own optimizer: a part of
    :class:`~memopt_nb.runtime.state.StateManager`."""

    def _raw_step(self, chunk: list[nn.Parameter]) -> None:
        opt = self.optimizer
        fn = type(opt).step
        raw = fn.__wrapped__ if getattr(fn, "hooked", False) else fn
        ids = {id(p) for p in chunk}
        groups = opt.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = [p for p in ps if id(p) in ids]
            raw(opt)
        finally:
            for g, ps in zip(groups, saved, strict=True):
                g["params"] = ps

    def _bring(self, chunk: list[nn.Parameter], wait: bool) -> list[Slot]:
        """Start (and optionally finish) bringing a chunk's state and parameters to the device."""
        slots = []
        for p in chunk:
            slots += self._bring_state(p, wait=False)
        for u in sorted({self.unit_of[id(p)] for p in chunk if id(p) in self.unit_of}):
            if self._param_slots[u]:
                self._fetch_params(u, wait=False)
        if wait:
            self._finish_bring(chunk, slots)
        return slots

    def _finish_bring(self, chunk: list[nn.Parameter], slots: list[Slot]) -> None:
        for s in slots:
            s.wait()
        for u in sorted({self.unit_of[id(p)] for p in chunk if id(p) in self.unit_of}):
            if self._param_slots[u]:
                self._fetch_params(u, wait=True)

    def _chunks_of(self, u: int, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """Unit ``u``'s part of the step (``params`` in ``param_groups`` order): one chunk, or one per trainable
        parameter when its optimizer state streams (frozen ones, which step nothing, ride with the first)."""
        if self.placements[u].optimizer != "stream":
            return [params]
        chunks = [[p] for p in params if p.requires_grad]
        frozen = [p for p in params if not p.requires_grad]
        if frozen:
            chunks = [chunks[0] + frozen, *chunks[1:]] if chunks else [frozen]
        return chunks

    def _run_parts(self, parts: list[list[list[nn.Parameter]]], before_step: Any = None) -> None:
        """Step ``parts`` one after another, each one chunk after another (see the module docstring).

        With prefetch, part ``i + 1``'s first chunk comes in when part ``i`` starts and the next chunk of a part while
        the one before it steps; a chunk's state leaves once the next chunk is on the device. ``before_step(chunk)``,
        if given, runs when a chunk's parameters, gradients and state are on the device, just before it steps."""
        if not parts:
            return
        ahead: list[Slot] | None = None  # the next part's first chunk, on its way in
        for i, part in enumerate(parts):
            pending, ahead = ahead, None
            for j, chunk in enumerate(part):
                if pending is None:
                    pending = self._bring(chunk, wait=False)
                self._finish_bring(chunk, pending)
                self._release_pending()  # the previous chunk's state has reached the host
                pending = None
                if self.prefetch:  # else each chunk comes after the one before it has stepped (one on the device)
                    if j == 0 and i + 1 < len(parts):
                        ahead = self._bring(parts[i + 1][0], wait=False)
                    if j + 1 < len(part):
                        pending = self._bring(part[j + 1], wait=False)
                self._step_chunk(chunk, before_step)
                for p in chunk:
                    u = self.unit_of.get(id(p))
                    if u is not None and self.placements[u].optimizer != "resident":
                        self._send_state(p)
            for u in sorted({self.unit_of[id(p)] for chunk in part for p in chunk if id(p) in self.unit_of}):
                if self._param_slots[u]:
                    self._param_dirty[u] = True
                    if not self._in_bw[u]:
                        self._free_params(u)
        self._release_pending()

    def _step_chunk(self, chunk: list[nn.Parameter], before_step: Any) -> None:
        """Step one chunk, its offloaded gradients brought back for the step (their host copies stay valid)."""
        swapped = []
        for p in chunk:
            g = p.grad
            if isinstance(g, HostTensor) and not g._stepped:
                p.grad = g._slot.materialize()
                self.stats["grad_h2d_bytes"] += g._slot.nbytes
                swapped.append((p, g))
        if chunk:
            if before_step is not None:
                before_step(chunk)
            self._raw_step(chunk)
        for p, g in swapped:
            p.grad = g

    def _all_chunks(self, opt: torch.optim.Optimizer, closure: Any = None) -> Any:
        self._refuse_after_undo("opt.step()")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        order = self._opt_ids()
        outside: list[nn.Parameter] = []
        by_unit: list[list[nn.Parameter]] = [[] for _ in self.unit_params]
        for g in opt.param_groups:
            for p in g["params"]:
                u = self.unit_of.get(id(p))
                if u is None:
                    outside.append(p)
                elif u not in self._stepped:
                    by_unit[u].append(p)
        if any(pl.managed for pl in self.placements):
            # a fixed schedule: the parameters outside units, then every unit in order, each while the next one's
            # state and parameters come in (a unit stepped in backward is an empty chunk), so what is on the device
            # at each point of the step depends on each unit's own placement only
            # (a unit whose state streams steps one parameter at a time)
            parts = [[outside]] + [self._chunks_of(u, ps) or [[]] for u, ps in enumerate(by_unit)]
        else:
            parts = [[outside + [p for ps in by_unit for p in ps]]]
        self._run_parts(parts)
        self._stepped.clear()
        self._undo.clear()  # the steps in backward were this step's: no longer to be undone (until here they are, if
        # the step runs out of memory: runtime/oom.py)
        self._reorder_state(order)
        if self._lr_sched:
            opt._opt_called = True
        return loss

    def _reorder_state(self, order: dict[int, int]) -> None:
        """Put state entries created in this step in the order plain training creates them (``param_groups`` order)."""
        state = self.optimizer.state
        new = [k for k in state if id(k) not in self._state_keys]
        if new:
            old = [(k, v) for k, v in state.items() if id(k) in self._state_keys]
            fresh = sorted(((k, state[k]) for k in new), key=lambda kv: order.get(id(kv[0]), len(order)))
            state.clear()
            state.update(old + fresh)
        self._state_keys = {id(k) for k in state}
