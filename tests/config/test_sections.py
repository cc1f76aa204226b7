"""Tests of policygrad.config.sections: the model, data, rollout and environment sections and
their checks (errors name the dotted field)."""

from __future__ import annotations

import pytest

from policygrad.config.sections import ConfigError, RolloutConfig
from policygrad.config.train import load_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--rollout.top_p=1.5"], "rollout.top_p must be in (0, 1], got 1.5"),
        (["--rollout.temperature=0"], "rollout.temperature must be > 0, got 0.0"),
        (["--rollout.engine=sglang"], "rollout.engine='sglang' is not valid; choose one of ['auto', 'hf', "),
        (["--rollout.is_correction=seq"], "rollout.is_correction='seq' is not valid"),
        (["--rollout.is_mode=clip"], "rollout.is_mode='clip' is not valid"),
        (["--rollout.is_cap=0"], "rollout.is_cap must be > 0"),
        (["--rollout.dtype=int8"], "rollout.dtype='int8' is not valid"),
        (["--rollout.vllm_gpu_memory_utilization=1.5"], "vllm_gpu_memory_utilization must be in (0, 1]"),
        (["--reward.weights=[1, 2]"], "reward.weights has 2 entries for 1 functions"),
        (
            ["--reward.on_error=ignore"],
            "reward.on_error='ignore' is not valid; choose one of ['raise', 'skip']",
        ),
        (["--reward.truncation=drop"], "reward.truncation='drop' is not valid"),
        (["--reward.functions=[]"], "reward.functions is empty"),
        (["--model.lora.rank=-1"], "model.lora.rank must be >= 0, got -1"),
        (["--model.dtype=float16"], "model.dtype='float16' is not valid"),
        (["--data.max_prompt_length=0"], "data.max_prompt_length must be > 0, got 0"),
        (["--rollout.engine=server"], "rollout.engine=server needs rollout.servers: a list of server URLs"),
        (["--rollout.servers=2"], "rollout.servers is for rollout.engine=server"),
        (["--rollout.engine=server", "--rollout.servers=0"], "rollout.servers must be >= 1"),
        (
            ["--rollout.engine=server", "--rollout.servers=[localhost:80]"],
            "is not a URL like http://host:8000",
        ),
        (
            ["--rollout.engine=server", "--rollout.servers=[http://a:80, http://A:80/]"],
            "rollout.servers names 'http://A:80/' twice",
        ),
        (
            ["--rollout.engine=server", "--rollout.servers=2", '--rollout.server_cpus=["1"]'],
            "rollout.server_cpus has 1 entries for 2 servers",
        ),
        (
            ["--rollout.engine=server", "--rollout.servers=1", '--rollout.server_cpus=["3-1"]'],
            "rollout.server_cpus: '3-1' is not a CPU list",
        ),
        (
            ["--rollout.engine=server", "--rollout.servers=2", '--rollout.server_gpus=["0", "0"]'],
            "rollout.server_gpus names a GPU twice",
        ),
        (
            ["--rollout.engine=server", "--rollout.servers=[http://a:80]", '--rollout.server_gpus=["0"]'],
            "rollout.server_gpus places servers the run starts",
        ),
        (
            ["--rollout.engine=server", "--rollout.servers=1", "--rollout.server_timeout_s=1e9"],
            "rollout.server_timeout_s must be a number of seconds in (0, 86400.0]",
        ),
        (
            ["--rollout.engine=server", "--rollout.servers=1", "--rollout.server_timeout_s=0"],
            "server_timeout_s",
        ),
    ],
)
def test_validation_errors_name_the_dotted_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.lora.rank=4", "--model.lora.dropout=1.5"], "model.lora.dropout must be in [0, 1)"),
        (["--model.lora.rank=4", "--model.lora.dropout=1"], "model.lora.dropout must be in [0, 1)"),
        (["--model.lora.rank=4", "--model.lora.dropout=-0.1"], "model.lora.dropout must be >= 0, got -0.1"),
        (["--model.lora.alpha=16"], "model.lora.alpha=16.0 has no effect with model.lora.rank=0"),
        (["--model.lora.dropout=0.05"], "model.lora.dropout=0.05 has no effect with model.lora.rank=0"),
        (
            ["--model.lora.target_modules=[q_proj]"],
            "model.lora.target_modules=['q_proj'] has no effect with model.lora.rank=0",
        ),
    ],
)
def test_lora_settings_that_would_have_no_effect_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_auto_engine_falls_back_to_hf_when_vllm_does_not_import(monkeypatch):
    # An install built for another torch is found by find_spec but fails on import: auto must
    # say so and use hf rather than die after the models have loaded.
    import builtins

    from policygrad.specs import engines

    monkeypatch.setattr(engines, "vllm_available", lambda: True)
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "vllm":
            raise ImportError("undefined symbol: _ZN3c10")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    engine, why = RolloutConfig(engine="auto").resolved_engine()
    assert engine == "hf" and "does not import" in why and "undefined symbol" in why
    assert RolloutConfig(engine="vllm").resolved_engine() == ("vllm", "configured")
    monkeypatch.setattr(engines, "vllm_available", lambda: False)
    assert RolloutConfig(engine="auto").resolved_engine() == ("hf", "auto: vllm not installed")


def test_env_retries_is_bounded():
    # an environment that always fails is retried env_retries times per episode and step: 1e9 was
    # a run that never finished its step (and a stop signal waits for the step)
    for good in (0, 10):
        RolloutConfig(env_retries=good).validate("rollout")
    for bad in (11, 10**9, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"rollout\.env_retries must be an int in \[0, 10\], got "):
            RolloutConfig(env_retries=bad).validate("rollout")
