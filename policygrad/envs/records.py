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
from policygrad.rollout.base import RESPONSE, ROW, Rollout, field_layouts, pad_columns

__all__ = ["EpisodeLimits", "Episodes", "Segments"]


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
class Segments:
    """The earlier segments of a batch's episodes: the rows an episode left behind each time its
    history restarted (``StepResult.restart``), the episode's own row holding its last segment.

    Attributes:
        rollout: S rows, each a segment's prompt (the conversation as it was rendered when the
            segment began), its actions and observations, laid out as the episodes' rollout;
            ``group_index`` and ``weight_version`` are meaningless here: a segment's are its
            episode's (:meth:`~policygrad.produce.stages.SampledBatch.training_rollout`).
        owner: long [S], the episode (row of the batch) each segment belongs to, in order of the
            episodes and, within one, of the segments.
    """

    rollout: Rollout
    owner: torch.Tensor

    def select(self, rows: list[int]) -> Segments | None:
        """The segments of the episodes ``rows`` (in that order), ``owner`` renumbered to their
        positions in ``rows``; None when none of them has one."""
        of: dict[int, list[int]] = {}
        for s, o in enumerate(self.owner.tolist()):
            of.setdefault(o, []).append(s)
        keep = [(i, s) for i, r in enumerate(rows) for s in of.get(r, [])]
        if not keep:
            return None
        return Segments(self.rollout.select([s for _, s in keep]), torch.tensor([i for i, _ in keep]))

    @staticmethod
    def concat(parts: Sequence[tuple[Segments | None, int]]) -> Segments | None:
        """The segments of batches joined in order (``parts``: each batch's segments and its
        number of episodes, by which the next batch's owners are offset); None when none has one."""
        rollouts, owners, offset = [], [], 0
        for segments, episodes in parts:
            if segments is not None:
                rollouts.append(segments.rollout)
                owners.append(segments.owner + offset)
            offset += episodes
        if not rollouts:
            return None
        return Segments(Rollout.concat(rollouts, renumber=False), torch.cat(owners))


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
        restarts: long [B], the times each episode's history restarted (its earlier segments);
            None in records made before segments existed (read as 0).
        earlier_tokens: long [B, 2], the action and observation tokens of each episode's earlier
            segments (None as ``restarts``).
        segments: the earlier segments (:class:`Segments`; None: no episode restarted), local
            to this process (each process trains its own).
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
    restarts: torch.Tensor | None = dataclasses.field(default=None, metadata={"layout": ROW})
    earlier_tokens: torch.Tensor | None = dataclasses.field(default=None, metadata={"layout": ROW})
    segments: Segments | None = dataclasses.field(default=None, metadata={"layout": "segments"})

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
            self.segments.select(index) if self.segments is not None else None,
        )

    @classmethod
    def concat(cls, parts: Sequence[Episodes]) -> Episodes:
        """One batch of several, rows in order, ``turn_rewards`` right-padded with 0."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.turn_rewards.shape[1] for p in parts)

        def joined(name: str) -> torch.Tensor:
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):  # a record from before segments: none restarted
                like = next(v for v in values if v is not None)
                values = [like.new_zeros((len(p.stop), *like.shape[1:])) if v is None else v
                          for p, v in zip(parts, values)]
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
        segments = Segments.concat([(p.segments, len(p.stop)) for p in parts])
        return parts[0]._build(joined, info, local, counts, segments)

    def gather(self, gather_rows) -> Episodes:
        """Every process's episodes (see :meth:`Rollout.gather`); ``info`` (whose keys may
        differ between processes), transcripts, errors and segments stay this process's."""
        info = self.info
        return self._build(
            lambda name: gather_rows(getattr(self, name), left=False),
            info,
            [[], []],
            (self.env_seconds, self.retries, self.close_errors),
            self.segments,
        )

    def _build(
        self, tensor_of: Callable[[str], torch.Tensor], info, local, counts, segments: Segments | None
    ) -> Episodes:
        values = {
            name: tensor_of(name) if getattr(self, name) is not None else None
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
            segments=segments,
        )
