"""An environment worker process (:mod:`policygrad.envs.worker_process`): its reply tree as the
trainer reads it, ``chdir`` in an environment restored, and nothing the environments started
outliving the worker or the process that started it."""

# ruff: noqa: ARG002 - environments take the protocol's arguments
from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from policygrad.envs import StepResult
from policygrad.envs.worker_process import _encode, decode_tree, env_call, one_line, read_reply
from tests.envs.test_episodes import runner
from tests.envs.test_workers import ONE_TURN, Does, _run

pytestmark = pytest.mark.unit


def test_the_reply_tree_reads_back_as_plain_values_and_named_stand_ins():
    tree = (
        "s",
        ("l", [("d", [(("v", "role"), ("v", "user")), (("v", "content"), ("v", "hi"))])]),
        ("v", 0.5),
        ("v", True),
        ("d", [(("v", "n"), ("t", [("v", 1), ("v", None)]))]),
    )
    got = decode_tree(tree)
    assert got == StepResult([{"role": "user", "content": "hi"}], 0.5, True, {"n": (1, None)})
    stand_in = decode_tree(("o", "ndarray", "array([1, 2])"))
    assert type(stand_in).__name__ == "ndarray" and repr(stand_in) == str(stand_in) == "array([1, 2])"
    assert type(decode_tree(("o", "not a name", "x"))).__name__ == "Opaque"
    assert read_reply(pickle.dumps(("ok", tree))) == ("ok", tree)
    with pytest.raises(pickle.UnpicklingError, match=r"^the environment worker sent a policygrad\.envs"):
        read_reply(pickle.dumps(("ok", StepResult())))


def test_a_step_result_crosses_the_process_boundary_with_every_field():
    """Every field set to something other than its default survives the worker's encoding (a
    field added to StepResult and left out of the encoding would silently read as its default)."""
    result = StepResult([{"role": "user", "content": "all of it"}], 0.25, True, {"k": 2.0}, restart=True)
    defaults = StepResult()
    assert all(
        getattr(result, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(StepResult)
    )
    assert decode_tree(_encode(result)) == result


def test_a_protocol_call_and_its_one_line_error():
    class Env:
        def reset(self, row, *, seed):
            return [{"role": "user", "content": f"{row['x']} {seed}"}]

    assert env_call(Env(), "reset", ({"x": 1}, 7)) == ([{"role": "user", "content": "1 7"}], None)
    assert env_call(Env(), "close", ()) is None  # an environment without close()
    with pytest.raises(ValueError, match="unknown environment call 'jump'"):
        env_call(Env(), "jump", ())
    assert one_line(KeyError("a\nb")) == "KeyError: 'a\\nb'"
    assert one_line(RuntimeError("first\nsecond")) == "RuntimeError: first"
    assert len(one_line(ValueError("x" * 1000))) == 300


def test_chdir_in_an_environment_does_not_move_the_run():
    r, _ = runner(Does, ONE_TURN)
    home = os.getcwd()
    try:
        _, _, episodes, _ = _run(r, "chdir")
        assert not episodes.failed.any() and os.getcwd() == home
    finally:
        r.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_what_an_environment_forks_is_gone_when_the_runner_closes(tmp_path):
    # Today the forked copies of the trainer run on after it.
    pidfile = tmp_path / "pids"
    r, _ = runner(Does, ONE_TURN)
    try:
        _, _, episodes, _ = _run(r, "fork", pidfile=str(pidfile))
        assert not episodes.failed.any()
        workers = [w.process.pid for w in r.host.slots if w is not None]
    finally:
        r.close()
    children = [int(p) for p in pidfile.read_text().split()]
    assert len(children) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children + workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in children + workers)


def test_what_an_environment_starts_in_a_new_session_is_gone_when_the_runner_closes(tmp_path):
    # Before: a child in a new session (SIGTERM ignored) and an orphan re-parented to init escaped
    # the worker's process-group kill and ran on after the run.
    pidfile = tmp_path / "pids"
    r, _ = runner(Does, ONE_TURN)
    try:
        _, _, episodes, _ = _run(r, "escape", pidfile=str(pidfile))
        assert not episodes.failed.any()
        workers = [w.process.pid for w in r.host.slots if w is not None]
    finally:
        r.close()
    started = [int(p) for p in pidfile.read_text().split()]
    assert len(started) == 4  # 2 episodes, each a direct child and an orphaned sleep
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in started + workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not any(_alive(p) for p in started + workers)
    finally:  # never leave them behind, whatever the result
        for p in started:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("end", ["exit", "SIGKILL"])
def test_workers_end_with_the_process_that_started_them(end, tmp_path):
    # A script that ends without closing its runner takes its workers and what they forked with
    # it; one killed outright (SIGKILL, no cleanup at all) still takes its workers.
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {os.getcwd()!r})
        from tests.envs.test_workers import Does, ONE_TURN, _run
        from tests.envs.test_episodes import runner
        r, _ = runner(Does, ONE_TURN)
        _run(r, "fork", pidfile={str(tmp_path / "pids")!r})
        print(" ".join(str(w.process.pid) for w in r.host.slots if w is not None), flush=True)
        if {end!r} == "SIGKILL":
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
        if end == "SIGKILL":
            proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == (0 if end == "exit" else -signal.SIGKILL)
    finally:
        proc.kill()
    if end == "exit":
        pids += [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
