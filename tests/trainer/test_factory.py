"""``prepare_config``: how a run records the objects a caller passes instead of names (reward
callables by import path or a placeholder, a model object by its folder), per-prompt seeds with
several processes, and the checks that run before any model is read; ``build_trainer`` builds
the same trainer from the same config."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policygrad.config.checks import read_chat_template
from policygrad.config.train import ConfigError, ModelConfig
from policygrad.envs import Environment, StepResult
from policygrad.parallel.distributed import Dist
from policygrad.rollout.base import SamplingParams
from policygrad.rollout.samplers import SingleTurnSampler
from policygrad.trainer.factory import build_trainer, prepare_config
from tests.training import config_with

pytestmark = pytest.mark.integration  # the last test builds a trainer of the tiny model


def importable_reward(_prompts, completions, **_fields):
    return [0.0 for _ in completions]


def _config(tmp_path, **sections):
    return config_with(tmp_path, 'no/such-model-is-ever-read', **sections)


class ImportableEnv(Environment):
    def reset(self, row, *, seed):  # noqa: ARG002 - the protocol's arguments
        return [{"role": "user", "content": "hi"}]

    def step(self, action):  # noqa: ARG002
        return StepResult(done=True)


class InMemoryModel(torch.nn.Module):
    """What ``record_model_object`` reads of a transformers model: ``name_or_path``."""

    def __init__(self, name_or_path=""):
        super().__init__()
        self.name_or_path = name_or_path


def test_nothing_given_returns_the_config_unchanged(tmp_path):
    cfg = _config(tmp_path)
    got, objects = prepare_config(cfg)
    assert got is cfg and objects is None


def test_reward_callables_are_recorded_by_import_path_or_a_placeholder(tmp_path):
    def local(_prompts, completions, **_fields):
        return [1.0 for _ in completions]

    functions = [importable_reward, local, "answer_correctness"]
    got, objects = prepare_config(
        _config(tmp_path, reward={"functions": ["answer_correctness"] * 3, "weights": [1.0, 2.0, 3.0]}),
        reward_functions=functions,
    )
    recorded = [
        "tests.trainer.test_factory:importable_reward",
        "<callable local (not importable)>",
        "answer_correctness",
    ]
    assert got.reward.functions == recorded
    assert got.reward.weights == [1.0, 2.0, 3.0]  # the rest of the section is kept
    # The importable one is loaded by its path like a name (in the reward worker); the other object
    # itself goes to the scorer.
    assert objects == ["tests.trainer.test_factory:importable_reward", local, "answer_correctness"]


def test_a_model_object_is_recorded_by_its_folder(tmp_path):
    got, _ = prepare_config(
        _config(tmp_path, model={"name": ModelConfig().name}), model=InMemoryModel()
    )
    assert got.model.name == "<model InMemoryModel (in memory)>"  # the default name is replaced
    folder = str(tmp_path)
    got, _ = prepare_config(
        _config(tmp_path, model={"name": folder}), model=InMemoryModel(folder)
    )
    assert got.model.name == folder  # the same folder: kept
    with pytest.raises(
        ConfigError, match=r"model.name='other/model' names another model than the model object"
    ):
        prepare_config(
            _config(tmp_path, model={"name": "other/model"}), model=InMemoryModel(folder)
        )


def test_several_processes_always_sample_with_per_prompt_seeds(tmp_path):
    cfg = _config(tmp_path, rollout={"per_prompt_seeds": False})
    one, _ = prepare_config(cfg, dist=Dist())
    assert one.rollout.per_prompt_seeds is False
    two, _ = prepare_config(cfg, dist=Dist(rank=0, world_size=2))
    assert two.rollout.per_prompt_seeds is True
    # nothing else changes
    assert dataclasses.replace(two, rollout=cfg.rollout) == cfg


def test_reward_specs_are_checked_before_any_model_without_running_user_code(tmp_path):
    ran = tmp_path / "ran"
    good = tmp_path / "rewards.py"
    good.write_text(
        f"open({str(ran)!r}, 'w').close()\n\n"
        "def f(prompts, completions, **k):\n    return [0.0] * len(completions)\n"
    )
    prepare_config(_config(tmp_path, reward={"functions": [f"{good}:f"]}))
    assert not ran.exists()  # parsed, not imported
    with pytest.raises(FileNotFoundError):
        prepare_config(_config(tmp_path, reward={"functions": [f"{tmp_path}/missing.py:f"]}))
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    with pytest.raises(Exception, match="SyntaxError"):
        prepare_config(_config(tmp_path, reward={"functions": [f"{bad}:f"]}))
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        prepare_config(_config(tmp_path), reward_functions=["no_such_module_xyz:f"])


def test_an_environment_object_is_recorded_by_import_path_or_a_placeholder(tmp_path):
    got, _ = prepare_config(_config(tmp_path), environment=ImportableEnv)
    assert got.env.name == "tests.trainer.test_factory:ImportableEnv"
    assert got.reward.functions == ["answer_correctness"]  # the rest is kept
    again, _ = prepare_config(got)  # the recorded path is a spec that needs no object
    assert again.env.name == got.env.name

    class Local(ImportableEnv):
        pass

    got, _ = prepare_config(_config(tmp_path), environment=Local)
    assert got.env.name == "<environment Local (not importable)>"
    # resumed or rerun from config.yaml without the object: the placeholder is no spec
    with pytest.raises(ConfigError) as info:
        prepare_config(got)
    message = str(info.value)
    assert message.startswith("env.name='<environment Local (not importable)>' records an environment object")
    assert "pass it again (policygrad.train(env=...))" in message
    # given again, it is accepted
    again, _ = prepare_config(got, environment=Local)
    assert again.env.name == "<environment Local (not importable)>"


def test_the_environment_spec_is_checked_before_any_model(tmp_path):
    with pytest.raises(ValueError, match=r"^unknown environment 'builtin:nope'"):
        prepare_config(_config(tmp_path, env={"name": "builtin:nope"}))
    with pytest.raises(FileNotFoundError):
        prepare_config(_config(tmp_path, env={"name": f"{tmp_path}/missing.py:Env"}))


def test_read_chat_template_takes_text_or_a_file(tmp_path):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert read_chat_template(template) == template  # text as is
    path = tmp_path / "chat.jinja"
    path.write_text(template + "\n")
    assert read_chat_template(str(path)) == template + "\n"  # the file's text, verbatim
    with pytest.raises(ConfigError) as info:
        read_chat_template(str(tmp_path / "missing.jinja"))
    assert "is neither a Jinja template nor an existing file" in str(info.value)
    assert str(info.value).startswith("data.chat_template=")
    with pytest.raises(ConfigError, match=r"^data.chat_template: cannot read "):
        read_chat_template(str(tmp_path))  # a folder exists but is no file


@pytest.mark.usefixtures("one_thread")
def test_the_same_config_builds_the_same_trainer(tmp_path, tiny_model_dir):
    # build_trainer seeds everything first and builds its parts in a fixed order: the random
    # streams a run starts with (torch's global RNG, the data order) are those of its seed.
    cfg = _config(
        tmp_path,
        model={"name": tiny_model_dir},
        data={"eval_size": 0, "difficulty": "easy"},
        kl={"placement": "loss", "beta": 0.04},
    )
    built = []
    for _ in range(2):
        trainer = build_trainer(cfg)
        try:
            assert trainer.step_idx == 0 and trainer.engine_name == "hf"
            assert trainer.reference is not None and trainer.seeds.run == cfg.seed
            rows = [trainer.stream.source.train_row(i)["prompt"] for i in range(4)]
            built.append((torch.get_rng_state(), rows))
        finally:
            trainer.close()
    (rng_a, rows_a), (rng_b, rows_b) = built
    assert torch.equal(rng_a, rng_b) and rows_a == rows_b
    other = build_trainer(dataclasses.replace(cfg, seed=cfg.seed + 1))
    try:
        assert not torch.equal(torch.get_rng_state(), rng_a)
    finally:
        other.close()


@pytest.mark.usefixtures("one_thread")
def test_the_producer_and_the_rollouts_are_built_from_the_run_parts(tmp_path, tiny_model_dir):
    cfg = _config(
        tmp_path,
        model={"name": tiny_model_dir},
        data={"eval_size": 0, "difficulty": "easy"},
        advantage={"estimator": "remax"},
        rollout={"temperature": 0.9, "top_k": 5},
        loss={"entropy_coef": 0.02, "entropy_target": 1.0, "entropy_coef_delta": 0.001},
    )
    trainer = build_trainer(cfg)
    try:
        producer, r = trainer.producer, cfg.rollout
        assert isinstance(producer.sampler, SingleTurnSampler) and producer.sampler.engine is trainer.engine
        assert producer.parts.engine is trainer.engine and producer.parts.tokenizer is trainer.tokenizer
        assert producer.parts.score == trainer.scorer.raw and producer.stream is trainer.stream
        assert producer.parts.params == SamplingParams(temperature=0.9, top_k=5)
        assert (producer.group_size, producer.prompts_per_step) == (r.group_size, r.prompts_per_step)
        assert list(producer.inputs) == ["baseline_rewards"]  # ReMax declares its greedy baseline
        assert producer.dynamic is None
        assert trainer.rollouts.max_staleness == 0 and trainer.rollouts.stream is trainer.stream
        assert trainer.entropy_ctl.coef == 0.02 and trainer.objective.entropy_coef == 0.02
    finally:
        trainer.close()
