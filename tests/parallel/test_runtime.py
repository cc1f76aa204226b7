"""The loop's process helpers: a clock read after the device's queued work, and handing freed
memory back to the operating system (glibc ``malloc_trim``)."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from policygrad.parallel import runtime
from policygrad.parallel.runtime import peak_rss_gb, release_free_memory, synced_clock

pytestmark = pytest.mark.unit


def test_synced_clock_on_cpu_is_perf_counter_without_a_device_sync(monkeypatch):
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    before = time.perf_counter()
    now = synced_clock(torch.device("cpu"))
    after = time.perf_counter()
    assert before <= now <= after  # the same clock, read between the two
    assert synced == []  # nothing to wait for on the CPU


def test_synced_clock_on_cuda_waits_for_that_device_first(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    real = time.perf_counter
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: events.append(("clock", None)) or real())
    device = torch.device("cuda", 1)
    synced_clock(device)
    assert events == [("sync", device), ("clock", None)]  # the clock is read after the sync


def test_release_free_memory_trims_with_pad_zero(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "_MALLOC_TRIM", lambda pad: calls.append(pad))
    assert release_free_memory() is None
    assert calls == [0]  # keep no slack at the top of the heap


def test_release_free_memory_is_a_no_op_without_glibc(monkeypatch):
    monkeypatch.setattr(runtime, "_MALLOC_TRIM", None)
    assert release_free_memory() is None


def test_malloc_trim_is_found_where_glibc_is():
    import ctypes

    try:
        ctypes.CDLL("libc.so.6")
    except OSError:
        pytest.skip("no glibc here")
    assert runtime._malloc_trim() is not None
    release_free_memory()  # the real call returns without error


def test_malloc_trim_is_none_where_libc_cannot_be_loaded(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(runtime.ctypes, "CDLL", missing)
    assert runtime._malloc_trim() is None


def test_peak_rss_is_kib_on_linux_and_bytes_on_macos(monkeypatch):
    monkeypatch.setattr(
        runtime.resource, "getrusage", lambda _who: types.SimpleNamespace(ru_maxrss=2_000_000)
    )
    monkeypatch.setattr(sys, "platform", "linux")
    assert peak_rss_gb() == pytest.approx(2_000_000 * 1024 / 1e9, rel=1e-12)  # 2.048 GB
    monkeypatch.setattr(sys, "platform", "darwin")
    assert peak_rss_gb() == pytest.approx(2_000_000 / 1e9, rel=1e-12)  # 0.002 GB


def test_peak_rss_of_this_process_is_positive():
    assert 0 < peak_rss_gb() < 1e4
