"""The checks of a config's algorithm choices: the policy loss and its options, the advantage
estimator, its options and its minimum group size (:func:`validate_policy_loss`,
:func:`validate_estimator`, called by ``TrainConfig.validate``).

Names, declared options, defaults and minimum group sizes come from the torch-free declarations
in :mod:`policygrad.specs`; the options' values are checked by running the torch function once on
a dummy batch, so that check imports ``policygrad.core`` when it runs, never when this module is
imported.
"""

from __future__ import annotations

from policygrad.config.checks import ConfigError, check_choice
from policygrad.specs.estimators import list_advantage_estimators
from policygrad.specs.losses import describe_options, list_policy_losses, policy_loss_options

__all__ = ["validate_estimator", "validate_policy_loss"]


def validate_policy_loss(config) -> None:
    """The loss of ``config`` (a ``TrainConfig``) is registered; every option set is one it
    declares, with a valid value (the values checked by running the loss once on a dummy batch).

    Raises:
        ConfigError: names the field, the loss and its options with their defaults.
    """
    if config.loss.policy_loss is not None:
        check_choice("loss.policy_loss", config.loss.policy_loss, set(list_policy_losses()))
    # torch: the values are checked by the loss itself; keeps `import policygrad.config` light
    from policygrad.core.losses import check_policy_loss_options

    name = config.policy_loss_name
    declared = describe_options(policy_loss_options(name))
    for key, (path, value) in config.loss.set_options().items():
        try:
            check_policy_loss_options(name, {key: value})
        except (ValueError, TypeError) as e:
            if key not in policy_loss_options(name):
                raise ConfigError(f"{path}: {e}; unset {path} or choose a policy loss that has it") from None
            raise ConfigError(
                f"{path}={value!r} is not valid for policy loss {name!r}: {e} (its options: {declared})"
            ) from None
    try:  # each value passed alone; now all of them together
        check_policy_loss_options(name, config.loss_options)
    except (ValueError, TypeError) as e:
        raise ConfigError(
            f"loss: the options {config.loss_options!r} are not valid together for policy loss "
            f"{name!r}: {e} (its options: {declared})"
        ) from None


def validate_estimator(config) -> None:
    """The estimator of ``config`` (a ``TrainConfig``) is registered, its options valid (checked by
    running it once on a dummy batch), and G at least its minimum group size.

    Raises:
        ConfigError: names the field, the estimator and the fix.
    """
    # torch: the values are checked by the estimator itself; keeps `import policygrad.config` light
    from policygrad.core.advantages import check_estimator_options

    if config.advantage.estimator is not None:
        check_choice("advantage.estimator", config.advantage.estimator, set(list_advantage_estimators()))
    name, options = config.estimator_name, config.estimator_options
    try:
        check_estimator_options(name, options)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"advantage.options: {e}") from None
    spec = config.estimator_spec
    if "vine_values" in spec.inputs and config.reward.whiten:
        raise ConfigError(
            "reward.whiten=true rescales the per-token rewards but not VinePPO's Monte-Carlo values "
            f"(advantage estimator {name!r}), so the two would not be on one scale; set "
            "reward.whiten=false (advantage.whiten=true rescales the advantages instead)"
        )
    need = spec.min_group_size(options)
    if config.rollout.group_size >= need:
        return
    # The options that raise the minimum (e.g. reinforce_pp's group_baseline): without any one
    # of them the estimator would need fewer samples per prompt.
    culprits = [
        key for key in options if spec.min_group_size({k: v for k, v in options.items() if k != key}) < need
    ]
    with_options = "".join(f" with {k}={options[k]!r}" for k in culprits)
    fix = f"set rollout.group_size >= {need}"
    if culprits:
        fix += " or change " + ", ".join(f"advantage.options.{k}" for k in culprits)
    else:
        fix += " or choose an estimator that does not compare samples of the same prompt"
    raise ConfigError(
        f"algorithm={config.algorithm!r} needs rollout.group_size >= {need} (advantage estimator "
        f"{name!r}{with_options} compares samples of the same prompt), got {config.rollout.group_size}; "
        f"{fix}"
    )
