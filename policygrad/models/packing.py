"""The packed training forward: final hidden states at the valid response positions only, each
distinct prompt run once and its responses packed end to end on its KV cache, so no work is spent
on padding (:func:`packed_response_hidden`; the padded forward it falls back to:
:mod:`policygrad.models.forward`)."""

from __future__ import annotations

import torch

from policygrad.rollout.base import Rollout

__all__ = ["PACK_ROW_TOKENS", "packed_response_hidden"]

# Most response tokens one packed row holds: the attention inside a row costs (row length)^2,
# so rows are capped to keep the training forward linear in G and in the response length.
PACK_ROW_TOKENS = 512


def _full_sdpa_attention(config) -> bool:
    """The decoder's ``config`` asks for sdpa attention without a sliding window: the packed
    forward's conditions on the model."""
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":  # a boolean 4-D mask is what sdpa takes as is
        return False
    # A sliding window (Mistral's sliding_window, Qwen's use_sliding_window, sliding layer types)
    # is not in the packed mask, and its cache keeps only the window's last keys.
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    return "sliding_attention" not in (getattr(config, "layer_types", None) or ())


def _pack_rows(
    inputs: list[int], owner: list[int], row_tokens: int
) -> tuple[list[int], list[int], list[int], list[int]]:
    """Greedy packing of responses into packed rows ("bins"), in row order.

    Row b (``inputs[b]`` input tokens, prompt ``owner[b]``) joins its prompt's open bin while that
    stays within ``row_tokens`` tokens, else opens a new one; rows without inputs get no bin.

    Returns:
        (row_bin, row_offset, bin_prompt, bin_fill): per row, its bin and its first position in
        that bin (0 for a row without inputs); per bin, its prompt and its number of tokens.
    """
    B = len(inputs)
    row_bin, row_offset, bin_prompt, bin_fill = [0] * B, [0] * B, [], []
    open_bin: dict[int, int] = {}
    for b in range(B):
        if inputs[b] == 0:
            continue
        j = owner[b]
        k = open_bin.get(j)
        if k is None or bin_fill[k] + inputs[b] > row_tokens:
            k = len(bin_prompt)
            bin_prompt.append(j)
            bin_fill.append(0)
            open_bin[j] = k
        row_bin[b], row_offset[b] = k, bin_fill[k]
        bin_fill[k] += inputs[b]
    return row_bin, row_offset, bin_prompt, bin_fill


def packed_response_hidden(decoder, rollout: Rollout, *, row_tokens: int = PACK_ROW_TOKENS):
    """Final hidden states at the valid response positions, computed without padding.

    Each distinct prompt runs once (its KV cache is shared by the rows that repeat it, as in
    :func:`response_logits`); then the responses of a prompt are packed end to end into rows of
    at most ``row_tokens`` tokens (greedy, in row order; a longer response gets a row of its
    own), each row sitting on its prompt's cache. A 4-D attention mask lets every response token
    see its prompt's valid tokens and the earlier tokens of its own response only, and position
    ids continue each response from its prompt's length, so every hidden state equals the one of
    the plain forward over ``cat(prompt, response)`` up to float rounding. Work: (distinct
    prompts x P) + (valid response tokens) + the padding of the last row of each prompt, instead
    of B x T; attention per row at most ``row_tokens x (P + row_tokens)``.

    Args:
        decoder: the model's decoder stack (``plain_output_head(model)[0]``) with sdpa attention.
        rollout: left-padded prompts, right-padded responses whose seen tokens
            (:meth:`~policygrad.rollout.base.Rollout.seen_mask`: chosen, and observed where there
            is an ``observation_mask``) are a prefix of each row (the rollout invariant).

    Returns:
        [N, H] hidden states in the model's dtype, N = ``rollout.seen_mask().sum()``, in the
        row-major order of ``rollout.seen_mask()`` (row b, token t is predicted by the hidden
        state before it; without an ``observation_mask`` these are the ``response_mask``
        positions); None when packing does not apply (another attention kernel, a mask that is
        not a prefix, a model without a transformers cache), so the caller falls back to the
        padded forward (also for a sliding-window model and for T = 0).
    """
    if not _full_sdpa_attention(getattr(decoder, "config", None)):
        return None
    if rollout.response_ids.shape[1] == 0:
        return None
    mask = rollout.seen_mask()
    lengths = mask.sum(-1)
    B, T = mask.shape
    steps = torch.arange(T, device=mask.device)
    if not torch.equal(mask, steps[None] < lengths[:, None]):
        return None
    P = rollout.prompt_ids.shape[1]
    key = torch.cat([rollout.prompt_ids, rollout.prompt_mask.to(rollout.prompt_ids)], dim=1)
    distinct, inverse = torch.unique(key, dim=0, return_inverse=True)
    prompt_ids, prompt_mask = distinct[:, :P], distinct[:, P:]
    n = distinct.shape[0]
    prompt_lengths = prompt_mask.sum(-1)
    position_ids = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
    out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=position_ids, use_cache=True)
    last = out.last_hidden_state[:, -1]  # [n, H]: predicts token 0 of every row of that prompt
    cache = out.past_key_values
    if not hasattr(cache, "reorder_cache"):
        return None
    # Response tokens 0 .. len-2 of each row are inputs (token len-1 predicts nothing kept).
    inputs = (lengths - 1).clamp(min=0).tolist()
    owner = inverse.tolist()
    row_bin, row_offset, bin_prompt, bin_fill = _pack_rows(inputs, owner, row_tokens)
    device = rollout.response_ids.device
    index = torch.zeros(B, T, dtype=torch.long, device=device)
    index[:, 0] = inverse  # t = 0 reads the prompt's last hidden state
    if bin_prompt:
        nb, L = len(bin_prompt), max(bin_fill)
        ids = torch.zeros(nb, L, dtype=rollout.response_ids.dtype, device=device)
        pos = torch.zeros(nb, L, dtype=torch.long, device=device)
        segment = torch.full((nb, L), -1, dtype=torch.long, device=device)
        for b in range(B):
            k_b = inputs[b]
            if k_b == 0:
                continue
            k, o = row_bin[b], row_offset[b]
            ids[k, o : o + k_b] = rollout.response_ids[b, :k_b]
            pos[k, o : o + k_b] = prompt_lengths[owner[b]] + steps[:k_b]
            segment[k, o : o + k_b] = b
            index[b, 1 : k_b + 1] = n + k * L + o + steps[:k_b]
        bins = torch.tensor(bin_prompt, dtype=torch.long, device=device)
        causal = steps.new_ones(L, L, dtype=torch.bool).tril()
        same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0) & causal
        sees_prompt = (prompt_mask[bins] > 0)[:, None, :].expand(nb, L, P)
        allowed = torch.cat([sees_prompt, same], dim=-1)[:, None]  # [nb, 1, L, P + L]
        cache.reorder_cache(bins)  # [n, ...] -> [nb, ...] by index_select: differentiable
        packed = decoder(
            input_ids=ids, attention_mask=allowed, position_ids=pos, past_key_values=cache, use_cache=True
        ).last_hidden_state
        source = torch.cat([last, packed.reshape(nb * L, -1)], dim=0)
    else:
        source = last
    return source.index_select(0, index[mask])
