"""A learned reward model as a reward function: a local one-label sequence classifier.

:class:`RewardModel` follows the reward-function protocol of :mod:`policygrad.rewards.registry`,
``fn(prompts, completions, **row_fields) -> list[float]``, so every algorithm can use it, alone
or summed with verifiers. In a config it is a ``reward.functions`` entry
``reward_model:/path/to/folder`` (see :func:`resolve_reward_functions`).

What it computes, for each (prompt, completion) pair:

1. the text the reward model was trained on: with a chat template (and ``use_chat_template``) the
   conversation ``[user: prompt, assistant: completion]`` rendered by the reward model's own
   tokenizer; without one, ``prompt + completion``;
2. its tokens with the reward model's tokenizer, right-padded in batches of ``batch_size``,
   truncated from the LEFT to ``max_length`` (the end of the response, where the score is read,
   is kept);
3. the transformer's hidden state at the LAST REAL token of each row (the largest column where
   the attention mask is 1), passed through the score head: one float per row.

Step 3 never reads a padding position. Hugging Face's own pooling picks the last token that is
not ``pad_token_id``, which is wrong when the pad id equals the end-of-sequence id (SmolLM2, many
Llama tokenizers): the EOS that ends a response is then skipped. Reading the attention mask
avoids that: the score is read at the EOS token that ends the response, never at padding (as in
Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO", which reads the reward at the
EOS token and warns against treating the pad token as EOS).

The model is frozen (no gradient, eval mode) with dropout off, and runs under
``torch.inference_mode``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from policygrad.models.loading import disable_dropout, resolve_torch_dtype, zero_dropout_config
from policygrad.models.value import is_sequence_classifier, score_head

__all__ = ["REWARD_MODEL_PREFIX", "RewardModel", "resolve_reward_functions", "reward_model_folder"]

REWARD_MODEL_PREFIX = "reward_model:"


def _last_real_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B] long: the largest column where ``attention_mask`` is nonzero (left or right padding)."""
    columns = torch.arange(attention_mask.shape[1], device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask != 0, columns, -1).max(dim=-1).values


