"""The suite's own caches (``tests/conftest.py``) do not outlive it: a session's folder holds the
converted bundled model (~0.5 GB), and one left behind per run filled a disk."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PROBE = "PG_TEST_CONFTEST_PROBE"


def test_probe_records_the_session_cache():
    # Run by the test below, in its inner sessions: records where the session's caches live.
    if PROBE not in os.environ:
        pytest.skip("only inside test_a_session_deletes_its_cache_folders")
    with open(os.environ[PROBE], "a", encoding="utf-8") as f:
        f.write(os.environ["POLICYGRAD_HOME"] + " " + os.environ["VLLM_RPC_BASE_PATH"] + "\n")


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist-workers"])
def test_a_session_deletes_its_cache_folders(tmp_path, workers):
    # An inner session with TMPDIR at a short empty folder (a forkserver's socket path under it
    # must stay within AF_UNIX's 108 bytes): the controller and every xdist worker make a
    # policygrad-tests-* folder there and must remove it. The probe proves the caches were there.
    tmp = Path(tempfile.mkdtemp(prefix="pgt-", dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        probe = tmp_path / "homes.txt"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        env.update(TMPDIR=str(tmp), **{PROBE: str(probe)})
        args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", str(workers)]
        args.append("tests/test_conftest.py::test_probe_records_the_session_cache")
        result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "1 passed" in result.stdout
        homes, rpc = zip(*(line.split() for line in probe.read_text(encoding="utf-8").splitlines()))
        assert len(homes) == 1 and Path(homes[0]).parent.parent == tmp
        assert not Path(homes[0]).exists()
        # vLLM's sockets went into the same session folder, deleted with it
        assert Path(rpc[0]).parent == Path(homes[0]).parent and not Path(rpc[0]).exists()
        assert sorted(p.name for p in tmp.glob("policygrad-tests-*")) == []
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
