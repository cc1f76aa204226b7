"""A run that trains nothing fails loudly.

:class:`UpdateWatch` counts, step by step, the updates the optimizer applied. A step that
applied none (every optimizer step skipped as non-finite, no token carrying loss, the update
stopped by ``optim.target_kl`` before its first step) is *empty*; so is a step whose optimizer
steps all had a gradient of exactly 0 (every advantage 0 and no other loss term, e.g. a reward
that gives every sample of a group the same score): it learns nothing from its batch (AdamW still
steps on the momentum of earlier updates; before the first one no weight moves, weight decay
aside). A gradient of exactly 0 while a group's samples
scored differently is a diverged run (the policy saturated by a step too large), named as such
with ``optim.lr``. ``max_skipped_updates`` empty steps in a row end
the run with a :class:`~policygrad.errors.TrainingError` that names the cause, and so does
a run that ends having applied no update at all. Finite weights and advantages are checked by
:mod:`policygrad.learn.health`.
"""

from __future__ import annotations

import math
from typing import Any

from policygrad.config.agent import episode_fields
from policygrad.errors import TrainingError

__all__ = ["UpdateWatch", "why_nothing_trained"]


def why_nothing_trained(metrics: dict[str, Any], config) -> str:
    """The cause of a step that applied no update, from its metrics (names of
    :data:`~policygrad.learn.metrics.METRICS`) and the run's config."""
    if metrics.get("optim/skipped_nonfinite", 0) or metrics.get("critic/skipped_nonfinite", 0):
        tokens = metrics.get("policy/nonfinite_tokens", 0)
        extra = f" ({tokens:g} sampled tokens had log-prob -inf)" if tokens else ""
        # The weights of the loss's other terms scale the gradient as much as the learning rate.
        loss = config.loss
        weights = [
            f"{name}={value:g}"
            for name, value in (
                ("loss.entropy_coef", loss.entropy_coef),
                ("loss.positive_lm_coef", loss.positive_lm_coef),
                ("kl.beta", config.kl.beta),
            )
            if value
        ]
        terms = f", the weights of the loss terms ({', '.join(weights)})" if weights else ""
        return (
            "every optimizer step was skipped because the loss or the gradient was not finite"
            f"{extra}: check optim.lr (lr={config.optim.lr:g}){terms}, the scale of the rewards, and the "
            "model's weights for NaN or infinity"
        )
    if metrics.get("optim/steps"):  # steps were taken: their gradient was exactly 0
        return _why_zero_gradient(metrics, config)
    if metrics.get("optim/early_stopped"):
        return (
            f"optim.target_kl={config.optim.target_kl:g} stopped every update before its first step "
            "(policy/approx_kl was above it); raise optim.target_kl"
        )
    if metrics.get("dynamic_sampling/groups_kept") == 0:
        decided = config.dynamic_sampling_reward
        scorer = "the reward functions"
        if config.env.name:  # the environment's rewards, turn rewards included, are in the return
            scorer = episode_fields(config)["rewards"] + (
                " and the reward functions" if decided == "return" and config.reward.functions else ""
            )
            if decided not in ("return", "env"):
                scorer = f"the reward function {decided!r}"
        return (
            f"no group had reward signal (drop_zero_variance_groups keeps none when every sample of a "
            f"prompt has the same dynamic_sampling.reward={decided!r}); check {scorer}"
        )
    if metrics.get("reward/invalid_frac") == 1:
        return (
            "the reward functions failed on every row and reward.on_error=skip left every row out of the "
            "loss (see reward_fn/<fn>/invalid); fix the reward functions"
        )
    if config.reward.truncation == "exclude" and metrics.get("response/truncated_frac") == 1:
        return (
            f"every completion was cut at rollout.max_new_tokens={config.rollout.max_new_tokens} and "
            "reward.truncation=exclude leaves them out of the loss; raise rollout.max_new_tokens"
        )
    return "no token carried loss (every row was left out of the loss)"


def _why_zero_gradient(metrics: dict[str, Any], config) -> str:
    functions = config.reward.functions
    if metrics.get("reward/zero_variance_group_frac") == 1:
        mean = metrics.get("reward/mean", float("nan"))
        code = "" if "code_tests" in functions else " (code rows: code_tests)"
        scorer = f"reward.functions={functions}"
        if config.env.name:  # episodes are scored by the environment first
            scorer, code = episode_fields(config)["rewards"], ""
            if functions:
                scorer += f" or reward.functions={functions}"
        return (
            f"every advantage was 0 at every step: the rewards gave each group's samples the same score "
            f"(reward/mean {mean:g}), so the gradient was exactly 0 and nothing was learned; make "
            f"{scorer} tell the completions apart{code}, or set "
            "drop_zero_variance_groups=true to skip such groups"
        )
    if _number(metrics.get("reward/zero_variance_group_frac", 1)) < 1:
        # Some group's samples scored differently, so its advantages were not 0: a gradient of
        # exactly 0 then means the policy no longer responds to its weights (a step too large
        # saturated it, e.g. to a uniform distribution), not that the rewards are flat.
        entropy = metrics.get("policy/entropy")
        seen = f" (policy/entropy {entropy:g})" if isinstance(entropy, (int, float)) else ""
        return (
            "the run diverged: the policy's gradient was exactly 0 at every optimizer step although the "
            "samples of a group scored differently (the advantages were not 0), so the policy no longer "
            f"responds to its weights{seen}, as after a step too large for it; lower optim.lr "
            f"(lr={config.optim.lr:g}) and start again from the model or a checkpoint from before it diverged"
        )
    return (
        "the policy's gradient was exactly 0 at every optimizer step (every advantage 0 and no other loss "
        f"term), so nothing was learned; check that reward.functions={functions} tell the completions "
        "apart and how the advantage estimator and reward normalisation treat their scores"
    )


