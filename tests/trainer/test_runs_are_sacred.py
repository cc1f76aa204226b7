"""Runs are sacred: interrupts, kills and a full disk lose at most the step in progress, a run
directory has one owner, an invalid command changes nothing on disk, a crafted checkpoint is
refused, reward code cannot stop or disturb the trainer, and a run that trains nothing fails.

The signal tests run ``python -m policygrad train`` in a subprocess, as a user would."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import namedtuple

import pytest
import torch
import yaml
from safetensors.torch import load_file

from policygrad.cli import main
from policygrad.run import Run
from policygrad.run.checkpoint import COMPLETE_FILE, checkpoint_problem
from policygrad.trainer.loop import Trainer
from tests.training import checkpoint_weights, tiny_overrides, write_jsonl

pytestmark = pytest.mark.integration

SLOW_REWARD = '''
import time


def slow_digits(prompts, completions, **fields):
    """digit_fraction, a quarter of a second late: a step lasts long enough to be interrupted."""
    time.sleep(0.25)
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def slow_lengths(prompts, completions, **fields):
    """Characters of the completion over 40, a quarter of a second late: a step lasts long enough
    to be interrupted, and the score varies with the sampled length, so a tiny random model's
    first groups train even when none of their samples holds a digit (slow_digits then scores
    every sample 0 and a 1- or 2-step run applies no update)."""
    time.sleep(0.25)
    return [len(c) / 40 for c in completions]


def sleeps_forever(prompts, completions, **fields):
    time.sleep(10_000)


def misbehaves(prompts, completions, mode=None, tests=None, **fields):
    """Per row mode: exit (sys.exit(0)), os_exit (os._exit(0)), chdir (os.chdir('/')), mutate
    (pops every row's test cases and empties the completions). Scores: the number of test cases
    the row arrived with."""
    import os
    import sys

    if mode[0] == "exit":
        sys.exit(0)
    if mode[0] == "os_exit":
        os._exit(0)
    if mode[0] == "chdir":
        os.chdir("/")
    scores = [float(len(t)) for t in tests]
    if mode[0] == "mutate":
        for t in tests:
            t.pop()
        completions.clear()
    return scores


def flaky(prompts, completions, bad=None, **fields):
    if any(bad or []):
        raise RuntimeError("cannot score this row")
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def nothing_scores(prompts, completions, **fields):
    return [None] * len(completions)
'''


@pytest.fixture
def rewards_file(tmp_path) -> str:
    path = tmp_path / "sacred_rewards.py"
    path.write_text(SLOW_REWARD)
    return str(path)


@pytest.fixture
def run_yaml(eos_model_dir, rewards_file, tmp_path):
    """``run_yaml(name, reward_fn="slow_lengths", **sections)`` -> (config path, run dir)."""

    def factory(name: str, *, reward_fn: str = "slow_lengths", **sections):
        tree = tiny_overrides(eos_model_dir, f"{rewards_file}:{reward_fn}", tmp_path / name, **sections)
        tree.setdefault("num_threads", 1)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tree))
        return str(path), str(tmp_path / name)

    return factory


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _complete_steps(run_dir) -> list[int]:
    root = os.path.join(run_dir, "checkpoints")
    names = [n for n in os.listdir(root) if n.startswith("step_")] if os.path.isdir(root) else []
    return sorted(int(n[5:]) for n in names if checkpoint_problem(os.path.join(root, n)) is None)


def _hidden_checkpoint_folders(run_dir) -> list[str]:
    return [n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith(".")]


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def _cli(*args, driver: str | None = None, **kwargs) -> subprocess.Popen:
    """``python -m policygrad ARGS`` (or ``python DRIVER ARGS``) in a subprocess, 1 thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, driver] if driver else [sys.executable, "-m", "policygrad"]
    return subprocess.Popen(
        [*command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kwargs
    )


def _wait_for(predicate, proc: subprocess.Popen, what: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (status {proc.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def _logged_steps(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    return len(_rows(run_dir)) if os.path.exists(path) else 0


def _snapshot(folder) -> dict[str, str]:
    """Every file under ``folder`` with the hash of its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


# ----------------------------------------------------------------------------- interrupts


def test_sigint_mid_run_then_resume_equals_an_uninterrupted_run(run_yaml, capsys):
    cfg, run = run_yaml("interrupted", steps=6)
    proc = _cli("train", cfg)
    try:
        _wait_for(lambda: _logged_steps(run) >= 2, proc, "two steps were logged")
        # Meanwhile a second run in the same directory is refused, naming the owner.
        assert main(["train", cfg]) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert f"is in use by another run (pid {proc.pid} on " in line and "started 20" in line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "SIGINT received: finishing the current step, then saving a checkpoint" in out
    assert f"continue with: policygrad train --resume {run}" in out
    logged = [r["step"] for r in _rows(run)]
    assert logged == list(range(1, len(logged) + 1)) and len(logged) < 6
    # The checkpoint is the last step the run finished: at most the step in progress is lost.
    assert _complete_steps(run) == [logged[-1]]
    assert json.loads(open(os.path.join(run, "summary.json")).read())["interrupted"] == "SIGINT"
    assert not os.path.exists(os.path.join(run, ".policygrad.lock"))

    assert main(["train", "--resume", run]) == 0
    straight_cfg, straight = run_yaml("straight", steps=6)
    assert main(["train", straight_cfg]) == 0
    capsys.readouterr()
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4, 5, 6]
    a, b = checkpoint_weights(straight, 6), checkpoint_weights(run, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


KILL_DRIVER = '''
import os
import sys
import time

import torch

real_save = torch.save


def save_then_hang(obj, f, *args, **kwargs):
    """The trainer state of step {step} is written, then the save hangs before its rename and
    completion marker: the test kills the process there."""
    real_save(obj, f, *args, **kwargs)
    if isinstance(obj, dict) and obj.get("step") == {step}:
        open({mark!r}, "w").close()
        time.sleep(600)


if __name__ == "__main__":
    torch.save = save_then_hang
    from policygrad.cli import main

    sys.exit(main(sys.argv[1:]))
'''


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_complete_one(run_yaml, tmp_path, capsys):
    cfg, run = run_yaml("killed", steps=3, save_every=1)
    mark = tmp_path / "saving_step_2"
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER.format(step=2, mark=str(mark)))
    proc = _cli("train", cfg, driver=str(driver))
    try:
        _wait_for(mark.exists, proc, "the checkpoint of step 2 was being written")
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _complete_steps(run) == [1]
    assert any(".step_2.tmp-" in n for n in _hidden_checkpoint_folders(run))  # the half-written one
    assert os.path.exists(os.path.join(run, ".policygrad.lock"))  # its owner died holding it

    assert main(["train", "--resume", run]) == 0
    out = capsys.readouterr().out
    assert f"newest complete checkpoint: {run}/checkpoints/step_1" in out
    assert f"took over the lock of {run}: a run (pid {proc.pid} on " in out
    assert _complete_steps(run) == [1, 3] or _complete_steps(run) == [1, 2, 3]
    assert _hidden_checkpoint_folders(run) == []
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]


FULL_DISK_REWARD = '''
import os

CALLS = []


def fills_the_disk(prompts, completions, **fields):
    """On its second call (step 2), fill the run's disk up to 64 KiB: the step's metrics row
    still fits, its checkpoint does not."""
    CALLS.append(1)
    if len(CALLS) == 2:
        st = os.statvfs({mount!r})
        with open(os.path.join({mount!r}, "filler"), "wb") as f:
            f.write(b"\\0" * max(st.f_bavail * st.f_frsize - 64 * 1024, 0))
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
'''

ENOSPC_DRIVER = """
import errno
import sys

import torch

real_save = torch.save


def save(obj, f, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("step") == 2:  # the disk fills up during step 2's save
        with open(f, "wb") as out:
            out.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(f))
    return real_save(obj, f, *args, **kwargs)


if __name__ == "__main__":
    torch.save = save
    from policygrad.cli import main

    sys.exit(main(sys.argv[1:]))
"""


def _can_mount_tmpfs(tmp_path) -> bool:
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {probe}"], capture_output=True
    )
    return done.returncode == 0


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint_and_ends_in_one_line(
    eos_model_dir, tmp_path
):
    mount = tmp_path / "disk"
    mount.mkdir()
    rewards = tmp_path / "full_disk.py"
    rewards.write_text(FULL_DISK_REWARD.format(mount=str(mount)))
    tree = tiny_overrides(eos_model_dir, f"{rewards}:fills_the_disk", mount / "run", steps=3, save_every=1)
    tree["num_threads"] = 1
    cfg = tmp_path / "full_disk.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    result = tmp_path / "result"
    result.mkdir()
    if _can_mount_tmpfs(tmp_path):  # a real full disk: an 8 MiB tmpfs in a private mount namespace
        script = (
            f"mount -t tmpfs -o size=8m tmpfs {mount} || exit 99\n"
            f"OMP_NUM_THREADS=1 {sys.executable} -m policygrad train {cfg} > {result}/out 2> {result}/err\n"
            f"echo $? > {result}/rc\n"
            f"cp -a {mount}/run {result}/run\n"
        )
        subprocess.run(["unshare", "-rm", "sh", "-c", script], check=True, timeout=300)
    else:  # simulated: the state file's write fails with ENOSPC
        driver = tmp_path / "enospc.py"
        driver.write_text(ENOSPC_DRIVER)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        with open(result / "out", "w") as out, open(result / "err", "w") as err:
            rc = subprocess.run(
                [sys.executable, str(driver), "train", str(cfg)], stdout=out, stderr=err, env=env
            )
        (result / "rc").write_text(str(rc.returncode))
        shutil.copytree(mount / "run", result / "run", symlinks=True)
    err = (result / "err").read_text()
    assert (result / "rc").read_text().strip() == "2", err
    line = _one_error_line(err)
    assert f"could not write checkpoint {mount}/run/checkpoints/step_2: No space left on device" in line
    assert "the checkpoints written before are intact" in line
    run = result / "run"
    assert _complete_steps(run) == [1]  # step 1 intact, nothing of step 2
    assert os.listdir(run / "checkpoints") == ["step_1"]
    assert [r["step"] for r in _rows(run)] == [1, 2]


# ----------------------------------------------------------------------------- the run directory


@pytest.mark.parametrize(
    "bad",
    [
        ["--optim.lr=-1"],  # refused when the config is built
        ["--data.max_prompt_length=8"],  # a prompt of the first batch is too long
        ["--reward.functions=[missing.py:f]"],  # a reward file that does not exist
        ["--data.dataset=/no/such/data.jsonl"],  # data that cannot be read
        ["--rollout.max_new_tokens=100000"],  # prompt + new tokens beyond the model's context
    ],
    ids=["lr", "prompt-length", "reward-file", "dataset", "context"],
)
def test_overwrite_with_an_invalid_config_leaves_the_old_run_byte_identical(bad, run_yaml, tmp_path, capsys):
    cfg, run = run_yaml("old", steps=1)
    assert main(["train", cfg]) == 0
    (tmp_path / "old" / "notes.txt").write_text("mine")
    before = _snapshot(run)
    assert main(["train", cfg, "--overwrite=true", *bad]) == 2
    _one_error_line(capsys.readouterr().err)
    assert _snapshot(run) == before
    # A new output folder stays absent, so the corrected command needs no --overwrite.
    assert main(["train", cfg, f"--output_dir={tmp_path / 'new'}", *bad]) == 2
    assert not os.path.exists(tmp_path / "new")


def test_overwrite_deletes_only_what_a_run_wrote_and_is_never_saved(run_yaml, tmp_path, capsys):
    cfg, run = run_yaml("old", steps=2, save_every=1)
    assert main(["train", cfg]) == 0
    (tmp_path / "old" / "notes.txt").write_text("mine")
    (tmp_path / "old" / "checkpoints" / "README").write_text("mine too")
    assert main(["train", cfg, "--steps=1", "--overwrite=true"]) == 0
    assert (tmp_path / "old" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path / "old" / "checkpoints")) == ["README", "step_1"]
    saved = yaml.safe_load(open(os.path.join(run, "config.yaml")))
    assert "overwrite" not in saved
    # Re-running the run's own config.yaml is a new run into a folder that holds one: refused.
    assert main(["train", os.path.join(run, "config.yaml")]) == 2
    assert "already holds a run" in _one_error_line(capsys.readouterr().err)
    assert (tmp_path / "old" / "notes.txt").exists()


def test_a_crafted_trainer_state_is_refused_on_resume(run_yaml, tmp_path, capsys):
    cfg, run = run_yaml("crafted", steps=1)
    assert main(["train", cfg]) == 0
    payload = tmp_path / "code_ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {payload}",))

    ckpt = os.path.join(run, "checkpoints", "step_1")
    torch.save({"step": 1, "x": Exploit()}, os.path.join(ckpt, "trainer_state.pt"))
    marker = json.load(open(os.path.join(ckpt, COMPLETE_FILE)))  # forge the marker too
    marker["files"]["trainer_state.pt"] = os.path.getsize(os.path.join(ckpt, "trainer_state.pt"))
    json.dump(marker, open(os.path.join(ckpt, COMPLETE_FILE), "w"))
    assert main(["train", "--resume", run, "--steps=2"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"checkpoint {ckpt}/trainer_state.pt cannot be loaded safely" in line
    assert not payload.exists()


# ----------------------------------------------------------------------------- reward code


def test_a_reward_that_sleeps_forever_is_stopped_by_its_timeout(run_yaml, capsys):
    cfg, _ = run_yaml("hangs", reward_fn="sleeps_forever", steps=1, reward={"timeout_s": 1.0})
    start = time.monotonic()
    assert main(["train", cfg]) == 2
    assert time.monotonic() - start < 120
    line = _one_error_line(capsys.readouterr().err)
    assert "sleeps_forever' did not return within reward.timeout_s=1 s on a batch of 8 rows" in line


def test_rewards_that_exit_chdir_or_mutate_their_inputs_leave_the_run_alive(
    make_config, rewards_file, tmp_path
):
    modes = ["exit", "os_exit", "chdir", "mutate", "mutate"]
    data = write_jsonl(
        tmp_path / "modes.jsonl",
        [
            {"prompt": f"Row {i}: what is 1+1?", "answer": "2", "mode": m, "tests": [1, 2, 3]}
            for i, m in enumerate(modes)
        ],
    )
    cfg = make_config(
        "misbehaving",
        steps=5,
        data={"dataset": data, "shuffle": False},
        rollout={"prompts_per_step": 1, "group_size": 4},
        reward={"functions": [f"{rewards_file}:misbehaves"], "on_error": "skip"},
        loss={"entropy_coef": 0.01},  # every score is 3.0: the bonus gives the updates a gradient
    )
    cwd = os.getcwd()
    run = Run(cfg)
    summary = run.train()  # alive: sys.exit and os._exit ended calls, not the run
    assert os.getcwd() == cwd
    assert summary["steps"] == 5 and summary["updates_applied"] == 3
    rows = _rows(cfg.output_dir)
    assert [r["reward/invalid_frac"] for r in rows] == [1.0, 1.0, 0.0, 0.0, 0.0]
    name = f"reward_fn/{rewards_file}:misbehaves/mean"
    assert [r[name] for r in rows[2:]] == [3.0, 3.0, 3.0]  # every row saw its 3 test cases
    assert [row["tests"] for row in run.trainer.stream.source.rows] == [[1, 2, 3]] * 5  # the dataset
    run.close()


# ----------------------------------------------------------------------------- runs that train nothing


def test_all_skipped_updates_end_the_run_non_zero(run_yaml, capsys):
    cfg, run = run_yaml(
        "nothing", reward_fn="nothing_scores", steps=6, max_skipped_updates=2, reward={"on_error": "skip"}
    )
    assert main(["train", cfg]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "2 steps in a row applied no update: the reward functions failed on every row" in line
    assert "(max_skipped_updates=2)" in line
    assert [r["step"] for r in _rows(run)] == [1, 2]

    cfg, run = run_yaml("short", reward_fn="nothing_scores", steps=1, reward={"on_error": "skip"})
    assert main(["train", cfg]) == 2  # however short: no update applied is an error
    line = _one_error_line(capsys.readouterr().err)
    assert "the run applied no update in 1 steps" in line
    assert json.load(open(os.path.join(run, "summary.json")))["updates_applied"] == 0


def test_a_run_whose_advantages_are_all_zero_says_it_trained_nothing(make_config):
    """GRPO on a constant reward: each group's samples score the same, every advantage is 0, the
    gradient is exactly 0 and the weights do not move; the run must say so, not "applied 2
    updates". An entropy bonus on the same reward is another loss term: that run trains."""
    from policygrad.errors import TrainingError

    run = Run(make_config("constant", reward_fn="zero", steps=2))
    before = {k: p.detach().clone() for k, p in run.trainer.policy.named_parameters()}
    try:
        with pytest.raises(TrainingError) as info:
            run.train()
        assert all(torch.equal(p, before[k]) for k, p in run.trainer.policy.named_parameters())
    finally:
        run.close()
    message = str(info.value)
    assert message.startswith(
        "the run applied no update in 2 steps: every advantage was 0 at every step: the rewards gave each "
        "group's samples the same score (reward/mean 0)"
    )
    assert "make reward.functions=" in message and "\n" not in message
    rows = _rows(run.run_dir)
    assert [(r["optim/steps"], r["optim/grad_norm"], r["reward/zero_variance_group_frac"]) for r in rows] == [
        (1, 0.0, 1.0),
        (1, 0.0, 1.0),
    ]
    assert json.load(open(os.path.join(run.run_dir, "summary.json")))["updates_applied"] == 0

    bonus_cfg = make_config("constant_with_bonus", reward_fn="zero", steps=2, loss={"entropy_coef": 0.01})
    bonus = Run(bonus_cfg)
    try:
        assert bonus.train()["updates_applied"] == 2
    finally:
        bonus.close()


def test_a_policy_that_no_longer_responds_is_named_diverged_not_flat_rewards(
    eos_model_dir, make_config, tmp_path
):
    """A model whose embeddings are all 0 keeps every hidden state 0 (no biases), so its logits are 0
    (a uniform policy, as optim.lr=1e6 leaves the bundled model) and every gradient is exactly 0,
    while length_fraction scores a group's samples differently (advantages not 0). The run must be
    named diverged with optim.lr, not sent to check reward.functions (what it said before)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from policygrad.errors import TrainingError

    model = tmp_path / "uniform"
    shutil.copytree(eos_model_dir, model)
    weights = load_file(model / "model.safetensors")
    weights = {k: torch.zeros_like(v) if "embed_tokens" in k else v for k, v in weights.items()}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    cfg = make_config("uniform", reward_fn="length_fraction", steps=2, model={"name": str(model)})
    run = Run(cfg)
    try:
        with pytest.raises(TrainingError) as info:
            run.train()
    finally:
        run.close()
    message = str(info.value)
    assert message.startswith("the run applied no update in 2 steps: the run diverged: ")
    assert "lower optim.lr (lr=0.01)" in message and "reward.functions" not in message
    rows = _rows(run.run_dir)
    assert [r["optim/grad_norm"] for r in rows] == [0.0, 0.0]
    assert all(r["reward/zero_variance_group_frac"] < 1 for r in rows)
    # Logits 0 over the 100 ids: the entropy of the uniform distribution, ln 100 (float32 rounding).
    assert all(abs(r["policy/entropy"] - math.log(100)) < 1e-5 for r in rows)


# ----------------------------------------------------------------------------- errors keep the finished steps


def test_an_error_after_the_first_step_keeps_the_finished_steps(run_yaml, bad_row_dataset, capsys):
    # The second row (step 2) makes the reward raise: step 1's work is saved before the run ends.
    cfg, run = run_yaml(
        "fails_later",
        reward_fn="flaky",
        steps=3,
        data={"dataset": bad_row_dataset, "shuffle": False},
        rollout={"prompts_per_step": 1},
    )
    assert main(["train", cfg]) == 2
    captured = capsys.readouterr()
    assert "raised RuntimeError: cannot score this row" in _one_error_line(captured.err)
    assert f"saved checkpoint {run}/checkpoints/step_1 before stopping on the error" in captured.out
    assert _complete_steps(run) == [1]
    state = torch.load(os.path.join(run, "checkpoints", "step_1", "trainer_state.pt"), weights_only=True)
    assert (state["step"], state["data_position"]) == (1, 1)  # the failed step's row is not skipped


def test_ctrl_c_during_the_final_evaluation_loses_nothing(make_config, monkeypatch):
    cfg = make_config("final_eval", steps=2, eval_after=True, data={"eval_size": 2})
    evaluate = Run.evaluate

    def interrupted(self, *args, tag="eval", **kwargs):
        if tag == "eval_after":
            raise KeyboardInterrupt
        return evaluate(self, *args, tag=tag, **kwargs)

    monkeypatch.setattr(Run, "evaluate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg).train()
    assert _complete_steps(cfg.output_dir) == [2]


# ----------------------------------------------------------------------------- resume options


def test_resume_applies_a_new_lr_and_refuses_other_changes(run_yaml, tmp_path, capsys):
    cfg, run = run_yaml("lr", steps=1)
    assert main(["train", cfg]) == 0
    assert main(["train", "--resume", run, "--steps=2", "--optim.lr=0.5"]) == 0
    rows = _rows(run)
    assert {"step": 1, "config/optim.lr": 0.5} in rows
    assert rows[-1]["step"] == 2 and rows[-1]["optim/lr"] == 0.5
    assert yaml.safe_load(open(os.path.join(run, "config.yaml")))["optim"]["lr"] == 0.5
    capsys.readouterr()
    assert main(["train", "--resume", run, "--steps=3", "--seed=5", "--algorithm=rloo"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cannot change on resume" in line and "algorithm: 'grpo' -> 'rloo'; seed: 0 -> 5" in line
    assert main(["train", "--resume", run, "--steps=3", f"--output_dir={tmp_path / 'fork'}"]) == 2
    assert "a resumed run continues in its own folder" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "fork").exists()
    assert [r["step"] for r in _rows(run) if "config/optim.lr" not in r] == [1, 2]


def test_a_failed_resume_leaves_config_yaml_as_it_was(run_yaml, capsys, monkeypatch):
    """config.yaml records the options of the newest checkpoint: a resume that fails before a
    checkpoint of its changed options (a corrupt trackers.json, an error in its first step)
    leaves it byte for byte, and the next successful resume records them."""
    cfg, run = run_yaml("failed_resume", steps=1)
    assert main(["train", cfg]) == 0
    config_yaml = os.path.join(run, "config.yaml")
    before = open(config_yaml).read()
    ids = os.path.join(run, "trackers.json")
    with open(ids, "w") as f:
        f.write("{not json")
    capsys.readouterr()
    assert main(["train", "--resume", run, "--steps=2", "--optim.lr=0.5"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"{ids} cannot be read (JSONDecodeError" in line and "delete it to start new tracker runs" in line
    assert open(config_yaml).read() == before
    os.remove(ids)

    def fails(_self):
        raise ValueError("the first resumed step fails")

    with monkeypatch.context() as m:
        m.setattr(Trainer, "step", fails)
        assert main(["train", "--resume", run, "--steps=2", "--optim.lr=0.5"]) == 2
    assert "the first resumed step fails" in _one_error_line(capsys.readouterr().err)
    assert open(config_yaml).read() == before and _complete_steps(run) == [1]
    assert main(["train", "--resume", run, "--steps=2", "--optim.lr=0.5"]) == 0
    assert yaml.safe_load(open(config_yaml))["optim"]["lr"] == 0.5 and _complete_steps(run) == [1, 2]


# ----------------------------------------------------------------------------- models that cannot be trained


def _model_copy(eos_model_dir, tmp_path, name) -> str:
    folder = tmp_path / name
    shutil.copytree(eos_model_dir, folder)
    return str(folder)


def test_a_model_folder_with_its_own_code_is_refused_without_running_it(
    eos_model_dir, run_yaml, tmp_path, capsys
):
    folder = _model_copy(eos_model_dir, tmp_path, "custom_code")
    config = json.load(open(os.path.join(folder, "config.json")))
    config.update(model_type="my_custom", auto_map={"AutoConfig": "my_config.MyConfig"})
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    ran = tmp_path / "custom_code_ran"
    (tmp_path / "custom_code" / "my_config.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    cfg, run = run_yaml("custom", steps=1, model={"name": folder})
    assert main(["train", cfg]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "ships its own Python code" in line and "model.trust_remote_code=true" in line
    assert not ran.exists() and not os.path.exists(run)


def test_a_model_with_nan_weights_is_refused_before_anything_is_written(
    eos_model_dir, run_yaml, tmp_path, capsys
):
    from safetensors.torch import save_file

    folder = _model_copy(eos_model_dir, tmp_path, "nan_model")
    weights = load_file(os.path.join(folder, "model.safetensors"))
    name = sorted(k for k in weights if k.endswith("mlp.up_proj.weight"))[0]
    weights[name][0, 0] = float("nan")
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    cfg, run = run_yaml("nan", steps=1, model={"name": folder})
    assert main(["train", cfg]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"has non-finite weights: {name} holds 1 NaN or infinite values" in line
    assert not os.path.exists(run)
    assert main(["train", cfg, "--rollout.temperature=1e-45"]) == 2
    assert "rollout.temperature=1e-45 is below 0.001" in _one_error_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- failed starts


def test_a_start_that_fails_in_step_1_leaves_the_folder_to_the_corrected_command(
    run_yaml, tmp_path, rewards_file, capsys
):
    data = write_jsonl(tmp_path / "first_bad.jsonl", [{"prompt": "What is 7-4?", "answer": "3", "bad": True}])
    cfg, run = run_yaml(
        "fails_first", reward_fn="flaky", steps=1, data={"dataset": data}, rollout={"prompts_per_step": 1}
    )
    assert main(["train", cfg]) == 2
    assert "raised RuntimeError: cannot score this row" in _one_error_line(capsys.readouterr().err)
    assert os.path.exists(os.path.join(run, "config.yaml")) and _complete_steps(run) == []
    (tmp_path / "fails_first" / "notes.txt").write_text("mine")
    # --resume has nothing to continue, and says what does work.
    assert main(["train", "--resume", run]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "saved no checkpoint" in line and f"policygrad train {run}/config.yaml" in line
    fixed = f"--reward.functions=[{rewards_file}:slow_digits]"
    assert main(["train", cfg, fixed]) == 0
    out = capsys.readouterr().out
    assert f"{run} holds what a start that saved no checkpoint left (config.yaml): replaced" in out
    assert _complete_steps(run) == [1] and (tmp_path / "fails_first" / "notes.txt").read_text() == "mine"
    assert yaml.safe_load(open(os.path.join(run, "config.yaml")))["reward"]["functions"] == [
        f"{rewards_file}:slow_digits"
    ]
    # Once a checkpoint exists the folder holds a run: the same command is refused.
    assert main(["train", cfg, fixed]) == 2
    assert "already holds a run" in _one_error_line(capsys.readouterr().err)


def test_steps_0_saves_nothing_and_leaves_the_folder_to_the_next_start(run_yaml):
    cfg, run = run_yaml("zero", steps=1)
    assert main(["train", cfg, "--steps=0"]) == 0
    assert _complete_steps(run) == []
    assert main(["train", cfg]) == 0
    assert _complete_steps(run) == [1]


def test_a_full_disk_at_the_first_checkpoint_names_the_file_and_advises_what_works(
    run_yaml, monkeypatch, capsys
):
    import errno

    from policygrad.run import checkpoint

    cfg, run = run_yaml("full_first", steps=1)
    real_save = torch.save

    def full(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(checkpoint.torch, "save", full)
        assert main(["train", cfg]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"could not write checkpoint {run}/checkpoints/step_1: No space left on device" in line
    assert "--resume" not in line and "run the same command again" in line
    assert main(["train", cfg]) == 0
    assert _complete_steps(run) == [1]


def test_a_full_disk_writing_metrics_names_the_file(tmp_path):
    import errno
    import types

    from policygrad.run import logging as metrics_logging

    def full(_fd, _data):
        raise OSError(errno.ENOSPC, "No space left on device")

    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    fake_os.write = full
    logger = metrics_logging.MetricsLogger(str(tmp_path), tensorboard=False)
    original = metrics_logging.os
    metrics_logging.os = fake_os
    try:
        with pytest.raises(OSError) as info:
            logger.log(1, {"x": 1.0})
    finally:
        metrics_logging.os = original
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "metrics.jsonl")


SLOW_DRIVER = '''
import sys
import time

import policygrad.run.run as run_module
import policygrad.run.start as start


def slow(*args, **kwargs):
    open({mark!r}, "w").close()
    time.sleep(600)


if __name__ == "__main__":
    for module in (run_module, start):
        if hasattr(module, {attr!r}):
            setattr(module, {attr!r}, slow)
    from policygrad.cli import main

    sys.exit(main(sys.argv[1:]))
'''
"""``python driver.py train ...`` with ``{attr}`` of :mod:`policygrad.run` replaced by a call that
marks ``{mark}`` and sleeps: a signal can be sent while the run is inside that call."""


def _signal_inside(cfg, attr: str, sig: str, tmp_path) -> tuple[int, str, str]:
    """``policygrad train cfg`` with ``<attr>`` of :mod:`policygrad.run` slowed by :data:`SLOW_DRIVER`, sent
    ``sig`` once the run is inside it. Returns (exit status, stdout, stderr)."""
    mark = tmp_path / f"inside_{attr}_{sig}"
    driver = tmp_path / f"slow_{attr}.py"
    driver.write_text(SLOW_DRIVER.format(attr=attr, mark=str(mark)))
    proc = _cli("train", cfg, driver=str(driver))
    try:
        _wait_for(mark.exists, proc, f"the run entered {attr}")
        proc.send_signal(getattr(signal, sig))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_initial_evaluation_stops_cleanly_and_the_same_command_works(
    sig, run_yaml, tmp_path
):
    from policygrad.run.interrupts import EXIT_STATUS

    cfg, run = run_yaml(f"eval_{sig}", steps=1, eval_before=True, data={"eval_size": 2})
    returncode, out, err = _signal_inside(cfg, "evaluate", sig, tmp_path)
    assert returncode == EXIT_STATUS[sig], out + err
    stops = [line for line in (out + err).splitlines() if f"stopped by {sig}" in line]
    assert len(stops) == 1 and "Traceback" not in err, out + err
    assert "nothing was trained or saved" in stops[0] and "--resume" not in stops[0]
    assert not os.path.exists(os.path.join(run, ".policygrad.lock"))
    assert main(["train", cfg]) == 0
    assert _complete_steps(run) == [1]


def test_sigterm_during_tracker_set_up_stops_cleanly_and_leaves_the_folder_as_it_was(run_yaml, tmp_path):
    cfg, run = run_yaml("trackers_sigterm", steps=1)
    returncode, out, err = _signal_inside(cfg, "build_trackers", "SIGTERM", tmp_path)
    assert returncode == 143, out + err
    stops = [line for line in (out + err).splitlines() if "stopped by SIGTERM" in line]
    assert stops == [
        "stopped by SIGTERM while the run was starting, before its first step; run the same "
        "command again to start it"
    ], out + err
    assert "Traceback" not in err and not os.path.exists(run)  # the folder it created is gone again


def test_sigterm_during_the_final_evaluation_stops_at_once_with_the_final_checkpoint(run_yaml, tmp_path):
    cfg, run = run_yaml("final_sigterm", steps=1, eval_after=True, data={"eval_size": 2})
    returncode, out, err = _signal_inside(cfg, "evaluate", "SIGTERM", tmp_path)
    assert returncode == 143, out + err
    stops = [line for line in (out + err).splitlines() if "stopped by SIGTERM" in line]
    assert len(stops) == 1 and "Traceback" not in err, out + err
    assert f"after the final checkpoint {run}/checkpoints/step_1 (step 1)" in stops[0]
    assert _complete_steps(run) == [1] and not os.path.exists(os.path.join(run, ".policygrad.lock"))
    summary = json.load(open(os.path.join(run, "summary.json")))
    assert summary["interrupted"] == "SIGTERM" and summary["updates_applied"] == 1


def test_a_full_disk_before_any_checkpoint_advises_a_new_start_not_resume(run_yaml, monkeypatch, capsys):
    import errno

    from policygrad.run.logging import MetricsLogger

    cfg, run = run_yaml("full_before", steps=1, eval_before=True, data={"eval_size": 2})
    log = MetricsLogger.log

    def full(self, step, metrics):
        if step == 0:  # the evaluation before training: no checkpoint exists yet
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return log(self, step, metrics)

    with monkeypatch.context() as m:
        m.setattr(MetricsLogger, "log", full)
        assert main(["train", cfg]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"no space left on device writing {run}/metrics.jsonl; free space, then run the same" in line
    assert "--resume" not in line
    assert main(["train", cfg]) == 0
    assert _complete_steps(run) == [1]


def test_a_disk_that_fills_before_the_first_checkpoint_says_which_steps_are_lost(
    run_yaml, monkeypatch, capsys
):
    # Steps 1 and 2 trained, no checkpoint yet (the default cadence is 10 minutes), then the disk is
    # full: metrics.jsonl's row of step 2 and the checkpoint the run tries after the error both fail.
    # Before: the line said to free space and start again, not that two trained steps were gone.
    import errno

    from policygrad.run import checkpoint
    from policygrad.run.logging import MetricsLogger

    cfg, run = run_yaml("full_mid", steps=3)
    log = MetricsLogger.log

    def full_log(self, step, metrics):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        return log(self, step, metrics)

    def full_save(_obj, f, *_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    with monkeypatch.context() as m:
        m.setattr(MetricsLogger, "log", full_log)
        m.setattr(checkpoint.torch, "save", full_save)
        assert main(["train", cfg]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line == (
        f"error: no space left on device writing {run}/metrics.jsonl; the training of steps 1-2 could not be "
        "saved on the full disk and is lost; free space, then run the same command again: no checkpoint was "
        f"saved, so the run starts over in {run}"
    )
    assert [r["step"] for r in _rows(run)] == [1] and _complete_steps(run) == []
    assert _hidden_checkpoint_folders(run) == []  # no half-written checkpoint left behind
    assert not os.path.exists(os.path.join(run, ".policygrad.lock"))
    assert main(["train", cfg]) == 0  # the same command starts over, as the line says
    assert _complete_steps(run) == [3]


def test_keep_checkpoints_keeps_the_newest_and_a_resume_goes_on_from_it(run_yaml, capsys):
    cfg, run = run_yaml("kept", steps=3, save_every=1, keep_checkpoints=2)
    assert main(["train", cfg]) == 0
    assert _complete_steps(run) == [2, 3]
    assert main(["train", "--resume", run, "--steps=4"]) == 0
    assert _complete_steps(run) == [3, 4]
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
    capsys.readouterr()


def test_a_disk_that_cannot_hold_one_checkpoint_is_refused_before_the_first_step(
    run_yaml, monkeypatch, capsys
):
    """The steps trained before the first checkpoint would all be lost on its save: the run is
    refused once the models are built, before any step, and leaves no folder."""
    cfg, run = run_yaml("no_room", steps=1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage(10**9, 10**9 - 1000, 1000))
    assert main(["train", cfg]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert " is on a disk with 1.0 kB free, and one checkpoint of this run takes about " in line
    assert "so nothing was trained" in line
    assert line.endswith("free space, or set output_dir on a disk with room")
    assert not os.path.exists(run)


def test_a_run_that_ends_having_skipped_non_finite_steps_says_it_diverged(make_config, caplog):
    """optim.lr=1e6: the first update applies, the later steps' loss is not finite and they are
    skipped, too few for max_skipped_updates (20) to end the run; it ended with its usual line only
    (exit 0, weights diverged). Now one warning line says so and names optim.lr."""
    cfg = make_config("lr", reward_fn="length_fraction", steps=3, optim={"lr": 1e6})
    run = Run(cfg)
    try:
        with caplog.at_level(logging.INFO, logger="policygrad"):
            summary = run.train()
    finally:
        run.close()
    skipped = sum(r["optim/skipped_nonfinite"] for r in _rows(run.run_dir))
    assert summary["updates_applied"] >= 1 and skipped >= 1
    lines = [r.getMessage() for r in caplog.records]
    warnings = [line for line in lines if line.startswith("warning: the run diverged")]
    assert len(warnings) == 1
    assert f"{skipped} optimizer steps were skipped" in warnings[0]
    assert "lower optim.lr (lr=1e+06)" in warnings[0]
