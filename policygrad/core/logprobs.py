"""Token log-probabilities from logits or from hidden states and the output head (the importance
weights for the train/inference mismatch: :mod:`policygrad.core.importance`).

The log-probs that enter a policy-gradient loss must be those of the distribution the tokens
were sampled from: ``log softmax(logits / temperature)`` at the sampling temperature, after the
same top-k / top-p truncation the sampler applied. Dividing the log-probs by the temperature, or
forgetting it, gives a different number (see the tests: logits [2, 1, 0], temperature 0.5,
token 0 has log-prob -0.1429; the raw logits give -0.4076).

:func:`logprobs_from_logits` never materialises a float32 [B, T, V] log-softmax: it works in
blocks of rows, and its backward recomputes the softmax block by block. For a 150k vocabulary
and 16k tokens a float32 log-softmax is ~9.8 GB; the largest temporary here is one block.
"""

from __future__ import annotations

import math
import numbers

import torch

from .checks import (
    check_chunk_size,
    check_floating,
    check_temperature,
    check_tensor,
)

__all__ = ["logprobs_from_hidden", "logprobs_from_logits", "row_blocks"]

# Elements per block of rows: 2**24 float32 values = 64 MiB per temporary.
_BLOCK_ELEMENTS = 1 << 24
# Blocks of logits computed from hidden states: 2**23 float32 values = 32 MiB, at glibc's
# largest mmap threshold (32 MiB), so the blocks are served from the heap and reused instead of
# being mapped, page-faulted and unmapped each time (measured: 1M minor faults per training
# forward with 64 MiB blocks and a materialised [B, T, V] logits tensor).
_HEAD_BLOCK_ELEMENTS = 1 << 23
# Stand-in for a -inf log-prob (p = 0) in the entropy sums: finite even after scaling by a large
# upstream gradient, so p x it is 0 instead of 0 x inf = NaN.
_NEG_LARGE = -1e30


