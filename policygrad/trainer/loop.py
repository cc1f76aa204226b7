"""The training loop: sample, score, estimate advantages, update the policy (and the critic).

One RL step, top to bottom (``Trainer.step``):

1. take ``prompts_per_step`` prompts from the data stream and sample ``group_size`` responses for
   each, all in one batch (rows of one prompt are contiguous);
2. score them with the reward functions (verifiers, reward models), normalise the scores
   (``reward.normalize``), apply the truncation policy, and (ReMax) score one greedy response per
   prompt as the baseline;
3. reference log-probs (only when the KL has a placement), old log-probs (only when the update
   is not exactly on-policy) and, with a critic, the values V(s_t) under ``torch.inference_mode``;
4. token rewards (score on the last valid token, minus beta x KL per token when the KL sits in the
   reward; optionally whitened), then the advantage estimator *looked up by name* in
   ``policygrad.core``, which also gives the critic's targets (lambda-returns);
5. ``ppo_epochs`` x ``num_minibatches`` optimizer steps; each minibatch is processed in
   micro-batches whose losses use the minibatch's global token and sequence counts, so the summed
   gradient equals the full minibatch's exactly. With a critic, each minibatch also takes one
   critic step (its own optimizer); with ``ptx.coef`` an LM loss on text joins the policy loss;
   with ``optim.target_kl`` the update stops at the first minibatch whose approx-KL exceeds it.

The first ``critic.pretrain_steps`` steps train only the critic, on Monte-Carlo returns (lam = 1),
with the policy frozen.

The loop never branches on the algorithm's name: the preset in ``trainer.config.ALGORITHMS``
supplies the registry names and says whether there is a critic. Global counts flow into
``aggregate`` explicitly, so data-parallel training only has to all-reduce those counts and the
gradients.
"""

from __future__ import annotations

import inspect
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import yaml

from policygrad.core.advantages import estimate_advantages
from policygrad.core.diagnostics import explained_variance, zero_variance_group_fraction
from policygrad.core.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_loss,
    kl_shaped_rewards,
)
from policygrad.core.logprobs import logprobs_from_hidden, logprobs_from_logits, truncated_importance_weights
from policygrad.core.losses import entropy_from_logits, get_policy_loss
from policygrad.core.masking import aggregate, masked_mean, masked_sum, masked_whiten
from policygrad.models.swiglu import use_memory_efficient_mlp
from policygrad.rewards.reward_model import resolve_reward_functions
from policygrad.rollout.base import Rollout
from policygrad.trainer.config import ConfigError, TrainConfig
from policygrad.trainer.evaluate import decode_completions
from policygrad.trainer.logging import MetricsLogger, peak_rss_gb
from policygrad.trainer.optim import make_adamw
from policygrad.trainer.ppo import CriticTrainer, PtxData, RewardNormalizer, monte_carlo_returns, ptx_loss


class TrainingError(RuntimeError):
    """The run cannot continue; the message says why and what to change."""


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy (when installed) and torch from one integer."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (bf16 matmul is slower than fp32 on CPUs without AMX or
    AVX512-BF16, measured 4x slower on the reference machine), bfloat16 on CUDA."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    return torch.bfloat16 if device.type == "cuda" else torch.float32


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


