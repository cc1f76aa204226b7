"""Observation tokens (tool output, environment text) are seen by the model but never learned
from: nothing placed at an observation position can change an advantage, a return, a loss, a KL
or a metric, and the loss sends no gradient to the logits there."""

from __future__ import annotations

import pytest
import torch

from policygrad.core.advantages import estimate_advantages
from policygrad.core.kl import get_kl_placement
from policygrad.core.losses import get_policy_loss
from policygrad.core.masking import AGGREGATION_MODES
from policygrad.learn.experience import Experience
from policygrad.learn.metrics import critic_metrics, mismatch_metrics
from policygrad.learn.objective import MinibatchCounts, PolicyObjective
from policygrad.models.forward import policy_logprobs
from policygrad.rollout.base import Rollout
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.unit

B, P, T, G = 4, 3, 12, 2


def episode_rollout(generator) -> Rollout:
    """Four rows of actions and observations interleaved (row 3 single-turn), ids at random."""
    action = torch.zeros(B, T)
    observed = torch.zeros(B, T)
    for row, turns in enumerate([[(0, 2), (5, 7), (9, 12)], [(0, 3), (6, 8)], [(0, 1), (4, 10)], [(0, 5)]]):
        for start, end in turns:
            action[row, start:end] = 1.0
        last = turns[-1][1]
        for (_, end), (start, _) in zip(turns, turns[1:]):
            observed[row, end:start] = 1.0
        action[row, last:] = 0.0
    sampler = torch.where(action > 0, -torch.rand(B, T, generator=generator), 0.0)
    return Rollout(
        prompt_ids=torch.randint(4, 90, (B, P), generator=generator),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        response_ids=torch.randint(4, 90, (B, T), generator=generator),
        response_mask=action,
        truncated=torch.zeros(B, dtype=torch.bool),
        sampler_logprobs=sampler,
        group_index=torch.arange(B // G).repeat_interleave(G),
        group_size=G,
        observation_mask=observed,
    )


def everything(rollout, inputs, *, estimator, placement, agg):
    """The trainer's path from rewards and log-probs to advantages, returns, loss and metrics
    (``Trainer.experience`` and ``PolicyObjective``), on fixed inputs."""
    mask = rollout.response_mask
    kl = get_kl_placement(placement)
    token_rewards = (
        kl.token_rewards(inputs["scores"], inputs["behaviour"], inputs["ref"], mask, beta=0.1, kind="k1")
        + inputs["turn_rewards"]
    )
    options = {"values": inputs["values"]} if estimator == "gae" else {}
    advantages, returns = estimate_advantages(
        estimator, token_rewards, mask, group_index=rollout.group_index, **options
    )
    exp = Experience(
        rows=torch.arange(B),
        rollout=rollout,
        loss_mask=mask,
        advantages=advantages,
        old_logprobs=inputs["behaviour"],
        ref_logprobs=inputs["ref"],
        values=inputs["values"],
        returns=returns,
        critic_mask=mask,
        behaviour_logprobs=inputs["behaviour"],
        kl_coef=0.1,
    )
    objective = PolicyObjective(
        get_policy_loss("ppo"), {}, agg_mode=agg, max_len=T, kl=kl, kl_kind="k3", is_level="token"
    )
    logprobs = inputs["logprobs"].clone().requires_grad_(True)
    loss, metrics, _ = objective(
        logprobs, inputs["entropy"], inputs["behaviour"], exp, MinibatchCounts.of(mask)
    )
    loss.backward()
    out = {
        "advantages": advantages * mask,
        "returns": returns * mask,
        "loss": loss.detach(),
        "grad": logprobs.grad,
        "lengths": rollout.response_lengths,
        **{k: torch.as_tensor(v) for k, v in metrics.items()},
        **{k: torch.tensor(v) for k, v in mismatch_metrics(inputs["behaviour"], None, rollout, mask).items()},
        **{
            k: torch.tensor(v)
            for k, v in critic_metrics(inputs["values"], returns, mask, mask, pretraining=False).items()
        },
    }
    return out


def inputs_of(rollout, generator) -> dict[str, torch.Tensor]:
    mask = rollout.response_mask > 0
    noisy = lambda: -torch.rand(B, T, generator=generator)  # noqa: E731
    return {
        "scores": torch.rand(B, generator=generator),
        "turn_rewards": torch.where(mask, torch.rand(B, T, generator=generator), 0.0)
        * (torch.rand(B, T, generator=generator) > 0.7),
        "values": torch.rand(B, T, generator=generator),
        "ref": noisy(),
        "behaviour": rollout.sampler_logprobs.clone(),
        "logprobs": noisy(),
        "entropy": torch.rand(B, T, generator=generator),
    }


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce", "reinforce_pp", "gae"])
@pytest.mark.parametrize("placement", ["reward", "loss"])
def test_nothing_at_an_observation_position_changes_a_result(estimator, placement):
    generator = torch.Generator().manual_seed(0)
    rollout = episode_rollout(generator)
    inputs = inputs_of(rollout, generator)
    observed = rollout.observation_mask > 0
    before = everything(rollout, inputs, estimator=estimator, placement=placement, agg="token-mean")
    perturbed = dict(inputs)
    for name in ("turn_rewards", "values", "ref", "behaviour", "logprobs", "entropy"):
        perturbed[name] = torch.where(observed, inputs[name] + 7.25, inputs[name])
    after = everything(rollout, perturbed, estimator=estimator, placement=placement, agg="token-mean")
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert not before["grad"][observed].any()  # d loss / d logprob is exactly 0 there
    assert before["grad"][rollout.response_mask > 0].abs().sum() > 0


def test_the_loss_sends_no_gradient_to_the_logits_of_observations():
    torch.manual_seed(0)
    model, _ = make_tiny_llama()
    generator = torch.Generator().manual_seed(1)
    rollout = episode_rollout(generator)
    captured = {}
    head = model.get_output_embeddings()

    def keep(_module, _inputs, out):
        captured["logits"] = out
        out.retain_grad()

    handle = head.register_forward_hook(keep)  # the logits materialised: no fused head
    try:
        logprobs, _ = policy_logprobs(model, rollout, fused_head=False)
    finally:
        handle.remove()
    mask = rollout.response_mask
    loss = -(logprobs * mask).sum() / mask.sum()
    loss.backward()
    grad = captured["logits"].grad  # the logits predicting each response position: [B, T, V]
    assert grad.shape[:2] == (B, T)
    predicting = grad.abs().sum(-1)
    observed = rollout.observation_mask > 0
    assert predicting[observed].abs().max() == 0.0
    assert predicting[mask > 0].abs().sum() > 0


@pytest.mark.parametrize("agg", AGGREGATION_MODES)
def test_ten_actions_among_fifty_observed_tokens_weigh_as_a_ten_token_answer(agg):
    # One episode row: 10 action tokens at positions 0-1, 12-15, 40-42 and 59, observations in
    # between; one single-turn row of the same 10 tokens. Per-token inputs agree at the actions,
    # so the loss (every aggregation, max_len 60 for both) and the length metric agree.
    generator = torch.Generator().manual_seed(3)
    positions = [0, 1, 12, 13, 14, 15, 40, 41, 42, 59]
    values = {name: -torch.rand(10, generator=generator) for name in ("logprobs", "old", "ref")}
    advantage = torch.randn(10, generator=generator)

    def row(width, where):
        out = {name: torch.full((1, width), -3.0) for name in values}
        adv = torch.full((1, width), 5.0)
        for name in values:
            out[name][0, where] = values[name]
        adv[0, where] = advantage
        return out, adv

    def loss_of(width, where, observed):
        tensors, adv = row(width, where)
        mask = torch.zeros(1, width)
        mask[0, where] = 1.0
        rollout = Rollout(
            prompt_ids=torch.ones(1, 2, dtype=torch.long),
            prompt_mask=torch.ones(1, 2, dtype=torch.long),
            response_ids=torch.full((1, width), 5),
            response_mask=mask,
            truncated=torch.zeros(1, dtype=torch.bool),
            sampler_logprobs=tensors["old"] * mask,
            group_index=torch.zeros(1, dtype=torch.long),
            observation_mask=observed,
        )
        exp = Experience(
            rows=torch.arange(1),
            rollout=rollout,
            loss_mask=mask,
            advantages=adv,
            ref_logprobs=tensors["ref"],
            kl_coef=0.05,
        )
        objective = PolicyObjective(
            get_policy_loss("ppo"), {}, agg_mode=agg, max_len=60, kl=get_kl_placement("loss"), kl_kind="k3"
        )
        lp = tensors["logprobs"] + 0.0
        loss, _, _ = objective(lp, torch.zeros(1, width), tensors["old"], exp, MinibatchCounts.of(mask))
        return loss, rollout.response_lengths

    observed = torch.ones(1, 60)
    observed[0, positions] = 0.0
    episode_loss, episode_length = loss_of(60, positions, observed)
    single_loss, single_length = loss_of(10, list(range(10)), None)
    assert episode_length.tolist() == single_length.tolist() == [10]
    torch.testing.assert_close(episode_loss, single_loss, rtol=0, atol=1e-7)
