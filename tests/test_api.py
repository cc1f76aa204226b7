"""The Python API (``policygrad.train``): the docs' example (docs/python-api.md) runs as written on
a tiny model (its model name the only substitution); callables (sync, async, lambdas) score the
samples and are recorded in ``config.yaml`` by import path or placeholder; in-memory datasets
train."""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

import policygrad
from policygrad.rollout.vllm import vllm_available
from tests.tiny import make_tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

PAGE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "python-api.md")
ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3) for b in range(3)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    # head_dim 32: a size vLLM's CPU attention supports, so the example runs on whichever engine
    # rollout.engine=auto picks here.
    path = tmp_path_factory.mktemp("tiny_api")
    make_tiny_llama(path, seed=0, hidden_size=64, num_heads=2, num_kv_heads=1, initializer_range=0.5)
    return str(path)


def digit_reward(_prompts, completions, **_fields):
    """An importable reward: its import path goes into config.yaml."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def _small(tmp_path, name: str) -> dict:
    return {
        "steps": 1,
        "output_dir": str(tmp_path / name),
        "progress": False,
        "tensorboard": False,
        "log_completions": 0,
        "rollout": {"engine": "hf", "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6},
        "data": {"eval_size": 0},
    }


def test_the_docs_example_runs_as_written(tiny_dir, tmp_path, monkeypatch):
    text = open(PAGE, encoding="utf-8").read()
    pattern = r"<!-- api-example:start -->\n```python\n(.*?)```\n<!-- api-example:end -->"
    block = re.search(pattern, text, re.S)
    code = block.group(1)
    assert len([line for line in code.splitlines() if line.strip()]) <= 15
    assert code.count('"bundled:smollm2-135m-instruct"') == 1
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    code = code.replace('"bundled:smollm2-135m-instruct"', repr(tiny_dir))  # the one substitution
    exec(compile(code, "docs/python-api.md", "exec"), namespace)
    summary = namespace["summary"]
    assert summary["steps"] == 2
    assert summary["rollout_engine"] == ("vllm" if vllm_available() else "hf")
    rows = [json.loads(line) for line in open(tmp_path / "runs" / "python-api" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert "reward_fn/brevity/mean" in rows[0] and "reward_fn/answer_correctness/mean" in rows[0]
    saved = yaml.safe_load(open(tmp_path / "runs" / "python-api" / "config.yaml"))
    assert saved["reward"]["functions"] == ["answer_correctness", "<callable brevity (not importable)>"]
    assert saved["data"]["dataset"] == "<dataset Dataset (81 rows, in memory)>"
    assert saved["model"]["name"] == tiny_dir


def test_a_lambda_reward_is_recorded_without_crashing(tiny_dir, tmp_path):
    summary = policygrad.train(
        tiny_dir, [lambda _prompts, completions, **_: [float(len(c)) for c in completions], digit_reward],
        ROWS, **_small(tmp_path, "lambda"),
    )
    assert summary["steps"] == 1
    saved = yaml.safe_load(open(tmp_path / "lambda" / "config.yaml"))
    recorded = ["<callable <lambda> (not importable)>", "tests.test_api:digit_reward"]
    assert saved["reward"]["functions"] == recorded
    assert saved["data"]["dataset"] == "<dataset list (9 rows, in memory)>"
    row = json.loads(open(tmp_path / "lambda" / "metrics.jsonl").readline())
    assert row["reward_fn/<lambda>/mean"] > 0 and "reward_fn/tests.test_api:digit_reward/mean" in row


def test_async_rewards_work(tiny_dir, tmp_path):
    calls = []

    async def async_length(_prompts, completions, answer=None, **_):  # noqa: ARG001 (answer: a row field passed by keyword)
        calls.append(len(completions))
        return [float(len(c)) for c in completions]

    class AsyncScorer:
        async def __call__(self, _prompts, completions, **_):
            return [1.0 for _ in completions]

    summary = policygrad.train(
        model=tiny_dir,
        reward_funcs=[async_length, AsyncScorer()],
        train_dataset=ROWS,
        **_small(tmp_path, "async"),
    )
    assert summary["steps"] == 1 and calls == [8]
    row = json.loads(open(tmp_path / "async" / "metrics.jsonl").readline())
    assert row["reward_fn/async_length/mean"] > 0 and row["reward_fn/AsyncScorer/mean"] == 1.0


def test_config_forms_and_mistakes(tiny_dir, tmp_path):
    from policygrad.config.train import ConfigError, TrainConfig

    base = TrainConfig(algorithm="rloo", seed=3)
    summary = policygrad.train(tiny_dir, digit_reward, ROWS, config=base, **_small(tmp_path, "cfg"))
    saved = yaml.safe_load(open(tmp_path / "cfg" / "config.yaml"))
    assert (saved["algorithm"], saved["seed"], summary["steps"]) == ("rloo", 3, 1)
    with pytest.raises(ConfigError, match="unknown config key rollout.grup_size"):
        policygrad.train(tiny_dir, digit_reward, ROWS, rollout={"grup_size": 4})
    with pytest.raises(TypeError, match="tokenizer= goes with a model object"):
        policygrad.train(tiny_dir, digit_reward, ROWS, tokenizer=object())
    with pytest.raises(ValueError, match="cannot tell which field holds the prompt"):
        policygrad.train(tiny_dir, digit_reward, [{"text": "x"}], **_small(tmp_path, "bad"))


def test_a_model_object_without_a_folder_trains_and_keeps_its_start_model(tiny_dir, tmp_path):
    # A model built in memory has no folder: it is written to RUN_DIR/start_model while the run
    # is built, and neither the run-directory check nor --overwrite may take it for an old run's.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.name_or_path = model.config._name_or_path = ""  # as after from_config
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for overwrite in (False, True):  # a first run, then one that replaces it
        config = {**_small(tmp_path, "object"), "overwrite": overwrite}
        summary = policygrad.train(model, digit_reward, ROWS, tokenizer=tokenizer, config=config)
        assert summary["steps"] == 1
        assert os.path.isfile(tmp_path / "object" / "start_model" / "config.json")


def test_a_model_object_is_recorded_as_model_name_and_another_name_is_refused(tiny_dir, tmp_path):
    # The run trains the object: config.yaml must name it, or a --resume would load another model.
    from transformers import AutoModelForCausalLM

    from policygrad.config.train import ConfigError

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    other = tmp_path / "other_model"
    make_tiny_llama(other, seed=1)
    with pytest.raises(ConfigError) as info:
        policygrad.train(model, digit_reward, ROWS, **_small(tmp_path, "other"), **{"model.name": str(other)})
    assert str(info.value) == (
        f"model.name={str(other)!r} names another model than the model object the run trains ({tiny_dir}); "
        "config.yaml would record the wrong model for --resume: leave model.name unset, or set it to "
        f"{tiny_dir!r}"
    )
    assert not (tmp_path / "other").exists()  # refused before anything was written
    summary = policygrad.train(model, digit_reward, ROWS, **_small(tmp_path, "default_name"))
    saved = yaml.safe_load(open(os.path.join(summary["run_dir"], "config.yaml")))
    assert saved["model"]["name"] == tiny_dir


def test_a_trainer_given_a_model_object_records_it_in_config_yaml(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from policygrad.config.train import load_config
    from policygrad.run import Run

    cfg = load_config(None, _small(tmp_path, "direct"))
    assert cfg.model.name == "bundled:smollm2-135m-instruct"  # the default: not the trained model
    run = Run(cfg, model=AutoModelForCausalLM.from_pretrained(tiny_dir))
    try:
        saved = yaml.safe_load(open(tmp_path / "direct" / "config.yaml"))
        assert run.config.model.name == saved["model"]["name"] == tiny_dir
    finally:
        run.close()


def test_a_callable_reward_that_exits_is_a_reward_error_not_the_end(tiny_dir, tmp_path):
    import sys

    from policygrad.rewards.registry import RewardFunctionError

    def exits(_prompts, _completions, **_):
        sys.exit(0)

    config = {**_small(tmp_path, "contained"), "reward": {"on_error": "raise", "timeout_s": 5}}
    with pytest.raises(RewardFunctionError, match=r"'exits' raised SystemExit: 0 for row 0"):
        policygrad.train(tiny_dir, [exits], ROWS, **config)


def test_an_environment_instance_is_refused_with_the_class_or_factory_to_pass(tiny_dir, tmp_path):
    # Before: AttributeError: 'FindChar' object has no attribute 'strip', after the model loaded.
    from tests.evaluate.test_evaluation import FindChar

    with pytest.raises(TypeError) as info:
        policygrad.train(tiny_dir, [], ROWS, env=FindChar(char="v"), **_small(tmp_path, "instance"))
    assert str(info.value) == (
        "env is an environment instance (FindChar), but every episode needs its own (a group's episodes "
        "run at once, each resetting and stepping it): pass the class, env=FindChar, with its arguments "
        "in env.options, or a factory that returns a new one, env=lambda: FindChar(...)"
    )
    assert not os.path.exists(tmp_path / "instance")


def test_a_chdir_during_the_run_does_not_move_its_files(tiny_dir, tmp_path, monkeypatch):
    # A relative output_dir is made absolute when the run starts: code that changes the working
    # directory mid-run (here: the first step itself) cannot move where checkpoints are written.
    # Before: the checkpoint went to elsewhere/run/checkpoints, away from the run's metrics.
    from policygrad.trainer.loop import Trainer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    step = Trainer.step

    def step_then_chdir(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        os.chdir(tmp_path / "elsewhere")
        return out

    monkeypatch.setattr(Trainer, "step", step_then_chdir)
    config = {**_small(tmp_path, "run"), "output_dir": "run", "steps": 2}
    summary = policygrad.train(tiny_dir, [digit_reward], ROWS, **config)
    assert summary["run_dir"] == str(tmp_path / "run")
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step_2"]
    assert os.listdir(tmp_path / "elsewhere") == []
