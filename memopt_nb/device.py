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
        """Measure the device tensors live on: a CUDA GPU if given or available, else the CPU as an emulated device."""
        import torch

        dev = torch.device(device) if device is not None else None
        if dev is None:
            dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if dev.type not in ("cpu", "cuda"):
            raise MemoptError(f"memopt_nb supports CPU and CUDA devices, not {dev.type!r}")
        from .runtime.limit import active_limit, uncounted

        with uncounted():  # measuring the device is not the training's memory
            spec = _detect_cuda(dev) if dev.type == "cuda" else _detect_cpu()
        limit = active_limit(dev)  # inside memopt.limit_memory the device holds the limit
        if limit is not None:
            spec = spec.with_changes(capacity_bytes=min(limit, spec.capacity_bytes),
                                     note=spec.note + f"; capacity limited by memopt.limit_memory to {limit} bytes")
        return spec

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

    def copy_seconds(self, nbytes: Any, n_storages: Any = 0, direction: str = "both") -> Any:
        """Seconds a copy of ``nbytes`` bytes in ``n_storages`` storages costs — the one copy-cost formula of memopt_nb.

        ``nbytes / bandwidth + n_storages * copy_overhead_s`` for one direction (``"d2h"`` to host, ``"h2d"`` back to
        the device); ``"both"`` is the round trip a swap makes, the sum of the two. The bytes term is what occupies a
        copy engine; the per-storage term is spent by the training thread. Without ``copy_overlap`` both add to the
        step; with it, the simulator queues the bytes term on the copy engines and adds only the per-storage term (see
        :mod:`memopt_nb.simulate`). ``copy_seconds(nbytes, 0, d)`` and ``copy_seconds(0, n_storages, d)`` give the two
        terms alone. The formula is linear: the arguments may be numpy arrays, and the solvers read its coefficients
        as ``copy_seconds(1.0, 0, d)`` per byte and ``copy_seconds(0.0, 1, d)`` per storage. A device without a host
        link never copies; its bytes term is 0.
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
        from .budget import format_bytes

        link = f"{self.h2d_bytes_per_s / GB:.1f} GB/s host link" if self.has_host_link else "no host link"
        if self.has_host_link and self.copy_overhead_s:
            link += f" + {self.copy_overhead_s * 1e6:.0f} µs per storage copied"
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


_CPU_CACHE: dict[tuple[int, int], DeviceSpec] = {}

#: Shape of the copy-overhead calibration: units of storages saved for backward, each this many float32 elements.
_CAL_UNITS, _CAL_STORAGES, _CAL_NUMEL, _CAL_REPEATS = 32, 8, 1024, 5


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _calibrate_copy_overhead(bandwidth: float, device: Any = "cpu") -> float:
    """Seconds per storage and direction that the real CPU swap path costs beyond moving the bytes.

    Runs a chain of ``_CAL_UNITS`` units, each saving ``_CAL_STORAGES`` small storages, forward and backward with the
    swap engine (every unit swapped, offload window 1, prefetch distance 1) and without it, interleaved, and takes the
    difference of the fastest runs (a shared machine only ever slows a run down), less the bytes' own copy time, per
    storage and direction. About 0.1-0.4 s; leaves torch's random state alone. ``device``: where the chain runs (on
    CUDA: the engine's side streams, events and pinned pool).
    """
    import torch

    from .plan import effective_triggers
    from .runtime.swap import SwapEngine

    n, k = _CAL_UNITS, _CAL_STORAGES
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    strategies = ["swap"] * n
    engine = SwapEngine(strategies, [1] * n, effective_triggers(strategies, [1] * n))

    def unit(h: Any) -> Any:
        for _ in range(k):
            h = torch.sigmoid(h)  # saves its output: one storage per op, dropped by the unit once it returns
        return h * 2.0

    def step(swap: bool) -> float:
        x = torch.ones(_CAL_NUMEL, device=device, requires_grad=True)
        sync()
        t0 = time.perf_counter()
        h = x
        for i in range(n):
            if swap:
                p = engine.begin_unit(i)
                with engine.hooks(p, i, set()):
                    y = unit(h)
                engine.end_unit(p, i, y)
            else:
                y = unit(h)
            h = y
        h.sum().backward()
        sync()
        return time.perf_counter() - t0

    try:
        with torch.inference_mode(False), torch.enable_grad():
            step(True), step(False)  # warm-up: copy threads, host pool
            swapped, plain = [], []
            for _ in range(_CAL_REPEATS):
                swapped.append(step(True))
                plain.append(step(False))
    finally:
        engine.close()
    copies = 2 * n * k  # each storage goes to the host and back
    nbytes = _CAL_NUMEL * 4
    per_copy = (min(swapped) - min(plain)) / copies - nbytes / bandwidth
    return max(0.0, per_copy)


def _detect_cpu() -> DeviceSpec:
    import ctypes

    import torch

    threads, cores = torch.get_num_threads(), _usable_cores()
    cached = _CPU_CACHE.get((threads, cores))
    if cached is not None:
        return cached
    # the emulated copy engine is a worker thread doing a single-threaded memmove: measure exactly that (the best of
    # the timed runs, as for compute: a shared machine only ever slows a run down)
    src = torch.ones(64 * 2**20, dtype=torch.uint8)
    dst = torch.zeros_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
        times.append(time.perf_counter() - t0)
    del src, dst
    bandwidth = 64 * 2**20 / min(times[1:])
    try:
        overhead = _calibrate_copy_overhead(bandwidth)
        how = f"per-storage copy cost {overhead * 1e6:.1f} µs measured on the swap engine"
    except Exception as exc:  # pragma: no cover - defensive: detection must not fail over a refinement
        overhead = 0.0
        how = f"per-storage copy cost not measured ({type(exc).__name__}: {exc})"
    spare = threads < cores
    spec = DeviceSpec(
        name="cpu (emulated device)",
        kind="cpu",
        capacity_bytes=_host_memory_bytes(),
        h2d_bytes_per_s=bandwidth,
        d2h_bytes_per_s=bandwidth,
        compute_flops=_matmul_flops("cpu", 512),
        copy_overlap=spare,
        copy_overhead_s=overhead,
        note="CPU as an emulated training device: link = measured single-thread memmove, compute = measured fp32 "
        f"matmul, {how}; torch uses {threads} of {cores} cores, so the copy threads "
        + ("have a spare core: copies overlap compute" if spare else "share the cores with compute: copies add to "
           "the step"),
    )
    _CPU_CACHE[(threads, cores)] = spec
    return spec


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

    h2d, d2h = bw(gpu, host), bw(host, gpu)
    del host, gpu
    try:  # the swap engine's side streams, events and pinned pool: 62-80 µs per storage on an H200 (2026-12-04)
        overhead = _calibrate_copy_overhead(min(h2d, d2h), dev)
        how = f"per-storage copy cost {overhead * 1e6:.1f} µs measured on the swap engine"
    except Exception as exc:  # defensive: detection must not fail over a refinement
        overhead = 0.0
        how = f"per-storage copy cost not measured ({type(exc).__name__}: {exc})"
    return DeviceSpec(
        name=props.name,
        kind="cuda",
        capacity_bytes=int(props.total_memory),
        h2d_bytes_per_s=h2d,
        d2h_bytes_per_s=d2h,
        compute_flops=_matmul_flops(dev, 4096),
        copy_overhead_s=overhead,
        note=f"detected: pinned-memory copy bandwidth and fp32 matmul throughput measured at profile time, {how}",
    )
