"""Advantage estimators, registered by name with their capabilities, all with one signature.

Every estimator is called as::

    advantages, returns = fn(token_rewards, response_mask, *, group_index, values=None, **options)

- ``token_rewards``: [B, T] floating. A sequence-level reward sits on the sequence's last valid
  token; per-token terms (a KL penalty) sit on every valid token. The reward of sequence i is
  ``R_i = sum_t response_mask[i, t] * token_rewards[i, t]`` (:func:`sequence_rewards`).
- ``response_mask``: [B, T], nonzero on valid response tokens.
- ``group_index``: [B] integer tensor, the prompt each row was sampled from. Rows with equal ids
  form a group (the G samples of one prompt). Rows of a group need not be contiguous and ids need
  not be 0..K-1; group statistics (:mod:`policygrad.core.groups`) are computed with
  ``index_add`` over the ids and never mix prompts.
- ``values``: [B, T] critic values V(s_t) or None (only estimators that declare
  ``needs_values``, i.e. ``gae``, use them).
- ``options``: keyword-only, specific to the estimator; an unknown option raises ``TypeError``
  naming the option, the estimator and its valid options.

Returns ``(advantages[B, T], returns[B, T])`` in ``token_rewards``' dtype, detached from any
autograd graph (they are fixed targets for the update). Masked positions of both are exactly 0,
and nothing at a masked position of ``token_rewards`` or ``values`` can change any output.

Capabilities: an estimator declares at registration whether it needs a critic's values, which
extra inputs the trainer must supply (keyword-only parameters that are not user options, e.g.
ReMax's greedy-baseline rewards) and its minimum group size (a number, or a function of its
options). :func:`estimator_spec` returns them as an :class:`EstimatorSpec`, and
:func:`check_estimator_options` validates a configuration's options before training starts, so
the trainer never needs to test an estimator's name.

``vineppo`` (Kazemnejad et al. 2024) takes the Monte-Carlo values of states inside each response
as trainer-supplied inputs and gives each segment between two of them its own advantage.

Sequence-level estimators (``reinforce``, ``rloo``, ``grpo``, ``remax``) put the sequence's
advantage on every valid token and its reward ``R_i`` as the return on every valid token. No
estimator whitens its output except ``reinforce_pp``, whose definition includes whitening; for
the others, whitening is the separate, optional :func:`policygrad.core.masking.masked_whiten`.

Sources, cited on each estimator: REINFORCE with a baseline (Williams 1992); RLOO (Kool et al.
2019; Ahmadian et al. 2024); GRPO (Shao et al. 2024) and Dr.GRPO (Liu et al. 2025); ReMax (Li
et al. 2023); REINFORCE++ (Hu 2025); GAE (Schulman et al. 2015b); VinePPO (Kazemnejad et al. 2024).
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .checks import check_2d, check_floating, check_group_index_dtype, check_shape_of, check_unit_interval
from .groups import group_inverse, group_mean_std, group_stats
from .masking import masked_sum, masked_whiten

__all__ = [
    "GRPO_SCALES",
    "VINEPPO_DEFAULTS",
    "VINEPPO_PROMPT_VALUES",
    "VINEPPO_SPLITS",
    "AdvantageEstimator",
    "EstimatorSpec",
    "check_estimator_options",
    "estimate_advantages",
    "estimator_spec",
    "get_advantage_estimator",
    "group_inverse",
    "group_mean_std",
    "list_advantage_estimators",
    "monte_carlo_returns",
    "register_advantage_estimator",
    "sequence_rewards",
]

AdvantageEstimator = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_ESTIMATORS: dict[str, AdvantageEstimator] = {}
_SHARED_KEYWORDS = ("group_index", "values")


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EstimatorSpec:
    """What a registered advantage estimator needs: its capabilities, read by the trainer.

    Fields:
        name: the registry key.
        options: the user options (keyword-only parameters other than ``group_index``,
            ``values`` and the ``inputs``), in signature order.
        needs_values: the estimator reads a critic's values V(s_t); the trainer must train a
            value model and pass ``values=[B, T]``.
        inputs: keyword-only parameters the trainer supplies (never user options), e.g. ReMax's
            ``baseline_rewards`` [B], the rewards of the greedy responses.
        group_size_rule: the minimum group size as declared: an int, or a function
            ``(options: dict) -> int``; read it through :meth:`min_group_size`.
        batch_statistics: the estimator computes a statistic of the whole batch (e.g.
            ``reinforce_pp``'s whitening) and takes the trainer-supplied keyword ``batch_reduce``
            (None, or a data-parallel ``reduce(tensor, op)``, see
            :func:`~policygrad.core.masking.masked_whiten`).
    """

    name: str
    options: tuple[str, ...]
    needs_values: bool
    inputs: tuple[str, ...]
    group_size_rule: int | Callable[[dict[str, Any]], int] = 1
    batch_statistics: bool = False

    def min_group_size(self, options: Mapping[str, Any]) -> int:
        """The smallest G (samples per prompt) the estimator accepts with these options.

        Args:
            options: the estimator options of the run (merged over the preset's).

        Returns:
            an int >= 1.

        Raises:
            TypeError / ValueError: the declared rule returned something other than an int >= 1.
        """
        rule = self.group_size_rule
        size = rule(dict(options)) if callable(rule) else rule
        _check_group_size(size, f"min_group_size of advantage estimator {self.name!r}")
        return int(size)


def _check_group_size(size: object, what: str) -> None:
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(
            f"{what} must be an int >= 1 (or a function of the options returning one), got {size!r}"
        )
    if size < 1:
        raise ValueError(f"{what} must be >= 1, got {size}")


def _check_inputs(
    token_rewards: object, response_mask: object, group_index: object, values: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate the shared estimator arguments; return (rewards, bool mask, group_index, values)."""
    if not isinstance(token_rewards, torch.Tensor):
        raise TypeError(f"token_rewards must be a torch.Tensor [B, T], got {type(token_rewards).__name__}")
    check_2d(token_rewards, "token_rewards")
    check_floating(token_rewards, "token_rewards")
    device = token_rewards.device
    if not isinstance(response_mask, torch.Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor [B, T], got {type(response_mask).__name__}")
    check_shape_of(response_mask, "response_mask", token_rewards, "token_rewards")
    mask = (response_mask != 0).to(device)
    if not isinstance(group_index, torch.Tensor):
        raise TypeError(
            "group_index must be a [B] integer tensor (the prompt id of each row), "
            f"got {type(group_index).__name__}"
        )
    batch = token_rewards.shape[0]
    if group_index.shape != (batch,):
        raise ValueError(f"group_index must have shape [B] = ({batch},), got {tuple(group_index.shape)}")
    check_group_index_dtype(group_index)
    group_index = group_index.to(device=device, dtype=torch.long)
    if values is not None:
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor [B, T] or None, got {type(values).__name__}")
        check_shape_of(values, "values", token_rewards, "token_rewards")
        check_floating(values, "values")
        values = values.to(device=device, dtype=token_rewards.dtype)
    return token_rewards, mask, group_index, values


def _check_groups(spec: EstimatorSpec, group_index: torch.Tensor, options: dict[str, Any]) -> None:
    """Refuse a batch whose every group is smaller than ``spec.min_group_size(options)``: such an
    estimator compares samples of one prompt, and with none to compare its advantages are all 0
    (or it fails inside). A batch mixing lone rows with full groups is the estimator's to judge."""
    need = spec.min_group_size(options)
    if need <= 1 or group_index.numel() == 0:
        return
    _, sizes = group_inverse(group_index)
    largest = int(sizes.max().item())
    if largest >= need:
        return
    # The options that raise the minimum (as the config reports them).
    culprits = [
        k for k in options if spec.min_group_size({o: v for o, v in options.items() if o != k}) < need
    ]
    with_options = "".join(f" with {k}={options[k]!r}" for k in culprits)
    change = "".join(f" or change {k}" for k in culprits)
    raise ValueError(
        f"advantage estimator {spec.name!r}{with_options} compares samples of the same prompt and needs "
        f"groups of at least {need} rows, but the largest group of this batch has {largest} "
        f"row{'s' if largest != 1 else ''} ({group_index.numel()} rows, {sizes.numel()} groups); pass at "
        f"least {need} rows per group_index id (rollout.group_size >= {need}){change}"
    )


def register_advantage_estimator(
    name: str,
    *,
    needs_values: bool = False,
    inputs: tuple[str, ...] = (),
    min_group_size: int | Callable[[dict[str, Any]], int] = 1,
    batch_statistics: bool = False,
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering an advantage estimator under ``name``, with its capabilities.

    The decorated function must have the shared signature
    ``fn(token_rewards, response_mask, *, group_index, values, **options)`` with its options
    declared as keyword-only parameters (no ``**kwargs``). The registered (and returned) callable
    wraps it: it validates the shared arguments (types, shapes; ``response_mask`` is passed on
    as a bool tensor), rejects unknown options with a ``TypeError`` naming the option and the
    valid ones, refuses (``ValueError``) a batch in which no group reaches ``min_group_size``
    with the options given, runs the estimator under ``torch.no_grad()``, and sets masked positions of both
    outputs to exactly 0. The wrapper's ``spec`` attribute is the :class:`EstimatorSpec` and its
    ``options`` attribute the user option names (``spec.options``).

    Args:
        name: registry key, a non-empty string.
        needs_values: the estimator reads the critic's ``values`` (e.g. GAE).
        inputs: names of keyword-only parameters the trainer supplies, not the user, e.g.
            ``("baseline_rewards",)`` for ReMax; each must be a keyword-only parameter.
        min_group_size: the smallest group size G the estimator accepts, an int >= 1 or a
            function ``(options: dict) -> int`` when it depends on the options.
        batch_statistics: the estimator reduces over the whole batch and takes a keyword-only
            ``batch_reduce=None`` that the trainer supplies (a cross-rank reduce, or None).

    Returns:
        the decorator.

    Raises:
        TypeError: ``name`` is not a non-empty string; ``needs_values`` not a bool; ``inputs`` not
            a tuple/list of strings; ``min_group_size`` neither an int nor callable; the
            function lacks the shared parameters, takes ``**kwargs``, or an input is not one of
            its keyword-only parameters.
        ValueError: ``name`` is already registered; ``min_group_size`` < 1.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"advantage estimator name must be a non-empty string, got {name!r}")
    if not isinstance(needs_values, bool):
        raise TypeError(
            f"advantage estimator {name!r}: needs_values must be True or False, got {needs_values!r}"
        )
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(i, str) and i for i in inputs):
        raise TypeError(
            f"advantage estimator {name!r}: inputs must be a tuple of parameter names, got {inputs!r}"
        )
    if not callable(min_group_size):
        _check_group_size(min_group_size, f"advantage estimator {name!r}: min_group_size")
    inputs = tuple(inputs)

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
        open_options = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
        if len(positional) != 2 or any(k not in params for k in _SHARED_KEYWORDS) or open_options:
            raise TypeError(
                f"advantage estimator {name!r} must have the signature "
                "fn(token_rewards, response_mask, *, group_index, values, **options), its options "
                "declared as keyword-only parameters"
            )
        keyword_only = tuple(
            p.name
            for p in params.values()
            if p.kind == inspect.Parameter.KEYWORD_ONLY and p.name not in _SHARED_KEYWORDS
        )
        missing = [
            i for i in (*inputs, *(("batch_reduce",) if batch_statistics else ())) if i not in keyword_only
        ]
        if missing:
            raise TypeError(
                f"advantage estimator {name!r}: input(s) {', '.join(map(repr, missing))} must be "
                "keyword-only parameters of the function"
            )
        spec = EstimatorSpec(
            name=name,
            options=tuple(
                k for k in keyword_only if k not in inputs and not (batch_statistics and k == "batch_reduce")
            ),
            needs_values=needs_values,
            inputs=inputs,
            group_size_rule=min_group_size,
            batch_statistics=batch_statistics,
        )

        @functools.wraps(fn)
        def estimator(token_rewards, response_mask, *, group_index, values=None, **kwargs):
            unknown = sorted(k for k in kwargs if k not in keyword_only)
            if unknown:
                supplied = f"; inputs supplied by the trainer: {', '.join(inputs)}" if inputs else ""
                raise TypeError(
                    f"advantage estimator {name!r} got unknown option(s) "
                    f"{', '.join(map(repr, unknown))}; "
                    f"valid options: {', '.join(spec.options) if spec.options else '(none)'}{supplied}"
                )
            rewards, mask, gidx, vals = _check_inputs(token_rewards, response_mask, group_index, values)
            _check_groups(spec, gidx, {k: v for k, v in kwargs.items() if k in spec.options})
            with torch.no_grad():
                advantages, returns = fn(rewards, mask, group_index=gidx, values=vals, **kwargs)
                zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
                advantages = torch.where(mask, advantages.to(rewards.dtype), zero)
                returns = torch.where(mask, returns.to(rewards.dtype), zero)
            return advantages, returns

        estimator.options = spec.options
        estimator.spec = spec
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


def estimator_spec(name: str) -> EstimatorSpec:
    """The capabilities of the estimator registered as ``name`` (see :class:`EstimatorSpec`).

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    return get_advantage_estimator(name).spec


def list_advantage_estimators() -> tuple[str, ...]:
    """Names of the registered advantage estimators, sorted."""
    return tuple(sorted(_ESTIMATORS))


def check_estimator_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate user options for the estimator ``name`` now, before any model is loaded.

    Every option must be one the estimator declares, and none may be one of its ``inputs``
    (those the trainer supplies). The values are then checked by calling the estimator once on
    a dummy batch (2 groups of max(2, min_group_size) rows x 3 tokens, float32 zeros, every token
    valid; ``values`` zeros when it needs values; a [B] zeros tensor for each input), so its own checks run.
    Options are configuration values (numbers, strings, booleans); a tensor shaped for a real
    batch would not fit the dummy one.

    Args:
        name: a registered estimator.
        options: option name -> value, e.g. ``{"scale": "none"}``.

    Returns:
        ``dict(options)``.

    Raises:
        ValueError: unknown estimator (lists the registered ones); an option that is one of its
            inputs (says the trainer supplies it); an option it does not declare (names the
            estimator and its valid options); a bad value (the estimator's own message).
        TypeError: ``options`` not a mapping; a value of the wrong type (the estimator's message).
    """
    estimator = get_advantage_estimator(name)
    spec = estimator.spec
    if not isinstance(options, Mapping):
        raise TypeError(
            f"advantage estimator options must be a mapping of name -> value, got {type(options).__name__}"
        )
    valid = ", ".join(spec.options) if spec.options else "(none)"
    supplied = [
        key for key in options if key in spec.inputs or (spec.batch_statistics and key == "batch_reduce")
    ]
    if supplied:
        raise ValueError(
            f"advantage estimator {name!r}: {supplied[0]!r} is an input the trainer supplies, not an "
            f"option; remove it (valid options: {valid})"
        )
    unknown = [key for key in options if key not in spec.options]
    if unknown:
        which = f"option {unknown[0]!r}" if len(unknown) == 1 else f"options {', '.join(map(repr, unknown))}"
        raise ValueError(f"advantage estimator {name!r} has no {which}; valid options: {valid}")
    size = max(2, spec.min_group_size(options))  # groups as large as the estimator needs
    rows = 2 * size
    rewards = torch.zeros(rows, 3)
    extra = {key: torch.zeros(rows) for key in spec.inputs}
    estimator(
        rewards,
        torch.ones(rows, 3),
        group_index=torch.arange(2).repeat_interleave(size),
        values=torch.zeros(rows, 3) if spec.needs_values else None,
        **extra,
        **options,
    )
    return dict(options)


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
        ValueError: unknown ``name`` (lists the registered ones); bad shapes; no group of
            ``group_index`` reaches the estimator's ``min_group_size`` for these options (names
            the estimator, the largest group's size and the fix); estimator errors.
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
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    baseline: float | torch.Tensor = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE with a baseline: ``A_i = R_i - b_i`` on every valid token (Williams 1992, eq. 11).

    Args:
        token_rewards, response_mask, group_index, values: see the module docstring
            (``group_index`` and ``values`` are not used).
        baseline: a float, or a [B] tensor (one baseline per row; it must not depend on the row's
            own sample to keep the gradient unbiased, Williams 1992). Default 0.

    Returns:
        advantages [B, T] = R - b on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError / TypeError: ``baseline`` of the wrong shape or type.
    """
    rewards = sequence_rewards(token_rewards, response_mask)
    b = _per_seq_tensor(baseline, "baseline", "reinforce", rewards)
    return _broadcast(rewards - b, response_mask), _broadcast(rewards, response_mask)


@register_advantage_estimator("rloo", min_group_size=2)
def rloo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: ``A_i = R_i - mean_{j != i, same group} R_j``.

    Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free!"); Ahmadian et al. 2024
    ("Back to Basics", eq. for the RLOO estimator). The baseline uses only the other samples of
    the same prompt, so the estimator is exactly unbiased. Computed as
    ``k/(k-1) * (R_i - group mean)``, which equals the leave-one-out difference exactly in real
    arithmetic (``R_i - (S - R_i)/(k-1) = k/(k-1) * (R_i - S/k)`` with S the group's sum) and is
    exactly 0 for an all-equal group.

    Returns:
        advantages [B, T] on valid tokens; returns [B, T] = R on valid tokens.

    Raises:
        ValueError: a group of size 1 (group_size must be >= 2).
    """
    rewards = sequence_rewards(token_rewards, response_mask)
    inverse, sizes, sums, constant = group_stats(rewards, group_index)
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


@register_advantage_estimator("grpo", min_group_size=2)
def grpo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    scale: str = "group",
    eps: float = 1e-6,
    unbiased: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage ``A_i = (R_i - mean_group R) / (std + eps)``.

    Shao et al. 2024 (DeepSeekMath, section 4.1.2, outcome supervision). ``scale`` picks the
    divisor:

    - ``"group"``: the std of R within the row's group (needs every group of size >= 2).
    - ``"batch"``: the std of R over the whole batch (all B rows), one number.
    - ``"none"``: no division, the centred advantage ``R_i - mean_group R`` of Dr.GRPO
      (Liu et al. 2025, "Understanding R1-Zero-Like Training", section 3.1).

    A group whose rewards are all equal gets exactly 0 in every scale (never NaN, never a large
    number from a rounding-error std). Dividing by a per-group std is a per-prompt reweighting,
    not a baseline (Liu et al. 2025, section 3.1: the question-level difficulty bias).

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
        TypeError: ``unbiased`` not a bool.
    """
    if scale not in GRPO_SCALES:
        raise ValueError(f"grpo: unknown scale {scale!r}; valid scales: {', '.join(GRPO_SCALES)}")
    if not isinstance(unbiased, bool):
        raise TypeError(f"grpo: unbiased must be True or False, got {unbiased!r}")
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


@register_advantage_estimator("remax", inputs=("baseline_rewards",))
def remax_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    baseline_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: ``A_i = R_i - R(greedy response to row i's prompt)`` (Li et al. 2023, eq. 6).

    The greedy decode does not depend on the sampled response, so the baseline keeps the
    gradient unbiased (Williams 1992: any baseline independent of the sampled action). The
    greedy rewards are an input the trainer supplies (``inputs=("baseline_rewards",)``), not a
    user option.

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


def _reinforce_pp_min_group_size(options: dict[str, Any]) -> int:
    # With one sample per prompt the group baseline equals the row's own reward, so every
    # advantage is exactly 0 (nothing to learn from); without it any G works.
    return 2 if options.get("group_baseline") else 1


@register_advantage_estimator(
    "reinforce_pp", min_group_size=_reinforce_pp_min_group_size, batch_statistics=True
)
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    gamma: float = 1.0,
    group_baseline: bool = False,
    batch_reduce=None,
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
        batch_reduce: supplied by the trainer, not the user: None in one process, or the
            cross-rank ``reduce`` of :func:`~policygrad.core.masking.masked_whiten`, so a batch
            split over data-parallel ranks is whitened as one.

    Returns:
        advantages [B, T] (whitened, 0 on masked tokens); returns [B, T] = the unwhitened
        reward-to-go ``G_t`` (without the group baseline) on valid tokens.

    Raises:
        ValueError: ``gamma`` outside [0, 1]; fewer than 2 valid tokens in the batch.
        TypeError: ``group_baseline`` not a bool.

    Capabilities: the minimum group size is 2 with ``group_baseline=True`` (with one sample per
    prompt the group mean is the row's own reward and every advantage is exactly 0), else 1.
    """
    gamma = check_unit_interval(gamma, "gamma", "reinforce_pp")
    if not isinstance(group_baseline, bool):
        raise TypeError(f"reinforce_pp: group_baseline must be True or False, got {group_baseline!r}")
    n_valid = int(response_mask.sum().item())
    if batch_reduce is not None:
        n_valid = int(batch_reduce(response_mask.sum().to(torch.float64)).item())
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
    return masked_whiten(shifted, response_mask, reduce=batch_reduce), returns


VINEPPO_SPLITS = ("newline", "fixed")
VINEPPO_PROMPT_VALUES = ("rollouts", "group")
VINEPPO_DEFAULTS: dict[str, Any] = {
    "rollouts": 9,
    "split": "newline",
    "segment_tokens": 64,
    "max_splits": 8,
    "prompt_value": "rollouts",
}
"""``vineppo``'s options and their defaults (K = 9 Monte-Carlo rollouts per state as in Kazemnejad
et al. 2024, steps cut at newlines; ``max_splits`` bounds the cost and is not in the paper)."""


def _check_vineppo_options(rollouts, split, segment_tokens, max_splits, prompt_value) -> None:
    def whole(value, name, low, why):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"vineppo: {name} must be an int >= {low} ({why}), got {value!r}")

    whole(rollouts, "rollouts", 1, "K continuations sampled from each split point; the paper uses 9")
    if split not in VINEPPO_SPLITS:
        raise ValueError(
            f"vineppo: split must be one of {', '.join(VINEPPO_SPLITS)} (steps end at a newline, or "
            f"every segment_tokens tokens), got {split!r}"
        )
    whole(segment_tokens, "segment_tokens", 1, "the length of a step with split=fixed")
    whole(max_splits, "max_splits", 0, "the most split points in one response; 0: the prompt's value only")
    if prompt_value not in VINEPPO_PROMPT_VALUES:
        raise ValueError(
            f"vineppo: prompt_value must be one of {', '.join(VINEPPO_PROMPT_VALUES)} (K rollouts from the "
            f"prompt, or the mean reward of the group's other samples), got {prompt_value!r}"
        )


def _vineppo_min_group_size(options: dict[str, Any]) -> int:
    # prompt_value=group estimates V(prompt) from the row's G - 1 siblings: it needs one.
    return 2 if options.get("prompt_value") == "group" else 1


@register_advantage_estimator(
    "vineppo", inputs=("vine_values", "vine_segments"), min_group_size=_vineppo_min_group_size
)
def vineppo_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
    values: torch.Tensor | None = None,  # noqa: ARG001 (the estimator signature)
    rollouts: int = 9,
    split: str = "newline",
    segment_tokens: int = 64,
    max_splits: int = 8,
    prompt_value: str = "rollouts",
    vine_values: torch.Tensor | None = None,
    vine_segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """VinePPO: advantages from Monte-Carlo values of the states between a response's steps
    (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential for LLM Reasoning Through Refined
    Credit Assignment", eq. 5 for the value estimate and the one-step advantage of eq. 2 with
    gamma = 1).

    A response is cut at split points ``0 = s_0 < s_1 < ... < s_n`` (token offsets) into
    segments; ``V(s_i)`` is the mean reward of K continuations the policy samples from the
    prompt plus the response's first ``s_i`` tokens (the trainer supplies them, see
    :mod:`policygrad.produce.vine`). Every token of segment i gets the segment's advantage::

        A_i = sum_{t in segment i} r_t + V(s_{i+1}) - V(s_i),   V(s_{n+1}) = 0 (the end)

    so without per-token terms ``A_i = V(s_{i+1}) - V(s_i)`` and the last segment gets
    ``R - V(s_n)`` (its outcome reward sits on its last token). Per-token terms (a KL penalty in
    the reward) count in the segment they fall in. The returns are ``A + V(s_i)``.

    The options decide how the trainer samples (they are checked here, and the computation reads
    the inputs only):

    Args:
        rollouts: K >= 1 continuations per split point, default 9 (the paper's).
        split: ``"newline"`` (a step ends after a token whose text holds a newline, the paper's
            reasoning steps) or ``"fixed"`` (every ``segment_tokens`` tokens).
        segment_tokens: the step length with ``split="fixed"``, default 64.
        max_splits: at most this many split points inside a response (evenly spaced over the
            candidates), default 8; 0 keeps only the prompt's value.
        prompt_value: ``"rollouts"`` (V(s_0) from K continuations of the prompt, once per prompt)
            or ``"group"`` (the mean score of the row's G - 1 siblings; needs G >= 2).
        vine_values: [B, T] float, ``V(s_i)`` on every token of segment i (supplied by the
            trainer); a [B] tensor is the one-segment case (the value of the prompt).
        vine_segments: [B, T], the segment index i of every token (0, 1, ... along the row,
            integer-valued); a [B] tensor means one segment.

    Returns:
        advantages [B, T] and returns [B, T] in ``token_rewards``' dtype, 0 on masked tokens.

    Raises:
        ValueError: a bad option (names it and the valid values); ``vine_values`` or
            ``vine_segments`` missing or of a shape other than [B, T] or [B].
        TypeError: an input that is not a tensor.
    """
    _check_vineppo_options(rollouts, split, segment_tokens, max_splits, prompt_value)
    B, T = token_rewards.shape
    dtype, device = token_rewards.dtype, token_rewards.device
    inputs = {"vine_values": vine_values, "vine_segments": vine_segments}
    for name, tensor in inputs.items():
        if tensor is None:
            raise ValueError(f"vineppo: {name} is required (the trainer supplies it: a [B, T] tensor)")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"vineppo: {name} must be a tensor [B, T], got {type(tensor).__name__}")
        if tensor.shape not in ((B, T), (B,)):
            raise ValueError(
                f"vineppo: {name} must have shape [B, T] = {(B, T)} or [B], got {tuple(tensor.shape)}"
            )
    v = vine_values.to(device=device, dtype=dtype)
    seg = vine_segments.to(device=device)
    if v.dim() == 1:
        v = v[:, None].expand(B, T)
    seg = torch.zeros(B, T, dtype=torch.long, device=device) if seg.dim() == 1 else seg.round().long()
    seg = torch.where(response_mask, seg.clamp_min(0), torch.zeros_like(seg))
    n = int(seg.max().item()) + 1 if seg.numel() else 1
    # Columns: the n segments, the end state (never written: value 0), and one that masked tokens
    # write to, so that nothing at a masked position reaches a segment.
    index = torch.where(response_mask, seg, torch.full_like(seg, n + 1))
    zero = torch.zeros((), dtype=dtype, device=device)
    sums = torch.zeros(B, n + 2, dtype=dtype, device=device)
    sums.scatter_add_(1, index, torch.where(response_mask, token_rewards, zero))
    start = torch.zeros(B, n + 2, dtype=dtype, device=device)  # V(s_i): every token of i holds it
    start.scatter_(1, index, torch.where(response_mask, v, zero))
    seen = torch.zeros(B, n + 2, dtype=torch.bool, device=device)
    seen.scatter_(1, index, response_mask)
    # V(s_{i+1}): the next segment's value, 0 after the row's last segment (the response ended).
    following = torch.where(seen[:, 1 : n + 1], start[:, 1 : n + 1], zero)
    per_segment = sums[:, :n] + following - start[:, :n]
    advantages = per_segment.gather(1, seg)
    returns = advantages + start.gather(1, seg)
    return torch.where(response_mask, advantages, zero), torch.where(response_mask, returns, zero)


