"""Measuring the device a model trains on: fp32 matmul throughput, host-link bandwidth and the per-storage cost of
the real swap path, into a :class:`~memopt_nb.core.device.DeviceSpec` (what :meth:`DeviceSpec.detect` returns).

On CUDA the link is timed with pinned-memory copies; on the CPU, the emulated device's link is a single-threaded
memmove (what the emulated copy engine does). Detection is cached per thread count on the CPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ..core.device import LIMIT_NOTE, DeviceSpec, GiB, set_detector
from ..core.errors import MemoptError
from ..core.plan import effective_triggers
from .limit import active_limit, uncounted
from .swap import SwapEngine

__all__ = ["detect"]


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
    try:  # the swap engine's side streams, events and pinned pool
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


def detect(device: Any = None) -> DeviceSpec:
    """Measure the device tensors live on: a CUDA GPU if given or available, else the CPU as an emulated device.

    torch's random generators are left as they were (the measurements draw random matrices)."""
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if dev.type not in ("cuda", "cpu"):
        raise MemoptError(f"memopt_nb supports CPU and CUDA devices, not {dev.type!r}")
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    # the benchmarks draw random matrices: the loop's random numbers must not move; and measuring the device is not
    # the training's memory
    with torch.random.fork_rng(devices=devices), uncounted():
        spec = _detect_cuda(dev) if dev.type == "cuda" else _detect_cpu()
    limit = active_limit(dev)  # inside memopt.limit_memory the device holds the limit
    if limit is not None:
        spec = spec.with_changes(capacity_bytes=min(limit, spec.capacity_bytes),
                                 note=spec.note + f"; {LIMIT_NOTE} {limit} bytes")
    return spec


set_detector(detect)
