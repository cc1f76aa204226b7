"""``import policygrad.config`` in a fresh interpreter loads no torch, transformers or vLLM, and
only the config's own modules and the torch-free declarations of :mod:`policygrad.specs`.

Before the declarations moved out of the torch modules, the import pulled in 40 of the package's
modules (``policygrad.core``, ``policygrad.data``, ``policygrad.rollout.vllm``) and torch with them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "vllm", "numpy", "safetensors", "accelerate", "peft", "datasets")


def _fresh(code: str) -> dict:
    """Run ``code`` in a new interpreter importing this checkout; return the JSON it prints."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_importing_the_config_loads_no_torch_and_only_config_and_specs():
    got = _fresh("import json, sys\nimport policygrad.config\nprint(json.dumps(sorted(sys.modules)))\n")
    heavy = sorted(m for m in got if m.split(".")[0] in HEAVY)
    assert heavy == [], heavy
    ours = [m for m in got if m == "policygrad" or m.startswith("policygrad.")]
    others = [
        m
        for m in ours
        if m not in ("policygrad", "policygrad.config", "policygrad.specs")
        and not m.startswith(("policygrad.config.", "policygrad.specs."))
    ]
    assert others == [], others
    assert "policygrad.config.train" in ours and "policygrad.specs.estimators" in ours


def test_a_config_error_is_raised_as_before_without_loading_torch():
    # Errors of a section's fields and of a registered name need no torch: the same one-line
    # ConfigError as ever, and no torch loaded by them. (The estimator is checked after the
    # policy loss's option values, which run the loss: torch is loaded by then.)
    got = _fresh(
        "import json, sys\n"
        "from policygrad.config import ConfigError, load_config\n"
        "out = []\n"
        "for overrides in (['--rollout.top_p=1.5'], ['--kl.placement=both'], "
        "['--loss.policy_loss=trpo'], ['--advantage.estimator=ppo']):\n"
        "    try:\n"
        "        load_config(None, overrides)\n"
        "    except ConfigError as e:\n"
        "        out.append([type(e).__name__, isinstance(e, ValueError), str(e), 'torch' in sys.modules])\n"
        "print(json.dumps(out))\n"
    )
    assert [(name, value_error) for name, value_error, _, _ in got] == [("ConfigError", True)] * 4
    assert [torch_loaded for *_, torch_loaded in got] == [False, False, False, True]
    messages = [message for _, _, message, _ in got]
    assert messages[0] == "rollout.top_p must be in (0, 1], got 1.5"
    assert messages[1] == "kl.placement='both' is not valid; choose one of ['loss', 'none', 'reward']"
    assert messages[2] == (
        "loss.policy_loss='trpo' is not valid; choose one of "
        "['cispo', 'clip_cov', 'gspo', 'kl_cov', 'ppo', 'vanilla']"
    )
    assert messages[3] == (
        "advantage.estimator='ppo' is not valid; choose one of "
        "['gae', 'grpo', 'reinforce', 'reinforce_pp', 'remax', 'rloo', 'vineppo']"
    )


def test_a_bad_option_value_is_still_checked_by_the_torch_function():
    # The values of an estimator's or a loss's options are checked by running it once, which
    # loads torch then (and only then): the same message as before the move.
    got = _fresh(
        "import json, sys\n"
        "from policygrad.config import ConfigError, load_config\n"
        "before = 'torch' in sys.modules\n"
        "try:\n"
        "    load_config(None, ['--loss.clip_low=1.5'])\n"
        "except ConfigError as e:\n"
        "    message = str(e)\n"
        "print(json.dumps({'before': before, 'message': message}))\n"
    )
    assert got["before"] is False
    assert got["message"].startswith("loss.clip_low=1.5 is not valid for policy loss 'ppo': clip_low")
    assert got["message"].endswith(
        "(its options: clip_low (default 0.2), clip_high (default 0.2), dual_clip (default None))"
    )
