"""Set-up of a run, split by concern: the rollout engine, the scorer, the critic and the
optimizers (the models: :mod:`policygrad.trainer.models`). Each builder takes the validated
config and returns ready objects; :func:`~policygrad.trainer.factory.build_trainer` calls them
in a fixed order (which fixes the random streams a run consumes at start)."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import asdict

import torch

from policygrad.config.agent import episode_fields
from policygrad.config.checks import parse_cpus
from policygrad.config.train import ConfigError, TrainConfig
from policygrad.core.kl import AdaptiveKLController, FixedKLController
from policygrad.core.losses import get_policy_loss
from policygrad.data.ptx import PtxData
from policygrad.envs.agent import agent_factory
from policygrad.envs.episodes import EpisodeLimits, EpisodeRunner
from policygrad.envs.registry import check_environment_spec, environment_factory
from policygrad.learn.critic import CriticTrainer
from policygrad.learn.objective import PolicyObjective
from policygrad.learn.optim import OptimizerStep, lr_schedule, make_adamw
from policygrad.learn.update import PolicyStep
from policygrad.models.value import load_value_model
from policygrad.parallel.precision import Precision
from policygrad.rewards.code import configure_code_rewards
from policygrad.rewards.isolation import isolate_reward_functions
from policygrad.rewards.normalize import RewardNormalizer
from policygrad.rewards.registry import CompositeReward, check_reward_spec
from policygrad.rewards.reward_model import resolve_reward_functions
from policygrad.rewards.scoring import Scorer
from policygrad.rollout.hf import HFRolloutEngine
from policygrad.rollout.server import start_server_engine
from policygrad.rollout.vllm import VLLMRolloutEngine, VLLMStartError
from policygrad.trainer.models import Models

__all__ = [
    "build_critic",
    "build_engine",
    "build_kl_controller",
    "build_objective",
    "build_policy_step",
    "build_ptx",
    "build_scorer",
    "policy_optimizer",
    "resolve_dtype",
    "seed_everything",
    "vllm_auto_dtype",
]

log = logging.getLogger("policygrad")


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch from one integer."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        # numpy is seeded where it is installed (not a dependency of its own)
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


def engine_context(model, wanted: int) -> int:
    """``wanted`` (longest prompt + new tokens) capped at the model's ``max_position_embeddings``:
    longer prompts are refused by the engine itself, naming ``max_new_tokens``."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted


def _response_room(cfg: TrainConfig) -> int:
    """The most tokens after a prompt: ``max_new_tokens``; an episode's actions and observations
    (``max_episode_tokens``, else as many as the model's context holds)."""
    r = cfg.rollout
    if not cfg.env.name:
        return r.max_new_tokens
    return r.max_episode_tokens if r.max_episode_tokens is not None else 1 << 30


def check_before_models(cfg: TrainConfig, functions=None, environment=None) -> None:
    """What a run checks before it reads (or converts) any model: the engine's choice, the
    reward-function specs (``functions``: the objects given instead of ``reward.functions``) and
    the environment's spec (``environment``: the object given instead of ``env.name``).

    Raises:
        ConfigError / ValueError / FileNotFoundError: naming the field.
    """
    resolve_engine(cfg)
    for spec in cfg.reward.functions if functions is None else functions:
        check_reward_spec(spec)
    agent = cfg.agent.function
    if agent is not None and environment is None:
        if agent.startswith("<"):
            raise ConfigError(
                f"agent.function={agent!r} records a function that cannot be imported; pass it again "
                "(policygrad.train(agent=...)), or make it importable as module:function"
            )
        check_environment_spec(agent, "agent.function")
        # Loaded once now (in a worker with env_isolation), so a wrong name shows before a model loads.
        r = cfg.rollout
        options = {"isolation": r.env_isolation, "timeout_s": r.env_step_timeout_s}
        agent_factory(cfg.env.name, cfg.env.options, **options)
    elif cfg.env.name and environment is None:
        if cfg.env.name.startswith("<"):
            raise ConfigError(
                f"env.name={cfg.env.name!r} records an environment object that cannot be imported; pass "
                "it again (policygrad.train(env=...)), or make it importable as module:Class"
            )
        check_environment_spec(cfg.env.name)
    if environment is not None:
        check_environment_spec(environment)


