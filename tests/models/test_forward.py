"""The training forward that runs each distinct prompt once (``response_logits(share_prompts=True)``)
gives the same logits and the same gradients as the plain forward over every whole row.

In float64 the log-probs of the two paths agree to ~1e-12 (the same attention over the same keys,
only the order of some sums differs), so any masking, position or cache-indexing mistake would
show. Gradients agree to ~2e-7 of their largest entry, not 1e-12: transformers' RMSNorm computes in
float32 even in a float64 model, so the backward rounds each row's gradient to float32 at every
norm, and the shared path rounds the sum of a group's G prompt gradients where the plain path
rounds each of them (measured: 1.9e-7 relative; a wrong row, position or mask gives O(1))."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policygrad.core.logprobs import logprobs_from_logits
from policygrad.models.forward import (
    Float32Head,
    float32_head,
    policy_logprobs,
    response_hidden,
    response_logits,
)
from policygrad.rollout.base import Rollout
from tests.tiny import PAD_ID, make_tiny_llama

pytestmark = pytest.mark.integration


def grouped_rollout(G: int = 3, n: int = 3, P: int = 7, T: int = 6, seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(n, P, dtype=torch.long)
    prompt_mask[0, :3] = 0  # a left-padded prompt
    prompt_mask[2, :1] = 0
    prompt_ids = torch.randint(4, 100, (n, P), generator=g).masked_fill(prompt_mask == 0, PAD_ID)
    B = n * G
    response_mask = torch.ones(B, T)
    response_mask[1, 4:] = 0  # responses that ended early: right padding
    response_mask[B - 1, 1:] = 0
    response_ids = torch.randint(4, 100, (B, T), generator=g).masked_fill(response_mask == 0, PAD_ID)
    return Rollout(
        prompt_ids=prompt_ids.repeat_interleave(G, 0),
        prompt_mask=prompt_mask.repeat_interleave(G, 0),
        response_ids=response_ids,
        response_mask=response_mask,
        truncated=torch.zeros(B, dtype=torch.bool),
        sampler_logprobs=torch.zeros(B, T),
        group_index=torch.arange(n).repeat_interleave(G),
        group_size=G,
    )


def _logprobs_and_grads(model, rollout, share):
    model.zero_grad(set_to_none=True)
    lp = logprobs_from_logits(response_logits(model, rollout, share_prompts=share), rollout.response_ids)
    # A loss that weights every row differently, so a gradient summed into the wrong prompt shows.
    weights = torch.linspace(-1.0, 2.0, rollout.batch_size, dtype=lp.dtype)[:, None]
    (lp * rollout.response_mask.to(lp) * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("rows", ["all", "shuffled", "partial_groups"])
def test_shared_prompt_forward_equals_the_plain_forward_with_gradients(rows):
    model, _ = make_tiny_llama(seed=1, initializer_range=0.3)
    model = model.double().train()
    rollout = grouped_rollout()
    if rows == "shuffled":  # rows of a group need not be contiguous
        order = torch.randperm(rollout.batch_size, generator=torch.Generator().manual_seed(0))
        rollout = rollout.select(order)
    elif rows == "partial_groups":  # a micro-batch may cut a group
        rollout = rollout.select(torch.tensor([0, 2, 4, 5, 8]))
    plain_lp, plain_grads = _logprobs_and_grads(model, rollout, share=False)
    shared_lp, shared_grads = _logprobs_and_grads(model, rollout, share=True)
    valid = rollout.response_mask > 0
    torch.testing.assert_close(shared_lp[valid], plain_lp[valid], atol=1e-12, rtol=0)
    for name, grad in plain_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        assert (shared_grads[name] - grad).abs().max().item() <= 2e-6 * scale, name


def test_single_token_responses_and_all_distinct_prompts():
    model, _ = make_tiny_llama(seed=2, initializer_range=0.3)
    model = model.double().eval()
    with torch.no_grad():
        one = grouped_rollout(T=1)  # only the last prompt position's logits are used
        torch.testing.assert_close(
            response_logits(model, one, share_prompts=True),
            response_logits(model, one, share_prompts=False),
            atol=1e-12,
            rtol=0,
        )
        distinct = grouped_rollout(G=1)  # nothing to share: the plain path runs
        torch.testing.assert_close(
            response_logits(model, distinct, share_prompts=True),
            response_logits(model, distinct, share_prompts=False),
            atol=0,
            rtol=0,
        )


@pytest.mark.parametrize("truncation", [(None, None), (5, None), (None, 0.9), (5, 0.9)])
def test_forwards_default_to_the_rollouts_sampling_params_bit_for_bit(truncation):
    # The trainer passes temperature/top_k/top_p from its config (top_k=0 and top_p=1.0 when off);
    # the rollout carries them normalised (None when off). Both spellings give the same bits, so
    # the trainer may switch to the rollout's own params.
    from policygrad.models.forward import inference_logprobs
    from policygrad.rollout.base import SamplingParams

    model, _ = make_tiny_llama(seed=4, initializer_range=0.3)
    model = model.eval()
    top_k, top_p = truncation
    sampling = SamplingParams(0.7, top_k, top_p)
    rollout = dataclasses.replace(varied_rollout(), sampling=sampling)
    config_style = {"temperature": 0.7, "top_k": top_k or 0, "top_p": 1.0 if top_p is None else top_p}
    with torch.no_grad():
        default, _ = policy_logprobs(model, rollout, with_entropy=True)
        for kwargs in (
            config_style,
            {"temperature": 0.7, "top_k": top_k, "top_p": top_p},
            {"sampling": sampling},
        ):
            lp, _ = policy_logprobs(model, rollout, with_entropy=True, **kwargs)
            assert torch.equal(lp, default), kwargs
        old = inference_logprobs(model, rollout, micro_batch_size=2)
        assert torch.equal(old, inference_logprobs(model, rollout, micro_batch_size=2, **config_style))
        ref = inference_logprobs(model, rollout, sampling=sampling.tempered(), micro_batch_size=2)
        assert torch.equal(ref, inference_logprobs(model, rollout, temperature=0.7, micro_batch_size=2))
        assert torch.equal(
            ref, inference_logprobs(model, rollout, temperature=0.7, top_k=0, top_p=1.0, micro_batch_size=2)
        )
        if top_k is None and top_p is None:
            assert torch.equal(ref, old)
        else:
            assert not torch.equal(ref, old)  # truncation changed the numbers
    with pytest.raises(TypeError, match="either sampling= or temperature="):
        policy_logprobs(model, rollout, sampling=sampling, temperature=0.7)


# ----------------------------------------------------------------------------- fp32 LM head


def _hand_logprobs(hidden, weight, tokens, temperature):
    """log softmax(hidden @ W^T / T) at ``tokens``, plainly: the head in the dtype of its inputs."""
    return torch.log_softmax((hidden @ weight.t()).float() / temperature, dim=-1).gather(-1, tokens[:, None])[
        :, 0
    ]


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
def test_float32_head_under_bf16_autocast_is_fp32_on_the_bf16_body(fused):
    """``model.lm_head_dtype: float32`` under ``bf16-mixed``: the body's matmuls run in bf16, the
    head's in float32 on the body's own hidden states.

    The reference is computed by hand: hidden states from the decoder under the same bf16
    autocast (the same kernels, so the same numbers), then ``hidden @ W^T`` and the log-softmax
    in float32 outside autocast. The kernel's blocked log-sum-exp differs from
    ``torch.log_softmax`` by float32 rounding only: log-probs of order log V = 4.6 (V = 100),
    unit roundoff 2**-24 = 6e-8, a few roundings per term -> atol 1e-5. A bf16 head instead rounds each
    logit's inputs to 8 significant bits (relative 2**-8 = 3.9e-3 per input): on logits of size
    ~1 (initializer_range 0.5, hidden 32) that is ~1e-3 nats per token, so the plain head must
    differ from the float32 reference by more than 1e-4 somewhere, and match its own bf16 hand
    computation instead."""
    model, _ = make_tiny_llama(seed=0, initializer_range=0.5)
    model.eval()
    rollout = grouped_rollout()
    valid = rollout.response_mask > 0
    body_dtypes, head_dtypes = [], []
    body = model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda _m, _i, o: body_dtypes.append(o.dtype)
    )
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = response_hidden(model, rollout, share_prompts=False)
        bf16_lp, _ = policy_logprobs(model, rollout, share_prompts=False, fused_head=fused)
    with torch.no_grad():
        bf16_hand = _hand_logprobs(
            hidden[valid].bfloat16(), model.lm_head.weight.bfloat16(), rollout.response_ids[valid], 1.0
        )
        fp32_hand = _hand_logprobs(
            hidden[valid].float(), model.lm_head.weight, rollout.response_ids[valid], 1.0
        )
    assert type(model.lm_head) is torch.nn.Linear  # today's behaviour without the option
    torch.testing.assert_close(bf16_lp[valid], bf16_hand, atol=1e-5, rtol=0)
    assert (bf16_lp[valid] - fp32_hand).abs().max() > 1e-4

    head = float32_head(model)
    assert (
        type(head) is Float32Head and head is model.lm_head and head.weight is model.model.embed_tokens.weight
    )
    hook = head.register_forward_hook(lambda _m, _i, o: head_dtypes.append(o.dtype))
    body_dtypes.clear()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = policy_logprobs(model, rollout, share_prompts=False, fused_head=fused)
    body.remove(), hook.remove()
    assert body_dtypes and set(body_dtypes) == {torch.bfloat16}  # the body computed in bf16
    if not fused:
        assert head_dtypes and set(head_dtypes) == {torch.float32}  # the head module gave fp32 logits
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp[valid], fp32_hand, atol=1e-5, rtol=0)
    assert bool((lp[~valid] == 0).all()) or not fused


def test_float32_head_trains_like_linear_outside_autocast_and_refuses_other_heads():
    """Outside autocast a Float32Head is the same float32 Linear: same log-probs and gradients
    bit for bit (the class swap changes nothing else; the state dict is the same)."""
    plain, _ = make_tiny_llama(seed=0)
    swapped, _ = make_tiny_llama(seed=0)
    float32_head(swapped)
    assert plain.state_dict().keys() == swapped.state_dict().keys()
    rollout = grouped_rollout()
    grads = []
    for model in (plain, swapped):
        lp, _ = policy_logprobs(model, rollout)
        lp.sum().backward()
        grads.append((lp.detach(), model.lm_head.weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert float32_head(swapped) is swapped.lm_head  # idempotent
    swapped.lm_head = torch.nn.Identity()
    with pytest.raises(
        ValueError,
        match=r"needs an output head that is a plain torch.nn.Linear; LlamaForCausalLM's is "
        r"torch.nn.modules.linear.Identity \(a LoRA adapter on lm_head is one\)",
    ):
        float32_head(swapped)


def varied_rollout() -> Rollout:
    """3 prompts x G = 4 with responses of lengths 0 .. T, so packing has empty, one-token and
    full rows to place; rows shuffled so a prompt's rows are not contiguous."""
    rollout = grouped_rollout(G=4, n=3, T=6)
    lengths = torch.tensor([6, 0, 1, 3, 2, 6, 5, 1, 4, 6, 0, 2])
    mask = (torch.arange(6)[None] < lengths[:, None]).float()
    rollout.response_mask = mask
    rollout.response_ids = rollout.response_ids.masked_fill(mask == 0, PAD_ID)
    order = torch.randperm(rollout.batch_size, generator=torch.Generator().manual_seed(3))
    return rollout.select(order)


