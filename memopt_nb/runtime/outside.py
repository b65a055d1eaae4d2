"""Leave no trace outside the model: the modules a loss function calls.

``memopt.profile(G, x, loss_fn=lambda out: D(out).mean())`` — a GAN's generator judged by its discriminator — runs
``D`` forward and backward many times (``memopt.measure`` too). :func:`~memopt_nb.runtime.step.preserved_state`
restores the profiled model; :func:`preserved_outside` restores every other module those steps call: its parameters,
gradients, buffers (BatchNorm's running statistics) and training flags, as they were when it was first called. A
profile or a measurement must change nothing a training loop could see, or "profile, then train" would not train as
"train" does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["preserved_outside"]


def _host(t: torch.Tensor) -> torch.Tensor:
    with _disable_current_modes():  # a memory meter's dispatch mode (measure's, on the CPU) must not count it
        return t.detach().to("cpu", copy=True)


class _Snapshot:
    """One module's own parameters, gradients, buffers and training flag (not its children's), in host memory."""

    __slots__ = ("module", "params", "grads", "buffers", "training")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.training = module.training
        self.params = {n: (p, _host(p)) for n, p in module._parameters.items() if p is not None}
        self.grads = {n: (p.grad, None if p.grad is None else _host(p.grad))
                      for n, p in module._parameters.items() if p is not None}
        self.buffers = {n: (b, _host(b)) for n, b in module._buffers.items() if b is not None}

    def restore(self) -> None:
        m = self.module
        m.training = self.training
        with torch.no_grad():
            for n, (p, value) in self.params.items():
                if m._parameters.get(n) is p and p.shape == value.shape:
                    p.copy_(value)
            for n, (grad, value) in self.grads.items():
                p = m._parameters.get(n)
                if p is None:
                    continue
                if value is None:
                    p.grad = None
                else:  # the same gradient tensor, as a loop holding it expects
                    grad.copy_(value)
                    if p.grad is not grad:
                        p.grad = grad
            for n, (b, value) in self.buffers.items():
                if m._buffers.get(n) is b and b.shape == value.shape:
                    b.copy_(value)
                elif n in m._buffers:
                    m._buffers[n] = b  # a module that replaced its buffer (not in place): the old one, as it was
                    b.copy_(value)


class _Watch:
    """While on, snapshots each module outside ``model`` the first time a forward reaches it (and its children)."""

    def __init__(self, model: nn.Module) -> None:
        self.inside = {id(m) for m in model.modules()}
        self.seen: dict[int, _Snapshot] = {}
        self.handle: Any = nn.modules.module.register_module_forward_pre_hook(self._pre)

    def _pre(self, module: nn.Module, args: Any) -> None:
        key = id(module)
        if key in self.inside or key in self.seen:
            return
        for m in module.modules():  # before its forward runs: its children are as the loop left them too
            if id(m) not in self.inside and id(m) not in self.seen:
                self.seen[id(m)] = _Snapshot(m)

    def stop(self) -> None:
        """Stop watching (later steps call the same modules: the snapshots hold what to restore)."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


@contextlib.contextmanager
def preserved_outside(model: nn.Module) -> Iterator[_Watch]:
    """Restore, on exit, every module outside ``model`` that a forward reached while watching.

    Watching installs a global forward pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``); call
    ``.stop()`` on what this yields after the first step, so later (timed) steps run without it. A module first called
    after that is not restored; a loss function calls the same modules every step.
    """
    watch = _Watch(model)
    try:
        yield watch
    finally:
        watch.stop()
        for snap in watch.seen.values():
            snap.restore()