class RewardModel:
    """A frozen one-label sequence classifier scoring prompt + completion at the last real token.

    Args:
        model: a decoder-only ``AutoModelForSequenceClassification`` with ``num_labels=1`` and a
            linear ``score`` head (Llama, Qwen2, Mistral, Gemma, GPT-2 ...).
        tokenizer: its tokenizer. A tokenizer without a pad token gets its eos token as pad
            (harmless: positions are found from the attention mask, never from the pad id).
        batch_size: rows per forward pass, >= 1.
        max_length: most tokens per row, >= 2; longer texts lose their beginning.
        use_chat_template: render ``[user, assistant]`` with the tokenizer's chat template when it
            has one.
        device: where the inputs go; None: the model's device.

    Raises:
        ValueError: the model has no one-output ``score`` head; bad ``batch_size`` or
            ``max_length``; the tokenizer has neither a pad nor an eos token.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        batch_size: int = 16,
        max_length: int = 1024,
        use_chat_template: bool = True,
        device: str | torch.device | None = None,
    ):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"reward model batch_size must be an int >= 1, got {batch_size!r}")
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"reward model max_length must be an int >= 2, got {max_length!r}")
        self.head = score_head(model)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if not isinstance(base, torch.nn.Module):
            raise ValueError(f"{type(model).__name__} exposes no base transformer (base_model_prefix)")
        self.base = base
        self.model = disable_dropout(model)
        self.model.eval()
        self.model.requires_grad_(False)
        if tokenizer.pad_token_id is None:
            if tokenizer.eos_token is None:
                raise ValueError("the reward model's tokenizer has neither a pad token nor an eos token")
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_length = max_length
        self.use_chat_template = use_chat_template
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.__name__ = "reward_model"  # the component name in reward_fn/<name>/mean

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device | None = None,
        **options,
    ) -> RewardModel:
        """Load a reward model folder (``config.json`` of a ``*ForSequenceClassification`` with one
        label, weights, tokenizer). ``options`` go to the constructor.

        Raises:
            ValueError: not a folder, not a sequence classifier, more than one label.
        """
        # Function-level: transformers is heavy and only a reward model needs it.
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        folder = os.path.expanduser(path)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ValueError(
                f"reward model {path!r} is not a model folder (no config.json there); give the folder "
                "of an AutoModelForSequenceClassification saved with save_pretrained"
            )
        if not is_sequence_classifier(folder):
            raise ValueError(
                f"reward model {path!r} is not a sequence classifier (its config.json architectures do "
                "not end in ForSequenceClassification); a reward model is an "
                "AutoModelForSequenceClassification with num_labels=1"
            )
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # library code only, never asks
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(
                f"reward model {path!r} has num_labels={config.num_labels}; it needs num_labels=1"
            )
        zero_dropout_config(config)
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, config=config, dtype=resolve_torch_dtype(dtype), trust_remote_code=False
        )
        if device is not None:
            model.to(device)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        return cls(model, tokenizer, device=device, **options)

    # ------------------------------------------------------------------------------------------
    def texts(self, prompts: Sequence[str], completions: Sequence[str]) -> list[str]:
        """The text scored for each pair (see the module docstring, step 1)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if self.use_chat_template and template:
            return [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                    tokenize=False,
                    add_generation_prompt=False,
                )
                for p, c in zip(prompts, completions)
            ]
        return [p + c for p, c in zip(prompts, completions)]

    @torch.inference_mode()
    def score_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores of token rows read at each row's last real token.

        Args:
            input_ids: LongTensor [B, L], any padding.
            attention_mask: [B, L], 1 on real tokens; every row needs at least one.

        Returns:
            float32 [B]: ``score_head(hidden[i, last_i])`` with ``last_i`` the largest column where
            ``attention_mask[i]`` is 1. Nothing at a padding column can reach it.

        Raises:
            ValueError: shapes differ; a row has no real token.
        """
        if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                "must both be [B, L]"
            )
        input_ids = input_ids.to(self.device)
        attention_mask = attention_mask.to(self.device).long()
        last = _last_real_index(attention_mask)
        if bool((last < 0).any()):
            raise ValueError("a reward-model row has no real token (empty prompt and completion)")
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        out = self.base(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state[torch.arange(input_ids.shape[0], device=self.device), last]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def score_texts(self, texts: Sequence[str]) -> torch.Tensor:
        """float32 [N] scores of already formatted texts, in batches of ``batch_size``."""
        has_template = bool(self.use_chat_template and getattr(self.tokenizer, "chat_template", None))
        scores = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start : start + self.batch_size])
            enc = self.tokenizer(
                chunk,
                padding=True,
                truncation=True,
                max_length=self.max_length,
                add_special_tokens=not has_template,  # a rendered template already has its specials
                return_tensors="pt",
            )
            scores.append(self.score_ids(enc["input_ids"], enc["attention_mask"]).cpu())
        return torch.cat(scores) if scores else torch.zeros(0)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **_row_fields) -> list[float]:
        """The reward protocol: one float per completion (row fields are accepted and ignored).

        Raises:
            ValueError: ``prompts`` and ``completions`` differ in length.
        """
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        return self.score_texts(self.texts(list(prompts), list(completions))).tolist()

    def __repr__(self) -> str:
        return f"RewardModel({type(self.model).__name__}, batch_size={self.batch_size})"


def reward_model_folder(spec) -> str | None:
    """The folder of a ``reward_model:PATH`` entry of ``reward.functions`` (``""`` when it names
    none), or None for any other entry (a built-in name, ``module:function``, an object)."""
    if isinstance(spec, str) and spec.strip().startswith(REWARD_MODEL_PREFIX):
        return spec.strip()[len(REWARD_MODEL_PREFIX) :].strip()
    return None


def resolve_reward_functions(
    specs: Sequence,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    batch_size: int = 16,
    max_length: int = 1024,
    use_chat_template: bool = True,
) -> list:
    """Replace every ``reward_model:PATH`` entry of a reward-function list by a loaded
    :class:`RewardModel`; other entries are returned unchanged (for ``CompositeReward``).

    Raises:
        ValueError: an empty path after the prefix; any error of :meth:`RewardModel.from_pretrained`.
    """
    out: list[str | Callable] = []
    for spec in specs:
        path = reward_model_folder(spec)
        if path is not None:
            if not path:
                raise ValueError(
                    f"reward.functions entry {spec!r} names no folder; write reward_model:/path/to/folder"
                )
            out.append(
                RewardModel.from_pretrained(
                    path,
                    dtype=dtype,
                    device=device,
                    batch_size=batch_size,
                    max_length=max_length,
                    use_chat_template=use_chat_template,
                )
            )
        else:
            out.append(spec)
    return out
