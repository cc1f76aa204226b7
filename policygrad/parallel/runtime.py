"""Process-level helpers of the loop: a clock that waits for the device, handing freed memory
back to the operating system between the generation and training phases, and the process's
peak resident memory."""

from __future__ import annotations

import ctypes
import resource
import sys
import time

import torch

__all__ = ["peak_rss_gb", "release_free_memory", "synced_clock"]


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Hand memory the allocator holds but no tensor uses back to the OS (glibc ``malloc_trim``).

    Generation and training need their large temporaries at different times; without a trim,
    glibc keeps the pages of one phase mapped through the next, and the process's peak RSS is
    the sum of both phases instead of the larger one. A no-op where glibc is absent."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def peak_rss_gb() -> float:
    """Peak resident set size of this process in GB (10^9 bytes), from ``getrusage``."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return kb * scale / 1e9
