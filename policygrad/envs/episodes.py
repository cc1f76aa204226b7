"""Episodes: G multi-turn episodes per dataset row, sampled turn by turn, as one training batch.

Every turn of every live episode is one batched ``engine.generate`` call (the first turn of a
row's G episodes is one call with G samples, exactly the single-turn call; later turns are one
call over the live episodes, each with its own seed, so an episode does not depend on which
others are still running). The sequence of an episode is kept as ids, never as text:

    prompt ids | action 1 (sampled ids, end id included) | observation 1 | action 2 | ...

``response_mask`` covers the actions and ``observation_mask`` the observations (the
environment's messages, as the chat template's delta: :mod:`policygrad.envs.template`), so the
training forward sees everything while the loss, the KL, the advantages and the lengths count
the policy's own tokens only. A turn's reward sits on its last action token; the final reward
(and the reward functions) on the episode's last action token.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from policygrad.data.chat import tokenize_prompts
from policygrad.envs.base import (
    STOP_REASONS,
    TRUNCATING_STOPS,
    Environment,
    EnvironmentFailure,
    check_messages,
    check_reward,
    check_step_result,
)
from policygrad.envs.template import ChatDelta, cut_middle
from policygrad.rollout.base import (
    RESPONSE,
    ROW,
    Rollout,
    RolloutEngine,
    field_layouts,
    pad_columns,
    prompt_seed,
)

__all__ = ["EpisodeLimits", "EpisodeRunner", "Episodes", "call_all"]


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
        workers: environment calls run at once (threads).
    """

    max_turns: int = 1
    max_new_tokens: int = 32
    max_episode_tokens: int | None = None
    max_observation_tokens: int | None = None
    max_context: int | None = None
    step_timeout_s: float | None = None
    workers: int = 4


@dataclasses.dataclass
class Episodes:
    """What a batch of episodes produced beyond the :class:`Rollout` (B rows, as the rollout's).

    Attributes:
        turn_rewards: float32 [B, T], each turn's reward on its last action token, 0 elsewhere.
        final_rewards: float32 [B], ``final_reward(stop_reason)`` (0 for failed episodes).
        stop: long [B], index of each episode's stop reason in :data:`STOP_REASONS`.
        turns: long [B], policy turns taken.
        failed: bool [B], episodes whose environment raised or timed out (no loss).
        info: key -> float32 [B], each episode's mean of ``StepResult.info[key]`` (NaN: never given).
        transcripts: B conversations (the opening messages, then assistant / observation
            messages), local to this process.
        errors: B one-line error messages (None where the episode did not fail), local.
        env_seconds: seconds spent in environment calls.
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
            self.env_seconds,
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
        return parts[0]._build(joined, info, local, sum(p.env_seconds for p in parts))

    def gather(self, gather_rows) -> Episodes:
        """Every process's episodes (see :meth:`Rollout.gather`); ``info`` (whose keys may
        differ between processes), transcripts and errors stay this process's."""
        info = self.info
        return self._build(
            lambda name: gather_rows(getattr(self, name), left=False), info, [[], []], self.env_seconds
        )

    def _build(self, tensor_of: Callable[[str], torch.Tensor], info, local, env_seconds) -> Episodes:
        values = {
            name: tensor_of(name)
            for name, layout in field_layouts(Episodes).items()
            if layout in (RESPONSE, ROW)
        }
        return Episodes(**values, info=info, transcripts=local[0], errors=local[1], env_seconds=env_seconds)


_TIMEOUT = object()


def call_all(
    calls: Sequence[Callable[[], Any]], *, workers: int, timeout_s: float | None
) -> list[tuple[bool, Any]]:
    """Run ``calls`` on at most ``workers`` threads at once, each bounded by ``timeout_s``.

    Returns:
        ``(True, result)`` or ``(False, one-line error)`` per call, in order. A call over the
        timeout is abandoned (Python cannot stop a thread: it runs on as a daemon thread, whose
        result is dropped) and reported as an error, so an environment that hangs costs its
        episode, never the run.
    """
    results: list[tuple[bool, Any] | None] = [None] * len(calls)
    done: queue.Queue = queue.Queue()
    pending, running = deque(range(len(calls))), {}

    def target(i: int, fn: Callable[[], Any]) -> None:
        try:
            done.put((i, (True, fn())))
        except BaseException as exc:  # noqa: BLE001 - sys.exit() too: any end of user code fails the episode
            done.put((i, (False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])))

    while pending or running:
        while pending and len(running) < max(workers, 1):
            i = pending.popleft()
            running[i] = time.monotonic() + timeout_s if timeout_s is not None else None
            threading.Thread(
                target=target, args=(i, calls[i]), daemon=True, name=f"policygrad-env-{i}"
            ).start()
        deadlines = [d for d in running.values() if d is not None]
        wait = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
        try:
            i, outcome = done.get(timeout=wait)
            if i in running:
                del running[i]
                results[i] = outcome
        except queue.Empty:
            now = time.monotonic()
            for i, deadline in list(running.items()):
                if deadline is not None and deadline <= now:
                    del running[i]
                    results[i] = (False, f"timed out after {timeout_s:g} s (rollout.env_step_timeout_s)")
    return results  # type: ignore[return-value]


