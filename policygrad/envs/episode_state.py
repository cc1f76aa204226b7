"""One episode while it runs (:class:`EpisodeState`, the runner's working record: its ids, masks,
rewards, messages and stop), and what a finished batch of them becomes: the rollout's columns
(:func:`to_rollout`) and the :class:`~policygrad.envs.records.Episodes` record (:func:`to_episodes`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from policygrad.envs.base import STOP_REASONS, TRUNCATING_STOPS, EnvironmentFailure, check_reward
from policygrad.envs.records import Episodes, Segments
from policygrad.rollout.base import Rollout

__all__ = [
    "EpisodeState",
    "accept",
    "check_tool_schemas",
    "checked_final",
    "group_tools",
    "to_episodes",
    "to_rollout",
    "to_segments",
]


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
    prompt: list[int] = dataclasses.field(default_factory=list)  # the segment's prompt ids
    # Earlier segments (a restarted history): (prompt, ids, action, logprobs) each; ``spent`` their
    # tokens after the prompt (the budget counts them), ``carried`` their turn rewards.
    segments: list[tuple] = dataclasses.field(default_factory=list)
    spent: int = 0
    carried: float = 0.0

    def fail(self, message: str) -> None:
        self.stop, self.error = "error", message


def to_rollout(first: Rollout, episodes: list[EpisodeState], pad_id: int) -> Rollout:
    """``first`` (the first turn's rollout) with the whole episodes' columns: every id after the
    prompt (right-padded with ``pad_id``), the action and observation masks, the sampler's
    log-probs, and ``truncated`` where the episode stopped on a cut turn; where an episode
    restarted, the prompt of its last segment (left-padded with ``pad_id``)."""
    device = first.response_ids.device
    if any(e.segments for e in episodes):
        ids, mask = _prompt_columns([e.prompt for e in episodes], pad_id)
        first = dataclasses.replace(first, prompt_ids=ids.to(device), prompt_mask=mask.to(device))
    columns = _response_columns([(e.ids, e.action, e.logprobs) for e in episodes], pad_id, device)
    truncated = torch.tensor([e.stop in TRUNCATING_STOPS for e in episodes], dtype=torch.bool)
    return dataclasses.replace(first, truncated=truncated.to(device), **columns)


def _prompt_columns(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_ids, prompt_mask)`` [R, P] of ``prompts``, left-padded with ``pad_id``."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), P, dtype=torch.long)
    for r, prompt in enumerate(prompts):
        ids[r, P - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[r, P - len(prompt) :] = 1
    return ids, mask


def _response_columns(rows: list[tuple], pad_id: int, device) -> dict[str, torch.Tensor | None]:
    """The response fields of a :class:`Rollout` of ``rows`` (``(ids, action flags, log-probs)``
    each, right-padded with ``pad_id``) on ``device``: ids, the action and observation masks
    (None when nothing is observed) and the sampler's log-probs."""
    R, T = len(rows), max(len(ids) for ids, _, _ in rows)
    ids = torch.full((R, T), pad_id, dtype=torch.long)
    action = torch.zeros(R, T, dtype=torch.float32)
    observed = torch.zeros(R, T, dtype=torch.float32)
    logprobs = torch.zeros(R, T, dtype=torch.float32)
    for r, (row_ids, row_action, row_logprobs) in enumerate(rows):
        n = len(row_ids)
        ids[r, :n] = torch.tensor(row_ids, dtype=torch.long)
        mask = torch.tensor(row_action, dtype=torch.bool)
        action[r, :n] = mask.float()
        observed[r, :n] = (~mask).float()
        logprobs[r, :n] = torch.tensor(row_logprobs, dtype=torch.float32)
    return {
        "response_ids": ids.to(device),
        "response_mask": action.to(device),
        "sampler_logprobs": logprobs.to(device),
        "observation_mask": observed.to(device) if bool(observed.any()) else None,
    }


def to_episodes(episodes: list[EpisodeState], env_seconds: float, rollout: Rollout, pad_id: int) -> Episodes:
    """The :class:`~policygrad.envs.records.Episodes` record of finished ``episodes`` (whose
    rows are ``rollout``, :func:`to_rollout`'s); earlier segments' turn rewards are added on the
    episode's last action token, where its final reward is."""
    T = max(len(e.ids) for e in episodes)
    turn_rewards = torch.zeros(len(episodes), T, dtype=torch.float32)
    for r, e in enumerate(episodes):
        for position, reward in e.rewards.items():
            turn_rewards[r, position] = reward
        if e.carried and True in e.action:
            last = len(e.action) - 1 - e.action[::-1].index(True)
            turn_rewards[r, last] += e.carried
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
        restarts=torch.tensor([len(e.segments) for e in episodes], dtype=torch.long),
        earlier_tokens=torch.tensor([_earlier_tokens(e) for e in episodes], dtype=torch.long).view(-1, 2),
        segments=to_segments(episodes, rollout, pad_id),
    )


