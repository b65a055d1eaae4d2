"""The device a plan is made for: memory capacity, host link bandwidth and compute speed.

A :class:`DeviceSpec` is detected for the device a model was profiled on (:meth:`DeviceSpec.detect`) or taken from a
preset for a GPU you do not have (:meth:`DeviceSpec.preset`). The simulator uses three things from it:

* ``capacity_bytes`` — what a plan must fit in when no explicit budget is given;
* ``h2d_bytes_per_s`` / ``d2h_bytes_per_s`` — the host link the swap engine copies over (0 means no host link: swap is
  impossible);
* ``compute_flops`` — achieved fp32 matmul throughput. Profiled times are rescaled to another device by the ratio of
  the two devices' ``compute_flops`` (or by an explicit ``time_scale``). This is a roofline-free, first-order rule:
  it assumes the step is compute bound and ignores kernel-launch overheads, so treat simulated GPU times as estimates.

On a machine without an accelerator the training device is *emulated* on the CPU: "device memory" is the memory of
tensors the training step holds, the host store of the swap engine is excluded, and the link bandwidth is the measured
speed of a host memory copy. The saving it reports is an emulation; on CUDA it is real.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

from .errors import MemoptError

GB = 10**9
GiB = 2**30
TFLOP = 1e12

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
        copy_overlap: whether host copies run beside compute (GPUs: dedicated copy engines). On the emulated CPU device
            copies share the cores and memory bus with compute, so their time adds to the step.
        note: where the figures come from.
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
        """Measure the device tensors live on: a CUDA GPU if given or available, else the CPU as an emulated device."""
        import torch

        dev = torch.device(device) if device is not None else None
        if dev is None:
            dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if dev.type == "cuda":
            return _detect_cuda(dev)
        if dev.type != "cpu":
            raise MemoptError(f"memopt_nb supports CPU and CUDA devices, not {dev.type!r}")
        return _detect_cpu()

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
    def has_host_link(self) -> bool:
        """Whether tensors can be swapped to host memory on this device."""
        return self.h2d_bytes_per_s > 0 and self.d2h_bytes_per_s > 0

    def time_factor(self, profiled_on: DeviceSpec) -> float:
        """Factor that turns times profiled on ``profiled_on`` into times on this device."""
        if self.time_scale is not None:
            return self.time_scale
        return profiled_on.compute_flops / self.compute_flops

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise MemoptError(f"unknown DeviceSpec fields {sorted(unknown)}")
        return cls(**data)

    def __str__(self) -> str:
        from .budget import format_bytes

        link = f"{self.h2d_bytes_per_s / GB:.1f} GB/s host link" if self.has_host_link else "no host link"
        return f"{self.name} ({format_bytes(self.capacity_bytes)}, {link}, {self.compute_flops / TFLOP:.2f} TFLOP/s)"


# ---------------------------------------------------------------------- detection helpers
def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GiB


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def _matmul_flops(device: Any, n: int, repeats: int = 8) -> float:
    """Achieved fp32 matmul FLOP/s: the best of several runs (a shared machine only ever slows a run down)."""
    import torch

    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    times = []
    for _ in range(repeats + 1):
        if a.is_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if a.is_cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / min(times[1:])


_CPU_CACHE: DeviceSpec | None = None


def _detect_cpu() -> DeviceSpec:
    global _CPU_CACHE
    if _CPU_CACHE is not None:
        return _CPU_CACHE
    import ctypes

    import torch

    # the emulated copy engine is a worker thread doing a single-threaded memmove: measure exactly that
    src = torch.ones(64 * 2**20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
        times.append(time.perf_counter() - t0)
    bandwidth = src.numel() / _median(times[1:])
    _CPU_CACHE = DeviceSpec(
        name="cpu (emulated device)",
        kind="cpu",
        capacity_bytes=_host_memory_bytes(),
        h2d_bytes_per_s=bandwidth,
        d2h_bytes_per_s=bandwidth,
        compute_flops=_matmul_flops("cpu", 512),
        copy_overlap=False,
        note="CPU as an emulated training device: link = measured single-thread memmove, compute = measured fp32 "
        "matmul; copies share the cores with compute",
    )
    return _CPU_CACHE


def _detect_cuda(dev: Any) -> DeviceSpec:  # pragma: no cover - needs a GPU
    import torch

    props = torch.cuda.get_device_properties(dev)
    n = 64 * 2**20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)

    def bw(dst: Any, src: Any) -> float:
        times = []
        for _ in range(5):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        return n / _median(times[1:])

    return DeviceSpec(
        name=props.name,
        kind="cuda",
        capacity_bytes=int(props.total_memory),
        h2d_bytes_per_s=bw(gpu, host),
        d2h_bytes_per_s=bw(host, gpu),
        compute_flops=_matmul_flops(dev, 4096),
        note="detected: pinned-memory copy bandwidth and fp32 matmul throughput measured at profile time",
    )
