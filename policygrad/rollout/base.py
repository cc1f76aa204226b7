"""The rollout batch, its sampling parameters and the checks of a generation request (the interface
every generation engine implements: :mod:`policygrad.rollout.engine`).

Layout of a batch of B = n_prompts x G sequences (design.md, "Conventions"):

- prompts are left-padded, responses right-padded, so ``cat(prompt_ids, response_ids)`` has every
  prompt's last token in column P-1 and every response's first token in column P;
- the G samples of prompt i are rows i*G .. i*G+G-1;
- ``response_mask`` is 1 on the tokens the policy chose, up to and including the first
  end-of-sequence token, and 0 on padding and after EOS;
- ``sampler_logprobs`` are log-probs under the distribution that was actually sampled:
  ``softmax(logits / temperature)`` restricted to the top-k / top-p set and renormalised.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
from collections.abc import Sequence

import torch


def prompt_seed(*parts: int) -> int:
    """A sampling seed in [0, 2**62) that depends on ``parts`` only (SHA-256), e.g. ``(run seed,
    step, round, global prompt position)``."""
    digest = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def _normalise_sampling(temperature, top_k, top_p) -> tuple[float, int | None, float | None]:
    """``(temperature, top_k, top_p)`` checked, with the "off" values normalised: ``top_k`` None
    when off (None or 0), ``top_p`` None when off (None or 1.0)."""
    temperature = float(temperature)
    if not temperature > 0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or None = off), got {top_k}")
        top_k = int(top_k) or None
    if top_p is not None:
        top_p = float(top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 or None = off), got {top_p}")
        if top_p == 1.0:
            top_p = None
    return temperature, top_k, top_p


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The distribution a batch was sampled from: ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely tokens, then to the smallest set of mass >= ``top_p``, renormalised
    (or the argmax with ``greedy``).

    The "off" values are normalised on construction, so equal distributions compare equal:
    ``top_k`` 0 -> None, ``top_p`` 1.0 -> None; ``temperature`` becomes a float.

    Raises (on construction):
        TypeError: ``top_k`` not an int or None.
        ValueError: ``temperature`` <= 0 or infinite; ``top_k`` < 0; ``top_p`` outside (0, 1].
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    greedy: bool = False

    def __post_init__(self) -> None:
        temperature, top_k, top_p = _normalise_sampling(self.temperature, self.top_k, self.top_p)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "greedy", bool(self.greedy))

    @property
    def truncates(self) -> bool:
        """True when top-k or top-p cuts the tempered softmax."""
        return self.top_k is not None or self.top_p is not None

    def tempered(self) -> SamplingParams:
        """The full tempered softmax at this temperature (no top-k/top-p, not greedy): the
        distribution of a reference model, which is never sampled from (truncated to its own
        top-k/top-p set it would give -inf to tokens the updated policy samples outside it)."""
        return SamplingParams(self.temperature)


# How a Rollout field is laid out along the batch, declared once per field (``layout`` metadata)
# and read by every operation that rebuilds a batch (select, trim, concat, gather), so a new
# field cannot be forgotten by one of them. A field without a layout is batch-wide metadata.
PROMPT = "prompt"  # [B, P]: left-padded prompt columns
RESPONSE = "response"  # [B, T]: right-padded response columns
ROW = "row"  # [B]: one value per row
GROUP = "group"  # [B]: a group id, renumbered when batches are joined
_PAD_LEFT = {PROMPT: True, RESPONSE: False}


def _rows(layout: str, **kwargs):
    """A dataclass field laid out along the batch as ``layout``."""
    return dataclasses.field(metadata={"layout": layout}, **kwargs)


def field_layouts(cls) -> dict[str, str | None]:
    """``{field name: layout}`` of a dataclass whose fields declare ``layout`` metadata (None:
    batch-wide metadata)."""
    return {f.name: f.metadata.get("layout") for f in dataclasses.fields(cls)}


@dataclasses.dataclass
class Rollout:
    """One batch of sampled responses (B sequences, P prompt columns, T response columns).

    Attributes:
        prompt_ids: LongTensor [B, P], left-padded with the pad id. Row i*G+g holds prompt i.
        prompt_mask: LongTensor [B, P], 1 on real prompt tokens, 0 on left padding.
        response_ids: LongTensor [B, T], right-padded with the pad id. T is the longest response
            of this batch (not max_new_tokens). Tokens after the first EOS are the pad id.
        response_mask: FloatTensor [B, T] (float32), 1.0 on the tokens the policy chose up to and
            including the first EOS, 0.0 after it and on padding.
        truncated: BoolTensor [B], True where no EOS was produced within max_new_tokens (the
            response was cut, and its mask covers all of its max_new_tokens tokens).
        sampler_logprobs: FloatTensor [B, T] (float32), natural-log probability of each chosen
            token under the distribution sampled from (temperature, then top-k, then top-p,
            renormalised); 0.0 where ``response_mask`` is 0.
        group_index: LongTensor [B], index (within this batch) of the prompt each row answers;
            rows of one prompt are contiguous, so ``group_index = arange(n).repeat_interleave(G)``.
        group_size: G, samples per prompt.
        sampling: the :class:`SamplingParams` the responses were drawn with (the distribution
            ``sampler_logprobs`` refer to, and the default of the training forwards).
        observation_mask: None, or FloatTensor [B, T] (float32), 1.0 on response-region tokens
            the model sees but did not choose (tool output, environment text between turns),
            never where ``response_mask`` is 1. The model's inputs (:meth:`attention_mask`,
            :meth:`position_ids`, :meth:`trim`, the training forwards) cover both masks
            (:meth:`seen_mask`); everything learned from or measured on the policy's choices
            (loss, KL, entropy, advantages, lengths) reads ``response_mask`` only, and
            ``sampler_logprobs`` is 0.0 on observation tokens.
        weight_version: None, or LongTensor [B]: the version of the weights each row was sampled
            with, as the engine counts its weight pushes (engines apart from the trainer, e.g.
            :class:`~policygrad.rollout.server.ServerRolloutEngine`; None where the engine
            samples the trainer's own copy).

    Raises (on construction):
        ValueError: tensors whose shapes disagree (names the fields); an ``observation_mask``
            that overlaps ``response_mask``.
    """

    prompt_ids: torch.Tensor = _rows(PROMPT)
    prompt_mask: torch.Tensor = _rows(PROMPT)
    response_ids: torch.Tensor = _rows(RESPONSE)
    response_mask: torch.Tensor = _rows(RESPONSE)
    truncated: torch.Tensor = _rows(ROW)
    sampler_logprobs: torch.Tensor = _rows(RESPONSE)
    group_index: torch.Tensor = _rows(GROUP)
    group_size: int = 1
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    observation_mask: torch.Tensor | None = _rows(RESPONSE, default=None)
    weight_version: torch.Tensor | None = _rows(ROW, default=None)

    def __post_init__(self) -> None:
        B, P = self.prompt_ids.shape
        if self.prompt_mask.shape != (B, P):
            raise ValueError(
                f"prompt_mask shape {tuple(self.prompt_mask.shape)} != prompt_ids shape {(B, P)}"
            )
        if self.response_ids.dim() != 2 or self.response_ids.shape[0] != B:
            raise ValueError(f"response_ids shape {tuple(self.response_ids.shape)} does not have B={B} rows")
        T = self.response_ids.shape[1]
        for name in ("response_mask", "sampler_logprobs"):
            if getattr(self, name).shape != (B, T):
                raise ValueError(
                    f"{name} shape {tuple(getattr(self, name).shape)} != response_ids shape {(B, T)}"
                )
        for name in ("truncated", "group_index"):
            if getattr(self, name).shape != (B,):
                raise ValueError(f"{name} shape {tuple(getattr(self, name).shape)} != (B,) = ({B},)")
        if self.weight_version is not None and self.weight_version.shape != (B,):
            raise ValueError(f"weight_version shape {tuple(self.weight_version.shape)} != (B,) = ({B},)")
        if self.observation_mask is not None:
            shape = tuple(self.observation_mask.shape)
            if shape != (B, T):
                raise ValueError(f"observation_mask shape {shape} != response_ids shape {(B, T)}")
            if bool(((self.observation_mask > 0) & (self.response_mask > 0)).any()):
                raise ValueError(
                    "observation_mask overlaps response_mask: a token is either chosen by the policy "
                    "or observed, not both"
                )

    @property
    def batch_size(self) -> int:
        """B, the number of sequences."""
        return self.response_ids.shape[0]

    @property
    def num_prompts(self) -> int:
        """Number of distinct prompts (distinct ``group_index`` values)."""
        return int(torch.unique(self.group_index).numel())

    @property
    def response_lengths(self) -> torch.Tensor:
        """LongTensor [B]: tokens per response, the first EOS included (= ``response_mask.sum(-1)``)."""
        return self.response_mask.sum(-1).long()

    def input_ids(self) -> torch.Tensor:
        """LongTensor [B, P+T]: ``cat(prompt_ids, response_ids)``, the full sequences."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def seen_mask(self) -> torch.Tensor:
        """BoolTensor [B, T]: the response-region tokens the model sees, chosen
        (``response_mask``) or observed (``observation_mask``)."""
        seen = self.response_mask > 0
        return seen if self.observation_mask is None else seen | (self.observation_mask > 0)

    def attention_mask(self) -> torch.Tensor:
        """LongTensor [B, P+T]: 1 on real prompt tokens and on the response tokens the model sees
        (:meth:`seen_mask`: chosen up to the first EOS, and observed)."""
        return torch.cat([self.prompt_mask.long(), self.seen_mask().long()], dim=1)

    def position_ids(self) -> torch.Tensor:
        """LongTensor [B, P+T]: ``cumsum(attention_mask) - 1``, 0 on padding.

        The first real token of every row is at position 0 whatever its left padding, the
        rule Hugging Face ``generate`` uses, so a training forward sees the positions the
        sampler saw.
        """
        mask = self.attention_mask()
        return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)

    def select(self, index: torch.Tensor | Sequence[int] | slice) -> Rollout:
        """A sub-rollout of the rows ``index`` (LongTensor/list of row ids, BoolTensor [B], or a slice).

        Columns are kept as they are (P and T unchanged; see :meth:`trim`); ``group_index`` keeps its
        values, so rows of a group are still recognisable. ``group_size`` is kept as metadata.
        """
        if not isinstance(index, (slice, torch.Tensor)):
            index = torch.as_tensor(list(index), dtype=torch.long)
        if isinstance(index, torch.Tensor):
            index = index.to(self.response_ids.device)
        return self._map(lambda t: t[index])

    def trim(self) -> Rollout:
        """The same rows with prompt columns that are padding in every row and response columns
        after the last one any row sees (:meth:`seen_mask`) removed (the result has the smallest P
        and T that hold the batch)."""
        P = self.prompt_ids.shape[1]
        real_cols = self.prompt_mask.any(0).nonzero()
        first = int(real_cols[0]) if real_cols.numel() else P
        seen_cols = self.seen_mask().any(0).nonzero()
        T = int(seen_cols[-1]) + 1 if seen_cols.numel() else 0
        cut = {PROMPT: lambda t: t[:, first:], RESPONSE: lambda t: t[:, :T]}
        return self._map(lambda t: t, per_layout=cut)

    def to(self, device: torch.device | str) -> Rollout:
        """All tensors moved to ``device`` (a no-op copy-free view where already there)."""
        return self._map(lambda t: t.to(device))

    @property
    def num_groups(self) -> int:
        """``max(group_index) + 1`` (0 for an empty batch): the group ids this batch uses, the
        offset of the next batch's groups when batches are joined."""
        return int(self.group_index.max()) + 1 if self.batch_size else 0

    @classmethod
    def concat(cls, rollouts: Sequence[Rollout], *, renumber: bool = True) -> Rollout:
        """One batch of several: rows in order, prompts left-padded (with 0) to the widest P,
        response fields right-padded (with 0) to the widest T, groups renumbered in order (each
        batch's ids offset by the :attr:`num_groups` of the batches before it; ``renumber=False``:
        the ids kept, for batches whose rows belong to the same groups). A single rollout is
        returned as it is. An optional field that is None in some batches and not in others is
        zeros in their rows.

        Raises:
            ValueError: no rollouts, or batch-wide metadata (``group_size``, ``sampling``) that
                differs between them.
        """
        if not rollouts:
            raise ValueError("Rollout.concat needs at least one rollout")
        if len(rollouts) == 1:
            return rollouts[0]
        first = rollouts[0]
        widths = {
            PROMPT: max(r.prompt_ids.shape[1] for r in rollouts),
            RESPONSE: max(r.response_ids.shape[1] for r in rollouts),
        }
        offsets, total = [], 0
        for r in rollouts:
            offsets.append(total)
            total += r.num_groups
        changes = {}
        for name, layout in field_layouts(cls).items():
            values = [getattr(r, name) for r in rollouts]
            if layout is None:
                _check_tensor_free(name, values[0])
                if any(v != values[0] for v in values[1:]):
                    raise ValueError(f"Rollout.concat: {name} differs between the rollouts: {values}")
                continue
            if all(v is None for v in values):
                continue
            parts = []
            for r, v, offset in zip(rollouts, values, offsets):
                if v is None:
                    like = next(u for u in values if u is not None)
                    v = like.new_zeros(r._shape(layout))
                if layout in _PAD_LEFT:
                    v = pad_columns(v, widths[layout], left=_PAD_LEFT[layout])
                elif layout == GROUP and renumber:
                    v = v + offset
                parts.append(v)
            changes[name] = torch.cat(parts)
        return dataclasses.replace(first, **changes)

    def gather(self, gather_rows, group_offset: int) -> Rollout:
        """Every process's rows as one batch, from a collective row gather.

        Args:
            gather_rows: ``gather_rows(tensor, left=bool) -> tensor``, the rows of every process's
                ``tensor`` [B_r, ...] concatenated in rank order, a second dimension padded to
                the widest (on the left with ``left``), e.g.
                ``policygrad.parallel.distributed.Dist.gather_rows``. Called once per tensor field,
                in field order, on every process (an optional field must be None on every
                process or on none).
            group_offset: the :attr:`num_groups` of the processes before this one (an exclusive
                prefix sum), added to this process's ``group_index`` so groups stay distinct.

        Returns:
            The gathered rollout; batch-wide metadata (``group_size``, ``sampling``) is this
            process's.
        """
        changes = {}
        for name, layout in field_layouts(type(self)).items():
            value = getattr(self, name)
            if layout is None:
                _check_tensor_free(name, value)
            elif value is not None:
                if layout == GROUP:
                    value = value + group_offset
                changes[name] = gather_rows(value, left=_PAD_LEFT.get(layout, False))
        return dataclasses.replace(self, **changes)

    def _shape(self, layout: str) -> tuple[int, ...]:
        """The shape of a field of ``layout`` in this batch."""
        if layout == PROMPT:
            return tuple(self.prompt_ids.shape)
        if layout == RESPONSE:
            return tuple(self.response_ids.shape)
        return (self.batch_size,)

    def _map(self, fn, per_layout: dict | None = None) -> Rollout:
        """Every tensor field through ``fn`` (and first through ``per_layout[layout]`` when the
        field's layout has an entry); None fields stay None."""
        per_layout = per_layout or {}
        changes = {}
        for name, layout in field_layouts(type(self)).items():
            value = getattr(self, name)
            if layout is None:
                _check_tensor_free(name, value)
            elif value is not None:
                changes[name] = fn(per_layout[layout](value) if layout in per_layout else value)
        return dataclasses.replace(self, **changes)


