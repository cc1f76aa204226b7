"""Rollouts with Hugging Face ``generate``: the live policy model, KV cache, one batch for all samples.

How sampling and its log-probs are kept consistent: ``generate`` runs with every built-in logits
processor and warper switched off (the model's own ``generation_config.json`` is set aside for the
call, so a repetition penalty or a default top-k stored there cannot leak in), and one processor of
ours does the whole transformation: ``logits / temperature``, then Hugging Face's top-k and top-p
warpers (same order and tie rules as ``generate`` itself). ``generate`` samples from the softmax
of what that processor returns, and the processor records the log-softmax of the same scores at
the token sampled, one step later. Only one step's scores [B, V] are held at any time; the
log-probs fill a [B, T] tensor column by column.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from policygrad.rollout.base import Rollout
from policygrad.rollout.engine import GenerationRequest, RolloutEngine


class _WarpAndRecord:
    """Logits processor: apply temperature / top-k / top-p, and record log-probs of the chosen tokens.

    Called by ``generate`` once per new token with ``input_ids`` [B, P + t] and the next-token
    ``scores`` [B, V] (float32). At call t it first gathers, from call t-1's warped scores, the
    log-prob of the token chosen at step t-1 (now ``input_ids[:, -1]``). :meth:`finish` does the
    same for the last step.
    """

    def __init__(
        self, temperature: float, top_k: int | None, top_p: float | None, row_keys: torch.Tensor | None = None
    ):
        # heavy: transformers loads when the hf engine samples
        from transformers.generation.logits_process import (
            LogitsProcessorList,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        warpers = LogitsProcessorList()
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
        if top_p is not None and top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        self.warpers = warpers
        self.columns: list[torch.Tensor] = []
        self._prev_scores: torch.Tensor | None = None
        self._prev_lse: torch.Tensor | None = None
        self.row_keys = row_keys  # int64 [B] per-row sampling keys (None: generate samples)
        self.calls = 0

    def _record(self, tokens: torch.Tensor) -> None:
        chosen = self._prev_scores.gather(1, tokens[:, None].long()).squeeze(1)
        self.columns.append((chosen - self._prev_lse).float())

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._prev_scores is not None:
            self._record(input_ids[:, -1])
        scores = self.warpers(input_ids, scores)
        self._prev_scores = scores
        self._prev_lse = torch.logsumexp(scores, dim=-1)
        if self.row_keys is not None:
            # Gumbel-max: argmax(scores + Gumbel noise) is a draw from softmax(scores); generate
            # runs greedy, and each row's noise depends on its key and the step only.
            scores = scores + gumbel_noise(self.row_keys, self.calls, scores.shape[1]).to(scores)
        self.calls += 1
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Record the last step and return the log-probs, FloatTensor [B, steps]."""
        if self._prev_scores is not None:
            self._record(last_tokens)
        self._prev_scores = self._prev_lse = None
        return torch.stack(self.columns, dim=1)


_MASK64 = (1 << 64) - 1


