"""Loading models and tokenizers (local folders, hub ids, the bundled default), LoRA, EOS ids."""

from policygrad.models.bundled import BUNDLED_MODELS, DEFAULT_MODEL, ensure_bundled_model, policygrad_home
from policygrad.models.loading import (
    apply_lora,
    disable_dropout,
    eos_token_ids,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)

__all__ = [
    "BUNDLED_MODELS",
    "DEFAULT_MODEL",
    "apply_lora",
    "disable_dropout",
    "ensure_bundled_model",
    "eos_token_ids",
    "load_causal_lm",
    "load_tokenizer",
    "policygrad_home",
    "resolve_model_path",
]