def engine_context_limit(engine, policy) -> int | None:
    """The most tokens (prompt and everything after it) ``engine`` takes: vLLM's
    ``max_model_len``, else ``policy``'s ``max_position_embeddings`` (None: unknown)."""
    limit = getattr(engine, "max_model_len", None)
    if limit is None:
        config = getattr(policy, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        limit = getattr(text, "max_position_embeddings", None)
    return int(limit) if limit is not None else None


def build_environment(cfg: TrainConfig, engine, tokenizer, policy, *, environment=None):
    """The :class:`~policygrad.envs.episodes.EpisodeRunner` of ``env`` (None without one):
    ``environment`` (an Environment class or factory) instead of ``env.name``, the episode limits
    of ``rollout``, the engine's end and pad ids and context (:func:`engine_context_limit`).

    Raises:
        ValueError / TypeError: the environment cannot be built with ``env.options``.
        TemplateError: the tokenizer's chat template cannot be extended (names data.chat_template).
    """
    if not cfg.env.name and environment is None:
        return None
    r = cfg.rollout
    limits = EpisodeLimits(
        max_turns=r.max_turns,
        max_new_tokens=r.max_new_tokens,
        max_episode_tokens=r.max_episode_tokens,
        max_observation_tokens=r.max_observation_tokens,
        max_context=engine_context_limit(engine, policy),
        step_timeout_s=r.env_step_timeout_s,
        workers=r.env_workers,
        retries=r.env_retries,
        isolation=r.env_isolation,
        timeout_field=episode_fields(cfg)["timeout"],
    )
    factory = agent_factory if cfg.agent.function is not None else environment_factory
    return EpisodeRunner(
        factory(
            cfg.env.name if environment is None else environment,
            cfg.env.options,
            isolation=r.env_isolation,
            timeout_s=r.env_step_timeout_s,
        ),
        engine,
        tokenizer,
        limits,
        end_ids=engine.eos_token_ids,
        pad_id=engine.pad_token_id,
        system_prompt=cfg.data.system_prompt,
        max_prompt_length=cfg.data.max_prompt_length,
    )


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


def build_engine(
    cfg: TrainConfig,
    models: Models,
    *,
    dtype: torch.dtype,
    quiet: bool = False,
    precision: Precision | None = None,
    shares_policy_weights: bool = True,
    cpu_threads: int | None = None,
    engine_option: str = "rollout.engine",
    dist=None,
):
    """The rollout engine ``rollout.engine`` names (``auto`` resolved), with the reason logged
    (at debug level when ``quiet``: ``policygrad eval`` reports the engine in its result).

    The hf engine samples with ``models.policy`` under ``precision``'s autocast;
    ``shares_policy_weights`` False when that is a copy of the trained policy (FSDP).
    ``cpu_threads``: the vllm engine's ``cpu_threads`` (the start-time thread count when the run
    adapted it below torch's default; None: vLLM's worker binds every allowed CPU).
    ``engine_option``: how the caller's user chose the engine (``--engine`` for ``policygrad
    eval``), named in the error of a vLLM that cannot run the model. ``dist``: the run's
    :class:`~policygrad.parallel.distributed.Dist` (the server engine: rank 0 starts servers and
    pushes weights; None: one process).

    Returns:
        ``(engine, name)``.

    Raises:
        ConfigError: ``rollout.dtype`` set while ``auto`` resolved to the hf engine; vLLM refused
            to start on the model (names ``engine_option`` and the hf engine).
    """
    name, why = resolve_engine(cfg)
    log.log(logging.DEBUG if quiet else logging.INFO, "rollout engine: %s (%s)", name, why)
    if name == "server":
        return build_server_engine(cfg, models, dtype=dtype, precision=precision, dist=dist), name
    if name != "vllm":
        engine = HFRolloutEngine(
            models.policy,
            models.tokenizer,
            models.eos_ids,
            shares_policy_weights=shares_policy_weights,
            autocast=precision.autocast if precision is not None else None,
            copies_weights=not shares_policy_weights,  # FSDP's unsharded copy, or the copy of rollouts ahead
        )
        return engine, name
    r = cfg.rollout
    try:
        engine = VLLMRolloutEngine(
            models.model_path,
            models.tokenizer,
            models.eos_ids,
            dtype=r.dtype if r.dtype != "auto" else vllm_auto_dtype(dtype, precision),
            seed=cfg.seed,
            max_model_len=engine_context(models.policy, cfg.data.max_prompt_length + _response_room(cfg)),
            kv_cache_gb=r.vllm_kv_cache_gb,
            gpu_memory_utilization=r.vllm_gpu_memory_utilization,
            enable_prefix_caching=r.vllm_prefix_caching,
            cpu_threads=cpu_threads,
        )
    except VLLMStartError as err:
        flag = engine_option.startswith("--")
        chosen = f"{engine_option} {r.engine}" if flag else f"{engine_option}={r.engine}"
        hf = f"{engine_option} hf" if flag else f"{engine_option}=hf"
        raise ConfigError(
            f"{chosen} chose the vllm engine{' (vllm is installed)' if r.engine == 'auto' else ''}, which "
            f"cannot run this model: {err}; use {hf}"
        ) from err
    return engine, name


def build_server_engine(cfg: TrainConfig, models: Models, *, dtype, precision, dist=None):
    """``rollout.engine: server``: the servers of ``rollout.servers`` (started here when it is a
    count, logs in ``<output_dir>/servers``). Its ``needs_weights`` until the first push.

    Raises:
        ConfigError: a count of servers under torchrun over several nodes (the run starts them
            on rank 0's node, where the other nodes cannot reach them).
    """
    r = cfg.rollout
    active = dist is not None and dist.active
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if isinstance(r.servers, int) and active and local and local != dist.world_size:
        raise ConfigError(
            f"rollout.servers={r.servers} starts servers on rank 0's node, which the ranks of other nodes "
            "cannot reach; start them with policygrad serve --host 0.0.0.0 and give rollout.servers as URLs"
        )
    return start_server_engine(
        r.servers,
        models.tokenizer,
        models.eos_ids,
        model_path=models.model_path,
        max_model_len=engine_context(models.policy, cfg.data.max_prompt_length + _response_room(cfg)),
        log_dir=os.path.join(cfg.output_dir, "servers"),
        dtype=r.dtype if r.dtype != "auto" else vllm_auto_dtype(dtype, precision),
        timeout_s=r.server_timeout_s,
        cpus=[parse_cpus("rollout.server_cpus", c) for c in r.server_cpus] if r.server_cpus else None,
        gpus=[str(g) for g in r.server_gpus] if r.server_gpus else None,
        kv_cache_gb=r.vllm_kv_cache_gb,
        prefix_caching=r.vllm_prefix_caching,
        gpu_memory_utilization=r.vllm_gpu_memory_utilization,
        seed=cfg.seed,
        share=dist.broadcast_object if active else None,
        sender=not active or dist.rank == 0,
    )  # no weights pushed yet: the factory pushes the policy's (needs_weights)


def vllm_auto_dtype(dtype: torch.dtype, precision: Precision | None) -> str:
    """``rollout.dtype: auto`` for vLLM: ``float16`` when the policy trains in ``fp16-mixed`` on
    CUDA (the sampler then rounds as the trainer's fp16 compute does: Qi et al. 2025 run both
    sides in fp16), else ``model.dtype`` resolved (``dtype``), as before ``fp16-mixed`` existed."""
    if precision is not None and precision.name == "fp16-mixed" and precision.device_type == "cuda":
        return "float16"
    return str(dtype).removeprefix("torch.")


def build_scorer(cfg: TrainConfig, *, device: torch.device, dtype: torch.dtype, functions=None, reduce=None):
    """The reward functions (reward models loaded), the score normaliser and the truncation
    policy, as one :class:`~policygrad.rewards.scoring.Scorer`. ``reduce``: None, or the
    data-parallel sum over ranks of the normaliser's running statistics.

    ``functions``: the reward functions as objects (callables, sync or async, or specs) to use
    instead of ``reward.functions``, which then holds how the config records them."""
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
            CompositeReward(list(zip(functions, weights)), on_error=rw.on_error) if functions else None,
            RewardNormalizer(rw.normalize, clip=rw.normalize_clip, reduce=reduce),
            truncation=rw.truncation,
            truncation_penalty=rw.truncation_penalty,
            worker=worker,
        )
    except BaseException:
        if worker is not None:
            worker.close()
        raise


