"""Tests of policygrad.core.losses: the policy-loss registry (against the declarations of
policygrad.specs.losses), the value loss and the entropy of a softmax."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from policygrad.core import losses
from policygrad.core.losses import (
    check_policy_loss_options,
    entropy_from_logits,
    get_policy_loss,
    list_policy_losses,
    policy_loss_options,
    register_policy_loss,
    value_loss,
)
from policygrad.specs import losses as loss_specs

pytestmark = pytest.mark.unit

NAN = float("nan")
F64 = torch.float64


def _from_ratios(ratios, old=-1.0):
    """logprobs (leaf, float64, requires grad) with exp(logprobs - old) = ratios; old_logprobs."""
    r = torch.tensor(ratios, dtype=F64)
    old_lp = torch.full_like(r, old)
    lp = (r.log() + old_lp).requires_grad_(True)
    return lp, old_lp


def _token_grads(loss_matrix, lp):
    (grad,) = torch.autograd.grad(loss_matrix.sum(), lp)
    return grad


# ------------------------------------------------------------------------------------------
# registry


def test_registry_lists_and_errors(monkeypatch):
    assert {"vanilla", "ppo", "gspo", "cispo", "clip_cov", "kl_cov"} <= set(list_policy_losses())
    assert get_policy_loss("ppo") is losses.ppo_loss
    with pytest.raises(ValueError, match="cispo, clip_cov, gspo, kl_cov, ppo, vanilla"):
        get_policy_loss("trpo")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("ppo")

    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(losses._POLICY_LOSSES))
    monkeypatch.setattr(loss_specs, "_OPTIONS", dict(loss_specs._OPTIONS))  # the declarations too

    @register_policy_loss("negated")
    def negated(logprobs, _old_logprobs, _advantages, _response_mask):
        return -logprobs, {}

    assert get_policy_loss("negated") is negated
    assert "negated" in list_policy_losses()
    with pytest.raises(ValueError, match="'negated' is already registered"):
        register_policy_loss("negated")


@pytest.mark.parametrize("name", ["vanilla", "ppo", "gspo", "cispo"])
def test_shape_errors_name_the_argument(name):
    fn = get_policy_loss(name)
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="old_logprobs"):
        fn(a, torch.zeros(2, 4), a, a)
    with pytest.raises(ValueError, match="advantages"):
        fn(a, a, torch.zeros(2), a)
    with pytest.raises(ValueError, match="response_mask"):
        fn(a, a, a, torch.ones(3, 3))
    with pytest.raises(ValueError, match="logprobs must be 2-D"):
        fn(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))


def test_option_validation():
    a = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="dual_clip"):
        get_policy_loss("ppo")(a, a, a, a, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low"):
        get_policy_loss("ppo")(a, a, a, a, clip_low=1.5)
    with pytest.raises(ValueError, match="clip_high"):
        get_policy_loss("gspo")(a, a, a, a, clip_high=-0.1)
    with pytest.raises(TypeError, match="clip_low"):
        get_policy_loss("cispo")(a, a, a, a, clip_low="0.2")
    with pytest.raises(TypeError, match="clip_high"):
        get_policy_loss("ppo")(a, a, a, a, clip_high=None)


# ------------------------------------------------------------------------------------------
# declared options


def test_losses_declare_their_options_with_the_papers_defaults():
    # PPO (Schulman et al. 2017): eps = 0.2 both sides, no dual clip; GSPO (Zheng et al. 2025,
    # section 5.1): 3e-4 / 4e-4; CISPO (MiniMax-M1): no lower bound, DAPO's 0.28 above.
    assert policy_loss_options("ppo") == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    assert policy_loss_options("gspo") == {"clip_low": 3e-4, "clip_high": 4e-4}
    assert policy_loss_options("cispo") == {"clip_low": None, "clip_high": 0.28}
    assert policy_loss_options("vanilla") == {}
    # Clip-Cov / KL-Cov (Cui et al. 2025, section 5 and its 7B settings): detach 2e-4 of the tokens
    # with covariance in [1, 5] under PPO's 0.2 band; penalise the top 2e-3 with coefficient 1.
    # The trainer's ``selected`` keyword is not an option a config may set.
    assert policy_loss_options("clip_cov") == {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "clip_cov_ratio": 2e-4,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
    }
    assert policy_loss_options("kl_cov") == {"kl_cov_ratio": 2e-3, "kl_cov_coef": 1.0}
    assert get_policy_loss("gspo").options == {"clip_low": 3e-4, "clip_high": 4e-4}
    # a copy: editing it changes nothing registered
    policy_loss_options("ppo")["clip_low"] = 0.5
    assert policy_loss_options("ppo")["clip_low"] == 0.2
    registered = "cispo, clip_cov, gspo, kl_cov, ppo, vanilla"
    with pytest.raises(ValueError, match=f"unknown policy loss 'trpo'; registered: {registered}"):
        policy_loss_options("trpo")


def test_check_policy_loss_options_names_the_loss_and_its_options():
    message = (
        "policy loss 'gspo' has no option 'dual_clip'; its options: clip_low (default 0.0003), "
        "clip_high (default 0.0004)"
    )
    with pytest.raises(ValueError) as info:
        check_policy_loss_options("gspo", {"dual_clip": 3.0})
    assert str(info.value) == message
    with pytest.raises(
        ValueError, match=r"policy loss 'vanilla' has no option 'clip_low'; its options: \(none\)"
    ):
        check_policy_loss_options("vanilla", {"clip_low": 0.2})
    with pytest.raises(ValueError, match="unknown policy loss 'trpo'"):
        check_policy_loss_options("trpo", {})
    with pytest.raises(TypeError, match="mapping"):
        check_policy_loss_options("ppo", [("clip_low", 0.2)])


def test_check_policy_loss_options_validates_the_values_now():
    with pytest.raises(ValueError, match=r"clip_low must be a finite number in \[0, 1.0\], got 1.5"):
        check_policy_loss_options("ppo", {"clip_low": 1.5})
    with pytest.raises(ValueError, match="dual_clip must be a finite number > 1"):
        check_policy_loss_options("ppo", {"dual_clip": 0.5})
    with pytest.raises(TypeError, match="clip_high must be a number"):
        check_policy_loss_options("gspo", {"clip_high": "4e-4"})
    with pytest.raises(TypeError, match="clip_high must be a number, got None"):
        check_policy_loss_options("ppo", {"clip_high": None})
    # an explicit None is passed on: CISPO without an upper bound is valid
    assert check_policy_loss_options("cispo", {"clip_high": None}) == {"clip_high": None}
    assert check_policy_loss_options("ppo", {"clip_high": 0.28, "dual_clip": 3}) == {
        "clip_high": 0.28,
        "dual_clip": 3,
    }
    assert check_policy_loss_options("vanilla", {}) == {}


def test_only_the_given_options_reach_the_loss(monkeypatch):
    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(losses._POLICY_LOSSES))
    monkeypatch.setattr(loss_specs, "_OPTIONS", dict(loss_specs._OPTIONS))  # the declarations too
    calls = []

    @register_policy_loss("recording")
    def recording(logprobs, _old_logprobs, _advantages, _response_mask, *, a=1, b=None):
        calls.append({"shape": tuple(logprobs.shape), "a": a, "b": b})
        return torch.zeros_like(logprobs), {}

    assert recording.options == {"a": 1, "b": None}
    assert check_policy_loss_options("recording", {"b": 5}) == {"b": 5}
    assert calls == [{"shape": (1, 2), "a": 1, "b": 5}]  # a kept the function's default


def test_registration_requires_declared_options(monkeypatch):
    monkeypatch.setattr(losses, "_POLICY_LOSSES", dict(losses._POLICY_LOSSES))
    monkeypatch.setattr(loss_specs, "_OPTIONS", dict(loss_specs._OPTIONS))  # the declarations too

    def open_options(logprobs, old_logprobs, advantages, response_mask, **options):  # noqa: ARG001 (a signature to refuse)
        return logprobs, {}

    def no_default(logprobs, old_logprobs, advantages, response_mask, *, clip):  # noqa: ARG001 (a signature to refuse)
        return logprobs, {}

    def three_tensors(logprobs, old_logprobs, advantages):  # noqa: ARG001 (a signature to refuse)
        return logprobs, {}

    with pytest.raises(TypeError, match="declared by name"):
        register_policy_loss("open")(open_options)
    with pytest.raises(TypeError, match="option 'clip' needs a default"):
        register_policy_loss("no_default")(no_default)
    with pytest.raises(TypeError, match="signature"):
        register_policy_loss("three")(three_tensors)
    assert not {"open", "no_default", "three"} & set(list_policy_losses())


def test_builtin_losses_implement_their_declarations(monkeypatch):
    # every declared loss is registered with exactly the declared options and defaults
    for name in list_policy_losses():
        declared = loss_specs.policy_loss_options(name)
        assert get_policy_loss(name).options == policy_loss_options(name) == declared
    params = inspect.signature(losses.ppo_loss).parameters.values()
    defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
    assert defaults == {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None}
    # a function whose defaults drift from the declaration is refused at registration
    monkeypatch.setattr(loss_specs, "_OPTIONS", dict(loss_specs._OPTIONS))
    loss_specs.declare_policy_loss("test_only_declared", {"clip": 0.2})

    def drifted(logprobs, old_logprobs, advantages, response_mask, *, clip=0.3):  # noqa: ARG001 (a signature to refuse)
        return logprobs, {}

    with pytest.raises(TypeError) as info:
        losses._implement("test_only_declared", drifted)
    assert str(info.value) == (
        "policy loss 'test_only_declared' is declared with the options clip (default 0.2) in "
        "policygrad.specs.losses, but its function takes clip (default 0.3); make them agree"
    )


# ------------------------------------------------------------------------------------------
# value loss


def test_value_loss_clipping_hand_example():
    # clip_range 0.2, old values 1.0 (clip window [0.8, 1.2]):
    #   t0: V=1.5, G=2: unclipped (1.5-2)^2 = 0.25; V_clip = 1.2: (1.2-2)^2 = 0.64 -> max 0.64,
    #       loss 0.32, clipped branch, gradient 0 (V outside the window)
    #   t1: V=0.5, G=2: 2.25 vs V_clip 0.8: 1.44 -> 2.25, loss 1.125, gradient V - G = -1.5
    #   t2: V=2.0, G=1: 1.0 vs V_clip 1.2: 0.04 -> 1.0, loss 0.5, gradient 1.0
    #   t3: V=1.1, G=2: inside the window, V_clip = V: equal errors, loss 0.405, gradient -0.9
    #   t4: padding (NaN)
    values = torch.tensor([[1.5, 0.5, 2.0, 1.1, NAN]], dtype=F64, requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 1.0, 1.0, NAN]], dtype=F64)
    returns = torch.tensor([[2.0, 2.0, 1.0, 2.0, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = value_loss(values, old_values, returns, mask, clip_range=0.2)
    torch.testing.assert_close(loss, torch.tensor([[0.32, 1.125, 0.5, 0.405, 0.0]], dtype=F64))
    torch.testing.assert_close(
        _token_grads(loss, values), torch.tensor([[0.0, -1.5, 1.0, -0.9, 0.0]], dtype=F64)
    )
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.25, abs=1e-7)
    assert metrics["num_tokens"].item() == 4
    # unclipped: 0.5 * [0.25, 2.25, 1.0, 0.81]
    loss_u, metrics_u = value_loss(values, old_values, returns, mask)
    torch.testing.assert_close(loss_u, torch.tensor([[0.125, 1.125, 0.5, 0.405, 0.0]], dtype=F64))
    assert metrics_u["vf_clipfrac"].item() == 0.0


def test_value_loss_errors():
    a = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="returns"):
        value_loss(a, a, torch.zeros(3, 2), a)
    with pytest.raises(ValueError, match="old_values"):
        value_loss(a, torch.zeros(2, 2), a, a)
    with pytest.raises(ValueError, match="clip_range"):
        value_loss(a, a, a, a, clip_range=0.0)


# ------------------------------------------------------------------------------------------
# entropy


def _reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_uniform_and_exact_formula():
    # uniform over V = 7: H = log 7 = 1.945910
    h = entropy_from_logits(torch.zeros(2, 3, 7))
    assert h.dtype == torch.float32 and h.shape == (2, 3)
    torch.testing.assert_close(h, torch.full((2, 3), math.log(7)), rtol=0, atol=1e-6)
    # [0, 0, -inf]: a banned token has probability 0 -> H = log 2, finite gradient
    x = torch.tensor([[0.0, 0.0, float("-inf")]], requires_grad=True)
    hx = entropy_from_logits(x)
    assert hx.item() == pytest.approx(math.log(2), abs=1e-6)
    hx.sum().backward()
    assert torch.isfinite(x.grad).all()
    # two-point [log 3, 0]: p = [0.75, 0.25], H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562335
    two = entropy_from_logits(torch.tensor([math.log(3.0), 0.0]))
    assert two.item() == pytest.approx(0.562335, abs=1e-6)


def test_entropy_matches_reference_values_gradients_and_chunks():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 5, 11, generator=g, dtype=F64) * 3
    ref = _reference_entropy(logits / 0.7)
    for chunk in (1, 4, 15, None):
        torch.testing.assert_close(entropy_from_logits(logits, temperature=0.7, chunk_size=chunk), ref)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: entropy_from_logits(t, temperature=0.7, chunk_size=4), (x,))
    # float32 gradient against autograd through the reference
    x32 = logits.float().requires_grad_(True)
    w = torch.randn(3, 5, generator=g)
    (g_new,) = torch.autograd.grad((entropy_from_logits(x32, chunk_size=2) * w).sum(), x32)
    (g_ref,) = torch.autograd.grad((_reference_entropy(x32) * w).sum(), x32)
    torch.testing.assert_close(g_new, g_ref, rtol=1e-5, atol=1e-6)


def test_entropy_bf16_keeps_no_float32_copy():
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(4, 6, 32, generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    h = entropy_from_logits(logits, chunk_size=5)
    assert h.dtype == torch.float32
    torch.testing.assert_close(h, _reference_entropy(logits.detach().float()), rtol=1e-5, atol=1e-5)
    # what the backward keeps alive: the bf16 logits themselves and [N] float32 vectors only
    saved = h.grad_fn.saved_tensors
    assert any(t.data_ptr() == logits.data_ptr() for t in saved)
    assert sum(t.numel() for t in saved if t.dtype == torch.float32) <= 2 * 4 * 6
    h.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    x32 = logits.detach().float().requires_grad_(True)
    _reference_entropy(x32).sum().backward()
    torch.testing.assert_close(logits.grad.float(), x32.grad, rtol=2e-2, atol=2e-3)


def test_entropy_non_contiguous_input():
    g = torch.Generator().manual_seed(8)
    full = torch.randn(5, 3, 9, generator=g)
    view = full.transpose(0, 1)[:, 1:]  # [3, 4, 9], not flattenable without a copy
    torch.testing.assert_close(entropy_from_logits(view, chunk_size=5), _reference_entropy(view))
