"""Policy losses (a registry, one signature), the value loss and the entropy of a softmax.

Every policy loss has the signature

    fn(logprobs[B, T], old_logprobs[B, T], advantages[B, T], response_mask[B, T], **options)
        -> (loss_matrix[B, T], metrics: dict[str, Tensor])

``loss_matrix`` holds the per-token loss to MINIMISE (the negated surrogate objective), exactly 0
on masked positions; reduce it with ``policygrad.core.masking.aggregate`` and a named mode.
``advantages`` and ``old_logprobs`` are constants (detached); only ``logprobs`` carries gradient.
Masked positions may hold NaN or inf: inputs are selected with :func:`torch.where` before any
arithmetic, so garbage there reaches neither the loss nor any gradient.

Metrics (detached 0-d tensors, over the valid tokens of the given batch):

- ``clipfrac``: fraction of valid tokens whose gradient the clip removes. For PPO this depends
  on the sign of the advantage (ratio 1.5 with A < 0 is NOT clipped: PPO always lets a mistake
  be undone); it is ``clipfrac_low + clipfrac_high + clipfrac_dual``.
- ``clipfrac_low``: tokens with A < 0 and ratio < 1 - clip_low (gradient removed).
- ``clipfrac_high``: tokens with A > 0 and ratio > 1 + clip_high (gradient removed).
- ``clipfrac_dual``: tokens with A < 0 and ratio > dual_clip (the dual clip's constant region).
- ``approx_kl``: mean k3 estimate of KL(pi_old || pi) on the sampled tokens,
  ``(r - 1) - log r`` with ``r = pi / pi_old`` (Schulman 2020, "Approximating KL
  divergence"; the ``approx_kl`` diagnostic of the reference PPO implementations).
- ``ratio_mean``, ``ratio_max``: of the importance ratio pi / pi_old over valid tokens
  (``ratio_max`` is 0 when there is no valid token).
- ``num_tokens``: int64 count of valid tokens. Every other metric except ``ratio_max`` is a mean
  over these tokens, so the exact average over micro-batches (and ranks) is
  ``sum(metric * num_tokens) / sum(num_tokens)``; ``ratio_max`` combines with ``max``.

Registered losses: ``vanilla``, ``ppo``, ``gspo``, ``cispo``, ``clip_cov``, ``kl_cov``. Adding one is
one decorated function: ``@register_policy_loss("name")``. A loss declares its options (keyword-only
parameters whose defaults are the paper's values); :func:`policy_loss_options` lists them and
:func:`check_policy_loss_options` validates a configuration's options before training starts.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .checks import (
    as_bool_mask,
    check_2d,
    check_chunk_size,
    check_floating,
    check_fraction,
    check_number,
    check_same_shape,
    check_temperature,
    check_tensor,
)
from .entropy import check_selection_options, covariance_selection, token_covariance
from .logprobs import row_blocks
from .masking import masked_mean, masked_sum

__all__ = [
    "PolicyLossFn",
    "check_policy_loss_options",
    "cispo_loss",
    "clip_cov_loss",
    "entropy_from_logits",
    "get_policy_loss",
    "gspo_loss",
    "kl_cov_loss",
    "list_policy_losses",
    "policy_loss_options",
    "ppo_loss",
    "register_policy_loss",
    "vanilla_loss",
    "value_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""``fn(logprobs, old_logprobs, advantages, response_mask, **options) -> (loss_matrix, metrics)``."""

_POLICY_LOSSES: dict[str, PolicyLossFn] = {}

