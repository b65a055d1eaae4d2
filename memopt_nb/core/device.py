"""The device a plan is made for: memory capacity, host link bandwidth and compute speed.

A :class:`DeviceSpec` is detected for the device a model was profiled on (:meth:`DeviceSpec.detect`) or taken from a
preset for a GPU you do not have (:meth:`DeviceSpec.preset`). The simulator uses three things from it:

* ``capacity_bytes`` — what a plan must fit in when no explicit budget is given;
* ``h2d_bytes_per_s`` / ``d2h_bytes_per_s`` — the host link the swap engine copies over (0 means no host link: swap is
  impossible);
* ``copy_overhead_s`` — seconds of the training thread per storage copied, per direction (hooks, hand-off to the copy
  engine, host pool); ``copy_overlap`` — whether the bytes cross the link beside compute.
  :meth:`DeviceSpec.copy_seconds` is the one formula every part of memopt_nb prices a copy with;
* ``compute_flops`` — achieved fp32 matmul throughput. Profiled times are rescaled to another device by the ratio of
  the two devices' ``compute_flops`` (or by an explicit ``time_scale``). This is a roofline-free, first-order rule:
  it assumes the step is compute bound and ignores kernel-launch overheads, so treat simulated GPU times as estimates.

On a machine without an accelerator the training device is *emulated* on the CPU: "device memory" is the memory of
tensors the training step holds, the host store of the swap engine is excluded, and the link bandwidth is the measured
speed of a host memory copy. The saving it reports is an emulation; on CUDA it is real. Two things about copies are
measured when the CPU is detected, because on this device they, not the bytes, dominate what swapping costs:

* the per-storage cost of the real swap path (``copy_overhead_s``), timed on the engine itself with many small storages
  (CUDA detection times it too, on the engine's side streams, events and pinned pool);
* whether the copy threads have a core of their own (``copy_overlap``): true when torch computes on fewer threads than
  the process may use (``torch.get_num_threads() < len(os.sched_getaffinity(0))``). Then a copy's bytes move beside the
  compute, like a GPU's copy engine, and cost time only where the step waits for them; otherwise they add to the step.
  A job of at most ``ThreadCopyEngine.INLINE_BYTES`` (1 MiB) is copied on the training thread instead, because handing
  it to a worker costs that thread more than the memmove; the simulator still queues its bytes on the copy engine
  (about 0.1 ms per job at most, roughly the hand-off it saves), and the per-storage cost measured here is that path's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .budget import format_bytes
from .errors import MemoptError

__all__ = ["DeviceSpec", "GB", "LIMIT_NOTE", "PRESET_EFFICIENCY", "TFLOP", "set_detector"]

GB = 10**9
GiB = 2**30
TFLOP = 1e12

#: What :meth:`DeviceSpec.detect` adds to the note of a device inside :func:`memopt_nb.limit_memory` (its capacity is
#: the limit), followed by the limit in bytes.
LIMIT_NOTE = "capacity limited by memopt.limit_memory to"

#: Fraction of the fp32 peak a preset is assumed to reach on the matmul-heavy part of a step.
PRESET_EFFICIENCY = 0.6

# name: (capacity, host link GB/s each way, fp32 peak TFLOP/s, note with sources)
_PRESETS: dict[str, tuple[int, float, float, str]] = {
    "v100-16gb": (
        16 * GiB,
        12.0,
        15.7,
        "NVIDIA V100 SXM2 datasheet: 16 GB HBM2, 15.7 TFLOP/s fp32; PCIe 3.0 x16 (15.75 GB/s raw, ~12 GB/s measured)",
    ),
    "a100-40gb": (
        40 * GiB,
        25.0,
        19.5,
        "NVIDIA A100 datasheet: 40 GB HBM2, 19.5 TFLOP/s fp32; PCIe 4.0 x16 (31.5 GB/s raw, ~25 GB/s measured)",
    ),
    "a100-80gb": (
        80 * GiB,
        25.0,
        19.5,
        "NVIDIA A100 datasheet: 80 GB HBM2e, 19.5 TFLOP/s fp32; PCIe 4.0 x16 host link (~25 GB/s measured)",
    ),
    "h100-80gb": (
        80 * GiB,
        50.0,
        67.0,
        "NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 67 TFLOP/s fp32; PCIe 5.0 x16 (63 GB/s raw, ~50 GB/s measured)",
    ),
    "h200-141gb": (
        141 * GB,
        50.0,
        67.0,
        "NVIDIA H200 SXM datasheet: 141 GB HBM3e, 67 TFLOP/s fp32; PCIe 5.0 x16 host link (~50 GB/s measured)",
    ),
    "rtx4090-24gb": (
        24 * GiB,
        25.0,
        82.6,
        "NVIDIA Ada (AD102) whitepaper: RTX 4090 24 GB GDDR6X, 82.6 TFLOP/s fp32; PCIe 4.0 x16 (~25 GB/s measured)",
    ),
}
_ALIASES = {
    "v100": "v100-16gb",
    "a100": "a100-40gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "h100": "h100-80gb",
    "h200": "h200-141gb",
    "rtx4090": "rtx4090-24gb",
    "4090": "rtx4090-24gb",
    "rtx-4090-24gb": "rtx4090-24gb",
}


@dataclass(frozen=True)
class DeviceSpec:
    """Capacity, host link and compute speed of one training device.

    Attributes:
        name: human-readable name (``"a100-40gb"``, ``"NVIDIA H200"``, ``"cpu (emulated device)"``).
        kind: ``"cpu"`` (emulated device on the host), ``"cuda"`` (a real GPU) or ``"preset"`` (simulated only).
        capacity_bytes: device memory in bytes.
        h2d_bytes_per_s: host-to-device copy bandwidth; 0 means no host link.
        d2h_bytes_per_s: device-to-host copy bandwidth; 0 means no host link.
        compute_flops: achieved fp32 matmul FLOP/s, used to rescale profiled times to this device.
        time_scale: if set, profiled times are multiplied by this factor instead of the FLOP/s ratio.
        copy_overlap: whether host copies run beside compute (GPUs: dedicated copy engines; the emulated CPU device when
            the copy threads have a spare core). Without overlap a copy's time adds to the step.
        note: where the figures come from.
        copy_overhead_s: seconds the training thread spends per storage copied, per direction, whatever its size
            (saved-tensor hooks, hand-off to the copy engine, host pool). Measured at detection on the CPU; 0 for the
            GPU presets (no documented figure; the bytes dominate there). Profiles saved before this field existed load
            with 0.

    What a copy costs is :meth:`copy_seconds` — the one formula the simulator, the exact solver, the baselines and the
    planner's heuristics all use.
    """

    name: str
    kind: str
    capacity_bytes: int
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    compute_flops: float
    time_scale: float | None = None
    copy_overlap: bool = True
    note: str = ""
    copy_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda", "preset"):
            raise MemoptError(f"DeviceSpec.kind must be 'cpu', 'cuda' or 'preset', got {self.kind!r}")
        if self.capacity_bytes <= 0:
            raise MemoptError(f"DeviceSpec.capacity_bytes must be positive, got {self.capacity_bytes}")
        if self.h2d_bytes_per_s < 0 or self.d2h_bytes_per_s < 0:
            raise MemoptError("DeviceSpec bandwidths must be >= 0 (0 means no host link)")
        if self.compute_flops <= 0:
            raise MemoptError(f"DeviceSpec.compute_flops must be positive, got {self.compute_flops}")
        if self.time_scale is not None and self.time_scale <= 0:
            raise MemoptError(f"DeviceSpec.time_scale must be positive, got {self.time_scale}")
        if not isinstance(self.copy_overhead_s, (int, float)) or not 0 <= self.copy_overhead_s < math.inf:
            raise MemoptError(f"DeviceSpec.copy_overhead_s must be a finite number of seconds >= 0, got "
                              f"{self.copy_overhead_s!r}")

    # ------------------------------------------------------------------ construction
    @staticmethod
    def preset_names() -> list[str]:
        """Names accepted by :meth:`preset`."""
        return sorted(_PRESETS)

    @classmethod
    def preset(cls, name: str) -> DeviceSpec:
        """A GPU you may not have, from its datasheet: ``DeviceSpec.preset("a100-40gb")``."""
        if isinstance(name, DeviceSpec):
            return name
        key = str(name).strip().lower().replace("_", "-").replace(" ", "-")
        key = _ALIASES.get(key, key)
        if key not in _PRESETS:
            raise MemoptError(f"unknown device preset {name!r}; known presets: {', '.join(cls.preset_names())}")
        cap, link, tflops, note = _PRESETS[key]
        return cls(
            name=key,
            kind="preset",
            capacity_bytes=cap,
            h2d_bytes_per_s=link * GB,
            d2h_bytes_per_s=link * GB,
            compute_flops=tflops * TFLOP * PRESET_EFFICIENCY,
            note=note + f"; compute assumed at {PRESET_EFFICIENCY:.0%} of fp32 peak",
        )

    @classmethod
    def detect(cls, device: Any = None) -> DeviceSpec:
        """Measure the device tensors live on: a CUDA GPU if given or available, else the CPU as an emulated device;
        torch's random generators are left as they were, and inside :func:`memopt_nb.limit_memory` the capacity is
        the limit.

        The measuring runs real kernels and the swap engine, so it lives in :mod:`memopt_nb.runtime.detect`, which
        installs itself here when the package is imported."""
        if _detector is None:  # pragma: no cover - the package installs it on import
            raise MemoptError("no device detector installed: import memopt_nb (it installs memopt_nb.runtime.detect)")
        return _detector(device)

    @classmethod
    def resolve(cls, device: DeviceSpec | str | None, default: DeviceSpec) -> DeviceSpec:
        """``None`` → ``default``; a preset name → that preset; a DeviceSpec → itself."""
        if device is None:
            return default
        if isinstance(device, DeviceSpec):
            return device
        if isinstance(device, str):
            return cls.preset(device)
        raise MemoptError(f"device must be a DeviceSpec, a preset name or None, not {type(device).__name__}")

    def with_changes(self, **changes: Any) -> DeviceSpec:
        """A copy with some fields changed, e.g. ``spec.with_changes(capacity_bytes=8 * 2**30)``."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ use
    @property
    def capacity_known(self) -> bool:
        """Whether ``capacity_bytes`` is what a training step must fit in: a GPU (detected or a preset), or the
        emulated device inside :func:`memopt_nb.limit_memory`; not the emulated device's host memory."""
        return self.kind != "cpu" or LIMIT_NOTE in self.note

    @property
    def has_host_link(self) -> bool:
        """Whether tensors can be swapped to host memory on this device."""
        return self.h2d_bytes_per_s > 0 and self.d2h_bytes_per_s > 0

    def copy_seconds(self, nbytes: Any, n_storages: Any = 0, direction: str = "both") -> Any:
        """Seconds a copy of ``nbytes`` bytes in ``n_storages`` storages costs — the one copy-cost formula of memopt_nb.

        ``nbytes / bandwidth + n_storages * copy_overhead_s`` for one direction (``"d2h"`` to host, ``"h2d"`` back to
        the device); ``"both"`` is the round trip a swap makes, the sum of the two. The bytes term is what occupies a
        copy engine; the per-storage term is spent by the training thread. Without ``copy_overlap`` both add to the
        step; with it, the simulator queues the bytes term on the copy engines and adds only the per-storage term (see
        :mod:`memopt_nb.sim.simulator`). ``copy_seconds(nbytes, 0, d)`` and ``copy_seconds(0, n_storages, d)`` give
        the two terms alone. The formula is linear: the arguments may be numpy arrays, and the solvers read its
        coefficients as ``copy_seconds(1.0, 0, d)`` per byte and ``copy_seconds(0.0, 1, d)`` per storage. A device
        without a host link never copies; its bytes term is 0.
        """
        if direction == "both":
            return self.copy_seconds(nbytes, n_storages, "d2h") + self.copy_seconds(nbytes, n_storages, "h2d")
        if direction not in ("d2h", "h2d"):
            raise MemoptError(f"copy direction must be 'd2h', 'h2d' or 'both', got {direction!r}")
        bandwidth = self.d2h_bytes_per_s if direction == "d2h" else self.h2d_bytes_per_s
        per_byte = 1.0 / bandwidth if bandwidth > 0 else 0.0
        return nbytes * per_byte + n_storages * self.copy_overhead_s

    def time_factor(self, profiled_on: DeviceSpec) -> float:
        """Factor that turns times profiled on ``profiled_on`` into times on this device."""
        if self.time_scale is not None:
            return self.time_scale
        return profiled_on.compute_flops / self.compute_flops

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict (:meth:`from_dict` reads it back; fields added later get their defaults)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        """A DeviceSpec from :meth:`to_dict`'s output; fields missing from older files take their defaults."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise MemoptError(f"unknown DeviceSpec fields {sorted(unknown)}")
        return cls(**data)

    def __str__(self) -> str:
        link = f"{self.h2d_bytes_per_s / GB:.1f} GB/s host link" if self.has_host_link else "no host link"
        if self.has_host_link and self.copy_overhead_s:
            link += f" + {self.copy_overhead_s * 1e6:.0f} µs per storage copied"
        return f"{self.name} ({format_bytes(self.capacity_bytes)}, {link}, {self.compute_flops / TFLOP:.2f} TFLOP/s)"


#: Measures a device (``DeviceSpec.detect``); installed by :mod:`memopt_nb.runtime.detect`.
_detector: Callable[[Any], DeviceSpec] | None = None


def set_detector(detect: Callable[[Any], DeviceSpec]) -> None:
    """Install the function :meth:`DeviceSpec.detect` measures a device with."""
    global _detector
    _detector = detect