def _signed64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (wrapping arithmetic; logical right shifts)."""

    def shr(t, n):
        return (t >> n) & ((1 << (64 - n)) - 1)

    x = (x ^ shr(x, 30)) * _signed64(0xBF58476D1CE4E5B9)
    x = (x ^ shr(x, 27)) * _signed64(0x94D049BB133111EB)
    return x ^ shr(x, 31)


def gumbel_noise(keys: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """float64 [B, V] standard Gumbel noise, a pure function of ``(keys[b], step, v)``: a
    counter-based generator (SplitMix64 of the three), the same numbers on any device and in any
    batch composition. 53-bit uniforms in (0, 1)."""
    device = keys.device
    golden = _signed64(0x9E3779B97F4A7C15)
    base = _mix64(keys * golden + step)  # [B]
    x = _mix64(base[:, None] + torch.arange(vocab, device=device, dtype=torch.long)[None, :] * golden)
    u = (((x >> 11) & ((1 << 53) - 1)).to(torch.float64) + 0.5) * 2.0**-53
    return -torch.log(-torch.log(u))


def sample_keys(prompt_seeds, group_size: int, device) -> torch.Tensor:
    """int64 [n * G]: the key of sample g of prompt i, a hash of ``(prompt_seeds[i], g)``."""
    keys = [_signed64(int(s) * 1_000_003 + g) for s in prompt_seeds for g in range(group_size)]
    return _mix64(torch.tensor(keys, dtype=torch.long, device=device))


def _unwrap(model):
    """The transformers model that owns ``generation_config`` (inside a peft wrapper, if any)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class HFRolloutEngine(RolloutEngine):
    """Sampling with ``model.generate`` on the live policy model.

    Args:
        model: a causal LM (``PreTrainedModel`` or a peft ``PeftModel``). The engine keeps a
            reference to it and always samples with its current weights.
        tokenizer: its tokenizer; supplies the pad id (falls back to the first EOS id).
        eos_token_ids: every id that ends a response; None -> ``eos_token_ids(tokenizer, model)``
            from :mod:`policygrad.models.loading`.
        shares_policy_weights: ``model`` is the trainer's live policy (True), or a copy it
            receives through :meth:`sync_weights` after every update (an FSDP run's unsharded
            copy, or a copy the engine owns: ``copies_weights``).
        copies_weights: ``model`` is the engine's own copy: :meth:`sync_weights` copies the
            given model's parameters and buffers into it, in place (rollouts that run while the
            policy trains, ``rollout.max_staleness``). Implies ``shares_policy_weights=False``.
        autocast: a context the model's forwards run in (the run's ``bf16-mixed`` autocast), or None.

    Raises:
        ValueError: an empty ``eos_token_ids``.
    """

    def __init__(
        self,
        model,
        tokenizer,
        eos_token_ids: list[int] | None = None,
        *,
        shares_policy_weights: bool = True,
        autocast: Callable[[], AbstractContextManager] | None = None,
        copies_weights: bool = False,
    ):
        self.shares_policy_weights = shares_policy_weights and not copies_weights
        self.copies_weights = copies_weights
        self.autocast = autocast or contextlib.nullcontext  # e.g. the run's bf16 autocast
        if eos_token_ids is None:
            # models imports rollout.base: at the top this would be a package cycle
            from policygrad.models.loading import eos_token_ids as find_eos

            eos_token_ids = find_eos(tokenizer, model)
        eos_token_ids = sorted({int(i) for i in eos_token_ids})
        if not eos_token_ids:
            raise ValueError("eos_token_ids is empty; give at least one end-of-sequence token id")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else eos_token_ids[0]

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Point the engine at ``model``. Generation already uses the live model object, so after an
        optimizer step nothing needs copying; passing a different model object switches to it.
        With ``copies_weights`` the engine keeps its own model and loads ``model``'s state dict
        into it, in place (same architecture).

        Raises:
            RuntimeError: ``copies_weights`` and ``model``'s state has other names or shapes."""
        if not self.copies_weights:
            self.model = model
        elif model is not self.model:
            self.model.load_state_dict(model.state_dict())

    def _max_positions(self) -> int | None:
        config = getattr(_unwrap(self.model), "config", None)
        if config is None:
            return None
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, "max_position_embeddings", None)

    def sample(self, request: GenerationRequest) -> Rollout:
        """Sample ``group_size`` responses per prompt in one batched ``generate`` call.

        All n * G sequences decode together with the KV cache; prompts are left-padded with the
        attention mask set, and ``generate`` derives position ids from it (cumsum - 1), so a
        padded prompt is continued exactly as it would be alone. Every id in ``eos_token_ids``
        ends a sequence; after it the row holds the pad id. The batch stops early when every row
        has ended, and T is trimmed to the longest response.

        Log-probs (``sampler_logprobs``) are float32 log-softmax of the processed scores
        (``logits / temperature`` then top-k then top-p, the rule of Hugging Face's warpers) at
        the chosen token. With ``greedy=True`` the argmax token is taken (the same token under any
        temperature or truncation) and its log-prob is still reported under that processed
        distribution at the given ``temperature`` / ``top_k`` / ``top_p``.

        The model is put in eval mode under ``torch.no_grad()`` for the call and every module's
        train/eval flag restored afterwards; its ``generation_config`` is set aside during the
        call and put back.

        Randomness: with ``generator_seed=None`` the draws come from torch's global RNG (the
        caller seeds it, e.g. once per step, and the stream advances); with an int the call runs
        inside ``torch.random.fork_rng`` seeded with it, so the result depends on the seed alone
        and the caller's RNG stream is left untouched. With ``prompt_seeds`` (one int per prompt)
        sampling is Gumbel-max with counter-based noise keyed by ``(prompt_seeds[i], g, step)``:
        a prompt's samples do not depend on the other prompts of the batch, on the batch size or on
        torch's RNG (up to the last bits of the logits a different padding can move), which is
        what lets data-parallel ranks split a batch without changing its samples.

        Called by :meth:`RolloutEngine.generate`, which checks the arguments (see there).

        Returns:
            :class:`Rollout` with B = len(prompts) * group_size rows.

        Raises:
            TypeError: ``prompt_token_ids`` not a list of int lists; non-int ``group_size`` /
                ``top_k`` / ``max_new_tokens``.
            ValueError: empty prompt list or prompt; ``group_size`` < 1; ``temperature`` <= 0;
                ``top_p`` outside (0, 1]; ``top_k`` < 0; ``max_new_tokens`` < 1; longest prompt +
                ``max_new_tokens`` beyond the model's ``max_position_embeddings``.
        """
        prompts, group_size, s = request.prompts, request.group_size, request.sampling
        temperature, top_k, top_p, greedy = s.temperature, s.top_k, s.top_p, s.greedy
        max_new_tokens, ignore_eos = request.max_new_tokens, request.ignore_eos
        generator_seed, prompt_seeds = request.generator_seed, request.prompt_seeds
        longest = max(len(p) for p in prompts)
        limit = self._max_positions()
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {limit} positions; shorten the prompts or lower max_new_tokens"
            )

        device = next(self.model.parameters()).device
        G = int(group_size)
        n = len(prompts)
        pad = self.pad_token_id
        prompt_ids = torch.full((n, longest), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, longest), dtype=torch.long)
        for i, ids in enumerate(prompts):
            prompt_ids[i, longest - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            prompt_mask[i, longest - len(ids) :] = 1
        prompt_ids = prompt_ids.repeat_interleave(G, dim=0).to(device)
        prompt_mask = prompt_mask.repeat_interleave(G, dim=0).to(device)
        group_index = torch.arange(n, device=device).repeat_interleave(G)

        with self.autocast():
            sequences, logprobs = self._run_generate(
                prompt_ids,
                prompt_mask,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                max_new_tokens=int(max_new_tokens),
                greedy=greedy,
                generator_seed=generator_seed,
                row_keys=None if greedy or prompt_seeds is None else sample_keys(prompt_seeds, G, device),
                ignore_eos=ignore_eos,
            )
        responses = sequences[:, longest:]
        steps = responses.shape[1]
        eos = torch.tensor(self.eos_token_ids if not ignore_eos else [], dtype=torch.long, device=device)
        is_eos = torch.isin(responses, eos)
        has_eos = is_eos.any(dim=1)
        # argmax returns the first maximum: the first EOS of a row that has one.
        lengths = torch.where(has_eos, is_eos.int().argmax(dim=1) + 1, steps)
        T = int(lengths.max()) if lengths.numel() else 0
        keep = torch.arange(T, device=device)[None, :] < lengths[:, None]
        response_ids = responses[:, :T].masked_fill(~keep, pad)
        sampler_logprobs = torch.where(keep, logprobs[:, :T], torch.zeros((), device=device))
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=keep.float(),
            truncated=~has_eos if not ignore_eos else torch.zeros_like(has_eos),
            sampler_logprobs=sampler_logprobs,
            group_index=group_index,
            group_size=G,
            sampling=request.sampling,
        )

    def _run_generate(
        self,
        prompt_ids,
        prompt_mask,
        *,
        temperature,
        top_k,
        top_p,
        max_new_tokens,
        greedy,
        generator_seed,
        row_keys=None,
        ignore_eos=False,
    ):
        """``sequences`` LongTensor [B, P + steps] and log-probs FloatTensor [B, steps]."""
        # heavy: transformers loads when the hf engine samples
        from transformers import GenerationConfig
        from transformers.generation.logits_process import LogitsProcessorList

        recorder = _WarpAndRecord(temperature, top_k, top_p, row_keys)
        greedy = greedy or row_keys is not None  # Gumbel-max: the noise is in the scores
        generation_config = GenerationConfig(
            do_sample=not greedy,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            temperature=1.0,
            top_k=None if greedy else 0,  # greedy: unset, or transformers warns about an unused flag
            top_p=1.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            use_cache=True,
            eos_token_id=list(self.eos_token_ids) if not ignore_eos else None,  # None: never stop early
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=False,
            output_scores=False,
        )
        model = self.model
        inner = _unwrap(model)
        modes = [(module, module.training) for module in model.modules()]
        saved_config = getattr(inner, "generation_config", None)
        device = prompt_ids.device
        if generator_seed is None:
            rng = contextlib.nullcontext()
        else:
            devices = [device.index or 0] if device.type == "cuda" else []
            rng = torch.random.fork_rng(devices=devices)
        try:
            # generate fills unset fields from model.generation_config; a blank one leaves only
            # the neutral global defaults (every other processor off).
            inner.generation_config = GenerationConfig()
            model.eval()
            with rng, torch.no_grad():
                if generator_seed is not None:
                    torch.manual_seed(int(generator_seed))
                sequences = model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=generation_config,
                    logits_processor=LogitsProcessorList([recorder]),
                )
                logprobs = recorder.finish(sequences[:, -1])
        except RuntimeError as e:
            if "probability tensor contains" not in str(e):
                raise
            # torch.multinomial on NaN/inf probabilities: the logits were not finite
            raise ValueError(
                "sampling failed: the policy's next-token probabilities are not finite (NaN or infinite "
                f"logits at temperature {temperature:g}); the model's weights or activations overflow"
            ) from None
        finally:
            inner.generation_config = saved_config
            for module, mode in modes:
                module.training = mode
        return sequences, logprobs
