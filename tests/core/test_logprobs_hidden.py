"""Tests of policygrad.core.logprobs.logprobs_from_hidden: log-probs and entropy from hidden
states and the output layer, block by block, with the logits never stored."""

from __future__ import annotations

import pytest
import torch

from policygrad.core.logprobs import logprobs_from_hidden, logprobs_from_logits
from policygrad.core.losses import entropy_from_logits

pytestmark = pytest.mark.unit

F64 = torch.float64


def test_hand_values():
    # hidden [1, 0] and W rows [1, 0], [0, 1], [0, 0]: logits [1, 0, 0]
    #   log p(0) = 1 - log(e + 2) = 1 - 1.5514447 = -0.5514447
    #   p = [e, 1, 1] / (e + 2) = [0.576117, 0.211942, 0.211942]
    #   H = -(0.576117 ln 0.576117 + 2 x 0.211942 ln 0.211942) = 0.317696 + 0.657632 = 0.975328
    # temperature 0.5: logits [2, 0, 0], log p(0) = 2 - log(e^2 + 2) = -0.2395448
    hidden = torch.tensor([[1.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    lp, ent = logprobs_from_hidden(hidden, weight, torch.tensor([0]), with_entropy=True)
    assert lp.shape == (1,) and lp.dtype == torch.float32
    assert lp.item() == pytest.approx(-0.5514447, abs=1e-6)
    assert ent.item() == pytest.approx(0.9753278, abs=1e-6)
    lp_half, none = logprobs_from_hidden(hidden, weight, torch.tensor([0]), temperature=0.5)
    assert none is None
    assert lp_half.item() == pytest.approx(-0.2395448, abs=1e-6)
    # a bias [0, 0, 1] makes the logits [1, 0, 1]: log p(0) = 1 - log(2e + 1) = 1 - 1.8619948 = -0.8619948
    lp_bias, _ = logprobs_from_hidden(hidden, weight, torch.tensor([0]), bias=torch.tensor([0.0, 0.0, 1.0]))
    assert lp_bias.item() == pytest.approx(-0.8619948, abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_equals_the_logits_path_with_gradients(temperature, entropy_grad, chunk_size):
    # Same values and the same gradients w.r.t. hidden, weight and bias as materialising the
    # logits and using logprobs_from_logits / entropy_from_logits, in float64 (~1e-15 apart).
    g = torch.Generator().manual_seed(0)
    N, H, V = 37, 8, 50
    hidden = torch.randn(N, H, dtype=F64, generator=g, requires_grad=True)
    weight = torch.randn(V, H, dtype=F64, generator=g, requires_grad=True)
    bias = torch.randn(V, dtype=F64, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (N,), generator=g)
    w_lp = torch.randn(N, dtype=F64, generator=g)
    w_ent = torch.randn(N, dtype=F64, generator=g)

    lp, ent = logprobs_from_hidden(
        hidden, weight, tokens, temperature=temperature, bias=bias, with_entropy=True, chunk_size=chunk_size
    )
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0.0)
    fused = torch.autograd.grad(loss, (hidden, weight, bias))

    logits = torch.nn.functional.linear(hidden, weight, bias)
    ref_lp = logprobs_from_logits(logits, tokens, temperature=temperature)
    ref_ent = entropy_from_logits(logits, temperature=temperature)
    ref_loss = (ref_lp * w_lp).sum() + ((ref_ent * w_ent).sum() if entropy_grad else 0.0)
    reference = torch.autograd.grad(ref_loss, (hidden, weight, bias))

    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    for got, want in zip(fused, reference):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_frozen_weight_gets_no_gradient_and_hidden_still_does():
    # LoRA freezes the output layer: only the hidden states need a gradient.
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, dtype=F64, generator=g, requires_grad=True)
    weight = torch.randn(9, 4, dtype=F64, generator=g)
    tokens = torch.randint(0, 9, (6,), generator=g)
    lp, _ = logprobs_from_hidden(hidden, weight, tokens)
    lp.sum().backward()
    # d/dh sum_i log p(tok_i) = W[tok] - p^T W per row
    p = torch.softmax(hidden.detach() @ weight.T, -1)
    torch.testing.assert_close(hidden.grad, weight[tokens] - p @ weight, atol=1e-12, rtol=0)


def test_bfloat16_blocks_are_upcast_like_the_logits_path():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 16, generator=g).bfloat16()
    weight = torch.randn(30, 16, generator=g).bfloat16()
    tokens = torch.randint(0, 30, (10,), generator=g)
    lp, ent = logprobs_from_hidden(hidden, weight, tokens, with_entropy=True)
    logits = torch.nn.functional.linear(hidden, weight)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, logprobs_from_logits(logits, tokens), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(logits), atol=1e-6, rtol=0)


