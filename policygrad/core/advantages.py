"""Advantage estimators, registered by name, all with one signature.

Every estimator is called as::

    advantages, returns = fn(token_rewards, response_mask, *, group_index, values=None, **options)

- ``token_rewards``: [B, T] floating. A sequence-level reward sits on the sequence's last valid
  token; per-token terms (a KL penalty) sit on every valid token. The reward of sequence i is
  ``R_i = sum_t response_mask[i, t] * token_rewards[i, t]`` (:func:`sequence_rewards`).
- ``response_mask``: [B, T], nonzero on valid response tokens.
- ``group_index``: [B] integer tensor, the prompt each row was sampled from. Rows with equal ids
  form a group (the G samples of one prompt). Rows of a group need not be contiguous and ids need
  not be 0..K-1; group statistics are computed with ``index_add`` over the ids and never mix
  prompts.
- ``values``: [B, T] critic values V(s_t) or None (only ``gae`` uses them).
- ``options``: keyword-only, specific to the estimator; an unknown option raises ``TypeError``
  naming the option, the estimator and its valid options.

Returns ``(advantages[B, T], returns[B, T])`` in ``token_rewards``' dtype, detached from any
autograd graph (they are fixed targets for the update). Masked positions of both are exactly 0,
and nothing at a masked position of ``token_rewards`` or ``values`` can change any output.

Sequence-level estimators (``reinforce``, ``rloo``, ``grpo``, ``remax``) put the sequence's
advantage on every valid token and its reward ``R_i`` as the return on every valid token. No
estimator whitens its output except ``reinforce_pp``, whose definition includes whitening; for
the others, whitening is the separate, optional :func:`policygrad.core.masking.masked_whiten`.

Source: the policy-gradient seed chapter, sections 4 (baselines: RLOO, group mean, greedy
baseline), 5 (critics, TD learning and GAE) and 10 (REINFORCE, RLOO and the case against the
critic); the papers are cited on each estimator.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable

import torch

from .masking import masked_sum, masked_whiten

__all__ = [
    "GRPO_SCALES",
    "AdvantageEstimator",
    "estimate_advantages",
    "get_advantage_estimator",
    "group_mean_std",
    "group_inverse",
    "list_advantage_estimators",
    "register_advantage_estimator",
    "sequence_rewards",
]

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_ESTIMATORS: dict[str, AdvantageEstimator] = {}
_SHARED_KEYWORDS = ("group_index", "values")


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


def _check_inputs(
    token_rewards: object, response_mask: object, group_index: object, values: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate the shared estimator arguments; return (rewards, bool mask, group_index, values)."""
    if not isinstance(token_rewards, torch.Tensor):
        raise TypeError(f"token_rewards must be a torch.Tensor [B, T], got {type(token_rewards).__name__}")
    if token_rewards.dim() != 2:
        raise ValueError(f"token_rewards must be 2-D [B, T], got shape {tuple(token_rewards.shape)}")
    if not token_rewards.is_floating_point():
        raise TypeError(f"token_rewards must be a floating tensor, got dtype {token_rewards.dtype}")
    device = token_rewards.device
    if not isinstance(response_mask, torch.Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor [B, T], got {type(response_mask).__name__}")
    if response_mask.shape != token_rewards.shape:
        raise ValueError(
            f"response_mask must have the shape of token_rewards {tuple(token_rewards.shape)}, "
            f"got {tuple(response_mask.shape)}"
        )
    mask = (response_mask != 0).to(device)
    if not isinstance(group_index, torch.Tensor):
        raise TypeError(
            "group_index must be a [B] integer tensor (the prompt id of each row), "
            f"got {type(group_index).__name__}"
        )
    batch = token_rewards.shape[0]
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must have shape [B] = ({batch},), got {tuple(group_index.shape)}")
    if group_index.is_floating_point() or group_index.is_complex() or group_index.dtype == torch.bool:
        raise TypeError(f"group_index must be an integer tensor (torch.long), got dtype {group_index.dtype}")
    group_index = group_index.to(device=device, dtype=torch.long)
    if values is not None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor [B, T] or None, got {type(values).__name__}")
        if values.shape != token_rewards.shape:
            raise ValueError(
                f"values must have the shape of token_rewards {tuple(token_rewards.shape)}, "
                f"got {tuple(values.shape)}"
            )
        if not values.is_floating_point():
            raise TypeError(f"values must be a floating tensor, got dtype {values.dtype}")
        values = values.to(device=device, dtype=token_rewards.dtype)
    return token_rewards, mask, group_index, values


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an advantage estimator under ``name``.

    The decorated function must have the shared signature
    ``fn(token_rewards, response_mask, *, group_index, values, **options)`` with its options
    keyword-only. The registered (and returned) callable wraps it: it validates the shared
    arguments (types, shapes; ``response_mask`` is passed on as a bool tensor), rejects unknown
    options with a ``TypeError`` naming the option and the valid ones, runs the estimator under
    ``torch.no_grad()``, and sets masked positions of both outputs to exactly 0. The wrapper's
    ``options`` attribute lists the option names.

    Args:
        name: registry key, a non-empty string.

    Returns:
        the decorator.

    Raises:
        TypeError: ``name`` is not a non-empty string; the function lacks the shared parameters.
        ValueError: ``name`` is already registered.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"advantage estimator name must be a non-empty string, got {name!r}")

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _ESTIMATORS:
            raise ValueError(
                f"advantage estimator {name!r} is already registered; choose another name "
                f"(registered: {', '.join(list_advantage_estimators())})"
            )
        params = inspect.signature(fn).parameters
        positional = [
            p.name
            for p in params.values()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        ]
        if len(positional) != 2 or any(k not in params for k in _SHARED_KEYWORDS):
            raise TypeError(
                f"advantage estimator {name!r} must have the signature "
                "fn(token_rewards, response_mask, *, group_index, values, **options)"
            )
        options = tuple(
            p.name
            for p in params.values()
            if p.kind == inspect.Parameter.KEYWORD_ONLY and p.name not in _SHARED_KEYWORDS
        )
        open_options = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())

        @functools.wraps(fn)
        def estimator(token_rewards, response_mask, *, group_index, values=None, **kwargs):
            if not open_options:
                unknown = sorted(k for k in kwargs if k not in options)
                if unknown:
                    raise TypeError(
                        f"advantage estimator {name!r} got unknown option(s) "
                        f"{', '.join(map(repr, unknown))}; "
                        f"valid options: {', '.join(options) if options else '(none)'}"
                    )
            rewards, mask, gidx, vals = _check_inputs(token_rewards, response_mask, group_index, values)
            with torch.no_grad():
                advantages, returns = fn(rewards, mask, group_index=gidx, values=vals, **kwargs)
                zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
                advantages = torch.where(mask, advantages.to(rewards.dtype), zero)
                returns = torch.where(mask, returns.to(rewards.dtype), zero)
            return advantages, returns

        estimator.options = options
        _ESTIMATORS[name] = estimator
        return estimator

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Return the registered estimator called ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    try:
        return _ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {', '.join(list_advantage_estimators())}"
        ) from None


