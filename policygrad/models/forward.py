"""Model forward kernels of the training step: log-probs of response tokens (and values' inputs).

- :func:`response_logits` / :func:`response_hidden`: the outputs that predict each response token,
  with each distinct prompt run once on a shared KV cache;
- :func:`~policygrad.models.packing.packed_response_hidden` (its own module): final hidden states
  at the valid response positions only, responses packed end to end on their prompt's cache (no
  work on padding);
- :func:`policy_logprobs`: float32 log-probs (and entropy) of the sampled tokens under the
  sampled distribution, from hidden states block by block where the model allows it;
- :func:`inference_logprobs`: the same without autograd, in micro-batches (old and reference
  log-probs);
- :func:`lm_loss`: next-token negative log-likelihood of text (the PPO-ptx term);
- :class:`Float32Head` / :func:`float32_head`: an output head that computes in float32 under a
  bf16/fp16 autocast (``model.lm_head_dtype: float32``).
"""

from __future__ import annotations

import torch

from policygrad.core.logprobs import logprobs_from_hidden, logprobs_from_logits
from policygrad.core.losses import entropy_from_logits
from policygrad.core.masking import masked_mean
from policygrad.models.packing import packed_response_hidden
from policygrad.rollout.base import Rollout, SamplingParams

__all__ = [
    "PLAIN_HEAD_MODEL_TYPES",
    "Float32Head",
    "call_as_forward",
    "float32_head",
    "inference_logprobs",
    "is_sharded_root",
    "lm_loss",
    "no_grad_context",
    "plain_output_head",
    "policy_logprobs",
    "resolve_sampling",
    "response_hidden",
    "response_logits",
]

# ----------------------------------------------------------------------------------------------
# Log-probs of response tokens: logits only at response positions.


def response_logits(model, rollout: Rollout, *, share_prompts: bool = True) -> torch.Tensor:
    """Logits that predict each response token, computed only at those positions.

    With ``share_prompts`` (the default), rows whose prompts are identical (the G samples of a
    prompt) run the prompt through the model once: one forward over the distinct prompts fills a
    KV cache, the cache is indexed out to the B rows (``index_select``, so in the backward the
    gradients of the G rows sum into the one prompt pass), and a second forward runs the response
    tokens on top of it. The result equals the plain forward over ``cat(prompt, response)`` up to
    float rounding (the same attention over the same keys), at (n_prompts x P + B x T) tokens of
    work instead of B x (P + T). It is used when some prompt repeats and the model keeps a cache
    (not under gradient checkpointing, which turns the cache off).

    Args:
        model: a causal LM (plain or peft-wrapped) that accepts ``logits_to_keep``.
        rollout: left-padded prompts and right-padded responses.
        share_prompts: run each distinct prompt once (see above); False runs every row whole.

    Returns:
        logits [B, T, V] in the model's dtype. ``logits[:, t]`` is computed from the prompt and
        response tokens before t (it is the last-prompt-token position for t = 0).
    """
    return _response_outputs(model, rollout, share_prompts=share_prompts, decoder=None)


def response_hidden(model, rollout: Rollout, *, share_prompts: bool = True) -> torch.Tensor:
    """Final hidden states (after the last norm) at the positions that predict each response
    token: :func:`response_logits` without the output layer, for models where
    :func:`plain_output_head` returns one.

    Returns:
        [B, T, H] in the model's dtype; ``lm_head(response_hidden(...))`` equals
        ``response_logits(...)``.

    Raises:
        ValueError: the model's logits are not a plain linear function of its hidden states.
    """
    head = plain_output_head(model)
    if head is None:
        raise ValueError(
            f"{type(model).__name__}: its logits are not lm_head(last hidden state); use response_logits"
        )
    return _response_outputs(model, rollout, share_prompts=share_prompts, decoder=head[0])


