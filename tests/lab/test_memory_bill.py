"""The lines of the memory bill: 16 bytes per trainable parameter and 2 per frozen one (ZeRO,
Rajbhandari et al. 2019, section 3.1), a float32 reference or the LoRA base shared, and one FSDP
rank's share of each sharded model."""

from __future__ import annotations

import pytest

from policygrad.lab.memory import resolve_shape
from policygrad.lab.memory_bill import BYTES_FROZEN, BYTES_TRAINABLE
from policygrad.lab.memory_plan import plan_memory
from policygrad.parallel.footprint import ModelShape, model_shape_from_config

pytestmark = pytest.mark.integration


def seven_b(**kw):
    return resolve_shape(params=7e9, **kw)


def test_sixteen_and_two_bytes_per_parameter():
    # fp32 weights 4 + fp32 grads 4 + Adam m 4 + Adam v 4 = 16; frozen bf16 = 2; the reference
    # float32 (4), like the master weights it must compute as.
    assert BYTES_TRAINABLE == 2 + 2 + 4 + 4 + 4 == 16
    assert BYTES_FROZEN == 2
    plan = plan_memory(seven_b(), "grpo")
    assert plan.item("policy").bytes == 112_000_000_000  # 7e9 x 16
    assert plan.item("policy").state == "trainable"
    assert plan.item("reference").bytes == 28_000_000_000  # 7e9 x 4
    assert plan.item("reference").state == "frozen"
    assert plan.state_bytes == 140_000_000_000
    assert plan.sft_state_bytes == 112_000_000_000


def test_no_reference_drops_it():
    plan = plan_memory(seven_b(), "grpo", reference=False)
    assert [it.component for it in plan.items] == ["policy"]


def test_lora_plan_base_frozen_adapters_trainable_reference_shared(tiny_lm_dir):
    shape = model_shape_from_config(tiny_lm_dir)
    plan = plan_memory(shape, "ppo", lora_rank=4)
    assert plan.item("policy (base)").bytes == shape.params * 2
    assert plan.item("policy (LoRA adapters)").bytes == 4096 * 16
    assert plan.item("reference").bytes == 0
    assert plan.item("critic (LoRA adapters)").bytes == 4096 * 16
    assert plan.sft_state_bytes == shape.params * 2 + 4096 * 16


def test_fsdp_prices_one_rank_of_the_sharded_models():
    # Two parameters of shapes [3, 2] and [4] (10 elements) over 2 ranks: fully_shard splits the
    # first dimension padded to a multiple of 2, so a rank holds ceil(3/2) * 2 + ceil(4/2) * 1 =
    # 4 + 2 = 6 elements: policy 6 x 16 B = 96, reference 6 x 4 B = 24. vLLM's copy stays whole
    # (10 x 2 B = 20); the KV cache and logits are of B/N = 3 of the 5 sequences (ceil):
    # 2 x 1 layer x 1 x 1 x 3 x 4 x 2 B = 48 and 3 x 4 x 8 x 2 B.
    rows = [(3, 6), (4, 4)]
    shape = ModelShape(params=10, vocab_size=8, num_layers=1, num_kv_heads=1, head_dim=1, param_rows=rows)
    plan = plan_memory(
        shape, "grpo", world_size=2, strategy="fsdp", inference_engine=True, batch=5, seq_len=4
    )
    assert plan.item("policy").bytes == 96
    assert plan.item("reference").bytes == 24
    assert plan.item("inference engine").bytes == 20
    assert plan.item("logits B x T x V").bytes == 3 * 4 * 8 * 2
    assert plan.item("KV cache").bytes == 48
    assert plan.item("unsharded copy").bytes == 0  # with vLLM it lives in CPU memory
    assert plan.state_bytes == 96 + 24 + 20
    # Without a vLLM engine the hf engine samples from the unsharded float32 copy: 10 x 4 B.
    hf = plan_memory(shape, "grpo", world_size=2, strategy="fsdp")
    assert hf.item("unsharded copy").bytes == 40 and hf.state_bytes == 96 + 24 + 40
    ddp = plan_memory(shape, "grpo", world_size=2, strategy="ddp")
    assert ddp.item("policy").bytes == 160 and ddp.item("reference").bytes == 40  # whole on every rank
    with pytest.raises(ValueError, match="--strategy must be ddp or fsdp"):
        plan_memory(shape, "grpo", world_size=2, strategy="zero")
    with pytest.raises(ValueError, match="--world-size must be an int >= 1"):
        plan_memory(shape, "grpo", world_size=0)
