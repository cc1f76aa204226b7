"""VinePPO's Monte-Carlo values: the estimator inputs ``vine_values`` and ``vine_segments`` of
the ``vineppo`` advantage estimator (Kazemnejad et al. 2024, "VinePPO: Unlocking RL Potential
for LLM Reasoning Through Refined Credit Assignment", section 4, eq. 5).

- :func:`split_points`: where a response is cut into steps (after a newline, or every L tokens),
  at most S points per response.
- The producer's half (:func:`sample_vine`): K continuations from each prompt plus response
  prefix, with the rollout engine (the policy that sampled the batch), in calls of at most the
  batch's number of sequences;
  each is cut to the response budget left after its prefix and scored by the reward functions.
  It touches no trainer state and no collective (it may run ahead, see
  :mod:`policygrad.produce.production`).
- The trainer's half (:func:`finish_vine_values`): the continuations' rewards normalised like
  the batch's (the run's statistics, not updated; the truncation policy), averaged over the K
  of each state into ``V(s_i)``, laid out per token.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

import torch

from policygrad.core.advantages import VINEPPO_DEFAULTS
from policygrad.core.groups import group_mean_std
from policygrad.produce.stages import FinishParts, ProducerParts, SampledBatch
from policygrad.rollout.base import prompt_seed

__all__ = [
    "finish_vine_segments",
    "finish_vine_values",
    "newline_tokens",
    "sample_vine",
    "sample_vine_segments",
    "segment_index",
    "split_points",
    "vine_metrics",
    "vine_options",
]

_VINE_SEED = 0x56494E45  # "VINE": keeps the continuations' seeds apart from the batch's own


def vine_options(options: dict[str, Any]) -> dict[str, Any]:
    """``vineppo``'s options: the estimator's ``options`` (``advantage.options``) over
    :data:`~policygrad.core.advantages.VINEPPO_DEFAULTS`."""
    return {k: options.get(k, default) for k, default in VINEPPO_DEFAULTS.items()}


def split_points(
    lengths: Sequence[int],
    *,
    split: str,
    segment_tokens: int,
    max_splits: int,
    newlines: Sequence[Sequence[bool]] | None = None,
) -> list[list[int]]:
    """The split points inside each response: token offsets p with 0 < p < length, a state
    "prompt + the response's first p tokens" whose value VinePPO estimates.

    Args:
        lengths: the responses' lengths (valid tokens, EOS included).
        split: ``"newline"``: after every token whose text holds a newline (a reasoning step
            ends there, as the paper cuts steps); ``"fixed"``: every ``segment_tokens`` tokens.
        segment_tokens: L, the step length of ``"fixed"``.
        max_splits: S; with more candidates, S of them evenly spaced (the j-th of S is candidate
            ``floor(j * n / S)`` of n), so the value checkpoints cover the whole response.
        newlines: per response, per token, whether its text holds a newline (``"newline"`` only;
            :func:`newline_tokens`).

    Returns:
        one ascending list of offsets per response (empty: the prompt's value only).

    Raises:
        ValueError: ``split="newline"`` without ``newlines``; an unknown ``split``.
    """
    out = []
    for row, length in enumerate(lengths):
        length = int(length)
        if split == "fixed":
            candidates = list(range(segment_tokens, length, segment_tokens))
        elif split == "newline":
            if newlines is None:
                raise ValueError("split_points: split='newline' needs newlines (per token: holds a newline)")
            candidates = [t + 1 for t in range(length - 1) if newlines[row][t]]
        else:
            raise ValueError(f"split_points: split must be 'newline' or 'fixed', got {split!r}")
        n = len(candidates)
        if n > max_splits:
            candidates = [candidates[(j * n) // max_splits] for j in range(max_splits)]
        out.append(candidates)
    return out


def newline_tokens(tokenizer, response_ids: torch.Tensor, lengths: Sequence[int]) -> list[list[bool]]:
    """Per response, per valid token: whether the token's own text holds a newline (each distinct
    id decoded once)."""
    rows = [response_ids[i, : int(n)].tolist() for i, n in enumerate(lengths)]
    vocab = sorted({t for row in rows for t in row})
    texts = tokenizer.batch_decode([[t] for t in vocab], skip_special_tokens=False)
    has = {t: "\n" in text for t, text in zip(vocab, texts)}
    return [[has[t] for t in row] for row in rows]


def segment_index(splits: list[list[int]], width: int) -> torch.Tensor:
    """float32 [B, width]: the segment of each token (token t is in segment i when
    ``s_i <= t < s_{i+1}``, ``s_0 = 0``)."""
    out = torch.zeros(len(splits), width)
    cols = torch.arange(width)
    for row, points in enumerate(splits):
        for p in points:
            out[row] += (cols >= p).float()
    return out


def _chosen_splits(parts: ProducerParts, rollout) -> list[list[int]]:
    o = vine_options(parts.options)
    lengths = rollout.response_lengths.tolist()
    newlines = None
    if o["split"] == "newline":
        newlines = newline_tokens(parts.tokenizer, rollout.response_ids, lengths)
    return split_points(
        lengths,
        split=o["split"],
        segment_tokens=o["segment_tokens"],
        max_splits=o["max_splits"],
        newlines=newlines,
    )


def sample_vine(parts: ProducerParts, chosen) -> dict[str, Any]:
    """The producer's half: K continuations of every state and their raw rewards, sampled in
    engine calls of at most the batch's number of sequences.

    The states, in order: with ``prompt_value="rollouts"`` each prompt (once per group), then for
    every row its split points. Each continuation may use the response budget left after its
    prefix (``rollout.max_new_tokens - p`` tokens): it is cut there and counts as truncated, as
    the whole response would have been. With per-prompt seeds (``parts.per_prompt_seeds``) a
    state's seed depends on the run seed, the step, the row's place in its group and the prefix's
    tokens only (not on the rank or the batch).

    Returns:
        ``{"rewards": float32 [N*K] (the reward functions' weighted sums), "truncated": bool
        [N*K], "valid": bool [N*K], "splits": per row its split points, "prompt_states": the
        number of prompt states first, "tokens": continuation tokens generated, "sequences":
        N*K, "seconds": wall time}``.
    """
    start = time.perf_counter()
    sampling = parts.params
    o = vine_options(parts.options)
    K, G = o["rollouts"], chosen.group_size
    rollout = chosen.rollout
    splits = _chosen_splits(parts, rollout)
    states: list[tuple[int, int, int]] = []  # (row of chosen.rows, sample in group or -1, prefix p)
    if o["prompt_value"] == "rollouts":
        states += [(i, -1, 0) for i in range(len(chosen.rows))]
    states += [(b // G, b % G, p) for b, points in enumerate(splits) for p in points]
    if not states:
        return _payload([], [], [], splits, 0, 0, start)
    prefixes = []
    for i, g, p in states:
        response = rollout.response_ids[i * G + g, :p].tolist() if p else []
        prefixes.append(list(chosen.prompt_ids[i]) + response)
    seeds = None
    if parts.per_prompt_seeds:
        step = getattr(chosen, "step", 0)
        seeds = [
            prompt_seed(parts.seeds.run, step, _VINE_SEED, g, p, zlib.crc32(str(ids).encode()))
            for (_, g, p), ids in zip(states, prefixes)
        ]
    # Calls of at most the batch's own number of sequences: the engine never holds more than it
    # did for the batch (hf keeps a call's KV cache at once), and vLLM's per-step prefill stays
    # near the batch's (on CPU it fails on a seeded request whose prefill is split over steps).
    per_call = max(1, rollout.batch_size // K)
    continuations: list[list[int]] = []
    truncated: list[bool] = []
    for first in range(0, len(states), per_call):
        part = slice(first, first + per_call)
        more = parts.engine.generate(
            prefixes[part],
            group_size=K,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_new_tokens=parts.max_new_tokens - min(p for _, _, p in states[part]),
            prompt_seeds=seeds[part] if seeds is not None else None,
            ignore_eos=parts.ignore_eos,
        )
        lengths = more.response_lengths.tolist()
        continuations += [more.response_ids[j, : lengths[j]].tolist() for j in range(len(lengths))]
        truncated += more.truncated.cpu().tolist()
    texts_ids, tokens = [], 0
    for j, (i, g, p) in enumerate(s for s in states for _ in range(K)):
        room = parts.max_new_tokens - p
        if len(continuations[j]) > room:  # past the response's own budget: cut where it would have been
            continuations[j], truncated[j] = continuations[j][:room], True
        tokens += len(continuations[j])
        head = rollout.response_ids[i * G + g, :p].tolist() if p else []
        texts_ids.append(head + continuations[j])
    completions = parts.tokenizer.batch_decode(texts_ids, skip_special_tokens=True)
    rows = [chosen.rows[i] for i, _, _ in states]
    raw = parts.score(rows, completions, repeat=K)
    prompt_states = sum(1 for _, g, _ in states if g < 0)
    return _payload(raw.rewards, truncated, raw.valid, splits, prompt_states, tokens, start)


def _payload(rewards, truncated, valid, splits, prompt_states, tokens, start) -> dict[str, Any]:
    return {
        "rewards": torch.as_tensor(rewards, dtype=torch.float32),
        "truncated": torch.as_tensor(truncated, dtype=torch.bool),
        "valid": torch.as_tensor(valid, dtype=torch.bool),
        "splits": splits,
        "prompt_states": prompt_states,
        "tokens": tokens,
        "sequences": len(rewards),
        "seconds": time.perf_counter() - start,
    }


def state_values(parts: FinishParts, payload: dict[str, Any]) -> torch.Tensor:
    """float32 [N]: V of each state, the mean of its K continuations' rewards normalised like the
    batch's scores (:meth:`~policygrad.rewards.scoring.Scorer.finish_baseline`). A continuation
    whose reward function failed is left out; a state with none left is NaN."""
    K = vine_options(parts.options)["rollouts"]
    if not len(payload["rewards"]):
        return torch.zeros(0)
    scores = parts.scorer.finish_baseline(payload["rewards"], payload["truncated"]).float()
    valid = payload["valid"].view(-1, K)
    total = torch.where(valid, scores.view(-1, K), 0.0).sum(-1)
    count = valid.sum(-1)
    return torch.where(count > 0, total / count.clamp_min(1), float("nan"))


def finish_vine_values(parts: FinishParts, payload: dict[str, Any], batch: SampledBatch) -> torch.Tensor:
    """float32 [B, T]: ``V(s_i)`` on every token of segment i of each row of ``batch``.

    V(s_0) is the prompt's K-rollout value, or with ``prompt_value="group"`` the mean score of
    the row's G - 1 siblings (leave-one-out: the row's own reward would bias its baseline). A
    state without a valid continuation takes the value before it (the prompt's: 0 if none).
    """
    o = vine_options(parts.options)
    G = batch.group_size
    values = state_values(parts, payload)
    splits = payload["splits"]
    B, T = batch.rollout.response_mask.shape
    if len(splits) != B:  # the producer's rows are the batch's, in its order
        raise RuntimeError(f"vineppo: value rollouts of {len(splits)} rows for a batch of {B}")
    n_prompt = payload["prompt_states"]
    if o["prompt_value"] == "rollouts":
        first = values[:n_prompt].repeat_interleave(G)
    else:
        scores = batch.scores.scores.float()
        centered, _, _ = group_mean_std(scores, batch.rollout.group_index.cpu())
        mean = scores - centered
        first = (mean * G - scores) / max(G - 1, 1)
    first = torch.nan_to_num(first, nan=0.0)
    per_token = torch.zeros(B, T)
    cursor = n_prompt
    cols = torch.arange(T)
    for b, points in enumerate(splits):
        current = float(first[b])
        per_token[b] = current
        for p in points:
            v = float(values[cursor])
            cursor += 1
            current = current if v != v else v  # NaN: no valid continuation, keep the value before
            per_token[b] = torch.where(cols >= p, current, per_token[b])
    return per_token


def finish_vine_segments(
    parts: FinishParts,  # noqa: ARG001 (the provider signature)
    payload: dict[str, Any],
    batch: SampledBatch,
) -> torch.Tensor:
    """float32 [B, T]: the segment index of every token (:func:`segment_index`)."""
    return segment_index(payload["splits"], batch.rollout.response_mask.shape[1])


def vine_metrics(parts: FinishParts, payload: dict[str, Any]) -> dict[str, float]:
    """The extra generation's cost: continuation tokens and sequences (summed over ranks), split
    points per response, and this rank's seconds sampling and scoring them."""
    total = parts.dist.total
    rows = total(len(payload["splits"]))
    return {
        "vineppo/extra_tokens": float(total(payload["tokens"])),
        "vineppo/extra_sequences": float(total(payload["sequences"])),
        "vineppo/splits_mean": float(total(sum(map(len, payload["splits"])))) / max(rows, 1),
        "time/vineppo_s": float(payload["seconds"]),
    }


def sample_vine_segments(parts: ProducerParts, chosen) -> dict[str, Any]:
    """The producer's half of ``vine_segments``: the split points of every chosen row."""
    return {"splits": _chosen_splits(parts, chosen.rollout)}
