"""Two masks over the response region: ``response_mask`` (tokens the policy chose) and
``observation_mask`` (tokens it sees but did not choose: tool output, environment text).

The forwards see both (attention, positions, packing), score the chosen tokens only, and equal a
plain forward over the whole unpadded sequence; everything learned from the policy's choices
(advantages, losses, KL) reads ``response_mask`` and is blind to what sits at observed positions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policygrad.core.advantages import estimate_advantages
from policygrad.core.kl import kl_estimate, kl_loss, kl_shaped_rewards
from policygrad.core.losses import get_policy_loss
from policygrad.core.masking import AGGREGATION_MODES, aggregate, masked_mean
from policygrad.models.forward import inference_logprobs, plain_output_head, policy_logprobs
from policygrad.models.packing import packed_response_hidden
from policygrad.rollout.base import Rollout, SamplingParams
from tests.tiny import EOS_ID, PAD_ID, make_tiny_llama

C, O = "c", "o"  # a chosen token, an observed one
# Per row: the response region, token by token (right-padded to T = 9). Rows 2i, 2i+1 share prompt i.
ROWS = [
    [C, C, O, O, O, C, C, C],  # a tool call, its output, the answer (EOS last)
    [C, O, O, C, C, C, C, C, C],  # the widest row: no padding
    [C, C, C, C, C],  # no observation at all
    [C, C, C, O, O],  # ends on an observation (cut by max_new_tokens)
]
PROMPT_LENGTHS = [3, 5]


def _masked_rollout(seed: int = 0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(ROWS), max(PROMPT_LENGTHS), max(map(len, ROWS))
    prompt_mask = torch.tensor([[0] * (P - k) + [1] * k for k in PROMPT_LENGTHS]).repeat_interleave(2, 0)
    prompt_ids = torch.randint(4, 100, (B // 2, P), generator=g).repeat_interleave(2, 0)
    response_mask = torch.zeros(B, T)
    observation_mask = torch.zeros(B, T)
    for b, row in enumerate(ROWS):
        for t, kind in enumerate(row):
            (response_mask if kind == C else observation_mask)[b, t] = 1.0
    response_ids = torch.randint(4, 100, (B, T), generator=g)
    response_ids[0, 7] = response_ids[1, 8] = response_ids[2, 4] = EOS_ID
    seen = (response_mask + observation_mask) > 0
    return Rollout(
        prompt_ids=prompt_ids.masked_fill(prompt_mask == 0, PAD_ID),
        prompt_mask=prompt_mask,
        response_ids=response_ids.masked_fill(~seen, PAD_ID),
        response_mask=response_mask,
        truncated=torch.tensor([False, False, False, True]),
        sampler_logprobs=torch.zeros(B, T),
        group_index=torch.arange(B // 2).repeat_interleave(2),
        group_size=2,
        sampling=SamplingParams(0.7),
        observation_mask=observation_mask,
    )


def _plain_logprobs(model, rollout: Rollout) -> torch.Tensor:
    """[B, T] log-probs of every seen response token from one forward per row over the whole
    unpadded sequence (prompt + response, observed tokens included), no mask, positions 0.."""
    out = torch.zeros(rollout.response_ids.shape, dtype=torch.float64)
    seen = rollout.seen_mask()
    for b in range(rollout.batch_size):
        prompt = rollout.prompt_ids[b][rollout.prompt_mask[b] > 0]
        n = int(seen[b].nonzero().max()) + 1
        ids = torch.cat([prompt, rollout.response_ids[b, :n]])
        logits = model(input_ids=ids[None]).logits[0].double()
        lp = (logits[len(prompt) - 1 : -1] / rollout.sampling.temperature).log_softmax(-1)
        out[b, :n] = lp.gather(-1, ids[len(prompt) :, None])[:, 0]
    return out


@pytest.mark.integration
def test_chosen_tokens_score_as_in_a_plain_forward_over_the_whole_sequence():
    model, _ = make_tiny_llama(seed=5, initializer_range=0.3)
    model = model.double().eval()
    rollout = _masked_rollout()
    chosen = rollout.response_mask > 0
    assert packed_response_hidden(plain_output_head(model)[0], rollout) is not None  # packing applies
    with torch.no_grad():
        expected = _plain_logprobs(model, rollout)
        paths = {
            "packed": policy_logprobs(model, rollout)[0],
            "padded": policy_logprobs(model, rollout, share_prompts=False)[0],
            "logits, shared prompts": policy_logprobs(model, rollout, fused_head=False)[0],
            "logits, whole rows": policy_logprobs(model, rollout, fused_head=False, share_prompts=False)[0],
            "inference": inference_logprobs(model, rollout, micro_batch_size=3),
        }
        for name, lp in paths.items():
            atol = 1e-6 if name == "inference" else 1e-10  # inference_logprobs returns float32
            torch.testing.assert_close(lp[chosen].double(), expected[chosen], atol=atol, rtol=0, msg=name)
        for name in ("packed", "padded", "inference"):  # the fused head scores the chosen tokens only
            assert torch.count_nonzero(paths[name][~chosen]) == 0, name
        # The observed tokens are inputs: without them every chosen token after them changes.
        blind, _ = policy_logprobs(model, dataclasses.replace(rollout, observation_mask=None))
        after = torch.zeros_like(chosen)
        after[0, 5:8] = after[1, 3:9] = True
        assert ((blind - paths["packed"]).abs()[after] > 1e-6).all()
        assert torch.equal(blind[~after], paths["packed"][~after])
    # trim keeps the last seen column (row 3 ends on an observation), positions count observed tokens.
    sub = rollout.select([3]).trim()
    assert sub.response_ids.shape == (1, 5) and sub.response_lengths.tolist() == [3]
    assert sub.position_ids()[0, -5:].tolist() == [5, 6, 7, 8, 9]


@pytest.mark.unit
def test_the_observation_mask_is_checked():
    rollout = _masked_rollout()
    with pytest.raises(ValueError, match="observation_mask shape"):
        dataclasses.replace(rollout, observation_mask=rollout.observation_mask[:, :3])
    with pytest.raises(ValueError, match="observation_mask overlaps response_mask"):
        dataclasses.replace(rollout, observation_mask=rollout.observation_mask + rollout.response_mask)
    assert rollout.attention_mask()[:, 5:].bool().equal(rollout.seen_mask())


@pytest.mark.unit
def test_values_at_observed_positions_move_no_advantage_loss_or_kl():
    rollout = _masked_rollout()
    mask, observed = rollout.response_mask, rollout.observation_mask > 0
    g = torch.Generator().manual_seed(1)
    rand = lambda: torch.randn(mask.shape, generator=g, dtype=torch.float64)  # noqa: E731
    base = {"rewards": rand(), "values": rand(), "ref": rand() - 1, "logprobs": rand() - 1, "old": rand() - 1}

    def everything(t):
        out = {}
        for name, options in (
            ("gae", {"values": t["values"], "gamma": 0.9, "lam": 0.95}),
            ("gae", {"values": t["values"], "gamma": 1.0, "lam": 0.9, "critic_lam": 1.0}),
            ("gae", {"values": t["values"], "length_adaptive_alpha": 0.5}),
            ("grpo", {}),
            ("rloo", {}),
            ("reinforce", {"baseline": 0.5}),
        ):
            adv, ret = estimate_advantages(
                name, t["rewards"], mask, group_index=rollout.group_index, **options
            )
            out[f"{name}{sorted(options)}/adv"], out[f"{name}{sorted(options)}/returns"] = adv, ret
        advantages = out["gae['gamma', 'lam', 'values']/adv"]
        logprobs = t["logprobs"].clone().requires_grad_()
        for loss_name in ("ppo", "vanilla", "gspo", "cispo"):
            matrix, metrics = get_policy_loss(loss_name)(logprobs, t["old"], advantages, mask)
            for mode in AGGREGATION_MODES:
                loss = aggregate(matrix, mask, mode)
                (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
                out[f"{loss_name}/{mode}"], out[f"{loss_name}/{mode}/grad"] = loss.detach(), grad
            out.update({f"{loss_name}/{k}": v for k, v in metrics.items()})
        for kind in ("k1", "k2", "k3"):
            out[f"kl/{kind}"] = masked_mean(kl_estimate(t["logprobs"], t["ref"], kind), mask)
            out[f"kl_loss/{kind}"] = kl_loss(t["logprobs"], t["ref"], mask, kind=kind, old_logprobs=t["old"])
        scores = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
        out["kl_shaped"] = kl_shaped_rewards(scores, t["logprobs"], t["ref"], mask, beta=0.1)
        return out

    expected = everything(base)
    for name in base:  # one input at a time, then all at once
        for changed in ([name], list(base)):
            moved = {k: torch.where(observed, v + 123.0, v) if k in changed else v for k, v in base.items()}
            got = everything(moved)
            for key, value in expected.items():
                assert torch.equal(got[key], value), (changed, key)
