"""The training loop: one RL step as a pipeline of named stages over one record.

``Trainer.step`` reads top to bottom:

1. **sample**: the step's batch from the rollouts (:class:`~policygrad.produce.rollouts.Rollouts`:
   produced now at ``rollout.max_staleness`` 0, else sampled ahead by the producer), finished on
   the trainer's thread (normalisation, truncation policy, the groups dynamic sampling kept);
2. **estimator inputs**: what the advantage estimator declares it needs beyond rewards (ReMax:
   the greedy baseline), from registered providers;
3. **log-probs / values**: the reference's log-probs when the KL placement needs them, the
   policy's old log-probs when the update is not exactly on-policy, the critic's values;
4. **token rewards -> advantages**: the KL placement shapes the per-token rewards, the
   registered estimator turns them (and the values) into advantages and returns, all in one
   immutable :class:`~policygrad.learn.experience.Experience`;
5. **update**: ``ppo_epochs`` x ``num_minibatches`` minibatch views of the experience, one policy
   step each (micro-batches whose losses use the minibatch's global counts) and one critic step;
6. **sync**: a rollout engine that holds its own copy of the weights receives the new ones
   (through the rollouts, which first drain a job in flight);
7. **controllers**: the adaptive KL controller sees the batch's KL to the reference, the entropy
   controller the update's entropy before the first optimizer step (:class:`UpdateStats`);
8. **metrics**: every name from :data:`policygrad.learn.metrics.METRICS`.

Randomness comes from the run's :class:`~policygrad.seeds.Seeds` only: prompts sample from their
own seeds, the minibatch order from ``seeds.update(step)``, and what draws from torch's stream
(dropout in the update, a sampler without per-prompt seeds) does so in a scope seeded with
``seeds.step(step)`` (:func:`~policygrad.seeds.seeded_torch`); a step never reseeds the global RNG.

The loop never tests an algorithm's, a loss's, a KL placement's or an engine's name: the config
resolves registered parts, and each declares what it needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from policygrad.config.train import TrainConfig
from policygrad.core.advantages import AdvantageEstimator, monte_carlo_returns
from policygrad.core.entropy import AdaptiveEntropyController, token_covariance
from policygrad.core.kl import AdaptiveKLController, FixedKLController, KLPlacement, kl_estimate
from policygrad.core.masking import masked_mean, masked_sum, masked_whiten
from policygrad.data.ptx import PtxData
from policygrad.data.stream import PromptStream
from policygrad.envs.episodes import EpisodeRunner
from policygrad.errors import TrainingError
from policygrad.learn.critic import CriticTrainer
from policygrad.learn.experience import Experience
from policygrad.learn.health import check_finite_advantages
from policygrad.learn.metrics import (
    batch_metrics,
    critic_metrics,
    episode_metrics,
    mean_value,
    mismatch_metrics,
    perf_metrics,
)
from policygrad.learn.objective import PolicyObjective, positive_samples
from policygrad.learn.optim import set_base_lr
from policygrad.learn.segments import extend_to_segments, first_rows
from policygrad.learn.update import PolicyStep, UpdateStats
from policygrad.models.forward import inference_logprobs
from policygrad.parallel.distributed import Dist
from policygrad.parallel.precision import Precision
from policygrad.parallel.runtime import release_free_memory, synced_clock
from policygrad.parallel.strategy import Strategy
from policygrad.parallel.threads import ThreadGovernor
from policygrad.produce.producer import Producer
from policygrad.produce.production import finish
from policygrad.produce.rollouts import Rollouts
from policygrad.rewards.scoring import Scorer
from policygrad.rollout.base import pad_columns
from policygrad.rollout.engine import RolloutEngine
from policygrad.seeds import Seeds, seeded_torch
from policygrad.trainer.state import load_trainer_state, trainer_state, write_trainer_shards

__all__ = ["Trainer", "TrainingError"]

log = logging.getLogger("policygrad")


@dataclass(eq=False, repr=False, kw_only=True)
class Trainer:
    """The parts of an RL run and :meth:`step`, which runs them once (see the module docstring).

    Built by :func:`policygrad.trainer.factory.build_trainer` from a config (the parts in a fixed
    order, which fixes the random streams a run consumes at start), each part named
    (``Trainer(config=..., dist=..., ...)``, every field below but ``step_idx`` and
    ``last_samples``); a :class:`policygrad.run.Run` owns one and does what surrounds the steps
    (the run directory, checkpoints, signals, evaluation, trackers). The trainer writes no file.

    ``threads`` holds torch's thread count: ``num_threads``, or (null) a count that fits the
    machine's load, re-read before each step (:mod:`policygrad.parallel.threads`). ``producer``
    makes a step's batch from its own parts (it holds no reference to the trainer), ``rollouts``
    hands every step its batch (:class:`~policygrad.produce.rollouts.Rollouts`: k = 0 inline, k > 0
    sampled ahead). ``entropy_ctl``: the adaptive entropy controller of ``loss.entropy_target``
    (None without one).

    Seams (attributes a caller may replace): ``scorer`` (rewards ->
    :class:`~policygrad.rewards.scoring.Scores`, on the trainer's thread), ``estimator`` (the
    registered advantage estimator), ``kl`` (the KL placement), ``objective`` and
    ``policy_step.forward``; what is sampled: ``producer.sampler``.
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
    entropy_ctl: AdaptiveEntropyController | None
    producer: Producer
    rollouts: Rollouts
    step_idx: int = field(default=0, init=False)
    last_samples: list[dict[str, Any]] = field(default_factory=list, init=False)  # for display

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
        """End the rollouts' job in flight without waiting for it (a second Ctrl-C): it may wait
        minutes for a reward call; closing the reward worker ends that call, and the thread (k = 0:
        no thread, closed at once)."""
        if not self.rollouts.close(timeout=1.0):
            self.scorer.close()
            self.rollouts.close(timeout=10.0)

    # ------------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One RL step (see the module docstring). Returns the step's metrics."""
        threads = self.threads.check()  # the machine's load since the last step (num_threads: fixed)
        t0 = time.perf_counter()
        taken = self.rollouts.take(self.step_idx, threads=threads)  # k = 0: produced now
        batch, sampled, metrics, inputs = finish(self, taken.production)
        release_free_memory()  # the sampler's temporaries go back to the OS before training
        t_gen = time.perf_counter()
        metrics["time/generation_s"] = taken.production.seconds
        pretraining = self.critic is not None and self.step_idx < self.config.critic.pretrain_steps
        rollout = batch.training_rollout().to(self.device)  # the samples, then any earlier segments
        ref = self._timed(metrics, "ref", self.kl.needs_reference, self.reference_logprobs, rollout)
        on_policy = self.on_policy(pretraining, batch.version)
        old = self._timed(metrics, "old", not on_policy, self.old_logprobs, rollout)
        values = self.critic_trainer.values(rollout) if self.critic_trainer is not None else None
        exp = self.experience(batch, rollout, ref, old, values, inputs, train_policy=not pretraining)
        stats = self.update(exp)
        release_free_memory()  # and the training activations before the next rollout
        metrics["time/training_s"] = synced_clock(self.device) - t_gen
        synced = bool(stats.steps) and not self.engine.shares_policy_weights  # an engine of its own
        times = self.rollouts.after_update(self.step_idx + 1, synced=synced)  # k > 0: drained first
        metrics.update(self.rollouts.report(self.step_idx, taken, times, batch, exp, stats, self.dist.total))
        everything = self.dist.gather_experience(exp)  # data-parallel: every rank's rows
        reduced = self.dist.reduce_update_stats(stats)  # and every rank's update statistics
        metrics.update(self.advance_kl_controller(everything))
        metrics.update(self.step_metrics(batch, sampled, everything, reduced))
        metrics.update(self.advance_entropy_controller(reduced))
        metrics["time/step_s"] = time.perf_counter() - t0
        metrics.update(perf_metrics(exp, metrics["time/step_s"], threads))
        self.step_idx += 1
        self.last_samples = batch.shown()
        return metrics

    def step_metrics(self, batch, sampled, exp: Experience, stats: UpdateStats) -> dict[str, Any]:
        """The step's metrics other than time, memory and KL (names in :data:`METRICS`).
        Data-parallel: of the batch gathered from every rank (``exp`` and ``stats`` already are)."""
        d = self.dist
        batch, sampled = d.gather_batch(batch), d.gather_batch(sampled)
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
        ``train_policy`` is False), whitened as configured, in one :class:`Experience`. ``rollout``
        holds the B samples, then any earlier segments (:mod:`policygrad.learn.segments`)."""
        cfg = self.config
        B = batch.rollout.batch_size
        # Everything up to the advantages is of the B samples' rows (head: the first B of ``rollout``).
        head, head_ref, head_old = first_rows(B, rollout, ref_logprobs, old_logprobs)
        segmented = head is not rollout
        scores = batch.scores.scores.to(self.device)
        response_mask = head.response_mask.float()
        loss_mask = response_mask * batch.scores.valid.to(response_mask)[:, None]
        behaviour = head_old if head_old is not None else head.sampler_logprobs
        beta = float(self.kl_ctl.value)
        token_rewards = self.kl.token_rewards(
            scores, behaviour, head_ref, response_mask, beta=beta, kind=cfg.kl.resolved_kind()
        )
        # The KL part: what the placement added to the scores (the turn rewards are not part of it).
        non_score = masked_sum(token_rewards, response_mask, dim=-1) - scores.to(token_rewards)
        if batch.episodes is not None:  # each turn's reward on its last action token
            turn_rewards = batch.episodes.turn_rewards.to(token_rewards)  # (a segment may be wider)
            token_rewards = token_rewards + pad_columns(turn_rewards, token_rewards.shape[1], left=False)
        shaped = token_rewards
        reduce = self.dist.batch_reduce  # None in one process; else statistics over every rank
        if cfg.reward.whiten and self.dist.total(loss_mask.sum()) >= 2:  # N+ reward whitening: scale only
            token_rewards = masked_whiten(token_rewards, loss_mask, shift_mean=False, reduce=reduce)
        options = {**cfg.estimator_options, **inputs}
        if self.estimator.spec.batch_statistics:  # e.g. reinforce_pp's whitening, over every rank
            options["batch_reduce"] = reduce
        advantages, returns = self.estimator(
            token_rewards, response_mask, group_index=head.group_index, values=values, **options
        )
        if not train_policy:  # value pretraining fits Monte-Carlo returns (lam = 1), not lam-returns
            returns = monte_carlo_returns(
                token_rewards, response_mask, gamma=float(options.get("gamma", 1.0))
            )
        sample_tokens = None  # (each row is a whole sample)
        if segmented:  # the segments' rows join, with their episodes' advantages
            advantages, returns, loss_mask, shaped, non_score, sample_tokens = extend_to_segments(
                batch, rollout.response_mask.float(), advantages, returns, shaped, non_score
            )
            behaviour = old_logprobs if old_logprobs is not None else rollout.sampler_logprobs
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
        if positive is not None and segmented:  # a segment is as positive as its episode
            positive = torch.cat([positive, positive[batch.episodes.segments.owner.to(positive.device)]])
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
            sample_tokens=sample_tokens,
            kl_coef=beta,
            train_policy=train_policy,
        )

    def cov_selection(self, advantages, logprobs, loss_mask) -> torch.Tensor:
        """The tokens a covariance loss acts on this step (:meth:`PolicyObjective.covariance_tokens`)."""
        return self.objective.covariance_tokens(advantages, logprobs, loss_mask, self.dist)

    def update(self, exp: Experience) -> UpdateStats:
        """``ppo_epochs`` x ``num_minibatches`` minibatch views of ``exp``: per minibatch one
        policy step (unless the policy is frozen or no token carries loss) and, with a critic, one
        critic step on the same rows. A minibatch whose approx-KL exceeds ``optim.target_kl``
        takes no step and ends the update (critic included).

        Randomness: the minibatch order from ``seeds.update(step)``; what the forward passes draw
        from torch's stream (dropout, e.g. LoRA's ``lora.dropout``) from a scope seeded with
        ``seeds.step(step)`` (:func:`~policygrad.seeds.seeded_torch`), the state that stream had
        when each step began by reseeding it: the draws are the same, and nothing else sees them."""
        with seeded_torch(self.seeds.step(self.step_idx)):
            return self._update(exp)

    def _update(self, exp: Experience) -> UpdateStats:
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

    def advance_entropy_controller(self, stats: UpdateStats) -> dict[str, float]:
        """``entropy/coef`` (the entropy bonus's coefficient this step) and, with
        ``loss.entropy_target``, one adaptive-controller step from the policy's mean entropy
        before the update (``stats.entropy_mean``, every rank's; it stands still when the policy
        did not train)."""
        out = {"entropy/coef": float(self.objective.entropy_coef)}
        ctl, entropy = self.entropy_ctl, stats.entropy_mean
        if ctl is not None and entropy is not None:
            was_capped = ctl.capped
            self.objective.entropy_coef = ctl.update(entropy)
            if ctl.capped and not was_capped:
                log.warning(
                    "warning: the adaptive entropy coefficient reached its cap %g: the policy's entropy "
                    "(entropy/mean %g) stays below loss.entropy_target=%g; lower the target",
                    ctl.cap, entropy, ctl.target,
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
    # State (:mod:`policygrad.trainer.state`).

    def state_dict(self) -> dict[str, Any]:
        """What the trainer needs to continue exactly where it is (:func:`trainer_state`)."""
        return trainer_state(self)

    def write_shards(self, path: str, *, tmp: str) -> tuple[str | None, dict[str, torch.Tensor] | None]:
        """The part of checkpoint ``path`` that needs every rank, into rank 0's temporary folder
        ``tmp`` (:func:`write_trainer_shards`)."""
        return write_trainer_shards(self, path, tmp=tmp)

    def load_state_dict(self, state: dict[str, Any], *, checkpoint: str) -> None:
        """Put :meth:`state_dict`'s output (read from ``checkpoint``) back (:func:`load_trainer_state`).

        Raises:
            CheckpointError: the checkpoint does not fit this run (named).
        """
        load_trainer_state(self, state, checkpoint=checkpoint)

    def close(self) -> None:
        """Stop the rollouts (k > 0: the job in flight finishes first), shut down the rollout
        engine (vLLM holds its own weights, KV cache and process state), the reward worker and
        the environment workers, and put back an adapted thread count. Safe to call more than once."""
        self.rollouts.close()
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()
        self.scorer.close()
        if self.environment is not None:  # its worker processes, and whatever they forked
            self.environment.close()
        self.threads.close()  # torch's count as the run found it (num_threads set: left as set)