# Model types whose ``ForCausalLM.forward`` computes ``logits = lm_head(last_hidden_state)`` with
# nothing after it (no soft-capping, logit scale or extra norm), so log-probs can be computed
# from the hidden states and the lm_head weight directly.
PLAIN_HEAD_MODEL_TYPES: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class Float32Head(torch.nn.Linear):
    """The LM head computing in float32 inside a bf16/fp16 autocast region: the hidden states
    (float32, or the autocast dtype) are upcast and ``hidden @ W^T + b`` runs with autocast off,
    so the logits, and the log-softmax after them, keep float32's 24 mantissa bits instead of
    bf16's 8 (ScaleRL, Khatri et al. 2025, "The Art of Scaling RL Compute"). The weights stay
    what they are (float32 master weights under a mixed precision); outside autocast it equals
    ``torch.nn.Linear`` on float32 inputs. Made by :func:`float32_head` (a class swap: the
    parameters, the state dict and ``save_pretrained`` are unchanged, and a deep copy keeps it).

    Shapes: input [..., H] (any floating dtype), output [..., V] float32.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(hidden.device.type, enabled=False):
            return torch.nn.functional.linear(hidden.float(), self.weight.float(), bias)


def float32_head(model) -> torch.nn.Module:
    """Swap ``model``'s output head (``get_output_embeddings()``, of the base model when peft
    wraps it) to :class:`Float32Head`, in place; tied embeddings stay tied (only the head's
    forward changes). Returns the head.

    Raises:
        ValueError: the head is not a plain ``torch.nn.Linear`` (nothing else is converted)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is torch.nn.Linear:
        head.__class__ = Float32Head
    elif not isinstance(head, Float32Head):
        raise ValueError(
            f"model.lm_head_dtype=float32 needs an output head that is a plain torch.nn.Linear; "
            f"{type(base).__name__}'s is {type(head).__module__}.{type(head).__qualname__} (a LoRA "
            "adapter on lm_head is one): drop lm_head from model.lora.target_modules or unset "
            "model.lm_head_dtype"
        )
    return head


