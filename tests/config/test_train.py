"""Tests of TrainConfig and its loading: YAML + overrides, coercion, presets, the checks that span
sections, errors naming the field. The sections' own checks are tested in test_config_sections.py
and test_config_training.py."""

from __future__ import annotations

import pytest
import yaml

from policygrad.config.train import (
    ConfigError,
    RolloutConfig,
    TrainConfig,
    load_config,
    parse_overrides,
)
from policygrad.core.advantages import list_advantage_estimators
from policygrad.core.kl import KL_PLACEMENTS, get_kl_placement
from policygrad.core.losses import list_policy_losses
from policygrad.core.masking import AGGREGATION_MODES

pytestmark = pytest.mark.unit


def _yaml(tmp_path, data, name="cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


# ----------------------------------------------------------------------------- YAML and overrides


def test_yaml_and_overrides_map_onto_the_tree(tmp_path):
    path = _yaml(
        tmp_path,
        {
            "algorithm": "rloo",
            "steps": 7,
            "kl": {"placement": "loss", "beta": 0.04},
            "optim": {"betas": [0.8, 0.95], "warmup_steps": 3},
            "reward": {"functions": ["answer_correctness", "answer_format"], "weights": [1, 0.5]},
        },
    )
    cfg = load_config(path, ["--kl.beta=0.1", "--rollout.group_size", "4", "--data.prompt_field=question"])
    # overrides win; YAML values stay where nothing overrides them; defaults fill the rest
    assert cfg.kl.beta == 0.1 and cfg.kl.placement == "loss"
    assert cfg.rollout.group_size == 4 and cfg.rollout.prompts_per_step == RolloutConfig().prompts_per_step
    assert cfg.data.prompt_field == "question"
    assert (cfg.algorithm, cfg.steps, cfg.optim.warmup_steps) == ("rloo", 7, 3)
    assert cfg.optim.betas == (0.8, 0.95) and isinstance(cfg.optim.betas, tuple)
    assert cfg.reward.functions == ["answer_correctness", "answer_format"]
    assert cfg.reward.weights == [1.0, 0.5] and all(type(w) is float for w in cfg.reward.weights)


def test_list_and_mapping_overrides_are_the_same():
    as_list = load_config(None, ["--kl.placement=reward", "--kl.beta=0.05", "--optim.lr=3e-4", "--steps=5"])
    as_dict = load_config(
        None, {"kl": {"placement": "reward", "beta": 0.05}, "optim": {"lr": 3e-4}, "steps": 5}
    )
    assert as_list == as_dict
    assert parse_overrides(["--kl.beta", "0.05", "--model.lora.rank=8"]) == {
        "kl": {"beta": 0.05},
        "model": {"lora": {"rank": 8}},
    }


@pytest.mark.parametrize(
    "override, path, expected, kind",
    [
        ("--kl.beta=1", ("kl", "beta"), 1.0, float),  # int -> float
        ("--steps=10.0", ("steps",), 10, int),  # integral float -> int
        ("--optim.lr=1e-5", ("optim", "lr"), 1e-5, float),  # YAML 1.1 reads 1e-5 as a string
        ("--optim.lr=2.5E-4", ("optim", "lr"), 2.5e-4, float),
        ("--progress=false", ("progress",), False, bool),
        ("--data.prompt_field=null", ("data", "prompt_field"), None, type(None)),
        ("--loss.dual_clip=3", ("loss", "dual_clip"), 3.0, float),  # float | None
        ("--max_minutes=2", ("max_minutes",), 2.0, float),
        (
            "--model.lora.target_modules=[q_proj, v_proj]",
            ("model", "lora", "target_modules"),
            ["q_proj", "v_proj"],
            list,
        ),
        ("--model.lora.target_modules=all-linear", ("model", "lora", "target_modules"), "all-linear", str),
        ("--advantage.options={scale: batch}", ("advantage", "options"), {"scale": "batch"}, dict),
    ],
)
def test_values_are_coerced_to_the_annotated_type(override, path, expected, kind):
    adapters = ["--model.lora.rank=4"] if override.startswith("--model.lora.") else []  # options need a rank
    cfg = load_config(None, [override, *adapters])
    value = cfg
    for name in path:
        value = getattr(value, name)
    assert value == expected and type(value) is kind


@pytest.mark.parametrize(
    "override, message",
    [
        ("--steps=1.5", "steps must be an integer, got 1.5"),
        ("--rollout.group_size=abc", "rollout.group_size must be an integer, got 'abc'"),
        ("--progress=maybe", "progress must be true or false, got 'maybe'"),
        ("--optim.lr=fast", "optim.lr must be a number, got 'fast'"),
        ("--kl.beta=nan", "kl.beta must be a finite number, got nan"),
        ("--optim.lr=.inf", "optim.lr must be a finite number, got inf"),
        ("--optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1)"),
        ("--num_threads=0", "num_threads must be >= 1"),
        ("--model.name=[a, b]", "model.name must be a string"),
        ("--reward.functions=answer_correctness", "reward.functions must be a list"),
        ("--model=3", "model must be a mapping of its fields"),
    ],
)
def test_wrong_types_name_the_dotted_field(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    "override, message",
    [
        ("--stepz=3", "unknown config key stepz; valid keys here: "),
        ("--kl.bta=1", "unknown config key kl.bta; valid keys here: beta, controller, horizon"),
        ("--model.lora.rnk=4", "unknown config key model.lora.rnk; valid keys here: alpha, dropout, rank"),
        # a section that takes a registered function's options says where they go
        ("--loss.clip_cov_ratio=2", "(an option of the chosen function goes in loss.options.clip_cov_ratio)"),
        ("--advantage.rollouts=4", "(an option of the chosen function goes in advantage.options.rollouts)"),
    ],
)
def test_unknown_keys_are_named_with_their_section(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert message in str(info.value)


def test_unknown_nested_key_in_yaml_is_named(tmp_path):
    path = _yaml(tmp_path, {"optim": {"lr": 1e-4, "lrr": 1e-4}})
    with pytest.raises(ConfigError, match=r"unknown config key optim\.lrr; valid keys here: betas, eps"):
        load_config(path)


def test_malformed_overrides_and_files():
    with pytest.raises(ConfigError, match=r"expected --key=value, got 'steps=3'"):
        load_config(None, ["steps=3"])
    with pytest.raises(ConfigError, match=r"config file 'configs/rloo.yaml' must come first: policygrad"):
        load_config(None, ["--steps=3", "configs/rloo.yaml"])
    with pytest.raises(ConfigError, match=r"--steps needs a value: --steps=VALUE"):
        load_config(None, ["--steps"])
    with pytest.raises(ConfigError, match=r"cannot set kl\.beta\.x: beta is not a section"):
        parse_overrides(["--kl.beta=1", "--kl.beta.x=2"])
    with pytest.raises(FileNotFoundError):
        load_config("/nonexistent/run.yaml")


def test_config_file_must_be_a_mapping(tmp_path):
    path = _yaml(tmp_path, ["grpo", "rloo"])
    with pytest.raises(ConfigError, match="a config file must be a YAML mapping"):
        load_config(path)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(
        None,
        [
            "--algorithm=dr_grpo",
            "--kl.placement=loss",
            "--kl.beta=0.02",
            "--optim.lr=5e-6",
            "--model.lora.rank=8",
            "--reward.weights=[2]",
        ],
    )
    path = _yaml(tmp_path, cfg.to_dict())
    assert load_config(path) == cfg


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize(
    "algorithm, estimator, options, agg_mode, min_group",
    [
        ("reinforce", "reinforce", {"baseline": 0.0}, "token-mean", 1),
        ("rloo", "rloo", {}, "token-mean", 2),
        ("remax", "remax", {}, "token-mean", 1),
        ("grpo", "grpo", {"scale": "group"}, "seq-mean-token-mean", 2),
        # Dr.GRPO (Liu et al. 2025): GRPO's group baseline without the std scale, and a constant
        # normaliser (num_seqs x max_new_tokens) instead of each sequence's length.
        ("dr_grpo", "grpo", {"scale": "none"}, "seq-mean-token-sum-norm", 2),
        ("reinforce_pp", "reinforce_pp", {}, "token-mean", 1),
    ],
)
def test_presets_resolve_to_registered_names(algorithm, estimator, options, agg_mode, min_group):
    cfg = load_config(None, [f"--algorithm={algorithm}", f"--rollout.group_size={max(min_group, 2)}"])
    assert cfg.estimator_name == estimator and cfg.estimator_options == options
    assert cfg.policy_loss_name == "ppo" and cfg.agg_mode == agg_mode
    # the minimum group size is the estimator's declared capability, not a preset field
    assert cfg.estimator_spec.min_group_size(cfg.estimator_options) == min_group
    # the trainer only looks these names up in core's registries
    assert estimator in list_advantage_estimators() and "ppo" in list_policy_losses()
    assert agg_mode in AGGREGATION_MODES


def test_overrides_of_the_preset():
    cfg = load_config(
        None, ["--algorithm=dr_grpo", "--advantage.options={scale: batch}", "--loss.agg_mode=token-mean"]
    )
    assert cfg.estimator_name == "grpo"
    assert cfg.estimator_options == {"scale": "batch"}  # merged over the preset's {"scale": "none"}
    assert cfg.agg_mode == "token-mean"
    # another estimator drops the preset's options (they belong to the preset's estimator)
    cfg = load_config(None, ["--algorithm=grpo", "--advantage.estimator=rloo"])
    assert (cfg.estimator_name, cfg.estimator_options) == ("rloo", {})
    cfg = load_config(None, ["--loss.policy_loss=vanilla"])
    assert cfg.policy_loss_name == "vanilla"


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--algorithm=ppo2"],
            "algorithm='ppo2' is not valid; choose one of ['dr_grpo', 'grpo', 'ppo', 'reinforce', "
            "'reinforce_pp', 'remax', 'rloo', 'vineppo']",
        ),
        (["--algorithm=rloo", "--rollout.group_size=1"], "algorithm='rloo' needs rollout.group_size >= 2"),
        (["--algorithm=grpo", "--rollout.group_size=1"], "algorithm='grpo' needs rollout.group_size >= 2"),
        (
            ["--algorithm=dr_grpo", "--rollout.group_size=1"],
            "algorithm='dr_grpo' needs rollout.group_size >= 2",
        ),
        (["--rollout.engine=hf", "--rollout.dtype=bfloat16"], "rollout.dtype='bfloat16' applies to the vllm"),
        (
            ["--rollout.prompts_per_step=4", "--rollout.group_size=8", "--optim.num_minibatches=33"],
            "optim.num_minibatches=33 exceeds the batch of 32 sequences",
        ),
        (["--eval_every=-1"], "eval_every must be >= 0, got -1"),
        # Before: "[Errno 2] No such file or directory: ''" when the run made its folder.
        (["--output_dir="], "output_dir must name the run's folder, e.g. --output_dir=runs/my_run; got ''"),
        (["--output_dir=' '"], "output_dir must name the run's folder"),
    ],
)
def test_validation_errors_name_the_dotted_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)