def list_advantage_estimators() -> tuple[str, ...]:
    """Names of the registered advantage estimators, sorted."""
    return tuple(sorted(_ESTIMATORS))


def estimate_advantages(
    name: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    **options: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the estimator registered as ``name``; see the module docstring for the signature.

    Returns:
        ``(advantages[B, T], returns[B, T])``, dtype of ``token_rewards``, 0 at masked positions.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones); bad shapes; estimator errors.
        TypeError: unknown option, wrong argument types.
    """
    return get_advantage_estimator(name)(
        token_rewards, response_mask, group_index=group_index, values=values, **options
    )


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------


def sequence_rewards(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Sequence reward ``R_i = sum_t mask_it * r_it`` over valid tokens, [B], rewards' dtype.

    Raises:
        ValueError: ``response_mask`` shape differs from ``token_rewards``.
    """
    return masked_sum(token_rewards, response_mask, dim=-1)


def group_inverse(group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Map arbitrary group ids to 0..K-1.

    Args:
        group_index: [B] integer tensor of group (prompt) ids, in any order.

    Returns:
        ``(inverse[B] long, sizes[K] long)``: ``inverse[i]`` is row i's group in 0..K-1 (groups
        numbered in increasing id order) and ``sizes[k]`` the number of rows in group k.
    """
    _, inverse, sizes = torch.unique(group_index, return_inverse=True, return_counts=True)
    return inverse, sizes


def _group_stats(
    rewards: torch.Tensor, group_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group bookkeeping: (inverse[B], sizes[K], sums[K], all-equal flag[K])."""
    inverse, sizes = group_inverse(group_index)
    k = sizes.shape[0]
    dtype, device = rewards.dtype, rewards.device
    sums = torch.zeros(k, dtype=dtype, device=device).index_add_(0, inverse, rewards)
    gmax = torch.full((k,), float("-inf"), dtype=dtype, device=device).scatter_reduce(
        0, inverse, rewards, reduce="amax"
    )
    gmin = torch.full((k,), float("inf"), dtype=dtype, device=device).scatter_reduce(
        0, inverse, rewards, reduce="amin"
    )
    return inverse, sizes, sums, gmax == gmin