_SHARDED_TRUNCATED = """
import os, tempfile
import torch
import torch.distributed as td
from torch.distributed.fsdp import fully_shard
from policygrad.models.forward import policy_logprobs
from tests.learn.test_update import _rollout
from tests.tiny import make_tiny_llama

torch.set_num_threads(1)
store = "file://" + os.path.join(tempfile.mkdtemp(), "store")
td.init_process_group("gloo", init_method=store, rank=0, world_size=1)
try:
    sharded, _ = make_tiny_llama(seed=1)
    plain, _ = make_tiny_llama(seed=1)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    rollout = _rollout()
    valid = rollout.response_mask > 0
    for options in ({"top_k": 20}, {"top_p": 0.9}):
        a, _ = policy_logprobs(sharded, rollout, **options)
        b, _ = policy_logprobs(plain, rollout, **options)
        assert torch.equal(a[valid].detach(), b[valid].detach()), options
        assert a[valid].isfinite().any()
finally:
    td.destroy_process_group()
print("same")
"""


def test_a_sharded_model_scores_under_top_k_and_top_p_as_the_plain_one():
    # With top-k/top-p the whole model runs (not the fused head); inside call_as_forward
    # ``model.forward`` is the kernel, so calling ``model(...)`` again recursed into it with the
    # model's keywords. One FSDP2 rank in its own process (a process group stays out of pytest's).
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _SHARDED_TRUNCATED],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("same"), done.stderr[-2000:]
