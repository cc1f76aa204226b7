"""Data parallelism on CPU with gloo: a 2-process run equals a 1-process run of the same global
batch (grpo with a KL loss, reinforce_pp's batch whitening, rloo with running reward
normalisation, ppo with a critic, whitened advantages and two shuffled minibatches; micro-batches
of 2 everywhere), with whole networks on every rank (ddp) and with FSDP2-sharded ones (fsdp);
runs resume across world sizes (2 -> 1 and 1 -> 2 ranks equal 4 straight steps); an FSDP rank
holds about half the parameter, gradient and optimizer bytes, as ``policygrad memory`` says; and
a reward error on rank 1 ends every rank through torchrun. Rollouts sampled ahead
(``rollout.max_staleness: 1``) are a case too, and VinePPO's value rollouts sampled ahead.

The two ranks run every case in one pair of spawned processes (imports cost more than the runs on
a 2-core machine); the 1-process runs happen in the test process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import yaml
from safetensors.torch import load_file

from policygrad.config.train import ConfigError, load_config
from policygrad.lab.memory_plan import plan_memory
from policygrad.parallel.distributed import Dist
from policygrad.parallel.footprint import model_shape_from_config
from policygrad.parallel.sharding import full_state_dict, local_bytes
from policygrad.parallel.strategy import make_strategy
from policygrad.run import Run
from tests.trainer.tolerances import VOLATILE, assert_same_metrics, recording_conditioning
from tests.training import checkpoint_weights, tiny_overrides, write_jsonl

pytestmark = pytest.mark.integration

STEPS = 2
STRATEGIES = ("ddp", "fsdp")
CASES = {
    "grpo": {"kl": {"placement": "loss", "beta": 0.05}},
    "reinforce_pp": {"algorithm": "reinforce_pp", "kl": {"placement": "reward", "beta": 0.05}},
    "rloo_normalized": {"algorithm": "rloo", "reward": {"normalize": "running"}},
    "ppo": {
        "algorithm": "ppo",
        "critic": {"lr": 1e-3, "micro_batch_size": 2},
        "kl": {"placement": "reward", "beta": 0.1},
        # lr 2e-4 (critic 1e-3), not 1e-3 (1e-2): there the tiny model's ratios reach 2 by step 2
        # and the clip's kinks turn float noise of the sharded sums into ~2e-5 differences.
        "optim": {"ppo_epochs": 2, "num_minibatches": 2, "lr": 2e-4},
    },
    # rollouts sampled ahead: one producer thread per rank, collectives only in the trainer's
    # thread; step 2 trains a batch of the initial weights (recomputed old log-probs, IS weights)
    "ahead": {"rollout": {"max_staleness": 1}, "kl": {"placement": "loss", "beta": 0.05}},
    # VinePPO's value rollouts: each rank samples its rows' continuations in its producer thread
    # (ahead), seeded by content, so 2 ranks sample what 1 process does (every vineppo/* metric
    # equal in both runs). In the same runs, Clip-Cov's token selection and the positive-example
    # LM loss's sample selection are made over every rank's batch, and the adaptive entropy
    # coefficient follows every rank's entropy.
    "vineppo_ahead": {
        "advantage": {
            "estimator": "vineppo",
            "options": {"rollouts": 2, "split": "fixed", "segment_tokens": 2, "max_splits": 2},
        },
        "rollout": {"max_staleness": 1},
        "kl": {"placement": "loss", "beta": 0.05},
        "loss": {
            "policy_loss": "clip_cov",
            "options": {"clip_cov_ratio": 0.25, "clip_cov_lb": -1e9},
            "positive_lm_coef": 0.5,
            "entropy_target": 4.6,  # never reached: the tiny model's most is ln 100 = 4.605
        },
        "optim": {"lr": 2e-4},  # as ppo's: at 1e-3 fsdp's float noise reached 1.3e-5 by step 2
    },
}


def case_config(name: str, model_dir: str, rewards_py: str, out_dir, strategy: str = "ddp", **extra):
    sections = {k: dict(v) if isinstance(v, dict) else v for k, v in CASES[name].items()}
    optim = {"lr": 1e-3, "micro_batch_size": 2, **sections.pop("optim", {})}
    tree = tiny_overrides(model_dir, f"{rewards_py}:length_fraction", out_dir, optim=optim, **sections)
    tree["steps"] = STEPS
    tree["num_threads"] = 1  # as each rank: matmuls split over threads sum in another order
    tree["distributed"] = {"strategy": strategy}
    tree["rollout"]["per_prompt_seeds"] = True  # as every multi-process run samples
    for key, value in extra.items():
        tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, tree)


def full_weights(trainer) -> dict[str, torch.Tensor]:
    """The policy's whole weights (fsdp: the engine's unsharded copy, synced after each update)."""
    model = trainer.trainer.whole_policy
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run_case(cfg) -> dict:
    """The run's metrics of every step (volatile keys left out), each step's batch conditioning
    (tests/trainer/tolerances.py), final whole weights and the bytes of training state held."""
    run = Run(cfg)
    try:
        with recording_conditioning() as conds:
            metrics = [
                {k: v for k, v in run.trainer.step().items() if not k.startswith(VOLATILE)}
                for _ in range(STEPS)
            ]
        held = local_bytes(run.trainer.policy, run.trainer.optimizer)
        return {"metrics": metrics, "conds": conds, "weights": full_weights(run), "bytes": sum(held.values())}
    finally:
        run.close()


RESUMED = "grpo"  # across world sizes: the KL loss and AdamW state (metrics to their bounds)


def resume_config(model_dir: str, rewards_py: str, out_dir, steps: int, strategy: str = "fsdp"):
    # lr 2e-4 as ppo's: at 1e-3 the gradient norm of the tiny model reaches 18 by step 4 and its
    # float noise, doubled each step, passes 1e-5.
    return case_config(RESUMED, model_dir, rewards_py, out_dir, strategy, steps=steps, optim={"lr": 2e-4})


def train(cfg, resume_from=None) -> list[dict]:
    """Trains ``cfg``; returns the conditioning of each step's batch (tests/trainer/tolerances.py)."""
    run = Run(cfg, resume_from=resume_from)
    try:
        with recording_conditioning() as conds:
            run.train()
        return conds
    finally:
        run.close()


