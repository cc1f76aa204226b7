"""The producer: a step's batch made from the parts it needs, and nothing of the trainer's.

:class:`Producer` takes a step's prompts from the stream, samples G of each through a
:class:`~policygrad.rollout.samplers.Sampler` (single-turn generations and environment episodes
are one call), scores them with the reward functions' raw output, runs DAPO's dynamic-sampling
rounds and the sampling half of the estimator's inputs (:data:`policygrad.produce.inputs.ESTIMATOR_INPUTS`),
and returns a :class:`~policygrad.produce.production.Production`. It holds no reference to the
trainer, the policy's parameters or the optimizer (the rollout engine it samples with may be the
policy itself: that engine reads the weights, the producer never writes them), so the rollouts
(:mod:`policygrad.produce.rollouts`) can run it on a thread while the trainer updates.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from policygrad.data.stream import PromptStream
from policygrad.produce.production import (
    Production,
    RawRound,
    chosen_positions,
    signal_components,
    whole_groups,
)
from policygrad.produce.stages import EstimatorInput, ProducerParts, groups_with_signal
from policygrad.rollout.base import Rollout
from policygrad.rollout.samplers import Sampler
from policygrad.seeds import seeded_torch

__all__ = ["Chosen", "DynamicSampling", "Producer"]


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (Yu et al. 2025, section 3.2): more rounds of ``prompts_per_step``
    prompts, at most ``max_extra_rounds``, until that many groups whose raw ``component``
    (:func:`~policygrad.produce.production.signal_components`) varies are kept."""

    component: str
    max_extra_rounds: int


class Producer:
    """``produce(step, version) -> Production`` from the parts it is built with.

    Args:
        sampler: G samples of each row (:class:`~policygrad.rollout.samplers.Sampler`).
        parts: what the producer and the estimator inputs' sampling halves read (the engine, the
            tokenizer, the raw scoring, the seeds, the sampling parameters, the response budget,
            the estimator's options).
        stream: the prompt stream (every rank takes all ``prompts_per_step`` prompts of a round).
        group_size: G.
        prompts_per_step: n, the prompts of one round (the whole step's batch over every rank).
        share: ``share(n) -> slice``, this rank's share of a round's n prompts (all of them in one
            process: :meth:`~policygrad.parallel.distributed.Dist.share`).
        inputs: the providers of the estimator's declared inputs, by name, in its order.
        dynamic: dynamic sampling's settings (None: off).
    """

    def __init__(
        self,
        sampler: Sampler,
        parts: ProducerParts,
        *,
        stream: PromptStream,
        group_size: int,
        prompts_per_step: int,
        share: Callable[[int], slice],
        inputs: Mapping[str, EstimatorInput],
        dynamic: DynamicSampling | None = None,
    ):
        self.sampler, self.parts, self.stream = sampler, parts, stream
        self.group_size, self.prompts_per_step, self.share = group_size, prompts_per_step, share
        self.inputs, self.dynamic = dict(inputs), dynamic

    def produce(self, step: int, version: int) -> Production:
        """Step ``step``'s batch, sampled with the engine's current weights (policy ``version``,
        the updates applied to them).

        Randomness: each prompt samples from its own seed (:meth:`Seeds.prompts`), whichever
        rank, batch or round it is in; a sampler without per-prompt seeds (a resumed run recorded
        with ``rollout.per_prompt_seeds=false``) draws from torch's stream, which this call then
        seeds with ``seeds.step(step)`` in a forked scope (the caller's stream is left as it was),
        so the draws are those a run made when that seed was set at the top of the step."""
        p = self.parts
        scope = contextlib.nullcontext() if p.per_prompt_seeds else seeded_torch(p.seeds.step(step))
        with scope:
            return self._produce(step, version)

    def _produce(self, step: int, version: int) -> Production:
        start = time.perf_counter()
        n = self.prompts_per_step
        rounds = [self.sample_round(step, self.stream.take(n), 0)]  # every rank takes all n
        kept = None
        if self.dynamic is not None:
            component = self.dynamic.component
            kept = [kept_groups(rounds[0], component)]
            while sum(map(len, kept)) < n and len(rounds) <= self.dynamic.max_extra_rounds:
                rounds.append(self.sample_round(step, self.stream.take(n), len(rounds)))
                kept.append(kept_groups(rounds[-1], component))
        chosen = chosen_rounds(rounds, kept if kept is not None else whole_groups(rounds[0]), step)
        inputs = {name: provider.sample(self.parts, chosen) for name, provider in self.inputs.items()}
        return Production(step, version, rounds, kept, inputs, time.perf_counter() - start)

    def sample_round(self, step: int, rows: list[dict[str, Any]], round_index: int) -> RawRound:
        """G samples (or episodes) of each of this rank's share of ``rows``, with the reward
        functions' raw output. Prompt i of the step's ``round_index``-th round samples from its own
        seed (:meth:`Seeds.prompts`), whichever rank or batch it is in."""
        share = self.share(len(rows))
        seeds = self.parts.seeds.prompts(step, round_index, len(rows))
        rows, seeds = rows[share], seeds[share]
        G = self.group_size
        samples = self.sampler.sample(rows, group_size=G, params=self.parts.params, seeds=seeds)
        raw = self.parts.score(rows, samples.completions, repeat=G, fields=samples.fields)
        return RawRound(rows, samples.prompt_ids, samples.rollout, samples.completions, raw, samples.episodes)


def kept_groups(round_: RawRound, component: str) -> list[int]:
    """The groups dynamic sampling keeps: those with signal on ``component``
    (:func:`~policygrad.produce.production.signal_components`), none of whose episodes failed
    (:func:`~policygrad.produce.production.whole_groups`)."""
    varied = groups_with_signal(
        signal_components(round_), round_.rollout.group_index, len(round_.rows), round_.group_size, component
    )
    whole = whole_groups(round_)
    return varied if whole is None else [i for i in varied if i in whole[0]]


class Chosen:
    """The groups a production trains on, as an estimator input's sampling half reads them:
    ``rows``, ``prompt_ids``, ``group_size``, ``step``, and ``rollout`` (their B rows' samples in
    the batch's order, gathered on first use)."""

    def __init__(self, rows, prompt_ids, group_size, step, rounds, positions=None):
        self.rows, self.prompt_ids, self.group_size, self.step = rows, prompt_ids, group_size, step
        self.rounds, self.positions = rounds, positions

    @functools.cached_property
    def rollout(self) -> Rollout:
        """The chosen groups' B rows (one round's rollout as it is, several concatenated)."""
        if self.positions is None:
            return self.rounds[0].rollout
        G = self.group_size
        parts = [
            self.rounds[r].rollout.select([i * G + g for i in groups for g in range(G)])
            for r, groups in self.positions
        ]
        return parts[0] if len(parts) == 1 else Rollout.concat(parts)


def chosen_rounds(rounds: list[RawRound], kept: list[list[int]] | None, step: int) -> Chosen:
    """The :class:`Chosen` groups of ``rounds`` (``kept``: per round the groups kept; None: the
    first round's, all of them)."""
    G = rounds[0].group_size
    positions = chosen_positions(rounds, kept)
    if positions is None:  # no dynamic sampling, or no group with signal: the first round stays
        return Chosen(rounds[0].rows, rounds[0].prompt_ids, G, step, rounds)
    rows = [rounds[r].rows[i] for r, groups in positions for i in groups]
    prompt_ids = [rounds[r].prompt_ids[i] for r, groups in positions for i in groups]
    return Chosen(rows, prompt_ids, G, step, rounds, positions)