SELECTION_ARG = "selected"
"""A keyword a loss that acts on a batch-level token selection (``clip_cov``, ``kl_cov``) takes
besides its options: the [B, T] bool selection computed by the trainer over the whole step batch
(so micro-batches and ranks cannot change it). Not an option: a config cannot set it. Such a
loss carries ``fn.token_selection`` (its :func:`~policygrad.core.entropy.covariance_selection`
mode); called without ``selected`` it selects over the tokens it is given."""


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``.

    Usage: ``@register_policy_loss("my_loss")`` above a function with the module's signature.
    The loss declares its options as keyword-only parameters, each with a default (the paper's
    value); registration records them, in signature order, as ``fn.options`` (a dict name ->
    default), read by :func:`policy_loss_options` and :func:`check_policy_loss_options`. The
    function itself is registered and returned unchanged.

    Raises:
        TypeError: ``name`` is not a non-empty string; the function does not take exactly the
            four tensors ``(logprobs, old_logprobs, advantages, response_mask)`` positionally,
            takes ``*args`` / ``**kwargs``, or has a keyword-only option without a default.
        ValueError: ``name`` is already registered (names must be unique; pick another name).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"policy loss name must be a non-empty string, got {name!r}")
    if name in _POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r} is already registered; choose another name")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in _POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered; choose another name")
        fn.options = _declared_options(name, fn)
        _POLICY_LOSSES[name] = fn
        return fn

    return decorator


def _declared_options(name: str, fn: PolicyLossFn) -> dict[str, Any]:
    """The keyword-only parameters of ``fn`` with their defaults; see :func:`register_policy_loss`."""
    params = inspect.signature(fn).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(positional) != 4 or variadic:
        raise TypeError(
            f"policy loss {name!r} must have the signature fn(logprobs, old_logprobs, advantages, "
            "response_mask, *, option=default, ...): four positional tensors and its options "
            "declared by name (no *args / **kwargs)"
        )
    options = {}
    for p in params:
        if p.kind is not p.KEYWORD_ONLY or p.name == SELECTION_ARG:
            continue
        if p.default is p.empty:
            raise TypeError(
                f"policy loss {name!r}: option {p.name!r} needs a default (the paper's value), "
                "so that a config may leave it unset"
            )
        options[p.name] = p.default
    return options


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(list_policy_losses())}")
    return _POLICY_LOSSES[name]


def list_policy_losses() -> list[str]:
    """Sorted names of the registered policy losses."""
    return sorted(_POLICY_LOSSES)


def policy_loss_options(name: str) -> dict[str, Any]:
    """The options the policy loss ``name`` declares, with their defaults (a new dict).

    ``policy_loss_options("gspo") == {"clip_low": 3e-4, "clip_high": 4e-4}``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    return dict(get_policy_loss(name).options)


def _describe_options(options: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} (default {v!r})" for k, v in options.items()) or "(none)"


def check_policy_loss_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate options for the policy loss ``name`` now, before any model is loaded.

    First every option must be one the loss declares; then the values are checked by calling
    the loss once on a dummy batch ([1, 2] float32 zeros, mask all ones) with exactly the given
    options, so the loss's own checks run (unset options keep the function's defaults).

    Args:
        name: a registered policy loss.
        options: option name -> value, e.g. ``{"clip_high": 0.28}``; an explicit None is passed
            on as None (for ``cispo``, ``clip_high=None`` means no upper bound).

    Returns:
        ``dict(options)``.

    Raises:
        ValueError: unknown loss (lists the registered ones); an option the loss does not
            declare (names the loss and lists its options with their defaults); a bad value
            (the loss's own message, e.g. ``clip_low`` 1.5 or ``dual_clip`` 0.5).
        TypeError: ``options`` is not a mapping; a value of the wrong type (the loss's message).
    """
    fn = get_policy_loss(name)
    if not isinstance(options, Mapping):
        raise TypeError(
            f"policy loss options must be a mapping of name -> value, got {type(options).__name__}"
        )
    declared = fn.options
    unknown = [key for key in options if key not in declared]
    if unknown:
        which = f"option {unknown[0]!r}" if len(unknown) == 1 else f"options {', '.join(map(repr, unknown))}"
        raise ValueError(f"policy loss {name!r} has no {which}; its options: {_describe_options(declared)}")
    zeros = torch.zeros(1, 2)
    with torch.no_grad():
        fn(zeros, zeros, zeros, torch.ones(1, 2), **options)
    return dict(options)


# --------------------------------------------------------------------------------------------
# shared helpers


