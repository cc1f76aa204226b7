"""Start-up quiet (policygrad.quiet): each named filter does what it says, a user's own setting
wins, --verbose (and a process a verbose run starts) applies none; the command's output of a run
with the vLLM engine holds policygrad's lines and none of the filtered ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from policygrad.quiet import FILTERS
from tests.training import tiny_overrides

CLEAN = {
    k: v
    for k, v in os.environ.items()
    if k
    not in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "HF_HUB_DISABLE_PROGRESS_BARS", "POLICYGRAD_QUIET")
}

PROBE = """
import json, logging, os, sys, warnings
from policygrad.quiet import apply, is_quiet
applied = apply(verbose=sys.argv[1] == "verbose")

def shown(category, module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        apply(verbose=sys.argv[1] == "verbose")  # as the command's filters, inside the recorder
        warnings.warn_explicit("x", category, "f.py", 1, module=module)
    return len(caught)

print(json.dumps({
    "applied": applied,
    "quiet": is_quiet(),
    "env": {k: os.environ.get(k) for k in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL",
                                             "HF_HUB_DISABLE_PROGRESS_BARS", "POLICYGRAD_QUIET")},
    "vllm_logger": logging.getLogger("vllm.triton_utils.importing").getEffectiveLevel(),
    "vllm_future": shown(FutureWarning, "vllm.triton_utils.dispatcher"),
    "torch_deprecation": shown(DeprecationWarning, "torch.jit._script"),
    "user_future": shown(FutureWarning, "my_reward"),
    "user_warning": shown(UserWarning, "vllm.engine"),
}))
"""


def probe(mode: str, **env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        env={**CLEAN, "PYTHONPATH": os.pathsep.join(sys.path), **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


@pytest.mark.unit
def test_every_filter_applies_by_name_and_a_users_setting_wins():
    got = probe("quiet")
    assert got["applied"] == list(FILTERS) and got["quiet"] is True
    assert got["env"] == {  # vllm-warnings, torch-cpp-warnings, progress-bars
        "VLLM_LOGGING_LEVEL": "ERROR",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "POLICYGRAD_QUIET": "1",
    }
    assert got["vllm_logger"] == 40  # logging.ERROR: the warning vLLM logs at import
    # library-deprecations: the libraries' deprecations, not a user's, and no other category
    assert (got["vllm_future"], got["torch_deprecation"]) == (0, 0)
    assert (got["user_future"], got["user_warning"]) == (1, 1)
    mine = probe("quiet", VLLM_LOGGING_LEVEL="DEBUG")
    assert mine["env"]["VLLM_LOGGING_LEVEL"] == "DEBUG" and mine["vllm_logger"] != 40


@pytest.mark.unit
def test_verbose_applies_nothing_and_its_child_processes_stay_verbose():
    for got in (probe("verbose"), probe("quiet", POLICYGRAD_QUIET="0")):
        assert got["applied"] == [] and got["quiet"] is False
        assert got["env"] == {
            "VLLM_LOGGING_LEVEL": None,
            "TORCH_CPP_LOG_LEVEL": None,
            "HF_HUB_DISABLE_PROGRESS_BARS": None,
            "POLICYGRAD_QUIET": "0",
        }
        assert (got["vllm_future"], got["torch_deprecation"]) == (1, 1)


FILTERED = (
    "WARNING",
    "Warning:",
    "FutureWarning",
    "DeprecationWarning",
    "Loading weights",
    "Writing model shards",
    "Loading safetensors checkpoint shards",
    "Triton",
)


@pytest.mark.integration
def test_a_run_with_the_vllm_engine_shows_policygrads_lines_and_not_the_libraries(server_model_dir, tmp_path):
    outputs = {}
    for mode in ("quiet", "verbose"):
        tree = tiny_overrides(server_model_dir, "answer_correctness", tmp_path / mode, steps=1)
        tree["rollout"] = {**tree["rollout"], "engine": "vllm"}
        tree["progress"] = True
        config = tmp_path / f"{mode}.yaml"
        config.write_text(yaml.safe_dump(tree))
        command = [sys.executable, "-m", "policygrad", "train", str(config)]
        done = subprocess.run(
            command + (["--verbose"] if mode == "verbose" else []),
            env={**CLEAN, "PYTHONPATH": os.pathsep.join(sys.path)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        outputs[mode] = done.stdout + done.stderr
    quiet = outputs["quiet"]
    assert "rollout engine: vllm" in quiet and "applied 1 updates in 1 steps" in quiet
    assert [line for line in quiet.splitlines() if any(f in line for f in FILTERED)] == []
    # --verbose shows what the filters hide: vLLM's start-up warnings are there.
    assert any("WARNING" in line and "vllm" in line.lower() for line in outputs["verbose"].splitlines())
