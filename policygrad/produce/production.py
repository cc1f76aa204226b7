"""The sample stage in two halves: the records the producer makes, and what the trainer's thread
makes of them.

- The **producer** (:class:`~policygrad.produce.producer.Producer`) makes a :class:`Production`:
  raw sampling rounds (:class:`RawRound`: samples and the reward functions' raw output), the
  groups DAPO's dynamic sampling keeps (decided on a raw reward component, or with an environment
  on each sample's raw return: :func:`signal_components`) and the sampled part of the estimator's
  inputs. It touches no collective and no trainer state, so the rollouts
  (:mod:`policygrad.produce.rollouts`) may run it in a background thread while the trainer
  updates the policy.
- :func:`finish` (the **trainer's thread**): the episodes' error budget (summed over ranks),
  normalisation (the normaliser's running statistics, a collective with several processes) and
  the truncation policy, the groups kept, and the estimator inputs' finishing.

A synchronous step is ``finish(trainer, producer.produce(step, step))``, with each round's
normalisation after the last round's sampling (the normaliser never feeds sampling, and the
dynamic-sampling decision reads raw components).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from policygrad.config.agent import SEGMENTS_FIX, episode_fields, segments_refused
from policygrad.envs.base import FLOAT32_MAX, STOP_REASONS
from policygrad.envs.episodes import Episodes
from policygrad.envs.records import Segments
from policygrad.errors import TrainingError
from policygrad.produce.inputs import ESTIMATOR_INPUTS
from policygrad.produce.stages import (
    FinishParts,
    SampledBatch,
    concat_batches,
)
from policygrad.rewards.registry import RewardOutput
from policygrad.rewards.scoring import EnvironmentScores
from policygrad.rollout.base import Rollout, SamplingParams

__all__ = [
    "Production",
    "RawRound",
    "check_segments_trainable",
    "chosen_positions",
    "fail_overflowing_episodes",
    "finish",
    "finish_parts",
    "production_from_state",
    "production_state",
    "signal_components",
    "whole_groups",
]


@dataclass(frozen=True)
class RawRound:
    """One sampling round of n prompts before its scores are finished: the rows, their prompt
    token ids, the B = n x G rollout, the decoded completions (an episode's final answer), the
    reward functions' output (:class:`~policygrad.rewards.registry.RewardOutput`, not
    normalised) and, with an environment, the episodes."""

    rows: list[dict[str, Any]]
    prompt_ids: list[list[int]]
    rollout: Rollout
    completions: list[str]
    rewards: RewardOutput
    episodes: Episodes | None = None

    @property
    def group_size(self) -> int:
        """G."""
        return self.rollout.group_size


@dataclass(frozen=True)
class Production:
    """What the producer made for one step.

    Attributes:
        step: the step whose batch this is.
        version: the policy version that sampled it (the number of updates applied to the
            weights the engine held; a synchronous step's batch has ``version == step``).
        rounds: the sampling rounds (one without dynamic sampling).
        kept: per round, the positions of the groups dynamic sampling keeps (None: off).
        inputs: the estimator inputs' sampled parts, by name.
        seconds: wall time of the production.
    """

    step: int
    version: int
    rounds: list[RawRound]
    kept: list[list[int]] | None
    inputs: dict[str, Any]
    seconds: float


def whole_groups(round_: RawRound) -> list[list[int]] | None:
    """``[positions of the groups none of whose episodes failed]`` when an episode of the round
    failed in the environment (after its retries), else None (every group stays). A group
    trained with a failed sample left out would compare its others to a baseline of fewer
    samples than its siblings', so it leaves the batch whole (``env/groups_dropped``)."""
    if round_.episodes is None or not bool(round_.episodes.failed.any()):
        return None
    failed = round_.episodes.failed.view(len(round_.rows), round_.group_size).any(-1)
    return [[i for i in range(len(round_.rows)) if not bool(failed[i])]]


def signal_components(round_: RawRound) -> dict[str, torch.Tensor]:
    """The raw values (float32 [B], NaN where they failed) dynamic sampling may decide on: each
    reward function's component and, with an environment, ``env`` (the episode's final reward
    plus its turn rewards) and ``return`` (``env`` plus the functions' weighted sum: everything
    the sample earned), before normalisation and the truncation policy."""
    out = round_.rewards
    episodes = round_.episodes
    if episodes is None:
        return out.components
    ok = ~episodes.failed
    env = episodes.final_rewards + episodes.turn_rewards.sum(-1)
    nan = torch.tensor(float("nan"))
    return {
        **out.components,
        "env": torch.where(ok, env, nan),
        "return": torch.where(ok & out.valid, out.rewards + env, nan),
    }


def chosen_positions(rounds, kept) -> list[tuple[int, list[int]]] | None:
    """``[(round, its groups trained on)]``, the first ``prompts_per_step`` kept groups in order;
    None without dynamic sampling or when no group has signal."""
    if kept is None:
        return None
    need = len(rounds[0].rows)
    chosen = []
    for r, groups in enumerate(kept):
        if groups[:need]:
            chosen.append((r, groups[:need]))
            need -= len(groups[:need])
    return chosen or None


# ----------------------------------------------------------------------------------------------
# The trainer's thread.


def finish_round(trainer, raw: RawRound, version: int = 0) -> SampledBatch:
    """One round's :class:`SampledBatch` (sampled by policy ``version``): normalised (the run's
    statistics updated), through the truncation policy; with an environment the episodes' error
    budget is checked first and a row cut short goes through ``reward.truncation`` as a whole
    (under ``penalty`` its turn rewards are dropped too).

    Raises:
        TrainingError: more than ``rollout.env_error_budget`` of the round's episodes failed.
    """
    r = trainer.config.rollout
    env = None
    episodes = raw.episodes
    if episodes is not None:
        if episodes.segments is not None:
            check_segments_trainable(trainer.config)
        episodes = fail_overflowing_episodes(episodes, raw.rewards)
        failed = float(trainer.dist.total(episodes.failed.sum())) / max(
            trainer.dist.total(len(raw.completions)), 1
        )
        if failed > r.env_error_budget:
            fields = episode_fields(trainer.config)
            first = next((e for e in episodes.errors if e is not None), "on another rank")
            raise TrainingError(
                f"{failed:.0%} of this step's episodes failed in the environment {fields['source']} "
                f"after {fields['retries']}={r.env_retries} retries "
                f"(rollout.env_error_budget={r.env_error_budget}); first error: {first}"
            )
        returns = episodes.final_rewards + episodes.turn_rewards.sum(-1)  # raw: before the truncation policy
        # Rows out of the loss carry no turn rewards: a failed one (its score is then filled so its
        # return is the group's mean return) and, under ``penalty``, a cut one (its return is the penalty).
        dropped = episodes.failed | ~raw.rewards.valid
        if trainer.scorer.truncation == "penalty":
            dropped = dropped | episodes.truncated
        if dropped.any():
            turn_rewards = episodes.turn_rewards.clone()
            turn_rewards[dropped] = 0.0
            episodes = dataclasses.replace(episodes, turn_rewards=turn_rewards)
        env = EnvironmentScores(
            final_rewards=episodes.final_rewards,
            returns=returns,
            failed=episodes.failed,
            fields={"transcript": episodes.transcripts},
            turn_rewards=episodes.turn_rewards.sum(-1),
        )
    scores = trainer.scorer.finish(raw.rewards, raw.rollout.truncated, raw.rollout.group_index, env=env)
    return SampledBatch(raw.rows, raw.prompt_ids, raw.rollout, raw.completions, scores, episodes, version)


def check_segments_trainable(config) -> None:
    """Stop a run whose environment restarted an episode's history (``StepResult.restart``) when
    the config cannot train its segments (:func:`~policygrad.config.agent.segments_refused`; an
    agent's config is refused at start, an environment's restarts show only when they happen).

    Raises:
        TrainingError: naming the environment, the option and the fix.
    """
    why = segments_refused(config)
    if why is not None:
        raise TrainingError(
            f"the environment {episode_fields(config)['source']} restarted an episode's history "
            f"(StepResult.restart); its earlier segments train with the episode's one advantage, which "
            f"{why} does not give; {SEGMENTS_FIX}"
        )


def fail_overflowing_episodes(episodes: Episodes, rewards: RewardOutput) -> Episodes:
    """``episodes`` with every episode whose rewards, each finite, sum beyond float32's range
    failed (as one whose environment gave a non-finite reward: no loss, counted against
    ``rollout.env_error_budget``, the message naming the rewards), so no return, reward-to-go or
    group statistic of the step becomes infinite.

    The sums checked, in float64, are those an estimator forms from a row's token rewards: every
    partial sum of the turn rewards from the first token and to the last, with the end's rewards
    (the final reward and the reward functions' weighted sum, ``rewards.rewards``, 0 where they
    failed) on the last action token, and the end's rewards themselves. A turn reward of
    ``float32`` infinity (two ``step()`` rewards on one token that overflowed) fails too.
    """
    turns = episodes.turn_rewards.double()
    end = episodes.final_rewards.double() + rewards.rewards.double()
    from_start = turns.cumsum(-1)
    to_end = turns.flip(-1).cumsum(-1).flip(-1) + end[:, None]
    partial = torch.cat([from_start, to_end, end[:, None]], dim=-1)
    bad = ~(partial.abs() <= FLOAT32_MAX).all(-1) & ~episodes.failed
    if not bad.any():
        return episodes
    failed, stop, final = episodes.failed.clone(), episodes.stop.clone(), episodes.final_rewards.clone()
    errors = list(episodes.errors) if episodes.errors else [None] * len(failed)
    for i in bad.nonzero().flatten().tolist():
        worst = float(partial[i][partial[i].abs().nan_to_num(float("inf")).argmax()])
        functions = float(rewards.rewards[i])
        errors[i] = (
            f"the episode's rewards, each finite, sum to {worst:g}, beyond float32's range (|x| <= 3.4e38): "
            f"turn rewards summing to {float(turns[i].sum()):g}, "
            f"final reward {float(episodes.final_rewards[i]):g}"
            + (f", reward functions' weighted sum {functions:g}" if functions else "")
            + "; scale the environment's rewards down"
        )
        failed[i], stop[i], final[i] = True, STOP_REASONS.index("error"), 0.0
    return dataclasses.replace(episodes, failed=failed, stop=stop, final_rewards=final, errors=errors)


def finish(trainer, production: Production) -> tuple[SampledBatch, SampledBatch, dict[str, float], dict]:
    """The trainer's half of the sample stage.

    Returns:
        ``(batch to train on, everything sampled, dynamic-sampling metrics, estimator inputs)``;
        the first has ``version`` = the production's.
    """
    rounds = [finish_round(trainer, raw, production.version) for raw in production.rounds]
    if production.kept is None:
        dropped = _drop_failed_groups(trainer, production.rounds[0], rounds[0])
        inputs = _inputs(trainer, production, dropped)
        metrics = _input_metrics(trainer, production)
        if production.rounds[0].episodes is not None:
            metrics["env/groups_dropped"] = float(
                trainer.dist.total(len(rounds[0].rows) - len(dropped.rows) if dropped is not rounds[0] else 0)
            )
        return dropped, rounds[0], metrics, inputs
    positions = chosen_positions(production.rounds, production.kept)
    sampled = concat_batches(rounds)
    kept_groups = sum(len(groups) for _, groups in positions) if positions else 0
    metrics = {
        "dynamic_sampling/groups_sampled": float(len(sampled.rows)),
        "dynamic_sampling/groups_kept": float(kept_groups),
        "dynamic_sampling/rounds": float(len(rounds)),
    }
    if production.rounds[0].episodes is not None:
        whole = [whole_groups(raw) for raw in production.rounds]
        dropped = sum(len(raw.rows) - len(w[0]) for raw, w in zip(production.rounds, whole) if w is not None)
        metrics["env/groups_dropped"] = float(trainer.dist.total(dropped))
        if metrics["env/groups_dropped"] == float(trainer.dist.total(len(sampled.rows))):
            # every group failed in the environment, none was judged on its signal: the same end as
            # without dynamic sampling (its none-kept is for groups with no signal)
            _no_group_left(trainer, production.rounds)
    if positions is None:  # no group with signal: the first round's rows stay, none carries loss
        nothing = dataclasses.replace(rounds[0].scores, valid=torch.zeros_like(rounds[0].scores.valid))
        batch = dataclasses.replace(rounds[0], scores=nothing)
    else:
        batch = concat_batches([rounds[r].select_groups(groups) for r, groups in positions])
    inputs = _inputs(trainer, production, batch)
    metrics.update(_input_metrics(trainer, production))
    return batch, sampled, metrics, inputs


def no_group_left(env: str, retries: int, errors, fields: dict[str, str] | None = None) -> str:
    """The message when every group of a step held a failed episode: names the environment and the
    first error; suggests the step timeout only when an episode timed out (``errors``: the
    episodes' errors, None for those that did not fail; empty on a rank with none). ``fields``:
    :func:`~policygrad.config.agent.episode_fields` (default: an environment's)."""
    f = fields or {"source": f"env.name={env}", "retries": "rollout.env_retries",
                   "timeout": "rollout.env_step_timeout_s"}
    failed = [e for e in errors if e is not None]
    timed_out = any(f["timeout"] in e for e in failed)
    what = "fix the agent" if f["source"].startswith("agent.") else "fix the environment"
    return (
        f"every group of this step has an episode that failed in the environment {f['source']} after "
        f"{f['retries']}={retries} retries, so no group is left to train on; first error: "
        f"{failed[0] if failed else 'on another rank'}; {what}"
        + (f" (or raise {f['timeout']})" if timed_out else "")
    )


def _drop_failed_groups(trainer, raw: RawRound, batch: SampledBatch) -> SampledBatch:
    """``batch`` without the groups that hold an episode failed in the environment
    (:func:`whole_groups`); with none left on this process, the batch with no row carrying loss
    (as dynamic sampling's none-kept).

    Raises:
        TrainingError: no process has a group left (names the environment and the first error).
    """
    whole = whole_groups(raw)
    if whole is None:
        return batch
    left = float(trainer.dist.total(len(whole[0])))
    if left == 0:
        _no_group_left(trainer, [raw])
    if not whole[0]:
        return dataclasses.replace(
            batch, scores=dataclasses.replace(batch.scores, valid=torch.zeros_like(batch.scores.valid))
        )
    return batch.select_groups(whole[0])


def _no_group_left(trainer, raws: list[RawRound]) -> None:
    """Raise the error of a step none of whose groups is left after the environment's failures
    (:func:`no_group_left`, over every round's episodes).

    Raises:
        TrainingError: always (names the environment, the retries and the first error).
    """
    errors = [e for raw in raws for e in raw.episodes.errors]
    config = trainer.config
    fields = episode_fields(config)
    raise TrainingError(no_group_left(config.env.name, config.rollout.env_retries, errors, fields))


def finish_parts(trainer) -> FinishParts:
    """What the estimator inputs' finishing halves read of the trainer's: the scorer (the
    normaliser's statistics), the data-parallel group and the estimator's options."""
    return FinishParts(trainer.scorer, trainer.dist, trainer.config.estimator_options)


def _inputs(trainer, production: Production, batch: SampledBatch) -> dict[str, torch.Tensor]:
    """The estimator inputs the producer sampled (``production.inputs``: the estimator's
    declared ones, in its order), finished."""
    parts = finish_parts(trainer)
    made = production.inputs.items()
    return {name: ESTIMATOR_INPUTS[name].finish(parts, payload, batch) for name, payload in made}


def _input_metrics(trainer, production: Production) -> dict[str, float]:
    """The metrics of the estimator inputs that report some (VinePPO's extra sampling)."""
    out: dict[str, float] = {}
    parts = finish_parts(trainer)
    for name, payload in production.inputs.items():
        if ESTIMATOR_INPUTS[name].metrics is not None:
            out.update(ESTIMATOR_INPUTS[name].metrics(parts, payload))
    return out


# ----------------------------------------------------------------------------------------------
# Checkpoints: a production as tensors, lists, dicts and numbers (``torch.load(weights_only=True)``).

_TYPES = {
    cls.__name__: cls
    for cls in (Production, RawRound, Rollout, SamplingParams, Episodes, Segments, RewardOutput)
}


def _encode(value):
    if isinstance(value, RewardOutput):  # a NamedTuple: its fields by name
        return {"__type__": "RewardOutput", **{k: _encode(v) for k, v in value._asdict().items()}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__type__": type(value).__name__, **fields}
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, dict):
        fields = {k: _decode(v) for k, v in value.items() if k != "__type__"}
        kind = value.get("__type__")
        return _TYPES[kind](**fields) if kind is not None else fields
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def production_state(production: Production) -> dict[str, Any]:
    """``production`` as nested dicts, lists, tensors and numbers (tensors by reference)."""
    return _encode(production)


def production_from_state(state: dict[str, Any]) -> Production:
    """The :class:`Production` that :func:`production_state` wrote.

    Raises:
        KeyError: a record of a type this version does not know.
    """
    return _decode(state)
