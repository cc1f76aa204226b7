"""The suite's own caches (``tests/conftest.py``) do not outlive it: a session's folder holds the
converted bundled model (~0.5 GB), and one left behind per run filled a disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist-workers"])
def test_a_session_deletes_its_cache_folders(tmp_path, workers):
    # A session that runs one cheap test, with TMPDIR pointed at an empty folder: the controller
    # and every xdist worker make a policygrad-tests-* folder there and must remove it.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(workers)]
    args.append("tests/test_errors.py::test_all_names_exactly_the_three_errors")
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert sorted(p.name for p in tmp_path.glob("policygrad-tests-*")) == []
