"""The interface every generation engine implements: :class:`RolloutEngine` checks and normalises
the arguments of :meth:`~RolloutEngine.generate` into a :class:`GenerationRequest`, and the engine
samples it into a :class:`~policygrad.rollout.base.Rollout` (the hf engine:
:mod:`policygrad.rollout.hf`; vLLM: :mod:`policygrad.rollout.vllm`)."""

from __future__ import annotations

import abc
import dataclasses
import numbers

import torch

from policygrad.rollout.base import Rollout, SamplingParams, check_sampling_args

__all__ = ["GenerationRequest", "RolloutEngine"]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """What :meth:`RolloutEngine.generate` asks of an engine, checked and normalised.

    Attributes:
        prompts: n prompts, each a non-empty list of int token ids.
        group_size: G >= 1 samples per prompt.
        sampling: the distribution to sample (``greedy``: the argmax instead).
        max_new_tokens: >= 1.
        generator_seed, prompt_seeds, ignore_eos, routing_keys: as :meth:`RolloutEngine.generate`
            takes them.
    """

    prompts: list[list[int]]
    group_size: int
    sampling: SamplingParams
    max_new_tokens: int
    generator_seed: int | None = None
    prompt_seeds: list[int] | None = None
    ignore_eos: bool = False
    routing_keys: list[int] | None = None


class RolloutEngine(abc.ABC):
    """Something that samples G responses per prompt and returns a :class:`Rollout`.

    Attributes:
        shares_policy_weights: the engine samples with the trainer's live policy object, so its
            log-probs are the trainer's and an update needs no weight push (the hf engine). An
            engine with its own copy of the weights (vLLM) says False: it receives them through
            :meth:`sync_weights` after every update.
    """

    shares_policy_weights: bool = False

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        *,
        group_size: int = 1,
        temperature: float = 1.0,
        top_p: float | None = None,
        top_k: int | None = None,
        max_new_tokens: int,
        greedy: bool = False,
        generator_seed: int | None = None,
        prompt_seeds: list[int] | None = None,
        ignore_eos: bool = False,
        routing_keys: list[int] | None = None,
    ) -> Rollout:
        """Sample ``group_size`` responses for each prompt (token ids, no padding) as one batch:
        the arguments are checked and normalised here, then the engine's :meth:`sample` runs.

        Args:
            prompt_token_ids: n prompts, each a non-empty list of token ids.
            group_size: G >= 1 samples per prompt; the result has B = n * G rows, prompt i's
                samples in rows i*G .. i*G+G-1.
            temperature: > 0; logits are divided by it before sampling.
            top_p: nucleus mass in (0, 1]; None or 1.0 = off.
            top_k: keep the k most likely tokens; None or 0 = off.
            max_new_tokens: >= 1, the most tokens a response may have (EOS included).
            greedy: choose the most likely token instead of sampling.
            generator_seed: None samples from torch's global RNG stream; an int makes the result
                depend on this seed only.
            prompt_seeds: one int per prompt: prompt i's samples depend on ``prompt_seeds[i]``
                only, not on the rest of the batch (overrides ``generator_seed``).
            ignore_eos: every response runs to exactly ``max_new_tokens`` tokens: an
                end-of-sequence id is sampled and kept as any other token (vLLM's ``ignore_eos``),
                and no response counts as truncated. For benchmarks of equal work.
            routing_keys: one int per prompt: an engine with several servers samples prompts of
                equal keys on the same server (an episode's turns, for its prefix cache); None:
                each prompt's position. Engines of one process ignore it; no key changes a token.

        Returns:
            A :class:`Rollout` with B = n * G rows.

        Raises:
            TypeError: ``prompt_token_ids`` not a list of int lists; non-int ``group_size`` /
                ``top_k`` / ``max_new_tokens`` / ``generator_seed``.
            ValueError: empty prompt list or prompt; ``group_size`` < 1; ``temperature`` <= 0;
                ``top_p`` outside (0, 1]; ``top_k`` < 0; ``max_new_tokens`` < 1; ``routing_keys``
                not one int per prompt; and what the engine's :meth:`sample` raises (a prompt
                beyond its context).
        """
        prompts, temperature, top_k, top_p = check_sampling_args(
            prompt_token_ids, group_size, temperature, top_p, top_k, max_new_tokens
        )
        if generator_seed is not None and (
            isinstance(generator_seed, bool) or not isinstance(generator_seed, numbers.Integral)
        ):
            raise TypeError(f"generator_seed must be an int or None, got {type(generator_seed).__name__}")
        if routing_keys is not None:
            routing_keys = list(routing_keys)
            if len(routing_keys) != len(prompts) or not all(
                isinstance(k, numbers.Integral) and not isinstance(k, bool) for k in routing_keys
            ):
                raise ValueError(
                    f"routing_keys must be one int per prompt ({len(prompts)}), "
                    f"got {len(routing_keys)} values"
                )
        request = GenerationRequest(
            prompts=prompts,
            group_size=int(group_size),
            sampling=SamplingParams(temperature, top_k, top_p, greedy=bool(greedy)),
            max_new_tokens=int(max_new_tokens),
            generator_seed=generator_seed,
            prompt_seeds=prompt_seeds,
            ignore_eos=ignore_eos,
            routing_keys=routing_keys,
        )
        return self.sample(request)

    @abc.abstractmethod
    def sample(self, request: GenerationRequest) -> Rollout:
        """The engine's sampling of a checked :class:`GenerationRequest` (see :meth:`generate`)."""

    @abc.abstractmethod
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (call after every update)."""
