"""``builtin:guess``: find a secret integer in ``[low, high]`` from "Higher." / "Lower." replies.

The smallest multi-turn task with a known optimum: binary search finds any secret in at most
``ceil(log2(high - low + 2))`` guesses, so the number of turns an episode takes measures how well
the policy uses the environment's feedback (the reward is the same for a lucky and a systematic
search unless ``turn_penalty`` is set). Rows: ``builtin:guess`` (:mod:`policygrad.data.guess_task`)
or any row; ``secret``, ``low`` and ``high`` are read from the row when present.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from policygrad.data.guess_task import guess_prompt
from policygrad.envs.base import Environment, StepResult

__all__ = ["GuessEnv"]

_INTEGER = re.compile(r"-?\d+")  # the first integer of the reply is the guess


def _int_option(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


class GuessEnv(Environment):
    """The guessing game (module docstring).

    Args:
        low: the smallest possible secret (default 1), unless the row has ``low``.
        high: the largest possible secret (default 100), unless the row has ``high``.
        turn_penalty: subtracted from the final reward per turn used (default 0.0), so that with
            it set, fewer guesses score higher.

    Raises:
        ValueError: ``low > high`` or a non-integer bound (from the options, or the row's at
            :meth:`reset`), a negative ``turn_penalty``, a row's ``secret`` outside the range.

    :meth:`reset` draws the secret from ``random.Random(seed)`` when the row has no ``secret``
    (the G episodes of a row share the seed, hence the secret). ``StepResult.info``: ``guesses``
    (1 per turn), ``invalid`` (1 for a turn without an integer), ``out_of_range`` and ``found``
    (1 on the turn that finds it).
    """

    def __init__(self, *, low: int = 1, high: int = 100, turn_penalty: float = 0.0):
        self.low, self.high = _int_option("low", low), _int_option("high", high)
        if self.low > self.high:
            raise ValueError(f"low={low} must be at most high={high}")
        if (isinstance(turn_penalty, bool) or not isinstance(turn_penalty, (int, float))
                or not turn_penalty >= 0):
            raise ValueError(f"turn_penalty must be a non-negative number, got {turn_penalty!r}")
        self.turn_penalty = float(turn_penalty)
        self.secret: int | None = None
        self.turns = 0
        self.found = False

    def reset(self, row: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:
        """One user message: the game's rules and range (the row's ``prompt`` when it has one)."""
        low = _int_option("row field 'low'", row.get("low", self.low))
        high = _int_option("row field 'high'", row.get("high", self.high))
        if low > high:
            raise ValueError(f"row range low={low} > high={high}")
        self.low, self.high = low, high
        if row.get("secret") is not None:
            self.secret = _int_option("row field 'secret'", row["secret"])
            if not low <= self.secret <= high:
                raise ValueError(f"row secret {self.secret} is outside [{low}, {high}]")
        else:
            self.secret = random.Random(seed).randint(low, high)
        self.turns = 0
        self.found = False
        prompt = row.get("prompt")
        text = prompt if isinstance(prompt, str) and prompt else guess_prompt(low, high)
        return [{"role": "user", "content": text}]

    def step(self, action: str) -> StepResult:
        """Judge the first integer of ``action``: ``"Higher."``, ``"Lower."``, done when equal, or
        a reminder of the format when there is none (the turn still counts)."""
        if self.secret is None:
            raise RuntimeError("GuessEnv.step before reset")
        self.turns += 1
        info = {"guesses": 1.0, "invalid": 0.0, "out_of_range": 0.0, "found": 0.0}
        match = _INTEGER.search(action)
        if match is None:
            info["invalid"] = 1.0
            return self._reply(f"Reply with one integer between {self.low} and {self.high}.", info)
        guess = int(match.group())
        if not self.low <= guess <= self.high:
            info["out_of_range"] = 1.0
        if guess == self.secret:
            self.found = True
            info["found"] = 1.0
            return StepResult([], 0.0, True, info)
        return self._reply("Higher." if guess < self.secret else "Lower.", info)

    @staticmethod
    def _reply(text: str, info: dict[str, float]) -> StepResult:
        return StepResult([{"role": "user", "content": text}], 0.0, False, info)

    def final_reward(self, stop_reason: str) -> float:  # noqa: ARG002 - found or not is all that counts
        """1.0 when the secret was found, else 0.0, minus ``turn_penalty`` per turn used."""
        return (1.0 if self.found else 0.0) - self.turn_penalty * self.turns
