"""Advantage estimators as the config sees them: names and capabilities, without torch.

An estimator's capabilities (:class:`EstimatorSpec`) say whether it needs a critic's values,
which inputs the trainer supplies, its user options and its minimum group size. The built-in
estimators are declared here, once; :mod:`policygrad.core.advantages` implements each name and
checks at registration that the function's keyword-only options are exactly the declared ones.
An estimator registered later with
:func:`~policygrad.core.advantages.register_advantage_estimator` is declared here by that call,
so the config accepts it too.

Sources of the minimum group sizes: RLOO's leave-one-out baseline and GRPO's group std compare
samples of one prompt (Kool et al. 2019; Shao et al. 2024); REINFORCE++-baseline's group mean
(Hu 2025); VinePPO's ``prompt_value=group`` (Kazemnejad et al. 2024).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN_ESTIMATORS",
    "GRPO_SCALES",
    "VINEPPO_DEFAULTS",
    "VINEPPO_PROMPT_VALUES",
    "VINEPPO_SPLITS",
    "EstimatorSpec",
    "check_min_group_size",
    "check_new_estimator_name",
    "declare_estimator",
    "estimator_spec",
    "list_advantage_estimators",
]


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
        check_min_group_size(size, f"min_group_size of advantage estimator {self.name!r}")
        return int(size)


def check_min_group_size(size: object, what: str) -> None:
    """Raise unless ``size`` is an int >= 1; ``what`` names it in the message.

    Raises:
        TypeError: not an int (a bool is not one).
        ValueError: below 1.
    """
    if isinstance(size, bool) or not isinstance(size, numbers.Integral):
        raise TypeError(
            f"{what} must be an int >= 1 (or a function of the options returning one), got {size!r}"
        )
    if size < 1:
        raise ValueError(f"{what} must be >= 1, got {size}")


GRPO_SCALES = ("group", "batch", "none")
"""``grpo``'s ``scale`` values: the group's std, the batch's std, or no division (Dr.GRPO)."""

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


def reinforce_pp_min_group_size(options: dict[str, Any]) -> int:
    """2 with ``group_baseline`` (with one sample per prompt the group baseline equals the row's
    own reward, so every advantage is exactly 0: nothing to learn from), else 1."""
    return 2 if options.get("group_baseline") else 1


def vineppo_min_group_size(options: dict[str, Any]) -> int:
    """2 with ``prompt_value=group`` (V(prompt) from the row's G - 1 siblings needs one), else 1."""
    return 2 if options.get("prompt_value") == "group" else 1


BUILTIN_ESTIMATORS: tuple[EstimatorSpec, ...] = (
    EstimatorSpec("reinforce", options=("baseline",), needs_values=False, inputs=()),
    EstimatorSpec("rloo", options=(), needs_values=False, inputs=(), group_size_rule=2),
    EstimatorSpec(
        "grpo", options=("scale", "eps", "unbiased"), needs_values=False, inputs=(), group_size_rule=2
    ),
    EstimatorSpec("remax", options=(), needs_values=False, inputs=("baseline_rewards",)),
    EstimatorSpec(
        "reinforce_pp",
        options=("gamma", "group_baseline"),
        needs_values=False,
        inputs=(),
        group_size_rule=reinforce_pp_min_group_size,
        batch_statistics=True,
    ),
    EstimatorSpec(
        "vineppo",
        options=tuple(VINEPPO_DEFAULTS),
        needs_values=False,
        inputs=("vine_values", "vine_segments"),
        group_size_rule=vineppo_min_group_size,
    ),
    EstimatorSpec(
        "gae",
        options=("gamma", "lam", "critic_lam", "length_adaptive_alpha"),
        needs_values=True,
        inputs=(),
    ),
)
"""The built-in estimators' capabilities; :mod:`policygrad.core.advantages` implements each."""

_SPECS: dict[str, EstimatorSpec] = {spec.name: spec for spec in BUILTIN_ESTIMATORS}


def declare_estimator(spec: EstimatorSpec) -> EstimatorSpec:
    """Add a new estimator's capabilities (what ``register_advantage_estimator`` calls).

    Raises:
        TypeError: ``spec`` is not an :class:`EstimatorSpec`.
        ValueError: the name is already declared; the message lists the declared ones.
    """
    if not isinstance(spec, EstimatorSpec):
        raise TypeError(f"declare_estimator takes an EstimatorSpec, got {type(spec).__name__}")
    check_new_estimator_name(spec.name)
    _SPECS[spec.name] = spec
    return spec


def check_new_estimator_name(name: str) -> None:
    """Raise ``ValueError`` when ``name`` is already registered (the message lists the names)."""
    if name in _SPECS:
        raise ValueError(
            f"advantage estimator {name!r} is already registered; choose another name "
            f"(registered: {', '.join(list_advantage_estimators())})"
        )


def estimator_spec(name: str) -> EstimatorSpec:
    """The capabilities of the estimator registered as ``name`` (see :class:`EstimatorSpec`).

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    try:
        return _SPECS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown advantage estimator {name!r}; registered: {', '.join(list_advantage_estimators())}"
        ) from None


def list_advantage_estimators() -> tuple[str, ...]:
    """Names of the registered advantage estimators, sorted."""
    return tuple(sorted(_SPECS))
