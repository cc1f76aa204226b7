"""The training loop: one RL step as a pipeline of named stages over one record.

``Trainer.step`` reads top to bottom:

1. **sample**: take ``prompts_per_step`` prompts from the stream, generate ``group_size``
   responses each (rows of a prompt contiguous), score them (reward functions, normalisation,
   truncation policy); with dynamic sampling, drop the groups without signal and refill;
2. **estimator inputs**: what the advantage estimator declares it needs beyond rewards (ReMax:
   the greedy baseline), from registered providers;
3. **log-probs / values**: the reference's log-probs when the KL placement needs them, the
   policy's old log-probs when the update is not exactly on-policy, the critic's values;
4. **token rewards -> advantages**: the KL placement shapes the per-token rewards, the
   registered estimator turns them (and the values) into advantages and returns, all in one
   immutable :class:`~policygrad.trainer.experience.Experience`;
5. **update**: ``ppo_epochs`` x ``num_minibatches`` minibatch views of the experience, one policy
   step each (micro-batches whose losses use the minibatch's global counts) and one critic step;
6. **sync**: a rollout engine that holds its own copy of the weights receives the new ones;
7. **metrics**: every name from :data:`policygrad.trainer.metrics.METRICS`.

The loop never tests an algorithm's, a loss's, a KL placement's or an engine's name: the config
resolves registered parts, and each declares what it needs.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Any

import torch

from policygrad.core.advantages import get_advantage_estimator, monte_carlo_returns
from policygrad.core.kl import kl_estimate
from policygrad.core.masking import masked_mean, masked_sum, masked_whiten
from policygrad.data.chat import encode_prompts
from policygrad.data.sources import build_eval_rows, build_train_source
from policygrad.data.stream import PromptStream
from policygrad.models.adapters import is_peft_model
from policygrad.models.forward import inference_logprobs
from policygrad.rewards.callables import describe_object
from policygrad.rewards.code import TaskReward
from policygrad.rollout.base import prompt_seed
from policygrad.trainer import build, rundir
from policygrad.trainer.checkpoint import (
    restore_trainer_state,
)
from policygrad.trainer.config import ConfigError, TrainConfig
from policygrad.trainer.distributed import Dist
from policygrad.trainer.errors import TrainingError
from policygrad.trainer.evaluate import decode_completions
from policygrad.trainer.experience import Experience
from policygrad.trainer.health import UpdateWatch, check_finite_weights
from policygrad.trainer.lifecycle import RunLifecycle
from policygrad.trainer.logging import peak_rss_gb
from policygrad.trainer.metrics import batch_metrics, critic_metrics, mismatch_metrics
from policygrad.trainer.precision import apply_precision, resolve_precision
from policygrad.trainer.resume import set_base_lr
from policygrad.trainer.runtime import release_free_memory, synced_clock
from policygrad.trainer.sharding import copy_full_weights, shard_model
from policygrad.trainer.stages import (
    ESTIMATOR_INPUTS,
    SampledBatch,
    concat_batches,
    keep_groups_with_signal,
)
from policygrad.trainer.update import UpdateStats

__all__ = ["Trainer", "TrainingError"]

log = logging.getLogger("policygrad")


class Trainer(RunLifecycle):
    """Runs a :class:`TrainConfig`: builds the models, data and rewards, then trains.

    Args:
        config: the validated run configuration.
        resume_from: a run directory to resume from (its newest complete checkpoint), or None;
            it must be ``config.output_dir``.
        engine: a rollout engine to use instead of the one ``rollout.engine`` names.
        model, tokenizer: a loaded transformers model (or peft model: its adapter trains) to
            train in place instead of ``model.name`` (see :func:`policygrad.trainer.build.adopt_model`);
            the config records it as ``model.name`` (:func:`~policygrad.trainer.build.record_model_object`).
        reward_functions: reward functions as objects (callables, sync or async, or specs)
            instead of ``reward.functions``; the config records each by its import path
            (``module:qualname``) or ``<callable NAME (not importable)>``.
        train_source: the training prompts as an object with ``train_row(i)`` (e.g. a
            :class:`~policygrad.data.sources.PromptDataset`) instead of ``data.dataset``.
        eval_rows: held-out rows (dicts with ``prompt`` and ``answer``) instead of ``data.eval_dataset``.

    Seams (attributes a caller may replace): ``engine``, ``scorer`` (rewards ->
    :class:`~policygrad.rewards.scoring.Scores`), ``estimator`` (the registered advantage
    estimator), ``kl`` (the KL placement), ``objective`` and ``policy_step.forward``.

    Nothing is written until every check has passed and every part is built; then the run
    directory is locked (:mod:`policygrad.trainer.rundir`) until :meth:`train` returns or
    :meth:`close` is called.

    Raises:
        ConfigError / ValueError: bad configuration or data (a prompt of the first batch too long
            for ``data.max_prompt_length`` or the model's context, non-finite model weights), a
            folder that holds a run without ``overwrite``, options that cannot change on resume;
            the field is named.
        TrainingError: another run owns the folder; ``resume_from`` has no complete checkpoint.
        CheckpointError: the checkpoint to resume from is corrupt or not a policygrad one.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        resume_from: str | None = None,
        engine=None,
        model=None,
        tokenizer=None,
        reward_functions: list | None = None,
        train_source=None,
        eval_rows: list[dict[str, Any]] | None = None,
    ):
        if model is not None:
            config = build.record_model_object(config, model)
        reward_objects = None
        if reward_functions is not None:  # the config records them; importable ones by their path
            recorded = [describe_object(f) for f in reward_functions]
            reward_objects = [f if r.startswith("<") else r for f, r in zip(reward_functions, recorded)]
            reward = dataclasses.replace(config.reward, functions=recorded)
            config = dataclasses.replace(config, reward=reward)
        self.config = cfg = config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        build.seed_everything(cfg.seed)
        self.dist = Dist.current()  # rank and world size (one process: rank 0 of 1)
        self.dist.check(cfg)
        if self.dist.active and not cfg.rollout.per_prompt_seeds:
            # Several processes always sample with per-prompt seeds: config.yaml says so, and a
            # resume in one process goes on sampling the same way.
            rollout = dataclasses.replace(cfg.rollout, per_prompt_seeds=True)
            self.config = cfg = dataclasses.replace(cfg, rollout=rollout)
        self.device = self.dist.device
        self.dtype = build.resolve_dtype(cfg.model.dtype, self.device)
        self.precision = resolve_precision(cfg.model.precision, self.device, model_dtype=cfg.model.dtype)
        # single (one process), ddp (whole networks on every rank) or fsdp (sharded networks)
        self.strategy = cfg.distributed.resolved(self.device.type) if self.dist.active else "single"
        self.run_dir = cfg.output_dir
        self._lock: rundir.RunLock | None = None
        self.scorer = None
        # 1. Read-only checks of the run directory (and the checkpoint to resume from): nothing
        # is written until every check has passed and every part is built (step 3).
        ckpt, state, changes = None, None, {}
        if resume_from is None:
            rundir.check_new_run_dir(self.run_dir, overwrite=cfg.overwrite)
        else:
            ckpt, state, changes = self._check_resume(resume_from)
        self.dist.barrier()  # every rank has checked before rank 0 may write (step 3)
        # 2. Build every part: first what needs no model (the engine's choice, reward specs, the
        # data), so a bad option or file is refused before a model is read or converted; then the models,
        # the engine, the rewards and the optimizers.
        build.check_before_models(cfg, reward_objects)
        if train_source is None:
            train_source = build_train_source(cfg.data, seed=cfg.seed)
        if eval_rows is not None:
            self.eval_rows = list(eval_rows)[: cfg.data.eval_size]
        else:
            self.eval_rows = build_eval_rows(cfg.data, seed=cfg.seed) if cfg.data.eval_size else []
        m = build.build_models(
            cfg,
            device=self.device,
            dtype=self.dtype,
            checkpoint=ckpt,
            model=model,
            tokenizer=tokenizer,
            run_dir=self.run_dir,
            policy_dtype=self.precision.param_dtype,  # float32 master weights unless bf16-pure
        )
        self.policy_as_reference = m.policy_as_reference
        self.full_policy = None  # fsdp: the unsharded copy the engine samples from and exports write
        if self.strategy == "fsdp" and is_peft_model(m.policy):  # e.g. model.name an adapter folder
            raise ConfigError(
                f"distributed.strategy=fsdp shards full fine-tuning, and model.name={cfg.model.name!r} is a "
                "LoRA adapter; a LoRA run trains a small adapter every rank can hold: set "
                "distributed.strategy=ddp"
            )
        engine_models = self._shard(m) if self.strategy == "fsdp" else m
        self.model_path, self.tokenizer, self.policy, self.reference = (
            m.model_path,
            m.tokenizer,
            m.policy,
            m.reference,
        )
        if engine is None:
            engine, self.engine_name = build.build_engine(cfg, engine_models, dtype=self.dtype)
        else:
            self.engine_name = type(engine).__name__
        self.engine = engine
        if self.full_policy is not None and self.engine.shares_policy_weights:
            self.engine.shares_policy_weights = False  # it samples from the copy, synced after updates
        if ckpt is not None or cfg.model.lora.rank > 0 or m.weights_differ_from_path:
            self.sync_engine()  # a separate engine loaded the base weights
        self.stream = PromptStream(train_source)
        # The rows' own verifier: code_tests (in the run's reward.code sandbox) on code rows.
        self.eval_reward = TaskReward(dataclasses.asdict(cfg.reward.code))
        self.scorer = build.build_scorer(cfg, device=self.device, dtype=self.dtype, functions=reward_objects)
        self.critic_trainer = build.build_critic(
            cfg,
            model_path=self.model_path,
            device=self.device,
            dtype=self.precision.param_dtype,
            checkpoint=ckpt,
            prepare=self._shard_critic if self.strategy == "fsdp" else None,
        )
        self.critic = self.critic_trainer.critic if self.critic_trainer else None
        self.ptx_data = build.build_ptx(cfg, self.tokenizer)
        self.estimator = get_advantage_estimator(cfg.estimator_name)
        self.kl = cfg.kl_placement
        self.objective = build.build_objective(cfg, self.kl)
        self.optimizer, self.scheduler, optimizer_step = build.policy_optimizer(
            cfg, self.policy, device=self.device
        )
        self.policy_step = build.build_policy_step(
            cfg, self.policy, self.objective, optimizer_step, ptx=self.ptx_data, device=self.device
        )
        self.kl_ctl = build.build_kl_controller(cfg)
        apply_precision(self, self.precision)  # forwards under autocast; parameters stay float32
        self.dist.attach(self, self.strategy)  # data-parallel: gradients and batch statistics over ranks
        self.watch = UpdateWatch(cfg)
        self.step_idx = 0
        self._saved_step: int | None = None  # the step of the newest checkpoint on disk
        self._steps_done = False  # train() finished its steps (a signal then has nothing to wait for)
        self._summary: dict[str, Any] = {"run_dir": self.run_dir}  # train()'s summary so far
        self._config_pending = False  # options changed on resume, for config.yaml at the next checkpoint
        self.last_samples: list[dict[str, Any]] = []  # the last step's completions, for display
        if ckpt is not None:
            restore_trainer_state(self, state, ckpt)
            self._saved_step = self.step_idx
            if "optim.lr" in changes:
                set_base_lr(self.optimizer, self.scheduler, cfg.optim.lr)
        check_finite_weights(self.policy, f"model.name={cfg.model.name!r}" if ckpt is None else ckpt)
        self._check_prompts()
        # 3. Take the run directory: lock it, then write (or, on resume, update) the run's files.
        try:
            self._take_run_dir(resume_from, changes)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One RL step (see the module docstring). Returns the step's metrics."""
        cfg = self.config
        t0 = time.perf_counter()
        # A per-step seed makes every step reproducible on its own, so a resumed run samples
        # exactly what a straight run would have.
        torch.manual_seed(cfg.seed * 1_000_003 + self.step_idx)
        batch, sampled, metrics = self.sample()
        inputs = {name: ESTIMATOR_INPUTS[name](self, batch) for name in self.estimator.spec.inputs}
        release_free_memory()  # the sampler's temporaries go back to the OS before training
        t_gen = time.perf_counter()
        metrics["time/generation_s"] = t_gen - t0
        pretraining = self.critic is not None and self.step_idx < cfg.critic.pretrain_steps
        rollout = batch.rollout.to(self.device)
        ref = self._timed(metrics, "ref", self.kl.needs_reference, self.reference_logprobs, rollout)
        old = self._timed(metrics, "old", not self.on_policy(pretraining), self.old_logprobs, rollout)
        values = self.critic_trainer.values(rollout) if self.critic_trainer is not None else None
        exp, shaped = self.experience(batch, rollout, ref, old, values, inputs, pretraining)
        stats = self.update(exp)
        release_free_memory()  # and the training activations before the next rollout
        metrics["time/training_s"] = synced_clock(self.device) - t_gen
        if stats.steps and not self.engine.shares_policy_weights:
            t_sync = time.perf_counter()  # the engine holds its own weights: push the updated ones
            self.sync_engine()
            metrics["time/weight_sync_s"] = time.perf_counter() - t_sync
        metrics.update(self.step_metrics(batch, sampled, exp, shaped, stats, pretraining))
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics["perf/tokens_per_s"] = int(exp.rollout.response_mask.sum().item()) / max(
            metrics["time/step_s"], 1e-9
        )
        metrics["memory/peak_rss_gb"] = peak_rss_gb()
        if torch.cuda.is_available():
            metrics["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
        self.step_idx += 1
        self.last_samples = [
            {"prompt": batch.rows[i // batch.group_size]["prompt"], "completion": c, "reward": float(s)}
            for i, (c, s) in enumerate(zip(batch.completions, batch.scores.scores))
        ]
        return metrics

    def step_metrics(self, batch, sampled, exp, shaped, stats, pretraining: bool) -> dict[str, Any]:
        """The step's metrics other than time and memory (names in :data:`METRICS`); feeds the
        KL controller its measurement. Data-parallel: of the batch gathered from every rank."""
        if self.dist.active:
            d = self.dist
            batch, sampled, exp = d.gather_batch(batch), d.gather_batch(sampled), d.gather_experience(exp)
            shaped, stats = {k: d.gather_rows(v) for k, v in shaped.items()}, d.reduce_update_stats(stats)
        response_mask = exp.rollout.response_mask.float()
        metrics = mismatch_metrics(stats.rollout_logprobs, stats.rollout_rows, exp.rollout, response_mask)
        metrics.update(
            critic_metrics(exp.values, exp.returns, exp.critic_mask, response_mask, pretraining=pretraining)
        )
        metrics.update(self.kl_feedback(exp, shaped["behaviour"], response_mask, pretraining))
        metrics["reward/score"] = batch.scores.scores.mean().item()
        metrics["reward/non_score"] = shaped["non_score"].mean().item()
        metrics.update(
            batch_metrics(
                sampled.scores,
                sampled.rollout,
                advantages=exp.advantages,
                loss_mask=exp.loss_mask,
                returns=shaped["returns"],
                response_mask=response_mask,
            )
        )
        metrics.update(sampled.scores.metrics)
        metrics.update(stats.metrics(**self._update_metric_options()))
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    # ------------------------------------------------------------------------------------------
    # Stages.

    def sample(self) -> tuple[SampledBatch, SampledBatch, dict[str, float]]:
        """Take prompts, generate, score. With ``drop_zero_variance_groups`` (DAPO's dynamic
        sampling), keep the groups whose ``dynamic_sampling.reward`` component varies and sample
        more prompts, up to ``dynamic_sampling.max_extra_rounds`` more rounds, until
        ``prompts_per_step`` groups are kept; then train on what there is.

        Returns:
            ``(batch to train on, everything sampled, dynamic-sampling metrics)``.
        """
        cfg = self.config
        n = cfg.rollout.prompts_per_step
        rounds = [self.generate_and_score(self.stream.take(n))]  # every rank takes all n, keeps its share
        if not cfg.drop_zero_variance_groups:
            return rounds[0], rounds[0], {}
        component = cfg.dynamic_sampling_reward
        kept = [keep_groups_with_signal(rounds[0], component)]
        while sum(map(len, kept)) < n and len(rounds) <= cfg.dynamic_sampling.max_extra_rounds:
            rounds.append(self.generate_and_score(self.stream.take(n), len(rounds)))
            kept.append(keep_groups_with_signal(rounds[-1], component))
        chosen, need = [], n
        for batch, groups in zip(rounds, kept):
            if groups[:need]:
                chosen.append(batch.select_groups(groups[:need]))
                need -= len(chosen[-1].rows)
        sampled = concat_batches(rounds)
        metrics = {
            "dynamic_sampling/groups_sampled": float(len(sampled.rows)),
            "dynamic_sampling/groups_kept": float(n - need),
            "dynamic_sampling/rounds": float(len(rounds)),
        }
        if not chosen:  # no group with signal: the first round's rows stay, none carries loss
            nothing = dataclasses.replace(rounds[0].scores, valid=torch.zeros_like(rounds[0].scores.valid))
            return dataclasses.replace(rounds[0], scores=nothing), sampled, metrics
        return concat_batches(chosen), sampled, metrics

    def generate_and_score(self, rows: list[dict[str, Any]], round_index: int = 0) -> SampledBatch:
        """G completions of each of this rank's rows' prompts (all of ``rows`` in one process),
        scored. With ``rollout.per_prompt_seeds`` (always with several processes) prompt i of the
        step's ``round_index``-th round samples from its own seed (run seed, step, round, i),
        whichever rank or batch it is in."""
        r = self.config.rollout
        share = self.dist.share(len(rows))
        seeds = [prompt_seed(self.config.seed, self.step_idx, round_index, i) for i in range(len(rows))]
        rows, seeds = rows[share], seeds[share]
        prompt_ids = encode_prompts(self.tokenizer, rows, self.config.data)
        rollout = self.engine.generate(
            prompt_ids,
            group_size=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            prompt_seeds=seeds if r.per_prompt_seeds or self.dist.active else None,
            ignore_eos=r.ignore_eos,
        )
        completions = self.decode(rollout)
        scores = self.scorer(
            rows, completions, rollout.truncated, rollout.group_index, group_size=r.group_size
        )
        return SampledBatch(rows, prompt_ids, rollout, completions, scores)

    def decode(self, rollout) -> list[str]:
        """Completion strings of a rollout."""
        return decode_completions(self.tokenizer, rollout)

    def on_policy(self, pretraining: bool) -> bool:
        """The update can use the training forward's own log-probs as the old ones: one epoch of
        one minibatch (or a frozen policy), unless the KL shapes the rewards from the sampler's
        log-probs and the sampler is a separate engine (its log-probs differ from the trainer's
        by the mismatch, which would then sit in every reward)."""
        o = self.config.optim
        exact = (o.ppo_epochs == 1 and o.num_minibatches == 1) or pretraining
        return exact and (self.engine.shares_policy_weights or not self.kl.shapes_rewards)

    def sync_engine(self) -> None:
        """Give the rollout engine the policy's current weights (fsdp: gathered from the shards
        into the unsharded copy it samples from; a collective, every rank calls it)."""
        if self.full_policy is not None:
            copy_full_weights(self.policy, self.full_policy)
            self.engine.sync_weights(self.full_policy)
        else:
            self.engine.sync_weights(self.policy)

    def _shard(self, m: build.Models) -> build.Models:
        """fsdp: keep an unsharded copy of the policy for the engine and the exports (on the CPU
        for vLLM, which holds its own weights), then shard the policy and the reference. Returns
        the models the engine is built from."""
        engine_name, _ = self.config.rollout.resolved_engine()
        # In the master weights' dtype (float32 unless bf16-pure): checkpoints' model folders and
        # exports are written from it, and bf16 weights would drop the small updates (the hf engine
        # still computes in bf16 under autocast).
        self.full_policy = copy.deepcopy(m.policy).requires_grad_(False).eval()
        if engine_name == "vllm":
            self.full_policy = self.full_policy.to("cpu")
        compute = self.precision.autocast_dtype
        shard_model(m.policy, compute_dtype=compute)
        if m.reference is not None:  # computes as the policy does, or the first KL is not 0
            shard_model(m.reference, compute_dtype=compute)
        return dataclasses.replace(m, policy=self.full_policy)

    def _shard_critic(self, critic) -> None:
        shard_model(critic, compute_dtype=self.precision.autocast_dtype)

    def reference_logprobs(self, rollout) -> torch.Tensor:
        """The reference's log-probs [B, T] of the sampled tokens, of the full tempered softmax:
        the reference is never sampled from, and truncated to its own top-k/top-p set it would give
        -inf (an infinite KL) to every token the updated policy samples outside that set."""
        kwargs = {
            "temperature": self.config.rollout.temperature,
            "micro_batch_size": self.config.optim.micro_batch_size,
        }
        if self.reference is not None:
            return inference_logprobs(self.reference, rollout, **kwargs)
        # LoRA: the base weights (disable_adapter), or the adapter the run started from
        with self.policy_as_reference():
            return inference_logprobs(self.policy, rollout, **kwargs)

    def old_logprobs(self, rollout) -> torch.Tensor:
        """The policy's log-probs [B, T] of the sampled tokens before the update."""
        r = self.config.rollout
        return inference_logprobs(
            self.policy,
            rollout,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            micro_batch_size=self.config.optim.micro_batch_size,
        )

    def _timed(self, times: dict[str, float], name: str, needed: bool, fn, rollout):
        start = time.perf_counter()
        out = fn(rollout) if needed else None
        times[f"time/{name}_logprobs_s"] = synced_clock(self.device) - start if needed else 0.0  # 0: skipped
        return out

    def experience(self, batch, rollout, ref_logprobs, old_logprobs, values, inputs, pretraining):
        """Token rewards (the KL placement's shaping of the scores), advantages and returns (the
        registered estimator; Monte-Carlo returns while the critic is pretrained), whitened as
        configured, in one :class:`Experience`. Also returns the record of the shaping:
        ``behaviour`` log-probs, ``non_score`` [B] (the KL part of each sequence's reward) and the
        ``returns``."""
        cfg = self.config
        scores = batch.scores.scores.to(self.device)
        response_mask = rollout.response_mask.float()
        loss_mask = response_mask * batch.scores.valid.to(response_mask)[:, None]
        behaviour = old_logprobs if old_logprobs is not None else rollout.sampler_logprobs
        beta = float(self.kl_ctl.value)
        token_rewards = self.kl.token_rewards(
            scores, behaviour, ref_logprobs, response_mask, beta=beta, kind=cfg.kl.resolved_kind()
        )
        non_score = masked_sum(token_rewards, response_mask, dim=-1) - scores.to(token_rewards)
        reduce = self.dist.batch_reduce  # None in one process; else statistics over every rank
        if cfg.reward.whiten and self.dist.total(loss_mask.sum()) >= 2:  # N+ reward whitening: scale only
            token_rewards = masked_whiten(token_rewards, loss_mask, shift_mean=False, reduce=reduce)
        options = {**cfg.estimator_options, **inputs}
        if self.estimator.spec.batch_statistics:  # e.g. reinforce_pp's whitening, over every rank
            options["batch_reduce"] = reduce
        advantages, returns = self.estimator(
            token_rewards, response_mask, group_index=rollout.group_index, values=values, **options
        )
        if pretraining:  # value pretraining fits Monte-Carlo returns (lam = 1), not lam-returns
            returns = monte_carlo_returns(
                token_rewards, response_mask, gamma=float(options.get("gamma", 1.0))
            )
        if cfg.whiten_advantages and self.dist.total(loss_mask.sum()) >= 2:
            advantages = masked_whiten(advantages, loss_mask, reduce=reduce)
        exp = Experience(
            rows=torch.arange(rollout.batch_size),
            rollout=rollout,
            loss_mask=loss_mask,
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            values=values,
            returns=returns if values is not None else None,
            critic_mask=loss_mask,
            kl_coef=beta,
            train_policy=not pretraining,
        )
        return exp, {"behaviour": behaviour, "non_score": non_score, "returns": returns}

    def update(self, exp: Experience) -> UpdateStats:
        """``ppo_epochs`` x ``num_minibatches`` minibatch views of ``exp``: per minibatch one
        policy step (unless the policy is frozen or no token carries loss) and, with a critic, one
        critic step on the same rows. A minibatch whose approx-KL exceeds ``optim.target_kl``
        takes no step and ends the update (critic included)."""
        o = self.config.optim
        self.policy.train()
        stats = UpdateStats.for_batch(exp)
        generator = torch.Generator().manual_seed(self.config.seed * 7919 + self.step_idx)
        shard = self.dist.minibatch_shard(exp.batch_size)  # data-parallel: global minibatches
        if self.strategy == "fsdp":  # what a rank with fewer rows in a minibatch runs its idle passes on
            self.policy_step.idle_batch = exp.select(torch.arange(1))
            if self.critic_trainer is not None:
                self.critic_trainer.idle_batch = self.policy_step.idle_batch
        for mb in exp.minibatches(o.ppo_epochs, o.num_minibatches, generator, shard):
            if exp.train_policy and self.dist.total(mb.loss_mask.sum()) > 0:
                self.policy_step(mb, stats)
                if stats.early_stopped:
                    break
            if self.critic_trainer is not None and exp.returns is not None:
                stats.add_critic(self.critic_trainer.fit(mb))
        return stats

    def kl_feedback(self, exp: Experience, behaviour, response_mask, pretraining: bool) -> dict[str, float]:
        """KL to the reference of this batch (k1 per token; its per-sequence sum feeds the
        adaptive controller, which stands still while the policy is frozen) and beta."""
        if exp.ref_logprobs is None:
            return {"kl/coef": exp.kl_coef}
        kl_tokens = kl_estimate(behaviour, exp.ref_logprobs, "k1")
        # masked_sum, not a product with the mask: with top-k/top-p the log-probs of padding tokens
        # are -inf, and inf * 0 would make the controller's input NaN.
        if not pretraining:
            self.kl_ctl.update(masked_sum(kl_tokens, response_mask, dim=-1).mean().item(), exp.batch_size)
        return {"kl/ref": masked_mean(kl_tokens, response_mask).item(), "kl/coef": exp.kl_coef}

    def _update_metric_options(self) -> dict[str, Any]:
        critic = self.critic_trainer
        return {
            "target_kl": self.config.optim.target_kl is not None,
            "ptx": self.ptx_data is not None,
            "critic_lr": critic.scheduler.get_last_lr()[0] if critic is not None else None,
        }

    # ------------------------------------------------------------------------------------------

    # ------------------------------------------------------------------------------------------