def plain_output_head(model):
    """``(decoder, lm_head)`` when ``model``'s logits are exactly ``lm_head(decoder(...)[0])``
    with ``lm_head`` a plain ``torch.nn.Linear`` or :class:`Float32Head` (model type in
    :data:`PLAIN_HEAD_MODEL_TYPES`, peft-wrapped or not, lm_head not adapted); None otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if type(head) not in (torch.nn.Linear, Float32Head) or decoder is None or decoder is base:
        return None
    return decoder, head


def _response_outputs(model, rollout: Rollout, *, share_prompts: bool, decoder) -> torch.Tensor:
    """Logits (``decoder`` None: the whole model, lm_head only at response positions) or final
    hidden states (``decoder`` given) at the T positions that predict the response tokens."""

    def run(input_ids, attention_mask, position_ids, keep, past_key_values=None, use_cache=False):
        inputs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "use_cache": use_cache,
        }
        if decoder is None:
            # Inside call_as_forward (FSDP) ``model.forward`` is the kernel itself and the root's
            # hooks have run: the model's own forward, not ``model(...)``.
            forward = type(model).forward.__get__(model) if _in_call_as_forward(model) else model
            out = forward(**inputs, logits_to_keep=keep)
            return out.logits, out.past_key_values
        out = decoder(**inputs)
        hidden = out.last_hidden_state
        if isinstance(keep, int):
            hidden = hidden[:, -keep:] if keep else hidden
        else:
            hidden = hidden[:, keep]
        return hidden, out.past_key_values

    input_ids = rollout.input_ids()
    P = rollout.prompt_ids.shape[1]
    T = rollout.response_ids.shape[1]
    if share_prompts and rollout.batch_size > 1 and not getattr(model, "is_gradient_checkpointing", False):
        key = torch.cat([rollout.prompt_ids, rollout.prompt_mask.to(rollout.prompt_ids)], dim=1)
        distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
        if distinct.shape[0] < rollout.batch_size:
            prompt_ids, prompt_mask = distinct[:, :P], distinct[:, P:]
            position_ids = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
            out, cache = run(prompt_ids, prompt_mask, position_ids, 1, use_cache=True)
            first = out[:, -1:].index_select(0, inverse)  # the last prompt token predicts token 0
            if T == 1:
                return first
            if hasattr(cache, "reorder_cache"):  # a transformers Cache (otherwise: no sharing)
                cache.reorder_cache(inverse)  # [n, ...] -> [B, ...] by index_select: differentiable
                # Response tokens 0 .. T-2 predict tokens 1 .. T-1 (the last predicts nothing kept).
                out, _ = run(
                    rollout.response_ids[:, : T - 1],
                    rollout.attention_mask()[:, : P + T - 1],
                    rollout.position_ids()[:, P : P + T - 1],
                    0,
                    past_key_values=cache,
                    use_cache=True,
                )
                return torch.cat([first, out], dim=1)
    # Positions P-1 .. P+T-2 predict response tokens 0 .. T-1; the lm_head runs on those only,
    # and the result is a contiguous [B, T, V] tensor.
    keep = torch.arange(P - 1, P + T - 1, device=input_ids.device)
    out, _ = run(input_ids, rollout.attention_mask(), rollout.position_ids(), keep)
    return out


def _in_call_as_forward(model) -> bool:
    """``model`` is running :func:`call_as_forward`."""
    return bool(model.__dict__.get("_running_as_forward", False))


def is_sharded_root(model) -> bool:
    """``model`` is an FSDP2 unit (``fully_shard``) not already running :func:`call_as_forward`."""
    # imported here: torch.distributed's FSDP loads only where a model may be sharded
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) and not _in_call_as_forward(model)


def call_as_forward(model, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` run as ``model``'s forward: through ``model.__call__``, so the hooks
    FSDP2 puts around an FSDP unit's forward fire. The pre-forward hook gathers the unit's own
    parameters (a root's embeddings, final norm and output head), the post-forward hook arranges
    the reduce-scatter of their gradients in the backward. Needed because the kernels here call
    the decoder and the head weight directly instead of ``model(...)``."""

    def forward(*a, **k):
        return fn(*a, **k)

    model.__dict__["forward"] = forward  # an instance attribute: __call__ runs it inside the hooks
    model.__dict__["_running_as_forward"] = True
    try:
        return model(*args, **kwargs)
    finally:
        del model.__dict__["forward"]
        model.__dict__["_running_as_forward"] = False


_UNSET = object()


def resolve_sampling(
    rollout: Rollout,
    sampling: SamplingParams | None = None,
    *,
    temperature=_UNSET,
    top_k=_UNSET,
    top_p=_UNSET,
) -> SamplingParams:
    """The distribution a forward scores the tokens under: ``sampling`` when given; else, when any
    of the loose ``temperature`` / ``top_k`` / ``top_p`` keywords is given, those (an omitted
    ``top_k`` / ``top_p`` is off, an omitted ``temperature`` is the rollout's); else the rollout's
    own ``rollout.sampling``. ``top_k`` 0 and None, ``top_p`` 1.0 and None mean the same (off).

    Raises:
        TypeError: ``sampling`` given together with a loose keyword.
    """
    loose = {
        k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not _UNSET
    }
    if sampling is not None:
        if loose:
            raise TypeError(f"give either sampling= or {'/'.join(loose)}=, not both")
        return sampling
    if not loose:
        return rollout.sampling
    return SamplingParams(
        loose.get("temperature", rollout.sampling.temperature), loose.get("top_k"), loose.get("top_p")
    )


