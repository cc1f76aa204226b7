"""Set-up of a run, split by concern: the models, the rollout engine, the scorer, the critic and
the optimizers. Each builder takes the validated config and returns ready objects; the
:class:`~policygrad.trainer.loop.Trainer` calls them in a fixed order (which fixes the random
streams a run consumes at start)."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass

import torch

from policygrad.trainer.config import ConfigError, TrainConfig

__all__ = [
    "Models",
    "build_critic",
    "build_engine",
    "build_kl_controller",
    "build_models",
    "build_objective",
    "build_policy_step",
    "build_ptx",
    "build_scorer",
    "policy_optimizer",
    "resolve_dtype",
    "seed_everything",
]

log = logging.getLogger("policygrad")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch from one integer."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (bf16 matmul is slower than fp32 on CPUs without AMX or
    AVX512-BF16, measured 4x slower on the reference machine), bfloat16 on CUDA."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class Models:
    """The policy (trainable), the frozen reference (None without a KL, or with LoRA: the base
    weights under ``disable_adapter`` are the reference), the tokenizer and end-of-sequence ids."""

    model_path: str
    tokenizer: object
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    eos_ids: list[int]


def build_models(
    cfg: TrainConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    checkpoint: str | None,
    policy_dtype: torch.dtype | None = None,
) -> Models:
    """Load the policy (LoRA, memory-efficient MLPs, checkpoint weights, gradient checkpointing)
    and, when the KL placement needs one, the reference (always the base model). The policy's
    parameters are ``policy_dtype`` (the precision's, float32 unless bf16-pure; None: ``dtype``),
    the frozen reference's ``dtype``."""
    from policygrad.models.loading import (
        apply_lora,
        eos_token_ids,
        load_causal_lm,
        load_tokenizer,
        resolve_model_path,
    )
    from policygrad.models.swiglu import use_memory_efficient_mlp
    from policygrad.trainer.checkpoint import load_policy_weights

    model_path = resolve_model_path(cfg.model.name)
    tokenizer = load_tokenizer(model_path)
    policy = load_causal_lm(model_path, dtype=policy_dtype or dtype).to(device)
    lora = cfg.model.lora
    if lora.rank > 0:
        policy = apply_lora(
            policy, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules
        )
    # SwiGLU MLPs and RMSNorms that save their inputs only and recompute the rest in the backward:
    # ~a third less activation memory, same result. After LoRA, so adapted projections keep their adapters.
    use_memory_efficient_mlp(policy)
    if checkpoint is not None:
        load_policy_weights(policy, os.path.join(checkpoint, "model"))
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable()
    reference = None
    if cfg.kl_placement.needs_reference and lora.rank == 0:
        reference = load_causal_lm(model_path, dtype=dtype, trainable=False).to(device)
    return Models(model_path, tokenizer, policy, reference, eos_token_ids(tokenizer, policy))


def engine_context(model, wanted: int) -> int:
    """``wanted`` (longest prompt + new tokens) capped at the model's ``max_position_embeddings``:
    longer prompts are refused by the engine itself, naming ``max_new_tokens``."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted


def build_engine(cfg: TrainConfig, models: Models, *, dtype: torch.dtype):
    """The rollout engine ``rollout.engine`` names (``auto`` resolved), with the reason logged.

    Returns:
        ``(engine, name)``.

    Raises:
        ConfigError: ``rollout.dtype`` set while ``auto`` resolved to the hf engine.
    """
    from policygrad.rollout.hf import HFRolloutEngine

    name, why = cfg.rollout.resolved_engine()
    if name == "hf" and cfg.rollout.dtype != "auto":
        raise ConfigError(
            f"rollout.dtype={cfg.rollout.dtype!r} needs the vllm engine, but rollout.engine=auto "
            "resolved to hf (vllm is not installed); install the vllm extra or set rollout.dtype=auto"
        )
    log.info("rollout engine: %s (%s)", name, why)
    if name != "vllm":
        return HFRolloutEngine(models.policy, models.tokenizer, models.eos_ids), name
    from policygrad.rollout.vllm import VLLMRolloutEngine

    r = cfg.rollout
    engine = VLLMRolloutEngine(
        models.model_path,
        models.tokenizer,
        models.eos_ids,
        dtype=r.dtype if r.dtype != "auto" else str(dtype).removeprefix("torch."),
        seed=cfg.seed,
        max_model_len=engine_context(models.policy, cfg.data.max_prompt_length + r.max_new_tokens),
        kv_cache_gb=r.vllm_kv_cache_gb,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        enable_prefix_caching=r.vllm_prefix_caching,
    )
    return engine, name


def build_scorer(cfg: TrainConfig, *, device: torch.device, dtype: torch.dtype):
    """The reward functions (reward models loaded), the score normaliser and the truncation
    policy, as one :class:`~policygrad.rewards.scoring.Scorer`."""
    from policygrad.rewards.normalize import RewardNormalizer
    from policygrad.rewards.registry import CompositeReward
    from policygrad.rewards.reward_model import resolve_reward_functions
    from policygrad.rewards.scoring import Scorer

    rw = cfg.reward
    weights = rw.weights or [1.0] * len(rw.functions)
    functions = resolve_reward_functions(
        rw.functions,
        dtype=dtype,
        device=device,
        batch_size=rw.model_batch_size,
        max_length=rw.model_max_length,
        use_chat_template=rw.model_chat_template,
    )
    return Scorer(
        CompositeReward(list(zip(functions, weights)), on_error=rw.on_error),
        RewardNormalizer(rw.normalize, clip=rw.normalize_clip),
        truncation=rw.truncation,
        truncation_penalty=rw.truncation_penalty,
    )


def build_critic(cfg: TrainConfig, *, model_path: str, device: torch.device, dtype: torch.dtype, checkpoint):
    """The value model and its :class:`~policygrad.trainer.critic.CriticTrainer` (None without a critic)."""
    if not cfg.uses_critic:
        return None
    from policygrad.models.value import load_value_model
    from policygrad.trainer.critic import CriticTrainer
    from policygrad.trainer.optim import lr_schedule

    c = cfg.critic
    critic = load_value_model(
        c.init_from,
        policy_path=model_path,
        dtype=dtype,
        lora_rank=c.lora.rank,
        lora_alpha=c.lora.alpha,
        lora_dropout=c.lora.dropout,
        lora_target_modules=c.lora.target_modules,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        device=device,
    )
    if checkpoint is not None:
        critic.load(os.path.join(checkpoint, "critic"))
    return CriticTrainer(
        critic,
        lr=c.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=c.weight_decay,
        max_grad_norm=c.max_grad_norm,
        clip_range=c.clip_range,
        micro_batch_size=c.micro_batch_size or cfg.optim.micro_batch_size,
        lr_lambda=lr_schedule(cfg.optim, optimizer_steps(cfg)),
        device=device,
    )


def optimizer_steps(cfg: TrainConfig) -> int:
    """Optimizer steps of the whole run (the schedules' horizon)."""
    return max(1, cfg.steps * cfg.optim.ppo_epochs * cfg.optim.num_minibatches)


def policy_optimizer(cfg: TrainConfig, policy, *, device: torch.device):
    """The policy's AdamW, its schedule and the :class:`~policygrad.trainer.optim.OptimizerStep`."""
    from policygrad.trainer.optim import OptimizerStep, lr_schedule, make_adamw

    o = cfg.optim
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = make_adamw(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(o, optimizer_steps(cfg)))
    return (
        optimizer,
        scheduler,
        OptimizerStep(optimizer, scheduler, params, max_grad_norm=o.max_grad_norm, device=device),
    )


def build_ptx(cfg: TrainConfig, tokenizer):
    """The PPO-ptx text stream (None when ``ptx.coef`` is 0)."""
    from policygrad.data.ptx import PtxData

    p = cfg.ptx
    if p.coef <= 0:
        return None
    return PtxData(p.dataset, tokenizer, field=p.text_field, max_length=p.max_length, batch_size=p.batch_size)


def build_objective(cfg: TrainConfig, kl):
    """The :class:`~policygrad.trainer.objective.PolicyObjective` of the config: the registered
    policy loss with only the options the user set, the aggregation, the KL placement's loss term,
    the entropy bonus and the truncated importance correction."""
    from policygrad.core.losses import get_policy_loss
    from policygrad.trainer.objective import PolicyObjective

    r = cfg.rollout
    return PolicyObjective(
        get_policy_loss(cfg.policy_loss_name),
        cfg.loss_options,
        agg_mode=cfg.agg_mode,
        max_len=r.max_new_tokens,
        kl=kl,
        kl_kind=cfg.kl.resolved_kind(),
        kl_importance_weighted=cfg.kl.importance_weighted,
        entropy_coef=cfg.loss.entropy_coef,
        is_level=None if r.is_correction == "none" else r.is_correction,
        is_cap=r.is_cap,
        is_mode=r.is_mode,
    )


def build_policy_step(cfg: TrainConfig, policy, objective, optimizer_step, *, ptx, device: torch.device):
    """The :class:`~policygrad.trainer.update.PolicyStep` run on every minibatch."""
    from policygrad.trainer.update import PolicyStep

    r = cfg.rollout
    return PolicyStep(
        policy,
        objective,
        optimizer_step,
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        micro_batch_size=cfg.optim.micro_batch_size,
        target_kl=cfg.optim.target_kl,
        ptx=ptx,
        ptx_coef=cfg.ptx.coef,
        device=device,
    )


def build_kl_controller(cfg: TrainConfig):
    """``kl.controller``: a fixed beta, or the adaptive controller of Ziegler et al. 2019."""
    from policygrad.core.kl import AdaptiveKLController, FixedKLController

    k = cfg.kl
    if k.controller == "adaptive":
        return AdaptiveKLController(k.beta, k.target, k.horizon)
    return FixedKLController(k.beta)
