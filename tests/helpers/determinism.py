"""Deterministic kernels for a test process that compares training bit for bit on a GPU.

``benchmarks/cuda_check.py`` runs the CUDA tests in a pytest of their own with ``MEMOPT_NB_DETERMINISTIC=1``;
``tests/conftest.py`` then calls :func:`deterministic_from_env` before any test, so that the tests comparing a plan's
training with plain training run on deterministic kernels (convolution and attention backward are not repeatable
without them) with cuBLAS's fixed workspace (set before cuBLAS starts). On the CPU the kernels are deterministic
anyway; the suite leaves the setting alone unless asked."""

from __future__ import annotations

import os

import torch

__all__ = ["ENV", "deterministic_from_env"]

ENV = "MEMOPT_NB_DETERMINISTIC"


def deterministic_from_env() -> bool:
    """Turn deterministic algorithms on (and cuBLAS's workspace fixed) if ``MEMOPT_NB_DETERMINISTIC=1``; whether it
    did."""
    if os.environ.get(ENV) != "1":
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    return True
