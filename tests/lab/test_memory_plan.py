"""The bill of one configuration: worked examples (a bf16 logits tensor, PPO against SFT, the KV
cache), every trainer algorithm with its models, ``--algorithm vineppo``'s value rollouts'
sequences, tokens and KV cache, and bad options named."""

from __future__ import annotations

import pytest

from policygrad.config.train import ALGORITHMS
from policygrad.lab.memory import build_parser, resolve_shape
from policygrad.lab.memory_plan import algorithm_models, plan_memory
from policygrad.parallel.footprint import ModelShape

SHAPE = ModelShape(params=1000, vocab_size=10, num_layers=2, num_kv_heads=1, head_dim=4)


def seven_b(**kw):
    return resolve_shape(params=7e9, **kw)


@pytest.mark.unit
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


@pytest.mark.unit
def test_bad_vine_options_name_the_flag():
    with pytest.raises(ValueError, match="--vine-rollouts must be an int >= 1, got 0"):
        plan_memory(SHAPE, "vineppo", batch=4, seq_len=10, vine_rollouts=0)


@pytest.mark.integration
def test_logits_tensor_is_268_gb():
    # 256 sequences x 4,096 tokens x 128,000 vocabulary x 2 bytes (bf16)
    # = 256 * 4096 = 1,048,576 tokens; x 128,000 = 134,217,728,000 values; x 2 = 268,435,456,000 B.
    plan = plan_memory(seven_b(vocab=128_000), "grpo", batch=256, seq_len=4096)
    logits = plan.item("logits B x T x V")
    assert logits.bytes == 268_435_456_000
    assert round(logits.bytes / 1e9, 1) == 268.4
    assert "268" in plan.table


@pytest.mark.integration
def test_ppo_needs_more_than_twice_sft():
    sft = plan_memory(seven_b(), "sft")
    assert [it.component for it in sft.items] == ["policy"]
    assert sft.state_bytes == 112_000_000_000
    ppo = plan_memory(seven_b(), "ppo")
    # policy 112 + critic 112 + reference 28 = 252 GB = 2.25 x SFT
    assert ppo.item("critic").bytes == 112_000_000_000
    assert ppo.state_bytes == 252_000_000_000
    assert ppo.ratio_to_sft == pytest.approx(2.25, abs=1e-12)
    assert ppo.state_bytes > 2 * sft.state_bytes
    # Without the reference exactly twice: the critic alone doubles the trainable footprint.
    assert plan_memory(seven_b(), "ppo", reference=False).state_bytes == 2 * sft.state_bytes


@pytest.mark.integration
def test_every_trainer_algorithm_has_a_bill_with_its_critic():
    # The planner's table is the trainer's registry plus sft: an algorithm added to ALGORITHMS
    # gets a bill, and one the trainer does not know is refused.
    table = algorithm_models()
    assert set(table) == set(ALGORITHMS) | {"sft"}
    assert not table["sft"].critic and not table["sft"].reference
    help_text = build_parser().format_help()
    for name, preset in ALGORITHMS.items():
        assert table[name].critic == preset.critic, name
        assert table[name].reference, name
        components = [it.component for it in plan_memory(seven_b(), name).items]
        assert ("critic" in components) == preset.critic, name
        assert "reference" in components, name
        assert name in help_text, name
    assert table["ppo"].critic and not table["grpo"].critic


@pytest.mark.integration
def test_reward_model_only_when_asked_and_inference_engine_with_kv_cache():
    verifier = plan_memory(seven_b(), "grpo")
    assert all(it.component != "reward model" for it in verifier.items)
    # A 7B model with 32 layers, 8 KV heads of width 128 (a Llama-3-8B-like shape):
    # KV cache = 2 x 32 x 8 x 128 x B 16 x T 1024 x 2 B = 2,147,483,648 B.
    shape = seven_b(layers=32, kv_heads=8, head_dim=128, vocab=128_000)
    plan = plan_memory(shape, "grpo", reward_model=True, inference_engine=True, batch=16, seq_len=1024)
    assert plan.item("reward model").bytes == 14_000_000_000
    assert plan.item("inference engine").bytes == 14_000_000_000
    assert plan.item("KV cache").bytes == 2 * 32 * 8 * 128 * 16 * 1024 * 2 == 2_147_483_648
    # state: policy 112 + reference 28 + reward model 14 + engine 14 = 168 GB
    assert plan.state_bytes == 168_000_000_000
    assert plan.total_bytes == plan.state_bytes + 2_147_483_648 + 16 * 1024 * 128_000 * 2


@pytest.mark.integration
def test_bad_inputs_name_the_option():
    with pytest.raises(ValueError, match="unknown algorithm 'ppo2'; choose one of .*grpo.*ppo"):
        plan_memory(seven_b(), "ppo2")
    with pytest.raises(ValueError, match="--batch and --seq-len together"):
        plan_memory(seven_b(), "grpo", batch=4)
    with pytest.raises(ValueError, match="LoRA needs the shapes"):
        plan_memory(seven_b(), "grpo", lora_rank=8)
    with pytest.raises(ValueError, match="KV cache needs"):
        plan_memory(seven_b(), "grpo", inference_engine=True, batch=2, seq_len=8)
    with pytest.raises(ValueError, match="match no linear layer"):
        resolve_shape(params=10, hidden=4, layers=1, intermediate=8).lora_params(2, ["w_q"])


@pytest.mark.unit
def test_rollout_servers_are_priced_apart_from_the_trainer_by_hand():
    plan = plan_memory(SHAPE, "grpo", batch=5, seq_len=10, servers=2)
    # each server: weights 1000 params x 2 B = 2000 B; KV of its share ceil(5 / 2) = 3 sequences:
    # 2 (K, V) x 2 layers x kv width 1 x 4 x B 3 x T 10 x 2 B = 960 B
    assert [(it.component, it.bytes) for it in plan.server_items] == [
        ("server weights", 2000),
        ("server KV cache", 960),
    ]
    # the trainer's own bill does not change: the servers are other processes
    alone = plan_memory(SHAPE, "grpo", batch=5, seq_len=10)
    assert plan.total_bytes == alone.total_bytes and plan.items == alone.items
    assert "rollout servers, apart from the trainer: 2 x " in plan.table
    assert plan.to_dict()["servers"] == 2
    assert plan_memory(SHAPE, "grpo", servers=1).server_items[0].bytes == 2000  # no batch: no KV
    with pytest.raises(ValueError, match="--servers must be an int >= 0"):
        plan_memory(SHAPE, "grpo", servers=-1)
    with pytest.raises(ValueError, match="drop --inference-engine, --servers"):
        plan_memory(SHAPE, "sft", servers=1)
