"""Tests of vLLM's outputs laid out as a Rollout (no engine is started: the outputs are stand-ins
with vLLM's fields), by hand: left-padded prompts, G rows per prompt, each response cut after its
first EOS, truncation, log-probs, and the refusals of outputs that break the contract."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from policygrad.rollout.base import SamplingParams
from policygrad.rollout.vllm_requests import rollout_from_outputs

pytestmark = pytest.mark.unit

EOS, PAD = 2, 0


def completion(index, tokens, *, finish="stop"):
    # vLLM's processed log-prob of each sampled token, here -(position + 1) / 10 for a hand check
    logprobs = [{t: SimpleNamespace(logprob=-(k + 1) / 10)} for k, t in enumerate(tokens)]
    return SimpleNamespace(
        index=index, token_ids=tokens, logprobs=logprobs, finish_reason=finish, stop_reason=None
    )


def layout(outputs, prompts, **kw):
    args = dict(group_size=2, max_new_tokens=3, eos_token_ids=[EOS], pad_token_id=PAD,
                sampling=SamplingParams(0.7), greedy=False, ignore_eos=False)
    return rollout_from_outputs(outputs, prompts, **{**args, **kw})


def test_outputs_become_the_hf_engines_layout():
    # Prompt [5, 6]: [9, EOS] (ended) and [4, 4, 4] (truncated at 3); prompt [7]: [EOS] and
    # [8, EOS, 3] (vLLM kept a token after the first EOS: cut there). Completions arrive out of
    # order and are sorted by their index.
    outputs = [
        SimpleNamespace(outputs=[completion(1, [4, 4, 4], finish="length"), completion(0, [9, EOS])]),
        SimpleNamespace(outputs=[completion(0, [EOS]), completion(1, [8, EOS, 3])]),
    ]
    r = layout(outputs, [[5, 6], [7]])
    assert r.prompt_ids.tolist() == [[5, 6], [5, 6], [PAD, 7], [PAD, 7]]
    assert r.prompt_mask.tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert r.response_ids.tolist() == [[9, EOS, PAD], [4, 4, 4], [EOS, PAD, PAD], [8, EOS, PAD]]
    assert r.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert r.truncated.tolist() == [False, True, False, False]
    lp = torch.tensor([[-0.1, -0.2, 0.0], [-0.1, -0.2, -0.3], [-0.1, 0.0, 0.0], [-0.1, -0.2, 0.0]])
    assert torch.equal(r.sampler_logprobs, lp)
    assert r.group_index.tolist() == [0, 0, 1, 1] and r.group_size == 2 and r.sampling == SamplingParams(0.7)
    # ignore_eos: EOS is a plain token, nothing is cut and nothing counts as truncated.
    free = layout([SimpleNamespace(outputs=[completion(0, [EOS, 3, 3]), completion(1, [3, EOS, 3])])], [[5]],
                  ignore_eos=True)
    assert free.response_ids.tolist() == [[EOS, 3, 3], [3, EOS, 3]] and not free.truncated.any()


def test_a_greedy_output_fills_the_group_and_a_broken_one_is_refused():
    greedy = layout([SimpleNamespace(outputs=[completion(0, [9, EOS])])], [[5]], greedy=True)
    assert greedy.response_ids.tolist() == [[9, EOS], [9, EOS]]
    with pytest.raises(RuntimeError, match="vLLM returned 1 completions for prompt 0, expected 2"):
        layout([SimpleNamespace(outputs=[completion(0, [9, EOS])])], [[5]])
    with pytest.raises(RuntimeError, match="no tokens or no log-probs for row 1"):
        layout([SimpleNamespace(outputs=[completion(0, [EOS]), completion(1, [])])], [[5]])
    short = [SimpleNamespace(outputs=[completion(0, [EOS]), completion(1, [4])])]
    with pytest.raises(RuntimeError, match="vLLM stopped row 1 after 1 of 3 tokens without an EOS"):
        layout(short, [[5]])
