"""The environment protocol: what an episode of several turns asks of the world it acts in.

An episode (one of the G samples of a dataset row) runs::

    messages = env.reset(row, seed=seed)         # the opening messages (chat format)
    loop:   the policy writes one turn (sampled ids kept verbatim)
            result = env.step(turn_text)           # observation messages, turn reward, done
            until result.done, a limit, or an error
    env.final_reward(stop_reason)                  # the episode's score beyond the turn rewards
    env.close()

One environment object serves one episode: :mod:`policygrad.envs.registry` builds a fresh one
per episode from the class (or factory) and its options. The G episodes of a row are reset with
the same seed, so they start from the same messages and face the same hidden state (a GRPO group
compares answers to one problem).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "STOP_REASONS",
    "TRUNCATING_STOPS",
    "Environment",
    "EnvironmentFailure",
    "StepResult",
    "check_messages",
    "check_reward",
    "check_step_result",
    "is_scalar_bool",
]

# Why an episode ended. ``done``: the environment said so; ``max_turns``: the turn limit (not a
# truncation: every turn ended normally); ``length``: a turn hit ``max_new_tokens`` without an
# end id; ``budget``: the episode hit ``max_episode_tokens``; ``context``: the model's context is
# full; ``error``: the environment raised or timed out (the episode carries no loss).
STOP_REASONS = ("done", "max_turns", "length", "budget", "context", "error")
# Stops that cut a turn short: the episode goes through ``reward.truncation`` as a whole.
TRUNCATING_STOPS = frozenset({"length", "budget", "context"})


class EnvironmentFailure(RuntimeError):
    """An environment raised, returned something malformed, or timed out."""


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What :meth:`Environment.step` returns.

    Attributes:
        observation: messages to show the policy before its next turn (``{"role": ..., "content":
            str}``; roles the chat template knows, usually ``user`` or ``tool``); may be empty
            when ``done``.
        reward: the turn's reward, placed on the turn's last action token (0.0: none).
        done: the episode is over; ``observation`` is then not shown.
        info: numbers to log, averaged over a step's turns as ``env/<key>``.
        restart: ``observation`` is the whole conversation from here on (it replaces the
            episode's history instead of extending it): the next turn's prompt is rendered from
            it afresh, and the tokens so far become an earlier *segment* of the episode, a row of
            its own trained with the episode's advantage (an agent whose library trims or rewrites
            its history; :mod:`policygrad.envs.agent`).
    """

    observation: list[dict[str, str]] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float] = dataclasses.field(default_factory=dict)
    restart: bool = False


