"""Tests of the mismatch meter: a tiny model whose bf16 forward disagrees with its fp32 forward far
more than the KV-cache decode does, the gap per precision, and the CLI (the statistics by hand:
test_mismatch_stats.py)."""

from __future__ import annotations

import json

import pytest
import torch

from policygrad.cli import main
from policygrad.lab.mismatch import parse_precisions, run_mismatch

pytestmark = pytest.mark.integration


def test_tiny_model_bf16_mismatch_exceeds_kv_cache_mismatch(tiny_lm, tmp_path):
    model, tokenizer = tiny_lm
    result = run_mismatch(
        model,
        tokenizer,
        ["Tell me a story.", "Count to ten."],
        samples_per_prompt=3,
        max_new_tokens=12,
        seed=0,
        output_dir=str(tmp_path),
    )
    kv = result.pairs["sampler vs recompute"]
    bf16 = result.pairs["bf16 vs fp32"]
    assert kv.n_tokens == bf16.n_tokens > 6
    # fp32 incremental decode vs full forward: rounding-level differences only.
    assert kv.abs_max < 1e-4
    assert bf16.abs_mean > 10 * kv.abs_mean
    for p in (kv, bf16):
        assert len(p.lengths) == len(p.cum_std) == len(p.sigma_sqrt_t) == len(p.seq_weight_std_t_truncated)
        assert 0.0 <= p.token_trunc_frac <= 1.0 and 0.0 <= p.seq_trunc_frac <= 1.0
        assert p.seq_weight_std_truncated <= p.seq_weight_std + 1e-12
    data = json.loads(open(result.json_path).read())
    assert set(data["pairs"]) == {"sampler vs recompute", "bf16 vs fp32"}
    assert open(result.png_path, "rb").read(4) == b"\x89PNG"
    assert next(model.parameters()).dtype == torch.float32


def test_bad_inputs(tiny_lm, capsys):
    model, tokenizer = tiny_lm
    with pytest.raises(ValueError, match="unknown sampler dtype 'fp8'; valid: float32, bfloat16"):
        run_mismatch(model, tokenizer, ["Hi"], sampler_dtype="fp8", output_dir=None)
    with pytest.raises(ValueError, match="cap must be a finite number > 0"):
        run_mismatch(model, tokenizer, ["Hi"], cap=0.0, output_dir=None)
    assert main(["lab", "mismatch", "--prompts", "9"]) == 2
    assert "error: --prompts must be in 1..4" in capsys.readouterr().err


def test_parse_precisions_keeps_order_and_refuses_unknown_names():
    assert parse_precisions("fp32, bf16-mixed,bf16-mixed+fp32-head,fp16-mixed,fp32,") == [
        "fp32",
        "bf16-mixed",
        "bf16-mixed+fp32-head",
        "fp16-mixed",
    ]
    assert parse_precisions("") == [] and parse_precisions(["fp16-mixed+fp32-head"]) == [
        "fp16-mixed+fp32-head"
    ]
    with pytest.raises(ValueError, match="--precisions: 'fp16' is not valid"):
        parse_precisions("fp32,fp16")
    with pytest.raises(ValueError, match="--precisions: 'fp32\\+fp32-head' is not valid"):
        parse_precisions("fp32+fp32-head")  # no autocast: the head already is float32


def test_gap_per_precision_orders_bf16_above_fp32_head_above_fp16(tiny_lm, tmp_path, monkeypatch):
    """Each precision samples and recomputes in itself. fp32's recompute is the float32 forward
    itself (delta exactly 0); bf16 keeps 8 significant bits, fp16 11 (unit roundoff 2**-8 against
    2**-11 with rounding to nearest: 8x finer), so fp16-mixed's distance from fp32 is well below
    bf16-mixed's (measured 3.5e-5 against 2.7e-4 mean |delta|; asserted: below half); the
    float32 head removes the head's bf16 rounding and leaves the body's (measured 1.1e-4)."""
    import policygrad.lab.mismatch as mismatch

    model, tokenizer = tiny_lm
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = run_mismatch(
        model,
        tokenizer,
        ["Tell me a story.", "Count to ten."],
        samples_per_prompt=3,
        max_new_tokens=12,
        seed=0,
        precisions="fp32,bf16-mixed,bf16-mixed+fp32-head,fp16-mixed",
        output_dir=str(tmp_path),
    )
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # the model is untouched
    assert type(model.lm_head) is torch.nn.Linear
    gap = {p: result.pairs[f"{p}: trainer vs fp32"].abs_mean for p in result.precisions}
    assert result.precisions == ["fp32", "bf16-mixed", "bf16-mixed+fp32-head", "fp16-mixed"]
    assert result.pairs["fp32: trainer vs fp32"].abs_max == 0.0
    assert result.pairs["fp32: sampler vs trainer"].abs_max < 1e-4  # KV cache vs full forward, fp32
    assert gap["fp16-mixed"] < 0.5 * gap["bf16-mixed"]
    assert 0 < gap["bf16-mixed+fp32-head"] < gap["bf16-mixed"]
    for p in result.precisions:
        assert result.pairs[f"{p}: sampler vs trainer"].n_tokens > 6
    assert "sampler/trainer gap per training precision" in result.table
    saved = json.loads(open(result.json_path, encoding="utf-8").read())
    assert list(saved["precisions"]) == result.precisions and saved["skipped"] == {}
    assert saved["precisions"]["fp16-mixed"]["trainer_vs_fp32"]["abs_mean"] == gap["fp16-mixed"]

    # A precision the device cannot run is skipped with its reason; the rest is measured.
    monkeypatch.setattr(
        mismatch,
        "unsupported_reason",
        lambda name, _device: "no float16 autocast" if name == "fp16-mixed" else None,
    )
    result = run_mismatch(
        model,
        tokenizer,
        ["Count to ten."],
        max_new_tokens=4,
        precisions=["fp16-mixed", "fp32"],
        output_dir=None,
    )
    assert result.precisions == ["fp32"] and result.skipped == {"fp16-mixed": "no float16 autocast"}
    assert "skipped fp16-mixed: no float16 autocast" in result.table


def test_cli_refuses_an_unknown_precision_in_one_line(capsys):
    assert main(["lab", "mismatch", "--precisions", "fp32,half"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --precisions: 'half' is not valid") and err.count("\n") == 1