def policy_logprobs(
    model,
    rollout: Rollout,
    *,
    sampling: SamplingParams | None = None,
    temperature: float = _UNSET,
    top_k: int | None = _UNSET,
    top_p: float | None = _UNSET,
    with_entropy: bool | str = False,
    share_prompts: bool = True,
    fused_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probs [B, T] of the response tokens under the sampled distribution
    (``logits / temperature`` with the sampler's top-k/top-p truncation; by default the rollout's
    ``rollout.sampling``, or ``sampling`` / the loose keywords, see :func:`resolve_sampling`:
    ``sampling=rollout.sampling.tempered()`` scores under the full tempered softmax), and the entropy [B, T]
    of the full tempered distribution when ``with_entropy`` is True (detached, a diagnostic) or
    ``"grad"`` (differentiable, for an entropy bonus); None otherwise. ``share_prompts``: run each
    distinct prompt once (:func:`response_logits`).

    Without top-k/top-p truncation and for a model whose logits are a plain linear layer of its
    hidden states (:func:`plain_output_head`), the logits are never materialised: the hidden
    states at the valid response positions (``response_mask`` > 0) go through
    :func:`policygrad.core.logprobs.logprobs_from_hidden` block by block, and positions outside
    the mask get log-prob 0 and entropy 0. Otherwise, or with ``fused_head=False`` (a caller
    that hooks the lm_head module), the [B, T, V] logits are computed at the response positions
    (every position, masked or not, gets its value).

    Observed tokens (``rollout.observation_mask``: tool output, environment text) are inputs of
    the forward (:meth:`~policygrad.rollout.base.Rollout.attention_mask`) but are not scored:
    log-prob and entropy are read at the ``response_mask`` positions only.

    A :class:`Float32Head` (``model.lm_head_dtype: float32``) computes the head's matmul and the
    log-softmax in float32 with autocast off, on the (upcast) hidden states of the body's
    autocast forward.

    An FSDP2-sharded ``model`` runs this as its own forward (:func:`call_as_forward`), with one
    decoder call per batch (no prompt sharing): each call all-gathers every layer, so the number
    of calls must not depend on the data, or the ranks' collectives would not pair up."""
    sampling = resolve_sampling(rollout, sampling, temperature=temperature, top_k=top_k, top_p=top_p)
    if is_sharded_root(model):
        return call_as_forward(
            model,
            policy_logprobs,
            model,
            rollout,
            sampling=sampling,
            with_entropy=with_entropy,
            share_prompts=False,
            fused_head=fused_head,
        )
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    head = plain_output_head(model) if fused_head and not sampling.truncates else None
    if head is not None:
        decoder, lm_head = head
        valid = rollout.response_mask > 0
        hidden_valid = None
        if share_prompts and not getattr(model, "is_gradient_checkpointing", False):
            hidden_valid = packed_response_hidden(decoder, rollout)
            if hidden_valid is not None and rollout.observation_mask is not None:
                hidden_valid = hidden_valid[valid[rollout.seen_mask()]]  # the chosen of the seen tokens
        if hidden_valid is None:
            hidden = _response_outputs(model, rollout, share_prompts=share_prompts, decoder=decoder)
            hidden_valid = hidden[valid]
        if type(lm_head) is Float32Head:  # the head's matmul in float32, outside the autocast
            with torch.autocast(hidden_valid.device.type, enabled=False):
                lp, ent = logprobs_from_hidden(
                    hidden_valid.float(),
                    lm_head.weight.float(),
                    rollout.response_ids[valid],
                    temperature=temperature,
                    bias=None if lm_head.bias is None else lm_head.bias.float(),
                    with_entropy=bool(with_entropy),
                )
        else:
            lp, ent = logprobs_from_hidden(
                hidden_valid,
                lm_head.weight,
                rollout.response_ids[valid],
                temperature=temperature,
                bias=lm_head.bias,
                with_entropy=bool(with_entropy),
            )
        logprobs = lp.new_zeros(valid.shape).masked_scatter(valid, lp)
        entropy = None
        if with_entropy:
            ent = ent if with_entropy == "grad" else ent.detach()
            entropy = ent.new_zeros(valid.shape).masked_scatter(valid, ent)
        return logprobs, entropy
    logits = response_logits(model, rollout, share_prompts=share_prompts)
    kwargs = {}
    if top_k is not None:
        kwargs["top_k"] = top_k
    if top_p is not None:
        kwargs["top_p"] = top_p
    logprobs = logprobs_from_logits(logits, rollout.response_ids, temperature=temperature, **kwargs)
    entropy = None
    if with_entropy == "grad":
        entropy = entropy_from_logits(logits, temperature=temperature)
    elif with_entropy:
        with torch.no_grad():  # a diagnostic only: no graph through the [B, T, V] logits
            entropy = entropy_from_logits(logits.detach(), temperature=temperature)
    return logprobs, entropy


def no_grad_context(model):
    """``torch.inference_mode()``, or ``torch.no_grad()`` for an FSDP2 unit: FSDP reuses the
    buffers it gathers parameters into across passes, and a buffer first written in inference
    mode cannot be written again outside it (by the training forwards)."""
    # imported here: torch.distributed's FSDP loads only where a model may be sharded
    from torch.distributed.fsdp import FSDPModule

    return torch.no_grad() if isinstance(model, FSDPModule) else torch.inference_mode()


def inference_logprobs(
    model,
    rollout: Rollout,
    *,
    sampling: SamplingParams | None = None,
    temperature: float = _UNSET,
    top_k: int | None = _UNSET,
    top_p: float | None = _UNSET,
    micro_batch_size: int,
) -> torch.Tensor:
    """:func:`policy_logprobs` without autograd, ``micro_batch_size`` rows at a time: the old
    log-probs of the sampling policy (the default: ``rollout.sampling``), or the reference's (pass
    ``sampling=rollout.sampling.tempered()``: a reference is never sampled from, so its log-probs
    are of the full tempered softmax). The distribution is chosen as in :func:`resolve_sampling`;
    the loose keywords are the older form (``temperature=`` alone is the full tempered softmax).

    Each micro-batch is trimmed to its own longest response and prompt (no work on columns that
    are padding in all of its rows); the rest of its rows stays 0.

    Returns:
        float32 [B, T], a normal tensor (not an inference tensor), usable next to autograd tensors.
    """
    sampling = resolve_sampling(rollout, sampling, temperature=temperature, top_k=top_k, top_p=top_p)
    with no_grad_context(model):
        out = torch.zeros(rollout.response_ids.shape, dtype=torch.float32, device=rollout.response_ids.device)
        for start in range(0, rollout.batch_size, micro_batch_size):
            rows = torch.arange(start, min(start + micro_batch_size, rollout.batch_size))
            sub = rollout.select(rows).trim()
            lp, _ = policy_logprobs(model, sub, sampling=sampling)
            out[start : start + sub.batch_size, : lp.shape[1]] = lp
        return out


def lm_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood of right-padded text, the PPO-ptx term.

    ``L_ptx = -mean over real next tokens of log pi(x_{j+1} | x_{<=j})`` at temperature 1 (the
    model's own distribution, not the sampling temperature: this is plain language modelling).
    InstructGPT maximises ``E[r - beta log(pi/pi_SFT)] + gamma E_pretrain[log pi(x)]`` (Ouyang et
    al. 2022, eq. 2) with ``gamma = 27.8`` for its PPO-ptx models; the trainer adds
    ``ptx.coef * L_ptx`` to the policy loss.

    Args:
        model: a causal LM.
        input_ids: LongTensor [b, L], right-padded.
        attention_mask: [b, L], 1 on real tokens (a prefix of each row).

    Returns:
        0-d float32 loss, differentiable with respect to the model's parameters.

    Raises:
        ValueError: shapes differ, fewer than 2 columns, or no row with 2 real tokens.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both "
            "be [b, L] with L >= 2"
        )
    mask = attention_mask[:, 1:] * attention_mask[:, :-1]
    if not bool(mask.any()):
        raise ValueError("ptx_loss needs at least one row with 2 real tokens")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).logits
    logprobs = logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature=1.0)
    return -masked_mean(logprobs, mask)
