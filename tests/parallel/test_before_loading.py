"""Every CPU run plans its memory before its first model loads
(:mod:`policygrad.parallel.before_loading`): the plan reads the prompts as the run tokenizes
them, and a run whose plan does not fit the machine is refused in one line, before any model
loads and before its folder is made."""

from __future__ import annotations

import os

import pytest
import yaml

from policygrad.cli import main
from policygrad.data.chat import encode_prompts
from policygrad.data.sources import build_train_source
from policygrad.models.loading import load_tokenizer
from policygrad.parallel.before_loading import PROMPT_SAMPLE, plan_run_from_config

pytestmark = pytest.mark.integration


def test_the_plan_reads_the_longest_prompt_as_the_run_tokenizes_it(make_config, eos_model_dir):
    cfg = make_config("plan")
    plan = plan_run_from_config(cfg)
    source = build_train_source(cfg.data, seed=cfg.seed)
    rows = [source.train_row(i) for i in range(PROMPT_SAMPLE)]
    longest = max(map(len, encode_prompts(load_tokenizer(eos_model_dir), rows, cfg.data)))
    assert plan.prompt_tokens == longest
    assert plan.seq_len == longest + cfg.rollout.max_new_tokens
    assert plan.engine == "hf" and plan.precision == "fp32"
    assert plan.sequences == cfg.rollout.prompts_per_step * cfg.rollout.group_size