def _default_chunk_rows(vocab_size: int) -> int:
    return max(1, _BLOCK_ELEMENTS // max(1, vocab_size))


def row_blocks(x: torch.Tensor, chunk_rows: int):
    """Yield ``(start, stop, block)`` with ``block`` the rows ``start:stop`` of ``x`` seen as [N, V].

    ``x`` has shape [..., V]. When the leading dims can be flattened without a copy (e.g. a
    contiguous tensor) the block is a view; otherwise (e.g. ``logits[:, :-1]`` of a [B, T+1, V]
    tensor) only the block's rows are gathered, a block-sized copy, never the whole tensor.
    """
    vocab = x.shape[-1]
    lead = x.shape[:-1]
    n = math.prod(lead)
    try:
        flat = x.view(n, vocab)
    except RuntimeError:
        flat = None
    for start in range(0, n, chunk_rows):
        stop = min(n, start + chunk_rows)
        if flat is not None:
            yield start, stop, flat[start:stop]
        else:
            idx = torch.arange(start, stop, device=x.device)
            yield start, stop, x[torch.unravel_index(idx, lead)]


def _keep_thresholds(z: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Smallest kept value per row after Hugging Face's top-k then top-p warpers. z: [n, V] scaled logits.

    Top-k keeps every value >= the k-th largest (ties kept), as ``TopKLogitsWarper``. Top-p
    follows ``TopPLogitsWarper``: sort ascending, cumulative softmax, drop the prefix whose
    cumulative probability is <= 1 - top_p, always keep the largest. The kept set is then
    ``z >= threshold``; the only difference from the sort-based mask is at exact ties with the
    smallest kept value, where all tied tokens are kept (the sort order among ties is
    implementation-defined).
    """
    vocab = z.shape[-1]
    threshold = torch.full((z.shape[0],), -math.inf, dtype=z.dtype, device=z.device)
    if top_k is not None:
        k = min(top_k, vocab)
        threshold = torch.topk(z, k, dim=-1).values[:, -1]
    if top_p is not None and top_p < 1.0:
        filtered = z if top_k is None else z.masked_fill(z < threshold[:, None], -math.inf)
        sorted_z = torch.sort(filtered, dim=-1, descending=False).values
        cumulative = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        removed = cumulative <= (1.0 - top_p)
        removed[:, -1] = False
        n_removed = removed.sum(dim=-1, keepdim=True)
        threshold = torch.maximum(threshold, sorted_z.gather(-1, n_removed).squeeze(-1))
    return threshold


class _LogprobsFromLogits(torch.autograd.Function):
    """log softmax(logits / T) at ``tokens``, forward and backward in blocks of rows."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, top_k, top_p, chunk_rows):
        vocab = logits.shape[-1]
        n = tokens.numel()
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        flat_tokens = tokens.reshape(n)
        lse = torch.empty(n, dtype=compute_dtype, device=logits.device)
        token_z = torch.empty(n, dtype=compute_dtype, device=logits.device)
        truncated = top_k is not None or (top_p is not None and top_p < 1.0)
        thresholds = torch.empty(n, dtype=compute_dtype, device=logits.device) if truncated else None
        for start, stop, block in row_blocks(logits, chunk_rows):
            z = block.to(compute_dtype, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            tok = flat_tokens[start:stop]
            token_z[start:stop] = z.gather(1, tok[:, None]).squeeze(1)
            if truncated:
                thr = _keep_thresholds(z, top_k, top_p)
                thresholds[start:stop] = thr
                z.masked_fill_(z < thr[:, None], -math.inf)
            lse[start:stop] = torch.logsumexp(z, dim=-1)
            del z
        out = token_z - lse
        if truncated:
            out = torch.where(token_z < thresholds, torch.full_like(out, -math.inf), out)
        ctx.save_for_backward(logits, flat_tokens, lse, thresholds)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.truncated = truncated
        ctx.vocab = vocab
        return out.reshape(tokens.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, flat_tokens, lse, thresholds = ctx.saved_tensors
        temperature = ctx.temperature
        compute_dtype = lse.dtype
        grad_logits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad_flat = grad_logits.view(-1, ctx.vocab)
        g_all = grad_out.reshape(-1).to(compute_dtype) / temperature
        for start, stop, block in row_blocks(logits, ctx.chunk_rows):
            z = block.to(compute_dtype, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            if ctx.truncated:
                z.masked_fill_(z < thresholds[start:stop, None], -math.inf)
            z.sub_(lse[start:stop, None])
            p = z.exp_()  # softmax of the (truncated) scaled logits, block rows only
            g = g_all[start:stop]
            p.mul_(-g[:, None])
            p.scatter_add_(1, flat_tokens[start:stop, None], g[:, None])
            grad_flat[start:stop] = p
            del p, z
        return grad_logits, None, None, None, None, None


def _check_token_ids(tokens: torch.Tensor, vocab: int, vocab_source: str) -> None:
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        raise ValueError(
            f"tokens must be ids in [0, {vocab}) (V = {vocab_source}); got values in "
            f"[{int(tokens.min())}, {int(tokens.max())}]"
        )


def logprobs_from_logits(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Log-probabilities of ``tokens`` under ``softmax(logits / temperature)``, memory-bounded.

    ``logprob[b, t] = z[b, t, tok] - logsumexp_v z[b, t, v]`` with ``z = logits / temperature``
    (the distribution a sampler at that temperature draws from: the logits are divided by the
    sampling temperature before the log-softmax, as in Huang et al. 2024, "The N+ Implementation
    Details of RLHF with PPO"). With ``top_k`` / ``top_p`` the
    log-sum-exp runs over the tokens Hugging Face's ``TopKLogitsWarper`` then
    ``TopPLogitsWarper`` keep, applied after the temperature as ``generate`` does, so the result
    is the log-prob under the truncated distribution actually sampled.

    Memory: a ``torch.autograd.Function``. The forward walks blocks of ``chunk_size`` rows
    (rows = positions of the flattened leading dims), upcasting one block at a time to float32,
    and saves only the input ``logits`` (alive anyway), ``tokens`` and the per-row log-sum-exp
    (plus a per-row truncation threshold with top-k/top-p). The backward recomputes the softmax
    block by block and writes ``grad * (onehot - softmax(z)) / temperature`` into one gradient
    tensor of the logits' dtype. No float32 [B, T, V] tensor is ever alive. Non-contiguous
    ``logits`` (e.g. ``logits[:, :-1]``) are read in place when their rows can be flattened
    without a copy, otherwise gathered one block of rows at a time (never copied whole).

    Args:
        logits: [B, T, V] (any leading shape [..., V]), float32, bfloat16, float16 or float64.
        tokens: [B, T] integer token ids (shape ``logits.shape[:-1]``), each in [0, V).
        temperature: sampling temperature, > 0.
        top_k: keep the ``top_k`` largest scaled logits (ties with the k-th kept); None = off.
        top_p: nucleus mass in (0, 1]; None or 1.0 = off. Ties with the smallest kept value are
            all kept (Hugging Face's sort order among exact ties is implementation-defined).
        chunk_size: rows per block; default ``max(1, 2**24 // V)`` (a 64 MiB float32 block).

    Returns:
        [B, T] float32 (float64 when ``logits`` are float64) log-probs, differentiable with
        respect to ``logits``. A token outside the top-k/top-p kept set has probability 0 under
        the sampled distribution: its log-prob is ``-inf`` (a sampler cannot have produced it, so
        the log-probs were requested with settings that differ from the sampler's); its
        gradient stays finite (``-softmax / temperature``), but any loss using it will be inf/NaN.

    Raises:
        TypeError: ``logits``/``tokens`` not tensors, ``logits`` not floating, ``tokens`` not
            integer, ``top_k`` not an int.
        ValueError: ``tokens`` shape differs from ``logits.shape[:-1]``; a token id outside
            [0, V); ``temperature`` <= 0 or not finite; ``top_k`` < 1; ``top_p`` outside (0, 1];
            ``chunk_size`` < 1.
    """
    logits = check_tensor(logits, "logits")
    tokens = check_tensor(tokens, "tokens")
    check_floating(logits, "logits")
    if logits.dim() < 1:
        raise ValueError("logits must have a vocabulary dimension: shape [B, T, V]")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor of token ids, got dtype {tokens.dtype}")
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"tokens must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, "
            f"got {tuple(tokens.shape)}"
        )
    vocab = logits.shape[-1]
    _check_token_ids(tokens, vocab, "logits.shape[-1]")
    temperature = check_temperature(temperature)
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, or None to disable top-k truncation; got {top_k}")
        top_k = int(top_k)
    if top_p is not None:
        top_p = float(top_p)
        if not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], or None to disable nucleus truncation; got {top_p}")
    chunk_size = check_chunk_size(chunk_size, _default_chunk_rows(vocab))
    tokens = tokens.to(device=logits.device, dtype=torch.long)
    return _LogprobsFromLogits.apply(logits, tokens, temperature, top_k, top_p, int(chunk_size))


def _block_logits_grad(z, tokens, g_lp, g_h, entropy, start: int, stop: int, temperature: float):
    """dL/d(untempered logits) of rows ``start:stop`` from their log-probs ``z`` (overwritten):
    ``g_lp (onehot - p) - g_H p (log p + H)``, divided by the temperature. ``g_h`` (the entropy's
    gradient) is None when the entropy is not differentiated; then ``entropy`` is not read."""
    g = g_lp[start:stop, None]
    if g_h is not None:
        # d/dz of (g_lp * log p_tok + g_H * H) = g_lp (onehot - p) - g_H p (log p + H)
        p = torch.exp(z)
        z.clamp_(min=_NEG_LARGE)  # p = 0 where z = -inf: 0 x finite, not 0 x inf
        z.add_(entropy[start:stop, None]).mul_(g_h[start:stop, None]).add_(g)
        d = p.mul_(z).neg_()
        del p
    else:
        d = z.exp_().mul_(-g)
    d.scatter_add_(1, tokens[start:stop, None], g)
    if temperature != 1.0:
        d.div_(temperature)
    return d


def _block_matmul_grads(d, h, weight, grad_hidden_rows, grad_weight) -> None:
    """One block's ``grad_hidden_rows = d @ weight`` and ``grad_weight += d^T h`` (either may be
    None). bfloat16 operands multiply in bf16, as autocast runs an unfused linear's backward: in
    float32 these matmuls made a bf16-mixed step 1.06x as long on an AVX512-BF16 CPU
    (benchmarks/levers.py --lever head_matmuls); each block's weight-gradient product is rounded
    once to bf16 and summed in float32. Other operands keep the weight gradient in float32."""
    if grad_hidden_rows is not None:
        if grad_hidden_rows.dtype == d.dtype:
            torch.mm(d, weight, out=grad_hidden_rows)
        else:
            grad_hidden_rows.copy_(torch.mm(d, weight))
    if grad_weight is not None:
        if d.dtype == torch.bfloat16:
            grad_weight += torch.mm(d.t(), h)
        else:
            grad_weight.addmm_(d.t().to(grad_weight.dtype), h.to(grad_weight.dtype))


class _LogprobsFromHidden(torch.autograd.Function):
    """log softmax((hidden @ W^T + b) / T) at ``tokens`` (and the entropy), logits never stored."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, temperature, want_entropy, chunk_rows):
        n = tokens.shape[0]
        compute_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lse = torch.empty(n, dtype=compute_dtype, device=hidden.device)
        token_z = torch.empty(n, dtype=compute_dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=compute_dtype, device=hidden.device) if want_entropy else None
        logits_dtype = hidden.dtype
        for start in range(0, n, chunk_rows):
            stop = min(n, start + chunk_rows)
            z = torch.nn.functional.linear(hidden[start:stop], weight, bias)
            logits_dtype = z.dtype  # under autocast the matmul's (bf16/fp16), not hidden's
            z = z.to(compute_dtype)
            if temperature != 1.0:
                z.div_(temperature)
            token_z[start:stop] = z.gather(1, tokens[start:stop, None]).squeeze(1)
            zmax = z.amax(dim=-1, keepdim=True)
            z.sub_(zmax)  # z - max: every exp <= 1
            if want_entropy:
                e = torch.exp(z)
                total = e.sum(dim=-1)
                z.clamp_(min=_NEG_LARGE)  # a -inf logit (p = 0) adds 0 x finite = 0, not NaN
                # H = log S - sum(e * (z - max)) / S with S = sum(e)
                dot = e.mul_(z).sum(dim=-1)
                log_total = total.log()
                entropy[start:stop] = log_total - dot / total
                del e
            else:
                log_total = z.exp_().sum(dim=-1).log()
            lse[start:stop] = zmax.squeeze(1) + log_total
            del z
        logprobs = token_z - lse
        ctx.save_for_backward(hidden, weight, bias, tokens, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        ctx.logits_dtype = logits_dtype
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, tokens, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        compute_dtype = lse.dtype
        n = tokens.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros(n, dtype=compute_dtype, device=hidden.device)
        g_lp = grad_logprobs.to(compute_dtype)
        g_h = grad_entropy.to(compute_dtype) if grad_entropy is not None else None
        grad_hidden = torch.empty_like(hidden) if need_h else None
        # Weight gradients accumulate over blocks in float32 (float64 for a float64 model).
        grad_weight = torch.zeros(weight.shape, dtype=compute_dtype, device=weight.device) if need_w else None
        grad_bias = None
        if need_b:
            grad_bias = torch.zeros(weight.shape[0], dtype=compute_dtype, device=weight.device)
        # The blocks' logits again, as the forward computed them, whatever autocast the backward
        # is called under (the trainer's runs outside the forward's): logits recomputed in another
        # dtype than the forward's log-sum-exp came from give a softmax that does not sum to 1
        # (0.91-1.10 for float32 against bf16 on SmolLM2's logits), the gradient of neither.
        ld = ctx.logits_dtype
        weight_z = weight.to(ld)
        bias_z = bias.to(ld) if bias is not None else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, ctx.chunk_rows):
                stop = min(n, start + ctx.chunk_rows)
                h = hidden[start:stop]
                h_ld = h.to(ld)
                z = torch.nn.functional.linear(h_ld, weight_z, bias_z).to(compute_dtype)
                if temperature != 1.0:
                    z.div_(temperature)
                z.sub_(lse[start:stop, None])  # log p
                d = _block_logits_grad(z, tokens, g_lp, g_h, entropy, start, stop, temperature)
                if need_b:
                    grad_bias += d.sum(dim=0)
                rows = grad_hidden[start:stop] if need_h else None
                if ld == torch.bfloat16:  # float32's exponent range: a scaled gradient fits
                    _block_matmul_grads(d.to(ld), h_ld, weight_z, rows, grad_weight)
                else:  # float16 would overflow at |dL/dz| > 65504 (GradScaler's 2^16 x a token's weight)
                    _block_matmul_grads(d.to(hidden.dtype), h, weight, rows, grad_weight)
                del d, z
        if need_w:
            grad_weight = grad_weight.to(weight.dtype)
        if need_b:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def logprobs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
    with_entropy: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``tokens`` (and the entropy) from final hidden states and the output layer,
    without ever storing the logits.

    The logits ``z = (hidden @ weight^T + bias) / temperature`` are computed one block of rows
    at a time; each block gives ``logprob = z[tok] - logsumexp(z)`` and, with ``with_entropy``,
    ``H = -sum_v p_v log p_v`` of the full tempered distribution, then is freed. Only
    ``hidden``, the per-row log-sum-exp and entropy are saved; the backward recomputes each
    block's logits (one extra output-layer matmul, in the dtype the forward's matmul ran in, with
    autocast off: after a bf16/fp16 autocast forward it casts ``hidden`` and ``weight`` as the
    autocast did, whatever autocast ``backward()`` is called under, so it differentiates the
    forward's logits) and applies
    ``dL/dz = g_lp (onehot - p) - g_H p (log p + H)`` (the log-prob at the sampling temperature and
    the entropy bonus c2 H of Schulman et al. 2017, eq. 9), then ``dL/dhidden = dL/dz W / T`` and
    ``dL/dW = (dL/dz)^T hidden / T``: in bf16 after a bf16 forward (as autocast differentiates an
    unfused linear; each block's weight product summed in float32), otherwise with the weight
    gradient in float32 (after a float16 forward too: float16 cannot hold a loss-scaled dL/dz).
    The result equals
    ``logprobs_from_logits(lm_head(hidden), tokens, temperature)`` and
    ``entropy_from_logits(...)`` up to float rounding (tested in float64), with no [N, V] tensor
    alive: the largest temporary is one block (32 MiB of float32 by default), and under autocast
    the backward's low-precision copy of ``weight`` (as the autocast forward held) and, in bf16,
    one block's [V, H] weight-gradient product before it is added. Blocks of logits
    computed in a bf16/fp16 model's dtype are upcast to float32 before the softmax, as in
    :func:`logprobs_from_logits`. Top-k / top-p truncation is not supported here (use
    :func:`logprobs_from_logits` on the logits).

    Args:
        hidden: [N, H] final hidden states (after the last norm) at the N positions that predict
            ``tokens``; float32, bfloat16, float16 or float64.
        weight: [V, H] output-layer weight (the lm_head / tied embedding), same dtype as hidden.
        tokens: [N] integer token ids in [0, V).
        temperature: sampling temperature, > 0.
        bias: optional [V] output-layer bias.
        with_entropy: also return the [N] entropy, differentiable (use ``.detach()`` for a
            diagnostic; an unused entropy costs no backward work).
        chunk_size: rows per block; default ``max(1, 2**23 // V)``.

    Returns:
        ``(logprobs, entropy)``: [N] float32 (float64 for float64 inputs) log-probs in nats,
        differentiable w.r.t. ``hidden``, ``weight`` and ``bias``; entropy [N] in nats, or None
        without ``with_entropy``.

    Raises:
        TypeError: an argument of the wrong type (names it).
        ValueError: shapes that do not fit (names the argument and the expected shape); a token
            id outside [0, V); ``temperature`` <= 0; ``chunk_size`` < 1.
    """
    hidden = check_tensor(hidden, "hidden")
    weight = check_tensor(weight, "weight")
    tokens = check_tensor(tokens, "tokens")
    if not hidden.is_floating_point() or hidden.dim() != 2:
        raise ValueError(f"hidden must be a floating [N, H] tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H] with H = {hidden.shape[1]}, got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"bias must be None or a [V] = [{weight.shape[0]}] tensor")
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must be an integer tensor of token ids, got dtype {tokens.dtype}")
    if tuple(tokens.shape) != (hidden.shape[0],):
        raise ValueError(f"tokens must have shape [N] = [{hidden.shape[0]}], got {tuple(tokens.shape)}")
    vocab = weight.shape[0]
    _check_token_ids(tokens, vocab, "weight.shape[0]")
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size, max(1, _HEAD_BLOCK_ELEMENTS // max(1, vocab)))
    tokens = tokens.to(device=hidden.device, dtype=torch.long)
    logprobs, entropy = _LogprobsFromHidden.apply(
        hidden, weight, bias, tokens, temperature, bool(with_entropy), int(chunk_size)
    )
    return logprobs, entropy
