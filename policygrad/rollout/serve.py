"""Rollout servers: vLLM's OpenAI-compatible server started with the routes and settings a
policygrad run samples and pushes weights through (:mod:`policygrad.rollout.server`).

``python -m policygrad.rollout.serve MODEL [vLLM options]`` (what ``policygrad serve`` runs)
registers the gloo weight-transfer engine (:mod:`policygrad.rollout.transfer`) and runs vLLM's
API server in this process with:

- ``VLLM_SERVER_DEV_MODE=1``: the weight-update routes (``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/weight_info``);
- ``--enable-scale-out``: token ids in and out through ``/inference/v1/generate`` (no tokenizer);
- ``--logprobs-mode processed_logprobs``: the log-prob of the distribution each token was drawn
  from (after temperature, top-k and top-p), as the in-process engine reports;
- ``--generation-config vllm``: only the request's stop ids end a response (the model folder's
  ``generation_config.json`` eos ids are not added), as in-process;
- eager mode, and on CPU no chunked prefill (a seeded request cannot rewind a CPU generator).

:class:`ServerProcesses` starts such servers as child processes (a count of them, each on its own
CPUs or GPU), waits for their health check, and stops them with the run.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time

from policygrad.errors import TrainingError
from policygrad.rollout.server_api import healthy
from policygrad.rollout.transfer import ENGINE_NAME, register

__all__ = ["ServerProcesses", "ServerStartError", "main", "server_arguments", "server_environment"]

CPU_BATCHED_TOKENS = 4096


class ServerStartError(TrainingError):
    """A rollout server that exited or did not answer its health check in time."""


def server_arguments(
    model: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    dtype: str = "float32",
    max_model_len: int | None = None,
    seed: int = 0,
    on_cpu: bool = True,
    prefix_caching: bool = True,
    gpu_memory_utilization: float = 0.9,
) -> list[str]:
    """vLLM server options for a policygrad rollout server of ``model`` (a local folder)."""
    args = [
        "--model", model,
        "--host", host,
        "--port", str(int(port)),
        "--dtype", dtype,
        "--seed", str(int(seed)),
        "--enforce-eager",
        "--skip-tokenizer-init",
        "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--weight-transfer-config", json.dumps({"backend": ENGINE_NAME}),
        "--worker-extension-cls", "policygrad.rollout.transfer_worker.RegisterTransfer",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    if max_model_len is not None:
        args += ["--max-model-len", str(int(max_model_len))]
    if on_cpu:
        batched = max(int(max_model_len or 0), CPU_BATCHED_TOKENS)
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(batched)]
    else:
        args += ["--gpu-memory-utilization", str(float(gpu_memory_utilization))]
    return args


def server_environment(kv_cache_gb: float | None = None, cpus: list[int] | None = None) -> dict[str, str]:
    """The environment variables a rollout server needs (added to the caller's)."""
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "fork"}
    if kv_cache_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(float(kv_cache_gb))))
    if cpus:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
    return env


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _child_setup(cpus: list[int] | None, parent: int) -> None:
    """In a server's process before it runs: die with the trainer (Linux's parent-death signal,
    so a killed run leaves no server behind; libc is loaded in the parent, no import here) and
    run on ``cpus``."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the trainer died before the signal was armed
            os._exit(1)
    if cpus:
        os.sched_setaffinity(0, cpus)


# Starts of one server on a new port after another process took the one it was given.
PORT_RETRIES = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcesses:
    """Rollout servers started as child processes of this one, stopped by :meth:`stop`.

    Args:
        model: local model folder the servers load.
        count: how many servers.
        cpus: per server, the CPU ids it runs on (its process affinity and vLLM's OpenMP bind
            list), or None for every allowed CPU.
        gpus: per server, the GPU it runs on (``CUDA_VISIBLE_DEVICES``), or None.
        log_dir: each server's output goes to ``server-<i>.log`` there.
        start_timeout_s: how long a server may take to answer its health check.
        dtype, max_model_len, seed, kv_cache_gb, prefix_caching, gpu_memory_utilization: the
            servers' vLLM settings (:func:`server_arguments`).

    Raises (on :meth:`start`):
        ServerStartError: a server exited before it was healthy, or was not healthy within
            ``start_timeout_s`` (the others are stopped; the message names its log).
    """

    def __init__(
        self,
        model: str,
        count: int,
        *,
        log_dir: str,
        cpus: list[list[int]] | None = None,
        gpus: list[str] | None = None,
        start_timeout_s: float = 300.0,
        dtype: str = "float32",
        max_model_len: int | None = None,
        seed: int = 0,
        kv_cache_gb: float | None = 1.0,
        prefix_caching: bool = True,
        gpu_memory_utilization: float = 0.9,
    ):
        self.model, self.count, self.log_dir = model, int(count), log_dir
        self.cpus, self.gpus = cpus, gpus
        self.start_timeout_s = float(start_timeout_s)
        self.settings = dict(
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            on_cpu=gpus is None,
            prefix_caching=prefix_caching,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        self.kv_cache_gb = kv_cache_gb
        self.processes: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.logs: list[str] = []
        self.log_starts: list[int] = []  # where each server's current start begins in its log

    def start(self) -> list[str]:
        """Start every server and wait until all answer ``/health``; returns their base URLs."""
        os.makedirs(self.log_dir, exist_ok=True)
        atexit.register(self.stop)
        try:
            for i in range(self.count):
                self.start_one(i)
            self.wait(range(self.count))
        except BaseException:
            self.stop()
            raise
        return list(self.urls)

    def start_one(self, i: int) -> str:
        """Start server ``i`` (again, when it has stopped: what is left of the old one is killed
        first) on a new free port; returns its URL."""
        if i < len(self.processes):
            _signal_group(self.processes[i], signal.SIGKILL)
        port = free_port()
        env = {**os.environ, **server_environment(self.kv_cache_gb, self.cpus[i] if self.cpus else None)}
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpus[i])
        # the server imports this package: from where this process has it, installed or not
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        args = [
            sys.executable,
            "-m",
            "policygrad.rollout.serve",
            *server_arguments(self.model, port=port, **self.settings),
        ]
        log_path = os.path.join(self.log_dir, f"server-{i}.log")
        log_start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        cpus = self.cpus[i] if self.cpus else None
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its engine-core child stops with it (the group is signalled)
                preexec_fn=functools.partial(_child_setup, cpus, os.getpid()),
            )
        url = f"http://127.0.0.1:{port}"
        if i < len(self.processes):
            self.processes[i], self.urls[i], self.logs[i] = process, url, log_path
            self.log_starts[i] = log_start
        else:
            self.processes.append(process)
            self.urls.append(url)
            self.logs.append(log_path)
            self.log_starts.append(log_start)
        return url

    def wait(self, indices) -> None:
        """Until servers ``indices`` answer ``/health`` (raises ServerStartError)."""
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(indices)
        port_retries = dict.fromkeys(pending, 0)
        while pending:
            for i in list(pending):
                code = self.processes[i].poll()
                if code is not None and port_retries[i] < PORT_RETRIES and self._lost_its_port(i):
                    # free_port() released the port before the server bound it, and another
                    # process took it meanwhile: start again on a new one, with a fresh deadline
                    port_retries[i] += 1
                    self.start_one(i)
                    deadline = time.monotonic() + self.start_timeout_s
                    continue
                if code is not None:
                    raise ServerStartError(
                        f"rollout server {i} exited with code {code} before it answered; see {self.logs[i]}"
                    )
                if healthy(self.urls[i]):
                    pending.remove(i)
            if pending and time.monotonic() > deadline:
                raise ServerStartError(
                    f"rollout server {pending[0]} did not answer /health within "
                    f"{self.start_timeout_s:.0f} s; "
                    f"see {self.logs[pending[0]]}"
                )
            if pending:
                time.sleep(0.5)

    def _lost_its_port(self, i: int) -> bool:
        """Server ``i``'s current start failed to bind its port (its log since that start says so)."""
        try:
            with open(self.logs[i], "rb") as log:
                log.seek(self.log_starts[i])
                return b"Address already in use" in log.read()
        except OSError:
            return False

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every server: SIGTERM to its process group (also when its leader has exited:
        vLLM's engine core may outlive it), SIGKILL after ``timeout_s``. Idempotent."""
        for process in self.processes:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(process, signal.SIGKILL)  # the leader's children, whatever it did
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # unkillable (in the kernel): nothing more to do


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    """``sig`` to ``process``'s process group (each server leads its own session)."""
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> None:
    """Run a vLLM API server in this process with the gloo weight-transfer engine registered.
    ``argv``: vLLM's server options (e.g. from :func:`server_arguments`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # the engine core inherits the registration
    register()
    # imported here: vLLM is optional, and this module is imported by runs that only start servers
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_main

    sys.argv = ["policygrad serve", *argv]
    vllm_main()


if __name__ == "__main__":
    main()