def test_empty_input():
    empty = torch.zeros(0, dtype=torch.long)
    lp, ent = logprobs_from_hidden(torch.zeros(0, 4), torch.zeros(7, 4), empty, with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"hidden": torch.zeros(3)}, ValueError, "hidden must be a floating"),
        ({"weight": torch.zeros(5, 3)}, ValueError, "weight must be"),
        ({"weight": torch.zeros(5, 4, dtype=F64)}, TypeError, "weight dtype"),
        ({"tokens": torch.zeros(2, dtype=torch.long)}, ValueError, "tokens must have shape"),
        ({"tokens": torch.tensor([0, 1, 5])}, ValueError, r"ids in \[0, 5\)"),
        ({"tokens": torch.zeros(3)}, TypeError, "integer tensor"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"bias": torch.zeros(4)}, ValueError, "bias"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    args = {"hidden": torch.zeros(3, 4), "weight": torch.zeros(5, 4), "tokens": torch.tensor([0, 1, 4])}
    args.update(kwargs)
    hidden, weight, tokens = args.pop("hidden"), args.pop("weight"), args.pop("tokens")
    with pytest.raises(error, match=match):
        logprobs_from_hidden(hidden, weight, tokens, **args)


def test_a_minus_inf_logit_gives_finite_entropy_and_gradients():
    # A -inf bias entry (a banned token) has p = 0: it adds nothing to the entropy (0 x log 0 = 0)
    # and nothing to any gradient; the naive e x z would be 0 x (-inf) = NaN.
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(5, 4, dtype=F64, generator=g, requires_grad=True)
    weight = torch.randn(7, 4, dtype=F64, generator=g, requires_grad=True)
    bias = torch.zeros(7, dtype=F64)
    bias[3] = float("-inf")
    tokens = torch.tensor([0, 1, 2, 4, 6])
    lp, ent = logprobs_from_hidden(hidden, weight, tokens, bias=bias, with_entropy=True)
    fused = torch.autograd.grad(lp.sum() + 5.0 * ent.sum(), (hidden, weight))
    logits = torch.nn.functional.linear(hidden, weight, bias)
    ref_lp, ref_ent = logprobs_from_logits(logits, tokens), entropy_from_logits(logits)
    reference = torch.autograd.grad(ref_lp.sum() + 5.0 * ref_ent.sum(), (hidden, weight))
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-12, rtol=0)
    for got, want in zip(fused, reference):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("with_bias", [False, True])
