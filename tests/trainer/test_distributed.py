"""Data parallelism on CPU with gloo: a 2-process run equals a 1-process run of the same global
batch (grpo with a KL loss, reinforce_pp's batch whitening, rloo with running reward
normalisation, ppo with a critic, whitened advantages and two shuffled minibatches; micro-batches
of 2 everywhere), and a reward error on rank 1 ends every rank through torchrun.

The two ranks run every case in one pair of spawned processes (imports cost more than the runs on
a 2-core machine); the 1-process runs happen in the test process."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml

from policygrad.trainer import Trainer
from policygrad.trainer.config import ConfigError, load_config
from policygrad.trainer.distributed import Dist
from tests.trainer.conftest import tiny_overrides, write_jsonl

pytestmark = pytest.mark.integration

STEPS = 2
CASES = {
    "grpo": {"kl": {"placement": "loss", "beta": 0.05}},
    "reinforce_pp": {"algorithm": "reinforce_pp", "kl": {"placement": "reward", "beta": 0.05}},
    "rloo_normalized": {"algorithm": "rloo", "reward": {"normalize": "running"}},
    "ppo": {
        "algorithm": "ppo",
        "critic": {"lr": 1e-2, "micro_batch_size": 2},
        "kl": {"placement": "reward", "beta": 0.1},
        "optim": {"ppo_epochs": 2, "num_minibatches": 2},
    },
}
# Metrics compared between the runs: all but wall-clock, throughput and memory readings.
VOLATILE = ("time/", "perf/", "memory/")


def case_config(name: str, model_dir: str, rewards_py: str, out_dir: str, **extra):
    sections = {k: dict(v) if isinstance(v, dict) else v for k, v in CASES[name].items()}
    optim = {"lr": 1e-3, "micro_batch_size": 2, **sections.pop("optim", {})}
    tree = tiny_overrides(model_dir, f"{rewards_py}:digit_fraction", out_dir, optim=optim, **sections)
    tree["steps"] = STEPS
    tree["rollout"]["per_prompt_seeds"] = True  # as every multi-process run samples
    for key, value in extra.items():
        tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, tree)


def run_case(cfg) -> dict:
    trainer = Trainer(cfg)
    metrics = [
        {k: v for k, v in trainer.step().items() if not k.startswith(VOLATILE)} for _ in range(STEPS)
    ]
    weights = {k: v.detach().clone() for k, v in trainer.policy.state_dict().items()}
    return {"metrics": metrics, "weights": weights}


def _worker(rank: int, world: int, port: int, model_dir: str, rewards_py: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for name in CASES:
            start = time.perf_counter()
            results[name] = run_case(case_config(name, model_dir, rewards_py, os.path.join(out, name)))
            results[name]["seconds"] = time.perf_counter() - start
        if rank == 0:
            torch.save(results, os.path.join(out, "results.pt"))
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_runs(eos_model_dir, rewards_py, tmp_path_factory):
    """Every case run by 2 gloo processes (rank 0's metrics and weights), and the wall time."""
    out = str(tmp_path_factory.mktemp("two_ranks"))
    start = time.perf_counter()
    torch.multiprocessing.spawn(
        _worker, args=(2, free_port(), eos_model_dir, rewards_py, out), nprocs=2, join=True
    )
    results = torch.load(os.path.join(out, "results.pt"), weights_only=False)
    results["wall_s"] = time.perf_counter() - start
    return results


def close(a, b, rel: float = 1e-5, floor: float = 1e-7) -> bool:
    """``a`` and ``b`` agree to ``rel`` relative (``floor`` absolute for values near 0, e.g. a
    policy loss that is 0 up to rounding at ratio 1); NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return abs(a - b) <= rel * max(abs(a), abs(b)) + floor


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_rank(name, two_rank_runs, eos_model_dir, rewards_py, tmp_path):
    one = run_case(case_config(name, eos_model_dir, rewards_py, tmp_path / "one"))
    two = two_rank_runs[name]
    for step, (m1, m2) in enumerate(zip(one["metrics"], two["metrics"])):
        assert m1.keys() == m2.keys()
        for key in ("reward/mean", "policy/loss", "optim/grad_norm", "policy/clipfrac"):
            assert key in m1, key
        if name != "rloo_normalized":
            assert "kl/ref" in m1
        if name == "ppo":
            assert "critic/vf_loss" in m1 and m1["optim/steps"] == 4  # 2 epochs x 2 minibatches
        # mismatch/* measure float noise between the sampler's and the trainer's forwards (~1e-6),
        # whose padding differs with the batch split: compared to 1e-5 absolute instead.
        differ = {
            k: (m1[k], m2[k])
            for k in m1
            if not close(float(m1[k]), float(m2[k]), floor=1e-5 if k.startswith("mismatch/") else 1e-7)
        }
        assert not differ, f"step {step}: {differ}"
    for key, w1 in one["weights"].items():
        w2 = two["weights"][key]
        assert (w2 - w1).norm() <= 1e-5 * w1.norm(), key
    assert not all(torch.equal(one["weights"][k], w) for k, w in run_case_initial(eos_model_dir).items())


def run_case_initial(model_dir: str) -> dict:
    from policygrad.models.loading import load_causal_lm

    return load_causal_lm(model_dir).state_dict()


def test_two_rank_wall_time_is_reported(two_rank_runs):
    """Not an assertion on speed: the run's wall time, for the README (printed with -s)."""
    seconds = {name: round(two_rank_runs[name]["seconds"], 1) for name in CASES}
    print(f"2-process CPU run: {two_rank_runs['wall_s']:.1f} s wall (spawn included); per case {seconds}")
    assert two_rank_runs["wall_s"] > 0


def test_world_size_must_divide_the_prompts(make_config):
    dist = Dist(rank=0, world_size=4)
    with pytest.raises(ConfigError, match="rollout.prompts_per_step=2 must be divisible by the world size 4"):
        dist.check(make_config())


def test_a_reward_error_on_rank_1_ends_every_rank_once(eos_model_dir, rewards_py, tmp_path):
    """Rank 1 holds the second prompt, whose row makes the reward function raise: rank 1 prints
    the error and exits 1, torchrun stops rank 0 (waiting in a collective), all within 60 s."""
    data = write_jsonl(
        tmp_path / "rows.jsonl",
        [
            {"prompt": "What is 2+3?", "answer": "5", "bad": False},
            {"prompt": "What is 7-4?", "answer": "3", "bad": True},
        ],
    )
    tree = tiny_overrides(eos_model_dir, f"{rewards_py}:flaky", tmp_path / "run")
    tree["data"] = {**tree["data"], "dataset": data, "shuffle": False}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tree))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
        "-m", "policygrad", "train", str(config),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    elapsed = time.perf_counter() - start
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert elapsed < 60, elapsed
    assert output.count("cannot score this row") == 1, output[-3000:]
