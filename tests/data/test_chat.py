"""Chat templates and prompt tokenization (BOS once, no EOS, a length budget)."""

from __future__ import annotations

import pytest
from tokenizers import processors

from policygrad.data.chat import format_prompt, format_prompts, tokenize_prompts
from tests.tiny import BOS_ID, EOS_ID, make_tiny_tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture
def tok():
    return make_tiny_tokenizer()


@pytest.fixture
def bos_tok():
    """The tiny tokenizer, made to prepend <|im_start|> (id 1) by default, as Llama's adds BOS."""
    tokenizer = make_tiny_tokenizer()
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", BOS_ID)]
    )
    assert tokenizer("ab")["input_ids"][0] == BOS_ID  # the premise of the tests using it
    return tokenizer


def test_chat_template_applied_with_generation_prompt(tok):
    text = format_prompt(tok, "What is 2 + 3?")
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    with_system = format_prompt(tok, "Hi", system_prompt="Be brief.")
    assert with_system == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert format_prompts(tok, ["a", "b"]) == [format_prompt(tok, "a"), format_prompt(tok, "b")]


def test_plain_text_without_template(tok):
    assert format_prompt(tok, "What is 2 + 3?", use_chat_template=False) == "What is 2 + 3?"
    assert format_prompt(tok, "Q", system_prompt="S", use_chat_template=False) == "S\n\nQ"
    tok.chat_template = None
    assert format_prompt(tok, "Q") == "Q"


def test_template_failure_names_the_fix(tok):
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    assert format_prompt(tok, "Q") == "Q"
    with pytest.raises(
        ValueError, match="System role not supported.*drop system_prompt.*use_chat_template=False"
    ):
        format_prompt(tok, "Q", system_prompt="S")


def test_format_prompt_type_errors(tok):
    with pytest.raises(TypeError, match="prompt must be a string"):
        format_prompt(tok, ["Q"])
    with pytest.raises(TypeError, match="system_prompt must be a string"):
        format_prompt(tok, "Q", system_prompt=3)


def test_tokenize_chat_text_has_one_bos_and_no_eos(tok, bos_tok):
    text = format_prompt(tok, "2+3?")
    # ChatML writes <|im_start|> (id 1) itself; the tiny tokenizer adds nothing by default.
    (ids,) = tokenize_prompts(tok, [text], max_prompt_length=64)
    expected = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == expected and ids[0] == BOS_ID and ids[-1] != EOS_ID
    # A tokenizer that prepends BOS by default does not add a second one to the chat text ...
    (ids_bos,) = tokenize_prompts(bos_tok, [text], max_prompt_length=64)
    assert ids_bos == expected
    assert bos_tok(text)["input_ids"][:2] == [BOS_ID, BOS_ID]  # which a plain call would do
    # ... but does prepend it to plain text, exactly once.
    (plain,) = tokenize_prompts(bos_tok, ["2+3?"], max_prompt_length=64)
    assert plain == [BOS_ID] + tok("2+3?", add_special_tokens=False)["input_ids"]
    (plain_tiny,) = tokenize_prompts(tok, ["2+3?"], max_prompt_length=64)
    assert len(plain_tiny) == 4  # one token per character, no BOS


def test_prompt_too_long_names_row_setting_and_fix(tok):
    # "What is 2 + 3?" is 14 characters = 14 tokens of the character-level tokenizer.
    texts = ["short", "What is 2 + 3?"]
    lengths = [len(x) for x in tokenize_prompts(tok, texts, max_prompt_length=14)]
    assert lengths == [5, 14]  # exactly at the limit is fine
    with pytest.raises(ValueError) as info:
        tokenize_prompts(tok, texts, max_prompt_length=13)
    message = str(info.value)
    assert "prompt 1 is 14 tokens long, over max_prompt_length=13" in message
    assert "'What is 2 + 3?'" in message and "raise max_prompt_length" in message
    with pytest.raises(ValueError, match="prompt row 17 is 14 tokens long"):
        tokenize_prompts(tok, texts, max_prompt_length=13, row_labels=["row 16", "row 17"])


def test_tokenize_prompts_bad_input(tok):
    with pytest.raises(ValueError, match="max_prompt_length must be a positive int"):
        tokenize_prompts(tok, ["a"], max_prompt_length=0)
    with pytest.raises(TypeError, match="got one string; wrap it in a list"):
        tokenize_prompts(tok, "abc", max_prompt_length=8)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        tokenize_prompts(tok, [""], max_prompt_length=8)
    with pytest.raises(ValueError, match="row_labels has 1 entries for 2 prompts"):
        tokenize_prompts(tok, ["a", "b"], max_prompt_length=8, row_labels=[0])
    assert tokenize_prompts(tok, [], max_prompt_length=8) == []