def _worker(rank: int, world: int, port: int, model_dir: str, rewards_py: str, out: str, one_run: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for strategy in STRATEGIES:
            for name in CASES:
                start = time.perf_counter()
                cfg = case_config(name, model_dir, rewards_py, os.path.join(out, strategy, name), strategy)
                results[strategy, name] = run_case(cfg)
                results[strategy, name]["seconds"] = time.perf_counter() - start
                held = torch.tensor(float(results[strategy, name]["bytes"]))
                torch.distributed.all_reduce(held, op=torch.distributed.ReduceOp.MAX)
                results[strategy, name]["bytes"] = int(held)  # the rank that holds the most
        start = time.perf_counter()
        train(resume_config(model_dir, rewards_py, os.path.join(out, "two_then_one"), 2))  # 2 ranks, 2 steps
        train(resume_config(model_dir, rewards_py, one_run, 4), resume_from=one_run)  # 1 rank's run, on 2
        # ppo's sharded critic and its optimizer through a sharded checkpoint, on the same 2 ranks:
        # 2 + 2 steps equal 4 straight bitwise.
        for name, steps in (("ppo_straight", 4), ("ppo_resumed", 2)):
            train(case_config("ppo", model_dir, rewards_py, os.path.join(out, name), "fsdp", steps=steps))
        resumed = os.path.join(out, "ppo_resumed")
        train(case_config("ppo", model_dir, rewards_py, resumed, "fsdp", steps=4), resume_from=resumed)
        results["resume_seconds"] = time.perf_counter() - start
        # bf16 compute (CPU autocast) with FSDP2's mixed precision: what the checkpoint exports.
        bf16 = {"dtype": "bfloat16", "precision": "bf16-mixed"}
        cfg = case_config("grpo", model_dir, rewards_py, os.path.join(out, "bf16"), "fsdp", model=bf16)
        run = Run(cfg)
        try:
            run.train()
            # Gathered from the shards (a collective), not read from the engine's copy.
            results["bf16_master"] = {k: v.clone() for k, v in full_state_dict(run.trainer.policy).items()}
        finally:
            run.close()
        if rank == 0:
            torch.save(results, os.path.join(out, "results.pt"))
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(config) -> subprocess.CompletedProcess:
    """``policygrad train CONFIG`` in 2 torchrun processes of one thread each (5 minutes at most)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
    ]
    command += ["-m", "policygrad", "train", str(config)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def two_rank_runs(eos_model_dir, rewards_py, tmp_path_factory):
    """Every case run by 2 gloo processes with each strategy (rank 0's metrics and weights), the
    resumed runs' folders, and the wall time. Before the spawn, one process trains the first 2
    steps of the run the two ranks then resume (1 -> 2)."""
    out = str(tmp_path_factory.mktemp("two_ranks"))
    one_run = os.path.join(out, "one_then_two")
    train(resume_config(eos_model_dir, rewards_py, one_run, 2, "ddp"))
    start = time.perf_counter()
    torch.multiprocessing.spawn(
        _worker, args=(2, free_port(), eos_model_dir, rewards_py, out, one_run), nprocs=2, join=True
    )
    results = torch.load(os.path.join(out, "results.pt"), weights_only=False)
    results["wall_s"] = time.perf_counter() - start
    results["out"], results["one_run"] = out, one_run
    return results


@pytest.fixture(scope="module")
def one_rank_runs(eos_model_dir, rewards_py, tmp_path_factory):
    """Every case run by one process (shared by both strategies' comparisons)."""
    out = tmp_path_factory.mktemp("one_rank")
    return {name: run_case(case_config(name, eos_model_dir, rewards_py, out / name)) for name in CASES}


def assert_same_weights(w1: dict, w2: dict) -> None:
    assert w1.keys() == w2.keys()
    for key, a in w1.items():
        assert (w2[key] - a).norm() <= 1e-5 * a.norm(), key


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_equal_one_rank(name, strategy, two_rank_runs, one_rank_runs, eos_model_dir):
    one, two = one_rank_runs[name], two_rank_runs[strategy, name]
    for m1 in one["metrics"]:
        for key in ("reward/mean", "policy/loss", "optim/grad_norm", "policy/clipfrac"):
            assert key in m1, key
        if name != "rloo_normalized":
            assert "kl/ref" in m1
        if name == "vineppo_ahead":  # a quarter of the tokens detached; some samples positive
            assert m1["entropy/cov_selected_frac"] == pytest.approx(0.25, abs=0.05)
            assert m1["policy/positive_frac"] > 0 and "entropy/mean" in m1
        if name == "ppo":
            assert "critic/vf_loss" in m1 and m1["optim/steps"] == 4  # 2 epochs x 2 minibatches
    assert_same_metrics(one["metrics"], two["metrics"], one["conds"])
    assert_same_weights(one["weights"], two["weights"])
    assert not all(torch.equal(one["weights"][k], w) for k, w in run_case_initial(eos_model_dir).items())


def run_case_initial(model_dir: str) -> dict:
    from policygrad.models.loading import load_causal_lm

    return load_causal_lm(model_dir).state_dict()


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def test_runs_resume_across_world_sizes(two_rank_runs, eos_model_dir, rewards_py, tmp_path):
    """2 FSDP ranks for 2 steps, then 1 process for 2 more; and 1 process for 2 steps, then 2 FSDP
    ranks for 2 more: both equal 4 straight steps in one process (metrics of every step, and the
    weights of the step-4 checkpoint: metrics to tests/trainer/tolerances.py's bounds, weights to
    1e-5 in norm)."""
    straight = tmp_path / "straight"
    conds = train(resume_config(eos_model_dir, rewards_py, straight, 4, "ddp"))
    two_then_one = os.path.join(two_rank_runs["out"], "two_then_one")
    sharded = os.path.join(two_then_one, "checkpoints", "step_2", "sharded")
    assert os.path.isfile(os.path.join(sharded, ".metadata"))  # written by torch.distributed.checkpoint
    train(resume_config(eos_model_dir, rewards_py, two_then_one, 4, "ddp"), resume_from=two_then_one)
    for resumed in (two_then_one, two_rank_runs["one_run"]):
        rows = _rows(resumed)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert_same_metrics(_rows(straight), rows, conds)
        assert_same_weights(checkpoint_weights(straight, 4), checkpoint_weights(resumed, 4))


def test_sharded_ppo_resumes_bitwise(two_rank_runs):
    """A 2-rank FSDP ppo run saved at step 2 (sharded policy, critic and both AdamW states) and
    resumed on 2 ranks equals 4 straight steps on 2 ranks exactly."""
    straight = os.path.join(two_rank_runs["out"], "ppo_straight")
    resumed = os.path.join(two_rank_runs["out"], "ppo_resumed")
    assert os.path.isdir(os.path.join(resumed, "checkpoints", "step_2", "sharded"))
    rows = _rows(resumed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "critic/vf_loss" in rows[-1]
    assert rows == _rows(straight)
    a, b = checkpoint_weights(straight, 4), checkpoint_weights(resumed, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one, two = (
        load_file(os.path.join(d, "checkpoints", "step_4", "critic", "value_model.safetensors"))
        for d in (straight, resumed)
    )
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def test_an_fsdp_checkpoint_exports_the_float32_master_weights(two_rank_runs):
    """bf16 compute (model.dtype bfloat16, bf16-mixed): the checkpoint's model folder holds the
    float32 master weights, not their bf16 roundings (which would drop small updates)."""
    saved = checkpoint_weights(os.path.join(two_rank_runs["out"], "bf16"), STEPS)
    master = two_rank_runs["bf16_master"]
    assert all(t.dtype == torch.float32 for t in saved.values())
    assert all(torch.equal(t, master[k]) for k, t in saved.items())
    assert any(not torch.equal(t, t.bfloat16().float()) for t in saved.values())  # not bf16 values


def test_fsdp_rank_holds_half_the_training_state(two_rank_runs, one_rank_runs, eos_model_dir):
    """Parameters + gradients + AdamW moments counted from the local shards: the larger rank's
    share is <= 0.55 of one process's, and ``policygrad memory --world-size 2 --strategy fsdp``
    prices it within 5%."""
    one = one_rank_runs["grpo"]["bytes"]
    two = two_rank_runs["fsdp", "grpo"]["bytes"]
    assert two_rank_runs["ddp", "grpo"]["bytes"] == one  # whole networks on every ddp rank
    assert two <= 0.55 * one, (two, one)
    shape = model_shape_from_config(eos_model_dir)
    planned = plan_memory(shape, "grpo", world_size=2, strategy="fsdp").item("policy").bytes
    assert abs(planned - two) <= 0.05 * two, (planned, two)
    print(
        f"policy parameter + gradient + AdamW bytes: 1 rank {one}, largest FSDP rank of 2 {two} "
        f"({two / one:.3f}x), policygrad memory --world-size 2 --strategy fsdp {planned}"
    )
    assert plan_memory(shape, "grpo").item("policy").bytes == one  # 16 B per trainable parameter


def test_two_rank_wall_time_is_reported(two_rank_runs):
    """Not an assertion on speed: the run's wall time for the README (printed with -s), every
    case present, and the per-run timings inside the wall time."""
    seconds = {f"{s}/{n}": round(two_rank_runs[s, n]["seconds"], 1) for s in STRATEGIES for n in CASES}
    print(
        f"2-process CPU run: {two_rank_runs['wall_s']:.1f} s wall (spawn included); per case {seconds}; "
        f"resume runs {two_rank_runs['resume_seconds']:.1f} s"
    )
    assert {(s, n) for s in STRATEGIES for n in CASES} <= set(two_rank_runs)  # every case ran
    assert 0 < sum(seconds.values()) + two_rank_runs["resume_seconds"] < two_rank_runs["wall_s"]


def test_world_size_must_divide_the_prompts(make_config):
    dist = Dist(rank=0, world_size=4)
    with pytest.raises(ConfigError, match="rollout.prompts_per_step=2 must be divisible by the world size 4"):
        dist.check(make_config())


def test_fsdp_refuses_lora(make_config):
    dist = Dist(rank=0, world_size=2)
    cfg = make_config(model={"lora": {"rank": 4}}, distributed={"strategy": "fsdp"})
    with pytest.raises(ConfigError, match="distributed.strategy=fsdp shards full fine-tuning"):
        make_strategy(cfg, dist)


def test_a_reward_error_on_rank_1_ends_every_rank_once(eos_model_dir, rewards_py, tmp_path):
    """Rank 1 holds the second prompt, whose row makes the reward function raise: rank 1 prints
    the error and exits 1, torchrun stops rank 0 (waiting in a collective) well before the process
    group's timeout."""
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
    # A rank left waiting in a collective would wait for the process group's timeout (30 minutes):
    # the subprocess's 5 minutes tell the two apart on a loaded machine too (the run ends in about
    # 8 s on an idle 2-core machine; 65 s was seen with five other jobs running).
    done = torchrun_train(config)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert output.count("cannot score this row") == 1, output[-3000:]
    # rank 0, whose collective lost its peer, says so in one line instead of a traceback from gloo
    assert "another process of this run failed" in output, output[-3000:]
    assert "[rank0]: Traceback" not in output and "Connection closed by peer" not in output, output[-3000:]


def test_torchrun_with_two_processes_trains_what_one_process_does(eos_model_dir, rewards_py, tmp_path):
    """The conftest's tiny run with no sampling option (per-prompt seeds by default) trains the
    same samples in one process and in 2 torchrun processes: every step's metrics (but wall-clock,
    throughput and memory) and the final checkpoint's weights agree as in the cases above.
    length_fraction scores the samples (digit_fraction gives a tiny random model's groups equal
    rewards, and a run that applies no update fails)."""
    trees = {}
    for name in ("one", "two"):
        tree = tiny_overrides(eos_model_dir, f"{rewards_py}:length_fraction", tmp_path / name)
        tree["num_threads"] = 1  # as each rank: matmuls split over threads sum in another order
        # the conftest's fp32 auto does not reach the torchrun processes; on a CPU with bf16
        # instructions their auto would be bf16-mixed
        tree["model"]["precision"] = "fp32"
        trees[name] = tree
    assert "per_prompt_seeds" not in trees["two"]["rollout"]
    assert_two_ranks_train_as_one(trees, tmp_path)


def assert_two_ranks_train_as_one(trees: dict, tmp_path) -> None:
    """``trees["one"]`` trained in this process and ``trees["two"]`` under torchrun with 2 ranks
    (runs in ``tmp_path/one``, ``tmp_path/two``): 2 steps that each applied an update, every
    step's metrics the same (tolerances.assert_same_metrics) and the final weights equal."""
    conds = train(load_config(None, trees["one"]))
    config = tmp_path / "two.yaml"
    config.write_text(yaml.safe_dump(trees["two"]))
    done = torchrun_train(config)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["step"] for r in one] == [1, 2] and all(r["optim/steps"] >= 1 for r in one)
    assert_same_metrics(one, two, conds)
    steps = trees["one"]["steps"]
    assert_same_weights(
        checkpoint_weights(tmp_path / "one", steps), checkpoint_weights(tmp_path / "two", steps)
    )
