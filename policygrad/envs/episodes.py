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

The runner's records (:class:`EpisodeLimits`, :class:`Episodes`) are :mod:`policygrad.envs.records`;
one episode while it runs, and the columns finished episodes become, are
:mod:`policygrad.envs.episode_state`; where the environments live is :mod:`policygrad.envs.workers`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policygrad.data.chat import tokenize_prompts
from policygrad.envs.base import (
    TRUNCATING_STOPS,
    Environment,
    check_messages,
    check_step_result,
)
from policygrad.envs.episode_state import (
    EpisodeState,
    accept,
    check_tool_schemas,
    checked_final,
    group_tools,
    to_episodes,
    to_rollout,
)
from policygrad.envs.records import EpisodeLimits, Episodes
from policygrad.envs.template import ChatDelta, TemplateError, cut_middle, max_token_chars
from policygrad.envs.workers import call_all, copy_row, make_host
from policygrad.rollout.base import Rollout, prompt_seed
from policygrad.rollout.engine import RolloutEngine

__all__ = ["EpisodeLimits", "EpisodeRunner", "Episodes", "call_all"]

_NO_LIMIT = 2**31 - 1  # a restarted history's prompt: bounded by the context (``_room``), not cut

log = logging.getLogger("policygrad")


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
        self.name = str(getattr(make_env, "spec", None) or getattr(make_env, "__name__", repr(make_env)))
        self.host = make_host(
            make_env,
            isolation=limits.isolation,
            workers=limits.workers,
            timeout_s=limits.step_timeout_s,
            name=self.name,
            timeout_field=limits.timeout_field,
        )
        self._close_warned = False

    def close(self) -> None:
        """Stop the environment workers (and whatever they forked). Idempotent."""
        self.host.close()

    # ------------------------------------------------------------------------------------------
    def _calls(self, episodes: Sequence[EpisodeState], method: str, args: Callable[[EpisodeState], tuple]):
        """``method`` on each episode's environment: ``(ok, value or one-line error)`` each."""
        return self.host.call([(e.env, method, args(e)) for e in episodes])

    def _open(self, episodes: list[EpisodeState]) -> None:
        """Build and reset each episode's environment (reset gets its own copy of the row); one
        that fails is tried again on a fresh environment, up to ``limits.retries`` times."""
        todo = episodes
        while True:
            self._open_once(todo)
            todo = [e for e in todo if e.stop == "error" and e.attempts < self.limits.retries]
            if not todo:
                return
            self._close(todo)
            for e in todo:
                e.attempts += 1

    def _open_once(self, episodes: list[EpisodeState]) -> None:
        for e in episodes:
            e.env = self.host.new_handles(1)[0]
            e.stop = e.error = None
        built = self._calls(episodes, "make", lambda _: ())
        live = []
        for e, (ok, value) in zip(episodes, built):
            if ok:
                live.append(e)
            else:
                e.fail(f"building the environment failed: {value}")
        opened = self._calls(live, "reset", lambda e: (copy_row(e.row), e.reset_seed))
        for e, outcome in zip(live, opened):
            check = lambda v: (check_messages(v[0], "reset()"), check_tool_schemas(v[1], self.delta))  # noqa: E731
            value = accept(e, outcome, "reset()", check)
            if value is not None:
                e.messages, e.tools = value

    def _opening(self, group: list[EpisodeState]) -> list[dict] | None:
        """The group's shared opening messages (None when every reset failed)."""
        opened = [e.messages for e in group if e.stop is None]
        for e in group:
            e.opening = opened[0] if opened else None
        for e in group:
            if e.stop is None and e.messages != opened[0]:
                e.fail(
                    "reset() gave this episode other opening messages than the rest of its group (same seed)"
                )
        return opened[0] if opened else None

    def _prompt_ids(self, rows, groups: list[list[EpisodeState]]) -> list[list[int]]:
        texts, ids = [], []
        for row, group in zip(rows, groups):
            messages = self._opening(group)
            if messages is None:  # no opening at all: the row's own prompt, and no loss on it
                messages = [{"role": "user", "content": str(row.get("prompt", ""))}]
            if self.system_prompt and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.system_prompt}, *messages]
            try:  # contents as plain text
                text, opening = self.delta.prompt(messages, tools=group_tools(group))
            except TemplateError as exc:  # the template refuses the opening: its episodes fail, for good
                for e in group:
                    e.opening = None  # (a retry would get the same opening)
                    if e.stop is None:
                        e.fail(f"reset() failed: {str(exc).splitlines()[0]}")
                messages = [{"role": "user", "content": str(row.get("prompt", ""))}]
                if self.system_prompt:
                    messages = [{"role": "system", "content": self.system_prompt}, *messages]
                text, opening = self.delta.prompt(messages)
            for e in group:
                e.messages, e.start = list(messages), list(messages)
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
        G = group_size
        episodes = [
            EpisodeState(row, prompt_seed(seed, g), seed) for row, seed in zip(rows, seeds) for g in range(G)
        ]
        t = time.perf_counter()
        self._open(episodes)
        env_seconds = time.perf_counter() - t
        groups = [episodes[i * G : (i + 1) * G] for i in range(len(rows))]
        prompts = self._prompt_ids(rows, groups)
        cap = self._first_turn_cap()
        first = self.engine.generate(
            prompts,
            group_size=G,
            max_new_tokens=cap[0],
            prompt_seeds=list(seeds) if per_prompt_seeds else None,
            routing_keys=[int(seed) for seed in seeds],  # a row's seed: its episodes' turns, one server
            **sampling,
        )
        self._take_actions(episodes, first, [cap] * len(episodes))
        prompt_of = [prompts[i] for i in range(len(rows)) for _ in range(G)]
        for e, prompt in zip(episodes, prompt_of):
            e.prompt = prompt
        env_seconds += self._observe(episodes)
        env_seconds += self._turns(episodes, 1, sampling)
        env_seconds += self._finish(episodes)
        env_seconds += self._retry(episodes, prompt_of, sampling)
        finals = [e.last_action for e in episodes]
        rollout = to_rollout(first, episodes, self.pad_id)
        return prompts, rollout, to_episodes(episodes, env_seconds, rollout, self.pad_id), finals

    def _turns(self, episodes: list[EpisodeState], turn: int, sampling) -> float:
        """The turns after ``turn`` of every live episode, until each stops; each turn's
        ``env.step``. Returns the seconds spent in the environments."""
        env_seconds = 0.0
        while True:
            live = [i for i, e in enumerate(episodes) if e.stop is None]
            if not live:
                return env_seconds
            turn += 1
            allowed = {i: self._room(episodes[i]) for i in live}
            for i in live:
                if allowed[i][0] < 1:
                    episodes[i].stop = allowed[i][1]
            for cap in sorted({a for a, _ in allowed.values() if a >= 1}):
                batch = [i for i in live if allowed[i][0] == cap]
                out = self.engine.generate(
                    [episodes[i].prompt + episodes[i].ids for i in batch],
                    group_size=1,
                    max_new_tokens=cap,
                    prompt_seeds=[prompt_seed(episodes[i].seed, turn) for i in batch],
                    routing_keys=[episodes[i].reset_seed for i in batch],  # the first turn's key
                    **sampling,
                )
                self._take_actions([episodes[i] for i in batch], out, [allowed[i] for i in batch])
            env_seconds += self._observe([episodes[i] for i in live])

    def _retry(self, episodes: list[EpisodeState], prompt_of: list[list[int]], sampling) -> float:
        """Run again from scratch each episode that failed in the environment after its reset,
        up to ``limits.retries`` fresh attempts in all: a fresh environment reset with its row
        (a fresh copy) and seed, which must give its group's opening messages, then every turn
        sampled again, turn k from ``prompt_seed(prompt_seed(seed, -attempt), k)`` (``seed``: the
        episode's own): a function of the run's seed and the attempt, so the retried run is as
        reproducible as the first. Replaces the failed episodes in ``episodes``; returns the
        seconds spent in the environments."""
        env_seconds = 0.0
        while True:
            failed = [
                i
                for i, e in enumerate(episodes)
                if e.stop == "error" and e.opening is not None and e.attempts < self.limits.retries
            ]
            if not failed:
                return env_seconds
            t = time.perf_counter()
            fresh = []
            for i in failed:
                old = episodes[i]
                attempt = old.attempts + 1
                origin = old.seed if old.origin is None else old.origin
                e = EpisodeState(
                    old.row, prompt_seed(origin, -attempt), old.reset_seed, attempts=attempt, origin=origin
                )
                e.opening = old.opening
                fresh.append(e)
            self._open_once(fresh)
            for e, i in zip(fresh, failed):
                if e.stop is None and e.messages != e.opening:
                    e.fail("reset() gave this episode other opening messages than its group's (same seed)")
                e.messages, e.start = list(episodes[i].start), list(episodes[i].start)
                e.prompt = prompt_of[i]
            env_seconds += time.perf_counter() - t
            env_seconds += self._turns(fresh, 0, sampling)
            env_seconds += self._finish(fresh)
            for e, i in zip(fresh, failed):
                episodes[i] = e

    # ------------------------------------------------------------------------------------------
    def _first_turn_cap(self) -> tuple[int, str]:
        lim = self.limits
        if lim.max_episode_tokens is not None and lim.max_episode_tokens < lim.max_new_tokens:
            return lim.max_episode_tokens, "budget"
        return lim.max_new_tokens, "length"

    def _room(self, e: EpisodeState) -> tuple[int, str]:
        """``(the most tokens e's next turn may have, the stop reason when that is the limit)``."""
        return self._room_after(len(e.prompt) + len(e.ids), e.spent + len(e.ids))

    def _room_after(self, in_context: int, spent: int) -> tuple[int, str]:
        """:meth:`_room` of an episode with ``in_context`` tokens in its segment (prompt and
        after) and ``spent`` after the prompts of all its segments (what the budget counts)."""
        lim = self.limits
        room, reason = lim.max_new_tokens, "length"
        if lim.max_episode_tokens is not None and lim.max_episode_tokens - spent < room:
            room, reason = lim.max_episode_tokens - spent, "budget"
        if lim.max_context is not None and lim.max_context - in_context < room:
            room, reason = lim.max_context - in_context, "context"
        return room, reason

    def _take_actions(self, episodes: list[EpisodeState], out: Rollout, caps) -> None:
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

    def _observe(self, episodes: list[EpisodeState]) -> float:
        """``env.step`` on every episode's new turn, a cut one included (the environment judges
        every turn the policy wrote; the episode then ends, its observation unseen); the
        observations of the live ones appended. Returns the seconds spent in the environments."""
        fresh = (None, *TRUNCATING_STOPS)
        live = [e for e in episodes if not e.stepped and e.stop in fresh]
        for e in live:
            e.stepped = True
        t = time.perf_counter()
        results = self._calls(live, "step", lambda e: (e.last_action, e.stop is not None))  # (cut)
        seconds = time.perf_counter() - t
        for e, outcome in zip(live, results):
            result = accept(e, outcome, "step()", check_step_result)
            if result is None:
                continue
            last = len(e.ids) - 1
            e.rewards[last] = e.rewards.get(last, 0.0) + result.reward
            for key, v in result.info.items():
                e.info.setdefault(key, []).append(v)
            if e.stop is None:  # a cut turn's episode is over whatever the environment says
                self._continue(e, result)
        return seconds

    def _continue(self, e: EpisodeState, result) -> None:
        """After a turn that ended normally: stop (done, max_turns, budget, context), restart
        the history (a new segment) or append the observation."""
        lim = self.limits
        if result.done:
            e.stop = "done"
            return
        if e.turns >= lim.max_turns:
            e.stop = "max_turns"
            return
        if result.restart:
            self._restart(e, result.observation)
            return
        prompt = e.prompt
        observation = result.observation
        too_long = self._surely_too_long(e, observation, prompt)
        if too_long is not None:
            e.stop = too_long  # what tokenising would have found, without tokenising it
            return
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
        if lim.max_episode_tokens is not None and e.spent + len(e.ids) + len(ids) >= lim.max_episode_tokens:
            e.stop = "budget"  # no room for the next turn
            return
        if lim.max_context is not None and len(prompt) + len(e.ids) + len(ids) >= lim.max_context:
            e.stop = "context"
            return
        e.ids.extend(ids)
        e.action.extend([False] * len(ids))
        e.logprobs.extend([0.0] * len(ids))
        e.messages.extend(observation)

    def _restart(self, e: EpisodeState, messages: list[dict]) -> None:
        """The episode's history replaced by ``messages`` (``StepResult.restart``): the tokens so
        far close a segment, and the next turn samples from ``messages`` rendered afresh (the
        opening's rules: the run's system prompt when they have none, contents as plain text, the
        tools of the episode's first call). The new prompt counts in the episode's token budget
        (``max_episode_tokens``: a history rewritten at every call cannot escape it); when it
        leaves no room for a turn the episode stops instead (``context`` or ``budget``), its
        history as it was, and one whose contents alone are surely too long is never tokenised
        (as an observation: :meth:`_surely_too_long`)."""
        if self.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        spent, lim = e.spent + len(e.ids), self.limits
        budget = None if lim.max_episode_tokens is None else lim.max_episode_tokens - spent
        rooms = [(r, why) for r, why in ((budget, "budget"), (lim.max_context, "context")) if r is not None]
        room, reason = min(rooms, default=(None, ""))
        chars = sum(len(m["content"]) for m in messages)
        if room is not None and chars > max_token_chars(self.tokenizer) * (room - 1):
            e.stop = reason  # its ids >= ceil(chars / L) >= room: no room for a turn after it
            return
        try:
            text, ids = self.delta.prompt(messages, tools=e.tools)
        except TemplateError as exc:
            e.fail(f"the restarted history cannot be rendered: {str(exc).splitlines()[0]}")
            return
        prompt = tokenize_prompts(self.tokenizer, [text], max_prompt_length=_NO_LIMIT, ids=[ids])[0]
        room, reason = self._room_after(len(prompt), spent + len(prompt))
        if room < 1:
            e.stop = reason
            return
        e.segments.append((e.prompt, e.ids, e.action, e.logprobs))
        e.prompt, e.spent, e.ids, e.action, e.logprobs = prompt, spent + len(prompt), [], [], []
        e.carried += sum(e.rewards.values())
        e.rewards = {}
        e.messages = list(messages)

    def _surely_too_long(self, e: EpisodeState, observation: list[dict], prompt: list[int]) -> str | None:
        """The stop reason (``budget``, ``context``) that :meth:`_continue` would give an
        observation whose contents alone are too long to fit, decided from their length in
        characters (a token covers at most :func:`max_token_chars` of them, so ``n`` characters
        are at least ``ceil(n / L)`` ids), so a huge observation is never tokenised; None when it
        may fit (or is cut to ``max_observation_tokens`` first): then it is tokenised as ever."""
        lim = self.limits
        if lim.max_observation_tokens is not None:
            return None
        chars = sum(len(m["content"]) for m in observation)
        per_token = max_token_chars(self.tokenizer)
        # ids >= room is the stop; chars > per_token * (room - 1) gives ids >= ceil(chars / L) >= room.
        budget = None if lim.max_episode_tokens is None else lim.max_episode_tokens - e.spent - len(e.ids)
        if budget is not None and chars > per_token * (budget - 1):
            return "budget"  # checked first in _continue
        context = None if lim.max_context is None else lim.max_context - len(prompt) - len(e.ids)
        if context is not None and chars > per_token * (context - 1):
            if budget is None:
                return "context"
            if budget <= context:
                return "budget"  # ids >= context >= budget: budget, checked first, stops it
            # else "budget" or "context" depends on the exact count, and at most per_token *
            # (budget - 1) characters are tokenised to find it: bounded work.
        return None

    def _finish(self, episodes: list[EpisodeState]) -> float:
        t = time.perf_counter()
        scored = [e for e in episodes if e.stop != "error"]
        results = self._calls(scored, "final_reward", lambda e: (e.stop,))
        for e, outcome in zip(scored, results):
            final = accept(e, outcome, "final_reward()", checked_final)
            if final is not None:
                e.final = final[0]
                for key, value in final[1].items():
                    e.info.setdefault(key, []).append(value)
        self._close(episodes)
        return time.perf_counter() - t

    def _close(self, episodes: list[EpisodeState]) -> None:
        """``close()`` each episode's environment that is still there; a failure is counted in
        the episode (``env/close_errors``) and said once per runner."""
        open_ = [e for e in episodes if e.env is not None and self.host.alive(e.env)]
        for e, (ok, value) in zip(open_, self._calls(open_, "close", lambda _: ())):
            if not ok:
                e.close_error = value
                if not self._close_warned:
                    self._close_warned = True
                    log.warning(
                        "environment %s: close() failed: %s (counted in env/close_errors; said once)",
                        self.name,
                        value,
                    )
