"""Layers that keep fewer activations for the backward than autograd would: the SwiGLU MLP and
the RMSNorm of Llama-family models.

The MLP of Llama-family models is ``down(silu(gate(x)) * up(x))``. Run by autograd it saves four
[N, I] tensors per layer for the backward (the gate output for silu, silu's output and the up
output for the product, the product for ``down``): about 60 % of the whole training forward's
saved activations for SmolLM2-135M (measured with saved-tensor hooks: 1.03 GB of 1.64 GB for 16
responses of one GRPO step). :class:`SwiGLUFunction` saves only ``x``, the gate output and the up
output, and recomputes ``silu`` and the product in the backward: two elementwise passes, no
extra matmul. :class:`RMSNormFunction` saves the input and the per-row inverse RMS instead of
the input and the normalised copy (another ~155 MB there). Values and gradients are those of the
plain modules up to float rounding (tested in float64).
"""

from __future__ import annotations

import types

import torch
from torch.nn import functional as F

__all__ = ["RMSNormFunction", "SwiGLUFunction", "use_memory_efficient_mlp"]


class SwiGLUFunction(torch.autograd.Function):
    """``down(silu(x @ W_gate^T) * (x @ W_up^T))`` saving ``x``, the gate and the up outputs
    (the SwiGLU feed-forward of Shazeer 2020, "GLU Variants Improve Transformer", eq. for FFN_SwiGLU
    without biases, as in Llama).

    Shapes: x [..., H]; w_gate, w_up [I, H]; w_down [H, I]; returns [..., H] in x's dtype.
    Backward (s = silu(g) = g sigmoid(g), h = s u, G = dL/d out):
    dL/dW_down = G^T h, dL/dh = G W_down, dL/du = dL/dh * s,
    dL/dg = dL/dh * u * sigmoid(g) (1 + g (1 - sigmoid(g))),
    dL/dx = dL/dg W_gate + dL/du W_up, dL/dW_gate = (dL/dg)^T x, dL/dW_up = (dL/du)^T x.
    """

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down):
        gate = F.linear(x, w_gate)
        up = F.linear(x, w_up)
        out = F.linear(F.silu(gate).mul_(up), w_down)
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        need_x, need_gate, need_up, need_down = ctx.needs_input_grad
        # Under autocast the forward's matmuls ran in gate's dtype (bf16) on float32 weights:
        # the backward's run in that dtype too, and each gradient returns in its input's dtype.
        # Without autocast every cast below is a no-op.
        x_dtype, weight_dtypes = x.dtype, (w_gate.dtype, w_up.dtype, w_down.dtype)
        x, w_gate, w_up, w_down = (t.to(gate.dtype) for t in (x, w_gate, w_up, w_down))
        grad_out = grad_out.to(gate.dtype)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_h = grad_out @ w_down  # [..., I]
        grad_w_down = None
        if need_down:
            h = silu * up
            grad_w_down = grad_out.reshape(-1, grad_out.shape[-1]).t() @ h.reshape(-1, h.shape[-1])
            del h
        grad_up = grad_h * silu
        del silu
        # d silu / d g = sigmoid(g) (1 + g (1 - sigmoid(g)))
        grad_gate = grad_h.mul_(up).mul_(sig).mul_(gate * (1 - sig) + 1)
        del sig
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = grad_w_gate = grad_w_up = None
        if need_x:
            grad_x = grad_gate @ w_gate
            grad_x.add_(grad_up @ w_up)
        if need_gate:
            grad_w_gate = grad_gate.reshape(-1, grad_gate.shape[-1]).t() @ x2
        if need_up:
            grad_w_up = grad_up.reshape(-1, grad_up.shape[-1]).t() @ x2
        grad_x = grad_x.to(x_dtype) if grad_x is not None else None
        weight_grads = (grad_w_gate, grad_w_up, grad_w_down)
        grads = [g.to(dt) if g is not None else None for g, dt in zip(weight_grads, weight_dtypes)]
        return (grad_x, *grads)


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x / sqrt(mean(x^2) + eps))`` as transformers' Llama/Mistral/Qwen2/Qwen3
    RMSNorm computes it (in float32, cast back to x's dtype before the weight), saving ``x`` and
    the per-row ``rstd = 1 / sqrt(mean(x^2) + eps)`` [..., 1] only (Zhang & Sennrich 2019, "Root
    Mean Square Layer Normalization", eq. 4).

    Shapes: x [..., H], weight [H]. Backward with n = x rstd, g = dL/dout * weight:
    dL/dweight = sum over rows of dL/dout * n, dL/dx = rstd (g - n mean(g n)).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * (xf * rstd).to(x.dtype)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        n = x.to(torch.float32) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad_out * weight).to(torch.float32)
            grad_x = (g - n * (g * n).mean(-1, keepdim=True)).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


# transformers RMSNorm classes whose forward is exactly RMSNormFunction's (Gemma's 1 + weight is not)
_RMSNORM_CLASSES = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def _memory_efficient_norm(self, hidden_states):
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def _plain_linear(module) -> bool:
    return type(module) is torch.nn.Linear and module.bias is None


# transformers MLP classes whose forward is exactly down(silu(gate(x)) * up(x)) (others with the
# same layers add multipliers, clamps or scales: FalconH1, DeepseekV4, ...)
_SWIGLU_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _memory_efficient_forward(self, x):
    if not all(_plain_linear(getattr(self, name)) for name in _PROJECTIONS):
        # wrapped since (e.g. LoRA applied after this module was changed): the class's own forward
        return type(self).forward(self, x)
    return SwiGLUFunction.apply(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


def use_memory_efficient_mlp(model: torch.nn.Module) -> int:
    """Make every SwiGLU MLP and RMSNorm of ``model`` run through :class:`SwiGLUFunction` and
    :class:`RMSNormFunction`, in place.

    An MLP qualifies when its class is transformers' Llama, Mistral, Qwen2 or Qwen3 MLP, its
    ``act_fn`` is SiLU (``torch.nn.SiLU`` or transformers' ``SiLUActivation``) and
    ``gate_proj``, ``up_proj`` and ``down_proj`` are plain ``torch.nn.Linear`` layers without
    bias; a projection wrapped later (e.g. by LoRA) makes that MLP run its class's own forward
    again, so the adapter is used. A norm qualifies when its class is one of transformers' Llama,
    Mistral, Qwen2 or Qwen3 RMSNorm. The ``forward`` is replaced on the instance; parameters,
    their names and the state dict do not change.

    Args:
        model: any ``torch.nn.Module`` (a transformers causal LM, peft-wrapped or not).

    Returns:
        The number of modules changed (0 for an architecture without either).
    """
    changed = 0
    for module in model.modules():
        if type(module).__name__ in _RMSNORM_CLASSES and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_memory_efficient_norm, module)
            changed += 1
            continue
        if type(module).__name__ not in _SWIGLU_CLASSES:
            continue
        act = getattr(module, "act_fn", None)
        if act is None or type(act).__name__ not in ("SiLU", "SiLUActivation"):
            continue
        if not all(_plain_linear(getattr(module, name, None)) for name in _PROJECTIONS):
            continue
        module.forward = types.MethodType(_memory_efficient_forward, module)
        changed += 1
    return changed
