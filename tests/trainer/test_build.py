"""The builders of a run that need no model: seeding, dtypes, the engine's choice, the checks
before models, the context an engine gets, the schedules' horizon, the policy's optimizer, the
KL controller, the objective and PPO-ptx."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from policygrad.config.train import ConfigError
from policygrad.core.kl import AdaptiveKLController, FixedKLController
from policygrad.core.losses import get_policy_loss
from policygrad.learn.optim import OptimizerStep
from policygrad.parallel.distributed import Dist
from policygrad.parallel.strategy import Single
from policygrad.specs import engines
from policygrad.trainer import build
from tests.training import config_with

pytestmark = pytest.mark.unit


def _config(tmp_path, **sections):
    return config_with(tmp_path, "org/model", **sections)


def _draws():
    return random.random(), float(np.random.rand()), torch.rand(2).tolist()


def test_seed_everything_seeds_python_numpy_and_torch():
    build.seed_everything(11)
    first = _draws()
    _draws()
    build.seed_everything(11)
    assert _draws() == first
    build.seed_everything(12)
    assert _draws() != first
    build.seed_everything(2**32 + 11)  # numpy takes the seed modulo 2**32
    assert float(np.random.rand()) == first[1]


def test_resolve_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert build.resolve_dtype("auto", cpu) == torch.float32
    assert build.resolve_dtype("auto", cuda) == torch.bfloat16  # only the device type is read
    assert build.resolve_dtype("float32", cuda) == torch.float32
    assert build.resolve_dtype("bfloat16", cpu) == torch.bfloat16


def test_engine_context_is_capped_by_the_models_positions():
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    assert build.engine_context(model, 40) == 40 and build.engine_context(model, 100) == 64
    assert build.engine_context(SimpleNamespace(), 100) == 100  # no config: no cap
    text = SimpleNamespace(max_position_embeddings=32)
    multimodal = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    assert build.engine_context(multimodal, 100) == 32


def test_resolve_engine_refuses_a_vllm_dtype_when_auto_resolves_to_hf(tmp_path, monkeypatch):
    assert build.resolve_engine(_config(tmp_path)) == ("hf", "configured")
    monkeypatch.setattr(engines, "vllm_available", lambda: False)
    cfg = _config(tmp_path, rollout={"engine": "auto", "dtype": "bfloat16"})
    with pytest.raises(
        ConfigError, match=r"rollout.dtype='bfloat16' needs the vllm engine, but rollout.engine=auto"
    ):
        build.resolve_engine(cfg)
    with pytest.raises(ConfigError):  # the same check runs before any model
        build.check_before_models(cfg)
    auto = _config(tmp_path, rollout={"engine": "auto"})
    assert build.resolve_engine(auto) == ("hf", "auto: vllm not installed")


def test_check_before_models_checks_the_given_functions_instead_of_the_configs(tmp_path):
    cfg = _config(tmp_path, reward={"functions": ["no_such_module_xyz:f"]})
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        build.check_before_models(cfg)
    build.check_before_models(cfg, [lambda _p, c: [0.0] * len(c), "answer_correctness"])  # objects pass


def test_optimizer_steps_is_the_schedules_horizon(tmp_path):
    # steps x ppo_epochs x num_minibatches = 3 x 2 x 4 = 24; 0 steps still give a horizon of 1.
    assert (
        build.optimizer_steps(_config(tmp_path, steps=3, optim={"ppo_epochs": 2, "num_minibatches": 4})) == 24
    )
    assert build.optimizer_steps(_config(tmp_path, steps=0)) == 1


def test_policy_optimizer_trains_only_trainable_parameters_on_the_schedule(tmp_path):
    cfg = _config(
        tmp_path,
        steps=4,
        optim={
            "lr": 0.5,
            "warmup_steps": 2,
            "schedule": "linear",
            "weight_decay": 0.25,
            "max_grad_norm": 3.0,
        },
    )
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    net[0].requires_grad_(False)
    optimizer, scheduler, step = build.policy_optimizer(
        cfg, net, device=torch.device("cpu"), strategy=Single(Dist())
    )
    assert isinstance(step, OptimizerStep) and step.optimizer is optimizer and step.scheduler is scheduler
    trained = optimizer.param_groups[0]["params"]
    assert len(trained) == 2 and all(p.requires_grad for p in trained) and step.params == trained
    assert optimizer.param_groups[0]["weight_decay"] == 0.25 and step.max_grad_norm == 3.0
    # warmup factor (0 + 1) / 2 at the first step: lr 0.25; then 1.0 at step 1 (lr 0.5).
    assert scheduler.get_last_lr() == [0.25]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5]


def test_kl_controller_fixed_or_adaptive(tmp_path):
    fixed = build.build_kl_controller(_config(tmp_path, kl={"placement": "loss", "beta": 0.04}))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.04
    cfg = _config(
        tmp_path,
        kl={"placement": "reward", "beta": 0.1, "controller": "adaptive", "target": 2.0, "horizon": 50.0},
    )
    adaptive = build.build_kl_controller(cfg)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.1


def test_build_objective_carries_the_configs_choices(tmp_path):
    cfg = _config(
        tmp_path,
        kl={"placement": "loss", "beta": 0.04},
        loss={"entropy_coef": 0.01},
        rollout={"max_new_tokens": 17},
    )
    obj = build.build_objective(cfg, cfg.kl_placement)
    assert obj.policy_loss is get_policy_loss(cfg.policy_loss_name)
    assert obj.max_len == 17 and obj.entropy_coef == 0.01 and obj.agg_mode == cfg.agg_mode
    assert obj.kl is cfg.kl_placement and obj.kl_kind == cfg.kl.resolved_kind()
    assert obj.loss_options == cfg.loss_options
    assert obj.is_level is None  # rollout.is_correction "none" turns the correction off


@pytest.mark.parametrize(
    ("sections", "skip"),
    [
        ({}, True),
        ({"optim": {"skip_zero_advantage_rows": False}}, False),
        ({"loss": {"entropy_target": 0.2}}, False),  # the controller reads every row's entropy
    ],
)
def test_policy_step_skips_rows_without_gradient_unless_told_or_the_entropy_controller_reads_them(
    tmp_path, sections, skip
):
    cfg = _config(tmp_path, **sections)
    step = build.build_policy_step(
        cfg, None, None, None, ptx=None, device=torch.device("cpu"), strategy=None, precision=None
    )
    assert step.skip_zero_advantage is skip


def test_no_ptx_stream_without_a_coefficient(tmp_path):
    assert build.build_ptx(_config(tmp_path), tokenizer=None) is None


def test_vllm_auto_dtype_follows_fp16_mixed_on_cuda_only():
    from policygrad.parallel.precision import Precision

    fp16_cuda = Precision("fp16-mixed", torch.float32, torch.float16, "cuda", loss_scaling=True)
    fp16_cpu = Precision("fp16-mixed", torch.float32, torch.float16, "cpu", loss_scaling=True)
    bf16_cuda = Precision("bf16-mixed", torch.float32, torch.bfloat16, "cuda")
    assert build.vllm_auto_dtype(torch.bfloat16, fp16_cuda) == "float16"
    # Everything else keeps model.dtype, as before fp16-mixed existed.
    assert build.vllm_auto_dtype(torch.float32, fp16_cpu) == "float32"
    assert build.vllm_auto_dtype(torch.bfloat16, bf16_cuda) == "bfloat16"
    assert build.vllm_auto_dtype(torch.bfloat16, None) == "bfloat16"
