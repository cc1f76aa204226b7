"""The policy's optimizer step on one minibatch, and the statistics of a whole update.

:class:`PolicyStep` runs a minibatch in micro-batches (each trimmed to its longest response):
forward (:func:`policygrad.models.forward.policy_logprobs`, replaceable as ``forward``), the
:class:`~policygrad.trainer.objective.PolicyObjective`, and one shared
:class:`~policygrad.trainer.optim.OptimizerStep`; with ``optim.target_kl`` it takes no step when
the minibatch's measured approx-KL exceeds the target, and with PPO-ptx it adds the language-model
loss before the step. :class:`UpdateStats` turns what the steps did into the update's metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from policygrad.models.forward import lm_loss, policy_logprobs
from policygrad.trainer.experience import Experience
from policygrad.trainer.objective import MinibatchCounts, PolicyObjective
from policygrad.trainer.optim import OptimizerStep
from policygrad.trainer.runtime import synced_clock

__all__ = ["PolicyStep", "UpdateStats"]

# Loss metrics -> logged names (anything else becomes ``policy/<key>``).
_METRIC_NAMES = {
    "kl_loss": "kl/loss_term",
    "is_weight_mean": "mismatch/is_weight_mean",
    "is_capped_frac": "mismatch/is_capped_frac",
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
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0
    nonfinite_tokens: int = 0
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
        for key, value in metrics.items():
            if key.startswith("num_"):
                continue  # counts, not per-token averages
            if key.endswith("_max"):
                self.maxima[key] = max(self.maxima.get(key, -math.inf), float(value))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight

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

    def metrics(self, *, target_kl: bool, ptx: bool, critic_lr: float | None) -> dict[str, Any]:
        """The update's metrics (names in :data:`policygrad.trainer.metrics.METRICS`)."""
        out: dict[str, Any] = {}
        for key, total in self.sums.items():
            out[_METRIC_NAMES.get(key, f"policy/{key}")] = total / max(self.weight, 1e-12)
        for key, value in self.maxima.items():
            out[_METRIC_NAMES.get(key, f"policy/{key}")] = value
        out["policy/loss"] = sum(self.losses) / len(self.losses) if self.losses else float("nan")
        for key, value in self.timers.items():
            out[f"time/{key}_s"] = value
        out["policy/nonfinite_tokens"] = self.nonfinite_tokens
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

    Attributes (seams): ``forward`` (the log-prob kernel, signature of
    :func:`~policygrad.models.forward.policy_logprobs`), ``objective``, ``reduce`` (None, or a
    data-parallel ``reduce(tensor) -> tensor`` summing over ranks: the minibatch counts and the
    approx-KL of ``target_kl`` are then global), ``equal_passes`` and ``idle_batch`` (FSDP: None,
    or ``equal_passes(count) -> max count over ranks``; a rank with fewer micro-batches runs
    zero-weight passes on ``idle_batch`` so every rank's sharded collectives pair up).
    """

    def __init__(
        self,
        policy,
        objective: PolicyObjective,
        step: OptimizerStep,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
        micro_batch_size: int,
        target_kl: float | None = None,
        ptx=None,
        ptx_coef: float = 0.0,
        device: torch.device,
    ):
        self.policy = policy
        self.forward = policy_logprobs
        self.objective = objective
        self.step = step
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        self.micro_batch_size = micro_batch_size
        self.target_kl = target_kl
        self.ptx = ptx
        self.ptx_coef = ptx_coef
        self.device = device
        self.reduce = None
        self.equal_passes = None
        self.idle_batch: Experience | None = None

    def __call__(self, mb: Experience, stats: UpdateStats) -> None:
        """Forward, backward and (unless stopped or non-finite) step on ``mb``; records into ``stats``."""
        counts = MinibatchCounts.of(mb.loss_mask)
        if self.reduce is not None:
            counts = MinibatchCounts(self.reduce(counts.num_tokens), self.reduce(counts.num_seqs))
        kl = {"sum": 0.0, "weight": 0.0}
        with_entropy = "grad" if self.objective.entropy_coef else True

        micros = list(mb.micro_batches(self.micro_batch_size))
        idle = self.equal_passes(len(micros)) - len(micros) if self.equal_passes is not None else 0

        def losses():
            for _ in range(idle):  # FSDP: this rank's share of the minibatch is smaller
                rollout = self.idle_batch.rollout
                logprobs, _ = self.forward(self.policy, rollout, with_entropy=False, **self.sampling)
                yield logprobs.sum() * 0.0
            for micro in micros:
                start = time.perf_counter()
                micro = micro.trim()
                logprobs, entropy = self.forward(
                    self.policy, micro.rollout, with_entropy=with_entropy, **self.sampling
                )
                old = micro.old_logprobs
                if old is None:
                    old = logprobs.detach()  # exactly on-policy: the ratio is exactly 1
                    if stats.rollout_rows is not None and stats.steps == 0:
                        stats.rollout_logprobs[micro.rows, : old.shape[1]] = old.to(stats.rollout_logprobs)
                        stats.rollout_rows[micro.rows] = True
                loss, m, mask = self.objective(logprobs, entropy, old, micro, counts)
                stats.nonfinite_tokens += m.pop("nonfinite_tokens")
                if torch.isfinite(loss):
                    stats.timers["forward"] += synced_clock(self.device) - start
                yield loss
                w = float(mask.sum())
                stats.add_micro(m, w)
                if "approx_kl" in m and w > 0:
                    kl["sum"] += float(m["approx_kl"]) * w
                    kl["weight"] += w

        def exceeds_target_kl() -> bool:
            # The policy has moved too far from the one that sampled: no step, and the update ends.
            if self.target_kl is not None and self.reduce is not None:
                kl["sum"], kl["weight"] = self.reduce(torch.tensor([kl["sum"], kl["weight"]])).tolist()
            return (
                self.target_kl is not None and kl["weight"] > 0 and kl["sum"] / kl["weight"] > self.target_kl
            )

        out = self.step(
            losses(), stop=exceeds_target_kl, extra_losses=self._ptx_losses(stats) if self.ptx else None
        )
        stats.timers["backward"] += out.backward_s
        stats.timers["optimizer"] += out.optimizer_s
        if out.stopped:
            stats.early_stopped = True
            return
        if out.grad_norm is not None:
            stats.grad_norms.append(out.grad_norm)
        if out.applied:
            stats.steps += 1
            stats.losses.append(out.loss)
        else:
            stats.skipped += 1

    def _ptx_losses(self, stats: UpdateStats):
        def losses():
            ids, attn = self.ptx.next_batch()
            loss = lm_loss(self.policy, ids.to(self.device), attn.to(self.device))
            yield self.ptx_coef * loss
            stats.ptx_losses.append(loss.item())

        return losses
