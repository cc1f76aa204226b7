"""Agents: a user's own agent code, written against the OpenAI client, trained as episodes.

``agent.function`` names ``run(client, row) -> reward``: an ``async`` function given an
``openai.AsyncOpenAI`` client (a plain function gets an ``openai.OpenAI``) whose ``base_url`` is
one session of the agent endpoint (:mod:`policygrad.envs.endpoint`), and a copy of the dataset
row. Whatever the agent does between its calls (tools, parsing, other services) is its own
business; its calls are the episode's turns. :class:`AgentEnv` turns that inside out into the
:class:`~policygrad.envs.base.Environment` protocol, so the episode runner
(:mod:`policygrad.envs.episodes`) drives an agent exactly as it drives an environment, with the
same batching, per-prompt seeds, limits, worker processes, retries and error budget:

* ``reset`` starts the agent (on a thread of its own) and returns the messages of its first call;
* ``step(turn)`` answers the call in flight with the policy's turn, then waits for the agent's
  next call, whose new messages are the observation (masked out of the loss), or for its return
  (the episode is done);
* ``final_reward`` is what the agent returned: a number, or a dict of named numbers (summed; each
  logged as ``env/reward_<name>``, through ``final_info``, however the episode ended).

**Token bookkeeping.** The policy's turns are trained on the ids it sampled, never re-tokenised:
the runner keeps them, and a call's messages are read only to find what is new. A call extends
its session when its messages start with the previous call's messages followed by the reply the
endpoint gave (same role and text; tool calls compared by name and arguments): the messages after
that are the observation, rendered by the chat template's delta like an environment's. A call that
does not extend (an agent or library that rewrites or trims its history, a template that drops
earlier reasoning) is decided by ``agent.rewritten_history``:

* ``segment`` (the default): the call starts a new *segment* of the episode
  (``StepResult.restart``): its messages are rendered afresh as the next turn's prompt, and the
  tokens so far become a row of their own, trained with the episode's advantage
  (:mod:`policygrad.learn.segments`); counted as ``episode/restarts_mean`` and
  ``env/history_rewrites`` (the share of turns that restarted);
* ``fail``: the episode fails with a line naming the first message that differs; it is counted,
  retried on a fresh session like any failure, and its group leaves the batch if it fails again.

**Failures.** The agent raising, returning without ever calling the model, returning something
that is not a finite number (or dict of them), or taking longer than ``agent.timeout_s`` between
two calls (its own time, not the model's) fails the episode with one line; with worker
processes a call over the time limit has its worker killed, so a hung agent cannot outlive it.
When the runner ends an episode at a limit (``max_turns``, a turn cut by ``max_new_tokens``, the
episode's token budget or the context), the call in flight and every later one are refused with
HTTP 400 (``openai.BadRequestError``: "the episode is over (max_turns)"); what the agent returns
then is the episode's reward, and if it raises instead the reward is 0.0.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Mapping
from typing import Any

from policygrad.config.agent import AGENT_ENVIRONMENT, REWRITTEN_HISTORY
from policygrad.envs.base import FLOAT32_MAX, Environment, EnvironmentFailure, StepResult, check_messages
from policygrad.envs.endpoint import AgentCall, endpoint, message_key, plain_message, reply_message
from policygrad.envs.registry import environment_factory, load_spec

__all__ = ["AGENT_ENVIRONMENT", "AgentEnv", "AgentFunction", "agent_factory", "load_agent"]


_LOADED: dict[str, Callable] = {}
_LOADED_LOCK = threading.Lock()


def load_agent(function: Any) -> Callable:
    """The agent function ``function`` names (``module:function`` or ``file.py:function``, loaded
    once per process), or ``function`` itself when it is callable.

    Raises:
        ValueError / FileNotFoundError: the spec cannot be loaded; TypeError: it names something
            that is not callable.
    """
    if callable(function):
        return function
    if not isinstance(function, str):
        raise TypeError(
            f"agent.function must be 'module:function', 'file.py:function' or a function, got {function!r}"
        )
    with _LOADED_LOCK:
        if function not in _LOADED:
            fn = load_spec(function, "agent.function", "agent")
            if not callable(fn):
                raise TypeError(f"agent.function {function!r} names a {type(fn).__name__}, not a function")
            _LOADED[function] = fn
        return _LOADED[function]


def _client(fn: Callable, url: str):
    """An OpenAI client on ``url``: async for an ``async`` agent. No retries (a refused call is an
    answer, not a glitch) and no client timeout (the runner bounds the agent's time)."""
    try:
        import openai  # an optional dependency: only agents need it
    except ImportError:
        raise EnvironmentFailure(
            "agents need the openai package; pip install 'policygrad[agent]' (or pip install openai)"
        ) from None
    kind = openai.AsyncOpenAI if is_async(fn) else openai.OpenAI
    return kind(base_url=url, api_key="policygrad", max_retries=0, timeout=None)


MAX_NAMED_REWARDS = 32  # each becomes a metric column


def _reward(value: Any) -> tuple[float, dict[str, float]]:
    """An agent's return value as ``(reward, named rewards)``.

    Raises:
        EnvironmentFailure: not a finite number (within float32) or a dict of at most
            :data:`MAX_NAMED_REWARDS` of them under string keys.
    """

    def number(v: Any, what: str) -> float:
        try:
            out = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else None
        except OverflowError:
            out = None
        if out is None or not math.isfinite(out) or abs(out) > FLOAT32_MAX:
            raise EnvironmentFailure(
                f"the agent returned {what} {v!r:.60}; return a finite number or a dict of them"
            )
        return out

    if isinstance(value, Mapping):
        if not value or len(value) > MAX_NAMED_REWARDS or not all(isinstance(k, str) for k in value):
            raise EnvironmentFailure(
                f"the agent returned a dict of {len(value)} rewards; return a number or a dict of 1 to "
                f"{MAX_NAMED_REWARDS} named numbers (string keys)"
            )
        named = {k: number(v, f"{k!r}:") for k, v in value.items()}
        return sum(named.values()), named
    return number(value, "the reward"), {}


def is_async(fn: Callable) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    call = type(fn).__call__ if callable(fn) and not inspect.isroutine(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


class AgentEnv(Environment):
    """One session of an agent as an environment (see the module docstring).

    Args:
        function: the agent (:func:`load_agent`).
        rewritten_history: what a call that does not extend its history does: ``segment`` (a new
            segment of the episode) or ``fail`` (module docstring).

    Raises:
        ValueError / FileNotFoundError / TypeError: ``function`` cannot be loaded, or
            ``rewritten_history`` is neither.
    """

    describe_tools = False  # the tools of the agent's first call go to the chat template

    def __init__(self, *, function: Any, rewritten_history: str = "segment"):
        if rewritten_history not in REWRITTEN_HISTORY:
            raise ValueError(
                f"rewritten_history must be one of {', '.join(REWRITTEN_HISTORY)}, got {rewritten_history!r}"
            )
        self.rewritten_history = rewritten_history
        self.function = load_agent(function)
        self.session = None
        self.thread: threading.Thread | None = None
        self.outcome: tuple[bool, Any] | None = None  # (returned, value or error line)
        self.history: list[tuple] = []
        self.tools: list[dict] | None = None
        self.call: AgentCall | None = None
        self.named: dict[str, float] = {}
        self.reward = 0.0
        self.ended_by_limit = False
        self.cut = False  # the turn being answered was cut by a limit (turn_cut)

    def tool_schemas(self) -> list[dict] | None:
        """The ``tools`` of the agent's first call (None: none)."""
        return self.tools

    # ------------------------------------------------------------------------------------------
    def _run(self, client, row) -> None:
        async def in_loop():  # the client closes in the loop it ran in
            try:
                return await self.function(client, row)
            finally:
                await client.close()

        try:
            if is_async(self.function):
                value = asyncio.run(in_loop())
            else:
                with client:
                    value = self.function(client, row)
            outcome: tuple[bool, Any] = (True, value)
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: reported as the episode's failure
            outcome = (False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
        with self.session.cond:
            self.outcome = outcome
            self.session.cond.notify_all()

    def _next(self) -> AgentCall | None:
        """The agent's next call, or None once it returned.

        Raises:
            EnvironmentFailure: it raised.
        """
        session = self.session
        with session.cond:
            while True:
                call = session.take()
                if call is not None:
                    return call
                if self.outcome is not None:
                    break
                session.cond.wait()
        returned, value = self.outcome
        if not returned:
            raise EnvironmentFailure(f"the agent raised {value}")
        return None

    def reset(self, row: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:  # noqa: ARG002 - the runner seeds the turns
        """Start the agent on ``row``; the messages of its first call."""
        self.session = endpoint().open()
        client = _client(self.function, self.session.url)
        self.thread = threading.Thread(
            target=self._run, args=(client, row), name="policygrad-agent", daemon=True
        )
        self.thread.start()
        call = self._next()
        if call is None:
            raise EnvironmentFailure(
                "the agent returned without calling the model; every episode needs a turn"
            )
        self.call, self.tools = call, call.tools
        self.history = [message_key(m) for m in call.messages]
        return check_messages([plain_message(m) for m in call.messages], "the agent's first call")

    def turn_cut(self) -> None:
        """The next :meth:`step`'s turn was cut by a limit: its reply says ``finish_reason: length``."""
        self.cut = True

    def step(self, action: str) -> StepResult:
        """Answer the call in flight with ``action``; the agent's next call's new messages, or
        done when it returned."""
        if self.call is None:
            raise RuntimeError("AgentEnv.step without a call in flight")
        reply, finish_reason, malformed = reply_message(action, self.call.tools)
        if self.cut:  # as an OpenAI server says of a reply cut at max_tokens
            finish_reason, self.cut = "length", False
        info = {
            "tool_calls": float(len(reply.get("tool_calls") or [])),
            "malformed_tool_calls": float(malformed),
            "history_rewrites": 0.0,
        }
        self.history.append(message_key(reply))
        self.session.answer(reply, finish_reason)
        call = self.call = self._next()
        if call is None:
            self.reward, self.named = _reward(self.outcome[1])
            return StepResult([], 0.0, True, info)
        keys = [message_key(m) for m in call.messages]
        n = len(self.history)
        if keys[:n] != self.history:
            first = next((i for i, (a, b) in enumerate(zip(keys, self.history)) if a != b), min(len(keys), n))
            if self.rewritten_history == "fail":
                raise EnvironmentFailure(
                    f"the agent's call {self.session.calls} does not extend its history (message {first} "
                    "differs from what this session saw and answered, or is missing); an episode's calls "
                    "must resend every earlier message and reply unchanged (or set "
                    "agent.rewritten_history=segment)"
                )
            self.history = keys  # a new segment: the call's whole conversation is its prompt
            messages = [plain_message(m) for m in call.messages]
            info["history_rewrites"] = 1.0
            return StepResult(check_messages(messages, "the agent's call"), 0.0, False, info, restart=True)
        self.history = keys
        return StepResult(
            check_messages(
                [plain_message(m) for m in call.messages[n:]], "the agent's new messages", allow_empty=True
            ),
            0.0,
            False,
            info,
        )

    def final_reward(self, stop_reason: str) -> float:
        """What the agent returned; at a limit its calls are refused first, and an agent that
        then raises scores 0.0."""
        if self.outcome is None:
            self.ended_by_limit = True
            self.session.end(f"the episode is over ({stop_reason}): return the reward")
            with self.session.cond:
                while self.outcome is None:
                    self.session.cond.wait()
            returned, value = self.outcome
            if not returned:
                return 0.0
            self.reward, self.named = _reward(value)
        return self.reward

    def final_info(self) -> dict[str, float]:
        """The named rewards (``reward_<name>``) of the agent's return, logged once per episode
        whether the agent or a limit ended it."""
        return {f"reward_{k}": v for k, v in self.named.items()}

    def close(self) -> None:
        """End the session: a call in flight or later is refused."""
        if self.session is not None:
            endpoint().close(self.session)


class AgentFunction:
    """An environment factory for an agent given as a function (``policygrad.train(agent=fn)``):
    ``AgentFunction(fn)(**options)`` builds ``AgentEnv(function=fn)``. Picklable when ``fn`` is
    importable, so the agent runs in worker processes."""

    def __init__(self, function: Callable):
        if not callable(function):
            raise TypeError(
                f"agent must be a function or a 'module:function' spec, got {type(function).__name__}"
            )
        self.function = function
        self.__name__ = getattr(function, "__name__", "agent")

    def __call__(self, **options: Any) -> AgentEnv:
        return AgentEnv(**{**options, "function": self.function})

    def __repr__(self) -> str:
        module = getattr(self.function, "__module__", "?")
        return f"agent {module}:{getattr(self.function, '__qualname__', self.__name__)}"


def agent_factory(make: Any, options: Mapping[str, Any], *, isolation: bool, timeout_s: float | None):
    """:func:`~policygrad.envs.registry.environment_factory` of the agent environment (``make``:
    :data:`AGENT_ENVIRONMENT` or an :class:`AgentFunction`), its errors about the agent itself.

    Raises:
        ValueError / TypeError / FileNotFoundError: the agent cannot be loaded (names agent.function).
    """
    try:
        return environment_factory(make, options, isolation=isolation, timeout_s=timeout_s)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        for prefix in (
            f"env.options do not fit {AGENT_ENVIRONMENT}: ",
            f"env.name {AGENT_ENVIRONMENT} could not be built: ",
        ):
            text = text.replace(prefix, "")
        raise type(exc)(text) from None
