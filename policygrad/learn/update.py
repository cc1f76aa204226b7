"""The policy's optimizer step on one minibatch, and the statistics of a whole update.

:class:`PolicyStep` runs a minibatch in micro-batches (each trimmed to its longest response):
forward (:func:`policygrad.models.forward.policy_logprobs`, replaceable as ``forward``), the
:class:`~policygrad.learn.objective.PolicyObjective`, and one shared
:class:`~policygrad.learn.optim.OptimizerStep`; with ``optim.target_kl`` it takes no step when
the minibatch's measured approx-KL exceeds the target, and with PPO-ptx it adds the language-model
loss before the step. :class:`UpdateStats` turns what the steps did into the update's metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from policygrad.learn.experience import Experience
from policygrad.learn.objective import MinibatchCounts, PolicyObjective
from policygrad.learn.optim import OptimizerStep, StepOutcome
from policygrad.models.forward import lm_loss, policy_logprobs
from policygrad.parallel.precision import Precision
from policygrad.parallel.runtime import synced_clock

__all__ = ["KLMeter", "PolicyStep", "UpdateStats"]

# Loss metrics -> logged names (anything else becomes ``policy/<key>``).
_METRIC_NAMES = {
    "kl_loss": "kl/loss_term",
    "is_weight_mean": "mismatch/is_weight_mean",
    "is_capped_frac": "mismatch/is_capped_frac",
    "is_floored_frac": "mismatch/is_floored_frac",
    "cov_selected_frac": "entropy/cov_selected_frac",
}


@dataclass
class UpdateStats:
    """Accumulates the policy and critic steps of one update (``ppo_epochs`` x ``num_minibatches``).

    Policy metrics are token-weighted means over the micro-batches that were backpropagated
    (``*_max`` combine with max); the trainer's own log-probs before any update are kept for the
    sampler-mismatch metrics (``rollout_logprobs`` over ``rollout_rows``, or the old-log-prob pass).
    """

    rollout_logprobs: torch.Tensor | None = None
    rollout_rows: torch.Tensor | None = None
    sums: dict[str, float] = field(default_factory=dict)
    maxima: dict[str, float] = field(default_factory=dict)
    weight: float = 0.0
    entropy_before: list[float] = field(default_factory=lambda: [0.0, 0.0])  # token-weighted sum, tokens
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0
    nonfinite_tokens: int = 0
    rows: list[int] = field(default_factory=lambda: [0, 0])  # minibatch rows: all, skipped as gradient-free
    early_stopped: bool = False
    timers: dict[str, float] = field(
        default_factory=lambda: {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    )
    ptx_losses: list[float] = field(default_factory=list)
    critic_sums: dict[str, float] = field(default_factory=dict)
    critic_tokens: float = 0.0
    critic_steps: int = 0
    critic_skipped: int = 0
    critic_grad_norms: list[float] = field(default_factory=list)

    @classmethod
    def for_batch(cls, exp: Experience) -> UpdateStats:
        """Stats of an update of ``exp``; on-policy updates record the first forward's log-probs."""
        if exp.old_logprobs is not None or not exp.train_policy:
            return cls(rollout_logprobs=exp.old_logprobs)
        rows = torch.zeros(exp.batch_size, dtype=torch.bool, device=exp.advantages.device)
        return cls(rollout_logprobs=torch.zeros_like(exp.advantages), rollout_rows=rows)

    def add_micro(self, metrics: dict[str, Any], weight: float) -> None:
        """Token-weighted sums of a backpropagated micro-batch's loss metrics."""
        self.weight += weight
        if not self.steps and "entropy" in metrics:  # the policy that sampled, before any update
            self.entropy_before[0] += float(metrics["entropy"]) * weight
            self.entropy_before[1] += weight
        for key, value in metrics.items():
            if key.startswith("num_"):
                continue  # counts, not per-token averages
            if key.endswith("_max"):
                self.maxima[key] = max(self.maxima.get(key, -math.inf), float(value))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight

    @property
    def entropy_mean(self) -> float | None:
        """The policy's mean entropy per token before the update's first optimizer step (what the
        adaptive entropy controller follows; ``entropy/mean``), None when no micro-batch recorded
        one (the policy did not train)."""
        total, tokens = self.entropy_before
        return total / tokens if tokens > 0 else None

    def add_critic(self, out: dict[str, float]) -> None:
        """A critic step's result (:meth:`CriticTrainer.fit`)."""
        if not out:
            return
        self.critic_skipped += int(out["skipped"])
        if not out["skipped"]:
            self.critic_steps += 1
            self.critic_grad_norms.append(out["grad_norm"])
            n = out["num_tokens"]
            self.critic_tokens += n
            for key in ("vf_loss", "vf_clipfrac"):
                self.critic_sums[key] = self.critic_sums.get(key, 0.0) + out[key] * n

    def record(self, out: StepOutcome) -> None:
        """What one policy optimizer step did (:class:`~policygrad.learn.optim.StepOutcome`)."""
        self.timers["backward"] += out.backward_s
        self.timers["optimizer"] += out.optimizer_s
        if out.stopped:
            self.early_stopped = True
            return
        if out.grad_norm is not None:
            self.grad_norms.append(out.grad_norm)
        if out.applied:
            self.steps += 1
            self.losses.append(out.loss)
        else:
            self.skipped += 1

    def record_first_logprobs(self, first: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep an on-policy update's first-forward log-probs for the sampler-mismatch metrics
        (call it for minibatches run before any optimizer step of the update)."""
        if self.rollout_rows is None:
            return
        for rows, logprobs in first:
            self.rollout_logprobs[rows, : logprobs.shape[1]] = logprobs.to(self.rollout_logprobs)
            self.rollout_rows[rows] = True

    def metrics(self, *, target_kl: bool, ptx: bool, critic_lr: float | None) -> dict[str, Any]:
        """The update's metrics (names in :data:`policygrad.learn.metrics.METRICS`)."""
        out: dict[str, Any] = {}
        for key, total in self.sums.items():
            out[_METRIC_NAMES.get(key, f"policy/{key}")] = total / max(self.weight, 1e-12)
        for key, value in self.maxima.items():
            out[_METRIC_NAMES.get(key, f"policy/{key}")] = value
        out["policy/loss"] = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        for key, value in self.timers.items():
            out[f"time/{key}_s"] = value
        out["policy/nonfinite_tokens"] = self.nonfinite_tokens
        if self.entropy_mean is not None:
            out["entropy/mean"] = self.entropy_mean
        if self.rows[0]:
            out["optim/skipped_rows_frac"] = self.rows[1] / self.rows[0]
        out["optim/steps"] = self.steps
        out["optim/skipped_nonfinite"] = self.skipped
        out["optim/grad_norm"] = _mean(self.grad_norms)
        if target_kl:
            out["optim/early_stopped"] = float(self.early_stopped)
        if ptx:
            out["ptx/loss"] = _mean(self.ptx_losses)
        if critic_lr is not None:
            for key, total in self.critic_sums.items():
                out[f"critic/{key}"] = total / max(self.critic_tokens, 1e-12)
            out["critic/steps"] = self.critic_steps
            out["critic/skipped_nonfinite"] = self.critic_skipped
            out["critic/grad_norm"] = _mean(self.critic_grad_norms)
            out["critic/lr"] = critic_lr
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class PolicyStep:
    """One policy optimizer step on a minibatch (see the module docstring).

    Args:
        policy: the trained network.
        objective: the :class:`~policygrad.learn.objective.PolicyObjective`.
        step: the policy's :class:`~policygrad.learn.optim.OptimizerStep`.
        strategy: the run's strategy: with several ranks the minibatch counts and the approx-KL of
            ``target_kl`` are global, and (FSDP) a rank with fewer micro-batches runs zero-weight
            passes so every rank's sharded collectives pair up.
        precision: the training forward runs under its autocast.
        micro_batch_size: sequences per forward.
        target_kl: no step when the minibatch's approx-KL exceeds it (None: off).
        ptx, ptx_coef: PPO-ptx's text stream (None: off) and the weight of its LM loss.

    Attributes (seams): ``forward`` (the log-prob kernel, signature of
    :func:`~policygrad.models.forward.policy_logprobs`) and ``objective``; ``recompute``: the
    :class:`~policygrad.parallel.recompute.Recompute` of ``model.gradient_checkpointing=auto``,
    asked before the first forward of every minibatch (None: the setting is fixed).
    """

    def __init__(
        self,
        policy,
        objective: PolicyObjective,
        step: OptimizerStep,
        *,
        strategy,
        precision: Precision,
        micro_batch_size: int,
        target_kl: float | None = None,
        ptx=None,
        ptx_coef: float = 0.0,
        skip_zero_advantage: bool = False,
        device: torch.device,
    ):
        self.policy = policy
        self.forward = policy_logprobs
        self.objective = objective
        self.step = step
        self.strategy = strategy
        self.precision = precision
        self.micro_batch_size = micro_batch_size
        self.target_kl = target_kl
        self.ptx = ptx
        self.ptx_coef = ptx_coef
        self.skip_zero_advantage = skip_zero_advantage
        self.device = device
        self.recompute = None

    def __call__(
        self, mb: Experience, stats: UpdateStats, *, idle: Experience | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Forward, backward and (unless stopped or non-finite) one optimizer step on ``mb``;
        records into ``stats``. ``idle``: a batch for the zero-weight passes of a rank with
        fewer micro-batches (FSDP).

        Returns:
            On an on-policy minibatch (``mb.old_logprobs`` None): each micro-batch's
            ``(rows, log-probs [b, T_micro])`` of the first forward (the ratio's denominator,
            the policy's log-probs before the update); else ``[]``.
        """
        reduce = self.strategy.reduce
        counts = MinibatchCounts.of(mb.loss_mask, mb.positive, mb.sample_tokens).reduced(reduce)
        trained = self._rows_to_train(mb)
        stats.rows[0] += mb.batch_size
        stats.rows[1] += mb.batch_size - trained.batch_size
        micros = list(trained.micro_batches(self.micro_batch_size))
        if self.recompute is not None and not self.recompute.enabled and micros:
            sizes = [micro.rollout.trim() for micro in micros]
            self.recompute.check(
                max(r.batch_size for r in sizes),
                max(r.prompt_ids.shape[1] + r.response_ids.shape[1] for r in sizes),
            )
        first_logprobs, kl = [], KLMeter()
        self.step.zero()
        passes = self.strategy.idle_passes(len(micros))
        for _ in range(passes):
            logprobs, _ = self._forward(idle.rollout, with_entropy=False)
            # with top-k/top-p a padding token's log-prob is -inf, and -inf * 0 would be NaN
            self.step.backward(torch.nan_to_num(logprobs, neginf=0.0).sum() * 0.0)
        if not micros and not passes:
            self.step.zero_gradients()  # what the skipped rows' backward would have left: AdamW still steps
        for micro in micros:
            start = time.perf_counter()
            micro = micro.trim()
            # the entropy needs a gradient only when it is in the loss
            logprobs, entropy = self._forward(
                micro.rollout, with_entropy="grad" if self.objective.entropy_coef else True
            )
            old = micro.old_logprobs
            if old is None:  # exactly on-policy: the ratio is exactly 1
                old = logprobs.detach()
                first_logprobs.append((micro.rows, old))
            loss, metrics, mask = self.objective(logprobs, entropy, old, micro, counts)
            stats.nonfinite_tokens += metrics.pop("nonfinite_tokens")
            if torch.isfinite(loss):
                stats.timers["forward"] += synced_clock(self.device) - start
            if not self.step.backward(loss):
                break
            stats.add_micro(metrics, kl.add(metrics, float(mask.sum())))
        if self.target_kl is not None and kl.exceeds(self.target_kl, reduce):
            out = self.step.cancel()  # moved too far from the sampling policy: no step, the update ends
        else:
            if self.ptx is not None and self.step.proceeding:
                self._ptx_loss(stats)
            out = self.step.apply()
        stats.record(out)
        return first_logprobs

    def _rows_to_train(self, mb: Experience) -> Experience:
        """``mb`` without the rows whose gradient is exactly 0 (``skip_zero_advantage``), or
        ``mb``. The minibatch's counts still include them, so the loss is unchanged."""
        if not self.skip_zero_advantage or self.target_kl is not None:
            return mb
        keep = self.objective.rows_with_gradient(mb)
        if keep is None or bool(keep.all()):
            return mb
        return mb.select(keep.nonzero().squeeze(1).cpu())

    def _forward(self, rollout, *, with_entropy):
        # the distribution the rollout was sampled from (rollout.sampling), under the precision's autocast
        with self.precision.autocast():
            return self.forward(self.policy, rollout, with_entropy=with_entropy)

    def _ptx_loss(self, stats: UpdateStats) -> None:
        ids, attn = self.ptx.next_batch()
        loss = lm_loss(self.policy, ids.to(self.device), attn.to(self.device))  # outside autocast, as before
        if self.step.backward(self.ptx_coef * loss, count=False):
            stats.ptx_losses.append(loss.item())


class KLMeter:
    """The token-weighted approx-KL of a minibatch's backpropagated micro-batches."""

    def __init__(self):
        self.sum, self.weight = 0.0, 0.0

    def add(self, metrics: dict[str, Any], weight: float) -> float:
        """Count a micro-batch's ``approx_kl`` (when the loss reports one) with ``weight`` tokens;
        returns ``weight``."""
        if "approx_kl" in metrics and weight > 0:
            self.sum += float(metrics["approx_kl"]) * weight
            self.weight += weight
        return weight

    def exceeds(self, target: float, reduce=None) -> bool:
        """The mean approx-KL (over every rank with ``reduce``) is above ``target``."""
        total, weight = self.sum, self.weight
        if reduce is not None:
            total, weight = reduce(torch.tensor([total, weight])).tolist()
        return weight > 0 and total / weight > target
