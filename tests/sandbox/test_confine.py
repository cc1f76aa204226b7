"""Entering the sandbox (:mod:`policygrad.sandbox.confine`), the part that runs without a sandbox:
the resource limits, set in a bare child interpreter that has only the modules' own source (as
the sandbox's worker has). Namespaces, bubblewrap and the supervisor run in
tests/sandbox/test_runner.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from policygrad.sandbox.launch import modules_program

pytestmark = pytest.mark.unit


def test_set_limits_sets_equal_soft_and_hard_limits_in_a_child_interpreter():
    program = modules_program(("procfs", "confine")) + (
        "import json, resource\n"
        "w = sys.modules['policygrad.sandbox.confine']\n"
        "nproc = resource.getrlimit(resource.RLIMIT_NPROC)\n"
        "w.set_limits(json.loads(sys.argv[1]))\n"
        "names = ['CORE', 'AS', 'CPU', 'FSIZE', 'NOFILE', 'NPROC']\n"
        "out = {n: resource.getrlimit(getattr(resource, 'RLIMIT_' + n)) for n in names}\n"
        "out['NPROC_BEFORE'] = nproc\n"
        "print(json.dumps(out))\n"
    )
    limits = {"memory_bytes": 1 << 31, "cpu_time_s": 2.2, "max_write_bytes": 1 << 20, "max_processes": 0}
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", program, json.dumps(limits)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["CORE"] == [0, 0]
    assert got["AS"] == [1 << 31, 1 << 31]
    assert got["CPU"] == [3, 3]  # 2.2 s rounded up to whole seconds
    assert got["FSIZE"] == [1 << 20, 1 << 20]
    assert got["NOFILE"] == [256, 256]
    assert got["NPROC"] == got["NPROC_BEFORE"]  # max_processes 0: left as it was
