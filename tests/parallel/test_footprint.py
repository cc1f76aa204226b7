"""What a model costs in memory from its shape: the activation estimate and the ``auto`` rule of
gradient checkpointing (the formula by hand, against autograd's saved tensors on a tiny Llama, and
the resolver's cases), LoRA counts by hand and against peft, and a shape read from a config alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from policygrad.lab.memory import resolve_shape
from policygrad.models.loading import apply_lora, load_causal_lm
from policygrad.models.swiglu import use_memory_efficient_mlp
from policygrad.parallel.footprint import (
    ModelShape,
    activation_bytes_per_token,
    llama_linear_shapes,
    logits_bytes_per_token,
    model_shape_from_config,
    resolve_gradient_checkpointing,
)
from tests.tiny import make_tiny_llama

SMOLLM = ModelShape(
    params=134_515_008, vocab_size=49152, num_layers=30, hidden_size=576, intermediate_size=1536, num_heads=9
)


@pytest.mark.unit
def test_smollm2_per_token_bytes_by_hand():
    # fp32 (r = c = 4, one q/k/v input): per layer 3*576*4 + 2*4 + 576*4 + 3*576*4 + 576*4 + 9*4
    # + 110*4 + 2*1536*4 = 6912 + 8 + 2304 + 6912 + 2304 + 36 + 440 + 12288 = 31204;
    # 30 layers + final norm (576*4 + 4 = 2308) = 938428 (measured: 938564 with rotary tables and ids)
    assert activation_bytes_per_token(SMOLLM, seq_len=110) == 938_428
    # bf16-mixed (r 4, c 2, three autocast copies of the q/k/v input): 6912 + 8 + 3456 + 3456 + 1152
    # + 36 + 220 + 6144 = 21384 per layer; 30 * 21384 + 2308 = 643828 (measured 643964 w/o weights)
    assert activation_bytes_per_token(SMOLLM, precision="bf16-mixed", seq_len=110) == 643_828
    # checkpointing: 30 layer inputs 576*4 = 69120, one recomputed layer 31204, final norm 2308
    assert activation_bytes_per_token(SMOLLM, seq_len=110, checkpointing=True) == 69120 + 31204 + 2308
    assert logits_bytes_per_token(SMOLLM) == 49152 * 4


@pytest.mark.unit
def test_unknown_sizes_or_precision_are_refused():
    with pytest.raises(ValueError, match="--intermediate"):
        activation_bytes_per_token(ModelShape(params=1, hidden_size=8, num_layers=2))
    with pytest.raises(ValueError, match="precision 'fp8'"):
        activation_bytes_per_token(SMOLLM, precision="fp8")


def _saved_bytes(model, ids, mask) -> int:
    """Bytes of the unique storages autograd saves in the decoder's forward (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # the forward only
        model.model(input_ids=ids, attention_mask=mask)
    return sum(seen.values())


@pytest.mark.unit
@pytest.mark.parametrize("checkpointing", [False, True])
def test_estimate_matches_the_saved_tensors_of_a_tiny_llama(checkpointing):
    model, _ = make_tiny_llama(
        hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    model.config.use_cache = False
    use_memory_efficient_mlp(model)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    B, T = 4, 40
    ids = torch.randint(4, 90, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :10] = 0  # left padding, as the trainer's batches: SDPA gets a mask
    measured = _saved_bytes(model, ids, mask)
    shape = ModelShape(
        params=1, vocab_size=100, num_layers=3, hidden_size=64, intermediate_size=128, num_heads=4
    )
    per_token = activation_bytes_per_token(shape, seq_len=T, checkpointing=checkpointing)
    if checkpointing:  # the forward saves the layer inputs; one layer's saves come back in the backward
        final_norm = 64 * 4 + 4
        per_token -= (activation_bytes_per_token(shape, seq_len=T) - final_norm) // 3
    estimate = per_token * B * T
    assert abs(estimate - measured) / measured < 0.15, (estimate, measured)


@pytest.mark.unit
def test_explicit_settings_pass_through():
    for setting in (True, False):
        choice = resolve_gradient_checkpointing(
            setting,
            state_bytes=10**12,
            activation_bytes_per_token=1,
            logits_bytes_per_token=1,
            tokens=1,
            available_bytes=1,
        )
        assert choice.enabled is setting and choice.needed_bytes is None


@pytest.mark.unit
def test_auto_turns_on_only_over_the_available_memory_less_the_margin():
    common = dict(state_bytes=2_000, activation_bytes_per_token=900, logits_bytes_per_token=100)
    # 2000 + 8 tokens * (900 + 100) = 10000 needed; 11000 available * 0.9 = 9900: over, on
    on = resolve_gradient_checkpointing("auto", tokens=8, available_bytes=11_000, **common)
    assert on.enabled and on.needed_bytes == 10_000 and on.limit_bytes == 9_900
    # 12000 * 0.9 = 10800 >= 10000: fits, off
    off = resolve_gradient_checkpointing("auto", tokens=8, available_bytes=12_000, **common)
    assert not off.enabled and "within" in off.why
    # exactly at the limit (10000 = 0.9 * 11112 rounded down to 10000): fits
    edge = resolve_gradient_checkpointing("auto", tokens=8, available_bytes=11_112, **common)
    assert not edge.enabled and edge.limit_bytes == 10_000


@pytest.mark.unit
def test_bad_setting_or_count_is_refused():
    kw = dict(
        state_bytes=0, activation_bytes_per_token=1, logits_bytes_per_token=1, tokens=1, available_bytes=1
    )
    with pytest.raises(ValueError, match="choose true, false or auto"):
        resolve_gradient_checkpointing("sometimes", **kw)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        resolve_gradient_checkpointing("auto", **{**kw, "tokens": -1})


@pytest.mark.integration
def test_lora_count_by_hand_for_llama_shapes():
    # hidden 4, 1 layer, MLP 8, no GQA: q, k, v, o are 4 -> 4 (r * 8 each), gate and up 4 -> 8
    # (r * 12 each), down 8 -> 4 (r * 12): 4 * 8r + 3 * 12r = 68r; r = 2 -> 136.
    shape = resolve_shape(params=1000, hidden=4, layers=1, intermediate=8)
    assert shape.lora_params(2) == 136
    assert shape.lora_params(2, ["q_proj", "v_proj"]) == 2 * 8 + 2 * 8
    assert len(llama_linear_shapes(4, 3, 8)) == 21


@pytest.mark.integration
def test_lora_count_matches_peft_and_shape_from_config(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    shape = model_shape_from_config(tiny_model_dir)
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


@pytest.mark.unit
def test_the_planner_imports_without_torch():
    # ``policygrad memory`` prices a model from its config alone: the footprint and the bill load
    # torch only where a config is read (checked in a fresh interpreter).
    code = (
        "import sys, policygrad.parallel.footprint, policygrad.lab.memory; "
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
