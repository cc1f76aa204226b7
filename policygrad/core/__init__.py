"""The chapter's math as pure functions of torch tensors.

Nothing in ``policygrad.core`` imports from the rest of the package (but :mod:`policygrad.specs`,
the torch-free declarations its registries implement), loads a model, reads a file or takes a
config object. Shapes follow one glossary: B sequences, T response tokens
(right-padded), G samples per prompt, V vocabulary.

Registries carry capabilities: an advantage estimator declares whether it needs values, the
inputs the trainer supplies and its minimum group size (:func:`estimator_spec`); a policy loss
declares its options and their defaults (:func:`policy_loss_options`); a KL placement says
whether it needs a reference model and builds its rewards and loss term
(:func:`get_kl_placement`). Input checks live in :mod:`policygrad.core.checks`, group
statistics in :mod:`policygrad.core.groups`.
"""

from policygrad.core.advantages import (
    EstimatorSpec,
    check_estimator_options,
    estimate_advantages,
    estimator_spec,
    get_advantage_estimator,
    list_advantage_estimators,
    monte_carlo_returns,
    register_advantage_estimator,
)
from policygrad.core.diagnostics import explained_variance, group_index_from_size
from policygrad.core.groups import (
    fill_with_group_mean,
    group_inverse,
    group_mean_std,
    group_stats,
    varied_group_rows,
    zero_variance_group_fraction,
)
from policygrad.core.importance import truncated_importance_weights
from policygrad.core.kl import (
    KL_KINDS,
    KL_PLACEMENTS,
    AdaptiveKLController,
    FixedKLController,
    KLPlacement,
    get_kl_placement,
    kl_estimate,
    kl_loss,
    kl_shaped_rewards,
)
from policygrad.core.logprobs import logprobs_from_hidden, logprobs_from_logits
from policygrad.core.losses import (
    check_policy_loss_options,
    entropy_from_logits,
    get_policy_loss,
    list_policy_losses,
    policy_loss_options,
    register_policy_loss,
    value_loss,
)
from policygrad.core.masking import (
    AGGREGATION_MODES,
    aggregate,
    aggregation_counts,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "AGGREGATION_MODES",
    "KL_KINDS",
    "KL_PLACEMENTS",
    "AdaptiveKLController",
    "EstimatorSpec",
    "FixedKLController",
    "KLPlacement",
    "aggregate",
    "aggregation_counts",
    "check_estimator_options",
    "check_policy_loss_options",
    "entropy_from_logits",
    "estimate_advantages",
    "estimator_spec",
    "explained_variance",
    "fill_with_group_mean",
    "get_advantage_estimator",
    "get_kl_placement",
    "get_policy_loss",
    "group_index_from_size",
    "group_inverse",
    "group_mean_std",
    "group_stats",
    "kl_estimate",
    "kl_loss",
    "kl_shaped_rewards",
    "list_advantage_estimators",
    "list_policy_losses",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "monte_carlo_returns",
    "policy_loss_options",
    "register_advantage_estimator",
    "register_policy_loss",
    "truncated_importance_weights",
    "value_loss",
    "varied_group_rows",
    "zero_variance_group_fraction",
]
