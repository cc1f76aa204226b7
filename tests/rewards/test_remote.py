"""The reward worker process (:mod:`policygrad.rewards.remote`): a closed worker is gone, a
SIGTERM to the trainer's process group leaves a call to finish, and every call sees the caller's
environment variables (the worker comes from a forkserver that an earlier run started)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from policygrad.rewards.isolation import isolate_reward_functions
from policygrad.rewards.registry import CompositeReward
from policygrad.rewards.remote import RewardWorker

pytestmark = pytest.mark.integration  # starts worker processes


def _score(fn):
    return CompositeReward([fn], on_error="skip")(["p", "p"], ["ab", "c"])


def test_a_closed_worker_process_is_gone(user_file):
    worker = RewardWorker(timeout_s=5)
    worker.load(f"{user_file}:ok")
    process = worker._process
    assert process.is_alive()
    worker.close()
    process.join(5)
    assert not process.is_alive()


def test_sigterm_to_the_process_group_leaves_the_call_to_finish(user_file):
    # torchrun, job schedulers and `kill -- -PGID` send SIGTERM to every process of the trainer's
    # group, this worker included: the trainer finishes its step (this call) and then stops, so
    # the worker must not die under it.
    worker = RewardWorker(timeout_s=10)
    worker.load(f"{user_file}:naps")
    timer = threading.Timer(0.4, os.kill, (worker._process.pid, signal.SIGTERM))
    timer.start()
    try:
        assert worker.call(f"{user_file}:naps", ["p", "p"], ["ab", "c"], {}) == [2.0, 1.0]
        assert worker._process.is_alive()
    finally:
        timer.cancel()
        worker.close()


def test_each_run_and_call_sees_the_callers_environment(user_file, monkeypatch):
    # Two runs in one process (a notebook, a sweep): workers come from a forkserver that the
    # process's first run started; the second run's variables must still reach its functions.
    spec = f"{user_file}:env_value"
    for value in ("1.5", "2.5"):
        monkeypatch.setenv("POLICYGRAD_TEST_RUN_VALUE", value)
        functions, worker = isolate_reward_functions([spec], timeout_s=10.0)
        try:
            assert _score(functions[0]).rewards.tolist() == [float(value)] * 2, value
            if value == "2.5":  # within one run: a change before a call reaches that call
                monkeypatch.setenv("POLICYGRAD_TEST_RUN_VALUE", "3.5")
                assert _score(functions[0]).rewards.tolist() == [3.5, 3.5]
                monkeypatch.delenv("POLICYGRAD_TEST_RUN_VALUE")
                assert _score(functions[0]).rewards.tolist() == [-1.0, -1.0]
        finally:
            worker.close()