class Environment(abc.ABC):
    """One episode's world. Subclass and implement :meth:`reset` and :meth:`step`.

    Methods run in worker processes (``rollout.env_isolation``, ``rollout.env_workers``;
    :mod:`policygrad.envs.workers`), each call bounded by ``rollout.env_step_timeout_s``; one
    object per episode, built there from its class and options. Run untrusted code through
    :mod:`policygrad.sandbox` (as :class:`policygrad.envs.tools.ToolEnv` does).
    """

    @abc.abstractmethod
    def reset(self, row: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:
        """The opening messages of an episode on dataset ``row`` (at least one; a ``system``
        message first is allowed). ``seed`` (an int in [0, 2**62)) is the same for the G episodes
        of a row and fixes any randomness of the episode's hidden state."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """The environment's answer to the policy's turn ``action`` (its decoded text, special
        tokens removed). Called on every turn the policy wrote, a turn cut short by a limit
        included: its reward counts, but the episode ends there (its observation is not shown)."""

    def final_reward(self, stop_reason: str) -> float:  # noqa: ARG002 - subclasses use it
        """The episode's reward beyond the turn rewards, placed on its last action token, given
        why it stopped (one of :data:`STOP_REASONS` but ``error``). Default 0.0."""
        return 0.0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode holds (called once, also after an error)."""

    # Optional: ``final_info() -> {name: number}``, called right after :meth:`final_reward`,
    # numbers to log for the whole episode as ``env/<name>`` (the agent environment's named
    # rewards use it); and ``turn_cut()``, called right before :meth:`step` on a turn a limit cut
    # (the agent environment answers it with ``finish_reason: length``). Not defined here, so an
    # environment without them costs nothing.


# A role is rendered by the chat template as markup (ChatML: after <|im_start|>), so it must be a
# name: text such as "user<|im_end|>\n<|im_start|>assistant" would forge a turn.
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def check_messages(messages: Any, what: str, *, allow_empty: bool = False) -> list[dict[str, str]]:
    """``messages`` as a list of ``{"role": str, "content": str}`` dicts (copies; other keys
    such as ``name`` are dropped, so the template renders only these two).

    Raises:
        EnvironmentFailure: not a list of such dicts (names ``what`` and the first bad entry), a
            role that is not a plain name (``[A-Za-z][A-Za-z0-9_-]*``, at most 64 characters),
            or empty when ``allow_empty`` is False.
    """
    if not isinstance(messages, (list, tuple)):
        raise EnvironmentFailure(f"{what} must be a list of messages, got {type(messages).__name__}")
    if not messages and not allow_empty:
        raise EnvironmentFailure(f"{what} is empty; give at least one message")
    out = []
    for i, m in enumerate(messages):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise EnvironmentFailure(
                f"{what}[{i}] must be a dict with string 'role' and 'content', got {m!r:.120}"
            )
        if not _ROLE.fullmatch(m["role"]):
            raise EnvironmentFailure(
                f"{what}[{i}]['role'] must be a plain role name such as 'user' or 'tool' (letters, digits, "
                f"'_' and '-', at most 64 characters), got {m['role']!r:.120}"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


# Rewards become float32 tensors: a larger magnitude would turn into infinity there.
FLOAT32_MAX = 3.4028234663852886e38


def check_reward(value: Any, what: str) -> float:
    """``value`` as a float if it is a real number (not a bool, not a string) that float32 holds
    finitely.

    Raises:
        EnvironmentFailure: anything else (names ``what``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise EnvironmentFailure(f"{what} must be a number, got {value!r:.60}")
    out = float(value)
    if not math.isfinite(out) or abs(out) > FLOAT32_MAX:
        raise EnvironmentFailure(f"{what} must be finite and within float32's range, got {value!r:.60}")
    return out


def check_step_result(result: Any) -> StepResult:
    """``result`` checked: a :class:`StepResult` with a finite float32 reward, bools ``done`` and
    ``restart`` (a restart's observation not empty) and finite numeric info.

    Raises:
        EnvironmentFailure: anything else (names the field).
    """
    if not isinstance(result, StepResult):
        raise EnvironmentFailure(f"step() must return a StepResult, got {type(result).__name__}")
    reward = check_reward(result.reward, "StepResult.reward")
    done, restart = _flag(result.done, "done"), _flag(result.restart, "restart")
    info = {}
    for key, value in dict(result.info).items():
        info[str(key)] = check_reward(value, f"StepResult.info[{key!r}]")
    observation = check_messages(
        result.observation, "StepResult.observation", allow_empty=not (restart and not done)
    )
    return StepResult(observation, reward, done, info, restart)


def is_scalar_bool(value: Any) -> bool:
    """A numpy or torch boolean scalar (a 0-d array of dtype bool)."""
    return getattr(value, "shape", None) == () and str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def _flag(value: Any, name: str) -> bool:
    """``value`` as a bool when it is True or False (numpy's bools too).

    Raises:
        EnvironmentFailure: anything else (names ``StepResult.<name>``).
    """
    if isinstance(value, bool):
        return value
    if is_scalar_bool(value):
        return bool(value)
    if isinstance(value, str) or not any((value == v) is True for v in (True, False)):
        raise EnvironmentFailure(f"StepResult.{name} must be True or False, got {value!r:.60}")
    return bool(value)
