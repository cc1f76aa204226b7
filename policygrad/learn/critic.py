"""The critic of PPO: the value model with its own optimizer, schedule and value loss.

The critic is a separate network, so the ``c1`` weight of PPO's combined loss (Schulman et al.
2017, eq. 9) becomes the critic's own learning rate. Its targets are the lambda-returns of GAE
(Schulman et al. 2015b), or Monte-Carlo returns while it is pretrained (Yuan et al. 2025, VC-PPO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from policygrad.core.losses import value_loss
from policygrad.core.masking import aggregate
from policygrad.learn.experience import Experience
from policygrad.learn.optim import OptimizerStep, make_adamw
from policygrad.models.forward import no_grad_context
from policygrad.parallel.distributed import Dist
from policygrad.parallel.precision import Precision
from policygrad.parallel.strategy import Single

__all__ = ["CriticTrainer"]


class CriticTrainer:
    """The value model with its own AdamW optimizer, learning-rate schedule and value loss.

    Args:
        critic: a :class:`policygrad.models.value.ValueModel`.
        lr, betas, eps, weight_decay: AdamW settings.
        max_grad_norm: gradient-norm clip, > 0.
        clip_range: value clipping ``eps_v`` (None: off); see :func:`policygrad.core.losses.value_loss`.
        micro_batch_size: sequences per forward.
        lr_lambda: a ``LambdaLR`` factor of the optimizer step (None: constant).
        device: where the critic runs (for timing only).
        strategy: the run's strategy (default one process): the token count and the metrics
            are summed over ranks, the optimizer step agrees over ranks, FSDP pairs idle passes.
        precision: the value forwards run under its autocast (default float32).
    """

    def __init__(
        self,
        critic,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
        clip_range: float | None = None,
        micro_batch_size: int = 32,
        lr_lambda: Callable[[int], float] | None = None,
        device: torch.device | None = None,
        strategy=None,
        precision: Precision | None = None,
    ):
        self.critic = critic
        self.params = [p for p in critic.parameters() if p.requires_grad]
        self.optimizer = make_adamw(
            self.params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda or (lambda _: 1.0))
        self.clip_range = clip_range
        self.micro_batch_size = micro_batch_size
        device = device or torch.device("cpu")
        self.strategy = strategy or Single(Dist(device=device))
        self.precision = precision or Precision("fp32", torch.float32, None, device.type)
        self.step = OptimizerStep(
            self.optimizer,
            self.scheduler,
            self.params,
            max_grad_norm=max_grad_norm,
            device=device,
            strategy=self.strategy,
            scaler=self.precision.grad_scaler(),  # fp16-mixed: the value loss is scaled too
        )

    def _values(self, rollout) -> torch.Tensor:
        with self.precision.autocast():
            return self.critic.response_values(rollout)

    def values(self, rollout) -> torch.Tensor:
        """float32 [B, T] ``V(s_t)`` of a rollout at rollout time (no gradient), in micro-batches."""
        chunks = []
        with no_grad_context(self.critic):
            for start in range(0, rollout.batch_size, self.micro_batch_size):
                rows = torch.arange(start, min(start + self.micro_batch_size, rollout.batch_size))
                chunks.append(self._values(rollout.select(rows)))
        return torch.cat(chunks).clone()  # cloned outside inference mode: a normal tensor

    def fit(self, batch: Experience, *, idle: Experience | None = None) -> dict[str, float]:
        """One optimizer step of the value loss on a minibatch (``idle``: a batch for the
        zero-weight passes of a rank with fewer micro-batches, FSDP).

        The loss is ``value_loss`` (``0.5 (V - G)^2``, clipped around ``batch.values`` when
        ``clip_range`` is set) averaged over the minibatch's ``critic_mask`` tokens (``token-mean``
        with the minibatch's global token count, so micro-batching does not change it).

        Returns:
            ``{"vf_loss", "vf_clipfrac", "grad_norm", "skipped", "num_tokens"}`` as floats; an
            empty dict when the minibatch has no valid token (no step taken). A non-finite loss or
            gradient norm skips the step (``skipped`` = 1) and leaves weights and optimizer state
            untouched.
        """
        num_tokens = batch.critic_mask.sum()
        reduce = self.strategy.reduce
        if reduce is not None:  # data-parallel: the count (and below the metrics) of all ranks
            num_tokens = reduce(num_tokens)
        if num_tokens.item() == 0:
            return {}
        self.critic.train()
        clipped = 0.0
        micros = list(batch.micro_batches(self.micro_batch_size))
        self.step.zero()
        for _ in range(self.strategy.idle_passes(len(micros))):
            self.step.backward(self._values(idle.rollout).sum() * 0.0)
        for micro in micros:
            values = self._values(micro.rollout)
            loss_mat, metrics = value_loss(
                values, micro.values, micro.returns, micro.critic_mask, clip_range=self.clip_range
            )
            loss = aggregate(loss_mat, micro.critic_mask, "token-mean", num_tokens=num_tokens)
            if not self.step.backward(loss):
                break
            clipped += float(metrics["vf_clipfrac"]) * float(micro.critic_mask.sum())
        out = self.step.apply()
        grad_norm = out.grad_norm if out.grad_norm is not None else float("nan")
        if not out.applied:
            return {"skipped": 1.0, "num_tokens": float(num_tokens), "grad_norm": grad_norm}
        n = float(num_tokens)
        if reduce is not None:
            out.loss, clipped = reduce(torch.tensor([out.loss, clipped], dtype=torch.float64)).tolist()
        return {
            "vf_loss": out.loss,
            "vf_clipfrac": clipped / n,
            "grad_norm": grad_norm,
            "skipped": 0.0,
            "num_tokens": n,
        }

    def state_dict(self) -> dict[str, Any]:
        """Optimizer and scheduler state (the weights are saved by ``ValueModel.save``), and the
        loss scaler's under fp16-mixed (``grad_scaler``)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.step.scaler is not None:
            state["grad_scaler"] = self.step.scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.step.scaler is not None and state.get("grad_scaler"):
            self.step.scaler.load_state_dict(state["grad_scaler"])