def pad_columns(t: torch.Tensor, width: int, *, left: bool) -> torch.Tensor:
    """``t`` [B, w] zero-padded to [B, width], on the left with ``left``."""
    extra = width - t.shape[1]
    return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra))


def _check_tensor_free(name: str, value) -> None:
    if isinstance(value, torch.Tensor):
        raise TypeError(f"Rollout field {name!r} is a tensor without a layout: declare it with _rows(...)")


def _check_prompts(prompt_token_ids) -> list[list[int]]:
    if isinstance(prompt_token_ids, torch.Tensor) or not isinstance(prompt_token_ids, (list, tuple)):
        raise TypeError(
            "prompt_token_ids must be a list of token-id lists (one per prompt, unpadded), "
            f"got {type(prompt_token_ids).__name__}"
        )
    if not prompt_token_ids:
        raise ValueError("prompt_token_ids is empty; give at least one prompt")
    out = []
    for i, ids in enumerate(prompt_token_ids):
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids
        ):
            raise TypeError(f"prompt_token_ids[{i}] must be a list of ints")
        if not ids:
            raise ValueError(f"prompt_token_ids[{i}] is empty; every prompt needs at least one token")
        out.append([int(t) for t in ids])
    return out


def check_sampling_args(prompt_token_ids, group_size, temperature, top_p, top_k, max_new_tokens):
    """Validate the arguments every engine's ``generate`` takes and normalise the "off" values.

    Returns:
        ``(prompts, temperature, top_k, top_p)``: prompts as lists of ints, temperature as a
        float, ``top_k`` None when off (None or 0), ``top_p`` None when off (None or 1.0).

    Raises:
        TypeError: ``prompt_token_ids`` not a list of int lists; non-int ``group_size`` /
            ``top_k`` / ``max_new_tokens``.
        ValueError: empty prompt list or prompt; ``group_size`` < 1; ``temperature`` <= 0 or
            infinite; ``top_p`` outside (0, 1]; ``top_k`` < 0; ``max_new_tokens`` < 1.
    """
    prompts = _check_prompts(prompt_token_ids)
    for name, value in (("group_size", group_size), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    temperature, top_k, top_p = _normalise_sampling(temperature, top_k, top_p)
    return prompts, temperature, top_k, top_p


def decode_completions(tokenizer, rollout: Rollout) -> list[str]:
    """Completion strings of a rollout: the policy's tokens only (``response_mask``), special
    tokens dropped."""
    ids = rollout.response_ids.masked_fill(rollout.response_mask == 0, tokenizer.pad_token_id)
    return tokenizer.batch_decode(ids.tolist(), skip_special_tokens=True)
