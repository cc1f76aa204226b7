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

Registered losses: ``vanilla``, ``ppo``, ``gspo``, ``cispo`` (:mod:`policygrad.core.policy_losses`),
``clip_cov``, ``kl_cov`` (:mod:`policygrad.core.covariance_losses`). Their options and defaults
(the papers' values) are declared without torch in :mod:`policygrad.specs.losses`, which the
config reads; this module registers each function against its declaration (its keyword-only
options must be exactly the declared ones, with the declared defaults). Adding one is one
decorated function: ``@register_policy_loss("name")``. A loss declares its options (keyword-only
parameters whose defaults are the paper's values); :func:`policy_loss_options` lists them and
:func:`check_policy_loss_options` validates a configuration's options before training starts.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from policygrad.specs.losses import (
    SELECTION_ARG,
    check_new_policy_loss_name,
    check_policy_loss_option_names,
    declare_policy_loss,
    describe_options,
    list_policy_losses,
    policy_loss_options,
)

from .checks import check_chunk_size, check_floating, check_number, check_temperature, check_tensor
from .covariance_losses import clip_cov_loss, kl_cov_loss
from .logprobs import row_blocks
from .masking import masked_mean
from .policy_losses import cispo_loss, gspo_loss, ppo_loss, prepare_loss_inputs, vanilla_loss

__all__ = [
    "SELECTION_ARG",
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


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy loss under ``name``.

    Usage: ``@register_policy_loss("my_loss")`` above a function with the module's signature.
    The loss declares its options as keyword-only parameters, each with a default (the paper's
    value); registration records them, in signature order, as ``fn.options`` (a dict name ->
    default), read by :func:`policy_loss_options` and :func:`check_policy_loss_options`, and
    declared in :mod:`policygrad.specs.losses` so the config accepts the name. The function
    itself is registered and returned unchanged.

    Raises:
        TypeError: ``name`` is not a non-empty string; the function does not take exactly the
            four tensors ``(logprobs, old_logprobs, advantages, response_mask)`` positionally,
            takes ``*args`` / ``**kwargs``, or has a keyword-only option without a default.
        ValueError: ``name`` is already registered (names must be unique; pick another name).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"policy loss name must be a non-empty string, got {name!r}")
    check_new_policy_loss_name(name)

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        check_new_policy_loss_name(name)
        fn.options = _declared_options(name, fn)
        declare_policy_loss(name, fn.options)
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


def _implement(name: str, fn: PolicyLossFn) -> PolicyLossFn:
    """Register the built-in loss ``fn`` against its declaration in :mod:`policygrad.specs.losses`.

    Raises:
        TypeError: ``fn``'s options or their defaults are not exactly the declared ones (the
            declaration is what the config validates against).
    """
    options = _declared_options(name, fn)
    declared = policy_loss_options(name)
    if list(options.items()) != list(declared.items()):
        raise TypeError(
            f"policy loss {name!r} is declared with the options {describe_options(declared)} in "
            f"policygrad.specs.losses, but its function takes {describe_options(options)}; make them agree"
        )
    fn.options = options
    return fn


# The built-in losses, each registered against its declaration (explicitly, not by an import side
# effect of the modules that define them).
_POLICY_LOSSES: dict[str, PolicyLossFn] = {
    name: _implement(name, fn)
    for name, fn in (
        ("vanilla", vanilla_loss),
        ("ppo", ppo_loss),
        ("gspo", gspo_loss),
        ("cispo", cispo_loss),
        ("clip_cov", clip_cov_loss),
        ("kl_cov", kl_cov_loss),
    )
}
# Each of these is the advantage times a function of the ratio (or of the log-prob), so a row
# whose advantages are all 0 has a loss and a gradient of exactly 0 (the covariance losses pick
# their tokens over the whole batch, so a row's presence can change another row's loss).
for _fn in (vanilla_loss, ppo_loss, gspo_loss, cispo_loss):
    _fn.vanishes_at_zero_advantage = True


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered under ``name``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(list_policy_losses())}")
    return _POLICY_LOSSES[name]


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
    check_policy_loss_option_names(name, options)
    zeros = torch.zeros(1, 2)
    with torch.no_grad():
        fn(zeros, zeros, zeros, torch.ones(1, 2), **options)
    return dict(options)


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
    mask, v, (old, ret) = prepare_loss_inputs(
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
