"""Starting rollout servers (policygrad/rollout/serve.py): the vLLM options and environment a
policygrad server runs with, the ``policygrad serve`` command's mistakes as one line, and a
server that fails to start named with its log. (Servers that start and serve:
tests/rollout/test_server.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from policygrad.cli import main
from policygrad.rollout.serve import ServerProcesses, ServerStartError, server_arguments, server_environment
from policygrad.specs.engines import vllm_available


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.unit
def test_server_arguments_ask_for_what_a_run_needs():
    args = server_arguments("/m", port=8123, max_model_len=600)
    assert _option(args, "--model") == "/m" and _option(args, "--port") == "8123"
    assert _option(args, "--logprobs-mode") == "processed_logprobs"  # the sampled distribution's
    assert _option(args, "--generation-config") == "vllm"  # only the request's stop ids end a response
    assert json.loads(_option(args, "--weight-transfer-config")) == {"backend": "policygrad_gloo"}
    assert {"--enforce-eager", "--skip-tokenizer-init", "--enable-scale-out"} <= set(args)
    # CPU: no chunked prefill (a seeded request cannot rewind a CPU generator), and a step's token
    # budget that holds the longest prompt
    assert "--no-enable-chunked-prefill" in args and _option(args, "--max-num-batched-tokens") == "4096"
    assert _option(server_arguments("/m", port=1, max_model_len=9000), "--max-num-batched-tokens") == "9000"
    gpu = server_arguments("/m", port=1, on_cpu=False, gpu_memory_utilization=0.5, prefix_caching=False)
    assert _option(gpu, "--gpu-memory-utilization") == "0.5" and "--no-enable-chunked-prefill" not in gpu
    assert "--no-enable-prefix-caching" in gpu


@pytest.mark.unit
def test_server_environment_opens_the_weight_routes_and_binds_the_cpus():
    env = server_environment(kv_cache_gb=0.3, cpus=[1, 3])
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /init_weight_transfer_engine, /update_weights, ...
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # whole GiB, at least 1
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1,3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_environment()


@pytest.mark.unit
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "x", "m"], "argument --port: invalid int value: 'x'"),
        (["m", "--cpus", "3-1"], "--cpus: '3-1' is not a CPU list"),
        (["/no/such/folder"], "the folder '/no/such/folder' does not exist"),
    ],
)
def test_serve_mistakes_are_one_error_line(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


@pytest.mark.integration
@pytest.mark.skipif(not vllm_available(), reason="vllm is not installed")
def test_a_server_that_cannot_start_is_named_with_its_log(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    processes = ServerProcesses(str(empty), 1, log_dir=str(tmp_path / "logs"), start_timeout_s=120)
    start = time.monotonic()
    with pytest.raises(
        ServerStartError, match=r"rollout server 0 exited with code \d+ before it answered; see "
    ):
        processes.start()
    assert time.monotonic() - start < 120
    assert (tmp_path / "logs" / "server-0.log").read_text()  # the reason is there
    assert processes.processes[0].poll() is not None


def _gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.integration
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="the parent-death signal is Linux's")
def test_a_killed_run_leaves_no_server_behind(server_model_dir, tmp_path):
    # A run's process that starts a server and is then SIGKILLed (no atexit, no close): the
    # server gets the parent-death signal and exits.
    code = (
        "import sys, time\n"
        "from policygrad.rollout.serve import ServerProcesses\n"
        f"p = ServerProcesses({server_model_dir!r}, 1, log_dir={str(tmp_path)!r}, max_model_len=512)\n"
        "p.start_one(0)\n"
        "print(p.processes[0].pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        server = int(run.stdout.readline())
        assert not _gone(server)
        run.kill()
        run.wait()
        deadline = time.monotonic() + 30
        while not _gone(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(server)
    finally:
        run.kill()


class _Exited:
    def poll(self):
        return 1


class _Running:
    def poll(self):
        return None


def _servers_whose_start_loses_its_port(tmp_path, monkeypatch, log_text, *, losses):
    """ServerProcesses with one server that has exited, its log ``log_text`` (the part before
    ``|`` written by an earlier start); each restart loses its port again until ``losses``
    restarts have happened, then comes up healthy."""
    import policygrad.rollout.serve as serve

    earlier, _, current = log_text.partition("|")
    log = tmp_path / "server-0.log"
    log.write_text(earlier + current)
    processes = ServerProcesses.__new__(ServerProcesses)
    processes.processes, processes.urls, processes.logs = [_Exited()], ["lost"], [str(log)]
    processes.log_starts, processes.start_timeout_s = [len(earlier)], 60.0
    restarts = []

    def start_one(i):
        restarts.append(i)
        processes.log_starts[i] = log.stat().st_size
        if len(restarts) < losses:
            log.write_text(log.read_text() + "OSError: [Errno 98] Address already in use\n")
            processes.processes[i] = _Exited()
        else:
            processes.processes[i], processes.urls[i] = _Running(), "ok"
        return processes.urls[i]

    processes.start_one = start_one
    monkeypatch.setattr(serve, "healthy", lambda url: url == "ok")
    return processes, restarts


@pytest.mark.unit
def test_a_server_whose_port_was_taken_before_it_bound_starts_again_on_another(tmp_path, monkeypatch):
    # free_port() releases the port it found; another process can bind it before the server does
    processes, restarts = _servers_whose_start_loses_its_port(
        tmp_path, monkeypatch, "|OSError: [Errno 98] Address already in use\n", losses=1
    )
    processes.wait([0])
    assert restarts == [0] and processes.urls == ["ok"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "log_text",
    [
        "|ValueError: not a model folder\n",  # another reason: named at once
        "OSError: [Errno 98] Address already in use\n|ValueError: not a model folder\n",  # an earlier start's
    ],
)
def test_a_server_that_exits_for_another_reason_is_not_started_again(tmp_path, monkeypatch, log_text):
    processes, restarts = _servers_whose_start_loses_its_port(tmp_path, monkeypatch, log_text, losses=1)
    with pytest.raises(ServerStartError, match="rollout server 0 exited with code 1 before it answered"):
        processes.wait([0])
    assert restarts == []


@pytest.mark.unit
def test_a_port_lost_again_and_again_is_an_error_after_the_retries(tmp_path, monkeypatch):
    import policygrad.rollout.serve as serve

    processes, restarts = _servers_whose_start_loses_its_port(
        tmp_path, monkeypatch, "|OSError: [Errno 98] Address already in use\n", losses=serve.PORT_RETRIES + 5
    )
    with pytest.raises(ServerStartError, match="exited with code 1"):
        processes.wait([0])
    assert restarts == [0] * serve.PORT_RETRIES