def group_mean_std(
    rewards: torch.Tensor, group_index: torch.Tensor, *, unbiased: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row statistics of the row's group: centred value, std and size, each [B].

    Means and squared deviations are accumulated with ``index_add`` over the group ids, so only
    rows with the same id are ever combined. A group whose values are all equal gets a centred
    value and a std of exactly 0 (detected with max == min, since the mean of equal float values
    can differ from them by a rounding error: 0.1 three times in float32).

    Args:
        rewards: [B] floating, one value per row (e.g. :func:`sequence_rewards`).
        group_index: [B] integer group ids, any order.
        unbiased: std with Bessel's correction (divide by n - 1; a group of size 1 then has std
            NaN, so callers that divide by it must reject such groups) or population std (n).

    Returns:
        ``(centered[B], std[B], size[B])``: ``rewards - group mean``, the group's std, and the
        group's size (long), each gathered back to the rows.
    """
    inverse, sizes, sums, constant = _group_stats(rewards, group_index)
    dtype, device = rewards.dtype, rewards.device
    means = sums / sizes.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=device)
    centered = torch.where(constant[inverse], zero, rewards - means[inverse])
    sq = torch.zeros(sizes.shape[0], dtype=dtype, device=device).index_add_(0, inverse, centered * centered)
    std = torch.sqrt(sq / (sizes - 1 if unbiased else sizes).to(dtype))
    return centered, std[inverse], sizes[inverse]


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put a [B] value on every valid token of [B, T]; 0 elsewhere."""
    zero = torch.zeros((), dtype=per_seq.dtype, device=per_seq.device)
    return torch.where(mask, per_seq[:, None].expand(mask.shape), zero)


def _per_seq_tensor(value: object, name: str, estimator: str, like: torch.Tensor) -> torch.Tensor:
    """Validate a float or [B] tensor option and return it as a [B] tensor like ``like``."""
    batch = like.shape[0]
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.expand(batch)
        if value.shape != (batch,):
            raise ValueError(
                f"{estimator}: {name} must be a float or a [B] = ({batch},) tensor, "
                f"got shape {tuple(value.shape)}"
            )
        return value.to(device=like.device, dtype=like.dtype)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return torch.full((batch,), float(value), dtype=like.dtype, device=like.device)
    raise TypeError(f"{estimator}: {name} must be a float or a [B] tensor, got {type(value).__name__}")


