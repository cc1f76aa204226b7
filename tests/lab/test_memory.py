"""Tests of the memory planner: worked examples (ZeRO's 16 bytes per trainable parameter,
Rajbhandari et al. 2019, section 3.1; a bf16 logits tensor; PPO against SFT), LoRA counts checked
against peft, parameter counts from a config alone, and the CLI."""

from __future__ import annotations

import json

import pytest

from policygrad.cli import main
from policygrad.config.train import ALGORITHMS
from policygrad.lab.memory import (
    BYTES_FROZEN,
    BYTES_TRAINABLE,
    ModelShape,
    algorithm_models,
    build_parser,
    check_options,
    llama_linear_shapes,
    model_shape_from_config,
    parse_count,
    plan_memory,
    resolve_shape,
    run_memory,
)
from policygrad.models.loading import apply_lora, load_causal_lm

pytestmark = pytest.mark.integration


def seven_b(**kw):
    return resolve_shape(params=7e9, **kw)


def test_logits_tensor_is_268_gb():
    # 256 sequences x 4,096 tokens x 128,000 vocabulary x 2 bytes (bf16)
    # = 256 * 4096 = 1,048,576 tokens; x 128,000 = 134,217,728,000 values; x 2 = 268,435,456,000 B.
    plan = plan_memory(seven_b(vocab=128_000), "grpo", batch=256, seq_len=4096)
    logits = plan.item("logits B x T x V")
    assert logits.bytes == 268_435_456_000
    assert round(logits.bytes / 1e9, 1) == 268.4
    assert "268" in plan.table


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


def test_no_reference_drops_it():
    plan = plan_memory(seven_b(), "grpo", reference=False)
    assert [it.component for it in plan.items] == ["policy"]


def test_kv_cache_without_gqa_from_hidden():
    # --hidden 4096 --layers 32 and no KV heads: K and V are 4096 wide.
    shape = seven_b(hidden=4096, layers=32)
    assert shape.kv_cache_bytes(1, 1) == 2 * 32 * 4096 * 2


def test_lora_count_by_hand_for_llama_shapes():
    # hidden 4, 1 layer, MLP 8, no GQA: q, k, v, o are 4 -> 4 (r * 8 each), gate and up 4 -> 8
    # (r * 12 each), down 8 -> 4 (r * 12): 4 * 8r + 3 * 12r = 68r; r = 2 -> 136.
    shape = resolve_shape(params=1000, hidden=4, layers=1, intermediate=8)
    assert shape.lora_params(2) == 136
    assert shape.lora_params(2, ["q_proj", "v_proj"]) == 2 * 8 + 2 * 8
    assert len(llama_linear_shapes(4, 3, 8)) == 21


def test_lora_count_matches_peft_and_shape_from_config(tiny_lm_dir):
    model = load_causal_lm(tiny_lm_dir)
    shape = model_shape_from_config(tiny_lm_dir)
    # Tied embeddings counted once, as model.parameters() does.
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.vocab_size, shape.num_layers, shape.num_kv_heads, shape.head_dim) == (100, 2, 2, 8)
    # Per layer (hidden 32, KV width 2 x 8 = 16, MLP 64): q 64r, k 48r, v 48r, o 64r, gate 96r,
    # up 96r, down 96r = 512r; 2 layers -> 1024r; r = 4 -> 4096.
    assert shape.lora_params(4) == 4096
    peft_model = apply_lora(model, rank=4, alpha=8.0)
    assert sum(p.numel() for p in peft_model.parameters() if p.requires_grad) == 4096
    # B = 3, T = 5: 2 (K, V) x 2 layers x 2 heads x 8 x 3 x 5 = 960 values x 2 B = 1920 B.
    assert shape.kv_cache_bytes(3, 5) == 1920


def test_lora_plan_base_frozen_adapters_trainable_reference_shared(tiny_lm_dir):
    shape = model_shape_from_config(tiny_lm_dir)
    plan = plan_memory(shape, "ppo", lora_rank=4)
    assert plan.item("policy (base)").bytes == shape.params * 2
    assert plan.item("policy (LoRA adapters)").bytes == 4096 * 16
    assert plan.item("reference").bytes == 0
    assert plan.item("critic (LoRA adapters)").bytes == 4096 * 16
    assert plan.sft_state_bytes == shape.params * 2 + 4096 * 16


def test_parse_count():
    assert parse_count("7e9", "--params") == 7_000_000_000
    assert parse_count("7B", "--params") == 7_000_000_000
    assert parse_count("135M", "--params") == 135_000_000
    assert parse_count("128k", "--vocab") == 128_000
    with pytest.raises(ValueError, match="--params"):
        parse_count("seven", "--params")
    with pytest.raises(ValueError, match="positive"):
        parse_count("-1", "--params")


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


def test_run_memory_writes_json_and_png(tmp_path):
    plan = run_memory(seven_b(vocab=128_000), "ppo", output_dir=str(tmp_path), batch=256, seq_len=4096)
    with open(plan.json_path) as f:
        data = json.load(f)
    assert data["plan"]["state_bytes"] == 252_000_000_000
    assert [p["algorithm"] for p in data["compared"]] == ["sft", "grpo"]
    with open(plan.png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_cli_memory(tmp_path, capsys):
    argv = [
        "memory",
        "--params",
        "7e9",
        "--vocab",
        "128000",
        "--batch",
        "256",
        "--seq-len",
        "4096",
        "--algorithm",
        "ppo",
        "--output-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "268.4" in out  # the logits row
    assert "112.0" in out  # policy and critic rows
    assert "2.25x SFT" in out
    assert str(tmp_path / "memory.png") in out


def test_cli_memory_errors(capsys):
    assert main(["memory", "--params", "7e9", "--algorithm", "dpo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown algorithm 'dpo'; choose one of")
    assert main(["memory", "--model", "/no/such/folder"]) == 2
    assert "does not exist" in capsys.readouterr().err


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


def test_fsdp_with_lora_is_refused_as_train_refuses_it(capsys):
    # Before: priced, though train refuses the combination; both say it in the same words.
    from policygrad.errors import fsdp_lora_refusal

    argv = ["--params", "7e9", "--world-size", "2", "--strategy", "fsdp", "--lora-rank", "8"]
    assert main(["memory", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --strategy=fsdp shards full fine-tuning; a LoRA run (--lora-rank) trains a small adapter "
        "that every rank can hold: set --strategy ddp"
    ]
    shared = fsdp_lora_refusal(strategy="--strategy", lora="--lora-rank", ddp="--strategy ddp")
    assert err[0] == f"error: {shared}"
    # One process trains without a strategy (train ignores it there), so the bill is priced.
    check_options("grpo", lora_rank=8, world_size=1, strategy="fsdp")


@pytest.mark.parametrize("args", [["--world-size", "2.5"], ["--strategy", "zero"], ["--world-size", "0"]])
def test_bad_memory_arguments_are_one_error_line(args, capsys):
    assert main(["memory", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "--world-size" in err[0] or "--strategy" in err[0]
