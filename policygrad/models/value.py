"""The critic: a transformer with a scalar head giving V(s_t) at every response position.

Alignment (the one thing a value model must get right). For response token ``t`` of a row, the
state is ``s_t`` = the prompt plus the response tokens before ``t``. ``V(s_t)`` is read from the
hidden state at the position BEFORE token ``t`` (column ``P - 1 + t`` of ``cat(prompt, response)``
with P left-padded prompt columns): the same positions whose logits predict token ``t``
(:func:`policygrad.models.forward.response_logits`). With causal attention that hidden state sees
only columns ``<= P - 1 + t``, so the value used for token ``t`` cannot depend on token ``t`` or
any later token. GAE needs exactly this: ``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)``, where
``V(s_t)`` is the critic's guess before it knows which token the policy will choose.

Initialisation (``critic.init_from``):

- ``policy``: the policy's transformer (its language-model head dropped) and a fresh scalar head
  with weight and bias 0, so every value starts at 0, the mean of a normalised reward.
- a folder holding an ``AutoModelForSequenceClassification`` with one label (a reward model):
  its transformer and its score head, as InstructGPT initialised its value function from the
  reward model (Ouyang et al. 2022, "Training Language Models to Follow Instructions with Human
  Feedback", appendix C.4).
- any other causal-LM folder: its transformer and a zero head.

Dropout is off (as in every model :mod:`policygrad.models.loading` builds). The head runs in the
backbone's dtype; values are returned in float32.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from policygrad.models.loading import disable_dropout, resolve_model_path, resolve_torch_dtype

__all__ = ["ValueModel", "load_value_model", "is_sequence_classifier"]


def is_sequence_classifier(path: str, *, trust_remote_code: bool = False) -> bool:
    """True when the folder's ``config.json`` names a ``*ForSequenceClassification`` architecture.

    Raises:
        OSError: from transformers when the folder holds no ``config.json``.
    """
    # heavy: loaded when a model is built, not when the module is imported
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return any(str(a).endswith("ForSequenceClassification") for a in (config.architectures or []))


def score_head(model) -> torch.nn.Linear:
    """The scalar head of a decoder-only sequence classifier (``.score``: Llama, Qwen2, Mistral,
    Gemma, GPT-2, GPT-NeoX ...), checked to map the hidden size to one output."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__} has no linear 'score' head; a reward model here must be a "
            "decoder-only AutoModelForSequenceClassification (LlamaForSequenceClassification, "
            "Qwen2ForSequenceClassification, ...) whose head reads each position's hidden state"
        )
    if head.out_features != 1:
        raise ValueError(
            f"the reward model's score head has {head.out_features} outputs; a reward model needs "
            "num_labels=1 (one scalar score per sequence)"
        )
    return head