@dataclasses.dataclass
class _Episode:
    """One episode while it runs."""

    env: Environment | None
    row: Mapping[str, Any]
    seed: int  # the episode's own seed, for turns after the first
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


class EpisodeRunner:
    """Runs G episodes per dataset row against an engine (see the module docstring).

    Args:
        make_env: builds a fresh environment per episode
            (:func:`~policygrad.envs.registry.environment_factory`).
        engine: the rollout engine (hf or vLLM).
        tokenizer: the policy's tokenizer (with a chat template).
        limits: :class:`EpisodeLimits`.
        end_ids: every id that ends a turn.
        pad_id: the id padding the response columns (the engine's).
        system_prompt: prepended as a system message when the opening messages have none.
        max_prompt_length: the most tokens of the opening prompt.

    Raises:
        TemplateError: the tokenizer's chat template cannot be extended (checked here, at start).
    """

    def __init__(
        self,
        make_env: Callable[[], Environment],
        engine: RolloutEngine,
        tokenizer,
        limits: EpisodeLimits,
        *,
        end_ids: Sequence[int],
        pad_id: int,
        system_prompt: str | None = None,
        max_prompt_length: int = 512,
    ):
        self.make_env = make_env
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.end_ids = frozenset(int(i) for i in end_ids)
        self.pad_id = int(pad_id)
        self.system_prompt = system_prompt
        self.max_prompt_length = max_prompt_length
        self.delta = ChatDelta(tokenizer, self.end_ids)

    # ------------------------------------------------------------------------------------------
    def _calls(self, calls):
        return call_all(calls, workers=self.limits.workers, timeout_s=self.limits.step_timeout_s)

    def _opening(self, group: list[_Episode]) -> list[dict] | None:
        """The group's shared opening messages (None when every reset failed)."""
        opened = [e.messages for e in group if e.stop is None]
        for e in group:
            if e.stop is None and e.messages != opened[0]:
                e.fail(
                    "reset() gave this episode other opening messages than the rest of its group (same seed)"
                )
        return opened[0] if opened else None

    def _prompt_ids(self, rows, groups: list[list[_Episode]]) -> list[list[int]]:
        texts, ids = [], []
        for row, group in zip(rows, groups):
            messages = self._opening(group)
            if messages is None:  # no opening at all: the row's own prompt, and no loss on it
                messages = [{"role": "user", "content": str(row.get("prompt", ""))}]
            if self.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            for e in group:
                e.messages = list(messages)
            text, opening = self.delta.prompt(messages, tools=_native_tools(group))  # contents as plain text
            texts.append(text)
            ids.append(opening)
        return tokenize_prompts(self.tokenizer, texts, max_prompt_length=self.max_prompt_length, ids=ids)

    def run(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        group_size: int,
        seeds: Sequence[int],
        per_prompt_seeds: bool,
        sampling: Mapping[str, Any],
    ) -> tuple[list[list[int]], Rollout, Episodes, list[str]]:
        """G episodes of each row.

        Args:
            rows: n dataset rows.
            group_size: G.
            seeds: one per row: its episodes' ``reset`` seed, and the root of their turn seeds.
            per_prompt_seeds: the first turn samples from ``seeds`` (else from torch's stream, as
                a single-turn run does).
            sampling: ``temperature``, ``top_p``, ``top_k`` of ``engine.generate``.

        Returns:
            ``(opening prompt ids [n], rollout [B = n x G], episodes, final answers [B])``.
        """
        env_seconds = 0.0
        G = group_size
        episodes = [
            _Episode(None, row, prompt_seed(seed, g)) for row, seed in zip(rows, seeds) for g in range(G)
        ]
        t = time.perf_counter()
        built = self._calls([self.make_env for _ in episodes])
        for e, (ok, value) in zip(episodes, built):
            if ok:
                e.env = value
            else:
                e.fail(f"building the environment failed: {value}")
        seeds_of = [s for s in seeds for _ in range(G)]
        live = [e for e in episodes if e.stop is None]
        opened = self._calls(
            [
                lambda e=e, s=s: e.env.reset(e.row, seed=s)
                for e, s in zip(episodes, seeds_of)
                if e.stop is None
            ]
        )
        for e, outcome in zip(live, opened):
            messages = _accept(e, outcome, "reset()", lambda v: check_messages(v, "reset()"))
            if messages is not None:
                e.messages = messages
        env_seconds += time.perf_counter() - t
        groups = [episodes[i * G : (i + 1) * G] for i in range(len(rows))]
        prompts = self._prompt_ids(rows, groups)
        cap = self._first_turn_cap()
        first = self.engine.generate(
            prompts,
            group_size=G,
            max_new_tokens=cap[0],
            prompt_seeds=list(seeds) if per_prompt_seeds else None,
            **sampling,
        )
        self._take_actions(episodes, first, [cap] * len(episodes))
        prompt_of = [prompts[i] for i in range(len(rows)) for _ in range(G)]
        env_seconds += self._observe(episodes, prompt_of)
        turn = 1
        while True:
            live = [i for i, e in enumerate(episodes) if e.stop is None]
            if not live:
                break
            turn += 1
            allowed = {i: self._room(episodes[i], prompt_of[i]) for i in live}
            for i in live:
                if allowed[i][0] < 1:
                    episodes[i].stop = allowed[i][1]
            for cap in sorted({a for a, _ in allowed.values() if a >= 1}):
                batch = [i for i in live if allowed[i][0] == cap]
                out = self.engine.generate(
                    [prompt_of[i] + episodes[i].ids for i in batch],
                    group_size=1,
                    max_new_tokens=cap,
                    prompt_seeds=[prompt_seed(episodes[i].seed, turn) for i in batch],
                    **sampling,
                )
                self._take_actions([episodes[i] for i in batch], out, [allowed[i] for i in batch])
            env_seconds += self._observe([episodes[i] for i in live], [prompt_of[i] for i in live])
        env_seconds += self._finish(episodes)
        finals = [e.last_action for e in episodes]
        return prompts, self._rollout(first, episodes), self._episodes(episodes, env_seconds), finals

    # ------------------------------------------------------------------------------------------
    def _first_turn_cap(self) -> tuple[int, str]:
        lim = self.limits
        if lim.max_episode_tokens is not None and lim.max_episode_tokens < lim.max_new_tokens:
            return lim.max_episode_tokens, "budget"
        return lim.max_new_tokens, "length"

    def _room(self, e: _Episode, prompt: list[int]) -> tuple[int, str]:
        """``(the most tokens e's next turn may have, the stop reason when that is the limit)``."""
        lim = self.limits
        room, reason = lim.max_new_tokens, "length"
        if lim.max_episode_tokens is not None and lim.max_episode_tokens - len(e.ids) < room:
            room, reason = lim.max_episode_tokens - len(e.ids), "budget"
        if lim.max_context is not None and lim.max_context - len(prompt) - len(e.ids) < room:
            room, reason = lim.max_context - len(prompt) - len(e.ids), "context"
        return room, reason

    def _take_actions(self, episodes: list[_Episode], out: Rollout, caps) -> None:
        """Append each episode's sampled turn (ids verbatim) and note a turn cut short."""
        lengths = out.response_lengths.tolist()
        for r, e in enumerate(episodes):
            cap, n = caps[r], lengths[r]
            ids = out.response_ids[r, :n].tolist()
            e.ids.extend(ids)
            e.action.extend([True] * n)
            e.logprobs.extend(out.sampler_logprobs[r, :n].tolist())
            e.turns += 1
            e.last_action = self.tokenizer.decode(ids, skip_special_tokens=True)
            e.messages.append({"role": "assistant", "content": e.last_action})
            if e.stop is not None:
                continue  # failed before its first turn: it still has a turn, but no loss
            e.stepped = False
            if not ids or ids[-1] not in self.end_ids:  # cut: by max_new_tokens or by a tighter limit
                e.stop = cap[1] if n >= cap[0] else "length"

    def _observe(self, episodes: list[_Episode], prompts: list[list[int]]) -> float:
        """``env.step`` on every episode's new turn, a cut one included (the environment judges
        every turn the policy wrote; the episode then ends, its observation unseen); the
        observations of the live ones appended. Returns the seconds spent in the environments."""
        fresh = (None, *TRUNCATING_STOPS)
        live = [(e, p) for e, p in zip(episodes, prompts) if not e.stepped and e.stop in fresh]
        for e, _ in live:
            e.stepped = True
        t = time.perf_counter()
        results = self._calls([lambda e=e: e.env.step(e.last_action) for e, _ in live])
        seconds = time.perf_counter() - t
        for (e, prompt), outcome in zip(live, results):
            result = _accept(e, outcome, "step()", check_step_result)
            if result is None:
                continue
            last = len(e.ids) - 1
            e.rewards[last] = e.rewards.get(last, 0.0) + result.reward
            for key, v in result.info.items():
                e.info.setdefault(key, []).append(v)
            if e.stop is None:  # a cut turn's episode is over whatever the environment says
                self._continue(e, result, prompt)
        return seconds

    def _continue(self, e: _Episode, result, prompt: list[int]) -> None:
        """After a turn that ended normally: stop (done, max_turns, budget, context) or append
        the observation."""
        lim = self.limits
        if result.done:
            e.stop = "done"
            return
        if e.turns >= lim.max_turns:
            e.stop = "max_turns"
            return
        observation = result.observation
        if lim.max_observation_tokens is not None:
            observation = [
                {**m, "content": cut_middle(self.tokenizer, m["content"], lim.max_observation_tokens)}
                for m in observation
            ]
        try:
            ids = self.delta.observation_ids(observation)
        except ValueError as exc:
            e.fail(str(exc).splitlines()[0])
            return
        if lim.max_episode_tokens is not None and len(e.ids) + len(ids) >= lim.max_episode_tokens:
            e.stop = "budget"  # no room for the next turn
            return
        if lim.max_context is not None and len(prompt) + len(e.ids) + len(ids) >= lim.max_context:
            e.stop = "context"
            return
        e.ids.extend(ids)
        e.action.extend([False] * len(ids))
        e.logprobs.extend([0.0] * len(ids))
        e.messages.extend(observation)

    def _finish(self, episodes: list[_Episode]) -> float:
        t = time.perf_counter()
        scored = [e for e in episodes if e.stop != "error"]
        results = self._calls([lambda e=e: e.env.final_reward(e.stop) for e in scored])
        for e, outcome in zip(scored, results):
            final = _accept(e, outcome, "final_reward()", lambda v: check_reward(v, "final_reward()"))
            if final is not None:
                e.final = final
        self._calls(
            [e.env.close for e in episodes if e.env is not None and callable(getattr(e.env, "close", None))]
        )
        return time.perf_counter() - t

    def _rollout(self, first: Rollout, episodes: list[_Episode]) -> Rollout:
        T = max(len(e.ids) for e in episodes)
        B = len(episodes)
        ids = torch.full((B, T), self.pad_id, dtype=torch.long)
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

    def _episodes(self, episodes: list[_Episode], env_seconds: float) -> Episodes:
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
        )


def _accept(e: _Episode, outcome: tuple[bool, Any], call: str, check: Callable[[Any], Any]) -> Any:
    """The checked value of an environment call's ``outcome`` (from :func:`call_all`), or None
    after failing episode ``e`` with one line that names ``call`` (what it raised, or why its
    value was refused)."""
    ok, value = outcome
    if not ok:
        e.fail(f"{call} failed: {value}")
        return None
    try:
        return check(value)
    except EnvironmentFailure as exc:
        e.fail(str(exc) if str(exc).startswith(call) else f"{call} failed: {exc}")
        return None


def _native_tools(group: list[_Episode]) -> list[dict] | None:
    """The JSON schemas of a tool environment that leaves its tools to the chat template
    (``tool_schemas()`` with ``describe_tools`` False: the template's own tool format), else None."""
    env = next((e.env for e in group if e.env is not None and e.stop is None), None)
    if (
        env is None
        or getattr(env, "describe_tools", True)
        or not callable(getattr(env, "tool_schemas", None))
    ):
        return None
    return env.tool_schemas()
