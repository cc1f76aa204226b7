"""The policy objective of one micro-batch: the registered policy loss per token, the truncated
importance weight against the sampler mismatch, the KL term of a KL-in-the-loss placement and the
entropy bonus, reduced with the minibatch's global token and sequence counts."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policygrad.core.entropy import covariance_selection, token_covariance
from policygrad.core.importance import truncated_importance_weights
from policygrad.core.kl import KLPlacement
from policygrad.core.losses import SELECTION_ARG
from policygrad.core.masking import aggregate, masked_mean
from policygrad.learn.experience import Experience

__all__ = ["MinibatchCounts", "PolicyObjective", "positive_samples"]


def positive_samples(scores: torch.Tensor, valid: torch.Tensor, dist=None) -> torch.Tensor:
    """The samples VAPO's positive-example LM loss trains on (Yue et al. 2025, section 4.3):
    float [B], 1 where a valid sample's score is the highest of the step's batch (over every rank
    with ``dist``), provided some valid sample scored lower (with a 0/1 verifier: the correct
    ones; a batch of equal scores has none)."""
    scores = scores.float()
    neg = torch.tensor(-torch.inf, dtype=scores.dtype, device=scores.device)
    pos = torch.tensor(torch.inf, dtype=scores.dtype, device=scores.device)
    hi = torch.where(valid, scores, neg).max() if scores.numel() else neg
    lo = torch.where(valid, scores, pos).min() if scores.numel() else pos
    if dist is not None and dist.active:
        hi, lo = dist.reduce(hi, "max"), dist.reduce(lo, "min")
    if not bool(hi > lo):
        return torch.zeros_like(scores, dtype=torch.float32)
    return (valid & (scores == hi)).float()


@dataclass(frozen=True)
class MinibatchCounts:
    """The normalisers of a minibatch, shared by its micro-batches (and, later, summed over
    ranks): valid tokens and sequences with at least one valid token, as 0-d tensors;
    ``num_positive_tokens`` the valid tokens of the positive-example LM loss's samples (None
    when it is off)."""

    num_tokens: torch.Tensor
    num_seqs: torch.Tensor
    num_positive_tokens: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        loss_mask: torch.Tensor,
        positive: torch.Tensor | None = None,
        sample_tokens: torch.Tensor | None = None,
    ) -> MinibatchCounts:
        """Counts of a [B, T] loss mask (and of its rows flagged by ``positive`` [B]). With
        ``sample_tokens`` [B] (each row's sample's valid tokens, over all the rows a sample spans:
        an episode's segments), a row counts as its share of its sample's tokens, so a sample
        counts once however its rows fall into minibatches."""
        pos = None if positive is None else (loss_mask * positive[:, None].to(loss_mask)).sum()
        if sample_tokens is None:
            return cls(loss_mask.sum(), (loss_mask.sum(-1) > 0).sum(), pos)
        tokens = loss_mask.sum(-1)
        share = torch.where(tokens > 0, tokens / sample_tokens.to(tokens).clamp_min(1), 0.0)
        return cls(loss_mask.sum(), share.sum(), pos)

    def reduced(self, reduce) -> MinibatchCounts:
        """The counts summed over ranks with ``reduce`` (None: unchanged)."""
        if reduce is None:
            return self
        pos = None if self.num_positive_tokens is None else reduce(self.num_positive_tokens)
        return MinibatchCounts(reduce(self.num_tokens), reduce(self.num_seqs), pos)


class PolicyObjective:
    """``loss(logprobs, entropy, old_logprobs, micro, counts) -> (loss, metrics, mask)``.

    Per token: ``policy_loss(logprobs, old, A, mask, **loss_options)``, times the truncated
    importance weight ``pi_old(trainer) / pi_sampler`` when ``is_level`` is set (Yao et al. 2025),
    plus ``beta x`` the KL placement's loss term (none unless the KL sits in the loss), minus
    ``entropy_coef x`` entropy; then :func:`~policygrad.core.masking.aggregate` with the
    minibatch's counts, so the summed gradient of the micro-batches equals the minibatch's.
    A covariance loss (``clip_cov``, ``kl_cov``) gets the step's token selection
    (``micro.cov_selected``). With ``positive_lm_coef``, VAPO's positive-example LM loss
    (Yue et al. 2025, section 4.3): ``coef x`` the summed negative log-likelihood of the positive
    samples' tokens over the minibatch's count of them, added to the aggregated loss.

    A token the sampler drew but the trainer's top-k/top-p set excludes has log-prob -inf here
    (the two sides' last bits disagree at the set's edge): it cannot be trained on, so it leaves
    the loss and is counted in ``nonfinite_tokens`` of the metrics.

    Attributes (seams a caller may replace): ``policy_loss`` (the registered function),
    ``loss_options`` (only the options the user set), :meth:`reduce`.
    """

    def __init__(
        self,
        policy_loss,
        loss_options: Mapping[str, Any],
        *,
        agg_mode: str,
        max_len: int,
        kl: KLPlacement,
        kl_kind: str,
        kl_importance_weighted: bool = False,
        entropy_coef: float = 0.0,
        is_level: str | None = None,
        is_cap: float = 2.0,
        is_mode: str = "truncate",
        is_floor: float | None = None,
        positive_lm_coef: float = 0.0,
    ):
        self.policy_loss = policy_loss
        self.loss_options = dict(loss_options)
        self.agg_mode = agg_mode
        self.max_len = max_len
        self.kl = kl
        self.kl_kind = kl_kind
        self.kl_importance_weighted = kl_importance_weighted
        self.entropy_coef = entropy_coef
        self.is_level = is_level
        self.is_cap = is_cap
        self.is_mode = is_mode
        self.is_floor = is_floor
        self.positive_lm_coef = positive_lm_coef

    @property
    def token_selection(self) -> str | None:
        """The covariance selection the policy loss acts on (``clip_cov``/``kl_cov``), or None."""
        return getattr(self.policy_loss, "token_selection", None)

    def rows_with_gradient(self, exp: Experience) -> torch.Tensor | None:
        """bool [B]: the rows of ``exp`` whose loss can have a gradient; the others' loss and
        gradient are exactly 0 whatever the weights (every advantage 0, or no token in the loss),
        so a forward and backward of them change nothing but the metrics. None when that cannot
        be known row by row: the policy loss does not declare ``vanishes_at_zero_advantage``
        (the covariance losses choose tokens over the whole batch), the loss has a term that
        does not vanish with the advantages (the entropy bonus, the positive-example LM loss), or
        a KL to the reference has beta > 0 (wherever it is placed: a check that needs no knowledge
        of the placement, and in the reward it rarely leaves an advantage of exactly 0)."""
        if not getattr(self.policy_loss, "vanishes_at_zero_advantage", False):
            return None
        if self.entropy_coef or self.positive_lm_coef:
            return None
        if exp.ref_logprobs is not None and exp.kl_coef != 0:
            return None
        return ((exp.advantages != 0) & (exp.loss_mask > 0)).any(dim=-1)

    def reduce(
        self, loss_matrix: torch.Tensor, mask: torch.Tensor, counts: MinibatchCounts, sample_tokens=None
    ) -> torch.Tensor:
        """The scalar loss of a micro-batch: ``aggregate`` with the minibatch's counts (and, for
        rows of samples that span several, each row's sample's tokens)."""
        return aggregate(
            loss_matrix,
            mask,
            self.agg_mode,
            num_tokens=counts.num_tokens,
            num_seqs=counts.num_seqs,
            max_len=self.max_len,
            seq_lengths=sample_tokens,
        )

    def __call__(
        self,
        logprobs: torch.Tensor,
        entropy: torch.Tensor,
        old: torch.Tensor,
        micro: Experience,
        counts: MinibatchCounts,
    ) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor]:
        """The loss of one trimmed micro-batch.

        Args:
            logprobs: [b, T] float32 log-probs with gradient.
            entropy: [b, T] entropy (with gradient when ``entropy_coef`` is set).
            old: [b, T] the log-probs of the policy before the update (detached).
            micro: the micro-batch's view of the step's :class:`Experience`, trimmed to T.
            counts: the minibatch's counts.

        Returns:
            ``(loss 0-d, metrics, mask [b, T])``: metrics are 0-d tensors or floats, per-token
            means over ``mask`` except ``*_max`` and ``nonfinite_tokens`` (a count); ``mask`` is
            the loss mask actually used (without non-finite tokens).
        """
        mask = micro.loss_mask
        usable = torch.isfinite(logprobs.detach()) & torch.isfinite(old)
        dropped = (mask > 0) & ~usable
        nonfinite = int(dropped.sum()) if dropped.any() else 0
        if nonfinite:
            mask = mask * usable.to(mask)
        options = self.loss_options
        if self.token_selection is not None and micro.cov_selected is not None:
            options = {**options, SELECTION_ARG: micro.cov_selected}
        loss_mat, m = self.policy_loss(logprobs, old, micro.advantages, mask, **options)
        if self.is_level is not None:
            sampler = micro.rollout.sampler_logprobs
            is_w = truncated_importance_weights(
                sampler,
                old,
                mask,
                level=self.is_level,
                cap=self.is_cap,
                mode=self.is_mode,
                floor=self.is_floor,
            )
            loss_mat = loss_mat * is_w
            m.update(_is_metrics(sampler, old, mask, is_w, self.is_level, self.is_cap, self.is_floor))
        if micro.ref_logprobs is not None:
            kl_mat = self.kl.loss_term(
                logprobs,
                micro.ref_logprobs,
                mask,
                kind=self.kl_kind,
                old_logprobs=old if self.kl_importance_weighted else None,
            )
            if kl_mat is not None:
                loss_mat = loss_mat + micro.kl_coef * kl_mat
                m = {**m, "kl_loss": masked_mean(kl_mat.detach(), mask)}
        if self.entropy_coef:
            loss_mat = loss_mat - self.entropy_coef * torch.where(mask > 0, entropy, 0.0)
        m = {**m, "entropy": masked_mean(entropy.detach(), mask), "nonfinite_tokens": nonfinite}
        loss = self.reduce(loss_mat, mask, counts, micro.sample_tokens)
        if self.positive_lm_coef and micro.positive is not None:
            positive = mask * micro.positive[:, None].to(mask)
            nll = -torch.where(positive > 0, logprobs, 0.0).sum()
            loss = loss + self.positive_lm_coef * nll / counts.num_positive_tokens.clamp_min(1)
            m["positive_lm_nll"] = masked_mean(-logprobs.detach(), positive)
            m["positive_frac"] = masked_mean(positive, mask)
        return loss, m, mask

    def covariance_tokens(self, advantages, logprobs, loss_mask, dist) -> torch.Tensor:
        """The tokens a covariance loss acts on this step (bool [B, T], this rank's rows): chosen
        once over every rank's batch (``dist``), from the covariance of the advantages with the
        log-probs of the policy before the update (the old ones, else the sampler's), so neither
        micro-batches, minibatches nor the number of ranks change which tokens they are (Cui et
        al. 2025, sec. 5)."""
        d = dist
        options = {**self.policy_loss.options, **self.loss_options}
        mode = self.token_selection
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


def _is_metrics(
    sampler_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    level: str,
    cap: float,
    floor: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token means of the importance weights actually applied and of the fraction of valid
    tokens whose raw ratio ``pi_trainer / pi_sampler`` (token level) or sequence ratio (sequence
    level) exceeded ``cap`` (clipped in ``truncate`` mode, dropped in ``mask`` mode). [B, T] inputs."""
    with torch.no_grad():
        valid = mask > 0
        log_ratio = torch.where(valid, logprobs.float() - sampler_logprobs.float(), 0.0)
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        capped = (log_ratio > math.log(cap)) & valid
        out = {
            "is_weight_mean": masked_mean(weights.float(), mask),
            "is_capped_frac": masked_mean(capped.float(), mask),
        }
        if floor is not None:
            out["is_floored_frac"] = masked_mean(((log_ratio < math.log(floor)) & valid).float(), mask)
        return out
