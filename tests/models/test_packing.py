"""The padding-free training forward (:mod:`policygrad.models.packing`): responses packed end to end
on their prompt's cache give the plain forward's hidden states and gradients (float64; gradients to
~2e-7 for transformers' float32 RMSNorm, as in test_forward.py), and packing declines what it
cannot do (a mask that is not a prefix, eager attention, a sliding window, empty responses)."""

from __future__ import annotations

import pytest
import torch

from policygrad.models.forward import plain_output_head, policy_logprobs, response_hidden
from policygrad.models.packing import packed_response_hidden
from tests.models.test_forward import grouped_rollout, varied_rollout
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("row_tokens", [512, 7, 3, 1])
def test_packed_forward_equals_the_plain_forward_with_gradients(row_tokens):
    # row_tokens 512: each prompt's responses share one packed row; 7 and 3: several rows per
    # prompt, a response longer than a row gets one of its own; 1: one row per response token
    # budget (every response alone). Hidden states and gradients match the plain forward over
    # cat(prompt, response) (float64; gradients to ~2e-7 for the float32 RMSNorm, see the top).
    model, _ = make_tiny_llama(seed=1, initializer_range=0.3)
    model = model.double().train()
    rollout = varied_rollout()
    valid = rollout.response_mask > 0
    decoder, head = plain_output_head(model)
    weights = torch.linspace(-1.0, 2.0, int(valid.sum()), dtype=torch.float64)[:, None]

    def hidden_and_grads(packed: bool):
        model.zero_grad(set_to_none=True)
        if packed:
            hidden = packed_response_hidden(decoder, rollout, row_tokens=row_tokens)
        else:
            hidden = response_hidden(model, rollout, share_prompts=False)[valid]
        (head(hidden).log_softmax(-1) * weights).sum().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, plain_grads = hidden_and_grads(False)
    packed, packed_grads = hidden_and_grads(True)
    assert packed.shape == (int(valid.sum()), model.config.hidden_size)
    torch.testing.assert_close(packed, plain, atol=1e-12, rtol=0)
    for name, grad in plain_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert (packed_grads[name] - grad).abs().max().item() <= 2e-6 * scale, name


def test_policy_logprobs_fused_head_equals_the_logits_path():
    # The trainer's default (packed forward, log-probs from hidden states) against the logits
    # path (fused_head=False): equal at valid tokens; exactly 0 elsewhere.
    model, _ = make_tiny_llama(seed=4, initializer_range=0.3)
    model = model.double().eval()
    rollout = varied_rollout()
    valid = rollout.response_mask > 0
    with torch.no_grad():
        lp, ent = policy_logprobs(model, rollout, temperature=0.7, top_k=0, top_p=1.0, with_entropy=True)
        ref_lp, ref_ent = policy_logprobs(
            model, rollout, temperature=0.7, top_k=0, top_p=1.0, with_entropy=True, fused_head=False
        )
    torch.testing.assert_close(lp[valid], ref_lp[valid], atol=1e-12, rtol=0)
    torch.testing.assert_close(ent[valid], ref_ent[valid], atol=1e-12, rtol=0)
    assert torch.count_nonzero(lp[~valid]) == 0 and torch.count_nonzero(ent[~valid]) == 0


def test_packing_declines_what_it_cannot_do():
    model, _ = make_tiny_llama(seed=1)
    decoder, _ = plain_output_head(model)
    holes = grouped_rollout()
    holes.response_mask[0, 2] = 0  # not a prefix: the padded forward must run instead
    assert packed_response_hidden(decoder, holes) is None
    model.config._attn_implementation = "eager"  # a 4-D boolean mask is sdpa's format only
    assert packed_response_hidden(decoder, grouped_rollout()) is None


def test_sliding_window_models_and_empty_responses_take_the_padded_path():
    # A sliding window is not in the packed mask (and its cache keeps only the last keys): packing
    # declines, and policy_logprobs still equals the logits path. T = 0: nothing to pack.
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = MistralForCausalLM(config).double().eval()
    decoder, _ = plain_output_head(model)
    rollout = varied_rollout()
    assert packed_response_hidden(decoder, rollout) is None
    valid = rollout.response_mask > 0
    with torch.no_grad():
        lp, _ = policy_logprobs(model, rollout, temperature=1.0, top_k=0, top_p=1.0)
        ref, _ = policy_logprobs(model, rollout, temperature=1.0, top_k=0, top_p=1.0, fused_head=False)
    torch.testing.assert_close(lp[valid], ref[valid], atol=1e-12, rtol=0)
    llama, _ = make_tiny_llama(seed=1)
    empty = grouped_rollout().select(torch.arange(3))
    empty.response_ids = empty.response_ids[:, :0]
    empty.response_mask = empty.response_mask[:, :0]
    empty.sampler_logprobs = empty.sampler_logprobs[:, :0]
    assert packed_response_hidden(plain_output_head(llama)[0], empty) is None
