"""Leaving a whole-step plan's block when its state does not fit the device: the manager stays applied, *parked*, until
the same plan's next block takes it over or :func:`bring_back` (see :mod:`memopt_nb.runtime.state`)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from ..core.budget import format_bytes
from ..core.errors import MemoptWarning
from .free import device_room
from .slots import HostTensor
from .state_errors import StateError

__all__ = ["Parking", "bring_back", "parked_manager"]

#: managers whose plan's block ended with their host state not fitting the device (:meth:`Parking.leave`)
_PARKED: weakref.WeakSet = weakref.WeakSet()


class Parking:
    """What happens to the state on the host when the plan's block ends: a part of
    :class:`~memopt_nb.runtime.state.StateManager`."""

    @property
    def parked(self) -> bool:
        """Whether the plan's block has ended with this manager still applied, its host state not fitting the device
        (see :meth:`leave`)."""
        return self._parked

    def host_bytes(self) -> int:
        """The bytes of parameters, optimizer state and gradients on the host now: what :meth:`remove` would bring to
        the device."""
        total = sum(s.nbytes for u, slots in enumerate(self._param_slots) if self._param_where[u] != "device"
                    for s in slots)
        for (_, key), slot in self._state_slots.items():
            st = self.optimizer.state.get(slot.owner)
            v = st.get(key) if st is not None else None
            if isinstance(v, HostTensor) and v._slot is slot:
                total += slot.nbytes
        return total + sum(p.grad._slot.nbytes for ps in self.unit_params for p in ps
                           if isinstance(p.grad, HostTensor) and not p.grad._stepped)

    def leave(self) -> bool:
        """End the plan's block: :meth:`remove` if what is on the host fits the device now (returns ``True``), else
        stay applied, parked (returns ``False``): every parameter, gradient and optimizer-state tensor stays where the
        plan put it and keeps moving as under the plan, so the model and optimizer keep working as inside the block
        and the device never holds more than it did between steps there. :func:`bring_back` removes it later; the next
        ``memopt.plan`` with the same placements takes it over."""
        if self._mover is None:
            return True
        if self._backward_failed():  # leaving by an exception raised mid-backward
            self._recover_failed_backward()
        need, room = self.host_bytes(), device_room(self._device)
        if room is None or need <= room:
            self.remove()
            return True
        if not self._parked:
            self._parked = True
            _PARKED.add(self)
            self.stats["parked_bytes"] = need
            warnings.warn(
                f"memopt: {format_bytes(need)} of training state (parameters, gradients, optimizer state) stay on the "
                f"host after the plan's block: the device has {format_bytes(room)} free. The model and optimizer keep "
                "working (that state moves to the device as under the plan); call memopt.bring_back(optimizer) when "
                "the device has room", MemoptWarning, stacklevel=4)
        return False

    def resume(self) -> Parking:
        """A parked manager taken over by the next block of a plan with its placements: applied again as it is."""
        self._parked = False
        _PARKED.discard(self)
        return self

    def matches(self, model: nn.Module, units: Sequence[nn.Module], placements: Sequence[Any],
                step_in_backward: bool) -> bool:
        """Whether this manager places the state of ``units`` of ``model`` as ``placements`` say."""
        return (model is self.model and len(units) == len(self.modules)
                and all(a is b for a, b in zip(units, self.modules, strict=True))
                and list(placements) == self.placements and step_in_backward == self.step_in_backward)

    def bring_back(self) -> int:
        """Remove a parked manager if what it holds on the host fits the device now (see :func:`bring_back`); returns
        the bytes brought back."""
        need, room = self.host_bytes(), device_room(self._device)
        if room is not None and need > room:
            raise StateError(
                f"the training state a plan's block left on the host ({format_bytes(need)}) does not fit the device "
                f"now ({format_bytes(room)} free); free device memory first (del what you no longer need), or keep "
                "training under the plan (`with memopt.plan(p):` with the same plan takes the state over as it is)")
        self.remove()
        return need


def parked_manager(obj: Any) -> Parking | None:
    """The parked :class:`~memopt_nb.runtime.state.StateManager` of ``obj`` (a model or an optimizer), or ``None``."""
    for mgr in list(_PARKED):
        if mgr.parked and (obj is mgr.optimizer or obj is mgr.model):
            return mgr
    return None


def bring_back(obj: Any) -> int:
    """Bring the training state a plan's block left on the host back to the device and remove what of the plan stayed
    to move it; ``obj`` is the model or its optimizer. Returns the bytes brought back (0 if nothing was left there).

    Leaving ``with memopt.plan(p):`` brings every parameter, gradient and optimizer-state tensor back only if all of
    it fits the device then; otherwise it stays where the plan put it (see :meth:`Parking.leave`). Call this once
    the device has room (outside ``memopt.limit_memory``, or after freeing memory). Raises :class:`StateError`, with
    nothing changed, if it still does not fit."""
    mgr = parked_manager(obj)
    return 0 if mgr is None else mgr.bring_back()
