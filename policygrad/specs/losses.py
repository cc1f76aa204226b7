"""Policy losses as the config sees them: names and options with their defaults, without torch.

The built-in losses' options and defaults (the papers' values) are declared here, once:
:mod:`policygrad.core.losses` implements each name with a function whose keyword-only options
are exactly these, and takes their defaults from here. A loss registered later with
:func:`~policygrad.core.losses.register_policy_loss` declares its options (its signature's
defaults) here through that call, so the config accepts it too.

Sources of the defaults: PPO's 0.2 (Schulman et al. 2017); GSPO's 3e-4 / 4e-4 (Zheng et al. 2025,
section 5.1); CISPO's upper clip borrowed from DAPO's 0.28 (Yu et al. 2025, section 3.1);
Clip-Cov's ratio 2e-4 and band [1, 5] and KL-Cov's ratio 2e-3 (Cui et al. 2025, section 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "BUILTIN_POLICY_LOSSES",
    "SELECTION_ARG",
    "check_new_policy_loss_name",
    "check_policy_loss_option_names",
    "declare_policy_loss",
    "describe_options",
    "list_policy_losses",
    "policy_loss_options",
]

SELECTION_ARG = "selected"
"""A keyword a loss that acts on a batch-level token selection (``clip_cov``, ``kl_cov``) takes
besides its options: the [B, T] bool selection computed by the trainer over the whole step batch
(so micro-batches and ranks cannot change it). Not an option: a config cannot set it. Such a
loss carries ``fn.token_selection`` (its :func:`~policygrad.core.entropy.covariance_selection`
mode); called without ``selected`` it selects over the tokens it is given."""

BUILTIN_POLICY_LOSSES: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "ppo": {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
    "cispo": {"clip_low": None, "clip_high": 0.28},
    "clip_cov": {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_cov_ratio": 2e-4,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
    },
    "kl_cov": {"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0},
}
"""The built-in losses: name -> {option: default}, in signature order."""

_OPTIONS: dict[str, dict[str, Any]] = {name: dict(options) for name, options in BUILTIN_POLICY_LOSSES.items()}


def check_new_policy_loss_name(name: str) -> None:
    """Raise ``ValueError`` when a policy loss ``name`` is already registered."""
    if name in _OPTIONS:
        raise ValueError(f"policy loss {name!r} is already registered; choose another name")


def declare_policy_loss(name: str, options: Mapping[str, Any]) -> None:
    """Declare a new loss's options and their defaults (what ``register_policy_loss`` calls).

    Raises:
        ValueError: ``name`` is already registered.
    """
    check_new_policy_loss_name(name)
    _OPTIONS[name] = dict(options)


def list_policy_losses() -> list[str]:
    """Sorted names of the registered policy losses."""
    return sorted(_OPTIONS)


def policy_loss_options(name: str) -> dict[str, Any]:
    """The options the policy loss ``name`` declares, with their defaults (a new dict).

    ``policy_loss_options("gspo") == {"clip_low": 3e-4, "clip_high": 4e-4}``.

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    if name not in _OPTIONS:
        raise ValueError(f"unknown policy loss {name!r}; registered: {', '.join(list_policy_losses())}")
    return dict(_OPTIONS[name])


def describe_options(options: Mapping[str, Any]) -> str:
    """``"clip_low (default 0.2), clip_high (default 0.2)"``; ``"(none)"`` for no option."""
    return ", ".join(f"{k} (default {v!r})" for k, v in options.items()) or "(none)"


def check_policy_loss_option_names(name: str, options: object) -> dict[str, Any]:
    """The checks of a loss's options that need no torch: ``name`` is registered, ``options`` is
    a mapping, and every key is an option the loss declares.

    Returns:
        the loss's declared options with their defaults.

    Raises:
        ValueError: unknown loss (lists the registered ones); an option the loss does not
            declare (names the loss and lists its options with their defaults).
        TypeError: ``options`` is not a mapping.
    """
    declared = policy_loss_options(name)
    if not isinstance(options, Mapping):
        raise TypeError(
            f"policy loss options must be a mapping of name -> value, got {type(options).__name__}"
        )
    unknown = [key for key in options if key not in declared]
    if unknown:
        which = f"option {unknown[0]!r}" if len(unknown) == 1 else f"options {', '.join(map(repr, unknown))}"
        raise ValueError(f"policy loss {name!r} has no {which}; its options: {describe_options(declared)}")
    return declared