def _check_unit_interval(value: object, name: str, estimator: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{estimator}: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_next`` backwards over valid tokens (masked tokens skipped), [B, T]."""
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    out = [running] * rewards.shape[1]
    for t in reversed(range(rewards.shape[1])):
        valid = mask[:, t]
        step = torch.where(valid, rewards[:, t], zero) + gamma * running
        running = torch.where(valid, step, running)
        out[t] = torch.where(valid, step, zero)
    return torch.stack(out, dim=1) if out else torch.zeros_like(rewards)


# ----------------------------------------------------------------------------------------------
# Estimators
# ----------------------------------------------------------------------------------------------


@register_advantage_estimator("reinforce")
def reinforce_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    baseline: float | torch.Tensor = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a baseline: ``A_i = R_i - b_i`` on every valid token (Williams 1992, eq. 11).

    Args:
        token_rewards, response_mask, group_index, values: see the module docstring
            (``group_index`` and ``values`` are not used).
        baseline: a float, or a [B] tensor (one baseline per row; it must not depend on the row's
            own sample to keep the gradient unbiased, seed section 4). Default 0.

    Returns:
        advantages [B, T] = R - b on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError / TypeError: ``baseline`` of the wrong shape or type.
    """
    rewards = sequence_rewards(token_rewards, response_mask)
    b = _per_seq_tensor(baseline, "baseline", "reinforce", rewards)
    return _broadcast(rewards - b, response_mask), _broadcast(rewards, response_mask)


@register_advantage_estimator("rloo")
def rloo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: ``A_i = R_i - mean_{j != i, same group} R_j``.

    Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"); Ahmadian et al. 2024
    ("Back to Basics", eq. for the RLOO estimator); seed section 4. The baseline uses only the
    other samples of the same prompt, so the estimator is exactly unbiased. Computed as
    ``k/(k-1) * (R_i - group mean)``, which equals the leave-one-out difference exactly in real
    arithmetic (seed section 4 identity) and is exactly 0 for an all-equal group.

    Returns:
        advantages [B, T] on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError: a group of size 1 (group_size must be >= 2).
    """
    rewards = sequence_rewards(token_rewards, response_mask)
    inverse, sizes, sums, constant = _group_stats(rewards, group_index)
    if bool((sizes < 2).any()):
        lone = torch.unique(group_index)[sizes < 2][:5].tolist()
        raise ValueError(
            f"rloo: group_size must be >= 2 (the leave-one-out baseline needs another sample of the "
            f"same prompt); group id(s) {lone} have a single row"
        )
    others_mean = (sums[inverse] - rewards) / (sizes[inverse] - 1).to(rewards.dtype)
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    advantages = torch.where(constant[inverse], zero, rewards - others_mean)
    return _broadcast(advantages, response_mask), _broadcast(rewards, response_mask)


def _safe_ratio(centered: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``centered / scale``, exactly 0 where ``centered`` is 0 (an all-equal group, even with eps 0)."""
    zero = torch.zeros((), dtype=centered.dtype, device=centered.device)
    return torch.where(centered == 0, zero, centered / scale)


GRPO_SCALES = ("group", "batch", "none")


@register_advantage_estimator("grpo")
def grpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage ``A_i = (R_i - mean_group R) / (std + eps)``.

    Shao et al. 2024 (DeepSeekMath, section 4.1.2, outcome supervision); seed section 4 and the
    table of section 10. ``scale`` picks the divisor:

    - ``"group"``: the std of R within the row's group (needs every group of size >= 2).
    - ``"batch"``: the std of R over the whole batch (all B rows), one number.
    - ``"none"``: no division, the centred advantage ``R_i - mean_group R`` of Dr.GRPO
      (Liu et al. 2025, "Understanding R1-Zero-Like Training", section 3.1).

    A group whose rewards are all equal gets exactly 0 in every scale (never NaN, never a large
    number from a rounding-error std). Dividing by a per-group std is a per-prompt reweighting,
    not a baseline (seed, "where the textbook bends").

    Args:
        scale: ``"group"`` (default), ``"batch"`` or ``"none"``.
        eps: added to the std, default 1e-6.
        unbiased: std with Bessel's correction (n - 1), default True as in the GRPO reference
            implementations; False for the population std.

    Returns:
        advantages [B, T] on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError: unknown ``scale`` (lists the valid ones); a group of size 1 with
            ``scale="group"``; fewer than 2 rows with ``scale="batch"`` and ``unbiased=True``;
            ``eps < 0``.
    """
    if scale not in GRPO_SCALES:
        raise ValueError(f"grpo: unknown scale {scale!r}; valid scales: {', '.join(GRPO_SCALES)}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or eps < 0:
        raise ValueError(f"grpo: eps must be a number >= 0, got {eps!r}")
    rewards = sequence_rewards(token_rewards, response_mask)
    centered, std, sizes = group_mean_std(rewards, group_index, unbiased=unbiased)
    if scale == "group":
        if bool((sizes < 2).any()):
            lone = group_index[sizes < 2][:5].tolist()
            raise ValueError(
                f"grpo: group_size must be >= 2 with scale='group' (a group std needs two samples); "
                f"group id(s) {lone} have a single row; use scale='batch' or 'none', or sample more"
            )
        advantages = _safe_ratio(centered, std + eps)
    elif scale == "batch":
        n = rewards.shape[0]
        if n < (2 if unbiased else 1):
            raise ValueError(f"grpo: scale='batch' with unbiased={unbiased} needs at least 2 rows, got {n}")
        _, batch_std, _ = group_mean_std(rewards, torch.zeros_like(group_index), unbiased=unbiased)
        advantages = _safe_ratio(centered, batch_std + eps)
    else:
        advantages = centered
    return _broadcast(advantages, response_mask), _broadcast(rewards, response_mask)


@register_advantage_estimator("remax")
def remax_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: ``A_i = R_i - R(greedy response to row i's prompt)`` (Li et al. 2023, eq. 6).

    The greedy decode does not depend on the sampled response, so the baseline is unbiased
    (seed section 4).

    Args:
        baseline_rewards: [B] tensor, the reward of the greedy response for each row's prompt
            (required).

    Returns:
        advantages [B, T] on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError: ``baseline_rewards`` missing or not of shape [B].
    """
    if baseline_rewards is None:
        raise ValueError(
            "remax: baseline_rewards is required: a [B] tensor holding, for each row, the reward of "
            "the greedy response to the same prompt"
        )
    if not isinstance(baseline_rewards, torch.Tensor):
        raise TypeError(
            f"remax: baseline_rewards must be a [B] tensor, got {type(baseline_rewards).__name__}"
        )
    rewards = sequence_rewards(token_rewards, response_mask)
    if baseline_rewards.shape != rewards.shape:
        raise ValueError(
            f"remax: baseline_rewards must have shape [B] = {tuple(rewards.shape)}, "
            f"got {tuple(baseline_rewards.shape)}"
        )
    b = baseline_rewards.to(device=rewards.device, dtype=rewards.dtype)
    return _broadcast(rewards - b, response_mask), _broadcast(rewards, response_mask)


@register_advantage_estimator("reinforce_pp")
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    group_baseline: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning LLMs").

    1. Reward-to-go over the token rewards, ``G_t = r_t + gamma * G_{t+1}`` backwards over valid
       tokens, so a per-token KL penalty reaches the tokens before it.
    2. With ``group_baseline=True`` (REINFORCE++-baseline), subtract the group mean of the
       sequence rewards R from every valid token's ``G_t``.
    3. Whiten over all valid tokens of the batch with
       :func:`~policygrad.core.masking.masked_whiten` (mean 0, unbiased std 1, eps 1e-8).

    This is the one estimator whose definition includes whitening (global batch normalisation
    is part of REINFORCE++; it is also why the batch must hold at least 2 valid tokens).

    Args:
        gamma: discount in [0, 1], default 1.0.
        group_baseline: subtract the group mean of R first, default False.

    Returns:
        advantages [B, T] (whitened, 0 on masked tokens); returns [B, T] = the unwhitened
        reward-to-go ``G_t`` (without the group baseline) on valid tokens.

    Raises:
        ValueError: ``gamma`` outside [0, 1]; fewer than 2 valid tokens in the batch.
    """
    gamma = _check_unit_interval(gamma, "gamma", "reinforce_pp")
    n_valid = int(response_mask.sum().item())
    if n_valid < 2:
        raise ValueError(
            f"reinforce_pp whitens over all valid tokens of the batch and needs at least 2, got {n_valid}"
        )
    returns = _reward_to_go(token_rewards, response_mask, gamma)
    shifted = returns
    if group_baseline:
        rewards = sequence_rewards(token_rewards, response_mask)
        centered, _, _ = group_mean_std(rewards, group_index)
        group_mean = rewards - centered
        shifted = returns - group_mean[:, None]
    return masked_whiten(shifted, response_mask), returns


@register_advantage_estimator("gae")
def gae_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    critic_lam: float | None = None,
    length_adaptive_alpha: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation, GAE(gamma, lam) (Schulman et al. 2015b, eq. 16).

    The recursion runs backwards over the valid tokens of each row, all rows at once::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    where ``V_next`` / ``A_next`` are those of the next VALID token of the row, and 0 after the
    last valid token (the terminal state has value 0: no bootstrapping from padding). Masked
    positions are skipped, so neither the value nor the reward at a masked position is ever read.
    ``returns = A + V`` are the lambda-return targets for the critic (seed section 5).

    Args:
        values: [B, T] critic values V(s_t), required.
        gamma: discount in [0, 1], default 1.0 (the LLM standard, seed section 5).
        lam: GAE lambda in [0, 1], default 0.95. lam = 1 gives ``sum of future rewards - V``,
            lam = 0 gives the TD error.
        critic_lam: if set, decoupled GAE of VC-PPO (Yuan et al. 2025, "What's Behind PPO's
            Collapse in Long-CoT?"): the returns are ``GAE(gamma, critic_lam) + V`` while the
            advantages use ``lam`` (or the length-adaptive lambda).
        length_adaptive_alpha: if set (> 0), VAPO's length-adaptive GAE (Yue et al. 2025):
            the advantages of row i use ``lam_i = 1 - 1 / (alpha * n_i)`` with ``n_i`` the row's
            number of valid tokens, clamped to [0, 1] (a sequence shorter than 1/alpha tokens
            gets lam 0, the TD error). This replaces ``lam``.

    Returns:
        advantages [B, T] and returns [B, T], 0 on masked tokens.

    Raises:
        ValueError: ``values`` is None; ``gamma``, ``lam`` or ``critic_lam`` outside [0, 1];
            ``length_adaptive_alpha`` not > 0.
    """
    if values is None:
        raise ValueError(
            "gae needs values=[B, T] critic values; got values=None (use a critic-free estimator)"
        )
    gamma = _check_unit_interval(gamma, "gamma", "gae")
    lam = _check_unit_interval(lam, "lam", "gae")
    if critic_lam is not None:
        critic_lam = _check_unit_interval(critic_lam, "critic_lam", "gae")
    dtype, device = token_rewards.dtype, token_rewards.device
    batch, steps = token_rewards.shape
    if length_adaptive_alpha is not None:
        alpha = length_adaptive_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not alpha > 0:
            raise ValueError(f"gae: length_adaptive_alpha must be a number > 0, got {alpha!r}")
        lengths = response_mask.sum(dim=-1).clamp_min(1).to(dtype)
        lam_rows = (1.0 - 1.0 / (float(alpha) * lengths)).clamp(0.0, 1.0)
    else:
        lam_rows = torch.full((batch,), lam, dtype=dtype, device=device)

    zero = torch.zeros((), dtype=dtype, device=device)
    next_value = torch.zeros(batch, dtype=dtype, device=device)
    next_adv = torch.zeros(batch, dtype=dtype, device=device)
    next_critic_adv = torch.zeros(batch, dtype=dtype, device=device)
    advantages = [next_adv] * steps
    critic_advantages = [next_adv] * steps
    for t in reversed(range(steps)):
        valid = response_mask[:, t]
        v_t = torch.where(valid, values[:, t], zero)
        r_t = torch.where(valid, token_rewards[:, t], zero)
        delta = r_t + gamma * next_value - v_t
        adv = delta + gamma * lam_rows * next_adv
        next_adv = torch.where(valid, adv, next_adv)
        advantages[t] = torch.where(valid, adv, zero)
        if critic_lam is not None:
            critic_adv = delta + (gamma * critic_lam) * next_critic_adv
            next_critic_adv = torch.where(valid, critic_adv, next_critic_adv)
            critic_advantages[t] = torch.where(valid, critic_adv, zero)
        next_value = torch.where(valid, v_t, next_value)
    if steps == 0:
        empty = torch.zeros_like(token_rewards)
        return empty, empty
    adv_matrix = torch.stack(advantages, dim=1)
    masked_values = torch.where(response_mask, values, zero)
    critic_matrix = torch.stack(critic_advantages, dim=1) if critic_lam is not None else adv_matrix
    return adv_matrix, critic_matrix + masked_values
