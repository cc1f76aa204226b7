"""Prompt text -> model input: the tokenizer's chat template, then token ids within a budget.

The chat template is what an instruction-tuned model was trained on; skipping it (or adding a
second beginning-of-sequence token) shifts the model's distribution before training starts.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_prompt", "format_prompts", "tokenize_prompts"]


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt(
    tokenizer,
    prompt: str,
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> str:
    """The text the model sees for one prompt.

    With a chat template (``tokenizer.chat_template`` set and ``use_chat_template``): the messages
    ``[system (when given), user: prompt]`` rendered by ``tokenizer.apply_chat_template(...,
    tokenize=False, add_generation_prompt=True)``, so the text ends with the assistant turn's
    header (for ChatML: ``<|im_start|>assistant\\n``). Some templates add a default system message
    when none is given (SmolLM2's does).

    Without one: the plain prompt, preceded by ``system_prompt`` and a blank line when given.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt: the dataset's prompt text.
        system_prompt: an optional system message.
        use_chat_template: set False to feed plain text even when a template exists.

    Returns:
        str, the formatted prompt (special tokens written out as text).

    Raises:
        TypeError: ``prompt`` or ``system_prompt`` is not a string.
        ValueError: the chat template rejected the messages (for example a template that has no
            system role); the message says to drop ``system_prompt`` or set
            ``use_chat_template=False``.
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise TypeError(f"system_prompt must be a string or None, got {type(system_prompt).__name__}")
    if use_chat_template and _has_chat_template(tokenizer):
        messages = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": prompt})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja errors come in several types
            hint = "drop system_prompt, or " if system_prompt else ""
            raise ValueError(
                f"the tokenizer's chat template failed on this prompt ({type(exc).__name__}: {exc}); "
                f"{hint}set use_chat_template=False to feed plain text"
            ) from exc
        if not isinstance(text, str):
            raise ValueError(
                f"apply_chat_template returned {type(text).__name__}, not text; this tokenizer's template "
                "is not usable here, set use_chat_template=False"
            )
        return text
    if system_prompt:
        return f"{system_prompt}\n\n{prompt}"
    return prompt


def format_prompts(
    tokenizer,
    prompts: Sequence[str],
    *,
    system_prompt: str | None = None,
    use_chat_template: bool = True,
) -> list[str]:
    """:func:`format_prompt` for each prompt of a list."""
    return [
        format_prompt(tokenizer, p, system_prompt=system_prompt, use_chat_template=use_chat_template)
        for p in prompts
    ]


def _default_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer prepends by default, or None when it prepends nothing."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    if len(with_special) > len(without) and with_special[0] == bos:
        return bos
    return None


def tokenize_prompts(
    tokenizer,
    texts: Sequence[str],
    *,
    max_prompt_length: int,
    row_labels: Sequence | None = None,
    ids: Sequence[Sequence[int]] | None = None,
) -> list[list[int]]:
    """Token ids of formatted prompts, with one BOS at most and no EOS.

    Texts are tokenized without special tokens; the tokenizer's default BOS (if it adds one, as
    Llama tokenizers do) is prepended only when the text does not already start with it, which a
    chat template that writes BOS into the text does. No EOS is ever appended: the model continues
    the prompt.

    Args:
        tokenizer: a Hugging Face tokenizer.
        texts: P formatted prompts (from :func:`format_prompt`).
        max_prompt_length: the most tokens a prompt may have (> 0).
        row_labels: optional P labels naming each prompt in error messages (e.g. the dataset row
            numbers); default: the position in ``texts``.
        ids: the P texts' ids as the caller tokenised them (an episode's opening, whose message
            contents are plain text: :meth:`~policygrad.envs.template.ChatDelta.prompt`); None:
            the tokenizer's, special tokens parsed.

    Returns:
        list of P lists of int token ids (unpadded; lengths vary).

    Raises:
        ValueError: ``max_prompt_length`` is not a positive int; a prompt has no tokens; a prompt is
            longer than ``max_prompt_length`` (the message names the row, its length and the fix).
        TypeError: ``texts`` is a single string or holds a non-string.
    """
    if (
        isinstance(max_prompt_length, bool)
        or not isinstance(max_prompt_length, int)
        or max_prompt_length <= 0
    ):
        raise ValueError(f"max_prompt_length must be a positive int, got {max_prompt_length!r}")
    if isinstance(texts, str):
        raise TypeError("texts must be a list of prompt strings, got one string; wrap it in a list")
    texts = list(texts)
    for k, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"prompt {k} must be a string, got {type(text).__name__}")
    if not texts:
        return []
    if row_labels is not None and len(row_labels) != len(texts):
        raise ValueError(
            f"row_labels has {len(row_labels)} entries for {len(texts)} prompts; give one per prompt"
        )
    labels = list(row_labels) if row_labels is not None else list(range(len(texts)))
    bos = _default_bos(tokenizer)
    if ids is not None and len(ids) != len(texts):
        raise ValueError(f"ids has {len(ids)} entries for {len(texts)} prompts; give one per prompt")
    encoded = ids if ids is not None else tokenizer(texts, add_special_tokens=False)["input_ids"]
    out = []
    for k, (text, ids) in enumerate(zip(texts, encoded)):
        ids = list(ids)
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        if not ids:
            raise ValueError(
                f"prompt {labels[k]} is empty (no tokens); remove empty prompts from the dataset"
            )
        if len(ids) > max_prompt_length:
            raise ValueError(
                f"prompt {labels[k]} is {len(ids)} tokens long, over max_prompt_length={max_prompt_length} "
                f"(prompt starts {text[:80]!r}); raise max_prompt_length, or shorten or drop the long "
                "prompts in the dataset"
            )
        out.append(ids)
    return out


def encode_prompts(tokenizer, rows: Sequence, data) -> list[list[int]]:
    """Token ids of dataset rows' prompts as the run formats them: :func:`format_prompt` with
    the data section's ``system_prompt`` and ``use_chat_template``, then :func:`tokenize_prompts`
    with its ``max_prompt_length``.

    Args:
        tokenizer: the policy's tokenizer.
        rows: dataset rows (dicts with ``"prompt"``).
        data: the run's data section (``policygrad.config.train.DataConfig``).

    Raises:
        ValueError: as :func:`tokenize_prompts` (a prompt over ``max_prompt_length`` names the row).
    """
    texts = format_prompts(
        tokenizer,
        [r["prompt"] for r in rows],
        system_prompt=data.system_prompt,
        use_chat_template=data.use_chat_template,
    )
    return tokenize_prompts(tokenizer, texts, max_prompt_length=data.max_prompt_length)