def plain_output_head(model):
    """``(decoder, lm_head)`` when ``model``'s logits are exactly ``lm_head(decoder(...)[0])``
    with ``lm_head`` a plain ``torch.nn.Linear`` (model type in :data:`PLAIN_HEAD_MODEL_TYPES`,
    peft-wrapped or not, lm_head not adapted); None otherwise."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or getattr(config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES:
        return None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if type(head) is not torch.nn.Linear or decoder is None or decoder is base:
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
            out = model(**inputs, logits_to_keep=keep)
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


# Most response tokens one packed row holds: the attention inside a row costs (row length)^2,
# so rows are capped to keep the training forward linear in G and in the response length.
PACK_ROW_TOKENS = 512


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
        rollout: left-padded prompts, right-padded responses whose ``response_mask`` is 1 on a
            prefix of each row (the rollout invariant).

    Returns:
        [N, H] hidden states in the model's dtype, N = ``(response_mask > 0).sum()``, in the
        row-major order of ``rollout.response_mask > 0`` (row b, token t is predicted by the
        hidden state before it); None when packing does not apply (another attention kernel, a
        mask that is not a prefix, a model without a transformers cache), so the caller falls
        back to the padded forward (also for a sliding-window model and for T = 0).
    """
    config = getattr(decoder, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    if attn != "sdpa":  # a boolean 4-D mask is what sdpa takes as is
        return None
    # A sliding window (Mistral's sliding_window, Qwen's use_sliding_window, sliding layer types)
    # is not in the packed mask, and its cache keeps only the window's last keys.
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return None
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return None
    if rollout.response_ids.shape[1] == 0:
        return None
    mask = rollout.response_mask > 0
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


def policy_logprobs(
    model,
    rollout: Rollout,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    with_entropy: bool | str = False,
    share_prompts: bool = True,
    fused_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32 log-probs [B, T] of the response tokens under the sampled distribution
    (``logits / temperature`` with the sampler's top-k/top-p truncation), and the entropy [B, T]
    of the full tempered distribution when ``with_entropy`` is True (detached, a diagnostic) or
    ``"grad"`` (differentiable, for an entropy bonus); None otherwise. ``share_prompts``: run each
    distinct prompt once (:func:`response_logits`).

    Without top-k/top-p truncation and for a model whose logits are a plain linear layer of its
    hidden states (:func:`plain_output_head`), the logits are never materialised: the hidden
    states at the valid response positions (``response_mask`` > 0) go through
    :func:`policygrad.core.logprobs.logprobs_from_hidden` block by block, and positions outside
    the mask get log-prob 0 and entropy 0. Otherwise, or with ``fused_head=False`` (a caller
    that hooks the lm_head module), the [B, T, V] logits are computed at the response positions
    (every position, masked or not, gets its value)."""
    head = plain_output_head(model) if fused_head and not top_k and top_p >= 1.0 else None
    if head is not None:
        decoder, lm_head = head
        valid = rollout.response_mask > 0
        hidden_valid = None
        if share_prompts and not getattr(model, "is_gradient_checkpointing", False):
            hidden_valid = packed_response_hidden(decoder, rollout)
        if hidden_valid is None:
            hidden = _response_outputs(model, rollout, share_prompts=share_prompts, decoder=decoder)
            hidden_valid = hidden[valid]
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
    if top_k:
        kwargs["top_k"] = top_k
    if top_p < 1.0:
        kwargs["top_p"] = top_p
    logprobs = logprobs_from_logits(logits, rollout.response_ids, temperature=temperature, **kwargs)
    entropy = None
    if with_entropy == "grad":
        entropy = entropy_from_logits(logits, temperature=temperature)
    elif with_entropy:
        with torch.no_grad():  # a diagnostic only: no graph through the [B, T, V] logits
            entropy = entropy_from_logits(logits.detach(), temperature=temperature)
    return logprobs, entropy


@dataclass
class StepBatch:
    """Everything the update needs for one RL step; rows are sequences (B)."""

    rollout: Rollout
    loss_mask: torch.Tensor  # [B, T] float32: response_mask of rows that take part in the loss
    advantages: torch.Tensor  # [B, T] float32
    old_logprobs: torch.Tensor | None  # [B, T] or None when on-policy (the ratio is then exactly 1)
    ref_logprobs: torch.Tensor | None  # [B, T] or None when the KL is not in the loss
    old_values: torch.Tensor | None = None  # [B, T] critic values at rollout time, or None
    returns: torch.Tensor | None = None  # [B, T] the critic's targets, or None without a critic
    critic_mask: torch.Tensor | None = None  # [B, T] tokens that train the critic
    train_policy: bool = True  # False in the critic-pretraining steps


class PromptStream:
    """A resumable stream of training rows over a source with ``train_row(i)`` (a pure function
    of the position ``i``), so resuming at a saved position gives exactly the rows a straight run
    would have seen."""

    def __init__(self, source):
        self.source = source
        self.position = 0

    def take(self, k: int) -> list[dict[str, Any]]:
        rows = [self.source.train_row(self.position + j) for j in range(k)]
        self.position += k
        return rows


# ----------------------------------------------------------------------------------------------


class Trainer:
    """Runs a :class:`TrainConfig`: builds the models, data and rewards, then trains.

    Args:
        config: the validated run configuration.
        resume_from: a run directory to resume from (its latest checkpoint), or None.

    Raises:
        ConfigError / ValueError: bad configuration or data, with the field named.
    """

    def __init__(self, config: TrainConfig, *, resume_from: str | None = None):
        from policygrad.models.loading import (
            apply_lora,
            eos_token_ids,
            load_causal_lm,
            load_tokenizer,
            resolve_model_path,
        )
        from policygrad.rewards.registry import CompositeReward
        from policygrad.rollout.hf import HFRolloutEngine
        from policygrad.trainer.sources import build_eval_rows, build_train_source

        self.config = cfg = config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        seed_everything(cfg.seed)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = resolve_dtype(cfg.model.dtype, self.device)
        self.run_dir = cfg.output_dir
        if resume_from is None:
            _prepare_new_run_dir(self.run_dir, overwrite=cfg.overwrite)
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"output_dir={self.run_dir!r} cannot be created ({e}); choose another folder"
            ) from None

        # Models. The policy may be restored from a checkpoint; the reference is always the base.
        self.model_path = resolve_model_path(cfg.model.name)
        self.tokenizer = load_tokenizer(self.model_path)
        ckpt = latest_checkpoint(resume_from) if resume_from else None
        if resume_from and ckpt is None:
            raise TrainingError(
                f"--resume {resume_from}: no checkpoint found under {resume_from}/checkpoints"
            )
        self.policy = load_causal_lm(self.model_path, dtype=self.dtype).to(self.device)
        if cfg.model.lora.rank > 0:
            self.policy = apply_lora(
                self.policy,
                rank=cfg.model.lora.rank,
                alpha=cfg.model.lora.alpha,
                dropout=cfg.model.lora.dropout,
                target_modules=cfg.model.lora.target_modules,
            )
        # SwiGLU MLPs and RMSNorms that save their inputs only and recompute the rest in the
        # backward: ~a third less activation memory, same result (policygrad.models.swiglu). After
        # LoRA, so adapted projections keep their adapters.
        use_memory_efficient_mlp(self.policy)
        if ckpt is not None:
            load_policy_weights(self.policy, os.path.join(ckpt, "model"))
        if cfg.model.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
        self.reference = None
        if cfg.kl.placement != "none" and cfg.model.lora.rank == 0:
            self.reference = load_causal_lm(self.model_path, dtype=self.dtype, trainable=False).to(
                self.device
            )
        self.eos_ids = eos_token_ids(self.tokenizer, self.policy)
        self.engine_name, engine_why = cfg.rollout.resolved_engine()
        if self.engine_name == "hf" and cfg.rollout.dtype != "auto":
            raise ConfigError(
                f"rollout.dtype={cfg.rollout.dtype!r} needs the vllm engine, but rollout.engine=auto "
                "resolved to hf (vllm is not installed); install the vllm extra or set rollout.dtype=auto"
            )
        print(f"rollout engine: {self.engine_name} ({engine_why})", flush=True)
        if self.engine_name == "vllm":
            from policygrad.rollout.vllm import VLLMRolloutEngine

            r = cfg.rollout
            dtype_name = r.dtype if r.dtype != "auto" else str(self.dtype).removeprefix("torch.")
            self.engine = VLLMRolloutEngine(
                self.model_path,
                self.tokenizer,
                self.eos_ids,
                dtype=dtype_name,
                seed=cfg.seed,
                max_model_len=_engine_context(self.policy, cfg.data.max_prompt_length + r.max_new_tokens),
                kv_cache_gb=r.vllm_kv_cache_gb,
                gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                enable_prefix_caching=r.vllm_prefix_caching,
            )
            if ckpt is not None or cfg.model.lora.rank > 0:
                self.engine.sync_weights(self.policy)  # the engine loaded the base weights
        else:
            self.engine = HFRolloutEngine(self.policy, self.tokenizer, self.eos_ids)

        # Data and rewards.
        self.train_source = build_train_source(cfg.data, seed=cfg.seed)
        self.stream = PromptStream(self.train_source)
        self.eval_rows = build_eval_rows(cfg.data, seed=cfg.seed) if cfg.data.eval_size else []
        weights = cfg.reward.weights or [1.0] * len(cfg.reward.functions)
        functions = resolve_reward_functions(
            cfg.reward.functions,
            dtype=self.dtype,
            device=self.device,
            batch_size=cfg.reward.model_batch_size,
            max_length=cfg.reward.model_max_length,
            use_chat_template=cfg.reward.model_chat_template,
        )
        self.reward_fn = CompositeReward(list(zip(functions, weights)), on_error=cfg.reward.on_error)
        self.reward_normalizer = RewardNormalizer(cfg.reward.normalize, clip=cfg.reward.normalize_clip)

        # The critic (PPO): its own network, optimizer and schedule.
        self.critic = None
        self.critic_trainer = None
        if cfg.uses_critic:
            from policygrad.models.value import load_value_model

            c = cfg.critic
            self.critic = load_value_model(
                c.init_from,
                policy_path=self.model_path,
                dtype=self.dtype,
                lora_rank=c.lora.rank,
                lora_alpha=c.lora.alpha,
                lora_dropout=c.lora.dropout,
                lora_target_modules=c.lora.target_modules,
                gradient_checkpointing=cfg.model.gradient_checkpointing,
                device=self.device,
            )
            if ckpt is not None:
                self.critic.load(os.path.join(ckpt, "critic"))
            critic_total = max(1, cfg.steps * cfg.optim.ppo_epochs * cfg.optim.num_minibatches)
            self.critic_trainer = CriticTrainer(
                self.critic,
                lr=c.lr,
                betas=tuple(cfg.optim.betas),
                eps=cfg.optim.eps,
                weight_decay=c.weight_decay,
                max_grad_norm=c.max_grad_norm,
                clip_range=c.clip_range,
                micro_batch_size=c.micro_batch_size or cfg.optim.micro_batch_size,
                lr_lambda=_schedule(cfg.optim, critic_total),
            )
        self.ptx_data = None
        if cfg.ptx.coef > 0:
            self.ptx_data = PtxData(
                cfg.ptx.dataset,
                self.tokenizer,
                field=cfg.ptx.text_field,
                max_length=cfg.ptx.max_length,
                batch_size=cfg.ptx.batch_size,
            )

        # Loss, optimizer, schedule, KL controller.
        self.policy_loss = get_policy_loss(cfg.policy_loss_name)
        self.loss_options = self._loss_options()
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = make_adamw(
            params,
            lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas),
            eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay,
        )
        total = max(1, cfg.steps * cfg.optim.ppo_epochs * cfg.optim.num_minibatches)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(cfg.optim, total))
        if cfg.kl.controller == "adaptive":
            self.kl_ctl = AdaptiveKLController(cfg.kl.beta, cfg.kl.target, cfg.kl.horizon)
        else:
            self.kl_ctl = FixedKLController(cfg.kl.beta)

        self.step_idx = 0
        if ckpt is not None:
            self._load_state(ckpt)
        else:
            with open(os.path.join(self.run_dir, "config.yaml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
        self.logger = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.tensorboard,
            truncate_after_step=self.step_idx if ckpt is not None else None,
        )
        if ckpt is None and os.path.exists(self.logger.path):
            os.remove(self.logger.path)  # a new run in an old directory starts a fresh file

    # ------------------------------------------------------------------------------------------
    def _loss_options(self) -> dict[str, Any]:
        cfg = self.config.loss
        wanted = {"clip_low": cfg.clip_low, "clip_high": cfg.clip_high, "dual_clip": cfg.dual_clip}
        params = inspect.signature(self.policy_loss).parameters
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        options = {}
        for key, value in wanted.items():
            if key in params or accepts_any:
                options[key] = value
            elif key == "dual_clip" and value is not None:
                raise ConfigError(
                    f"loss.dual_clip is set but loss.policy_loss={self.config.policy_loss_name!r} has no "
                    "dual clip; unset it or use policy_loss=ppo"
                )
        return options

    # ------------------------------------------------------------------------------------------
    def _prompt_ids(self, rows: list[dict[str, Any]]) -> list[list[int]]:
        from policygrad.data.chat import format_prompt, tokenize_prompts

        d = self.config.data
        texts = [
            format_prompt(
                self.tokenizer,
                r["prompt"],
                system_prompt=d.system_prompt,
                use_chat_template=d.use_chat_template,
            )
            for r in rows
        ]
        return tokenize_prompts(self.tokenizer, texts, max_prompt_length=d.max_prompt_length)

    def _completions(self, rollout: Rollout) -> list[str]:
        return decode_completions(self.tokenizer, rollout)

    def _score(self, rows: list[dict[str, Any]], completions: list[str], repeat: int):
        """Rewards [B] float32, per-function components and a validity mask [B] bool."""
        prompts = [r["prompt"] for r in rows for _ in range(repeat)]
        fields: dict[str, list] = {}
        for key in rows[0]:
            if key != "prompt":
                fields[key] = [r.get(key) for r in rows for _ in range(repeat)]
        return self.reward_fn(prompts, completions, **fields)

    @torch.inference_mode()
    def _inference_logprobs(self, model, rollout: Rollout, *, truncate: bool = True) -> torch.Tensor:
        r = self.config.rollout
        mbs = self.config.optim.micro_batch_size
        top_k, top_p = (r.top_k, r.top_p) if truncate else (0, 1.0)
        out = torch.zeros(rollout.response_ids.shape, dtype=torch.float32, device=rollout.response_ids.device)
        for start in range(0, rollout.batch_size, mbs):
            # Each micro-batch is trimmed to its own longest response and prompt (no work on
            # columns that are padding in all of its rows); the rest of its row stays 0.
            sub = rollout.select(torch.arange(start, min(start + mbs, rollout.batch_size))).trim()
            lp, _ = policy_logprobs(model, sub, temperature=r.temperature, top_k=top_k, top_p=top_p)
            out[start : start + sub.batch_size, : lp.shape[1]] = lp
        return out  # a normal tensor (not an inference tensor), usable next to autograd tensors

    def _reference_logprobs(self, rollout: Rollout) -> torch.Tensor:
        # The reference is never sampled from, so its log-probs are of the full tempered softmax:
        # truncated to its own top-k/top-p set it would give -inf (an infinite KL) to every token
        # the updated policy samples outside that set.
        if self.reference is not None:
            return self._inference_logprobs(self.reference, rollout, truncate=False)
        with self.policy.disable_adapter():  # LoRA: the base weights are the reference
            return self._inference_logprobs(self.policy, rollout, truncate=False)

    # ------------------------------------------------------------------------------------------
    def step(self) -> dict[str, Any]:
        """One RL step: rollout, rewards, advantages, update. Returns the step's metrics."""
        cfg = self.config
        r = cfg.rollout
        G = r.group_size
        metrics: dict[str, Any] = {}
        t0 = time.perf_counter()
        # A per-step seed makes every step reproducible on its own, so a resumed run samples
        # exactly what a straight run would have.
        torch.manual_seed(cfg.seed * 1_000_003 + self.step_idx)

        rows = self.stream.take(r.prompts_per_step)
        prompt_ids = self._prompt_ids(rows)
        rollout = self.engine.generate(
            prompt_ids,
            group_size=G,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
        )
        completions = self._completions(rollout)
        scored = self._score(rows, completions, G)
        scores, valid = scored.rewards, scored.valid
        raw_scores = scores.clone()
        # Normalised before the EOS penalty, so a truncated completion gets exactly the penalty.
        scores = self.reward_normalizer(scores, valid)
        from policygrad.rewards.registry import apply_truncation_policy

        scores, valid = apply_truncation_policy(
            scores,
            rollout.truncated,
            mode=cfg.reward.truncation,
            penalty=cfg.reward.truncation_penalty,
            valid=valid,
        )
        failed = ~scored.valid
        if failed.any():
            # A row whose reward function failed (on_error=skip) has no score: it is left out of
            # the loss, and its group mean stands in for it so it moves no group statistic.
            scores = _fill_with_group_mean(scores, failed, rollout.group_index.cpu())
        estimator_options = dict(cfg.estimator_options)
        if cfg.preset.greedy_baseline:
            greedy = self.engine.generate(
                prompt_ids,
                group_size=1,
                max_new_tokens=r.max_new_tokens,
                greedy=True,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
            )
            base = self._score(rows, self._completions(greedy), 1).rewards
            base = self.reward_normalizer(base, update=False)
            base, _ = apply_truncation_policy(
                base, greedy.truncated, mode=cfg.reward.truncation, penalty=cfg.reward.truncation_penalty
            )
            estimator_options["baseline_rewards"] = base.repeat_interleave(G)
        _release_free_memory()  # the sampler's temporaries go back to the OS before training
        t_gen = time.perf_counter()
        metrics["time/generation_s"] = t_gen - t0

        rollout = rollout.to(self.device)
        response_mask = rollout.response_mask.float()
        loss_mask = response_mask * valid.to(response_mask)[:, None]
        # Reference and old log-probs, only when something uses them.
        beta = float(self.kl_ctl.value)
        ref_logprobs = None
        metrics["time/ref_logprobs_s"] = metrics["time/old_logprobs_s"] = 0.0  # 0: pass skipped
        if cfg.kl.placement != "none":
            t_pass = time.perf_counter()
            ref_logprobs = self._reference_logprobs(rollout)
            metrics["time/ref_logprobs_s"] = _synced_clock(self.device) - t_pass
        # Critic pretraining (VC-PPO): the policy is frozen, so its old log-probs are not needed.
        pretraining = self.critic is not None and self.step_idx < cfg.critic.pretrain_steps
        on_policy = (cfg.optim.ppo_epochs == 1 and cfg.optim.num_minibatches == 1) or pretraining
        if self.engine_name != "hf" and cfg.kl.placement == "reward":
            # The KL reward needs the trainer's own log-probs of the sampled tokens: a separate
            # engine's differ (the mismatch), and would put that gap into every reward.
            on_policy = False
        old_logprobs = None
        if not on_policy:
            t_pass = time.perf_counter()
            old_logprobs = self._inference_logprobs(self.policy, rollout)
            metrics["time/old_logprobs_s"] = _synced_clock(self.device) - t_pass
        old_values = self.critic_trainer.values(rollout) if self.critic_trainer is not None else None

        # Token rewards: the score on the last valid token, KL per token when it is in the reward.
        kl_kind = cfg.kl.resolved_kind()
        behaviour = old_logprobs if old_logprobs is not None else rollout.sampler_logprobs
        if cfg.kl.placement == "reward":
            token_rewards = kl_shaped_rewards(
                scores.to(self.device), behaviour, ref_logprobs, response_mask, beta=beta, kind=kl_kind
            )
        else:
            token_rewards = kl_shaped_rewards(
                scores.to(self.device), behaviour, behaviour, response_mask, beta=0.0, kind="k1"
            )
        # The KL part of the per-token reward, summed per sequence (0 without a KL in the reward).
        non_score = masked_sum(token_rewards, response_mask, dim=-1) - scores.to(token_rewards)
        if cfg.reward.whiten and loss_mask.sum() >= 2:
            # N+ reward whitening: scale only, over the valid tokens of the batch.
            token_rewards = masked_whiten(token_rewards, loss_mask, shift_mean=False)
        advantages, returns = estimate_advantages(
            cfg.estimator_name,
            token_rewards,
            response_mask,
            group_index=rollout.group_index,
            values=old_values,
            **estimator_options,
        )
        if pretraining:
            # Value pretraining fits Monte-Carlo returns (lam = 1), not the estimator's lam-returns.
            returns = monte_carlo_returns(
                token_rewards, response_mask, gamma=float(estimator_options.get("gamma", 1.0))
            )
        if cfg.whiten_advantages and loss_mask.sum() >= 2:
            advantages = masked_whiten(advantages, loss_mask)
        critic_mask = loss_mask.clone()
        zero_var = zero_variance_group_fraction(scores, rollout.group_index)
        if cfg.drop_zero_variance_groups:
            keep = _rows_of_varied_groups(scores, rollout.group_index)
            loss_mask = loss_mask * keep.to(loss_mask)[:, None]

        batch = StepBatch(
            rollout,
            loss_mask,
            advantages,
            old_logprobs,
            ref_logprobs if cfg.kl.placement == "loss" else None,
            old_values=old_values,
            returns=returns if old_values is not None else None,
            critic_mask=critic_mask,
            train_policy=not pretraining,
        )
        update_metrics = self._update(batch, beta)
        _release_free_memory()  # and the training activations before the next rollout
        t_train = _synced_clock(self.device)
        metrics.update(self._mismatch_metrics(rollout, response_mask))
        if self.engine_name == "vllm" and update_metrics.get("optim/steps", 0) > 0:
            # The engine holds its own copy of the weights: push the updated ones before the
            # next rollout (in place, no reload; its prefix cache is reset).
            t_sync = time.perf_counter()
            self.engine.sync_weights(self.policy)
            metrics["time/weight_sync_s"] = time.perf_counter() - t_sync

        if old_values is not None:
            ev = explained_variance(old_values, returns, critic_mask) if critic_mask.any() else float("nan")
            metrics["critic/explained_variance"] = float(ev)
            metrics["critic/values_mean"] = masked_mean(old_values, response_mask).item()
            metrics["critic/pretraining"] = float(pretraining)

        # KL to the reference of this batch (k1 mean per token, the controller's input). The
        # controller stands still while the policy is frozen (critic pretraining).
        if ref_logprobs is not None:
            kl_tokens = kl_estimate(behaviour, ref_logprobs, "k1")
            kl_mean = masked_mean(kl_tokens, response_mask).item()
            metrics["kl/ref"] = kl_mean
            # masked_sum, not a product with the mask: with top-k/top-p the log-probs of padding
            # tokens are -inf, and inf * 0 would make the controller's input NaN.
            seq_kl = masked_sum(kl_tokens, response_mask, dim=-1).mean().item()
            if not pretraining:
                self.kl_ctl.update(seq_kl, r.prompts_per_step * G)
        metrics["kl/coef"] = beta
        metrics["reward/score"] = scores.mean().item()
        metrics["reward/non_score"] = non_score.mean().item()

        lengths = response_mask.sum(-1)
        metrics.update(
            {
                "reward/mean": scores[~failed].mean().item() if (~failed).any() else float("nan"),
                "reward/std": scores.std().item() if scores.numel() > 1 else 0.0,
                "reward/score_raw_mean": raw_scores.mean().item(),
                "reward/valid_frac": valid.float().mean().item(),
                "reward/zero_variance_group_frac": float(zero_var),
                "response/length_mean": lengths.mean().item(),
                "response/length_max": lengths.max().item(),
                "response/truncated_frac": rollout.truncated.float().mean().item(),
                "advantages/mean": masked_mean(advantages, loss_mask).item() if loss_mask.any() else 0.0,
                "returns/mean": masked_mean(returns, response_mask).item(),
            }
        )
        metrics.update(scored.metrics())
        metrics.update(update_metrics)
        n_tokens = int(response_mask.sum().item())
        t_end = time.perf_counter()
        metrics["time/training_s"] = t_train - t_gen
        metrics["time/step_s"] = t_end - t0
        metrics["perf/tokens_per_s"] = n_tokens / max(t_end - t0, 1e-9)
        metrics["memory/peak_rss_gb"] = peak_rss_gb()
        if torch.cuda.is_available():
            metrics["memory/peak_cuda_gb"] = torch.cuda.max_memory_allocated() / 1e9
        metrics["optim/lr"] = self.scheduler.get_last_lr()[0]
        self.step_idx += 1
        self._last_samples = [
            {"prompt": rows[i // G]["prompt"], "completion": completions[i], "reward": float(scores[i])}
            for i in range(len(completions))
        ]
        return metrics

    # ------------------------------------------------------------------------------------------
    def _mismatch_metrics(self, rollout: Rollout, response_mask: torch.Tensor) -> dict[str, float]:
        """How far the sampler's log-probs are from the trainer's for the same tokens and weights
        (the train/inference mismatch; seed section on it, Yao et al. 2025): mean and max per-token
        absolute difference, and the spread of the sequence-level ratio exp(sum_t (lp - lp_sampler))."""
        lp = self._rollout_time_logprobs
        if lp is None:
            return {}
        mask = response_mask > 0
        if self._rollout_time_rows is not None:
            mask = mask & self._rollout_time_rows[:, None]
        if not mask.any():
            return {}
        diff = torch.where(mask, lp.float() - rollout.sampler_logprobs.float(), 0.0)
        seq = diff.sum(-1)[mask.any(-1)]
        return {
            "mismatch/logprob_abs_mean": masked_mean(diff.abs(), mask.float()).item(),
            "mismatch/logprob_abs_max": diff.abs().max().item(),
            "mismatch/seq_log_ratio_std": seq.std().item() if seq.numel() > 1 else 0.0,
            "mismatch/seq_ratio_min": seq.min().exp().item(),
            "mismatch/seq_ratio_max": seq.max().exp().item(),
        }

    def _update(self, batch: StepBatch, beta: float) -> dict[str, Any]:
        """``ppo_epochs`` x ``num_minibatches`` optimizer steps over ``batch``: per minibatch one
        policy step (unless ``batch.train_policy`` is False) and, with a critic, one critic step
        on the same rows. With ``optim.target_kl``, the first minibatch whose measured approx-KL
        exceeds it takes no step, and the update ends there (remaining minibatches and epochs,
        critic included)."""
        cfg = self.config
        r = cfg.rollout
        o = cfg.optim
        B = batch.rollout.batch_size
        self.policy.train()
        sums: dict[str, float] = {}
        maxima: dict[str, float] = {}
        losses: list[float] = []
        ptx_losses: list[float] = []
        weight_total = 0.0
        skipped = 0
        steps = 0
        grad_norms = []
        critic_sums: dict[str, float] = {}
        critic_tokens = 0.0
        critic_steps = 0
        critic_skipped = 0
        critic_grad_norms = []
        early_stopped = False
        trains_critic = self.critic_trainer is not None and batch.returns is not None
        # The trainer's log-probs of the sampled tokens before any update (for the mismatch
        # metrics): the old-log-prob pass when there is one, else gathered from the first forward.
        self._rollout_time_logprobs = batch.old_logprobs
        self._rollout_time_rows = None
        if batch.old_logprobs is None and batch.train_policy:
            self._rollout_time_logprobs = torch.zeros_like(batch.advantages)
            self._rollout_time_rows = torch.zeros(B, dtype=torch.bool, device=batch.advantages.device)
        is_level = r.is_correction
        timers = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        nonfinite_tokens = 0
        g = torch.Generator().manual_seed(cfg.seed * 7919 + self.step_idx)
        for _epoch in range(o.ppo_epochs):
            if early_stopped:
                break
            order = torch.randperm(B, generator=g) if o.num_minibatches > 1 else torch.arange(B)
            for mb_rows in torch.tensor_split(order, o.num_minibatches):
                mb_mask = batch.loss_mask[mb_rows]
                num_tokens = mb_mask.sum()
                num_seqs = (mb_mask.sum(-1) > 0).sum()
                if batch.train_policy and num_tokens.item() > 0:
                    self.optimizer.zero_grad(set_to_none=True)
                    finite = True
                    mb_loss = 0.0
                    mb_kl = 0.0
                    mb_weight = 0.0
                    for micro in torch.split(mb_rows, o.micro_batch_size):
                        t_fwd = time.perf_counter()
                        # Trimmed to the micro-batch's longest response (and prompt): columns
                        # masked in all of its rows carry no loss, so they need no forward.
                        sub = batch.rollout.select(micro).trim()
                        T_mb = sub.response_ids.shape[1]
                        mask = batch.loss_mask[micro, :T_mb]
                        logprobs, entropy = policy_logprobs(
                            self.policy,
                            sub,
                            temperature=r.temperature,
                            top_k=r.top_k,
                            top_p=r.top_p,
                            with_entropy="grad" if cfg.loss.entropy_coef else True,
                        )
                        if batch.old_logprobs is None:
                            old = logprobs.detach()  # exactly on-policy: the ratio is exactly 1
                            if self._rollout_time_rows is not None and steps == 0:
                                lp_store = self._rollout_time_logprobs
                                lp_store[micro, :T_mb] = old.to(lp_store)
                                self._rollout_time_rows[micro] = True
                        else:
                            old = batch.old_logprobs[micro, :T_mb]
                        # A token the sampler drew but the trainer's top-k/top-p set excludes has
                        # log-prob -inf here (the two sides' last bits disagree at the set's edge);
                        # it cannot be trained on, so it leaves the loss and is counted.
                        usable = torch.isfinite(logprobs.detach()) & torch.isfinite(old)
                        dropped = (mask > 0) & ~usable
                        if dropped.any():
                            nonfinite_tokens += int(dropped.sum())
                            mask = mask * usable.to(mask)
                        loss_mat, m = self.policy_loss(
                            logprobs, old, batch.advantages[micro, :T_mb], mask, **self.loss_options
                        )
                        if is_level != "none":
                            # Truncated importance sampling: the sampler is not the trainer's
                            # policy, so weight each token by pi_old(trainer) / pi_sampler, capped.
                            is_w = truncated_importance_weights(
                                sub.sampler_logprobs, old, mask, level=is_level, cap=r.is_cap, mode=r.is_mode
                            )
                            loss_mat = loss_mat * is_w
                            m.update(_is_metrics(sub.sampler_logprobs, old, mask, is_w, is_level, r.is_cap))
                        if batch.ref_logprobs is not None:
                            kl_mat = kl_loss(
                                logprobs,
                                batch.ref_logprobs[micro, :T_mb],
                                mask,
                                kind=cfg.kl.resolved_kind(),
                                old_logprobs=old if cfg.kl.importance_weighted else None,
                            )
                            loss_mat = loss_mat + beta * kl_mat
                            m = {**m, "kl_loss": masked_mean(kl_mat.detach(), mask)}
                        if cfg.loss.entropy_coef:
                            loss_mat = loss_mat - cfg.loss.entropy_coef * torch.where(mask > 0, entropy, 0.0)
                        loss = aggregate(
                            loss_mat,
                            mask,
                            cfg.agg_mode,
                            num_tokens=num_tokens,
                            num_seqs=num_seqs,
                            max_len=r.max_new_tokens,
                        )
                        if not torch.isfinite(loss):
                            finite = False
                            break
                        t_bwd = _synced_clock(self.device)
                        timers["forward"] += t_bwd - t_fwd
                        loss.backward()
                        timers["backward"] += _synced_clock(self.device) - t_bwd
                        w = float(mask.sum())
                        weight_total += w
                        mb_loss = mb_loss + loss.item()
                        m = {**m, "entropy": masked_mean(entropy.detach(), mask)}
                        if "approx_kl" in m and w > 0:
                            mb_kl += float(m["approx_kl"]) * w
                            mb_weight += w
                        for key, value in m.items():
                            if key.startswith("num_"):
                                continue  # counts, not per-token averages
                            if key.endswith("_max"):
                                maxima[key] = max(maxima.get(key, -math.inf), float(value))
                            else:
                                sums[key] = sums.get(key, 0.0) + float(value) * w
                    if o.target_kl is not None and mb_weight > 0 and mb_kl / mb_weight > o.target_kl:
                        # The policy has moved too far from the one that sampled: no step, stop.
                        self.optimizer.zero_grad(set_to_none=True)
                        early_stopped = True
                        break
                    if finite and self.ptx_data is not None:
                        ids, attn = self.ptx_data.next_batch()
                        lm_loss = ptx_loss(self.policy, ids.to(self.device), attn.to(self.device))
                        if torch.isfinite(lm_loss):
                            (cfg.ptx.coef * lm_loss).backward()
                            ptx_losses.append(lm_loss.item())
                        else:
                            finite = False
                    t_opt = time.perf_counter()
                    if finite:
                        grad_norm = torch.nn.utils.clip_grad_norm_(
                            [p for p in self.policy.parameters() if p.requires_grad], o.max_grad_norm
                        )
                        finite = bool(torch.isfinite(grad_norm))
                        grad_norms.append(float(grad_norm))
                    if finite:
                        self.optimizer.step()
                        self.scheduler.step()
                        steps += 1
                        losses.append(mb_loss)
                    else:
                        # Leave weights and optimizer state untouched; record the skip.
                        self.optimizer.zero_grad(set_to_none=True)
                        skipped += 1
                    timers["optimizer"] += _synced_clock(self.device) - t_opt
                if trains_critic:
                    cm = self.critic_trainer.fit_minibatch(
                        batch.rollout, mb_rows, batch.old_values, batch.returns, batch.critic_mask
                    )
                    if cm:
                        critic_skipped += int(cm["skipped"])
                        if not cm["skipped"]:
                            critic_steps += 1
                            critic_grad_norms.append(cm["grad_norm"])
                            n = cm["num_tokens"]
                            critic_tokens += n
                            for key in ("vf_loss", "vf_clipfrac"):
                                critic_sums[key] = critic_sums.get(key, 0.0) + cm[key] * n
        self.optimizer.zero_grad(set_to_none=True)
        names = {
            "clipfrac": "policy/clipfrac",
            "clipfrac_low": "policy/clipfrac_low",
            "clipfrac_high": "policy/clipfrac_high",
            "approx_kl": "policy/approx_kl",
            "ratio_mean": "policy/ratio_mean",
            "ratio_max": "policy/ratio_max",
            "entropy": "policy/entropy",
            "kl_loss": "kl/loss_term",
            "is_weight_mean": "mismatch/is_weight_mean",
            "is_capped_frac": "mismatch/is_capped_frac",
        }
        out: dict[str, Any] = {}
        for key, total in sums.items():
            out[names.get(key, f"policy/{key}")] = total / max(weight_total, 1e-12)
        for key, value in maxima.items():
            out[names.get(key, f"policy/{key}")] = value
        out["policy/loss"] = sum(losses) / len(losses) if losses else float("nan")
        for key, value in timers.items():
            out[f"time/{key}_s"] = value
        out["policy/nonfinite_tokens"] = nonfinite_tokens
        out["optim/steps"] = steps
        out["optim/skipped_nonfinite"] = skipped
        out["optim/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        if o.target_kl is not None:
            out["optim/early_stopped"] = float(early_stopped)
        if self.ptx_data is not None:
            out["ptx/loss"] = sum(ptx_losses) / len(ptx_losses) if ptx_losses else float("nan")
        if trains_critic:
            for key, total in critic_sums.items():
                out[f"critic/{key}"] = total / max(critic_tokens, 1e-12)
            out["critic/steps"] = critic_steps
            out["critic/skipped_nonfinite"] = critic_skipped
            out["critic/grad_norm"] = (
                sum(critic_grad_norms) / len(critic_grad_norms) if critic_grad_norms else float("nan")
            )
            out["critic/lr"] = self.critic_trainer.scheduler.get_last_lr()[0]
        return out

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def evaluate(self, rows: list[dict[str, Any]] | None = None, *, batch_size: int = 64, tag: str = "eval"):
        """Greedy accuracy on held-out rows, judged by the answer-correctness verifier.

        Returns ``(accuracy, records)``; records (prompt, completion, answer, reward) are also
        written to ``RUN_DIR/<tag>.jsonl``."""
        from policygrad.rewards.verifiers import answer_correctness

        rows = self.eval_rows if rows is None else rows
        if not rows:
            return float("nan"), []
        records = []
        for start in range(0, len(rows), batch_size):
            chunk = rows[start : start + batch_size]
            rollout = self.engine.generate(
                self._prompt_ids(chunk),
                group_size=1,
                max_new_tokens=self.config.rollout.max_new_tokens,
                greedy=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
            )
            completions = self._completions(rollout)
            rewards = answer_correctness(
                [r["prompt"] for r in chunk], completions, answer=[r["answer"] for r in chunk]
            )
            for row, completion, reward in zip(chunk, completions, rewards):
                records.append(
                    {
                        "prompt": row["prompt"],
                        "answer": row["answer"],
                        "completion": completion,
                        "reward": float(reward),
                    }
                )
        accuracy = sum(r["reward"] for r in records) / len(records)
        _write_jsonl(os.path.join(self.run_dir, f"{tag}.jsonl"), records)
        return accuracy, records

    # ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        """Run ``config.steps`` steps (or until ``max_minutes``), with held-out evaluation before
        and after. Returns a summary that is also written to ``RUN_DIR/summary.json``."""
        import json

        from tqdm import tqdm

        cfg = self.config
        start = time.perf_counter()
        summary: dict[str, Any] = {"run_dir": self.run_dir, "rollout_engine": self.engine_name}
        if cfg.eval_before and self.eval_rows and self.step_idx == 0:
            acc, _ = self.evaluate(tag="eval_before")
            summary["accuracy_before"] = acc
            self.logger.log(0, {"eval/accuracy": acc})
            print(f"held-out greedy accuracy before training: {acc:.3f} ({len(self.eval_rows)} problems)")
        bar = tqdm(
            total=cfg.steps, initial=self.step_idx, disable=not cfg.progress, desc="train", dynamic_ncols=True
        )
        stopped_early = False
        while self.step_idx < cfg.steps:
            if cfg.max_minutes is not None and (time.perf_counter() - start) / 60 > cfg.max_minutes:
                stopped_early = True
                break
            metrics = self.step()
            if cfg.eval_every and self.step_idx % cfg.eval_every == 0 and self.step_idx < cfg.steps:
                metrics["eval/accuracy"], _ = self.evaluate(tag=f"eval_step{self.step_idx}")
            self.logger.log(self.step_idx, metrics)
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.3f}",
                len=f"{metrics['response/length_mean']:.0f}",
                s=f"{metrics['time/step_s']:.1f}",
            )
            if cfg.log_completions and self.step_idx % 10 == 1:
                for sample in self._last_samples[: cfg.log_completions]:
                    bar.write(
                        f"  [step {self.step_idx}] reward={sample['reward']:.2f} "
                        f"{sample['completion'][:120]!r}"
                    )
            if cfg.save_every and self.step_idx % cfg.save_every == 0:
                self.save_checkpoint()
        bar.close()
        summary["steps"] = self.step_idx
        summary["stopped_by_max_minutes"] = stopped_early
        summary["train_minutes"] = (time.perf_counter() - start) / 60
        if cfg.eval_after and self.eval_rows:
            acc, _ = self.evaluate(tag="eval_after")
            summary["accuracy_after"] = acc
            self.logger.log(self.step_idx, {"eval/accuracy": acc})
            print(f"held-out greedy accuracy after training:  {acc:.3f} ({len(self.eval_rows)} problems)")
            if "accuracy_before" in summary:
                summary["accuracy_gain"] = acc - summary["accuracy_before"]
                print(f"change: {summary['accuracy_gain']:+.3f}")
        summary["wall_minutes"] = (time.perf_counter() - start) / 60
        summary["peak_rss_gb"] = peak_rss_gb()
        if not cfg.save_every or self.step_idx % cfg.save_every:
            self.save_checkpoint()
        with open(os.path.join(self.run_dir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)
        self.logger.close()
        return summary

    def close(self) -> None:
        """Shut down the rollout engine (vLLM holds its own weights, KV cache and process state)
        and flush the metrics log. The trainer cannot generate afterwards."""
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()
        self.logger.close()

    # ------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """Write ``RUN_DIR/checkpoints/step_N``: weights (safetensors; the adapter with LoRA),
        optimizer, scheduler, KL controller, data position and RNG states; with a critic its
        weights (``critic/``) and optimizer; the reward normaliser and the PPO-ptx position."""
        path = os.path.join(self.run_dir, "checkpoints", f"step_{self.step_idx}")
        os.makedirs(path, exist_ok=True)
        self.policy.save_pretrained(os.path.join(path, "model"), safe_serialization=True)
        # The tokenizer too, so a checkpoint is a complete model folder (policygrad eval --model).
        self.tokenizer.save_pretrained(os.path.join(path, "model"))
        state = {
            "step": self.step_idx,
            "data_position": self.stream.position,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "kl_controller": self.kl_ctl.state_dict(),
            "reward_normalizer": self.reward_normalizer.state_dict(),
            "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
        }
        if self.critic is not None:
            self.critic.save(os.path.join(path, "critic"))
            state["critic"] = self.critic_trainer.state_dict()
        if self.ptx_data is not None:
            state["ptx_position"] = self.ptx_data.position
        torch.save(state, os.path.join(path, "trainer_state.pt"))
        return path

    def _load_state(self, ckpt: str) -> None:
        state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
        self.step_idx = state["step"]
        self.stream.position = state["data_position"]
        self.optimizer.load_state_dict(state["optimizer"])
        fused = self.optimizer.defaults.get("fused")
        for group in self.optimizer.param_groups:  # a checkpoint may carry another implementation
            group["fused"] = fused
        self.scheduler.load_state_dict(state["scheduler"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        if "reward_normalizer" in state:
            self.reward_normalizer.load_state_dict(state["reward_normalizer"])
        if self.critic_trainer is not None:
            if "critic" not in state:
                raise TrainingError(
                    f"checkpoint {ckpt} has no critic state; it was written by a run without a critic"
                )
            self.critic_trainer.load_state_dict(state["critic"])
        if self.ptx_data is not None:
            self.ptx_data.position = state.get("ptx_position", 0)
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"])


# ----------------------------------------------------------------------------------------------
def _engine_context(model, wanted: int) -> int:
    """``wanted`` (longest prompt + new tokens) capped at the model's ``max_position_embeddings``:
    longer prompts are refused by the engine itself, naming ``max_new_tokens``."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return min(wanted, int(limit)) if limit else wanted


def _release_free_memory() -> None:
    """Hand memory the allocator holds but no tensor uses back to the OS (glibc ``malloc_trim``).

    Generation and training need their large temporaries at different times; without a trim,
    glibc keeps the pages of one phase mapped through the next, and the process's peak RSS is
    the sum of both phases instead of the larger one. A no-op where glibc is absent."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None


def _synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work has finished (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _is_metrics(
    sampler_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    level: str,
    cap: float,
) -> dict[str, torch.Tensor]:
    """Per-token means of the importance weights actually applied and of the fraction of valid
    tokens whose raw ratio ``pi_trainer / pi_sampler`` (token level) or sequence ratio (sequence
    level) exceeded ``cap`` (clipped in ``truncate`` mode, dropped in ``mask`` mode). [B, T] inputs."""
    with torch.no_grad():
        valid = mask > 0
        log_ratio = torch.where(valid, logprobs.float() - sampler_logprobs.float(), 0.0)
        if level == "sequence":
            log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
        capped = (log_ratio > math.log(cap)) & valid
        return {
            "is_weight_mean": masked_mean(weights.float(), mask),
            "is_capped_frac": masked_mean(capped.float(), mask),
        }


def _prepare_new_run_dir(run_dir: str, *, overwrite: bool) -> None:
    """A new run never mixes with an old one: an ``output_dir`` that already holds a run is an
    error unless ``overwrite`` is set, in which case the old run's files are removed.

    Raises:
        ConfigError: ``run_dir`` holds a run and ``overwrite`` is False, or it is a file.
    """
    import shutil

    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"output_dir={run_dir!r} is a file; give a folder")
    markers = ("checkpoints", "metrics.jsonl", "config.yaml", "summary.json")
    if not os.path.isdir(run_dir) or not any(os.path.exists(os.path.join(run_dir, m)) for m in markers):
        return
    if not overwrite:
        raise ConfigError(
            f"output_dir={run_dir!r} already holds a run; continue it with --resume {run_dir}, choose a new "
            "--output_dir, or replace it with --overwrite=true"
        )
    for name in (*markers, "tensorboard"):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    for name in os.listdir(run_dir):
        if name.startswith("eval") and name.endswith(".jsonl"):
            os.remove(os.path.join(run_dir, name))


def _fill_with_group_mean(
    scores: torch.Tensor, missing: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """[B] scores with ``missing`` rows replaced by the mean of their group's other rows (0 when
    the whole group is missing), so they change neither the group mean nor any advantage."""
    n = int(group_index.max()) + 1
    present = (~missing).to(scores.dtype)
    sums = torch.zeros(n, dtype=scores.dtype).index_add(0, group_index, torch.where(missing, 0.0, scores))
    counts = torch.zeros(n, dtype=scores.dtype).index_add(0, group_index, present)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return torch.where(missing, means[group_index], scores)


def _rows_of_varied_groups(scores: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows whose group has at least two different scores (dynamic sampling, DAPO)."""
    n = int(group_index.max()) + 1
    g = group_index.cpu()
    hi = torch.full((n,), -math.inf).scatter_reduce(0, g, scores, "amax")
    lo = torch.full((n,), math.inf).scatter_reduce(0, g, scores, "amin")
    return (hi > lo)[g]


def _schedule(o, total: int):
    def factor(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if o.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def latest_checkpoint(run_dir: str) -> str | None:
    """The ``checkpoints/step_N`` folder with the largest N under ``run_dir``, or None."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = [
        int(d.split("_")[1]) for d in os.listdir(root) if d.startswith("step_") and d.split("_")[1].isdigit()
    ]
    return os.path.join(root, f"step_{max(steps)}") if steps else None


def load_policy_weights(model, folder: str) -> None:
    """Load saved policy weights (full model safetensors or a peft adapter) into ``model``."""
    from safetensors.torch import load_file

    adapter = os.path.join(folder, "adapter_model.safetensors")
    if os.path.exists(adapter):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    state = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, name)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "lm_head" not in k]  # tied embeddings are saved once
    if missing or unexpected:
        raise TrainingError(
            f"checkpoint {folder} does not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )


def _write_jsonl(path: str, records: list[dict[str, Any]]) -> None:
    import json

    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