@pytest.mark.parametrize("algorithm", ["reinforce", "remax", "reinforce_pp"])
def test_group_size_one_is_fine_without_a_group_baseline(algorithm):
    cfg = load_config(None, [f"--algorithm={algorithm}", "--rollout.group_size=1"])
    assert cfg.rollout.group_size == 1


def test_construction_validates():
    with pytest.raises(ConfigError, match="algorithm='nope'"):
        TrainConfig(algorithm="nope")
    cfg = TrainConfig()
    cfg.rollout.group_size = 1  # mutated after construction: validate() catches it
    with pytest.raises(ConfigError, match="needs rollout.group_size >= 2"):
        cfg.validate()


# ----------------------------------------------------------------------------- estimator capabilities


def test_estimator_spec_comes_from_the_registry():
    cfg = load_config(None, ["--algorithm=ppo"])
    assert cfg.estimator_spec.name == "gae" and cfg.estimator_spec.needs_values
    cfg = load_config(None, ["--algorithm=remax"])
    assert cfg.estimator_spec.inputs == ("baseline_rewards",)
    assert not hasattr(cfg.preset, "greedy_baseline") and not hasattr(cfg.preset, "min_group_size")


# ----------------------------------------------------------------------------- KL placement


def test_kl_placement_is_the_registered_object():
    for name in KL_PLACEMENTS:
        beta = [] if name == "none" else ["--kl.beta=0.1"]
        cfg = load_config(None, [f"--kl.placement={name}", *beta])
        assert cfg.kl_placement is get_kl_placement(name)
        assert cfg.kl.resolved_kind() == get_kl_placement(name).default_kind
    with pytest.raises(
        ConfigError, match=r"kl.placement='both' is not valid; choose one of \['loss', 'none'"
    ):
        load_config(None, ["--kl.placement=both"])


