"""Starting a run once it is built: the prompt-length check, and taking the run folder (lock,
``config.yaml``, metrics log). (The read-only checks of ``--resume``: tests/run/test_resume.py.)"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from policygrad.config.train import ConfigError
from policygrad.errors import TrainingError
from policygrad.run.directory import LOCK_FILE, RunLock
from policygrad.run.resume import check_resume
from policygrad.run.start import check_prompts, take_run_dir
from tests.run.folders import run_config, run_folder
from tests.tiny import make_tiny_tokenizer

pytestmark = pytest.mark.unit

# ----------------------------------------------------------------------------- check_prompts


def _prompts(prompts, *, context, max_new_tokens, max_prompt_length=None):
    """``check_prompts``'s arguments but the held-out rows: the first batch is ``prompts``."""
    data = {"max_prompt_length": max_prompt_length} if max_prompt_length else {}
    cfg = run_config(
        "/tmp/unused", rollout={"prompts_per_step": len(prompts), "max_new_tokens": max_new_tokens}, data=data
    )
    policy = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context))
    return cfg, make_tiny_tokenizer(), policy, [{"prompt": p} for p in prompts]


def test_prompts_that_fit_the_context_pass_and_the_longest_is_refused():
    # ChatML around a 2-character prompt: "<|im_start|>user\n" (1 + 5) + 2 + "<|im_end|>\n" (2)
    # + "<|im_start|>assistant\n" (1 + 10) = 21 tokens of the character tokenizer.
    short = _prompts(["hi", "ho"], context=21 + 4, max_new_tokens=4)
    check_prompts(*short, [])
    long = _prompts(["hi", "hello"], context=21 + 4, max_new_tokens=4)  # 24 + 4 > 25
    with pytest.raises(
        ConfigError,
        match=r"a training prompt of 24 tokens plus rollout.max_new_tokens=4 exceeds the model's context "
        r"of 25",
    ):
        check_prompts(*long, [])
    with pytest.raises(ConfigError, match="a held-out prompt of 24 tokens"):
        check_prompts(*short, [{"prompt": "hello"}])


# ----------------------------------------------------------------------------- take_run_dir


def test_a_new_run_takes_its_folder_and_writes_its_config(tmp_path):
    run = tmp_path / "new"
    cfg = run_config(run)
    taken = take_run_dir(cfg, model_path="org/model", step=0, resume=None, is_main=True)
    try:
        assert taken.lock is not None and not taken.config_pending
        assert {"config.yaml", LOCK_FILE} <= set(os.listdir(run))
        assert (run / "config.yaml").read_text().count("org/model") == 1
    finally:
        taken.logger.close()
        taken.lock.release()


def test_other_ranks_write_nothing(tmp_path):
    taken = take_run_dir(run_config(tmp_path / "r"), model_path="m", step=0, resume=None, is_main=False)
    assert taken.lock is None and not (tmp_path / "r").exists()


def test_a_resume_refuses_a_newer_checkpoint_written_meanwhile(tmp_path):
    run = run_folder(tmp_path / "run", 1)
    resume = check_resume(run_config(run), run)
    run_folder(run, 2)  # another run saved step 2 after the checks
    with pytest.raises(
        TrainingError, match="another run wrote a newer checkpoint while this one was starting"
    ):
        take_run_dir(run_config(run), model_path="m", step=1, resume=resume, is_main=True)
    RunLock.acquire(run).release()  # the lock was released: the folder can be taken again


def test_a_resume_with_changes_records_them_with_the_next_checkpoint(tmp_path):
    run = run_folder(tmp_path / "run", 1)
    before = open(os.path.join(run, "config.yaml")).read()
    os.makedirs(os.path.join(run, "checkpoints", ".step_2.tmp-5"))  # an interrupted save
    resume = check_resume(run_config(run, optim={"lr": 5e-6}), run)
    taken = take_run_dir(
        run_config(run, optim={"lr": 5e-6}), model_path="m", step=1, resume=resume, is_main=True
    )
    try:
        assert taken.config_pending
        assert open(os.path.join(run, "config.yaml")).read() == before  # unchanged until the next checkpoint
        assert os.listdir(os.path.join(run, "checkpoints")) == ["step_1"]  # the interrupted save is gone
    finally:
        taken.logger.close()
        taken.lock.release()
