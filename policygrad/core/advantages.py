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

Capabilities: an estimator declares whether it needs a critic's values, which extra inputs the
trainer must supply (keyword-only parameters that are not user options, e.g. ReMax's
greedy-baseline rewards) and its minimum group size (a number, or a function of its options).
:func:`estimator_spec` returns them as an :class:`EstimatorSpec`, and
:func:`check_estimator_options` validates a configuration's options before training starts, so
the trainer never needs to test an estimator's name. The built-in estimators' capabilities are
declared without torch in :mod:`policygrad.specs.estimators` (which the config reads); this
module implements each declared name with its function from
:mod:`policygrad.core.sequence_estimators` or :mod:`policygrad.core.token_estimators`, checking
the function's options against the declaration. :func:`register_advantage_estimator` declares
and implements a new one in one step.

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
from collections.abc import Callable, Mapping
from typing import Any

import torch

from policygrad.specs.estimators import (
    GRPO_SCALES,
    VINEPPO_DEFAULTS,
    VINEPPO_PROMPT_VALUES,
    VINEPPO_SPLITS,
    EstimatorSpec,
    check_min_group_size,
    check_new_estimator_name,
    declare_estimator,
    estimator_spec,
    list_advantage_estimators,
)

from .checks import check_2d, check_floating, check_group_index_dtype, check_shape_of
from .groups import group_inverse, group_mean_std
from .sequence_estimators import (
    grpo_advantages,
    reinforce_advantages,
    remax_advantages,
    rloo_advantages,
    sequence_rewards,
)
from .token_estimators import gae_advantages, reinforce_pp_advantages, vineppo_advantages

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
    declared as keyword-only parameters (no ``**kwargs``). Its capabilities are declared in
    :mod:`policygrad.specs.estimators` too, so the config accepts the name. The registered (and
    returned) callable
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
        check_min_group_size(min_group_size, f"advantage estimator {name!r}: min_group_size")
    inputs = tuple(inputs)

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        check_new_estimator_name(name)
        keyword_only = _keyword_options(name, fn, inputs, batch_statistics)
        spec = EstimatorSpec(
            name=name,
            options=_user_options(keyword_only, inputs, batch_statistics),
            needs_values=needs_values,
            inputs=inputs,
            group_size_rule=min_group_size,
            batch_statistics=batch_statistics,
        )
        estimator = _wrap(spec, fn, keyword_only)
        declare_estimator(spec)
        _ESTIMATORS[name] = estimator
        return estimator

    return decorator


def _keyword_options(
    name: str, fn: AdvantageEstimator, inputs: tuple[str, ...], batch_statistics: bool
) -> tuple[str, ...]:
    """The keyword-only parameters of ``fn`` but ``group_index`` and ``values``; raise
    ``TypeError`` unless ``fn`` has the shared signature and takes every input by keyword."""
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
    supplied = (*inputs, *(("batch_reduce",) if batch_statistics else ()))
    missing = [i for i in supplied if i not in keyword_only]
    if missing:
        raise TypeError(
            f"advantage estimator {name!r}: input(s) {', '.join(map(repr, missing))} must be "
            "keyword-only parameters of the function"
        )
    return keyword_only


def _user_options(
    keyword_only: tuple[str, ...], inputs: tuple[str, ...], batch_statistics: bool
) -> tuple[str, ...]:
    """The user options among the keyword-only parameters: not an input, not ``batch_reduce``."""
    batch_reduce = ("batch_reduce",) if batch_statistics else ()
    return tuple(k for k in keyword_only if k not in inputs and k not in batch_reduce)


def _wrap(spec: EstimatorSpec, fn: AdvantageEstimator, keyword_only: tuple[str, ...]) -> AdvantageEstimator:
    """The registered callable around ``fn``: see :func:`register_advantage_estimator`."""
    name, inputs = spec.name, spec.inputs

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
    return estimator


def _implement(name: str, fn: AdvantageEstimator) -> AdvantageEstimator:
    """The registered callable of a built-in estimator, declared in :mod:`policygrad.specs.estimators`.

    Raises:
        TypeError: ``fn`` lacks the shared signature or an input, or its options are not exactly
            the declared ones (the declaration is what the config validates against).
    """
    spec = estimator_spec(name)
    keyword_only = _keyword_options(name, fn, spec.inputs, spec.batch_statistics)
    options = _user_options(keyword_only, spec.inputs, spec.batch_statistics)
    if options != spec.options:
        raise TypeError(
            f"advantage estimator {name!r} is declared with the options {spec.options} in "
            f"policygrad.specs.estimators, but its function takes {options}; make them agree"
        )
    return _wrap(spec, fn, keyword_only)


# The built-in estimators, each implementing its declaration (explicitly, not by an import side
# effect of the modules that define them).
_ESTIMATORS: dict[str, AdvantageEstimator] = {
    name: _implement(name, fn)
    for name, fn in (
        ("reinforce", reinforce_advantages),
        ("rloo", rloo_advantages),
        ("grpo", grpo_advantages),
        ("remax", remax_advantages),
        ("reinforce_pp", reinforce_pp_advantages),
        ("vineppo", vineppo_advantages),
        ("gae", gae_advantages),
    )
}


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
