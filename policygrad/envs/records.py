"""The records of an episode run (:class:`~policygrad.envs.episodes.EpisodeRunner`): how far an
episode may run (:class:`EpisodeLimits`, from ``rollout.*``) and what a batch of episodes
produced beyond its :class:`~policygrad.rollout.base.Rollout` (:class:`Episodes`: per-turn and
final rewards, stop reasons, turns, failures, transcripts), with the row operations the rollout
has (select, concat, gather)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from policygrad.envs.base import STOP_REASONS, TRUNCATING_STOPS
from policygrad.rollout.base import RESPONSE, ROW, field_layouts, pad_columns

__all__ = ["EpisodeLimits", "Episodes"]


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """How far an episode may run (``rollout.*`` of the config).

    Attributes:
        max_turns: the most policy turns; reaching it is the stop ``max_turns`` (not a truncation).
        max_new_tokens: the most tokens of one turn.
        max_episode_tokens: the most tokens after the prompt (actions and observations); None: no
            limit but the context.
        max_observation_tokens: the most tokens of one observation message's content (longer ones
            keep their head and tail); None: no limit.
        max_context: the engine's context in tokens (prompt and everything after it); None: none.
        step_timeout_s: the most seconds one environment call may take; None: no limit.
        workers: environment calls run at once (worker processes, or threads in-process).
        retries: fresh attempts of an episode that failed in the environment (see
            :meth:`EpisodeRunner.run`).
        isolation: environments run in worker processes (:mod:`policygrad.envs.workers`).
        timeout_field: the option ``step_timeout_s`` came from, named when a call times out.
    """

    max_turns: int = 1
    max_new_tokens: int = 32
    max_episode_tokens: int | None = None
    max_observation_tokens: int | None = None
    max_context: int | None = None
    step_timeout_s: float | None = None
    workers: int = 4
    retries: int = 0
    isolation: bool = True
    timeout_field: str = "rollout.env_step_timeout_s"


@dataclasses.dataclass
class Episodes:
    """What a batch of episodes produced beyond the :class:`Rollout` (B rows, as the rollout's).

    Attributes:
        turn_rewards: float32 [B, T], each turn's reward on its last action token, 0 elsewhere.
        final_rewards: float32 [B], ``final_reward(stop_reason)`` (0 for failed episodes).
        stop: long [B], index of each episode's stop reason in :data:`STOP_REASONS`.
        turns: long [B], policy turns taken.
        failed: bool [B], episodes whose environment raised, timed out or died, after their
            retries (no loss).
        info: key -> float32 [B], each episode's mean of ``StepResult.info[key]`` (NaN: never given).
        transcripts: B conversations (the opening messages, then assistant / observation
            messages), local to this process.
        errors: B one-line error messages (None where the episode did not fail), local.
        env_seconds: seconds spent in environment calls.
        retries: fresh attempts made for episodes that failed in the environment.
        close_errors: episodes whose ``close()`` failed.
    """

    turn_rewards: torch.Tensor = dataclasses.field(metadata={"layout": RESPONSE})
    final_rewards: torch.Tensor = dataclasses.field(metadata={"layout": ROW})
    stop: torch.Tensor = dataclasses.field(metadata={"layout": ROW})
    turns: torch.Tensor = dataclasses.field(metadata={"layout": ROW})
    failed: torch.Tensor = dataclasses.field(metadata={"layout": ROW})
    info: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict, metadata={"layout": "row_dict"})
    transcripts: list = dataclasses.field(default_factory=list, metadata={"layout": "local"})
    errors: list = dataclasses.field(default_factory=list, metadata={"layout": "local"})
    env_seconds: float = 0.0
    retries: int = 0
    close_errors: int = 0

    @property
    def stop_reasons(self) -> list[str]:
        """The stop reason of each episode."""
        return [STOP_REASONS[int(i)] for i in self.stop]

    @property
    def truncated(self) -> torch.Tensor:
        """bool [B]: episodes that stopped on a cut turn (``length``, ``budget``, ``context``)."""
        cut = torch.tensor([STOP_REASONS.index(s) for s in sorted(TRUNCATING_STOPS)])
        return torch.isin(self.stop, cut)

    def select(self, rows: torch.Tensor) -> Episodes:
        """The episodes ``rows`` (LongTensor), in that order."""
        index = rows.tolist()
        return self._build(
            lambda name: getattr(self, name)[rows],
            {k: v[rows] for k, v in self.info.items()},
            [
                [self.transcripts[i] for i in index] if self.transcripts else [],
                [self.errors[i] for i in index] if self.errors else [],
            ],
            (self.env_seconds, self.retries, self.close_errors),
        )

    @classmethod
    def concat(cls, parts: Sequence[Episodes]) -> Episodes:
        """One batch of several, rows in order, ``turn_rewards`` right-padded with 0."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.turn_rewards.shape[1] for p in parts)

        def joined(name: str) -> torch.Tensor:
            values = [getattr(p, name) for p in parts]
            if name == "turn_rewards":
                values = [pad_columns(v, width, left=False) for v in values]
            return torch.cat(values)

        keys = sorted({k for p in parts for k in p.info})
        info = {
            k: torch.cat([p.info.get(k, torch.full((len(p.stop),), float("nan"))) for p in parts])
            for k in keys
        }
        local = [[t for p in parts for t in p.transcripts], [e for p in parts for e in p.errors]]
        counts = tuple(sum(getattr(p, k) for p in parts) for k in ("env_seconds", "retries", "close_errors"))
        return parts[0]._build(joined, info, local, counts)

    def gather(self, gather_rows) -> Episodes:
        """Every process's episodes (see :meth:`Rollout.gather`); ``info`` (whose keys may
        differ between processes), transcripts and errors stay this process's."""
        info = self.info
        return self._build(
            lambda name: gather_rows(getattr(self, name), left=False),
            info,
            [[], []],
            (self.env_seconds, self.retries, self.close_errors),
        )

    def _build(self, tensor_of: Callable[[str], torch.Tensor], info, local, counts) -> Episodes:
        values = {
            name: tensor_of(name)
            for name, layout in field_layouts(Episodes).items()
            if layout in (RESPONSE, ROW)
        }
        seconds, retries, close_errors = counts
        return Episodes(
            **values,
            info=info,
            transcripts=local[0],
            errors=local[1],
            env_seconds=seconds,
            retries=retries,
            close_errors=close_errors,
        )
