"""Set-up of a run, split by concern: the models, the rollout engine, the scorer, the critic and
the optimizers. Each builder takes the validated config and returns ready objects; the
:class:`~policygrad.trainer.loop.Trainer` calls them in a fixed order (which fixes the random
streams a run consumes at start)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import random
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

import torch

from policygrad.trainer.config import ConfigError, TrainConfig

__all__ = [
    "Models",
    "adopt_model",
    "build_critic",
    "build_engine",
    "build_kl_controller",
    "build_models",
    "build_objective",
    "build_policy_step",
    "build_ptx",
    "build_scorer",
    "load_eval_models",
    "policy_optimizer",
    "record_model_object",
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
    """The policy (trainable), the tokenizer, end-of-sequence ids, and the reference: a frozen
    model (``reference``), or the policy itself inside ``policy_as_reference()`` (LoRA: the base
    under ``disable_adapter``; a run started from a trained adapter: that adapter's starting
    weights), or neither without a KL.

    ``model_path`` is the folder an engine or critic loads the architecture (and, unless
    ``weights_differ_from_path``, the weights) from."""

    model_path: str
    tokenizer: object
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    eos_ids: list[int]
    policy_as_reference: Callable[[], AbstractContextManager] | None = None
    weights_differ_from_path: bool = False


def build_models(
    cfg: TrainConfig,
    *,
    device: torch.device,
    dtype: torch.dtype,
    checkpoint: str | None,
    model=None,
    tokenizer=None,
    run_dir: str | None = None,
    policy_dtype: torch.dtype | None = None,
) -> Models:
    """Load the policy (a trained adapter to start from, LoRA, memory-efficient MLPs, checkpoint
    weights, gradient checkpointing) and, when the KL placement needs one, the reference: the
    starting policy, frozen. The policy's parameters and the reference's are ``policy_dtype``
    (the precision's: float32 unless bf16-pure; None: ``dtype``): the reference runs under the
    policy's autocast, so two copies of the starting weights compute the same log-probs and
    the KL is exactly 0 before the first update (a bf16 reference next to float32 master
    weights gave a KL of ~6e-3 at step 0).

    Args:
        cfg: the run's config (``model`` section).
        model, tokenizer: a loaded transformers model (or peft model) to train instead of
            ``model.name``, and its tokenizer (None: read from the model's folder). The model is
            trained in place; without a local folder of its own it is written to
            ``run_dir/start_model`` for engines and critics that load from a folder.
        checkpoint: a checkpoint folder whose policy weights are loaded (resume).

    Raises:
        ConfigError: ``model.lora.rank`` set for a run that starts from an adapter.
        ValueError / OSError: as :func:`policygrad.models.adapters.resolve_model_source`.
    """
    from policygrad.models.adapters import FrozenStart, is_peft_model, load_model, resolve_model_source
    from policygrad.models.loading import apply_lora, eos_token_ids, load_tokenizer
    from policygrad.models.swiglu import use_memory_efficient_mlp
    from policygrad.trainer.checkpoint import load_policy_weights

    trained = policy_dtype or dtype
    source = None
    if model is None:
        source = resolve_model_source(cfg.model.name, cfg.model.adapter)
        trust = cfg.model.trust_remote_code  # False: a model folder's own code never runs, never asks
        tokenizer = load_tokenizer(source.tokenizer, trust_remote_code=trust)
        policy = load_model(source, dtype=trained, trainable=True, trust_remote_code=trust).to(device)
        model_path = source.base
    else:
        policy, tokenizer, model_path = adopt_model(model, tokenizer, dtype=trained, run_dir=run_dir)
        policy = policy.to(device)
    from_adapter = is_peft_model(policy)
    lora = cfg.model.lora
    if from_adapter and lora.rank > 0:
        raise ConfigError(
            f"model.lora.rank={lora.rank}: this run starts from a trained adapter and trains it (its own "
            "rank and targets); unset model.lora.rank, or start from a full model"
        )
    start = None
    needs_reference = cfg.kl_placement.needs_reference
    if needs_reference and model is not None and not from_adapter and lora.rank == 0:
        start = copy.deepcopy(policy)  # an object the caller passed: its starting weights, frozen
    elif from_adapter and needs_reference:
        start = FrozenStart(policy)  # before any checkpoint weights load
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
    reference, as_reference = None, None
    if isinstance(start, FrozenStart):
        as_reference = start.active
    elif isinstance(start, torch.nn.Module):
        reference = start.eval().requires_grad_(False)
    elif needs_reference and lora.rank > 0:
        as_reference = policy.disable_adapter  # LoRA: the base weights are the starting policy
    elif needs_reference:
        reference = load_model(
            source, dtype=trained, trainable=False, trust_remote_code=cfg.model.trust_remote_code
        ).to(device)
    differ = from_adapter or model is not None
    return Models(
        model_path, tokenizer, policy, reference, eos_token_ids(tokenizer, policy), as_reference, differ
    )


def load_eval_models(cfg: TrainConfig, *, device: torch.device, dtype: torch.dtype) -> Models:
    """The model of ``model.name`` / ``model.adapter`` for evaluation only: frozen, in eval mode,
    a LoRA adapter merged into the weights (plain generation speed).

    Raises:
        ValueError / OSError: as :func:`policygrad.models.adapters.resolve_model_source`.
    """
    from policygrad.models.adapters import load_model, merged_model, resolve_model_source
    from policygrad.models.loading import eos_token_ids, load_tokenizer

    source = resolve_model_source(cfg.model.name, cfg.model.adapter)
    trust = cfg.model.trust_remote_code
    tokenizer = load_tokenizer(source.tokenizer, trust_remote_code=trust)
    policy = merged_model(load_model(source, dtype=dtype, trainable=False, trust_remote_code=trust))
    policy = policy.to(device)
    policy.requires_grad_(False)
    return Models(
        source.base, tokenizer, policy, None, eos_token_ids(tokenizer, policy),
        weights_differ_from_path=source.adapter is not None,
    )


def record_model_object(cfg: TrainConfig, model) -> TrainConfig:
    """``cfg`` with ``model.name`` naming ``model``, a loaded model the run trains instead of
    loading one (:func:`~policygrad.models.adapters.describe_model`), so ``config.yaml`` records
    what was trained. The default ``model.name`` is replaced; the same folder is kept.

    Raises:
        ConfigError: ``model.name`` names another model (a resume from this config would load it).
    """
    from policygrad.models.adapters import describe_model
    from policygrad.trainer.config import ModelConfig

    named = describe_model(model)
    name = cfg.model.name
    same = name == named or (
        not named.startswith("<") and os.path.realpath(os.path.expanduser(name)) == os.path.realpath(named)
    )
    if same:
        return cfg
    if name != ModelConfig().name:
        raise ConfigError(
            f"model.name={name!r} names another model than the model object the run trains ({named}); "
            "config.yaml would record the wrong model for --resume: leave model.name unset, or set it to "
            f"{named!r}"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=named))


def adopt_model(model, tokenizer, *, dtype: torch.dtype, run_dir: str | None):
    """A caller's loaded model made ready to train (dropout off, no KV cache, train mode, every
    parameter trainable unless it is a peft model, whose adapter alone trains; cast to ``dtype``
    when its floating-point parameters differ), its tokenizer (a copy, padded on the left) and the
    folder engines load its architecture from.

    Returns:
        ``(model, tokenizer, folder)``.

    Raises:
        TypeError: ``model`` is not a torch module with a transformers config.
        ValueError: no tokenizer given and none in the model's folder.
    """
    from policygrad.models.adapters import is_peft_model
    from policygrad.models.loading import disable_dropout, load_tokenizer, prepare_tokenizer

    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(
            f"model must be a transformers model (or a peft model around one), got {type(model).__name__}"
        )
    peft = is_peft_model(model)
    base = model.get_base_model() if peft else model
    folder = getattr(base, "name_or_path", "") or ""
    local = bool(folder) and os.path.isfile(os.path.join(os.path.expanduser(folder), "config.json"))
    if tokenizer is None:
        if not local:
            raise ValueError(
                "tokenizer: the model has no local folder to read its tokenizer from; pass tokenizer="
            )
        tokenizer = load_tokenizer(folder)
    else:
        tokenizer = prepare_tokenizer(copy.deepcopy(tokenizer))
    if any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        model = model.to(dtype)
    disable_dropout(model)
    base.config.use_cache = False
    model.train()
    if not peft:
        model.requires_grad_(True)
    if not local:
        if run_dir is None:
            raise ValueError("the model has no local folder; give run_dir to write one")
        from policygrad.models.adapters import merged_weights

        folder = os.path.join(run_dir, "start_model")
        state = dict(merged_weights(model)) if peft else None  # plain names an engine can load
        base.save_pretrained(folder, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    return model, tokenizer, os.path.expanduser(folder)


def engine_context(model, wanted: int) -> int:
    """``wanted`` (longest prompt + new tokens) capped at the model's ``max_position_embeddings``:
    longer prompts are refused by the engine itself, naming ``max_new_tokens``."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted


def check_before_models(cfg: TrainConfig, functions=None) -> None:
    """What a run checks before it reads (or converts) any model: the engine's choice and the
    reward-function specs (``functions``: the objects given instead of ``reward.functions``).

    Raises:
        ConfigError / ValueError / FileNotFoundError: naming the field.
    """
    from policygrad.rewards.registry import check_reward_spec

    resolve_engine(cfg)
    for spec in cfg.reward.functions if functions is None else functions:
        check_reward_spec(spec)


def resolve_engine(cfg: TrainConfig) -> tuple[str, str]:
    """``(name, why)`` of the engine ``rollout.engine`` names (``auto`` resolved), checked against
    the options only vLLM takes; needs no model, so a run refuses a bad choice before loading one.

    Raises:
        ConfigError: ``rollout.dtype`` set while ``auto`` resolved to the hf engine.
    """
    name, why = cfg.rollout.resolved_engine()
    if name == "hf" and cfg.rollout.dtype != "auto":
        raise ConfigError(
            f"rollout.dtype={cfg.rollout.dtype!r} needs the vllm engine, but rollout.engine=auto "
            "resolved to hf (vllm is not installed); install the vllm extra or set rollout.dtype=auto"
        )
    return name, why


def build_engine(cfg: TrainConfig, models: Models, *, dtype: torch.dtype, quiet: bool = False):
    """The rollout engine ``rollout.engine`` names (``auto`` resolved), with the reason logged
    (at debug level when ``quiet``: ``policygrad eval`` reports the engine in its result).

    Returns:
        ``(engine, name)``.

    Raises:
        ConfigError: ``rollout.dtype`` set while ``auto`` resolved to the hf engine.
    """
    from policygrad.rollout.hf import HFRolloutEngine

    name, why = resolve_engine(cfg)
    log.log(logging.DEBUG if quiet else logging.INFO, "rollout engine: %s (%s)", name, why)
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


def build_scorer(cfg: TrainConfig, *, device: torch.device, dtype: torch.dtype, functions=None):
    """The reward functions (reward models loaded), the score normaliser and the truncation
    policy, as one :class:`~policygrad.rewards.scoring.Scorer`.

    ``functions``: the reward functions as objects (callables, sync or async, or specs) to use
    instead of ``reward.functions``, which then holds how the config records them."""
    from policygrad.rewards.code import configure_code_rewards
    from policygrad.rewards.isolation import isolate_reward_functions
    from policygrad.rewards.normalize import RewardNormalizer
    from policygrad.rewards.registry import CompositeReward
    from policygrad.rewards.reward_model import resolve_reward_functions
    from policygrad.rewards.scoring import Scorer

    rw = cfg.reward
    weights = rw.weights or [1.0] * len(rw.functions)
    functions = resolve_reward_functions(
        rw.functions if functions is None else functions,
        dtype=dtype,
        device=device,
        batch_size=rw.model_batch_size,
        max_length=rw.model_max_length,
        use_chat_template=rw.model_chat_template,
    )
    # code_tests gets the run's sandbox (reward.code); building it checks and logs the isolation.
    functions = configure_code_rewards(functions, asdict(rw.code))
    # User code (module:function, file.py:function, callables) is contained; see rewards.isolation.
    functions, worker = isolate_reward_functions(functions, isolation=rw.isolation, timeout_s=rw.timeout_s)
    try:
        return Scorer(
            CompositeReward(list(zip(functions, weights)), on_error=rw.on_error),
            RewardNormalizer(rw.normalize, clip=rw.normalize_clip),
            truncation=rw.truncation,
            truncation_penalty=rw.truncation_penalty,
            worker=worker,
        )
    except BaseException:
        if worker is not None:
            worker.close()
        raise


def build_critic(
    cfg: TrainConfig, *, model_path: str, device: torch.device, dtype: torch.dtype, checkpoint, prepare=None
):
    """The value model and its :class:`~policygrad.trainer.critic.CriticTrainer` (None without a
    critic). ``prepare(critic)``, when given, runs after the checkpoint weights load and before
    the optimizer is built on the parameters (FSDP sharding)."""
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
        trust_remote_code=cfg.model.trust_remote_code,
    )
    if checkpoint is not None:
        critic.load(os.path.join(checkpoint, "critic"))
    if prepare is not None:
        prepare(critic)
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