def test_a_planned_out_of_memory_run_is_refused_before_any_model_loads(
    make_config, tmp_path, monkeypatch, capsys
):
    cfg = make_config("oom")
    path = tmp_path / "oom.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    loaded = []

    def build_models(*_args, **_kwargs):
        loaded.append(True)
        raise AssertionError("a model loaded")

    monkeypatch.setattr("policygrad.trainer.factory.build_models", build_models)
    monkeypatch.setattr("policygrad.parallel.before_loading.available_memory_bytes", lambda: 10**8)  # 0.1 GB
    monkeypatch.setattr("policygrad.parallel.before_loading._resident_bytes", lambda: 0)  # and none held
    assert main(["train", str(path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert "planned to need" in errors[0] and "0.10 GB available" in errors[0]
    assert "policygrad memory --config" in errors[0]
    assert not loaded
    assert not os.path.exists(cfg.output_dir)


def test_a_run_that_fits_logs_its_plan_and_builds(make_config, caplog):
    # the plan is made on every CPU run; one that fits says so in one line and goes on to load
    from policygrad.run import Run

    cfg = make_config("fits", steps=1)
    with caplog.at_level("INFO", logger="policygrad"):
        Run(cfg).close()
    said = [r.getMessage() for r in caplog.records]
    plan = [i for i, m in enumerate(said) if m.startswith("memory: planned peak")]
    engine = [i for i, m in enumerate(said) if m.startswith("rollout engine:")]
    assert len(plan) == 1 and plan[0] < engine[0]  # before the models and the engine


def test_a_model_without_the_plans_sizes_runs_unchecked_and_says_so(make_config, monkeypatch, caplog):
    # GPT-2's config.json names no intermediate_size: the activation arithmetic has no MLP width,
    # so the run is not checked, and says so at info level instead of being refused or silent
    import dataclasses

    from policygrad.parallel import before_loading
    from policygrad.parallel.footprint import model_shape_from_config

    cfg = make_config("gpt2-like")
    real = model_shape_from_config

    def without_width(spec):
        return dataclasses.replace(real(spec), intermediate_size=None)

    monkeypatch.setattr(before_loading, "model_shape_from_config", without_width)
    monkeypatch.setattr(before_loading, "available_memory_bytes", lambda: 10**8)  # would refuse a plan
    with pytest.raises(before_loading.NotPlanned, match="names no intermediate_size"):
        plan_run_from_config(cfg)
    source = build_train_source(cfg.data, seed=cfg.seed)
    with caplog.at_level("INFO", logger="policygrad"):
        assert before_loading.check_before_loading(cfg, train_source=source, precision="fp32") is None
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory:")]
    assert len(said) == 1, said
    assert said[0].startswith("memory: not planned, so not checked against this machine (")
    assert said[0].endswith("config.json names no intermediate_size)")


def test_a_run_given_an_engine_object_plans_it_as_given(make_config, monkeypatch):
    # the engine object's memory is its own: the plan must not price rollout.engine's
    from policygrad.trainer import factory

    seen = []

    class Stop(Exception):
        pass

    def check(_cfg, **kwargs):
        seen.append(kwargs["engine"])
        raise Stop

    monkeypatch.setattr(factory, "check_before_loading", check)
    cfg = make_config("given")
    for engine, planned in ((object(), "given"), (None, None)):
        with pytest.raises(Stop):
            factory.build_trainer(cfg, engine=engine)
        assert seen.pop() == planned


def test_a_reward_model_is_planned_at_its_exact_parameter_count(make_config, tmp_path):
    from policygrad.parallel.before_loading import reward_model_params
    from tests.models.test_value import make_tiny_reward_model

    folder = tmp_path / "rm"
    make_tiny_reward_model(str(folder))
    model, _ = make_tiny_reward_model(None)
    exact = sum(p.numel() for p in model.parameters())
    assert reward_model_params(str(folder)) == exact
    cfg = make_config("rm", reward={"functions": ["answer_correctness", f"reward_model:{folder}"]})
    lines = [it for it in plan_run_from_config(cfg).items if it.component == "reward model"]
    assert [(it.params, it.bytes) for it in lines] == [(exact, 4 * exact)]  # float32 on a CPU
    with pytest.raises(ValueError, match="cannot read its config.json"):
        reward_model_params(str(tmp_path / "nowhere"))


def test_what_a_process_already_holds_counts_up_to_the_plans_process_line(monkeypatch):
    from policygrad.parallel import before_loading
    from policygrad.parallel.run_memory import PROCESS_BYTES

    # a notebook holding a 20 GB model: only the plan's process line of it counts as available
    monkeypatch.setattr(before_loading, "_resident_bytes", lambda: 20 * 10**9)
    assert before_loading.available_to_a_run(lambda: 10**9) == 10**9 + PROCESS_BYTES
    # 4 torchrun processes at the same point: each one's process line
    assert before_loading.available_to_a_run(lambda: 10**9, processes=4) == 10**9 + 4 * PROCESS_BYTES
    monkeypatch.setattr(before_loading, "_resident_bytes", lambda: 10**8)
    assert before_loading.available_to_a_run(lambda: 10**9, processes=2) == 10**9 + 2 * 10**8


def test_memory_check_false_skips_the_plan(make_config, monkeypatch):
    from policygrad.trainer import factory

    called = []
    monkeypatch.setattr(factory, "check_before_loading", lambda *_a, **_k: called.append(True))

    class Stop(Exception):
        pass

    def build_models(*_args, **_kwargs):
        raise Stop

    monkeypatch.setattr(factory, "build_models", build_models)
    for check, expected in ((False, []), (True, [True])):
        with pytest.raises(Stop):
            factory.build_trainer(make_config("skip", memory_check=check))
        assert called == expected


def test_the_plan_reads_prompts_in_the_runs_chat_template(make_config):
    # a template that wraps every message in a long preamble: the plan's prompts grow by it
    template = "{% for m in messages %}" + "x " * 40 + "{{ m['content'] }}{% endfor %}"
    plain = plan_run_from_config(make_config("plain"))
    templated = plan_run_from_config(make_config("templated", data={"chat_template": template}))
    assert templated.prompt_tokens > plain.prompt_tokens + 30


def test_a_reward_model_entry_that_is_no_local_folder_is_left_to_its_loader(make_config, tmp_path):
    cfg = make_config(
        "rm-missing", reward={"functions": ["answer_correctness", f"reward_model:{tmp_path}/none"]}
    )
    plan = plan_run_from_config(cfg)
    assert plan is not None and "reward model" not in {it.component for it in plan.items}
