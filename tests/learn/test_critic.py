"""The critic's trainer: hand-worked value clipping, and a critic fitted on a fixed batch explains
its returns (explained variance from 0 to > 0.9)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from policygrad.core.diagnostics import explained_variance
from policygrad.learn.critic import CriticTrainer
from policygrad.learn.experience import Experience
from policygrad.models.value import ValueModel, load_value_model
from tests.models.test_value import make_rollout
from tests.tiny import BOS_ID

pytestmark = pytest.mark.integration


class TokenTable(torch.nn.Module):
    """A stand-in transformer: the hidden state at a column is a learnable scalar per token id, so
    V(s_t) = w * table[token at column P - 1 + t] + b is set by hand."""

    def __init__(self, table: dict[int, float]):
        super().__init__()
        weights = torch.zeros(100, 1)
        for token, value in table.items():
            weights[token, 0] = value
        self.embed = torch.nn.Embedding.from_pretrained(weights, freeze=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):  # noqa: ARG002 (the model's forward signature: passed by keyword)
        return SimpleNamespace(last_hidden_state=self.embed(input_ids))


def _table_critic():
    head = torch.nn.Linear(1, 1)
    with torch.no_grad():
        head.weight.fill_(1.0)
        head.bias.zero_()
    # prompt [10], response [11, 12]: V(s_0) = table[10] = 1.0, V(s_1) = table[11] = 1.0
    return ValueModel(TokenTable({10: 1.0, 11: 1.0}), head)


def _experience(rollout, values, returns, mask) -> Experience:
    """The critic's view of a batch: rollout-time values, targets, and the tokens that train it."""
    zeros = torch.zeros_like(mask)
    return Experience(
        torch.arange(rollout.batch_size),
        rollout,
        mask,
        zeros,
        values=values,
        returns=returns,
        critic_mask=mask,
    )


@pytest.mark.parametrize("clip_range", [0.2, None])
def test_value_clipping_hand_worked(clip_range):
    critic = _table_critic()
    trainer = CriticTrainer(critic, lr=1e-3, clip_range=clip_range, max_grad_norm=1e9)
    grads = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.update({n: p.grad.clone() for n, p in critic.named_parameters()})
    )
    rollout = make_rollout([[10]], [[11, 12]])
    old_values = torch.tensor([[0.5, 0.9]])
    returns = torch.tensor([[2.0, 0.0]])
    out = trainer.fit(_experience(rollout, old_values, returns, rollout.response_mask))
    if clip_range is not None:
        # token 0: V = 1, V_old = 0.5, G = 2. (V - G)^2 = 1; V_clip = 0.5 + 0.2 = 0.7,
        #   (V_clip - G)^2 = 1.69 > 1: clipped, loss 0.5 * 1.69 = 0.845, and no gradient
        #   (V is outside V_old +- 0.2, so V_clip does not move with it).
        # token 1: V = 1, V_old = 0.9, G = 0. V_clip = 1.0 = V: not clipped, loss 0.5 * 1 = 0.5,
        #   gradient (V - G) / 2 tokens = 0.5.
        # token-mean: (0.845 + 0.5) / 2 = 0.6725; vf_clipfrac = 1 / 2.
        assert out["vf_loss"] == pytest.approx(0.6725, abs=1e-6)
        assert out["vf_clipfrac"] == 0.5
        expected_table = {10: 0.0, 11: 0.5}
        expected_bias = 0.5
    else:
        # (0.5 * 1 + 0.5 * 1) / 2 = 0.5; gradients (1 - 2) / 2 = -0.5 and (1 - 0) / 2 = 0.5.
        assert out["vf_loss"] == pytest.approx(0.5, abs=1e-6)
        assert out["vf_clipfrac"] == 0.0
        expected_table = {10: -0.5, 11: 0.5}
        expected_bias = 0.0
    table_grad = grads["backbone.embed.weight"][:, 0]
    for token, value in expected_table.items():
        assert float(table_grad[token]) == pytest.approx(value, abs=1e-6)
    assert float(grads["head.bias"]) == pytest.approx(expected_bias, abs=1e-6)


def test_fitting_the_critic_on_a_fixed_batch_explains_the_returns(tiny_model_dir):
    # 8 rows with distinct prompts; the return of every token of row i is R_i (a terminal reward,
    # gamma = lam = 1). A zero-head critic explains none of it (EV = 0 exactly); fitted, > 0.9.
    prompts = [[BOS_ID, 10 + i, 30 + 2 * i, 60 - i] for i in range(8)]
    responses = [[70 + i, 71, 72, 73] for i in range(8)]
    rollout = make_rollout(prompts, responses, lengths=[4, 3, 4, 2, 4, 4, 1, 3])
    R = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 1.0, -1.0, 0.25])
    mask = rollout.response_mask
    returns = R[:, None] * mask
    critic = load_value_model("policy", policy_path=tiny_model_dir)
    trainer = CriticTrainer(critic, lr=1e-2, micro_batch_size=4)
    before = trainer.values(rollout)
    assert float(explained_variance(before, returns, mask)) == 0.0
    batch = _experience(rollout, before, returns, mask)
    for _ in range(150):
        out = trainer.fit(batch)
        assert out["skipped"] == 0.0
    after = trainer.values(rollout)
    assert float(explained_variance(after, returns, mask)) > 0.9


# ----------------------------------------------------------------------------- reward normalisation
