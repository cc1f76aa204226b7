"""benchmarks/_roofline.py: the FLOP and byte counts of a step's phases against hand-worked numbers,
and the table built from them."""

from __future__ import annotations

import importlib.util
import math
import os
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "_roofline.py")


@pytest.fixture(scope="module")
def rl():
    if "_roofline" not in sys.modules:  # gpu_check.py may have imported it already
        spec = importlib.util.spec_from_file_location("_roofline", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["_roofline"] = module  # the dataclass looks its module up by name
        spec.loader.exec_module(module)
    return sys.modules["_roofline"]


def dims(rl, tied=True):
    # 2 layers, 4 heads of 8 (d_attn 32), 2 KV heads; a 100-parameter embedding and lm_head
    n_params = 1000 if tied else 1100
    return rl.ModelDims(n_params, 100, 100, tied, layers=2, heads=4, kv_heads=2, head_dim=8)


def test_parameter_split(rl):
    # tied: 1000 counts the shared matrix once (as the embedding); body = 1000 - 100 = 900
    # untied: 1100 - 100 (embedding lookup) - 100 (head) = 900; N_matmul = 900 + 100 either way
    for tied in (True, False):
        d = dims(rl, tied)
        assert (d.n_body, d.n_head, d.n_matmul, d.d_attn) == (900, 100, 1000, 32)
        assert d.kv_values_per_token() == 64  # 2 (K, V) x 2 layers x 2 KV heads x 8


def test_attention_context(rl):
    # P = 3, R = 2: the prompt's positions attend to 1 + 2 + 3 = 6 keys, the response's to 4 + 5 = 9
    assert rl.attention_context(2, 3, 2) == 2 * 6 + 2 * 9 == 30
    assert rl.attention_context(2, 3, 2, prompt_rows=1) == 6 + 2 * 9 == 24  # one shared prompt


def test_forward_backward_decode_flops(rl):
    d = dims(rl)
    # 2 x 900 x (6 + 4) + 2 x 100 x 4 + 4 x 2 layers x 32 x 30 = 18000 + 800 + 7680
    assert rl.forward_flops(d, 6, 4, 30) == 26480
    assert rl.backward_flops(26480) == 52960
    assert rl.backward_flops(26480, recompute=26480 - 800) == 78640  # checkpointing: all but the head
    assert rl.decode_flops(d, 2, 6, 4, 30) == 26480


def test_bytes(rl):
    d = dims(rl)
    out = rl.decode_bytes(d, steps=2, rows=2, prompt_len=3, response_len=2, weight_bytes=4, kv_bytes=2)
    # weights: 1000 x 4 B x 2 steps; KV: each row's 2 generated tokens read 3 + 4 = 7 cached tokens,
    # 2 rows -> 14 tokens x 64 values x 2 B
    assert out["weights"] == 8000 and out["kv_tokens_read"] == 14 and out["kv"] == 1792
    assert out["total"] == 9792
    # AdamW: read p, g, m, v + write p, m, v = 28 B; clipping: read g (norm) + read and write g = 12 B
    assert rl.optimizer_bytes(1000) == 40000
    assert rl.optimizer_bytes(1000, clip=False) == 28000
    assert rl.optimizer_bytes(1000, state_bytes=2, clip=False) == 14000


def test_step_counts_and_table(rl):
    d = dims(rl)
    step = {
        "batch": 2,
        "prompt_tokens": 6,
        "distinct_prompt_tokens": 3,
        "response_tokens": 4,
        "response_len_padded": 2,
    }
    kw = {"weight_bytes": 4, "kv_bytes": 2, "n_trainable": 1000}
    c = rl.step_counts(
        d, step, passes=1, gradient_checkpointing=False, head_recompute=True, share_prompts=True, **kw
    )
    # shared prompt: 3 prompt tokens computed, context 24 ->
    # 2 x 900 x 7 + 2 x 100 x 4 + 4 x 2 x 32 x 24 = 12600 + 800 + 6144 = 19544
    assert c["forward"]["flops"] == 19544
    assert c["logprob_passes"]["flops"] == 19544
    assert c["backward"]["flops"] == 2 * 19544 + 800  # the fused head's logits recomputed
    assert c["generation"]["flops"] == 26480  # sampling runs every row's prompt
    assert c["generation"]["bytes"] == 9792 and c["optimizer"]["bytes"] == 40000
    c = rl.step_counts(
        d, step, passes=0, gradient_checkpointing=True, head_recompute=False, share_prompts=False, **kw
    )
    assert c["forward"]["flops"] == 26480 and c["logprob_passes"]["flops"] == 0
    assert c["backward"]["flops"] == 2 * 26480 + (26480 - 800)

    peaks = {"fp32_square_flops": 1e4, "fp32_model_flops": 5e3, "copy_bytes_per_s": 1e4}
    splits = {"generation": 1.0, "logprob_passes": 0.0, "forward": 2.0, "backward": 4.0, "optimizer": 8.0}
    table = rl.side_roofline([{"splits": splits}], [c], peaks, train_dtype="float32", decode_dtype="float32")
    assert table["forward"]["gflop_per_s"] * 1e9 == pytest.approx(26480 / 2)
    assert table["forward"]["frac_matmul_peak"] == pytest.approx(1.324)  # the better of the two peaks
    assert table["optimizer"]["frac_bandwidth_peak"] == pytest.approx(40000 / 8 / 1e4)
    assert math.isnan(table["logprob_passes"]["seconds"])  # a phase that did not run
    text = rl.roofline_markdown("t", {"side": table})
    assert "side: loss forward" in text and "log-prob" not in text
    assert "132 % (fp32)" in text


def test_step_floor(rl):
    # matmul peak 1e9 FLOP/s (the better of square and model-shaped), bandwidth 2e9 B/s (the
    # better of copy and read); seconds per phase at the roofline:
    #   generation: max(4 GFLOP / 1e9, 6 GB / 2e9) = max(4, 3) = 4, measured 10 -> 4
    #   forward:    2 GFLOP -> 2, measured 5 -> 2
    #   optimizer:  1 GB -> 0.5, measured 0.2 -> 0.2 (the count overstates its traffic)
    #   logprob_passes: no work counted -> 0
    # floor = 4 + 2 + 0.2 = 6.2
    peaks = {
        "fp32_square_flops": 1e9,
        "fp32_model_flops": 0.5e9,
        "copy_bytes_per_s": 1e9,
        "read_bytes_per_s": 2e9,
    }
    nan = math.nan
    phases = {
        "generation": {"seconds": 10.0, "gflop": 4.0, "gb": 6.0, "matmul_peak_dtype": "float32"},
        "logprob_passes": {"seconds": nan, "gflop": 0.0, "gb": nan, "matmul_peak_dtype": "float32"},
        "forward": {"seconds": 5.0, "gflop": 2.0, "gb": nan, "matmul_peak_dtype": "float32"},
        "optimizer": {"seconds": 0.2, "gflop": nan, "gb": 1.0, "matmul_peak_dtype": "float32"},
    }
    assert rl.step_floor(phases, peaks) == pytest.approx(6.2, abs=1e-12)
    # a phase run in bf16 is bounded by the bf16 peak: 2 GFLOP at 4e9 -> 0.5 instead of 2
    bf16 = {**phases, "forward": {**phases["forward"], "matmul_peak_dtype": "bfloat16"}}
    assert rl.step_floor(bf16, {**peaks, "bf16_square_flops": 4e9}) == pytest.approx(4.7, abs=1e-12)
    assert math.isnan(rl.step_floor(phases, None))
    assert math.isnan(rl.step_floor({"forward": {"seconds": 1.0, "gflop": 0.0}}, peaks))
