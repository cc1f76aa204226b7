"""Tests of policygrad.models.swiglu: the SwiGLU MLP and RMSNorm that save fewer activations give
the plain modules' values and gradients, keep less for the backward, and leave what they cannot
handle (LoRA-wrapped projections, other norms) alone."""

from __future__ import annotations

import copy

import pytest
import torch

from policygrad.models.swiglu import RMSNormFunction, SwiGLUFunction, use_memory_efficient_mlp
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.integration

F64 = torch.float64


def test_swiglu_hand_value():
    # x = [1], W_gate = [[2]], W_up = [[3]], W_down = [[0.5]]:
    #   gate 2, up 3, silu(2) = 2 / (1 + e^-2) = 2 x 0.8807971 = 1.7615942,
    #   out = 0.5 x 1.7615942 x 3 = 2.6423913
    # d out / d x = 0.5 x (W_up silu(g) + W_gate u silu'(g)),
    #   silu'(2) = s(2)(1 + 2(1 - s(2))) = 0.8807971 x 1.2384058 = 1.0907842
    #   = 0.5 x (3 x 1.7615942 + 2 x 3 x 1.0907842) = 0.5 x (5.2847825 + 6.5447055) = 5.9147440
    x = torch.tensor([[1.0]], dtype=F64, requires_grad=True)
    w_gate, w_up, w_down = (torch.tensor([[v]], dtype=F64) for v in (2.0, 3.0, 0.5))
    out = SwiGLUFunction.apply(x, w_gate, w_up, w_down)
    assert out.item() == pytest.approx(2.6423913, abs=1e-7)
    out.backward()
    assert x.grad.item() == pytest.approx(5.9147440, abs=1e-7)


def test_swiglu_equals_autograd_with_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, dtype=F64, generator=g, requires_grad=True)
    w_gate, w_up = (torch.randn(10, 6, dtype=F64, generator=g, requires_grad=True) for _ in range(2))
    w_down = torch.randn(6, 10, dtype=F64, generator=g, requires_grad=True)
    weights = torch.randn(2, 5, 6, dtype=F64, generator=g)
    inputs = (x, w_gate, w_up, w_down)
    fused = torch.autograd.grad((SwiGLUFunction.apply(*inputs) * weights).sum(), inputs)
    plain_out = torch.nn.functional.linear(torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T), w_down)
    plain = torch.autograd.grad((plain_out * weights).sum(), inputs)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_rmsnorm_equals_transformers_with_gradients():
    # transformers' RMSNorm computes in float32 even for float64 input, so compare in float32
    # against the module itself: values bitwise, gradients to float32 rounding.
    model, _ = make_tiny_llama(seed=0)
    norm = model.model.norm
    norm.weight.data.uniform_(0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, norm.weight.shape[0], generator=g, requires_grad=True)
    weights = torch.randn(x.shape, generator=g)
    plain_out = norm(x)
    plain = torch.autograd.grad((plain_out * weights).sum(), (x, norm.weight))
    fused_out = RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon)
    fused = torch.autograd.grad((fused_out * weights).sum(), (x, norm.weight))
    torch.testing.assert_close(fused_out, plain_out, atol=0, rtol=0)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_patched_model_matches_and_saves_less():
    model, _ = make_tiny_llama(seed=1, initializer_range=0.3)
    model = model.double().train()
    patched = copy.deepcopy(model)
    # 2 layers: 2 MLPs + 2 x 2 layer norms + the final norm
    assert use_memory_efficient_mlp(patched) == 7
    ids = torch.randint(4, 100, (3, 9), generator=torch.Generator().manual_seed(2))

    def run(m):
        saved = []

        def pack(t):
            saved.append(t.untyped_storage().nbytes())
            return t

        m.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = m(input_ids=ids).logits
        logits.log_softmax(-1)[..., 5].sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, sum(saved)

    plain_logits, plain_grads, plain_bytes = run(model)
    logits, grads, saved_bytes = run(patched)
    torch.testing.assert_close(logits, plain_logits, atol=1e-12, rtol=0)
    for name, grad in plain_grads.items():
        # the float32 RMSNorm rounds the two backward formulas differently (~2e-7 relative)
        assert (grads[name] - grad).abs().max().item() <= 2e-6 * grad.abs().max().item(), name
    assert saved_bytes < plain_bytes


def test_lora_projections_are_left_alone():
    peft = pytest.importorskip("peft")
    model, _ = make_tiny_llama(seed=0)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    )
    # the MLPs have LoRA-wrapped projections: only the 5 norms change
    assert use_memory_efficient_mlp(lora) == 5


def test_lora_applied_after_the_change_still_trains_its_adapters():
    # The trainer changes the layers, then (with model.lora) wraps projections with LoRA: the MLP
    # must then run its class's forward, so the adapter is in the output and gets gradients.
    peft = pytest.importorskip("peft")
    base, _ = make_tiny_llama(seed=3, initializer_range=0.3)
    plain = copy.deepcopy(base)
    use_memory_efficient_mlp(base)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    models = []
    for m in (plain, base):
        torch.manual_seed(0)
        lora = peft.get_peft_model(m, copy.deepcopy(config))
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.data.fill_(0.1)  # B starts at 0; make the adapter change the output
        models.append(lora)
    ids = torch.randint(4, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    outs = []
    for lora in models:
        logits = lora(input_ids=ids).logits
        logits.sum().backward()
        outs.append(logits.detach())
        grads = [p.grad for n, p in lora.named_parameters() if "lora_" in n and "mlp" in n]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_look_alike_mlps_are_left_alone():
    # Same layers and activation, another class (e.g. one that scales or clamps): not changed.
    class ScaledMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(4, 8, bias=False)
            self.up_proj = torch.nn.Linear(4, 8, bias=False)
            self.down_proj = torch.nn.Linear(8, 4, bias=False)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return 3.0 * self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    mlp = ScaledMLP()
    assert use_memory_efficient_mlp(mlp) == 0
    assert "forward" not in vars(mlp)
