"""``policygrad memory --algorithm vineppo``: the value rollouts' sequences, tokens and KV cache."""

from __future__ import annotations

import pytest

from policygrad.lab.memory import ModelShape, algorithm_models, plan_memory

pytestmark = pytest.mark.unit

SHAPE = ModelShape(params=1000, vocab_size=10, num_layers=2, num_kv_heads=1, head_dim=4)


def test_vineppo_prices_its_value_rollouts_by_hand():
    assert algorithm_models()["vineppo"].value_rollouts
    assert not any(m.value_rollouts for name, m in algorithm_models().items() if name != "vineppo")
    plan = plan_memory(
        SHAPE, "vineppo", batch=4, seq_len=10, inference_engine=True, vine_rollouts=3, vine_splits=2
    )
    # B 4 x (S 2 + 1) x K 3 = 36 sequences of at most T = 10 tokens: 360 tokens. They are sampled
    # at most B = 4 at a time after the batch, so they add no memory: the same items as GRPO's.
    assert plan.value_rollout_sequences == 36 and plan.value_rollout_tokens == 360
    assert "VinePPO value rollouts per step: up to 36 sequences, 360 tokens" in plan.table
    assert plan.to_dict()["value_rollout_sequences"] == 36
    grpo = plan_memory(SHAPE, "grpo", batch=4, seq_len=10, inference_engine=True)
    assert [(it.component, it.bytes) for it in plan.items] == [(it.component, it.bytes) for it in grpo.items]
    assert grpo.value_rollout_sequences == 0 and "value_rollout_sequences" not in grpo.to_dict()
    assert "VinePPO" not in grpo.table


def test_bad_vine_options_name_the_flag():
    with pytest.raises(ValueError, match="--vine-rollouts must be an int >= 1, got 0"):
        plan_memory(SHAPE, "vineppo", batch=4, seq_len=10, vine_rollouts=0)
