"""What the sandbox takes and gives (:mod:`policygrad.sandbox.records`): limits checked when made
and as the worker reads them, a test spec's count and its checks, the binary verdict."""

from __future__ import annotations

import pytest

from policygrad.sandbox.records import SandboxLimits, TestResult, TestSpec

pytestmark = pytest.mark.unit


def test_limits_are_checked():
    with pytest.raises(ValueError, match="sandbox limit wall_time_s must be a positive number, got 0"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="below the 64 MiB"):
        SandboxLimits(memory_bytes=1 << 20)


def test_the_worker_reads_the_cpu_time_as_the_wall_time_unless_set():
    assert SandboxLimits(wall_time_s=3.5).for_worker() == {
        "wall_time_s": 3.5,
        "cpu_time_s": 3.5,
        "memory_bytes": 1 << 30,
        "max_processes": 64,
        "max_write_bytes": 256 << 20,
        "max_output_bytes": 1 << 20,
    }
    assert SandboxLimits(wall_time_s=3.5, cpu_time_s=1.0).for_worker()["cpu_time_s"] == 1.0
    with pytest.raises(ValueError, match="cpu_time_s must be positive or None, got 0"):
        SandboxLimits(cpu_time_s=0)


def test_a_test_spec_counts_check_as_one_test_and_each_assert():
    assert TestSpec(names=("f",), check="def check(c): pass", entry_point="f", asserts=("a", "b")).total == 3
    assert TestSpec(names=("f",), asserts=("assert f() == 1",)).total == 1
    with pytest.raises(ValueError, match="needs entry_point"):
        TestSpec(names=("f",), check="def check(c): pass")
    with pytest.raises(ValueError, match="needs check code or at least one assert"):
        TestSpec(names=("f",))


def test_all_passed_needs_every_test_and_at_least_one():
    assert TestResult(2, 2, False).all_passed
    assert not TestResult(1, 2, False).all_passed
    assert not TestResult(0, 0, False).all_passed  # no test: no verdict of correctness
