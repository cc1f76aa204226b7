"""What :class:`Run` decides around the steps: which signal stops the ranks, an evaluation
without rows, and, with the tiny model, the save cadence of a whole run. (What its checkpoints
decide: tests/run/test_saves.py; end-to-end behaviour of runs: tests/trainer/test_loop.py and
tests/trainer/test_runs_are_sacred.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from policygrad.config.train import load_config
from policygrad.parallel.distributed import Dist
from policygrad.run import Run
from policygrad.run.checkpoint import checkpoint_problem, load_trainer_state
from policygrad.run.directory import RunLock
from policygrad.run.run import progress_label

pytestmark = pytest.mark.integration  # the last test trains the tiny model; the others need none


def _fake_run(step=2):
    """A Run without its parts: a trainer at ``step``."""
    run = Run.__new__(Run)
    run.run_dir = "/r"
    run.trainer = SimpleNamespace(step_idx=step)
    return run


# ----------------------------------------------------------------------------- signals and evaluation


def test_the_signal_that_stops_the_ranks():
    run = _fake_run()
    run.dist = Dist()
    assert run._agreed_signal("SIGINT") == "SIGINT" and run._agreed_signal(None) is None
    anyone = SimpleNamespace(active=True, any=lambda _flag: True)
    run.dist = anyone  # another rank received one: this rank stops too (SIGTERM when it got none)
    assert run._agreed_signal(None) == "SIGTERM" and run._agreed_signal("SIGINT") == "SIGINT"
    run.dist = SimpleNamespace(active=True, any=lambda flag: flag)
    assert run._agreed_signal(None) is None


def test_no_held_out_rows_evaluate_to_nan():
    run = _fake_run()
    run.eval_rows, run.dist = [], Dist()
    scores, records = run.evaluate()
    assert list(scores) == ["eval/accuracy"] and scores["eval/accuracy"] != scores["eval/accuracy"]
    assert records == []


# ----------------------------------------------------------------------------- a whole tiny run


def count_digits(_prompts, completions, **_fields):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _tiny_config(model_dir, run_dir, *, eval_size, **top):
    """The tiny model's two-prompt run with the given top-level options, in ``run_dir``."""
    return load_config(
        None,
        {
            "save_every_minutes": 0,
            "output_dir": str(run_dir),
            "progress": False,
            "tensorboard": False,
            "eval_after": False,
            "log_completions": 0,
            "model": {"name": model_dir},
            "data": {"eval_size": eval_size, "difficulty": "easy"},
            "rollout": {"engine": "hf", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
            "reward": {"functions": ["tests.run.test_run:count_digits"], "isolation": False},
            "optim": {"lr": 1e-3, "micro_batch_size": 4},
            **top,
        },
    )


@pytest.mark.usefixtures("one_thread")
def test_checkpoints_follow_save_every_and_the_final_step(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    cfg = _tiny_config(tiny_model_dir, run_dir, steps=3, save_every=2, eval_before=False, eval_size=0)
    run = Run(cfg)
    summary = run.train()
    assert summary["steps"] == 3
    names = sorted(os.listdir(run_dir / "checkpoints"))
    assert names == ["step_2", "step_3"]  # every 2 steps, and the final one; not step 1
    for name in names:
        assert checkpoint_problem(str(run_dir / "checkpoints" / name)) is None
    state = load_trainer_state(str(run_dir / "checkpoints" / "step_3"))
    assert state["step"] == 3 and state["updates"]["steps"] == 3
    assert json.load(open(run_dir / "summary.json"))["steps"] == 3
    run.close()  # after train(): safe, and the folder is free
    RunLock.acquire(str(run_dir)).release()


def test_the_progress_bar_names_the_time_limit_its_eta_does_not_count():
    assert progress_label(None) == "train"
    assert progress_label(24) == "train (stops after 24 min)"  # the default job's max_minutes
    assert progress_label(0.5) == "train (stops after 0.5 min)"


WRITER = """
import sys
from tqdm import tqdm
from policygrad.run.run import write_above
bar = tqdm(total=3, file=sys.stderr, desc="train")
bar.update(1)
write_above(bar, "  [step 1] reward=1.00 'x'")
bar.update(2)
bar.close()
"""


def test_a_line_written_above_the_bar_lands_whole_and_in_order_when_both_streams_share_a_file():
    """stdout piped to a file is block-buffered and the bar writes to stderr unbuffered: the
    line must reach the file before the bar is redrawn, on a line of its own."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # as a user's shell
    out = subprocess.run(
        [sys.executable, "-c", WRITER], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, check=True
    ).stdout.decode()
    pieces = [p.strip() for p in re.split(r"[\r\n]", out) if p.strip()]
    line = pieces.index("[step 1] reward=1.00 'x'")  # whole: neither bar text nor spaces inside
    # the bar at 1/3 is drawn after the line (tqdm redraws it on leaving external_write_mode)
    assert [i for i, p in enumerate(pieces) if "3/3" in p or "1/3" in p][0] == line + 1


@pytest.mark.usefixtures("one_thread")
def test_max_minutes_counts_the_steps_not_the_evaluation_before_them(tiny_model_dir, tmp_path, monkeypatch):
    """A fake clock: the evaluation before training takes an hour and each step a minute.
    With max_minutes 2.5 the budget is checked before steps at 0, 1, 2 and 3 minutes of
    training: steps 1-3 run, the 4th is refused (3 > 2.5). Counting the hour of evaluation, no
    step would run."""
    import policygrad.run.run as run_module

    offset = [0.0]
    real = run_module.time.perf_counter
    monkeypatch.setattr(run_module.time, "perf_counter", lambda: real() + offset[0])
    cfg = _tiny_config(
        tiny_model_dir,
        tmp_path / "run",
        steps=5,
        max_minutes=2.5,
        save_every=0,
        eval_before=True,
        eval_size=2,
    )
    run = Run(cfg)

    def evaluate_before(summary):
        offset[0] += 3600.0
        summary["accuracy_before"] = 0.0

    step = run.trainer.step

    def one_minute_step():
        offset[0] += 60.0
        return step()

    monkeypatch.setattr(run, "_evaluate_before", evaluate_before)
    monkeypatch.setattr(run.trainer, "step", one_minute_step)
    summary = run.train()
    run.close()
    assert summary["steps"] == 3 and summary["stopped_by_max_minutes"] is True
    # 3 fake minutes plus the real seconds of 3 tiny steps (under a second here; steps == 3 above
    # only needs the first two to take under 30 s, the budget's 0.5 minute of slack)
    assert 3.0 < summary["train_minutes"] < 5.0
    assert summary["wall_minutes"] > 60.0 + summary["train_minutes"] - 1e-9  # the hour is in it
