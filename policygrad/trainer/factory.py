"""A :class:`~policygrad.trainer.loop.Trainer` from a config: :func:`prepare_config` records
the objects a caller passes instead of names, :func:`build_trainer` builds every part in a fixed
order (which fixes the random streams a run consumes at start: the same config and seed build
the same trainer).

Order: what needs no model first (:func:`prepare_config` checks the engine's choice and the
reward-function specs, :func:`build_trainer` starts with the training data), so a bad option or
file is refused before a model is read or converted; then the models, the strategy's sharding,
the engine, the rewards, the critic and the optimizers.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import os

from policygrad.config.checks import read_chat_template
from policygrad.config.train import ConfigError, TrainConfig
from policygrad.config.training import MAX_LOSS_COEF
from policygrad.core.advantages import get_advantage_estimator
from policygrad.core.entropy import AdaptiveEntropyController
from policygrad.data.sources import build_train_source
from policygrad.data.stream import PromptStream
from policygrad.parallel.before_loading import check_before_loading
from policygrad.parallel.distributed import Dist
from policygrad.parallel.precision import resolve_precision, resumed_precision
from policygrad.parallel.recompute import Recompute, pending_state_bytes
from policygrad.parallel.strategy import make_strategy
from policygrad.parallel.threads import ThreadGovernor
from policygrad.produce.inputs import estimator_inputs
from policygrad.produce.producer import DynamicSampling, Producer
from policygrad.produce.rollouts import Rollouts
from policygrad.produce.stages import ProducerParts
from policygrad.rewards.callables import describe_object
from policygrad.rollout.base import SamplingParams
from policygrad.rollout.samplers import EpisodeSampler, SingleTurnSampler
from policygrad.seeds import Seeds
from policygrad.trainer import build
from policygrad.trainer.loop import Trainer
from policygrad.trainer.models import build_models, record_model_object

log = logging.getLogger("policygrad")

__all__ = ["build_entropy_controller", "build_producer", "build_trainer", "prepare_config"]


def prepare_config(
    config: TrainConfig,
    *,
    model=None,
    reward_functions: list | None = None,
    environment=None,
    dist: Dist | None = None,
) -> tuple[TrainConfig, list | None]:
    """``config`` as a run records it, and the reward objects to use.

    A model object is recorded as ``model.name`` (:func:`~policygrad.trainer.models.record_model_object`);
    reward functions given as objects are recorded by import path (``module:qualname``) or a
    placeholder ``<callable NAME (not importable)>``, and the objects without a path are
    returned for the scorer (an ``environment`` object is recorded the same way, as
    ``env.name``); several processes always sample with per-prompt seeds, so
    ``config.yaml`` says so and a resume in one process goes on sampling the same way;
    ``output_dir`` is made absolute (a later ``os.chdir`` cannot move the run). Then what
    needs no model is checked (the engine's choice, the reward-function specs: no user code
    runs), so a bad option or file is refused before a model is read or converted.

    Returns:
        ``(config, reward objects or None)``.

    Raises:
        ConfigError / ValueError / FileNotFoundError: ``model.name`` names another model than
            ``model``; a bad engine choice or reward-function spec (named).
    """
    # Absolute from the start: code that changes the working directory during the run (a reward
    # function run in-process, an environment, a callback) cannot move where it writes.
    if not os.path.isabs(config.output_dir):
        config = dataclasses.replace(config, output_dir=os.path.abspath(config.output_dir))
    if model is not None:
        config = record_model_object(config, model)
    reward_objects = None
    if reward_functions is not None:
        recorded = [describe_object(f) for f in reward_functions]
        reward_objects = [f if r.startswith("<") else r for f, r in zip(reward_functions, recorded)]
        weights = config.reward.weights
        if weights is not None and len(weights) != len(recorded):
            raise ConfigError(
                f"reward.weights has {len(weights)} entries for {len(recorded)} reward functions; give one "
                "weight per function, or none (equal weights)"
            )
        config = dataclasses.replace(config, reward=dataclasses.replace(config.reward, functions=recorded))
    if environment is not None and config.agent.function is None:  # (an agent is recorded as agent.function)
        recorded = describe_object(environment, kind="environment")
        config = dataclasses.replace(config, env=dataclasses.replace(config.env, name=recorded))
    dist = dist or Dist.current()
    if dist.active and not config.rollout.per_prompt_seeds:
        config = dataclasses.replace(
            config, rollout=dataclasses.replace(config.rollout, per_prompt_seeds=True)
        )
    r = config.rollout
    if r.max_staleness > 0 and r.is_correction == "none":
        log.warning(
            "warning: rollout.max_staleness=%d trains on batches sampled by older weights, and "
            "rollout.is_correction=none leaves the lag uncorrected (the clipped ratio is against the "
            "recomputed old log-probs only); the default (auto) weights each token by pi_old / pi_sampler, "
            "capped",
            r.max_staleness,
        )
    build.check_before_models(config, reward_objects, environment)
    return config, reward_objects


def check_entropy_target(cfg: TrainConfig, policy) -> None:
    """``loss.entropy_target`` must be below ln V, the entropy of the uniform distribution over the
    policy's V output tokens and the most any token distribution has: a target at or above it is
    never reached, and the adaptive coefficient would climb every step.

    Raises:
        ConfigError: naming loss.entropy_target and the largest valid value.
    """
    target = cfg.loss.entropy_target
    if target is None:
        return
    head = policy.get_output_embeddings() if hasattr(policy, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    vocab = int(weight.shape[0]) if weight is not None and weight.dim() == 2 else None
    if vocab is None:
        config = getattr(policy, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
    if vocab and target >= math.log(vocab):
        most = math.log(vocab)
        raise ConfigError(
            f"loss.entropy_target={target:g} is not below ln V = {most:.4g} nats, the entropy of the "
            f"uniform distribution over the model's {vocab} tokens and the most a token's distribution can "
            "have: the policy never reaches it and the adaptive coefficient would rise every step; give a "
            f"target below {most:.4g} (Skywork-OR1 uses 0.2)"
        )


def build_trainer(
    cfg: TrainConfig,
    *,
    checkpoint: str | None = None,
    checkpoint_precision: str | None = None,
    engine=None,
    model=None,
    tokenizer=None,
    reward_objects: list | None = None,
    train_source=None,
    environment=None,
) -> Trainer:
    """Every part of a run of ``cfg`` (as :func:`prepare_config` returns it), as a :class:`Trainer`
    at step 0 (a resume then loads the checkpoint's state: :meth:`Trainer.load_state_dict`).

    Args:
        checkpoint: a checkpoint folder whose policy (and critic) weights are loaded.
        checkpoint_precision: the precision its trainer state records (``model.precision=auto``
            keeps it: :func:`~policygrad.parallel.precision.resumed_precision`).
        engine: a rollout engine to use instead of the one ``rollout.engine`` names (its own
            precision: the run's autocast wraps only the engines it builds).
        model, tokenizer: a loaded model to train in place instead of ``model.name``.
        reward_objects: reward functions as objects, instead of ``reward.functions``.
        train_source: the training prompts (an object with ``train_row(i)``) instead of ``data.dataset``.
        environment: an Environment class (or factory) instead of ``env.name``.

    Raises:
        ConfigError / ValueError / FileNotFoundError: a bad option, file or model, named.
    """
    threads = ThreadGovernor(cfg.num_threads)  # num_threads, or a count that fits the machine's load
    build.seed_everything(cfg.seed)
    dist = Dist.current()  # rank and world size (one process: rank 0 of 1)
    dist.check(cfg)
    strategy = make_strategy(cfg, dist)
    if train_source is None:
        train_source = build_train_source(cfg.data, seed=cfg.seed)
    device = dist.device
    dtype = build.resolve_dtype(cfg.model.dtype, device)
    name, fast_cpu_bf16 = cfg.model.precision, None
    if checkpoint is not None:
        name, fast_cpu_bf16 = resumed_precision(name, checkpoint_precision)
    precision = resolve_precision(
        name,
        device,
        model_dtype=cfg.model.dtype,
        lm_head_dtype=cfg.model.lm_head_dtype,
        fast_cpu_bf16=fast_cpu_bf16,
    )
    if checkpoint is not None and cfg.model.precision == "auto":
        log.info("model.precision=auto: %s, as the checkpoint was trained", precision.name)
    if model is None and device.type == "cpu" and cfg.memory_check:  # a planned out-of-memory run
        # stops before any model loads; rank 0 plans for its host's processes (the others' errors
        # are not shown), and the others wait: memory they loaded meanwhile would read as used
        if dist.rank == 0:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) if dist.active else 1
            plan = {"precision": precision.name, "world_size": dist.world_size, "processes": local}
            plan["engine"] = "given" if engine is not None else None  # an engine object's memory is its own
            check_before_loading(cfg, train_source=train_source, **plan)
        dist.barrier()
    m = build_models(
        cfg,
        device=device,
        dtype=dtype,
        checkpoint=checkpoint,
        model=model,
        tokenizer=tokenizer,
        run_dir=cfg.output_dir,
        policy_dtype=precision.param_dtype,  # float32 master weights unless bf16-pure
    )
    check_entropy_target(cfg, m.policy)
    if cfg.data.chat_template:
        m.tokenizer.chat_template = read_chat_template(cfg.data.chat_template)
    precision.prepare_head(m.policy)  # model.lm_head_dtype=float32 (else nothing)
    precision.prepare_head(m.reference)
    engine_name, _ = cfg.rollout.resolved_engine()
    engine_models = strategy.prepare_models(m, engine_name=engine_name, precision=precision)
    ahead = cfg.rollout.max_staleness > 0
    own_weights = engine_name in ("vllm", "server")
    if engine is None and ahead and not own_weights and engine_models.policy is m.policy:
        # sampling runs while the policy trains: the hf engine gets a copy, synced after each update
        copy_ = copy.deepcopy(m.policy).requires_grad_(False).eval()
        engine_models = dataclasses.replace(engine_models, policy=copy_)
    if engine is None:
        engine, engine_name = build.build_engine(
            cfg,
            engine_models,
            dtype=dtype,
            precision=precision,
            shares_policy_weights=engine_models.policy is m.policy,
            cpu_threads=threads.threads if threads.threads < threads.default else None,
            dist=dist,
        )
    elif engine_models.policy is not m.policy and engine.shares_policy_weights:
        raise ConfigError(
            f"engine={type(engine).__name__} samples with the live policy (shares_policy_weights), which "
            f"distributed.strategy={strategy.name} shards; give an engine that holds its own weights "
            "(synced after every update), or let the run build its engine"
        )
    else:
        engine_name = type(engine).__name__
    if ahead and engine.shares_policy_weights:
        raise ConfigError(
            f"rollout.max_staleness={cfg.rollout.max_staleness} samples while the policy trains, and "
            f"engine={type(engine).__name__} samples with the live policy (shares_policy_weights); give an "
            "engine that holds its own weights, or let the run build its engine"
        )
    seeds = Seeds(cfg.seed)
    tokenizer = m.tokenizer
    environment = build.build_environment(cfg, engine, tokenizer, m.policy, environment=environment)
    if (
        checkpoint is not None
        or cfg.model.lora.rank > 0
        or m.weights_differ_from_path
        or getattr(engine, "needs_weights", False)  # servers: whatever they hold, the policy's first
    ):
        strategy.sync_engine(engine, m.policy)  # a separate engine loaded the base weights
    stream = PromptStream(train_source)
    scorer = build.build_scorer(
        cfg, device=device, dtype=dtype, functions=reward_objects, reduce=strategy.reduce
    )
    critic_trainer = build.build_critic(
        cfg,
        model_path=m.model_path,
        device=device,
        checkpoint=checkpoint,
        strategy=strategy,
        precision=precision,
    )
    ptx_data = build.build_ptx(cfg, tokenizer)
    estimator = get_advantage_estimator(cfg.estimator_name)
    kl = cfg.kl_placement
    objective = build.build_objective(cfg, kl)
    optimizer, scheduler, optimizer_step = build.policy_optimizer(
        cfg, m.policy, device=device, strategy=strategy, scaler=precision.grad_scaler()
    )
    policy_step = build.build_policy_step(
        cfg,
        m.policy,
        objective,
        optimizer_step,
        ptx=ptx_data,
        device=device,
        strategy=strategy,
        precision=precision,
    )
    policy_step.recompute = build_recompute(
        cfg, m.policy, critic_trainer, optimizer, precision=precision, device=device
    )
    producer = build_producer(
        cfg,
        engine,
        environment,
        tokenizer,
        scorer,
        stream=stream,
        seeds=seeds,
        dist=dist,
        estimator=estimator,
    )
    r = cfg.rollout
    rollouts = Rollouts(
        producer.produce,
        functools.partial(strategy.sync_engine, engine, m.policy),  # FSDP: gathered into the copy
        stream,
        max_staleness=r.max_staleness,
        steps=cfg.steps,
        executor=r.async_executor,
        engine_owns_weights=not engine.shares_policy_weights,
    )
    return Trainer(
        config=cfg,
        dist=dist,
        threads=threads,
        strategy=strategy,
        precision=precision,
        seeds=seeds,
        device=device,
        dtype=dtype,
        model_path=m.model_path,
        tokenizer=tokenizer,
        policy=m.policy,
        reference=m.reference,
        policy_as_reference=m.policy_as_reference,
        engine=engine,
        engine_name=engine_name,
        environment=environment,
        stream=stream,
        scorer=scorer,
        critic_trainer=critic_trainer,
        ptx_data=ptx_data,
        estimator=estimator,
        kl=kl,
        objective=objective,
        optimizer=optimizer,
        scheduler=scheduler,
        policy_step=policy_step,
        kl_ctl=build.build_kl_controller(cfg),
        entropy_ctl=build_entropy_controller(cfg, objective),
        producer=producer,
        rollouts=rollouts,
    )


def build_producer(
    cfg: TrainConfig, engine, environment, tokenizer, scorer, *, stream, seeds: Seeds, dist: Dist, estimator
) -> Producer:
    """The run's :class:`~policygrad.produce.producer.Producer`: a sampler over ``engine``
    (episodes over ``environment`` when the run has one), the raw scoring of ``scorer``, the
    prompt ``stream``, the ``seeds``, the rollout section's sampling settings, this rank's share
    of a round (``dist``) and the providers of ``estimator``'s declared inputs.

    Raises:
        KeyError: an input the estimator declares has no provider.
    """
    r = cfg.rollout
    if environment is not None:
        sampler = EpisodeSampler(environment, per_prompt_seeds=r.per_prompt_seeds)
    else:
        sampler = SingleTurnSampler(
            engine,
            tokenizer,
            cfg.data,
            max_new_tokens=r.max_new_tokens,
            ignore_eos=r.ignore_eos,
            per_prompt_seeds=r.per_prompt_seeds,
        )
    parts = ProducerParts(
        engine=engine,
        tokenizer=tokenizer,
        score=scorer.raw,
        seeds=seeds,
        params=SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p),
        max_new_tokens=r.max_new_tokens,
        ignore_eos=r.ignore_eos,
        per_prompt_seeds=r.per_prompt_seeds,
        options=cfg.estimator_options,
    )
    dynamic = None
    if cfg.drop_zero_variance_groups:
        dynamic = DynamicSampling(cfg.dynamic_sampling_reward, cfg.dynamic_sampling.max_extra_rounds)
    return Producer(
        sampler,
        parts,
        stream=stream,
        group_size=r.group_size,
        prompts_per_step=r.prompts_per_step,
        share=dist.share,
        inputs=estimator_inputs(estimator.spec.inputs),
        dynamic=dynamic,
    )


def build_entropy_controller(cfg: TrainConfig, objective) -> AdaptiveEntropyController | None:
    """``loss.entropy_target``'s adaptive controller of the entropy bonus's coefficient (None
    without a target); ``objective`` starts from its value."""
    loss = cfg.loss
    if loss.entropy_target is None:
        return None
    ctl = AdaptiveEntropyController(
        loss.entropy_coef, loss.entropy_target, loss.entropy_coef_delta, cap=MAX_LOSS_COEF
    )
    objective.entropy_coef = ctl.value
    return ctl


def build_recompute(cfg: TrainConfig, policy, critic_trainer, optimizer, *, precision, device):
    """The :class:`~policygrad.parallel.recompute.Recompute` of ``model.gradient_checkpointing=auto``
    (None for ``true`` / ``false``), the setting logged at start as the rollout engine is."""
    setting = cfg.model.gradient_checkpointing
    if setting != "auto":
        log.info("gradient checkpointing: %s (model.gradient_checkpointing)", "on" if setting else "off")
        return None
    models, params = [policy], list(policy.parameters())
    critic_optimizer = None
    if critic_trainer is not None:
        models.append(critic_trainer.critic)
        critic_optimizer = critic_trainer.optimizer

    def states() -> int:
        pending = pending_state_bytes(params, optimizer)
        if critic_trainer is not None:
            pending += pending_state_bytes(critic_trainer.critic.parameters(), critic_optimizer)
        return pending

    recompute = Recompute.for_policy(policy, precision=precision.name, device=device, states=states)
    if recompute is not None:
        recompute.models = models
    log.info(
        "gradient checkpointing: off (model.gradient_checkpointing=auto: turned on at an update whose "
        "micro-batch would not fit without it)"
    )
    return recompute
