"""Environments in worker processes (:mod:`policygrad.envs.workers`): what an environment does
to its own process (``os._exit``, a signal, ``chdir``, a fork, a C call holding the GIL, editing
its row) fails or stays in its episode, never reaches the run; workers leave nothing behind."""

# ruff: noqa: ARG002 - environments take the protocol's arguments
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from policygrad.envs import Environment, StepResult
from policygrad.envs.workers import InProcessHost, ProcessHost
from tests.envs.test_episodes import enc, runner, turns_script
from tests.tiny import EOS_ID

pytestmark = pytest.mark.unit

ONE_TURN = turns_script([enc("a") + [EOS_ID]])


class Does(Environment):
    """One turn; ``step`` does what the row's ``act`` says; reward 1.0 when it returns."""

    def reset(self, row, *, seed):
        self.row = row
        return [{"role": "user", "content": "go"}]

    def step(self, action):
        act = self.row["act"]
        if act == "exit":
            os._exit(0)
        if act in ("SIGKILL", "SIGTERM"):
            os.kill(os.getpid(), getattr(signal, act))
            time.sleep(5)
        if act == "chdir":
            os.chdir("/")
        if act == "gil":
            ctypes.PyDLL(None).sleep(20)  # PyDLL keeps the GIL through the C call
        if act == "escape":  # out of the worker's process group: a new session, SIGTERM ignored
            ignore = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
            child = subprocess.Popen([sys.executable, "-c", ignore], start_new_session=True)
            # and an orphan: sh ends at once, leaving its sleep (new session) to be re-parented
            shell = f"sleep 60 & echo $! >> {self.row['pidfile']}"
            subprocess.Popen(["sh", "-c", shell], start_new_session=True).wait()
            with open(self.row["pidfile"], "a") as f:
                f.write(f"{child.pid}\n")
        if act == "fork":
            child = os.fork()
            if child == 0:
                time.sleep(60)
                os._exit(0)
            with open(self.row["pidfile"], "a") as f:
                f.write(f"{child}\n")
        return StepResult(reward=1.0, done=True, info={"pid": float(os.getpid())})


def _run(r, act, G=2, **row):
    return r.run(
        [{"prompt": "p", "act": act, **row}], group_size=G, seeds=[3], per_prompt_seeds=False, sampling={}
    )


@pytest.mark.parametrize(
    ("act", "how"), [("exit", "exit status 0"), ("SIGKILL", "SIGKILL"), ("SIGTERM", "SIGTERM")]
)
def test_an_environment_that_ends_its_process_fails_its_episode_not_the_run(act, how):
    # Today os._exit(0) ends the test process itself; SIGTERM runs the trainer's handler.
    r, _ = runner(Does, ONE_TURN, retries=1, workers=1)
    try:
        _, _, episodes, _ = _run(r, act)
        assert episodes.failed.tolist() == [True, True]
        assert how in episodes.errors[0] and "worker process ended" in episodes.errors[0]
        assert episodes.retries == 2  # each episode tried once more, on a fresh worker
        # A well-behaved episode after it runs on a fresh worker.
        _, _, episodes, _ = _run(r, "nothing")
        assert episodes.failed.tolist() == [False, False] and episodes.final_rewards.tolist() == [0.0, 0.0]
    finally:
        r.close()


def test_environments_run_in_other_processes_and_in_process_without_isolation():
    isolated, _ = runner(Does, ONE_TURN)
    trusted, _ = runner(Does, ONE_TURN, isolation=False)
    try:
        assert isinstance(isolated.host, ProcessHost) and isinstance(trusted.host, InProcessHost)
        assert os.getpid() not in _run(isolated, "nothing").__getitem__(2).info["pid"].tolist()
        assert _run(trusted, "nothing")[2].info["pid"].tolist() == [os.getpid()] * 2
    finally:
        isolated.close()


def test_a_c_call_holding_the_gil_cannot_stretch_the_step_timeout():
    # Today the trainer's own thread waits on the GIL for the whole 20 s call.
    r, _ = runner(Does, ONE_TURN, step_timeout_s=1.0, retries=0)
    start = time.monotonic()
    try:
        _, _, episodes, _ = _run(r, "gil", G=1)
        assert time.monotonic() - start < 10
        assert "timed out after 1 s (rollout.env_step_timeout_s)" in episodes.errors[0]
    finally:
        r.close()


class EditsRow(Environment):
    """``reset`` edits its row (a field, a nested list) and opens with what it found."""

    def reset(self, row, *, seed):
        row["log"].append(1)
        row["prompt"] += "!"
        return [{"role": "user", "content": f"{row['prompt']} {len(row['log'])}"}]

    def step(self, action):
        return StepResult(done=True)


@pytest.mark.parametrize("isolation", [True, False])
def test_each_episode_resets_on_its_own_copy_of_the_row(isolation):
    # Today the G episodes share the row: the 2nd reset finds "p!! 2" and fails its episode as
    # one whose opening differs from its group's.
    r, _ = runner(EditsRow, ONE_TURN, isolation=isolation)
    row = {"prompt": "p", "log": []}
    try:
        _, _, episodes, _ = r.run([row], group_size=4, seeds=[1], per_prompt_seeds=False, sampling={})
    finally:
        r.close()
    assert not episodes.failed.any()
    assert [t[0]["content"] for t in episodes.transcripts] == ["p! 1"] * 4
    assert row == {"prompt": "p", "log": []}


class CloseFails(Does):
    def close(self):
        raise OSError("port still bound")


def test_close_failing_in_every_episode_is_counted_and_said_once(caplog):
    # Today nothing counts it and nothing is said.
    r, _ = runner(CloseFails, ONE_TURN)
    try:
        with caplog.at_level(logging.WARNING, logger="policygrad"):
            first = _run(r, "nothing", G=3)[2]
            second = _run(r, "nothing", G=3)[2]
    finally:
        r.close()
    assert first.close_errors == second.close_errors == 3 and not first.failed.any()
    said = [m for m in caplog.messages if "close() failed" in m]
    assert len(said) == 1 and "OSError: port still bound" in said[0] and "env/close_errors" in said[0]


def test_an_environment_defined_in_main_runs_in_process_with_a_note(caplog):
    local = type("Local", (Does,), {"__module__": "__main__"})
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        r, _ = runner(local, ONE_TURN)
    assert isinstance(r.host, InProcessHost)
    assert any("runs in the trainer's process" in m and "__main__" in m for m in caplog.messages)
