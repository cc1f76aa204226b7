"""Starting and ending a sandbox worker (:mod:`policygrad.sandbox.launch`): the worker's modules
run from their source in a bare interpreter, the bubblewrap command line, the capped reading of
an output pipe, and the end of a worker's whole process group."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from policygrad.sandbox import launch
from policygrad.sandbox.launch import Drain, bwrap_argv, close_fds, kill_worker, modules_program
from policygrad.sandbox.records import SandboxLimits

pytestmark = pytest.mark.unit


def test_the_worker_modules_run_from_their_source_without_the_package(tmp_path):
    # -I -S and a folder without the package: only the program's own source can provide them.
    program = modules_program(launch.WORKER_MODULES) + (
        "w = sys.modules['policygrad.sandbox.worker']\n"
        "print(sorted(k for k in sys.modules if k.startswith('policygrad')))\n"
        "print(w.encode((1, b'x')), w.main.__module__, w.supervise.__module__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-B", "-c", program], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    modules, used = done.stdout.splitlines()
    assert modules == str(["policygrad", "policygrad.sandbox", *(f"policygrad.sandbox.{m}" for m in
                                                                sorted(launch.WORKER_MODULES))])
    assert used == "{'__t': 'tuple', 'v': [1, {'__t': 'bytes', 'v': '78'}]} policygrad.sandbox.worker " \
        "policygrad.sandbox.confine"
    assert launch.worker_program().endswith('sys.modules["policygrad.sandbox.worker"].main()\n')


def test_bwrap_gets_a_clean_environment_a_sized_tmpfs_and_the_interpreter_read_only():
    python = launch.interpreter()
    argv = bwrap_argv("/usr/bin/bwrap", python, SandboxLimits(max_write_bytes=1 << 20))
    assert argv[0] == "/usr/bin/bwrap" and argv[-1] == "--"
    assert "--clearenv" in argv and "--unshare-net" in argv and "--die-with-parent" in argv
    assert argv[argv.index("--tmpfs") - 2 : argv.index("--tmpfs") + 2] == ["--size", str(1 << 20), "--tmpfs",
                                                                         "/sandbox"]
    setenv = [argv[i + 1 : i + 3] for i, a in enumerate(argv) if a == "--setenv"]
    assert setenv == [list(item) for item in launch.CLEAN_ENV.items()]
    bound = {argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"}
    assert {p for p in launch.readonly_paths(python) if not os.path.islink(p)} <= bound
    assert ("--unshare-user" in argv) == (os.geteuid() != 0)


def test_a_drain_counts_up_to_its_cap_and_keeps_the_head():
    drain = Drain(-1, cap=10, keep=4)
    assert drain.feed(b"abc") and drain.count == 3
    assert not drain.feed(b"defghijk")  # 11 bytes >= the cap of 10: close the pipe
    assert drain.count == 11 and drain.text == "abcd"
    assert not Drain(-1, cap=10).feed(b"")  # end of file
    assert Drain(-1, cap=10, keep=2).feed(b"\xff\xfe") and launch.KEPT_OUTPUT_BYTES == 4096


def test_kill_worker_ends_the_whole_process_group_and_reaps_the_worker():
    # The worker ignores SIGTERM and leaves a child in its group: both must go.
    program = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, start_new_session=True)
    child = int(proc.stdout.readline())
    kill_worker(proc)
    assert proc.returncode == -signal.SIGKILL
    for _ in range(200):  # the child is init's to reap: wait until it is gone or a zombie
        try:
            with open(f"/proc/{child}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.01)
    else:
        raise AssertionError(f"process {child} of the worker's group is still running")
    proc.stdout.close()


def test_close_fds_closes_each_and_ignores_those_already_closed():
    r, w = os.pipe()
    os.close(w)
    close_fds(r, w)
    with pytest.raises(OSError):
        os.fstat(r)
