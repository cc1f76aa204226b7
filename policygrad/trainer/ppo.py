"""The parts of the trainer that PPO with a learned critic adds, usable by any algorithm:

- :class:`RewardNormalizer`: ``reward.normalize`` (a fixed offset from samples of the initial
  policy, or running mean/std with optional clipping);
- :func:`monte_carlo_returns`: the lam = 1 value targets of the critic-pretraining phase;
- :class:`CriticTrainer`: the value model's own optimizer, its value estimates at rollout time
  and its minibatch updates with optional value clipping;
- :class:`PtxData` and :func:`ptx_loss`: PPO-ptx, a language-modelling loss on pretraining/SFT
  text mixed into the policy update (Ouyang et al. 2022, eq. 2).

Sources: the seed's sections on critics/TD/GAE (value targets are lambda-returns), PPO (value
loss and clipping), "PPO for language models" and the RLHF details (reward normalisation, value
pretraining, PPO-ptx); Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO";
Zheng et al. 2023, "Secrets of RLHF in Large Language Models Part I: PPO"; Yuan et al. 2025
(VC-PPO, value pretraining with lam = 1).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import torch

from policygrad.core.advantages import estimate_advantages
from policygrad.core.logprobs import logprobs_from_logits
from policygrad.core.losses import value_loss
from policygrad.core.masking import aggregate, masked_mean
from policygrad.trainer.optim import make_adamw

__all__ = [
    "REWARD_NORMALIZATIONS",
    "CriticTrainer",
    "PtxData",
    "RewardNormalizer",
    "monte_carlo_returns",
    "ptx_loss",
]

REWARD_NORMALIZATIONS = ("none", "fixed_offset", "running")


class RewardNormalizer:
    """Sequence-score normalisation, applied to the reward functions' scores before the EOS
    penalty and the KL shaping.

    Modes:

    - ``none``: scores unchanged.
    - ``fixed_offset``: the first batch it sees (samples of the initial policy) sets
      ``offset = mean(scores)`` over its valid rows; every batch, that one included, becomes
      ``scores - offset``, so samples of the initial policy score 0 on average. This is N+ detail
      15 (Huang et al. 2024), which sets the reward head's bias so a reference distribution has
      mean reward 0; here the reference distribution is the initial policy's samples.
    - ``running``: running mean and population variance over every valid score seen so far
      (Chan et al. parallel update, the current batch included), then
      ``(scores - mean) / (std + eps)`` ("Secrets of RLHF", reward normalisation with running
      statistics).

    With ``clip`` set, the result is clamped to ``[-clip, clip]`` ("Secrets of RLHF" clips the
    normalised reward).

    Args:
        mode: one of :data:`REWARD_NORMALIZATIONS`.
        clip: None or a number > 0.
        eps: added to the running std, > 0.

    Raises:
        ValueError: unknown ``mode`` (lists the valid ones), ``clip`` <= 0, ``eps`` <= 0.
    """

    def __init__(self, mode: str = "none", *, clip: float | None = None, eps: float = 1e-8):
        if mode not in REWARD_NORMALIZATIONS:
            raise ValueError(
                f"unknown reward normalisation {mode!r}; valid: {', '.join(REWARD_NORMALIZATIONS)}"
            )
        if clip is not None and not clip > 0:
            raise ValueError(f"reward normalisation clip must be > 0 or None, got {clip!r}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.mode = mode
        self.clip = clip
        self.eps = eps
        self.offset: float | None = None
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        """Population std of the scores seen so far (0 before any)."""
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def _update(self, values: torch.Tensor) -> None:
        n = values.numel()
        if n == 0:
            return
        batch_mean = values.double().mean().item()
        batch_m2 = ((values.double() - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def __call__(
        self, scores: torch.Tensor, valid: torch.Tensor | None = None, *, update: bool = True
    ) -> torch.Tensor:
        """Normalise a batch of scores.

        Args:
            scores: float [B] sequence scores.
            valid: bool [B]; only valid rows update the statistics (all rows when None). Every
                row is transformed.
            update: False transforms with the current statistics without updating them (e.g. the
                greedy baseline's scores of ReMax); the fixed offset is still set by the first
                batch that updates.

        Returns:
            float32 [B].

        Raises:
            ValueError: ``scores`` not 1-D, or ``valid`` of another shape.
        """
        scores = torch.as_tensor(scores, dtype=torch.float32)
        if scores.dim() != 1:
            raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
        if valid is None:
            valid = torch.ones_like(scores, dtype=torch.bool)
        valid = torch.as_tensor(valid, dtype=torch.bool)
        if valid.shape != scores.shape:
            raise ValueError(
                f"valid must have the shape of scores {tuple(scores.shape)}, got {tuple(valid.shape)}"
            )
        if self.mode == "none":
            out = scores.clone()
        elif self.mode == "fixed_offset":
            if self.offset is None and update and bool(valid.any()):
                self.offset = scores[valid].double().mean().item()
            out = scores - (self.offset or 0.0)
        else:
            if update:
                self._update(scores[valid])
            out = (scores - self.mean) / (self.std + self.eps)
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out.float()

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: offset, count, mean, m2."""
        return {"offset": self.offset, "count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.offset = state["offset"]
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])