def _earlier_tokens(e: EpisodeState) -> list[int]:
    """``[action tokens, observation tokens]`` of ``e``'s earlier segments."""
    actions = sum(sum(action) for _, _, action, _ in e.segments)
    return [actions, sum(len(action) for _, _, action, _ in e.segments) - actions]


def to_segments(episodes: list[EpisodeState], rollout: Rollout, pad_id: int) -> Segments | None:
    """The episodes' earlier segments (:class:`~policygrad.envs.records.Segments`), laid out as
    ``rollout`` (prompts left-padded and responses right-padded with ``pad_id``, on its device,
    its sampling and group size); None when no episode restarted."""
    rows = [(r, segment) for r, e in enumerate(episodes) for segment in e.segments]
    if not rows:
        return None
    S = len(rows)
    prompt_ids, prompt_mask = _prompt_columns([prompt for _, (prompt, *_) in rows], pad_id)
    owner = torch.tensor([r for r, _ in rows], dtype=torch.long)
    device = rollout.response_ids.device
    segments = Rollout(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        truncated=torch.zeros(S, dtype=torch.bool, device=device),  # a segment's turns all ended
        group_index=owner.to(device),  # a placeholder: a segment's group is its episode's
        group_size=rollout.group_size,
        sampling=rollout.sampling,
        **_response_columns([segment[1:] for _, segment in rows], pad_id, device),
    )
    return Segments(segments, owner)


def checked_final(value: Any) -> tuple[float, dict[str, float]]:
    """A ``final_reward`` call's value (the reward, or ``(reward, final_info())``) checked."""
    info: Any = {}
    if isinstance(value, tuple) and len(value) == 2:
        value, info = value
    if not isinstance(info, Mapping):
        raise EnvironmentFailure(f"final_info() must return a dict of numbers, got {info!r:.60}")
    return check_reward(value, "final_reward()"), {
        str(k): check_reward(v, f"final_info()[{k!r}]") for k, v in info.items()
    }


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


def check_tool_schemas(tools: Any, delta) -> list[dict] | None:
    """Native tool schemas (``tool_schemas()``'s value) checked: a list of JSON dicts without the
    text of a special token (the template renders them as markup, so such text would be read as
    real tokens; ``delta``: the runner's :class:`~policygrad.envs.template.ChatDelta`).

    Raises:
        EnvironmentFailure: anything else (names ``tool_schemas()``).
    """
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise EnvironmentFailure(f"tool_schemas() must return a list of dicts, got {tools!r:.120}")
    try:
        text = json.dumps(tools, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise EnvironmentFailure(f"tool_schemas() must be JSON ({exc})") from None
    found = delta.special_in(text)
    if found is not None:
        raise EnvironmentFailure(
            f"tool_schemas() holds the text of the special token {found!r}, which the chat template "
            "would render as a real token; remove it from the tool's name and description"
        )
    return tools


def group_tools(group: list[EpisodeState]) -> list[dict] | None:
    """The native tool schemas (:func:`~policygrad.envs.workers.native_tools`, read by the
    environment's host after ``reset``) of the group's first live episode, else None."""
    return next((e.tools for e in group if e.env is not None and e.stop is None), None)