class ValueModel(torch.nn.Module):
    """Transformer backbone plus a linear scalar head: ``V = head(hidden_state)``.

    Args:
        backbone: a Hugging Face base model (``LlamaModel`` ...) or a peft wrapper of one, called
            as ``backbone(input_ids=, attention_mask=, position_ids=)`` and returning
            ``last_hidden_state`` [B, L, H].
        head: ``torch.nn.Linear(H, 1)``.

    Raises:
        TypeError: ``head`` is not a ``Linear`` with one output.
    """

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Linear):
        super().__init__()
        if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
            raise TypeError(f"head must be torch.nn.Linear(hidden_size, 1), got {head!r}")
        self.backbone = backbone
        self.head = head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values at the chosen columns.

        Args:
            input_ids: LongTensor [B, L].
            attention_mask: [B, L], 1 on real tokens (None: all real).
            position_ids: LongTensor [B, L] (None: the backbone's default).
            positions: LongTensor [K] of column indices to read, or None for all L columns.

        Returns:
            float32 [B, K] (or [B, L]): ``V`` at those columns, each computed from the hidden
            state at that column (which, with causal attention, sees columns up to it only).
        """
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state
        if positions is not None:
            hidden = hidden[:, positions]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()

    def response_values(self, rollout) -> torch.Tensor:
        """``V(s_t)`` for every response token of a rollout.

        Args:
            rollout: a :class:`policygrad.rollout.base.Rollout` (left-padded prompts, P columns;
                right-padded responses, T columns).

        Returns:
            float32 [B, T], with gradient when called outside ``no_grad``. Column ``t`` is read at
            sequence column ``P - 1 + t`` (the last prompt token for t = 0): the value of the
            state before response token ``t``. Values at masked (post-EOS, padding) positions
            are whatever the head gives there; callers mask them.
        """
        P = rollout.prompt_ids.shape[1]
        T = rollout.response_ids.shape[1]
        input_ids = rollout.input_ids()
        keep = torch.arange(P - 1, P + T - 1, device=input_ids.device)
        return self(
            input_ids,
            attention_mask=rollout.attention_mask(),
            position_ids=rollout.position_ids(),
            positions=keep,
        )

    # ------------------------------------------------------------------------------------------
    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters that training changes (all of them for a full critic; the LoRA adapters
        and the head with LoRA), detached and contiguous, keyed by parameter name."""
        return {name: p.detach().contiguous() for name, p in self.named_parameters() if p.requires_grad}

    def save(self, folder: str, state: dict[str, torch.Tensor] | None = None) -> str:
        """Write :meth:`trainable_state_dict` to ``folder/value_model.safetensors``; returns the path.

        ``state``: the full weights to take the trainable ones from instead (an FSDP-sharded
        critic's, gathered by :func:`policygrad.parallel.sharding.full_state_dict`)."""
        # loaded where a value head's weights are written or read
        from safetensors.torch import save_file

        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "value_model.safetensors")
        if state is None:
            trainable = self.trainable_state_dict()
        else:
            trainable = {n: state[n].contiguous() for n, p in self.named_parameters() if p.requires_grad}
        save_file({k: v.cpu() for k, v in trainable.items()}, path)
        return path

    def load(self, folder: str) -> None:
        """Restore what :meth:`save` wrote into this (identically built) model.

        Raises:
            FileNotFoundError: ``folder/value_model.safetensors`` is missing.
            ValueError: the file does not match this model's trainable parameters.
        """
        # loaded where a value head's weights are written or read
        from safetensors.torch import load_file

        path = os.path.join(folder, "value_model.safetensors")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no value model weights at {path}")
        state = load_file(path)
        params = dict(self.named_parameters())
        expected = {k for k, p in params.items() if p.requires_grad}
        if set(state) != expected:
            missing = sorted(expected - set(state))[:3]
            unexpected = sorted(set(state) - expected)[:3]
            raise ValueError(
                f"value model checkpoint {path} does not match the critic: missing {missing}, "
                f"unexpected {unexpected} (was it saved with another critic.lora setting?)"
            )
        with torch.no_grad():
            for key, value in state.items():
                params[key].copy_(value.to(params[key].dtype))


def _apply_lora_backbone(
    backbone, *, rank: int, alpha: float, dropout: float, target_modules: str | Sequence[str]
):
    """LoRA adapters (Hu et al. 2021, eq. 3) on a base transformer without a language-model head;
    only the adapters train. Same argument checks as ``models.loading.apply_lora``."""
    # peft loads only for a LoRA run
    from peft import LoraConfig, get_peft_model

    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"critic.lora.rank must be an int >= 1 (0 means no LoRA), got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"critic.lora.alpha must be > 0, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"critic.lora.dropout must be in [0, 1), got {dropout}")
    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    if not targets:
        raise ValueError("critic.lora.target_modules is empty; give 'all-linear' or a list like ['q_proj']")
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="FEATURE_EXTRACTION"
    )
    return get_peft_model(backbone, config)