def build_critic(
    cfg: TrainConfig, *, model_path: str, device: torch.device, checkpoint, strategy, precision: Precision
):
    """The value model and its :class:`~policygrad.learn.critic.CriticTrainer` (None without a
    critic), parameters in the precision's dtype. ``strategy.prepare_critic(critic)`` runs after
    the checkpoint weights load and before the optimizer is built on the parameters (FSDP
    sharding)."""
    if not cfg.uses_critic:
        return None
    c = cfg.critic
    try:
        critic = load_value_model(
            c.init_from,
            policy_path=model_path,
            dtype=precision.param_dtype,
            lora_rank=c.lora.rank,
            lora_alpha=c.lora.alpha,
            lora_dropout=c.lora.dropout,
            lora_target_modules=c.lora.target_modules,
            gradient_checkpointing=cfg.model.gradient_checkpointing is True,  # auto: see trainer.recompute
            device=device,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    except (ValueError, OSError) as exc:
        # The loaders word a bad folder as "model: ..." (they load model.name too): here it is
        # the critic's own field that names it.
        text = str(exc).strip()
        if c.init_from == "policy" or not text.startswith("model"):
            raise
        text = text.removeprefix("model:").removeprefix("model").strip()
        raise ConfigError(f"critic.init_from={c.init_from!r}: {text}") from exc
    if checkpoint is not None:
        critic.load(os.path.join(checkpoint, "critic"))
    strategy.prepare_critic(critic)
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
        strategy=strategy,
        precision=precision,
    )