def test_under_bf16_autocast_the_backward_differentiates_the_forward_it_ran(with_bias):
    # Under autocast the forward's logits come from a bf16 matmul; the backward runs outside the
    # autocast and must recompute the same logits. Logits recomputed in float32 against the
    # forward's log-sum-exp give a softmax summing to 1 +- |lse_bf16 - lse_fp32| (up to 0.1 at
    # logits of +-30, SmolLM2's range), a gradient of neither function. Reference: the exact
    # (float64) gradient dz of the forward's own logits z, taken from the same autocast matmul:
    # dL/dz = g_lp (onehot - p) - g_H p (log p + H), then dL/dhidden = dz W_bf and
    # dL/dW = dz^T hidden_bf with the operands autocast's forward used (W_bf, hidden_bf: bf16).
    # The fused path computes dz in float32 from bit-identical logits (a few float32 ulps times
    # |z| <= ~60: ~4e-6 relative), so the bias gradient, its float32 sum, is within 1e-4; the
    # float32-recompute bug is off by ~1e-2 there. The two matmuls run in bf16 as an unfused
    # autocast linear's backward: dz rounded to bf16 (relative error <= u = 2^-8), the product
    # accumulated in float32 (V or n terms x 2^-24, under 1e-4 here) and rounded once more to bf16
    # (<= u of each block's product, itself <= sum |dz| |operand|): elementwise
    # |got - ref| <= (2u + 1e-4) sum |dz| |operand|.
    torch.manual_seed(0)
    n, h_dim, vocab, temperature = 48, 64, 1024, 0.9
    hidden = torch.randn(n, h_dim, requires_grad=True)
    weight = (1.5 * torch.randn(vocab, h_dim)).requires_grad_()  # logits of std ~12, as an LM's
    bias = torch.randn(vocab, requires_grad=True) if with_bias else None
    tokens = torch.randint(0, vocab, (n,))
    g_lp, g_h = torch.randn(n), torch.randn(n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = logprobs_from_hidden(
            hidden, weight, tokens, temperature=temperature, bias=bias, with_entropy=True, chunk_size=20
        )
        z_fwd = torch.nn.functional.linear(hidden, weight, bias)
    assert z_fwd.dtype == torch.bfloat16 and z_fwd.abs().max() > 30
    ((lp * g_lp).sum() + (ent * g_h).sum()).backward()

    z = z_fwd.detach().to(F64).requires_grad_()
    logp = torch.log_softmax(z / temperature, dim=-1)
    lp_ref = logp.gather(1, tokens[:, None]).squeeze(1)
    ent_ref = -(logp.exp() * logp).sum(-1)
    assert torch.allclose(lp.to(F64), lp_ref, rtol=0, atol=1e-4)  # the forward is the autocast one
    ((lp_ref * g_lp.to(F64)).sum() + (ent_ref * g_h.to(F64)).sum()).backward()
    dz = z.grad
    u = 2.0**-8
    w_bf = weight.detach().bfloat16().to(F64)
    h_bf = hidden.detach().bfloat16().to(F64)
    expected = {
        "hidden": (dz @ w_bf, dz.abs() @ w_bf.abs()),
        "weight": (dz.t() @ h_bf, dz.abs().t() @ h_bf.abs()),
    }
    got = {"hidden": hidden.grad, "weight": weight.grad}
    for name, (ref, size) in expected.items():
        excess = (got[name].to(F64) - ref).abs() - (2 * u + 1e-4) * size
        assert float(excess.max()) <= 0, name
        gap = float((got[name].to(F64) - ref).norm() / ref.norm())
        assert gap < 5e-3, (name, gap)  # measured 2.2e-3 and 2.4e-3: the roundings, any CPU
    if with_bias:
        gap = float((bias.grad.to(F64) - dz.sum(0)).norm() / dz.sum(0).norm())
        assert gap < 1e-4, gap
    # the identity behind it: a softmax's gradient sums to 0 over the vocabulary, so the weight
    # gradient's columns sum to 0, up to the bf16 roundings above: |sum_v dW[v, j]| <=
    # (2u + 1e-4) sum_v sum_n |dz| |hidden_bf| (the recompute bug leaves sum_v dz ~ 0.1 |g|)
    colsum = weight.grad.to(F64).sum(0).abs()
    assert bool((colsum <= (2 * u + 1e-4) * (dz.abs().t() @ h_bf.abs()).sum(0)).all())


def test_a_float32_forward_keeps_its_float32_backward_when_backward_runs_under_autocast():
    # The reverse case: the forward outside autocast (float32 logits), backward() called inside a
    # bf16 autocast. The recompute must stay in float32, or the softmax differentiated is again
    # not the forward's; so the gradients equal those of a backward outside autocast exactly.
    torch.manual_seed(1)
    hidden = torch.randn(40, 32, requires_grad=True)
    weight = (2.0 * torch.randn(512, 32)).requires_grad_()
    tokens = torch.randint(0, 512, (40,))
    g = torch.randn(40)
    grads = []
    for inside in (False, True):
        hidden.grad = weight.grad = None
        lp, _ = logprobs_from_hidden(hidden, weight, tokens, chunk_size=16)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside):
            (lp * g).sum().backward()
        grads.append((hidden.grad.clone(), weight.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_loss_scaled_gradient_stays_finite_under_autocast(dtype):
    # fp16-mixed scales the loss by GradScaler's 2^16 before backward(), so a token's dL/dz can
    # pass float16's largest value, 65504: the gradient matmuls must not take dL/dz in float16
    # (they did for a while: inf and NaN gradients, every such step skipped). Under fp16 autocast
    # they run in float32 on the float32 weights, so the gradients are the float64 products of
    # the forward's own logits' gradient dz with them up to float32 rounding (under 1e-4
    # relative); bf16 has float32's exponent range and stays finite in its own matmuls, within
    # its roundings (under 1e-2; the default test above bounds it elementwise).
    torch.manual_seed(2)
    n, h_dim, vocab = 64, 32, 512
    hidden = torch.randn(n, h_dim, requires_grad=True)
    weight = (torch.randn(vocab, h_dim) / 4).requires_grad_()
    tokens = torch.randint(0, vocab, (n,))
    g = 2.0**16 * torch.rand(n) * 4  # scaled per-token weights up to 2.6e5 > 65504
    with torch.autocast("cpu", dtype=dtype):
        lp, _ = logprobs_from_hidden(hidden, weight, tokens, chunk_size=24)
        z = torch.nn.functional.linear(hidden, weight).detach().to(F64).requires_grad_()
    (lp * g).sum().backward()
    (torch.log_softmax(z, -1).gather(1, tokens[:, None]).squeeze(1) * g.to(F64)).sum().backward()
    if dtype == torch.float16:
        w_ref, h_ref = weight.detach().to(F64), hidden.detach().to(F64)
        bound = 1e-4
    else:
        w_ref, h_ref = weight.detach().bfloat16().to(F64), hidden.detach().bfloat16().to(F64)
        bound = 1e-2
    for got, ref in ((hidden.grad, z.grad @ w_ref), (weight.grad, z.grad.t() @ h_ref)):
        assert torch.isfinite(got).all()
        assert float((got.to(F64) - ref).norm() / ref.norm()) < bound  # measured 1e-7 (fp16), 2.2e-3 (bf16)