def _prepare(
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


def _ratio_metrics(
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
# registered policy losses


@register_policy_loss("vanilla")
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
    mask, lp, (old, adv) = _prepare(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    loss = torch.where(mask, -adv * lp, zero)
    log_ratio = (lp - old).detach()
    return loss, _ratio_metrics(log_ratio, torch.exp(log_ratio), mask)


@register_policy_loss("ppo")
def ppo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
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
    mask, lp, (old, adv) = _prepare(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    loss, low, high, dual = _clipped_surrogate(ratio, adv, clip_low, clip_high, dual_clip)
    loss = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    return loss, _ratio_metrics(log_ratio, ratio, mask, low, high, dual)


@register_policy_loss("gspo")
def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
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
    mask, lp, (old, adv) = _prepare(
        "logprobs", logprobs, old_logprobs=old_logprobs, advantages=advantages, response_mask=response_mask
    )
    token_log_ratio = lp - old
    lengths = mask.sum(dim=-1).clamp_min(1).to(lp.dtype)
    seq_log_ratio = masked_sum(token_log_ratio, mask, dim=-1) / lengths  # [B]
    log_s = seq_log_ratio.detach()[:, None] + lp - lp.detach()
    s = torch.exp(log_s)
    loss, low, high, _ = _clipped_surrogate(s, adv, clip_low, clip_high, None)
    loss = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    metrics = _ratio_metrics(token_log_ratio, s, mask, low, high)
    return loss, metrics


@register_policy_loss("cispo")
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = 0.28,
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
    mask, lp, (old, adv) = _prepare(
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
    return loss, _ratio_metrics(log_ratio, ratio, mask, low, high)


def _selected_tokens(selected, mask: torch.Tensor, compute) -> torch.Tensor:
    """The trainer's step-level selection (bool [B, T], checked), else ``compute()`` over this batch."""
    if selected is None:
        return compute()
    selected = check_tensor(selected, SELECTION_ARG)
    check_same_shape(mask, "response_mask", selected=selected)
    return selected.to(device=mask.device).bool() & mask


@register_policy_loss("clip_cov")
def clip_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
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
    mask, lp, (old, adv) = _prepare(
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


@register_policy_loss("kl_cov")
def kl_cov_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-3,
    kl_cov_coef: float = 1.0,
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
    mask, lp, (old, adv) = _prepare(
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
    metrics = _ratio_metrics(log_ratio, ratio, mask)
    metrics["cov_selected_frac"] = masked_mean(chosen.float(), mask)
    return loss, metrics


kl_cov_loss.token_selection = "kl_cov"


# --------------------------------------------------------------------------------------------
# value loss and entropy


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_range: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ``0.5 * (V - G)^2`` per token, with optional PPO-style value clipping.

    With ``clip_range = eps_v``: ``V_clip = V_old + clamp(V - V_old, -eps_v, eps_v)`` and
    ``loss = 0.5 * max((V - G)^2, (V_clip - G)^2)`` (from the reference PPO implementations, not
    the paper: Huang et al. 2022, "The 37 Implementation Details of PPO", value-loss clipping;
    Andrychowicz et al. 2020 found it does not help, so it is off by default). Where the clipped
    error is the larger one, the gradient is 0 if ``V`` is outside ``V_old +- eps_v``.

    Args:
        values: [B, T] float critic predictions V, with gradient.
        old_values: [B, T] predictions at rollout time (detached).
        returns: [B, T] targets G, e.g. GAE returns (detached).
        response_mask: [B, T], nonzero = valid token.
        clip_range: None or eps_v > 0.

    Returns:
        ``(loss_matrix [B, T], metrics)``: 0 on masked positions; metrics ``vf_clipfrac``
        (fraction of valid tokens where the clipped error is selected, i.e. strictly larger)
        and ``num_tokens`` (int64), detached.

    Raises:
        TypeError: an input is not a tensor, ``values`` not floating, ``clip_range`` not a number.
        ValueError: shape mismatch (names the argument); ``clip_range`` <= 0.
    """
    if clip_range is not None:
        clip_range = check_number(clip_range, "clip_range", or_none=True)
        if not (math.isfinite(clip_range) and clip_range > 0):
            raise ValueError(f"clip_range must be a finite number > 0, or None to disable; got {clip_range}")
    mask, v, (old, ret) = _prepare(
        "values", values, old_values=old_values, returns=returns, response_mask=response_mask
    )
    error = (v - ret).square()
    if clip_range is None:
        loss = 0.5 * error
        clipped = torch.zeros_like(mask)
    else:
        v_clipped = old + torch.clamp(v - old, -clip_range, clip_range)
        error_clipped = (v_clipped - ret).square()
        clipped = (error_clipped > error).detach()
        loss = 0.5 * torch.where(clipped, error_clipped, error)
    loss = torch.where(mask, loss, torch.zeros((), dtype=loss.dtype, device=loss.device))
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((clipped & mask).float(), mask), "num_tokens": mask.sum()}
    return loss, metrics


class _EntropyFromLogits(torch.autograd.Function):
    """H(softmax(logits / T)) per row, forward and backward in blocks of rows."""

    @staticmethod
    def forward(ctx, logits, temperature, chunk_rows):
        vocab = logits.shape[-1]
        n = math.prod(logits.shape[:-1])
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        entropy = torch.empty(n, dtype=compute_dtype, device=logits.device)
        lse = torch.empty(n, dtype=compute_dtype, device=logits.device)
        for start, stop, block in row_blocks(logits, chunk_rows):
            z = block.to(compute_dtype, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            block_lse = torch.logsumexp(z, dim=-1)
            logp = z.sub_(block_lse[:, None])
            plogp = logp.exp() * logp
            plogp = torch.where(torch.isfinite(logp), plogp, torch.zeros((), dtype=z.dtype, device=z.device))
            entropy[start:stop] = -plogp.sum(dim=-1)
            lse[start:stop] = block_lse
            del z, logp, plogp
        ctx.save_for_backward(logits, entropy, lse)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.vocab = vocab
        return entropy.reshape(logits.shape[:-1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, entropy, lse = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad_logits.view(-1, ctx.vocab)
        g_all = grad_out.reshape(-1).to(entropy.dtype) / temperature
        for start, stop, block in row_blocks(logits, ctx.chunk_rows):
            z = block.to(entropy.dtype, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            logp = z.sub_(lse[start:stop, None])
            # dH/dz_j = -p_j (log p_j + H); zero where p_j = 0 (a -inf logit).
            term = logp.exp() * (logp + entropy[start:stop, None])
            term = torch.where(
                torch.isfinite(logp), term, torch.zeros((), dtype=term.dtype, device=term.device)
            )
            grad_flat[start:stop] = term.mul_(-g_all[start:stop, None])
            del z, logp, term
        return grad_logits, None, None


def entropy_from_logits(
    logits: torch.Tensor, *, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Exact entropy of ``softmax(logits / temperature)`` over the full vocabulary, per position.

    ``H = -sum_v p_v log p_v`` with ``log p = z - logsumexp(z)``, ``z = logits / temperature``
    (the entropy bonus c2 H of Schulman et al. 2017, eq. 9, and the entropy diagnostic).
    Computed in float32 (float64 for float64 logits) in blocks of ``chunk_size`` rows of the
    flattened leading dims: each block is upcast, reduced and freed before the next, so for
    bf16 logits no float32 copy of the whole [N, V] tensor is ever alive, neither in the forward
    nor in the backward (a ``torch.autograd.Function`` that saves only the logits and two [N]
    vectors and recomputes the softmax block by block; ``dH/dz = -p (log p + H)``). Logits of
    -inf (banned tokens) have probability 0 and contribute 0.

    Args:
        logits: [..., V] floating (e.g. [B, T, V] bf16).
        temperature: > 0; pass the sampling temperature to get the sampled distribution's entropy.
        chunk_size: rows per block; default ``max(1, 2**24 // V)``.

    Returns:
        [...] (``logits.shape[:-1]``) float32 entropies in nats, differentiable w.r.t. ``logits``.
        Uniform logits over V give ``log V``.

    Raises:
        TypeError: ``logits`` not a floating tensor; ``temperature`` not a number.
        ValueError: ``logits`` 0-d; ``temperature`` <= 0; ``chunk_size`` < 1.
    """
    logits = check_tensor(logits, "logits")
    check_floating(logits, "logits")
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension: shape [..., V]")
    temperature = check_temperature(temperature)
    vocab = logits.shape[-1]
    chunk_size = check_chunk_size(chunk_size, max(1, (1 << 24) // max(1, vocab)))
    return _EntropyFromLogits.apply(logits, temperature, chunk_size)
