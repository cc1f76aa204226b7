"""Tests of policygrad.core.logprobs: memory-bounded token log-probs (the importance weights:
test_importance.py)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from policygrad.core.logprobs import logprobs_from_logits

pytestmark = pytest.mark.unit

NAN = float("nan")
F64 = torch.float64


def _reference(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    x = logits if logits.dtype == F64 else logits.float()
    logp = torch.log_softmax(x / temperature, dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1)


# ------------------------------------------------------------------------------------------
# values


def test_case6_temperature_hand_value():
    # logits [2, 1, 0], temperature 0.5 -> z = [4, 2, 0]
    #   log p(0) = 4 - log(e^4 + e^2 + 1) = 4 - log(54.598 + 7.389 + 1) = 4 - 4.142932 = -0.142932
    # wrong answers: raw logits 2 - log(e^2 + e + 1) = -0.407606; raw log-prob / T = -0.815212
    logits = torch.tensor([[[2.0, 1.0, 0.0]]])
    lp = logprobs_from_logits(logits, torch.tensor([[0]]), temperature=0.5)
    assert lp.shape == (1, 1) and lp.dtype == torch.float32
    assert lp.item() == pytest.approx(-0.142932, abs=1e-5)
    assert logprobs_from_logits(logits, torch.tensor([[0]])).item() == pytest.approx(-0.407606, abs=1e-5)


def test_matches_log_softmax_values_and_gradients_fp32():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 6, 40, generator=g) * 4).requires_grad_(True)
    tokens = torch.randint(0, 40, (3, 6), generator=g)
    upstream = torch.randn(3, 6, generator=g)
    lp = logprobs_from_logits(logits, tokens, temperature=0.8, chunk_size=5)
    (grad,) = torch.autograd.grad((lp * upstream).sum(), logits)
    x = logits.detach().clone().requires_grad_(True)
    ref = _reference(x, tokens, 0.8)
    (grad_ref,) = torch.autograd.grad((ref * upstream).sum(), x)
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-7)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, tokens, 0.6, chunk_size=2), (logits,))
    assert logprobs_from_logits(logits, tokens).dtype == F64


def test_chunking_invariance():
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 7, 33, generator=g) * 3).requires_grad_(True)
    tokens = torch.randint(0, 33, (4, 7), generator=g)
    results = []
    for chunk in (1, 3, 7, 28, 1000):
        lp = logprobs_from_logits(logits, tokens, temperature=1.3, chunk_size=chunk)
        (grad,) = torch.autograd.grad(lp.sum(), logits)
        results.append((lp, grad))
    for lp, grad in results[1:]:
        torch.testing.assert_close(lp, results[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=1e-7)


def test_bf16_logits():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 5, 64, generator=g) * 3).to(torch.bfloat16).requires_grad_(True)
    tokens = torch.randint(0, 64, (2, 5), generator=g)
    lp = logprobs_from_logits(logits, tokens, temperature=0.7, chunk_size=3)
    assert lp.dtype == torch.float32
    x = logits.detach().float().requires_grad_(True)
    ref = _reference(x, tokens, 0.7)
    # the log-probs of the bf16 values, computed in float32: no bf16 rounding of the result
    torch.testing.assert_close(lp, ref, rtol=1e-6, atol=1e-6)
    # the backward keeps the bf16 logits (already alive) and [N]-sized vectors, no float32 [N, V]
    saved = [t for t in lp.grad_fn.saved_tensors if t is not None]
    assert any(t.data_ptr() == logits.data_ptr() for t in saved)
    assert all(t.numel() <= 2 * 5 for t in saved if t.data_ptr() != logits.data_ptr())
    lp.sum().backward()
    ref.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad.float(), x.grad, rtol=1e-2, atol=1e-3)


def test_non_contiguous_logits():
    g = torch.Generator().manual_seed(4)
    full = torch.randn(3, 8, 20, generator=g, dtype=F64)
    tokens = torch.randint(0, 20, (3, 7), generator=g)
    views = {
        "shifted": full[:, :-1],  # the usual logits[:, :-1] slice (rows read block by block)
        "transposed": full.transpose(0, 1).contiguous().transpose(0, 1)[:, 1:],
        "strided_vocab": torch.randn(3, 7, 40, generator=g, dtype=F64)[..., ::2],  # flattens to a view
    }
    for name, view in views.items():
        assert not view.is_contiguous(), name
        lp = logprobs_from_logits(view, tokens, 0.9, chunk_size=4)
        torch.testing.assert_close(lp, _reference(view.contiguous(), tokens, 0.9), rtol=1e-12, atol=1e-12)
    # gradients flow into a non-contiguous view of a leaf
    leaf = full.clone().requires_grad_(True)
    lp = logprobs_from_logits(leaf.transpose(0, 1).transpose(0, 1)[:, 1:], tokens, 0.9, chunk_size=4)
    lp.sum().backward()
    x = full.clone().requires_grad_(True)
    _reference(x[:, 1:], tokens, 0.9).sum().backward()
    torch.testing.assert_close(leaf.grad, x.grad)


def test_gradcheck_through_non_contiguous_view():
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 3, 6, generator=g, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, 6, (3, 3), generator=g)
    assert torch.autograd.gradcheck(
        lambda b: logprobs_from_logits(b.transpose(0, 1)[:, 1:], tokens, 1.0, chunk_size=2), (base,)
    )


# ------------------------------------------------------------------------------------------
# top-k / top-p against Hugging Face's warpers


def _hf_logprobs(logits, tokens, temperature, top_k=None, top_p=None):
    flat = logits.reshape(-1, logits.shape[-1]).float()
    ids = torch.zeros(flat.shape[0], 1, dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, flat)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    logp = torch.log_softmax(scores, dim=-1)
    return logp, logp.gather(-1, tokens.reshape(-1, 1)).reshape(tokens.shape)


@pytest.mark.parametrize(
    "top_k,top_p", [(5, None), (None, 0.8), (8, 0.7), (1, None), (None, 1.0), (None, 1e-9), (3, 0.999)]
)
def test_top_k_top_p_match_hf_warpers(top_k, top_p):
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(3, 4, 30, generator=g) * 2).requires_grad_(True)
    # sample the tokens from the warped distribution, as generate would
    full_logp, _ = _hf_logprobs(logits.detach(), torch.zeros(3, 4, dtype=torch.long), 0.7, top_k, top_p)
    tokens = torch.multinomial(full_logp.exp(), 1, generator=g).reshape(3, 4)
    _, expected = _hf_logprobs(logits.detach(), tokens, 0.7, top_k, top_p)
    lp = logprobs_from_logits(logits, tokens, 0.7, top_k=top_k, top_p=top_p, chunk_size=5)
    torch.testing.assert_close(lp, expected, rtol=1e-6, atol=1e-6)
    # gradient: as autograd through the warped log-softmax (kept set held fixed)
    x = logits.detach().clone().requires_grad_(True)
    _, ref = _hf_logprobs(x, tokens, 0.7, top_k, top_p)
    (g_ref,) = torch.autograd.grad(ref.sum(), x)
    (g_new,) = torch.autograd.grad(lp.sum(), logits)
    torch.testing.assert_close(g_new, g_ref, rtol=1e-5, atol=1e-6)
    if top_k is not None or (top_p is not None and top_p < 1):
        # the truncation changed the values (the test would catch a forgotten truncation)
        assert (lp - _reference(logits.detach(), tokens, 0.7)).abs().max() > 1e-3


def test_top_k_hand_value_and_token_outside_kept_set():
    # logits [2, 1, 0], T = 1, top_k = 2: kept {0, 1}; log p(0) = 2 - log(e^2 + e) = -0.313262
    # token 2 was removed by the warper: its log-prob is -inf (a sampler could not produce it)
    logits = torch.tensor([[[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]]], requires_grad=True)
    lp = logprobs_from_logits(logits, torch.tensor([[0, 2]]), top_k=2)
    assert lp[0, 0].item() == pytest.approx(-0.313262, abs=1e-6)
    assert lp[0, 1].item() == float("-inf")
    # gradient of the kept token: onehot - p over the kept set = [1 - 0.731059, -0.268941, 0]
    (grad,) = torch.autograd.grad(lp[0, 0], logits)
    torch.testing.assert_close(grad[0, 0], torch.tensor([0.268941, -0.268941, 0.0]), rtol=0, atol=1e-6)
    # top_p = 0.6 on p = [0.665241, 0.244728, 0.090031]: ascending cumulative [0.090, 0.335, 1.0];
    # removed where <= 0.4 -> keep only token 0: log p(0) = 0
    lp_p = logprobs_from_logits(logits.detach(), torch.tensor([[0, 1]]), top_p=0.6)
    assert lp_p[0, 0].item() == 0.0
    assert lp_p[0, 1].item() == float("-inf")


# ------------------------------------------------------------------------------------------
# errors


def test_logprobs_errors():
    logits = torch.zeros(2, 3, 5)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="tokens must have shape"):
        logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        logprobs_from_logits(logits, tokens + 5)
    with pytest.raises(TypeError, match="tokens must be an integer"):
        logprobs_from_logits(logits, tokens.float())
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        logprobs_from_logits(logits, tokens, top_k=0)
    with pytest.raises(ValueError, match="top_p"):
        logprobs_from_logits(logits, tokens, top_p=1.5)
    with pytest.raises(TypeError, match="logits must be a floating"):
        logprobs_from_logits(torch.zeros(2, 3, 5, dtype=torch.long), tokens)