class UpdateWatch:
    """Counts applied updates and consecutive empty steps (see the module docstring).

    Args:
        config: the run's config (``max_skipped_updates`` and what causes name).

    Attributes:
        applied: optimizer steps applied over the run (policy and critic).
        steps: RL steps watched over the run.
        empty_in_a_row: consecutive steps that applied nothing, up to the last one.
        skipped_nonfinite: optimizer steps (policy and critic) skipped over the run because their
            loss or gradient was not finite.
        diverged: steps whose gradient was exactly 0 although a group's samples scored differently
            (a policy that no longer responds to its weights).
    """

    def __init__(self, config):
        self.config = config
        self.applied = 0
        self.steps = 0
        self.empty_in_a_row = 0
        self.skipped_nonfinite = 0
        self.diverged = 0
        self.last_cause = ""

    def observe(self, metrics: dict[str, Any]) -> None:
        """Record one step's metrics.

        Raises:
            TrainingError: this was the ``max_skipped_updates``-th empty step in a row.
        """
        policy = int(metrics.get("optim/steps", 0))
        critic = int(_number(metrics.get("critic/steps", 0)))
        # A step with a gradient of exactly 0 (in every optimizer step: the mean of norms is 0)
        # moved nothing; absent norms (older metrics) count as moving.
        if metrics.get("optim/grad_norm") == 0:
            policy = 0
        if metrics.get("critic/grad_norm") == 0:
            critic = 0
        applied = policy + critic
        self.steps += 1
        self.applied += applied
        self.skipped_nonfinite += int(_number(metrics.get("optim/skipped_nonfinite", 0)))
        self.skipped_nonfinite += int(_number(metrics.get("critic/skipped_nonfinite", 0)))
        if applied:
            self.empty_in_a_row = 0
            return
        self.empty_in_a_row += 1
        self.last_cause = why_nothing_trained(metrics, self.config)
        self.diverged += self.last_cause.startswith("the run diverged")
        limit = self.config.max_skipped_updates
        if limit and self.empty_in_a_row >= limit:
            raise TrainingError(
                f"{self.empty_in_a_row} steps in a row applied no update: {self.last_cause} "
                f"(max_skipped_updates={limit})"
            )

    def check_trained(self) -> None:
        """At the end of a run that took at least one step.

        Raises:
            TrainingError: no update was applied over the whole run.
        """
        if self.steps and not self.applied:
            raise TrainingError(
                f"the run applied no update in {self.steps} steps: {self.last_cause}; nothing was trained"
            )

    def end_warning(self) -> str | None:
        """The ``warning:`` line for a run that ended (having applied updates) with optimizer steps
        skipped as non-finite or steps where the policy no longer responded, else None: such a run
        diverged, though too few of its steps were empty for ``max_skipped_updates`` to end it."""
        if not self.skipped_nonfinite and not self.diverged:
            return None
        seen = []
        if self.skipped_nonfinite:
            seen.append(
                f"{self.skipped_nonfinite} optimizer steps were skipped because the loss or the gradient "
                "was not finite (optim/skipped_nonfinite)"
            )
        if self.diverged:
            seen.append(
                f"in {self.diverged} steps the policy's gradient was exactly 0 although a group's samples "
                "scored differently"
            )
        return (
            f"warning: the run diverged over its {self.steps} steps: {' and '.join(seen)}; its weights are "
            f"not usable; lower optim.lr (lr={self.config.optim.lr:g}) and start again from the model or a "
            "checkpoint from before it diverged"
        )

    def state_dict(self) -> dict[str, int]:
        return {
            "applied": self.applied,
            "steps": self.steps,
            "empty_in_a_row": self.empty_in_a_row,
            "skipped_nonfinite": self.skipped_nonfinite,
            "diverged": self.diverged,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.applied = int(state.get("applied", 0))
        self.steps = int(state.get("steps", 0))
        self.empty_in_a_row = int(state.get("empty_in_a_row", 0))
        self.skipped_nonfinite = int(state.get("skipped_nonfinite", 0))
        self.diverged = int(state.get("diverged", 0))


def _number(value) -> float:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else 0
