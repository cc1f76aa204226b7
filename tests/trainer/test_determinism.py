"""A run is a function of its config and seed: the same small ``policygrad train`` job (sampling,
a KL loss against the reference, two shuffled minibatches per update, 3 steps) run twice as a
command, into two run folders, writes the same ``metrics.jsonl`` (every value equal, NaN equal to
NaN) and the same final weights, bit for bit. Any unseeded draw (sampling, data order, minibatch
permutations) or order-dependent reduction that varies between processes fails it.

Not compared (wall-clock and machine readings, which differ between two identical runs):
``time/`` (seconds), ``perf/`` (throughput, derived from seconds), ``memory/`` (resident and peak
bytes, which depend on the allocator's history), and ``async/queue`` / ``async/overlap`` (how far
the sampler got ahead: timing; present only with ``rollout.max_staleness`` > 0, not here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from tests.training import checkpoint_weights, tiny_overrides

pytestmark = pytest.mark.integration

VOLATILE = ("time/", "perf/", "memory/", "async/queue", "async/overlap")
STEPS = 3


def _rows(run_dir) -> list[dict]:
    """Every logged row, volatile keys left out; NaN as the string "nan" so NaN == NaN."""
    rows = []
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            rows.append(
                {
                    k: "nan" if isinstance(v, float) and math.isnan(v) else v
                    for k, v in row.items()
                    if not k.startswith(VOLATILE)
                }
            )
    return rows


def test_the_same_cli_job_twice_gives_the_same_metrics_and_weights(eos_model_dir, rewards_py, tmp_path):
    procs = {}
    for name in ("first", "second"):
        tree = tiny_overrides(
            eos_model_dir,
            f"{rewards_py}:length_fraction",  # varies between a group's samples: the update moves
            tmp_path / name,
            steps=STEPS,
            num_threads=1,  # one intra-op thread in each: the comparison is of seeds, not of the CPU
            kl={"placement": "loss", "beta": 0.05},
            optim={"num_minibatches": 2},  # shuffled minibatches: the update's seed is used too
        )
        config = tmp_path / f"{name}.yaml"
        config.write_text(yaml.safe_dump(tree))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "policygrad", "train", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
    for proc in procs.values():  # both at once: one thread each on a 2-core machine
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (out + err)[-3000:]
    first, second = _rows(tmp_path / "first"), _rows(tmp_path / "second")
    assert [r["step"] for r in first] == list(range(1, STEPS + 1))
    # the job samples, measures a KL against the reference and updates on every step
    assert all(r["kl/ref"] != 0 and r["kl/loss_term"] > 0 and r["optim/steps"] == 2 for r in first[1:])
    assert all(r["reward/std"] > 0 for r in first)
    assert len(first) == len(second)
    for r1, r2 in zip(first, second):
        differ = {k: (r1.get(k), r2.get(k)) for k in r1.keys() | r2.keys() if r1.get(k) != r2.get(k)}
        assert not differ, f"step {r1['step']}: {differ}"
    a, b = checkpoint_weights(tmp_path / "first", STEPS), checkpoint_weights(tmp_path / "second", STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