def monte_carlo_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0):
    """Monte-Carlo returns ``G_t = sum_{l >= 0} gamma^l r_{t+l}`` over the valid tokens of each row.

    Computed as the returns of ``gae`` with lam = 1 and zero values (seed section 5: with lam = 1
    the lambda-return is the Monte-Carlo return, whatever the critic says). These are the value
    targets of the critic-pretraining phase (Yuan et al. 2025, VC-PPO; "Secrets of RLHF").

    Args:
        token_rewards: [B, T] float per-token rewards.
        response_mask: [B, T], nonzero on valid tokens.
        gamma: discount in [0, 1].

    Returns:
        [B, T] returns, 0 on masked positions.

    Raises:
        ValueError: as the ``gae`` estimator (shapes, gamma outside [0, 1]).
    """
    zeros = torch.zeros_like(token_rewards)
    group_index = torch.arange(token_rewards.shape[0], device=token_rewards.device)
    _, returns = estimate_advantages(
        "gae", token_rewards, response_mask, group_index=group_index, values=zeros, gamma=gamma, lam=1.0
    )
    return returns


class CriticTrainer:
    """The value model with its own AdamW optimizer, learning-rate schedule and value loss.

    The critic is a separate network, so the ``c1`` weight of PPO's combined loss (Schulman et
    al. 2017, eq. 9) becomes the critic's own learning rate (seed section 7).

    Args:
        critic: a :class:`policygrad.models.value.ValueModel`.
        lr, betas, eps, weight_decay: AdamW settings.
        max_grad_norm: gradient-norm clip, > 0.
        clip_range: value clipping ``eps_v`` (None: off); see :func:`policygrad.core.losses.value_loss`.
        micro_batch_size: sequences per forward.
        lr_lambda: a ``LambdaLR`` factor of the optimizer step (None: constant).
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
    ):
        self.critic = critic
        self.params = [p for p in critic.parameters() if p.requires_grad]
        self.optimizer = make_adamw(
            self.params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda or (lambda step: 1.0))
        self.max_grad_norm = max_grad_norm
        self.clip_range = clip_range
        self.micro_batch_size = micro_batch_size

    def values(self, rollout) -> torch.Tensor:
        """float32 [B, T] ``V(s_t)`` of a rollout at rollout time (no gradient), in micro-batches."""
        chunks = []
        with torch.inference_mode():
            for start in range(0, rollout.batch_size, self.micro_batch_size):
                rows = torch.arange(start, min(start + self.micro_batch_size, rollout.batch_size))
                chunks.append(self.critic.response_values(rollout.select(rows)))
        return torch.cat(chunks).clone()  # cloned outside inference mode: a normal tensor

    def fit_minibatch(
        self,
        rollout,
        rows: torch.Tensor,
        old_values: torch.Tensor,
        returns: torch.Tensor,
        mask: torch.Tensor,
    ) -> dict[str, float]:
        """One optimizer step of the value loss on the rows ``rows`` of a batch.

        The loss is ``value_loss`` (``0.5 (V - G)^2``, clipped around ``old_values`` when
        ``clip_range`` is set) averaged over the minibatch's valid tokens (``token-mean`` with the
        minibatch's global token count, so micro-batching does not change it).

        Args:
            rollout: the step's rollout (all B rows).
            rows: LongTensor of the minibatch's row ids.
            old_values, returns, mask: [B, T] rollout-time values, value targets, and the mask of
                tokens that train the critic.

        Returns:
            ``{"vf_loss", "vf_clipfrac", "grad_norm", "skipped", "num_tokens"}`` as floats; an
            empty dict when the minibatch has no valid token (no step taken). A non-finite loss or
            gradient norm skips the step (``skipped`` = 1) and leaves weights and optimizer state
            untouched.
        """
        mb_mask = mask[rows]
        num_tokens = mb_mask.sum()
        if num_tokens.item() == 0:
            return {}
        self.critic.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        clipped = 0.0
        finite = True
        for micro in torch.split(rows, self.micro_batch_size):
            sub = rollout.select(micro)
            m = mask[micro]
            values = self.critic.response_values(sub)
            loss_mat, metrics = value_loss(
                values, old_values[micro], returns[micro], m, clip_range=self.clip_range
            )
            loss = aggregate(loss_mat, m, "token-mean", num_tokens=num_tokens)
            if not torch.isfinite(loss):
                finite = False
                break
            loss.backward()
            total_loss += loss.item()
            clipped += float(metrics["vf_clipfrac"]) * float(m.sum())
        grad_norm = float("nan")
        if finite:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
            finite = math.isfinite(grad_norm)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            return {"skipped": 1.0, "num_tokens": float(num_tokens), "grad_norm": grad_norm}
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = float(num_tokens)
        return {
            "vf_loss": total_loss,
            "vf_clipfrac": clipped / n,
            "grad_norm": grad_norm,
            "skipped": 0.0,
            "num_tokens": n,
        }

    def state_dict(self) -> dict[str, Any]:
        """Optimizer and scheduler state (the weights are saved by ``ValueModel.save``)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