def load_value_model(
    init_from: str,
    *,
    policy_path: str,
    dtype: str | torch.dtype = "float32",
    lora_rank: int = 0,
    lora_alpha: float = 32.0,
    lora_dropout: float = 0.0,
    lora_target_modules: str | Sequence[str] = "all-linear",
    gradient_checkpointing: bool = False,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
) -> ValueModel:
    """Build the critic (trainable, dropout off, train mode).

    Args:
        init_from: ``"policy"`` (the transformer of ``policy_path`` with a zero head), or a model
            folder: a one-label ``AutoModelForSequenceClassification`` (a reward model: its
            transformer and its score head are copied) or any causal LM (its transformer, zero
            head). ``bundled:NAME`` and hub ids resolve as for ``model.name``.
        policy_path: the policy's resolved folder (for ``"policy"`` and the vocabulary check).
        dtype: parameter dtype (``"float32"``, ``"bfloat16"``, ... or a torch dtype).
        lora_rank: 0 for a full critic; >= 1 puts LoRA adapters on the transformer (the head is
            always fully trained).
        lora_alpha, lora_dropout, lora_target_modules: the LoRA settings.
        gradient_checkpointing: recompute activations in the backward pass.
        device: where to put the model.
        trust_remote_code: run the modelling code a folder ships; False never runs it or asks.

    Returns:
        :class:`ValueModel`; with a zero head every initial value is exactly 0.

    Raises:
        ValueError: ``init_from`` is empty, not a model folder, a classifier with more than one
            label, or a model whose vocabulary size differs from the policy's (the critic reads
            the policy's token ids, so it must share the policy's tokenizer).
    """
    # heavy: loaded when a model is built, not when the module is imported
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    if not isinstance(init_from, str) or not init_from.strip():
        raise ValueError(
            "critic.init_from must be 'policy' or a model folder (a reward model or a causal LM)"
        )
    torch_dtype = resolve_torch_dtype(dtype)
    path = policy_path if init_from.strip() == "policy" else resolve_model_path(init_from.strip())
    trust = {"trust_remote_code": trust_remote_code}
    config = AutoConfig.from_pretrained(path, **trust)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and type(value) is float:
            setattr(config, key, 0.0)
    config.use_cache = False
    policy_vocab = AutoConfig.from_pretrained(policy_path, **trust).get_text_config().vocab_size
    vocab = config.get_text_config().vocab_size
    if vocab != policy_vocab:
        raise ValueError(
            f"critic.init_from={init_from!r} has a vocabulary of {vocab} tokens but the policy's has "
            f"{policy_vocab}; the critic reads the policy's token ids, so it must share the policy's "
            "tokenizer (use critic.init_from=policy or a reward model trained on the policy's tokenizer)"
        )
    if is_sequence_classifier(path, trust_remote_code=trust_remote_code):
        if getattr(config, "num_labels", 1) != 1:
            raise ValueError(
                f"critic.init_from={init_from!r} is a classifier with {config.num_labels} labels; "
                "a reward model to initialise the critic from needs num_labels=1"
            )
        classifier = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, dtype=torch_dtype, **trust
        )
        source = score_head(classifier)
        backbone = getattr(classifier, classifier.base_model_prefix)
        hidden = source.in_features
        head = torch.nn.Linear(hidden, 1, bias=True, dtype=source.weight.dtype)
        with torch.no_grad():
            head.weight.copy_(source.weight)
            head.bias.copy_(source.bias if source.bias is not None else torch.zeros(1))
        del classifier
    else:
        backbone = AutoModel.from_pretrained(path, config=config, dtype=torch_dtype, **trust)
        hidden = backbone.config.get_text_config().hidden_size
        param_dtype = next(backbone.parameters()).dtype
        head = torch.nn.Linear(hidden, 1, bias=True, dtype=param_dtype)
        with torch.no_grad():
            head.weight.zero_()
            head.bias.zero_()
    disable_dropout(backbone)
    if gradient_checkpointing:
        backbone.gradient_checkpointing_enable()
        if lora_rank:
            backbone.enable_input_require_grads()  # frozen embeddings: keep a graph for the adapters
    if lora_rank:
        backbone.requires_grad_(False)
        backbone = _apply_lora_backbone(
            backbone,
            rank=lora_rank,
            alpha=lora_alpha,
            dropout=lora_dropout,
            target_modules=lora_target_modules,
        )
    else:
        backbone.requires_grad_(True)
    model = ValueModel(backbone, head)
    head.requires_grad_(True)
    if device is not None:
        model.to(device)
    model.train()
    return model