# ----------------------------------------------------------------------------- dynamic sampling


def test_dynamic_sampling_defaults_and_components():
    cfg = load_config(None, [])
    assert (cfg.dynamic_sampling.reward, cfg.dynamic_sampling.max_extra_rounds) == (None, 0)
    functions = "--reward.functions=[answer_correctness, answer_format, answer_correctness]"
    cfg = load_config(None, ["--drop_zero_variance_groups=true", functions])
    assert cfg.dynamic_sampling_reward == "answer_correctness"  # the first entry
    for component in ("answer_format", "answer_correctness#2"):
        cfg = load_config(
            None,
            [
                "--drop_zero_variance_groups=true",
                functions,
                f"--dynamic_sampling.reward={component}",
                "--dynamic_sampling.max_extra_rounds=3",
            ],
        )
        assert cfg.dynamic_sampling_reward == component and cfg.dynamic_sampling.max_extra_rounds == 3


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (
            ["--dynamic_sampling.reward=answer_correctness"],
            "dynamic_sampling.reward='answer_correctness' has no effect; set drop_zero_variance_groups=true",
        ),
        (
            ["--dynamic_sampling.max_extra_rounds=2"],
            "dynamic_sampling.max_extra_rounds=2 has no effect; set drop_zero_variance_groups=true",
        ),
        (
            ["--drop_zero_variance_groups=true", "--dynamic_sampling.reward=answer_format"],
            "dynamic_sampling.reward='answer_format' is not a reward component; choose one of "
            "['answer_correctness']",
        ),
        (
            ["--drop_zero_variance_groups=true", "--dynamic_sampling.reward=answer_correctness#2"],
            "dynamic_sampling.reward='answer_correctness#2' is not a reward component",
        ),
        (["--dynamic_sampling.rounds=2"], "unknown config key dynamic_sampling.rounds"),
        (  # an episode's return: only with an environment
            ["--drop_zero_variance_groups=true", "--dynamic_sampling.reward=return"],
            "dynamic_sampling.reward='return' is not a reward component; choose one of "
            "['answer_correctness']",
        ),
    ],
)
def test_dynamic_sampling_validation(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert fragment in str(info.value)


# ------------------------------------------------------------- settings without a check or an effect


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--eval_every=5", "--data.eval_size=0"],
            "eval_every=5 with data.eval_size=0 would evaluate no problem; set data.eval_size > 0",
        ),
        (
            ["--data.dataset=builtin:code"],
            "data.dataset='builtin:code' holds code rows (tests, no final answer), but "
            "reward.functions=['answer_correctness'] cannot score a program",
        ),
        (
            ["--data.dataset=builtin:code", "--reward.functions=[answer_format, length_penalty]"],
            "set reward.functions=[code_tests]",
        ),
    ],
)
def test_settings_that_would_have_no_effect_are_refused(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_the_same_settings_are_accepted_where_they_act():
    cfg = load_config(
        None,
        [
            "--loss.entropy_coef=0.01",
            "--model.lora.rank=4",
            "--model.lora.alpha=16",
            "--model.lora.dropout=0.05",
            "--kl.controller=adaptive",
            "--kl.placement=reward",
            "--eval_every=5",
            "--data.eval_size=3",
        ],
    )
    assert (cfg.loss.entropy_coef, cfg.model.lora.dropout, cfg.kl.controller) == (0.01, 0.05, "adaptive")
    assert load_config(None, ["--loss.entropy_coef=0"]).loss.entropy_coef == 0.0
    code = ["--data.dataset=builtin:code"]
    assert load_config(None, [*code, "--reward.functions=[code_tests]"]).reward.functions == ["code_tests"]
    # A function of the user's own may score programs: only the built-in answer/length rewards are refused.
    mine = load_config(None, [*code, "--reward.functions=[answer_correctness, my_rewards:passes]"])
    assert mine.reward.functions == ["answer_correctness", "my_rewards:passes"]


# ----------------------------------------------------------------------------- environments

ENV = "--env.name=builtin:guess"


def test_reward_functions_default_depends_on_the_environment():
    assert load_config(None, []).reward.functions == ["answer_correctness"]
    with_env = load_config(None, [ENV])
    assert with_env.reward.functions == []  # the environment's return is the reward
    assert with_env.reward_components == ["env"]
    # an explicit list is kept either way
    both = load_config(None, [ENV, "--reward.functions=[answer_format]"])
    assert both.reward.functions == ["answer_format"]
    assert both.reward_components == ["env", "answer_format"]


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (
            ["--rollout.max_turns=3"],
            ["rollout.max_turns applies to multi-turn episodes only; set env.name"],
        ),
        (
            ["--rollout.env_workers=2"],
            ["rollout.env_workers applies to multi-turn episodes only; set env.name"],
        ),
        (
            ["--env.options={low: 1}"],
            ["env.options is set but env.name is null"],
        ),
        (
            [ENV, "--rollout.ignore_eos=true"],
            ["rollout.ignore_eos with env.name would never end a turn"],
        ),
        (
            [ENV, "--algorithm=remax"],
            ["advantage estimator 'remax' needs", "which multi-turn episodes do not provide"],
        ),
        (
            ["--reward.functions=[]"],
            ["reward.functions is empty; give at least one reward function"],
        ),
        (
            [ENV, "--drop_zero_variance_groups=true", "--dynamic_sampling.reward=answer_correctness"],
            [
                "dynamic_sampling.reward='answer_correctness' is not a reward component; "
                "choose one of ['env', 'return']"
            ],
        ),
    ],
)
def test_environment_settings_are_checked(overrides, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_same_settings_are_accepted_with_an_environment():
    cfg = load_config(None, [ENV, "--rollout.max_turns=3", "--env.options={low: 1, high: 8}"])
    assert (cfg.rollout.max_turns, cfg.env.options) == (3, {"low": 1, "high": 8})
    assert load_config(None, ["--algorithm=remax"]).algorithm == "remax"  # fine single-turn
    # an environment needs no reward function
    assert load_config(None, [ENV, "--reward.functions=[]"]).reward.functions == []


def test_dynamic_sampling_with_an_environment_defaults_to_its_return():
    # the return: final + turn rewards + the functions' weighted sum (env alone when named)
    cfg = load_config(None, [ENV, "--drop_zero_variance_groups=true"])
    assert cfg.dynamic_sampling_reward == "return"
    cfg = load_config(None, [ENV, "--drop_zero_variance_groups=true", "--reward.functions=[answer_format]"])
    assert cfg.dynamic_sampling_reward == "return"
    cfg = load_config(None, [ENV, "--drop_zero_variance_groups=true", "--dynamic_sampling.reward=env"])
    assert cfg.dynamic_sampling_reward == "env"
    cfg = load_config(
        None,
        [
            ENV,
            "--drop_zero_variance_groups=true",
            "--reward.functions=[answer_format]",
            "--dynamic_sampling.reward=answer_format",
        ],
    )
    assert cfg.dynamic_sampling_reward == "answer_format"