# ----------------------------------------------------------------------------------------------
# PPO-ptx


class PtxData:
    """A cyclic, resumable stream of tokenized text for the PPO-ptx language-modelling loss.

    Args:
        path: a JSONL file, one object per line with a string field ``field`` (blank lines
            skipped).
        tokenizer: the POLICY's tokenizer.
        field: the text field, default ``"text"``.
        max_length: tokens per text, >= 2 (longer texts are cut at the end).
        batch_size: texts per batch, >= 1.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line that is not a JSON object with a non-empty string ``field`` (names the
            line and the fields present); no text with at least 2 tokens; bad sizes.
    """

    def __init__(
        self, path: str, tokenizer, *, field: str = "text", max_length: int = 256, batch_size: int = 4
    ):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"ptx.dataset {path!r} does not exist; give a JSONL file of {{{field!r}: ...}}"
            )
        if max_length < 2:
            raise ValueError(f"ptx.max_length must be >= 2, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"ptx.batch_size must be >= 1, got {batch_size}")
        self.sequences: list[list[int]] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"ptx.dataset {path}:{lineno} is not valid JSON ({exc})") from None
                text = row.get(field) if isinstance(row, dict) else None
                if not isinstance(text, str) or not text:
                    fields = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
                    raise ValueError(
                        f"ptx.dataset {path}:{lineno} has no non-empty string field {field!r} "
                        f"(fields: {fields}); set ptx.text_field"
                    )
                ids = tokenizer(text, add_special_tokens=True, truncation=True, max_length=max_length)[
                    "input_ids"
                ]
                if len(ids) >= 2:
                    self.sequences.append(list(ids))
        if not self.sequences:
            raise ValueError(f"ptx.dataset {path} holds no text of at least 2 tokens")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.batch_size = batch_size
        self.position = 0

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``batch_size`` texts (wrapping around), right-padded.

        Returns:
            ``(input_ids LongTensor [b, L], attention_mask LongTensor [b, L])``.
        """
        seqs = [self.sequences[(self.position + i) % len(self.sequences)] for i in range(self.batch_size)]
        self.position += self.batch_size
        length = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), length), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = 1
        return ids, mask


def ptx_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood of right-padded text, the PPO-ptx term.

    ``L_ptx = -mean over real next tokens of log pi(x_{j+1} | x_{<=j})`` at temperature 1 (the
    model's own distribution, not the sampling temperature: this is plain language modelling).
    InstructGPT maximises ``E[r - beta log(pi/pi_SFT)] + gamma E_pretrain[log pi(x)]`` (Ouyang et
    al. 2022, eq. 2) with ``gamma = 27.8`` for its PPO-ptx models; the trainer adds
    ``ptx.coef * L_ptx`` to the policy loss.

    Args:
        model: a causal LM.
        input_ids: LongTensor [b, L], right-padded.
        attention_mask: [b, L], 1 on real tokens (a prefix of each row).

    Returns:
        0-d float32 loss, differentiable with respect to the model's parameters.

    Raises:
        ValueError: shapes differ, fewer than 2 columns, or no row with 2 real tokens.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both "
            "be [b, L] with L >= 2"
        )
    mask = attention_mask[:, 1:] * attention_mask[:, :-1]
    if not bool(mask.any()):
        raise ValueError("ptx_loss needs at least one row with 2 real tokens")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature=1.0)
    return -masked_mean(logprobs, mask)
