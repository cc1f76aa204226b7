"""Processes by their parent, from ``/proc`` (:mod:`policygrad.sandbox.procfs`): a child is found
under its parent, a grandchild among the descendants after its parent, and a process name with
spaces and parentheses does not confuse the parse."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from policygrad.sandbox.procfs import child_pids, descendants

pytestmark = pytest.mark.unit

# A child that names itself "odd) 1 (x" (prctl PR_SET_NAME = 15), starts a grandchild, prints its
# pid and waits for its stdin to close. Its /proc/PID/stat reads "PID (odd) 1 (x) S PPID ...": only
# a parse after the last ")" finds PPID.
PARENT = """
import ctypes, subprocess, sys
ctypes.CDLL(None).prctl(15, b"odd) 1 (x", 0, 0, 0)
grandchild = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
print(grandchild.pid, flush=True)
sys.stdin.read()
grandchild.stdin.close()
grandchild.wait()
"""


def test_children_are_read_from_proc():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert child.pid in child_pids().get(os.getpid(), [])
        assert child_pids().get(child.pid, []) == []
    finally:
        child.stdin.close()
        child.wait()


def test_descendants_list_children_before_their_children_whatever_their_names():
    child = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        grandchild = int(child.stdout.readline())
        with open(f"/proc/{child.pid}/stat", "rb") as handle:
            assert handle.read().startswith(f"{child.pid} (odd) 1 (x) ".encode())
        assert child_pids()[child.pid] == [grandchild]
        found = descendants(os.getpid())
        assert found.index(child.pid) < found.index(grandchild)
        assert descendants(child.pid) == [grandchild] and descendants(grandchild) == []
    finally:
        child.stdin.close()
        child.wait()
    assert child.pid not in descendants(os.getpid())  # ended and reaped
