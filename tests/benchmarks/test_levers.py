"""benchmarks/levers.py: the table of one lever, with the sampler's log-prob gap and the load time
that a lever changing the sampler (vLLM's compilation) must show beside its step time."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def levers(import_script):
    return import_script("levers")


def variant(label, steps, gaps, load_s):
    return {
        "label": label,
        "ready": {"load_s": load_s},
        "steps": [
            {"warmup": i == 0, "metrics": {"mismatch/logprob_abs_mean": g}} for i, g in enumerate(gaps)
        ],
        "summary": {"step": steps, "generation": steps / 2, "peak_rss_gb": 4.0},
        "ratio_to_first": math.nan,
    }


def test_the_table_has_the_samplers_gap_over_the_measured_steps_and_the_load(levers):
    run = {
        "lever": "vllm_compile",
        # the warm-up step's gap (9e-3) is left out: medians of 1e-5, 2e-5, 4e-5 -> 2e-5
        "variants": [
            variant("eager", 10.0, [9e-3, 1e-5, 4e-5, 2e-5], 20.0),
            variant("compiled", 8.0, [9e-3, 3e-5], 140.0),
        ],
    }
    table = levers.lever_table(run)
    assert "| sampler - trainer log-prob, mean abs | 2.0e-05 | 3.0e-05 |" in table
    assert "| load, before the first step (s) | 20.00 | 140.00 |" in table
    # a lever whose steps report no sampler gap (the hf engine) has no such row
    for v in run["variants"]:
        for st in v["steps"]:
            st["metrics"] = {}
    assert "sampler - trainer" not in levers.lever_table(run)


def test_the_float32_head_patch_gives_the_float32_matmul_gradient(levers, monkeypatch):
    # The head_matmuls lever's second variant times the backward before its matmuls ran in bf16:
    # the patch multiplies the default's bf16 operands (the forward's logits' gradient dz rounded
    # to bf16, the bf16 weight and hidden copies) in float32, so its products are exact up to
    # float32 rounding (a few ulps times the sums' sizes), and to the few elements of dz that
    # float32 may round to the other bf16 neighbour than float64 does (each moves one term by
    # 2^-8): under 2e-4 relative. The default's bf16 matmuls round each product once more (~1e-3).
    import torch

    import policygrad.core.logprobs as logprobs

    torch.manual_seed(0)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = (1.5 * torch.randn(300, 32)).requires_grad_()
    tokens = torch.randint(0, 300, (40,))

    def grads():
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = logprobs.logprobs_from_hidden(hidden, weight, tokens, chunk_size=16)
        lp.sum().backward()
        return hidden.grad.double(), weight.grad.double()

    bf16_default = grads()
    monkeypatch.setattr(logprobs, "_block_matmul_grads", logprobs._block_matmul_grads)  # restored after
    levers.apply_patch("float32_head_matmuls")
    patched = grads()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = torch.nn.functional.linear(hidden, weight).detach().double().requires_grad_()
    torch.log_softmax(z, -1).gather(1, tokens[:, None]).sum().backward()
    dz = z.grad.bfloat16().double()
    refs = (dz @ weight.detach().bfloat16().double(), dz.t() @ hidden.detach().bfloat16().double())
    for got, default, ref in zip(patched, bf16_default, refs):
        assert float((got - ref).norm() / ref.norm()) < 2e-4  # measured 5e-8
        assert float((default - ref).norm() / ref.norm()) > 5e-4  # measured 1.4e-3


def test_the_sdpa_math_patch_routes_the_models_attention_through_the_math_backend(levers, monkeypatch):
    # The attention lever's second variant: transformers' "sdpa" attention runs SDPA's math
    # backend, which computes bf16 inputs in float32 and rounds the output once; torch's CPU
    # flash kernel gives a different rounding. The patched function must give the math backend's
    # output bit for bit, and one the flash kernel does not give.
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface

    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 16).bfloat16() for _ in range(3))
    mask = torch.ones(2, 1, 24, 24, dtype=torch.bool).tril()
    module = torch.nn.Module()
    module.is_causal = True
    expected = {}
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel([backend]):
            expected[backend] = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert not torch.equal(expected[SDPBackend.MATH], expected[SDPBackend.FLASH_ATTENTION])
    levers.apply_patch("sdpa_math")
    out, _ = AttentionInterface._global_mapping["sdpa"](module, q, k, v, mask)
    assert torch.equal(out, expected[SDPBackend.MATH].transpose(1, 2))


def test_every_variants_patch_exists(levers):
    patches = {v["patch"] for lever in levers.LEVERS for v in levers.variants(lever) if "patch" in v}
    assert patches == set(levers._PATCHES)  # a misspelt patch would fail in the worker, after loading
