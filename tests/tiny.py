"""Tiny, randomly initialised models and tokenizers for fast offline tests.

Nothing here downloads anything: the tokenizer is built with the ``tokenizers`` library from a
character-level vocabulary, and the model is a ``LlamaForCausalLM`` with a few thousand parameters,
shaped like SmolLM2 (tied embeddings, ChatML chat template, ``<|im_end|>`` as end of sequence).

Token ids of the special tokens are fixed: ``<pad>`` = 0, ``<|im_start|>`` = 1, ``<|im_end|>`` = 2,
``<unk>`` = 3; every other id is one printable ASCII character.
"""

from __future__ import annotations

import os
import string

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

# ChatML, the template SmolLM2-Instruct uses (without its default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Every printable ASCII character except the rarely useful \t \r \x0b \x0c; includes digits,
# letters, space, newline and all punctuation (+-*/=?.,:#\{}() among them).
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer with ChatML special tokens, built offline.

    Vocabulary: the 4 special tokens (ids 0..3, see the module docstring) followed by one token per
    printable ASCII character (``len(tokenizer) == 4 + len(CHARACTERS)`` = 100). Unknown characters
    map to ``<unk>``. ``decode(ids, skip_special_tokens=True)`` returns the original text exactly
    (characters are concatenated with no added spaces). Padding side is left.

    Returns:
        PreTrainedTokenizerFast with pad ``<pad>``, eos ``<|im_end|>``, bos ``<|im_start|>``, unk
        ``<unk>`` and a ChatML ``chat_template`` (generation prompt ``<|im_start|>assistant\\n``).
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # One pre-token per character (newline included), so WordLevel acts as a character model.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(
    path: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    max_position_embeddings: int = 512,
    initializer_range: float = 0.02,
    **config_overrides,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """A randomly initialised tiny ``LlamaForCausalLM`` plus the tiny tokenizer.

    The config mirrors SmolLM2's choices: tied input/output embeddings, ``eos_token_id`` = id of
    ``<|im_end|>`` (2), ``pad_token_id`` = id of ``<pad>`` (0), ``bos_token_id`` = id of
    ``<|im_start|>`` (1); ``generation_config`` carries the same eos/pad/bos ids. Weights are
    drawn with ``torch.manual_seed(seed)`` inside ``torch.random.fork_rng`` so the caller's RNG
    stream is untouched and the same seed gives bitwise the same model. The model is returned
    in float32 and train mode.

    Args:
        path: when given, ``save_pretrained`` of model, tokenizer and generation config into this
            folder (created if missing), so it loads with ``from_pretrained`` like any local
            Hugging Face model folder.
        seed: weight-initialisation seed.
        vocab_size: embedding rows; defaults to ``len(tokenizer)`` (100). Must be >= that.
        hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
        max_position_embeddings, initializer_range: the Llama config fields of the same meaning.
        **config_overrides: any other ``LlamaConfig`` field (e.g. ``attention_dropout=0.1``).

    Raises:
        ValueError: ``vocab_size`` smaller than the tokenizer's vocabulary.
    """
    tokenizer = make_tiny_tokenizer()
    if vocab_size is None:
        vocab_size = len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        **config_overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.train()
    if path is not None:
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model, tokenizer
