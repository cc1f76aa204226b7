"""Samplers: dataset rows in, G samples of each out, one record for single and multi-turn.

A :class:`Sampler` is what the producer and the evaluation call; it hides whether a sample is
one generation (:class:`SingleTurnSampler`, over a rollout engine) or an episode of turns with
an environment (:class:`EpisodeSampler`, over an :class:`~policygrad.envs.episodes.EpisodeRunner`).
Both return :class:`Samples`: the rows' opening prompt ids, the B = n x G rollout (rows of a
prompt contiguous), the decoded completions (an episode's final answer) and, for episodes, the
episodes' record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from policygrad.data.chat import encode_prompts
from policygrad.envs.episodes import EpisodeRunner, Episodes
from policygrad.rollout.base import Rollout, SamplingParams, decode_completions
from policygrad.rollout.engine import RolloutEngine

__all__ = ["EpisodeSampler", "Sampler", "Samples", "SingleTurnSampler", "engine_sampling"]


@dataclass(frozen=True)
class Samples:
    """G samples of each of n rows.

    Attributes:
        prompt_ids: the n rows' opening prompt token ids.
        rollout: B = n x G rows, row i's samples in rows i*G .. i*G+G-1.
        completions: B decoded completions (an episode's final answer).
        episodes: the episodes' record (None for single-turn samples).
    """

    prompt_ids: list[list[int]]
    rollout: Rollout
    completions: list[str]
    episodes: Episodes | None = None

    @property
    def fields(self) -> dict[str, Any]:
        """Per-sample fields a reward function may read beyond the completion (an episode's
        ``transcript``)."""
        return {"transcript": self.episodes.transcripts} if self.episodes is not None else {}


class Sampler(Protocol):
    """``sample(rows, group_size=G, params=..., seeds=[one per row]) -> Samples``.

    ``seeds``: row i's samples draw from ``seeds[i]`` whichever batch, round or rank the row is
    in (a sampler built without per-prompt seeds draws from ``generator_seed``, or from torch's
    stream when that is None)."""

    def sample(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        group_size: int,
        params: SamplingParams,
        seeds: Sequence[int],
        generator_seed: int | None = None,
    ) -> Samples: ...


class SingleTurnSampler:
    """One generation per sample: the rows' prompts formatted and tokenised as the run's data
    section says (:func:`~policygrad.data.chat.encode_prompts`), sampled by ``engine``.

    Args:
        engine: the rollout engine.
        tokenizer: the policy's tokenizer (prompts in, completions out).
        data: the data section (``system_prompt``, ``use_chat_template``, ``max_prompt_length``).
        max_new_tokens: the most tokens of a response (EOS included).
        ignore_eos: keep sampling past EOS (benchmarks: a fixed length).
        per_prompt_seeds: sample row i from ``seeds[i]`` (False: from ``generator_seed``).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        data,
        *,
        max_new_tokens: int,
        ignore_eos: bool = False,
        per_prompt_seeds: bool = True,
    ):
        self.engine, self.tokenizer, self.data = engine, tokenizer, data
        self.max_new_tokens, self.ignore_eos = max_new_tokens, ignore_eos
        self.per_prompt_seeds = per_prompt_seeds

    def sample(self, rows, *, group_size, params, seeds, generator_seed=None) -> Samples:
        """See :class:`Sampler`."""
        prompt_ids = encode_prompts(self.tokenizer, rows, self.data)
        rollout = self.engine.generate(
            prompt_ids,
            group_size=group_size,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_new_tokens=self.max_new_tokens,
            greedy=params.greedy,
            generator_seed=None if self.per_prompt_seeds else generator_seed,
            prompt_seeds=list(seeds) if self.per_prompt_seeds else None,
            ignore_eos=self.ignore_eos,
        )
        return Samples(prompt_ids, rollout, decode_completions(self.tokenizer, rollout))


class EpisodeSampler:
    """One episode per sample: turns of the policy and an environment
    (:meth:`EpisodeRunner.run`); a row's seed is also its episodes' ``reset`` seed.

    Args:
        runner: the episode runner (engine, tokenizer, environment, turn limits).
        per_prompt_seeds: the first turn samples from the row's seed (False: torch's stream).
    """

    def __init__(self, runner: EpisodeRunner, *, per_prompt_seeds: bool = True):
        self.runner, self.per_prompt_seeds = runner, per_prompt_seeds

    def sample(self, rows, *, group_size, params, seeds, generator_seed=None) -> Samples:  # noqa: ARG002
        """See :class:`Sampler` (``generator_seed`` is unused: an episode's turns seed themselves)."""
        prompt_ids, rollout, episodes, finals = self.runner.run(
            rows,
            group_size=group_size,
            seeds=seeds,
            per_prompt_seeds=self.per_prompt_seeds,
            sampling=engine_sampling(params),
        )
        return Samples(prompt_ids, rollout, finals, episodes)

    def close(self) -> None:
        """Stop the environment's worker processes (and whatever they forked)."""
        self.runner.close()


def engine_sampling(params: SamplingParams) -> dict[str, Any]:
    """``engine.generate``'s sampling arguments of ``params`` (greedy: the argmax, at temperature 1)."""
    if params.greedy:
        return {"greedy": True, "temperature": 1.0}
    return {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
