"""The policy losses that clip or weight the importance ratio: vanilla REINFORCE, PPO, GSPO and
CISPO, with the input checks and the metrics every policy loss shares.

The signature, the metrics and the masking rules are those of :mod:`policygrad.core.losses`,
which registers each function under its name; the options' defaults are the ones declared in
:mod:`policygrad.specs.losses` (the papers' values), read from there so each is defined once.

Sources, cited on each loss: REINFORCE (Williams 1992); PPO (Schulman et al. 2017) with DAPO's
clip-higher (Yu et al. 2025) and the dual clip (Ye et al. 2020); GSPO (Zheng et al. 2025); CISPO
(MiniMax-M1, 2025).
"""

from __future__ import annotations

import math

import torch

from policygrad.specs.losses import BUILTIN_POLICY_LOSSES

from .checks import (
    as_bool_mask,
    check_2d,
    check_floating,
    check_fraction,
    check_number,
    check_same_shape,
    check_tensor,
)
from .masking import masked_mean, masked_sum

__all__ = ["cispo_loss", "gspo_loss", "ppo_loss", "prepare_loss_inputs", "ratio_metrics", "vanilla_loss"]

_PPO = BUILTIN_POLICY_LOSSES["ppo"]
_GSPO = BUILTIN_POLICY_LOSSES["gspo"]
_CISPO = BUILTIN_POLICY_LOSSES["cispo"]


