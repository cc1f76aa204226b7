"""Finite numbers in, finite numbers out: :func:`check_finite_weights` refuses a model with a
NaN or infinite weight before it is trained or evaluated, and :func:`check_finite_advantages`
names, at once, the step whose finite rewards are too large for the estimator's float32
statistics (its loss would be NaN and every optimizer step skipped). Counting the updates a run
applied, and ending one that trains nothing, is :class:`policygrad.run.health.UpdateWatch`.
"""

from __future__ import annotations

import torch

from policygrad.config.agent import episode_fields
from policygrad.config.train import ConfigError
from policygrad.errors import TrainingError

__all__ = ["check_finite_advantages", "check_finite_weights"]


def check_finite_weights(model, what: str, *, use: str = "trained") -> None:
    """Refuse a model with a NaN or infinite weight before the run (or evaluation) starts: it
    cannot sample (the hf engine's probabilities would be NaN, greedy decoding picks arbitrary
    tokens) and no update of it would be finite.

    Args:
        model: a torch module.
        what: how to name it in the message (``model.name='...'``).
        use: what it cannot be (``trained``, ``evaluated``).

    Raises:
        ConfigError: the first parameter that holds a non-finite value, with how many.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            param = param.to_local() if hasattr(param, "to_local") else param  # FSDP: this rank's shard
            if param.is_floating_point() and not bool(torch.isfinite(param).all()):
                bad = int((~torch.isfinite(param)).sum())
                raise ConfigError(
                    f"{what} has non-finite weights: {name} holds {bad} NaN or infinite values; it cannot be "
                    f"{use} (repair the weights or choose another model)"
                )


def check_finite_advantages(dist, config, returns, token_rewards, advantages, loss_mask, values) -> None:
    """Name rewards too large for float32's statistics: every token reward (and value) that
    carries loss is finite, yet an advantage is not, so a group or batch statistic of the rewards
    (a sum, a variance) overflowed float32 (returns near 3.4e38: three of 3e38 in a group sum to
    inf). Without this the step's loss is NaN and every optimizer step is skipped. Every rank
    raises together (``dist.any``, a collective).

    Args:
        dist: the run's :class:`~policygrad.parallel.distributed.Dist`; config: its config.
        returns: float32 [B], this rank's samples' returns (for the message).
        token_rewards: [B, T] the token rewards before reward whitening; advantages: [B, T];
        loss_mask: [B, T]; values: [B, T] or None.

    Raises:
        TrainingError: such a step, naming the largest return and the rewards to scale down.
    """
    carried = loss_mask > 0
    overflowed = not bool(torch.isfinite(advantages[carried]).all()) and bool(
        torch.isfinite(token_rewards[carried]).all()
    )
    if values is not None:
        overflowed = overflowed and bool(torch.isfinite(values[carried]).all())
    if not dist.any(overflowed):
        return
    largest = returns.double().abs().max() if returns.numel() else torch.zeros((), dtype=torch.float64)
    largest = float(dist.reduce(largest, "max"))
    sources = f"reward.functions={config.reward.functions}"
    if config.env.name:
        sources = episode_fields(config)["rewards"] + (
            f" and {sources}" if config.reward.functions else ""
        )
    raise TrainingError(
        "the advantages are not finite though every reward is (the largest |return| this step is "
        f"{largest:g}): the advantage estimator's sums or variances of rewards this large leave "
        f"float32's range (|x| <= 3.4e38); scale {sources} down"
    )
