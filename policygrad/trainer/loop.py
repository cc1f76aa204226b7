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
   immutable :class:`~policygrad.learn.experience.Experience`;
5. **update**: ``ppo_epochs`` x ``num_minibatches`` minibatch views of the experience, one policy
   step each (micro-batches whose losses use the minibatch's global counts) and one critic step;
6. **sync**: a rollout engine that holds its own copy of the weights receives the new ones;
7. **KL controller**: the adaptive controller sees the batch's KL to the reference;
8. **metrics**: every name from :data:`policygrad.learn.metrics.METRICS`.

The loop never tests an algorithm's, a loss's, a KL placement's or an engine's name: the config
resolves registered parts, and each declares what it needs.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from policygrad.config.train import TrainConfig
from policygrad.config.training import MAX_LOSS_COEF
from policygrad.core.advantages import AdvantageEstimator, monte_carlo_returns
from policygrad.core.entropy import AdaptiveEntropyController, covariance_selection, token_covariance
from policygrad.core.kl import AdaptiveKLController, FixedKLController, KLPlacement, kl_estimate
from policygrad.core.masking import masked_mean, masked_sum, masked_whiten
from policygrad.data.ptx import PtxData
from policygrad.data.stream import PromptStream
from policygrad.envs.episodes import EpisodeRunner
from policygrad.errors import CheckpointError, TrainingError
from policygrad.learn.critic import CriticTrainer
from policygrad.learn.experience import Experience
from policygrad.learn.health import check_finite_advantages
from policygrad.learn.metrics import (
    async_metrics,
    batch_metrics,
    critic_metrics,
    episode_metrics,
    mean_value,
    mismatch_metrics,
)
from policygrad.learn.objective import PolicyObjective, positive_samples
from policygrad.learn.optim import set_base_lr
from policygrad.learn.update import PolicyStep, UpdateStats
from policygrad.models.forward import inference_logprobs
from policygrad.parallel.distributed import Dist
from policygrad.parallel.precision import Precision
from policygrad.parallel.runtime import peak_rss_gb, release_free_memory, synced_clock
from policygrad.parallel.state import SHARDED_DIR, load_full_optimizer, load_sharded_state
from policygrad.parallel.strategy import Strategy
from policygrad.parallel.threads import ThreadGovernor
from policygrad.produce.production import finish, produce
from policygrad.produce.rollouts import RolloutPipeline
from policygrad.rewards.scoring import Scorer
from policygrad.rollout.engine import RolloutEngine
from policygrad.seeds import Seeds

__all__ = ["Trainer", "TrainingError"]

log = logging.getLogger("policygrad")


class Trainer:
    """The parts of an RL run and :meth:`step`, which runs them once (see the module docstring).

    Built by :func:`policygrad.trainer.factory.build_trainer` from a config (the parts in a fixed
    order, which fixes the random streams a run consumes at start); a
    :class:`policygrad.run.Run` owns one and does what surrounds the steps (the run directory,
    checkpoints, signals, evaluation, trackers). The trainer writes no file.

    ``threads`` holds torch's thread count: ``num_threads``, or (null) a count that fits the
    machine's load, re-read before each step (:mod:`policygrad.parallel.threads`).

    Seams (attributes a caller may replace): ``engine``, ``scorer`` (rewards ->
    :class:`~policygrad.rewards.scoring.Scores`), ``estimator`` (the registered advantage
    estimator), ``kl`` (the KL placement), ``objective`` and ``policy_step.forward``.
    """

    config: TrainConfig
    dist: Dist
    threads: ThreadGovernor
    strategy: Strategy
    precision: Precision
    seeds: Seeds
    device: torch.device
    dtype: torch.dtype
    model_path: str
    tokenizer: Any
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    policy_as_reference: Callable[[], AbstractContextManager] | None
    engine: RolloutEngine
    engine_name: str
    environment: EpisodeRunner | None
    stream: PromptStream
    scorer: Scorer
    critic_trainer: CriticTrainer | None
    ptx_data: PtxData | None
    estimator: AdvantageEstimator
    kl: KLPlacement
    objective: PolicyObjective
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    policy_step: PolicyStep
    kl_ctl: FixedKLController | AdaptiveKLController
    step_idx: int
    last_samples: list[dict[str, Any]]
    pipeline: RolloutPipeline | None
    entropy_ctl: AdaptiveEntropyController | None

    def __init__(self, config: TrainConfig, **parts: Any):
        """``parts``: every annotated attribute above except ``config``, ``step_idx``,
        ``last_samples``, ``pipeline`` and ``entropy_ctl`` (see
        :func:`~policygrad.trainer.factory.build_trainer`); with ``rollout.max_staleness`` > 0 the
        trainer builds its :class:`RolloutPipeline`, with ``loss.entropy_target`` its
        :class:`~policygrad.core.entropy.AdaptiveEntropyController`.

        Raises:
            TypeError: a part is missing or unknown.
        """
        names = set(Trainer.__annotations__) - {
            "config",
            "step_idx",
            "last_samples",
            "pipeline",
            "entropy_ctl",
        }
        if set(parts) != names:
            missing, unknown = sorted(names - set(parts)), sorted(set(parts) - names)
            raise TypeError(f"Trainer parts: missing {missing}, unknown {unknown}")
        self.config = config
        for name, part in parts.items():
            setattr(self, name, part)
        self.step_idx = 0
        self.last_samples = []  # the last step's completions, for display
        loss = config.loss
        self.entropy_ctl = None
        if loss.entropy_target is not None:
            self.entropy_ctl = AdaptiveEntropyController(
                loss.entropy_coef, loss.entropy_target, loss.entropy_coef_delta, cap=MAX_LOSS_COEF
            )
            self.objective.entropy_coef = self.entropy_ctl.value
        r = config.rollout
        self.pipeline = None  # max_staleness 0: today's synchronous step, no pipeline at all
        if r.max_staleness > 0:
            self.pipeline = RolloutPipeline(
                lambda step, version: produce(self, step, version),
                self.sync_engine,
                self.stream,
                max_staleness=r.max_staleness,
                steps=config.steps,
                executor=r.async_executor,
                engine_owns_weights=not self.engine.shares_policy_weights,
            )

    @property
    def critic(self) -> torch.nn.Module | None:
        """The value model (None without a critic)."""
        return self.critic_trainer.critic if self.critic_trainer is not None else None

    @property
    def whole_policy(self) -> torch.nn.Module:
        """The unsharded policy: what the engine samples from and exports write (FSDP: the copy)."""
        return self.strategy.engine_policy(self.policy)

    # ------------------------------------------------------------------------------------------
    # What the run around the steps asks, as named questions rather than the parts' own attributes.

    @property
    def shards_state(self) -> bool:
        """Whether a checkpoint needs every rank (FSDP: :meth:`write_shards`)."""
        return self.strategy.shards_state

    @property
    def saves_alone(self) -> bool:
        """Whether rank 0 can write a checkpoint without the other ranks (after an error on one)."""
        return self.strategy.saves_alone

    @property
    def gradient_checkpointing(self) -> bool:
        """Whether the policy's updates recompute activations (``auto``: as decided at the updates)."""
        recompute = getattr(self.policy_step, "recompute", None)
        if recompute is None:
            return self.config.model.gradient_checkpointing is True
        return recompute.enabled

    def optimizer_steps(self) -> tuple[int, int]:
        """The optimizer steps applied so far (policy, critic): whether one happened since a state."""
        critic = self.critic_trainer
        return (self.scheduler.last_epoch, critic.scheduler.last_epoch if critic is not None else 0)

    def next_rows(self) -> list[dict[str, Any]]:
        """The rows of the next step's prompts, read from the stream, not taken."""
        position, n = self.stream.position, self.config.rollout.prompts_per_step
        return [self.stream.source.train_row(position + j) for j in range(n)]

    def set_base_lr(self, lr: float) -> None:
        """A new base learning rate for the policy under its schedule's position (a resume's ``optim.lr``)."""
        set_base_lr(self.optimizer, self.scheduler, lr)

    def stop_at_once(self) -> None:
        """End the rollout pipeline's job in flight without waiting for it (a second Ctrl-C): it may
        wait minutes for a reward call; closing the reward worker ends that call, and the thread."""
        if self.pipeline is not None and not self.pipeline.close(timeout=1.0):
            self.scorer.close()
            self.pipeline.close(timeout=10.0)

    # ------------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One RL step (see the module docstring). Returns the step's metrics."""
        cfg = self.config
        threads = self.threads.check()  # the machine's load since the last step (num_threads: fixed)
        if self.pipeline is not None:
            self.pipeline.threads = threads  # its next job runs with the same count
        t0 = time.perf_counter()
        torch.manual_seed(self.seeds.step(self.step_idx))
        if self.pipeline is None:
            production = produce(self, self.step_idx, self.step_idx)
            queue = waited = None
        else:  # sampled ahead, with the weights of update max(0, step - max_staleness)
            production, waited, queue = self.pipeline.take(self.step_idx)
        batch, sampled, metrics, inputs = finish(self, production)
        release_free_memory()  # the sampler's temporaries go back to the OS before training
        t_gen = time.perf_counter()
        metrics["time/generation_s"] = t_gen - t0 if self.pipeline is None else production.seconds
        pretraining = self.critic is not None and self.step_idx < cfg.critic.pretrain_steps
        rollout = batch.rollout.to(self.device)
        ref = self._timed(metrics, "ref", self.kl.needs_reference, self.reference_logprobs, rollout)
        on_policy = self.on_policy(pretraining, batch.version)
        old = self._timed(metrics, "old", not on_policy, self.old_logprobs, rollout)
        values = self.critic_trainer.values(rollout) if self.critic_trainer is not None else None
        exp = self.experience(batch, rollout, ref, old, values, inputs, train_policy=not pretraining)
        stats = self.update(exp)
        release_free_memory()  # and the training activations before the next rollout
        metrics["time/training_s"] = synced_clock(self.device) - t_gen
        if self.pipeline is not None:  # drain the job in flight, push the weights, start the next
            synced = bool(stats.steps) and not self.engine.shares_policy_weights
            times = self.pipeline.after_update(self.step_idx + 1, synced=synced)
            metrics.update(
                async_metrics(
                    self.step_idx, batch, exp, stats, production, waited, queue, times, self.dist.total
                )
            )
        elif stats.steps and not self.engine.shares_policy_weights:
            t_sync = time.perf_counter()  # the engine holds its own weights: push the updated ones
            self.sync_engine()
            metrics["time/weight_sync_s"] = time.perf_counter() - t_sync
        everything = self.dist.gather_experience(exp)  # data-parallel: every rank's rows
        metrics.update(self.advance_kl_controller(everything))
        metrics.update(self.step_metrics(batch, sampled, everything, stats))
        metrics.update(self.advance_entropy_controller(metrics))
        metrics["time/step_s"] = time.perf_counter() - t0
        tokens = int(exp.rollout.response_mask.sum().item())
        metrics["perf/tokens_per_s"] = tokens / max(metrics["time/step_s"], 1e-9)
        metrics["perf/threads"] = threads
        metrics["memory/peak_rss_gb"] = peak_rss_gb()
        if torch.cuda.is_available():
            metrics["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
        self.step_idx += 1
        self.last_samples = [
            {"prompt": batch.rows[i // batch.group_size]["prompt"], "completion": c, "reward": float(s)}
            for i, (c, s) in enumerate(zip(batch.completions, batch.returns))
        ]
        return metrics

    def step_metrics(self, batch, sampled, exp: Experience, stats: UpdateStats) -> dict[str, Any]:
        """The step's metrics other than time, memory and KL (names in :data:`METRICS`).
        Data-parallel: of the batch gathered from every rank (``exp`` already is)."""
        d = self.dist
        batch, sampled, stats = d.gather_batch(batch), d.gather_batch(sampled), d.reduce_update_stats(stats)
        response_mask = exp.rollout.response_mask.float()
        metrics = mismatch_metrics(stats.rollout_logprobs, stats.rollout_rows, exp.rollout, response_mask)
        metrics.update(
            critic_metrics(
                exp.values, exp.returns, exp.critic_mask, response_mask, pretraining=not exp.train_policy
            )
        )
        metrics["reward/score"] = mean_value(batch.returns)
        metrics["reward/non_score"] = mean_value(exp.non_score_rewards)
        metrics.update(
            batch_metrics(
                sampled.scores,
                sampled.rollout,
                sample_returns=sampled.returns,
                advantages=exp.advantages,
                loss_mask=exp.loss_mask,
                returns=exp.returns,
                response_mask=response_mask,
            )
        )
        metrics.update(sampled.scores.metrics)
        if exp.behaviour_logprobs is not None:
            usable = exp.loss_mask * torch.isfinite(exp.behaviour_logprobs).to(exp.loss_mask)
            cov = token_covariance(exp.behaviour_logprobs, exp.advantages, usable)
            metrics["entropy/cov"] = masked_mean(cov, usable).item()
        if sampled.episodes is not None:
            metrics.update(episode_metrics(sampled.episodes, sampled.rollout))
        metrics.update(stats.metrics(**self._update_metric_options()))
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        if self.policy_step.step.scaler is not None:  # fp16-mixed
            metrics["optim/loss_scale"] = self.policy_step.step.loss_scale
        return metrics

    # ------------------------------------------------------------------------------------------
    # Stages.

    def on_policy(self, pretraining: bool, version: int | None = None) -> bool:
        """The update can use the training forward's own log-probs as the old ones: one epoch of
        one minibatch (or a frozen policy), unless the KL shapes the rewards from the sampler's
        log-probs and the sampler is a separate engine (its log-probs differ from the trainer's
        by the mismatch, which would then sit in every reward), and only for a batch sampled by
        the current weights (``version``, the updates applied when it was sampled, equal to
        ``step_idx``; None: assume so). A stale batch's old log-probs are recomputed: the
        proximal policy of the decoupled objective (Fu et al. 2025, AReaL, eq. 5), while the
        sampler's log-probs stay the behaviour policy of the importance weights."""
        if version is not None and version != self.step_idx:
            return False
        o = self.config.optim
        exact = (o.ppo_epochs == 1 and o.num_minibatches == 1) or pretraining
        return exact and (self.engine.shares_policy_weights or not self.kl.shapes_rewards)

    def sync_engine(self) -> None:
        """Give the rollout engine the policy's current weights (FSDP: gathered from the shards
        into the unsharded copy it samples from; a collective, every rank calls it)."""
        self.strategy.sync_engine(self.engine, self.policy)

    def reference_logprobs(self, rollout) -> torch.Tensor:
        """The reference's log-probs [B, T] of the sampled tokens, of the full tempered softmax:
        the reference is never sampled from, and truncated to its own top-k/top-p set it would give
        -inf (an infinite KL) to every token the updated policy samples outside that set."""
        kwargs = {
            "sampling": rollout.sampling.tempered(),
            "micro_batch_size": self.config.optim.micro_batch_size,
        }
        with self.precision.autocast():
            if self.reference is not None:
                return inference_logprobs(self.reference, rollout, **kwargs)
            # LoRA: the base weights (disable_adapter), or the adapter the run started from
            with self.policy_as_reference():
                return inference_logprobs(self.policy, rollout, **kwargs)

    def old_logprobs(self, rollout) -> torch.Tensor:
        """The policy's log-probs [B, T] of the sampled tokens before the update (of the
        distribution they were sampled from: ``rollout.sampling``)."""
        with self.precision.autocast():
            return inference_logprobs(
                self.policy, rollout, micro_batch_size=self.config.optim.micro_batch_size
            )

    def _timed(self, times: dict[str, float], name: str, needed: bool, fn, rollout):
        start = time.perf_counter()
        out = fn(rollout) if needed else None
        times[f"time/{name}_logprobs_s"] = synced_clock(self.device) - start if needed else 0.0  # 0: skipped
        return out

    def experience(
        self, batch, rollout, ref_logprobs, old_logprobs, values, inputs, *, train_policy: bool
    ) -> Experience:
        """Token rewards (the KL placement's shaping of the scores), advantages and returns (the
        registered estimator; Monte-Carlo returns while the critic is pretrained, i.e. while
        ``train_policy`` is False), whitened as configured, in one :class:`Experience`."""
        cfg = self.config
        scores = batch.scores.scores.to(self.device)
        response_mask = rollout.response_mask.float()
        loss_mask = response_mask * batch.scores.valid.to(response_mask)[:, None]
        behaviour = old_logprobs if old_logprobs is not None else rollout.sampler_logprobs
        beta = float(self.kl_ctl.value)
        token_rewards = self.kl.token_rewards(
            scores, behaviour, ref_logprobs, response_mask, beta=beta, kind=cfg.kl.resolved_kind()
        )
        # The KL part: what the placement added to the scores (the turn rewards are not part of it).
        non_score = masked_sum(token_rewards, response_mask, dim=-1) - scores.to(token_rewards)
        if batch.episodes is not None:  # each turn's reward on its last action token
            token_rewards = token_rewards + batch.episodes.turn_rewards.to(token_rewards)
        shaped = token_rewards
        reduce = self.dist.batch_reduce  # None in one process; else statistics over every rank
        if cfg.reward.whiten and self.dist.total(loss_mask.sum()) >= 2:  # N+ reward whitening: scale only
            token_rewards = masked_whiten(token_rewards, loss_mask, shift_mean=False, reduce=reduce)
        options = {**cfg.estimator_options, **inputs}
        if self.estimator.spec.batch_statistics:  # e.g. reinforce_pp's whitening, over every rank
            options["batch_reduce"] = reduce
        advantages, returns = self.estimator(
            token_rewards, response_mask, group_index=rollout.group_index, values=values, **options
        )
        if not train_policy:  # value pretraining fits Monte-Carlo returns (lam = 1), not lam-returns
            returns = monte_carlo_returns(
                token_rewards, response_mask, gamma=float(options.get("gamma", 1.0))
            )
        if cfg.whiten_advantages and self.dist.total(loss_mask.sum()) >= 2:
            advantages = masked_whiten(advantages, loss_mask, reduce=reduce)
        check_finite_advantages(self.dist, self.config, batch.returns, shaped, advantages, loss_mask, values)
        cov_selected = (
            self.cov_selection(advantages, behaviour, loss_mask) if self.objective.token_selection else None
        )
        positive = (  # the samples with the highest return (an episode's turn rewards count)
            positive_samples(batch.returns.to(self.device), batch.scores.valid, self.dist)
            if cfg.loss.positive_lm_coef
            else None
        )
        return Experience(
            rows=torch.arange(rollout.batch_size),
            rollout=rollout,
            loss_mask=loss_mask,
            advantages=advantages,
            old_logprobs=old_logprobs,
            ref_logprobs=ref_logprobs,
            values=values,
            returns=returns,
            critic_mask=loss_mask,
            behaviour_logprobs=behaviour,
            non_score_rewards=non_score,
            cov_selected=cov_selected,
            positive=positive,
            kl_coef=beta,
            train_policy=train_policy,
        )

    def cov_selection(self, advantages, logprobs, loss_mask) -> torch.Tensor:
        """The tokens a covariance loss acts on this step (bool [B, T], this rank's rows): chosen
        once over every rank's batch, from the covariance of the advantages with the log-probs of
        the policy before the update (the old ones, else the sampler's), so neither micro-batches,
        minibatches nor the number of ranks change which tokens they are (Cui et al. 2025, sec. 5)."""
        d = self.dist
        options = {**self.objective.policy_loss.options, **self.objective.loss_options}
        mode = self.objective.token_selection
        usable = loss_mask * torch.isfinite(logprobs).to(loss_mask)  # a top-k/top-p edge token: -inf
        adv_all, logprobs_all, usable_all = (d.gather_rows(t) for t in (advantages, logprobs, usable))
        cov = token_covariance(logprobs_all, adv_all, usable_all)
        if mode == "clip_cov":
            choice = {
                "ratio": options["clip_cov_ratio"],
                "lb": options["clip_cov_lb"],
                "ub": options["clip_cov_ub"],
            }
        else:
            choice = {"ratio": options["kl_cov_ratio"]}
        selected = covariance_selection(cov, usable_all, mode=mode, **choice)
        offset = d.rank_offsets(advantages.shape[0])
        return selected[offset : offset + advantages.shape[0], : advantages.shape[1]]

    def update(self, exp: Experience) -> UpdateStats:
        """``ppo_epochs`` x ``num_minibatches`` minibatch views of ``exp``: per minibatch one
        policy step (unless the policy is frozen or no token carries loss) and, with a critic, one
        critic step on the same rows. A minibatch whose approx-KL exceeds ``optim.target_kl``
        takes no step and ends the update (critic included)."""
        o = self.config.optim
        self.policy.train()
        stats = UpdateStats.for_batch(exp)
        generator = torch.Generator().manual_seed(self.seeds.update(self.step_idx))
        shard = self.dist.minibatch_shard(exp.batch_size)  # data-parallel: global minibatches
        idle = exp.select(torch.arange(1)) if self.strategy.collective else None  # for idle passes
        for mb in exp.minibatches(o.ppo_epochs, o.num_minibatches, generator, shard):
            if exp.train_policy and self.dist.total(mb.loss_mask.sum()) > 0:
                before = stats.steps
                first_logprobs = self.policy_step(mb, stats, idle=idle)
                if not before:
                    stats.record_first_logprobs(first_logprobs)
                if stats.early_stopped:
                    break
            if self.critic_trainer is not None and exp.values is not None:
                stats.add_critic(self.critic_trainer.fit(mb, idle=idle))
        return stats

    def advance_kl_controller(self, exp: Experience) -> dict[str, float]:
        """Feed the adaptive KL controller the batch's KL to the reference (k1 per token, summed
        per sequence, averaged; it stands still while the policy is frozen). Returns the KL
        metrics. Data-parallel: ``exp`` holds every rank's rows."""
        if exp.ref_logprobs is None:
            return {"kl/coef": exp.kl_coef}
        response_mask = exp.rollout.response_mask.float()
        kl_tokens = kl_estimate(exp.behaviour_logprobs, exp.ref_logprobs, "k1")
        # masked_sum, not a product with the mask: with top-k/top-p the log-probs of padding tokens
        # are -inf, and inf * 0 would make the controller's input NaN.
        if exp.train_policy:
            self.kl_ctl.update(masked_sum(kl_tokens, response_mask, dim=-1).mean().item(), exp.batch_size)
        return {"kl/ref": masked_mean(kl_tokens, response_mask).item(), "kl/coef": exp.kl_coef}

    def advance_entropy_controller(self, metrics: dict[str, Any]) -> dict[str, float]:
        """``entropy/coef`` (the entropy bonus's coefficient this step) and, with
        ``loss.entropy_target``, one adaptive-controller step from the policy's mean entropy
        before the update (``entropy/mean``; it stands still when the policy did not train)."""
        out = {"entropy/coef": float(self.objective.entropy_coef)}
        ctl = self.entropy_ctl
        if ctl is not None and "entropy/mean" in metrics:
            was_capped = ctl.capped
            self.objective.entropy_coef = ctl.update(metrics["entropy/mean"])
            if ctl.capped and not was_capped:
                log.warning(
                    "warning: the adaptive entropy coefficient reached its cap %g: the policy's entropy "
                    "(entropy/mean %g) stays below loss.entropy_target=%g; lower the target",
                    ctl.cap, metrics["entropy/mean"], ctl.target,
                )
        return out

    def _update_metric_options(self) -> dict[str, Any]:
        critic = self.critic_trainer
        return {
            "target_kl": self.config.optim.target_kl is not None,
            "ptx": self.ptx_data is not None,
            "critic_lr": critic.scheduler.get_last_lr()[0] if critic is not None else None,
        }

    # ------------------------------------------------------------------------------------------
    # State.

    def _networks(self) -> dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]:
        networks = {"policy": (self.policy, self.optimizer)}
        if self.critic_trainer is not None:
            networks["critic"] = (self.critic, self.critic_trainer.optimizer)
        return networks

    def state_dict(self) -> dict[str, Any]:
        """What the trainer needs to continue exactly where it is: step, data position, optimizer
        (None when the strategy writes it in shards: :meth:`write_shards`), schedule, KL
        controller, reward normaliser, RNG states; with a critic its optimizer and schedule; with
        PPO-ptx the text position. Tensors by reference: valid until the next optimizer step."""
        sharded = self.strategy.shards_state
        state = {
            "step": self.step_idx,
            "data_position": self.stream.position,
            "optimizer": None if sharded else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kl_controller": self.kl_ctl.state_dict(),
            **({"entropy_controller": self.entropy_ctl.state_dict()} if self.entropy_ctl is not None else {}),
            "reward_normalizer": self.scorer.normalizer.state_dict(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
            "precision": self.precision.name,  # what model.precision=auto resolved to, kept on resume
        }
        scaler = self.policy_step.step.scaler
        if scaler is not None:  # fp16-mixed: the loss scale and its growth count, for an exact resume
            state["grad_scaler"] = scaler.state_dict()
        if self.critic_trainer is not None:
            state["critic"] = self.critic_trainer.state_dict()
            if sharded:
                state["critic"]["optimizer"] = None
        if self.ptx_data is not None:
            state["ptx_position"] = self.ptx_data.position
        if sharded:
            state["sharded"] = SHARDED_DIR
        if self.pipeline is not None:  # the batches sampled ahead, and where their prompts end
            state["pipeline"] = self.pipeline.state_dict()
            state["data_position"] = state["pipeline"]["position"]
        return state

    def write_shards(self, path: str, *, tmp: str) -> tuple[str | None, dict[str, torch.Tensor] | None]:
        """The part of checkpoint ``path`` that needs every rank (FSDP's shards, into rank 0's
        temporary folder ``tmp``; nothing otherwise): ``(temporary folder or None, the critic's
        full weights on rank 0 or None)``. A collective."""
        return self.strategy.write_shards(path, self._networks(), tmp=tmp)

    def load_state_dict(self, state: dict[str, Any], *, checkpoint: str) -> None:
        """Put :meth:`state_dict`'s output (read from ``checkpoint``) back; a sharded optimizer
        state is read from the checkpoint's ``sharded/`` folder, resharded to this run's ranks.

        Raises:
            CheckpointError: the run has a critic but the checkpoint has no critic state.
        """
        self.step_idx = state["step"]
        self.stream.position = state["data_position"]
        self._load_pipeline_state(state, checkpoint)
        critic = self.critic_trainer
        if critic is not None and "critic" not in state:
            raise CheckpointError(
                f"checkpoint {checkpoint} has no critic state; it was written by a run without a critic"
            )
        if state.get("sharded"):  # an FSDP run's checkpoint: resharded to this run's ranks
            load_sharded_state(os.path.join(checkpoint, state["sharded"]), self._networks())
        else:
            load_full_optimizer(self.policy, self.optimizer, state["optimizer"])
            if critic is not None:
                load_full_optimizer(self.critic, critic.optimizer, state["critic"]["optimizer"])
        for _, optimizer in self._networks().values():  # a checkpoint may carry another implementation
            fused = optimizer.defaults.get("fused")
            for group in optimizer.param_groups:
                group["fused"] = fused
        self.scheduler.load_state_dict(state["scheduler"])
        self._load_controllers(state)
        if critic is not None:
            critic.scheduler.load_state_dict(state["critic"]["scheduler"])
            if critic.step.scaler is not None and state["critic"].get("grad_scaler"):
                critic.step.scaler.load_state_dict(state["critic"]["grad_scaler"])
        self._load_loss_scale(state, checkpoint)
        if self.ptx_data is not None:
            self.ptx_data.position = state.get("ptx_position", 0)
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])

    def _load_controllers(self, state: dict[str, Any]) -> None:
        """The KL and entropy coefficients' controllers and the reward normaliser."""
        self.kl_ctl.load_state_dict(state["kl_controller"])
        if self.entropy_ctl is not None and "entropy_controller" in state:
            self.entropy_ctl.load_state_dict(state["entropy_controller"])
            self.objective.entropy_coef = self.entropy_ctl.value
        if "reward_normalizer" in state:
            self.scorer.normalizer.load_state_dict(state["reward_normalizer"])

    def _load_loss_scale(self, state: dict[str, Any], checkpoint: str) -> None:
        scaler = self.policy_step.step.scaler
        if scaler is not None:
            if state.get("grad_scaler"):
                scaler.load_state_dict(state["grad_scaler"])
            else:  # a checkpoint of another precision: the scale starts over
                start = scaler.get_scale()
                log.warning("note: checkpoint %s has no fp16 loss scale; starting from %g", checkpoint, start)

    def _load_pipeline_state(self, state: dict[str, Any], checkpoint: str) -> None:
        saved = state.get("pipeline")
        k = self.config.rollout.max_staleness
        if saved is None and self.pipeline is None:
            return
        if saved is None or self.pipeline is None or saved["max_staleness"] != k:
            was = saved["max_staleness"] if saved is not None else 0
            raise CheckpointError(
                f"checkpoint {checkpoint} was written with rollout.max_staleness={was}; resume it with that "
                f"value (this run has {k})"
            )
        self.pipeline.load_state_dict(saved)

    def close(self) -> None:
        """Stop the rollout pipeline (the job in flight finishes first), shut down the rollout
        engine (vLLM holds its own weights, KV cache and process state), the reward worker and
        the environment workers, and put back an adapted thread count. Safe to call more than once."""
        if self.pipeline is not None:
            self.pipeline.close()
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()
        self.scorer.close()
        if self.environment is not None:  # its worker processes, and whatever they forked
            self.environment.close()
        self.threads.close()  # torch's count as the run found it (num_threads set: left as set)
