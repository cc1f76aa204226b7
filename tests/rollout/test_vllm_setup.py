"""Tests of what an in-process vLLM engine needs around the library (no engine is started here):
the CPU bind list and the environment it starts in, and the names and shapes of a weight push
checked before anything is copied."""

from __future__ import annotations

import pytest
import torch

from policygrad.rollout import vllm_setup

pytestmark = pytest.mark.integration


def test_the_bind_list_takes_the_first_cpu_threads_allowed_cpus(monkeypatch, tmp_path):
    # Read only by a worker in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1); in-process the
    # engine's kernels run with torch's thread count of the thread that calls generate.
    monkeypatch.setattr(vllm_setup.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 5})
    monkeypatch.setattr(vllm_setup, "ENV_SET_HERE", {})
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CACHE_ROOT",
                "TORCHINDUCTOR_CACHE_DIR", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    vllm_setup.set_env_defaults(str(tmp_path))
    assert vllm_setup.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-2,5"
    vllm_setup.set_env_defaults(str(tmp_path), cpu_threads=2)  # set by an earlier engine: replaced
    assert vllm_setup.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "3")  # the user's own: left alone
    vllm_setup.set_env_defaults(str(tmp_path), cpu_threads=1)
    assert vllm_setup.os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "3"


def test_a_weight_push_is_checked_against_the_checkpoint_before_anything_is_copied():
    expected = {"a.weight": (2, 3), "b.bias": (3,)}
    w = [("a.weight", torch.zeros(2, 3)), ("b.bias", torch.zeros(3))]
    vllm_setup.check_weight_names(w, expected, "/m")  # every name, every shape: accepted
    vllm_setup.check_weight_names([("anything", torch.zeros(1))], None, "/m")  # no safetensors: vLLM checks
    with pytest.raises(ValueError, match=r"'c\.weight' is not a parameter of the engine's model \(/m\)"):
        vllm_setup.check_weight_names([*w, ("c.weight", torch.zeros(1))], expected, "/m")
    with pytest.raises(ValueError, match=r"'b\.bias' has shape \(4,\), the engine's model has \(3,\)"):
        vllm_setup.check_weight_names([w[0], ("b.bias", torch.zeros(4))], expected, "/m")
    lacks = r"the model lacks 1 of the engine's weights \(e\.g\. \['b\.bias'\]\)"
    with pytest.raises(ValueError, match=lacks):
        vllm_setup.check_weight_names(w[:1], expected, "/m")


def test_request_seeds_and_the_cpu_list_by_hand():
    # {0, 1, 2, 5} -> runs 0-2 and 5; a lone CPU is itself.
    assert vllm_setup.cpu_list({5, 0, 2, 1}) == "0-2,5" and vllm_setup.cpu_list([3]) == "3"
    seeds = {vllm_setup.request_seed(7, i) for i in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**62 for s in seeds)
    assert vllm_setup.request_seed(7, 3) == vllm_setup.request_seed(7, 3) != vllm_setup.request_seed(8, 3)
