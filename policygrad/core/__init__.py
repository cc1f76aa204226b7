"""The chapter's math as pure functions of torch tensors.

Nothing in ``policygrad.core`` imports from the rest of the package, loads a model, reads a file
or takes a config object. Shapes follow one glossary: B sequences, T response tokens
(right-padded), G samples per prompt, V vocabulary.
"""

from policygrad.core.advantages import (
    estimate_advantages,
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
)
from policygrad.core.diagnostics import (
    explained_variance,
    group_index_from_size,
    zero_variance_group_fraction,
)
from policygrad.core.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_loss,
    kl_shaped_rewards,
)
from policygrad.core.logprobs import logprobs_from_hidden, logprobs_from_logits, truncated_importance_weights
from policygrad.core.losses import (
    entropy_from_logits,
    get_policy_loss,
    list_policy_losses,
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
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "aggregation_counts",
    "entropy_from_logits",
    "estimate_advantages",
    "explained_variance",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_index_from_size",
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
    "register_advantage_estimator",
    "register_policy_loss",
    "truncated_importance_weights",
    "value_loss",
    "zero_variance_group_fraction",
]
