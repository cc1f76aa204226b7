"""One episode while it runs (:class:`EpisodeState`, the runner's working record: its ids, masks,
rewards, messages and stop), and what a finished batch of them becomes: the rollout's columns
(:func:`to_rollout`) and the :class:`~policygrad.envs.records.Episodes` record (:func:`to_episodes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from policygrad.envs.base import STOP_REASONS, TRUNCATING_STOPS, EnvironmentFailure
from policygrad.envs.records import Episodes
from policygrad.rollout.base import Rollout

__all__ = ["EpisodeState", "accept", "group_tools", "to_episodes", "to_rollout"]


@dataclasses.dataclass
class EpisodeState:
    """One episode while it runs."""

    row: Mapping[str, Any]
    seed: int  # the episode's own seed, for turns after the first
    reset_seed: int  # its row's seed: reset()'s
    env: int | None = None  # the environment's handle in the runner's host
    tools: list[dict] | None = None  # native tool schemas (see group_tools)
    opening: list[dict] | None = None  # what its group's reset() gave (None: every one failed)
    start: list[dict] = dataclasses.field(default_factory=list)  # the messages of its prompt
    attempts: int = 0  # fresh environments after the first
    origin: int | None = None  # a retried episode's first seed
    close_error: str | None = None
    messages: list[dict] = dataclasses.field(default_factory=list)
    ids: list[int] = dataclasses.field(default_factory=list)  # everything after the prompt
    action: list[bool] = dataclasses.field(default_factory=list)  # per id: sampled by the policy
    logprobs: list[float] = dataclasses.field(default_factory=list)
    rewards: dict[int, float] = dataclasses.field(default_factory=dict)  # position -> turn reward
    info: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    turns: int = 0
    stepped: bool = True  # env.step has seen the newest turn
    final: float = 0.0
    last_action: str = ""
    stop: str | None = None
    error: str | None = None

    def fail(self, message: str) -> None:
        self.stop, self.error = "error", message


def to_rollout(first: Rollout, episodes: list[EpisodeState], pad_id: int) -> Rollout:
    """``first`` (the first turn's rollout) with the whole episodes' columns: every id after the
    prompt (right-padded with ``pad_id``), the action and observation masks, the sampler's
    log-probs, and ``truncated`` where the episode stopped on a cut turn."""
    T = max(len(e.ids) for e in episodes)
    B = len(episodes)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    action = torch.zeros(B, T, dtype=torch.float32)
    observed = torch.zeros(B, T, dtype=torch.float32)
    logprobs = torch.zeros(B, T, dtype=torch.float32)
    for r, e in enumerate(episodes):
        n = len(e.ids)
        ids[r, :n] = torch.tensor(e.ids, dtype=torch.long)
        mask = torch.tensor(e.action, dtype=torch.bool)
        action[r, :n] = mask.float()
        observed[r, :n] = (~mask).float()
        logprobs[r, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
    truncated = torch.tensor([e.stop in TRUNCATING_STOPS for e in episodes], dtype=torch.bool)
    device = first.response_ids.device
    return dataclasses.replace(
        first,
        response_ids=ids.to(device),
        response_mask=action.to(device),
        sampler_logprobs=logprobs.to(device),
        truncated=truncated.to(device),
        observation_mask=observed.to(device) if bool(observed.any()) else None,
    )


def to_episodes(episodes: list[EpisodeState], env_seconds: float) -> Episodes:
    """The :class:`~policygrad.envs.records.Episodes` record of finished ``episodes``."""
    T = max(len(e.ids) for e in episodes)
    turn_rewards = torch.zeros(len(episodes), T, dtype=torch.float32)
    for r, e in enumerate(episodes):
        for position, reward in e.rewards.items():
            turn_rewards[r, position] = reward
    keys = sorted({k for e in episodes for k in e.info})
    nan = float("nan")
    info = {
        k: torch.tensor([sum(e.info[k]) / len(e.info[k]) if e.info.get(k) else nan for e in episodes])
        for k in keys
    }
    return Episodes(
        turn_rewards=turn_rewards,
        final_rewards=torch.tensor([e.final for e in episodes], dtype=torch.float32),
        stop=torch.tensor([STOP_REASONS.index(e.stop) for e in episodes], dtype=torch.long),
        turns=torch.tensor([e.turns for e in episodes], dtype=torch.long),
        failed=torch.tensor([e.stop == "error" for e in episodes], dtype=torch.bool),
        info=info,
        transcripts=[e.messages for e in episodes],
        errors=[e.error for e in episodes],
        env_seconds=env_seconds,
        retries=sum(e.attempts for e in episodes),
        close_errors=sum(e.close_error is not None for e in episodes),
    )


def accept(e: EpisodeState, outcome: tuple[bool, Any], call: str, check: Callable[[Any], Any]) -> Any:
    """The checked value of an environment call's ``outcome`` (from
    :func:`~policygrad.envs.workers.call_all`), or None after failing episode ``e`` with one line
    that names ``call`` (what it raised, or why its value was refused)."""
    ok, value = outcome
    if not ok:
        e.fail(f"{call} failed: {value}")
        return None
    try:
        return check(value)
    except EnvironmentFailure as exc:
        e.fail(str(exc) if str(exc).startswith(call) else f"{call} failed: {exc}")
        return None


def group_tools(group: list[EpisodeState]) -> list[dict] | None:
    """The native tool schemas (:func:`~policygrad.envs.workers.native_tools`, read by the
    environment's host after ``reset``) of the group's first live episode, else None."""
    return next((e.tools for e in group if e.env is not None and e.stop is None), None)
