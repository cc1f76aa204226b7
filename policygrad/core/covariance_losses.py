"""Clip-Cov and KL-Cov: the policy losses that act on the tokens whose log-prob/advantage
covariance is largest (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs",
section 5).

The signature, metrics and masking rules are those of :mod:`policygrad.core.losses`, which
registers both; their defaults are declared in :mod:`policygrad.specs.losses` (the paper's).
"""

from __future__ import annotations

import math

import torch

from policygrad.specs.losses import BUILTIN_POLICY_LOSSES, SELECTION_ARG

from .checks import check_number, check_same_shape, check_tensor
from .entropy import check_selection_options, covariance_selection, token_covariance
from .masking import masked_mean
from .policy_losses import ppo_loss, prepare_loss_inputs, ratio_metrics

__all__ = ["clip_cov_loss", "kl_cov_loss"]

_CLIP_COV = BUILTIN_POLICY_LOSSES["clip_cov"]
_KL_COV = BUILTIN_POLICY_LOSSES["kl_cov"]


def _selected_tokens(selected, mask: torch.Tensor, compute) -> torch.Tensor:
    """The trainer's step-level selection (bool [B, T], checked), else ``compute()`` over this batch."""
    if selected is None:
        return compute()
    selected = check_tensor(selected, SELECTION_ARG)
    check_same_shape(mask, "response_mask", selected=selected)
    return selected.to(device=mask.device).bool() & mask


def clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = _CLIP_COV["clip_low"],
    clip_high: float = _CLIP_COV["clip_high"],
    clip_cov_ratio: float = _CLIP_COV["clip_cov_ratio"],
    clip_cov_lb: float = _CLIP_COV["clip_cov_lb"],
    clip_cov_ub: float = _CLIP_COV["clip_cov_ub"],
    selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO's clipped surrogate with the gradient of a few high-covariance tokens removed
    (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs", section 5, eq. 8).

    Tokens whose log-prob/advantage covariance summand (:func:`~policygrad.core.entropy.token_covariance`)
    lies in ``[clip_cov_lb, clip_cov_ub]`` are the ones that lower the entropy most; a random
    ``clip_cov_ratio`` of the valid tokens among them (at least one) get loss 0 and no gradient,
    the rest the PPO loss of :func:`ppo_loss`. Called directly, the covariance is of this batch
    (``logprobs`` detached) and tokens PPO already clips are not chosen; in training the trainer
    passes ``selected``, drawn once over the step's whole batch from the sampling policy's
    log-probs (see :data:`SELECTION_ARG`). Defaults: the paper's ratio 2e-4 and band [1, 5].

    Metrics: the module's (of the PPO part), plus ``cov_selected_frac`` (fraction of valid tokens
    whose gradient the selection removed).

    Args:
        logprobs, old_logprobs, advantages, response_mask: [B, T] as in :func:`ppo_loss`.
        clip_low, clip_high: PPO's band.
        clip_cov_ratio: fraction of valid tokens to detach, in [0, 1].
        clip_cov_lb, clip_cov_ub: the covariance band, ``lb <= ub``.
        selected: see :data:`SELECTION_ARG`.

    Returns:
        ``(loss_matrix [B, T], metrics)``; 0 on masked and selected positions.

    Raises:
        TypeError/ValueError: as :func:`ppo_loss`; ``clip_cov_ratio`` outside [0, 1]; lb > ub.
    """
    loss, metrics = ppo_loss(
        logprobs, old_logprobs, advantages, response_mask, clip_low=clip_low, clip_high=clip_high
    )
    mask, lp, (old, adv) = prepare_loss_inputs(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )

    def select() -> torch.Tensor:
        ratio = torch.exp(lp.detach() - old)
        clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
        cov = token_covariance(lp.detach(), adv, mask)
        return covariance_selection(
            cov,
            mask,
            mode="clip_cov",
            ratio=clip_cov_ratio,
            lb=clip_cov_lb,
            ub=clip_cov_ub,
            eligible=~clipped,
        )

    # the options are checked even when the trainer supplies the selection
    check_selection_options("clip_cov", clip_cov_ratio, clip_cov_lb, clip_cov_ub)
    chosen = _selected_tokens(selected, mask, select)
    loss = torch.where(chosen, torch.zeros((), dtype=loss.dtype, device=loss.device), loss)
    metrics["cov_selected_frac"] = masked_mean(chosen.float(), mask)
    return loss, metrics


clip_cov_loss.token_selection = "clip_cov"


def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = _KL_COV["kl_cov_ratio"],
    kl_cov_coef: float = _KL_COV["kl_cov_coef"],
    selected: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate ``-r A`` plus a KL penalty ``coef |log pi - log pi_old|`` on
    the tokens with the largest log-prob/advantage covariance (Cui et al. 2025, section 5, eq. 9).

    The ``floor(kl_cov_ratio x N)`` valid tokens with the largest covariance summand
    (:func:`~policygrad.core.entropy.token_covariance`) get the penalty; the others only ``-r A``
    (no clip: the penalty is the trust region, where it matters). Called directly the covariance
    is of this batch; in training the trainer passes ``selected`` (:data:`SELECTION_ARG`).
    Defaults: the paper's 2e-3 (its 7B setting; 2e-4 for 32B) and coefficient 1.

    Metrics: the module's (no clip fractions: nothing is clipped), plus ``cov_selected_frac``.

    Args:
        logprobs, old_logprobs, advantages, response_mask: [B, T] as in :func:`ppo_loss`.
        kl_cov_ratio: fraction of valid tokens penalised, in [0, 1].
        kl_cov_coef: the penalty's coefficient, >= 0.
        selected: see :data:`SELECTION_ARG`.

    Returns:
        ``(loss_matrix [B, T], metrics)``; 0 on masked positions.

    Raises:
        TypeError/ValueError: shape mismatch; ``kl_cov_ratio`` outside [0, 1]; ``kl_cov_coef`` < 0.
    """
    kl_cov_coef = check_number(kl_cov_coef, "kl_cov_coef")
    if not (math.isfinite(kl_cov_coef) and kl_cov_coef >= 0):
        raise ValueError(f"kl_cov_coef must be a finite number >= 0, got {kl_cov_coef}")
    check_selection_options("kl_cov", kl_cov_ratio)
    mask, lp, (old, adv) = prepare_loss_inputs(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)

    def select() -> torch.Tensor:
        return covariance_selection(
            token_covariance(lp.detach(), adv, mask), mask, mode="kl_cov", ratio=kl_cov_ratio
        )

    chosen = _selected_tokens(selected, mask, select)
    loss = -adv * ratio + torch.where(chosen, kl_cov_coef * log_ratio.abs(), 0.0)
    loss = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    metrics = ratio_metrics(log_ratio, ratio, mask)
    metrics["cov_selected_frac"] = masked_mean(chosen.float(), mask)
    return loss, metrics


kl_cov_loss.token_selection = "kl_cov"
