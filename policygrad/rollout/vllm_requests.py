"""vLLM's side of one generation call (the engine: :mod:`policygrad.rollout.vllm`): the sampling
parameters of each prompt's request, and vLLM's outputs laid out as a
:class:`~policygrad.rollout.base.Rollout` exactly as the Hugging Face engine lays out its own."""

from __future__ import annotations

import torch

from policygrad.rollout.base import Rollout, SamplingParams

__all__ = ["rollout_from_outputs", "sampling_fields", "sampling_params"]


def sampling_fields(
    G, temperature, top_p, top_k, max_new_tokens, greedy, seed, ignore_eos, eos_token_ids
) -> dict:
    """The fields of vLLM's ``SamplingParams`` for one prompt's request (also its JSON form in a
    server request): G samples with its ``seed`` (greedy: one, copied to the G rows), the sampled
    token's log-prob, stopping only at ``eos_token_ids``."""
    common = dict(
        max_tokens=max_new_tokens,
        logprobs=0,  # the sampled token's log-prob only
        stop_token_ids=list(eos_token_ids) if not ignore_eos else [],
        ignore_eos=ignore_eos,
        detokenize=False,
    )
    if greedy:  # vLLM's greedy mode needs n=1; the G rows are copies
        return dict(n=1, temperature=0.0, **common)
    return dict(
        n=G,
        temperature=temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        seed=int(seed),
        **common,
    )


def sampling_params(G, temperature, top_p, top_k, max_new_tokens, greedy, seed, ignore_eos, eos_token_ids):
    """vLLM's ``SamplingParams`` of one prompt's request (:func:`sampling_fields`)."""
    # imported here: vLLM is an optional dependency, loaded when an engine samples
    from vllm import SamplingParams

    return SamplingParams(
        **sampling_fields(
            G, temperature, top_p, top_k, max_new_tokens, greedy, seed, ignore_eos, eos_token_ids
        )
    )


def rollout_from_outputs(
    outputs,
    prompts: list[list[int]],
    *,
    group_size: int,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    sampling: SamplingParams,
    greedy: bool,
    ignore_eos: bool,
) -> Rollout:
    """vLLM's outputs of one ``llm.generate`` call (one per prompt, in order) as a :class:`Rollout`
    laid out as :meth:`VLLMRolloutEngine.sample <policygrad.rollout.vllm.VLLMRolloutEngine.sample>`
    describes: prompts left-padded, prompt i's samples in rows i*G .. i*G+G-1, each response cut
    after its first id of ``eos_token_ids`` and right-padded, log-probs 0.0 where masked.

    Raises:
        RuntimeError: vLLM returned another number of completions than G, a completion without
            tokens or log-probs, or one that stopped short of ``max_new_tokens`` without an EOS.
    """
    G, n, pad = int(group_size), len(prompts), pad_token_id
    longest = max(len(p) for p in prompts)
    responses = torch.full((n * G, max_new_tokens), pad, dtype=torch.long)
    logprobs = torch.zeros((n * G, max_new_tokens), dtype=torch.float32)
    lengths = torch.zeros(n * G, dtype=torch.long)
    eos = set(eos_token_ids) if not ignore_eos else set()  # ignore_eos: EOS is a plain token
    for i, out in enumerate(outputs):
        completions = sorted(out.outputs, key=lambda c: c.index)
        if greedy:
            completions = completions * G
        if len(completions) != G:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, expected {G}")
        for g, c in enumerate(completions):
            row = i * G + g
            tokens = list(c.token_ids)
            if not tokens or c.logprobs is None or len(c.logprobs) != len(tokens):
                raise RuntimeError(
                    f"vLLM returned no tokens or no log-probs for row {row} "
                    f"(finish_reason={c.finish_reason!r})"
                )
            # The first EOS ends the response (vLLM includes the stop token in token_ids).
            cut = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
            if cut < max_new_tokens and tokens[cut - 1] not in eos:
                raise RuntimeError(
                    f"vLLM stopped row {row} after {cut} of {max_new_tokens} tokens without an EOS "
                    f"(finish_reason={c.finish_reason!r}, stop_reason={c.stop_reason!r})"
                )
            tokens = tokens[:cut]
            responses[row, :cut] = torch.tensor(tokens, dtype=torch.long)
            logprobs[row, :cut] = torch.tensor(
                [step[t].logprob for step, t in zip(c.logprobs, tokens, strict=False)],
                dtype=torch.float32,
            )
            lengths[row] = cut
    has_eos = torch.tensor(
        [int(lengths[r]) > 0 and int(responses[r, lengths[r] - 1]) in eos for r in range(n * G)],
        dtype=torch.bool,
    )
    T = int(lengths.max()) if lengths.numel() else 0
    keep = torch.arange(T)[None, :] < lengths[:, None]

    prompt_ids = torch.full((n, longest), pad, dtype=torch.long)
    prompt_mask = torch.zeros((n, longest), dtype=torch.long)
    for i, ids in enumerate(prompts):
        prompt_ids[i, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, longest - len(ids) :] = 1
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(G, dim=0),
        prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
        response_ids=responses[:, :T].masked_fill(~keep, pad),
        response_mask=keep.float(),
        truncated=~has_eos if not ignore_eos else torch.zeros_like(has_eos),
        sampler_logprobs=torch.where(keep, logprobs[:, :T], torch.zeros(())),
        group_index=torch.arange(n).repeat_interleave(G),
        group_size=G,
        sampling=sampling,
    )