def prepare_loss_inputs(
    first_name: str, first: torch.Tensor, **others: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Validate [B, T] inputs; return the bool mask, ``first`` and the others (detached), 0 where masked."""
    first = check_tensor(first, first_name)
    check_2d(first, first_name)
    check_floating(first, first_name)
    for name, value in others.items():
        check_tensor(value, name)  # None is not an optional input here
    check_same_shape(first, first_name, **others)
    mask = as_bool_mask(first, others.pop("response_mask"), first_name, "response_mask")
    zero = torch.zeros((), dtype=first.dtype, device=first.device)
    clean_first = torch.where(mask, first, zero)
    cleaned = [
        torch.where(mask, v.detach().to(device=first.device, dtype=first.dtype), zero)
        for v in others.values()
    ]
    return mask, clean_first, cleaned


def ratio_metrics(
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    mask: torch.Tensor,
    clipped_low: torch.Tensor | None = None,
    clipped_high: torch.Tensor | None = None,
    clipped_dual: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Detached float32 metrics over valid tokens (see the module docstring)."""
    with torch.no_grad():
        log_ratio = log_ratio.detach().float()
        ratio = ratio.detach().float()
        none = torch.zeros_like(mask)
        low = (clipped_low if clipped_low is not None else none) & mask
        high = (clipped_high if clipped_high is not None else none) & mask
        dual = (clipped_dual if clipped_dual is not None else none) & mask
        k3 = torch.expm1(log_ratio) - log_ratio
        zero = torch.zeros((), dtype=ratio.dtype, device=ratio.device)
        ratio_max = torch.where(mask, ratio, zero).max() if mask.numel() else zero
        return {
            "clipfrac": masked_mean((low | high | dual).float(), mask),
            "clipfrac_low": masked_mean(low.float(), mask),
            "clipfrac_high": masked_mean(high.float(), mask),
            "clipfrac_dual": masked_mean(dual.float(), mask),
            "approx_kl": masked_mean(k3, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": ratio_max,
            "num_tokens": mask.sum(),
        }


def _clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, dual-clipped for A < 0.

    Written region by region so the value is the formula's and the gradient is exactly zero in
    the clipped regions (no tie-splitting at the band's edge): A > 0 and r > 1 + clip_high gives
    the constant ``-(1 + clip_high) A``; A < 0 and r < 1 - clip_low gives ``-(1 - clip_low) A``;
    A < 0 and r > dual_clip gives ``-dual_clip A``; elsewhere ``-r A`` (gradient ``-A r grad log pi``).
    Returns ``(loss, clipped_low, clipped_high, clipped_dual)``.
    """
    with torch.no_grad():
        r = ratio.detach()
        positive = advantages > 0
        negative = advantages < 0
        clipped_high = positive & (r > 1.0 + clip_high)
        clipped_low = negative & (r < 1.0 - clip_low)
        if dual_clip is not None:
            clipped_dual = negative & (r > dual_clip)
        else:
            clipped_dual = torch.zeros_like(positive)
    surrogate_ratio = torch.where(
        clipped_high,
        ratio.new_tensor(1.0 + clip_high),
        torch.where(clipped_low, ratio.new_tensor(1.0 - clip_low), ratio),
    )
    loss = -advantages * surrogate_ratio
    if dual_clip is not None:
        loss = torch.where(clipped_dual, -dual_clip * advantages, loss)
    return loss, clipped_low, clipped_high, clipped_dual


# --------------------------------------------------------------------------------------------
# the ratio losses


def vanilla_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """On-policy policy gradient (REINFORCE): ``loss = -A * logprob`` per valid token.

    Williams (1992), REINFORCE; the policy-gradient theorem of Sutton et al. (2000). Its
    gradient is ``-A grad log pi``; averaging over samples estimates the negated policy gradient.
    ``old_logprobs`` enters only the metrics (ratio, approx_kl; on-policy the ratio is 1).

    Args:
        logprobs: [B, T] float log pi of the sampled tokens, with gradient.
        old_logprobs: [B, T] log-probs of the sampling policy (metrics only).
        advantages: [B, T] advantages (detached).
        response_mask: [B, T], nonzero = valid token.

    Returns:
        ``(loss_matrix [B, T] in logprobs' dtype, 0 on masked positions; metrics)`` with the
        module's metrics (all clip fractions are 0).

    Raises:
        TypeError: an input is not a tensor, ``logprobs`` not floating.
        ValueError: ``logprobs`` not 2-D, or another input's shape differs (names it).
    """
    mask, lp, (old, adv) = prepare_loss_inputs(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    loss = torch.where(mask, -adv * lp, zero)
    log_ratio = (lp - old).detach()
    return loss, ratio_metrics(log_ratio, torch.exp(log_ratio), mask)


def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = _PPO["clip_low"],
    clip_high: float = _PPO["clip_high"],
    dual_clip: float | None = _PPO["dual_clip"],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, per token, with optional clip-higher and dual clip.

    ``loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` with ``r = pi / pi_old``
    (Schulman et al. 2017, eq. 7). ``clip_high > clip_low`` is DAPO's clip-higher (Yu et al.
    2025, section 3.1, which uses 0.2 / 0.28). ``dual_clip = c > 1`` caps the loss of
    tokens with A < 0 at ``-c A`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with
    Deep RL", eq. 5), so a bad token whose ratio exploded cannot dominate the batch.

    Gradient by region (Schulman et al. 2017, figure 1): A > 0, r > 1 + clip_high -> 0; A < 0,
    r < 1 - clip_low -> 0; A < 0, r > c -> 0 (dual clip); elsewhere ``-A r grad log pi``. At
    r = 1 (the first step on fresh samples) this is exactly the vanilla gradient.

    Args:
        logprobs: [B, T] float log pi of the sampled tokens, with gradient.
        old_logprobs: [B, T] log pi_old (the sampling policy), detached.
        advantages: [B, T], detached.
        response_mask: [B, T], nonzero = valid token.
        clip_low: lower band 1 - clip_low, in [0, 1].
        clip_high: upper band 1 + clip_high, >= 0.
        dual_clip: None, or the dual-clip constant c > 1.

    Returns:
        ``(loss_matrix [B, T], metrics)``; 0 on masked positions; the module's metrics.

    Raises:
        TypeError: an input is not a tensor or an option not a number.
        ValueError: shape mismatch (names the argument); ``clip_low`` outside [0, 1];
            ``clip_high`` < 0; ``dual_clip`` <= 1.
    """
    clip_low = check_fraction(clip_low, "clip_low", allow_none=False, upper=1.0)
    clip_high = check_fraction(clip_high, "clip_high", allow_none=False)
    if dual_clip is not None:
        dual_clip = check_number(dual_clip, "dual_clip", or_none=True)
        if not (math.isfinite(dual_clip) and dual_clip > 1.0):
            raise ValueError(f"dual_clip must be a finite number > 1 (e.g. 3.0), or None; got {dual_clip}")
    mask, lp, (old, adv) = prepare_loss_inputs(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    loss, low, high, dual = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    loss = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return loss, ratio_metrics(log_ratio, ratio, mask, low, high, dual)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = _GSPO["clip_low"],
    clip_high: float = _GSPO["clip_high"],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: clipped surrogate on the length-normalised sequence ratio (Zheng et al. 2025).

    ``s_i = exp(mean over valid t of (log pi - log pi_old))`` = (pi(y_i) / pi_old(y_i))^(1/|y_i|),
    clipped per sequence to [1 - clip_low, 1 + clip_high] (GSPO eq. 5-7). Implemented in the
    paper's token-level form (GSPO-token, eq. 13-14): ``s_it = sg(s_i) * pi_t / sg(pi_t)``, whose
    value is ``s_i`` on every token and whose gradient w.r.t. ``log pi_t`` is ``s_i``; the
    per-token loss is ``-min(s_it A_it, clip(s_it) A_it)``. Reduced with the ``seq-mean-token-mean``
    aggregation (mean over each sequence's tokens, then over sequences) and a per-sequence
    advantage, the gradient equals the sequence-level GSPO gradient
    ``-A_i grad s_i``. Defaults 3e-4 / 4e-4 are the paper's clipping ranges (section 5.1);
    sequence ratios are far closer to 1 than token ratios, hence the tiny band.

    Metrics: as the module's, with ``ratio_mean`` / ``ratio_max`` of the sequence ratio ``s_i``
    (each sequence weighted by its valid tokens), the clip fractions counting the valid tokens
    of clipped sequences, and ``approx_kl`` from the token ratios.

    Args:
        logprobs, old_logprobs, advantages, response_mask: [B, T] as in :func:`ppo_loss`.
        clip_low: lower band of the sequence ratio, in [0, 1].
        clip_high: upper band, >= 0.

    Returns:
        ``(loss_matrix [B, T], metrics)``; 0 on masked positions. A row with no valid token
        contributes 0 and no gradient.

    Raises:
        TypeError/ValueError: as :func:`ppo_loss`.
    """
    clip_low = check_fraction(clip_low, "clip_low", allow_none=False, upper=1.0)
    clip_high = check_fraction(clip_high, "clip_high", allow_none=False)
    mask, lp, (old, adv) = prepare_loss_inputs(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    token_log_ratio = lp - old
    lengths = mask.sum(dim=-1).clamp_min(1).to(lp.dtype)
    seq_log_ratio = masked_sum(token_log_ratio, mask, dim=-1) / lengths  # [B]
    log_s = seq_log_ratio.detach()[:, None] + lp - lp.detach()
    s = torch.exp(log_s)
    loss, low, high, _ = _clipped_surrogate(s, adv, clip_low, clip_high, None)
    loss = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    metrics = ratio_metrics(token_log_ratio, s, mask, low, high)
    return loss, metrics


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float | None = _CISPO["clip_low"],
    clip_high: float | None = _CISPO["clip_high"],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clipped, detached importance weight times the REINFORCE term (MiniMax-M1, 2025).

    ``loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi`` with ``r = pi / pi_old``
    (MiniMax-M1 technical report, eq. 4-5). Unlike PPO no token's gradient is ever dropped: the
    clip bounds the weight, the gradient ``-w A grad log pi`` always flows. ``clip_low=None``
    means no lower bound, as in the paper (which sets the lower range large and tunes only the
    upper one, without publishing its value); ``clip_high=None`` means no upper bound. The
    default ``clip_high=0.28`` borrows DAPO's upper clip; tune it.

    Metrics: as the module's, except that the clip fractions count tokens whose weight was
    truncated (any sign of A): ``clipfrac_high`` r > 1 + clip_high, ``clipfrac_low``
    r < 1 - clip_low. Their gradient is scaled down, not removed.

    Args:
        logprobs, old_logprobs, advantages, response_mask: [B, T] as in :func:`ppo_loss`.
        clip_low: None or a number in [0, 1].
        clip_high: None or a number >= 0.

    Returns:
        ``(loss_matrix [B, T], metrics)``; 0 on masked positions.

    Raises:
        TypeError/ValueError: as :func:`ppo_loss`.
    """
    clip_low = check_fraction(clip_low, "clip_low", allow_none=True, upper=1.0)
    clip_high = check_fraction(clip_high, "clip_high", allow_none=True)
    mask, lp, (old, adv) = prepare_loss_inputs(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    log_ratio = (lp - old).detach()
    ratio = torch.exp(log_ratio)
    lower = None if clip_low is None else 1.0 - clip_low
    upper = None if clip_high is None else 1.0 + clip_high
    weight = ratio.clamp(min=lower, max=upper) if (lower is not None or upper is not None) else ratio
    loss = torch.where(mask, -(weight * adv) * lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
    low = ratio < lower if lower is not None else None
    high = ratio > upper if upper is not None else None
    return loss, ratio_metrics(log_ratio, ratio, mask, low, high)