@register_advantage_estimator("gae", needs_values=True)
def gae_advantages(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    group_index: torch.Tensor,  # noqa: ARG001 (the estimator signature)
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
    ``returns = A + V`` are the lambda-return targets for the critic (Schulman et al. 2015b,
    section 5: ``A + V`` is the TD(lambda) return).

    Args:
        values: [B, T] critic values V(s_t), required.
        gamma: discount in [0, 1], default 1.0 (no discount within a response, as in
            Ouyang et al. 2022 and the N+ details of Huang et al. 2024).
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
    gamma = check_unit_interval(gamma, "gamma", "gae")
    lam = check_unit_interval(lam, "lam", "gae")
    if critic_lam is not None:
        critic_lam = check_unit_interval(critic_lam, "critic_lam", "gae")
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


# ----------------------------------------------------------------------------------------------
# Value targets
# ----------------------------------------------------------------------------------------------


def monte_carlo_returns(token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0):
    """Monte-Carlo returns ``G_t = sum_{l >= 0} gamma^l r_{t+l}`` over the valid tokens of each row.

    Computed as the returns of ``gae`` with lam = 1 and zero values: with lam = 1, GAE (Schulman
    et al. 2015b, eq. 16) telescopes to ``sum_l gamma^l r_{t+l} - V(s_t)``, so ``A + V`` is the
    Monte-Carlo return whatever the critic says. These are the value targets of the
    critic-pretraining phase (Yuan et al. 2025, VC-PPO, "What's Behind PPO's Collapse in
    Long-CoT?"; Zheng et al. 2023, "Secrets of RLHF").

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