def optimizer_steps(cfg: TrainConfig) -> int:
    """Optimizer steps of the whole run (the schedules' horizon)."""
    return max(1, cfg.steps * cfg.optim.ppo_epochs * cfg.optim.num_minibatches)


def policy_optimizer(cfg: TrainConfig, policy, *, device: torch.device, strategy, scaler=None):
    """The policy's AdamW, its schedule and the :class:`~policygrad.learn.optim.OptimizerStep`
    (``scaler``: fp16-mixed's ``torch.amp.GradScaler``, or None)."""
    o = cfg.optim
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = make_adamw(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(o, optimizer_steps(cfg)))
    return (
        optimizer,
        scheduler,
        OptimizerStep(
            optimizer,
            scheduler,
            params,
            max_grad_norm=o.max_grad_norm,
            device=device,
            strategy=strategy,
            scaler=scaler,
        ),
    )


def build_ptx(cfg: TrainConfig, tokenizer):
    """The PPO-ptx text stream (None when ``ptx.coef`` is 0)."""
    p = cfg.ptx
    if p.coef <= 0:
        return None
    return PtxData(p.dataset, tokenizer, field=p.text_field, max_length=p.max_length, batch_size=p.batch_size)


def build_objective(cfg: TrainConfig, kl):
    """The :class:`~policygrad.learn.objective.PolicyObjective` of the config: the registered
    policy loss with only the options the user set, the aggregation, the KL placement's loss term,
    the entropy bonus and the truncated importance correction."""
    r = cfg.rollout
    return PolicyObjective(
        get_policy_loss(cfg.policy_loss_name),
        cfg.loss_options,
        agg_mode=cfg.agg_mode,
        max_len=r.max_new_tokens * (r.max_turns if cfg.env.name else 1),  # the most action tokens
        kl=kl,
        kl_kind=cfg.kl.resolved_kind(),
        kl_importance_weighted=cfg.kl.importance_weighted,
        entropy_coef=cfg.loss.entropy_coef,
        is_level=None if r.resolved_is_correction() == "none" else r.resolved_is_correction(),
        is_cap=r.is_cap,
        is_mode=r.is_mode,
        is_floor=r.is_floor,
        positive_lm_coef=cfg.loss.positive_lm_coef,
    )


def build_policy_step(
    cfg: TrainConfig, policy, objective, optimizer_step, *, ptx, device: torch.device, strategy, precision
):
    """The :class:`~policygrad.learn.update.PolicyStep` run on every minibatch."""
    return PolicyStep(
        policy,
        objective,
        optimizer_step,
        strategy=strategy,
        precision=precision,
        micro_batch_size=cfg.optim.micro_batch_size,
        target_kl=cfg.optim.target_kl,
        ptx=ptx,
        ptx_coef=cfg.ptx.coef,
        # the adaptive entropy controller reads the entropy of every row
        skip_zero_advantage=cfg.optim.skip_zero_advantage_rows and cfg.loss.entropy_target is None,
        device=device,
    )


def build_kl_controller(cfg: TrainConfig):
    """``kl.controller``: a fixed beta, or the adaptive controller of Ziegler et al. 2019."""
    k = cfg.kl
    if k.controller == "adaptive":
        return AdaptiveKLController(k.beta, k.target, k.horizon)
    return FixedKLController(k.beta)
