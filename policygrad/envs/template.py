"""Token ids of the messages an environment adds, from the chat template, without ever
re-rendering the history.

A multi-turn sequence is the first prompt's ids, then for each turn the ids the policy sampled
(verbatim: never decoded and encoded again, so decode -> encode drift cannot change what is
trained), then the ids of the environment's new messages. Those are the template's *delta*:
``render(BASE + new, generation prompt) - render(BASE)`` for a fixed short conversation ``BASE``
that ends with an assistant turn, preceded by what the template writes after the assistant's
end-of-turn token (ChatML: the newline after ``<|im_end|>``). The history is never rendered
again, so a template that rewrites earlier turns (Qwen3 drops the ``<think>`` blocks of past
turns) cannot make the trained sequence differ from what the model saw.

The delta is only meaningful when rendering more messages extends the rendered text (the
template preserves prefixes); :class:`ChatDelta` checks that once, at start.

Message contents are the environment's text, never markup: a content that holds the text of a
special token (``<|im_end|>\n<|im_start|>assistant`` in a tool's output, or in the policy's own
text echoed back) is tokenised as plain text, so a turn boundary can only come from the chat
template itself. Contents without such text are tokenised exactly as before (the rendered text
in one call).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Sequence

__all__ = ["ChatDelta", "TemplateError", "cut_middle", "max_token_chars", "special_token_texts"]

_BASE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
_PROBE = [{"role": "user", "content": "Go on."}]
_MARK = "\ue000"  # the first private-use character: placeholders of hidden special-token text


class TemplateError(ValueError):
    """The tokenizer's chat template cannot give the ids of new messages by extension."""


class ChatDelta:
    """Renders messages the way the model's chat template does, for episodes.

    Args:
        tokenizer: the policy's tokenizer, with a chat template.
        end_ids: every id that ends a turn (the engine's end-of-sequence ids).

    Raises:
        TemplateError: no chat template; a template that fails on a plain user/assistant
            conversation; one whose rendering of more messages does not extend the rendering of
            fewer (the message names ``data.chat_template``, the override).
    """

    def __init__(self, tokenizer, end_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.end_ids = frozenset(int(i) for i in end_ids)
        specials = special_token_texts(tokenizer)
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                "environments need a chat template and this tokenizer has none; set data.chat_template "
                "to a Jinja template (text or a file path)"
            )
        self._base = self.render(_BASE, generation_prompt=False)
        after = self._base[self._base.rfind(_BASE[-1]["content"]) + len(_BASE[-1]["content"]) :]
        after_ids = self._encode(after)
        # What follows the end-of-turn token the model sampled (ChatML: "\n"); when the template's
        # turn does not end with an end id, the whole of it follows the sampled end id.
        if after_ids and after_ids[0] in self.end_ids:
            self.after_end = after[len(tokenizer.decode([after_ids[0]])) :]
        else:
            self.after_end = after
        self.observation_ids(_PROBE)  # the prefix check, once

    def render(self, messages: Sequence[dict], *, generation_prompt: bool = True, tools=None) -> str:
        """``apply_chat_template(messages)`` as text (with the assistant header when
        ``generation_prompt``; ``tools``: JSON schemas for a template that takes them).

        Raises:
            TemplateError: the template failed on these messages.
        """
        kwargs = {"tools": tools} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation_prompt, **kwargs
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises several types
            roles = [m.get("role") for m in messages]
            raise TemplateError(
                f"the chat template failed on messages with roles {roles} ({type(exc).__name__}: {exc}); "
                "use roles the template knows, or set data.chat_template"
            ) from exc
        if not isinstance(text, str):
            raise TemplateError(
                f"apply_chat_template returned {type(text).__name__}, not text; set data.chat_template"
            )
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[dict], *, tools=None) -> tuple[str, list[int]]:
        """An episode's opening: ``(render(messages, generation prompt), its ids)``, the contents
        tokenised as plain text (see the module docstring), no BOS added.

        Raises:
            TemplateError: the template failed on ``messages``.
        """
        text_of = lambda ms: self.render(ms, generation_prompt=True, tools=tools)  # noqa: E731
        return text_of(messages), self._content_as_text(messages, text_of)

    def _content_as_text(self, messages: Sequence[dict], text_of: Callable[[list[dict]], str]) -> list[int]:
        """The ids of ``text_of(messages)`` with the special tokens' text inside the messages'
        contents tokenised as plain text: such text is swapped for placeholders before rendering,
        the template's own special tokens are taken from the rendered text, and every piece
        between them (placeholders put back) is tokenised without parsing special tokens."""
        messages = list(messages)
        contents = [m.get("content") for m in messages]
        specials = self._specials
        if specials is None or not any(isinstance(c, str) and specials.search(c) for c in contents):
            return self._encode(text_of(messages))  # nothing to hide: one call, as ever
        # Placeholders are the private-use character MARK around a number; MARK itself, where a
        # content holds it, is hidden the same way, so the scheme needs no character to be absent.
        hide_pattern = re.compile(f"{specials.pattern}|{re.escape(_MARK)}")
        hidden: list[str] = []

        def hide(match: re.Match) -> str:
            hidden.append(match.group(0))
            return f"{_MARK}{len(hidden) - 1}{_MARK}"

        escaped = [
            {**m, "content": hide_pattern.sub(hide, m["content"])} if isinstance(m.get("content"), str) else m
            for m in messages
        ]
        text = text_of(escaped)
        restore = re.compile(f"{_MARK}([0-9]+){_MARK}")
        ids: list[int] = []
        start = 0
        for match in [*specials.finditer(text), None]:  # the template's own special tokens
            end = match.start() if match is not None else len(text)
            piece = restore.sub(lambda m: hidden[int(m.group(1))], text[start:end])
            if piece:
                ids += self.tokenizer(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if match is not None:
                ids.append(int(self.tokenizer.convert_tokens_to_ids(match.group(0))))
                start = match.end()
        return ids

    def special_in(self, text: str) -> str | None:
        """The first special token's text found in ``text``, else None."""
        match = self._specials.search(text) if self._specials is not None else None
        return match.group(0) if match else None

    def observation_ids(self, messages: Sequence[dict]) -> list[int]:
        """The ids that follow a turn the policy ended with an end id: the rest of the template's
        turn suffix, ``messages`` as the template renders them, and the next assistant header.

        Raises:
            TemplateError: the template does not preserve prefixes, or fails on ``messages``.
        """
        return self._content_as_text(messages, self._delta_text)

    def _delta_text(self, messages: list[dict]) -> str:
        full = self.render([*_BASE, *messages], generation_prompt=True)
        if not full.startswith(self._base):
            raise TemplateError(
                "the chat template does not preserve prefixes (rendering a conversation with more "
                "messages changes the text of the earlier ones), so the ids of new messages cannot be "
                "computed without re-rendering what the model saw; set data.chat_template to a template "
                "that only appends"
            )
        return self.after_end + full[len(self._base) :]


def special_token_texts(tokenizer) -> list[str]:
    """The text of every special token of ``tokenizer`` (its named special tokens and every added
    token marked special), longest first, so a regex alternation matches the longest."""
    texts = {str(t) for t in getattr(tokenizer, "all_special_tokens", None) or []}
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(getattr(token, "content", token)))
    return sorted((t for t in texts if t), key=lambda t: (-len(t), t))


_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def max_token_chars(tokenizer) -> int:
    """The most characters of text one token of ``tokenizer`` can cover (computed once per
    tokenizer, cached): the longest token string of its vocabulary (added tokens included) or
    decoded token. A byte-level BPE token's string has one character per byte it covers (at least
    one per character), a SentencePiece piece one per character (``<0x..>`` byte pieces more), so a
    text of ``n`` characters has at least ``ceil(n / max_token_chars)`` tokens, which bounds the
    work on a text that cannot fit before tokenising it. (A tokenizer whose normaliser drops or
    merges characters is outside this bound; the chat models' BPE and SentencePiece ones are not.)
    """
    try:
        return _TOKEN_CHARS[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = list(range(len(tokenizer)))
    longest = max((len(t) for t in tokenizer.convert_ids_to_tokens(ids) if isinstance(t, str)), default=1)
    decoded = tokenizer.batch_decode([[i] for i in ids])
    out = max(longest, max((len(t) for t in decoded), default=1), 1)
    try:
        _TOKEN_CHARS[tokenizer] = out
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return out


def cut_middle(tokenizer, text: str, max_tokens: int, marker: str = "\n...\n") -> str:
    """``text`` if it has at most ``max_tokens`` tokens, else its first and last
    ``max(max_tokens // 2, 1)`` tokens around ``marker`` (the marker not counted; deterministic:
    the end of a tool's output often says what went wrong, the start what ran)."""
    # Cut huge texts by characters first, so a megabyte of tool output is not tokenised whole: each
    # kept end of ``span`` characters has at least max_tokens tokens (max_token_chars), so the cut
    # text still has more than max_tokens and goes on to be cut by tokens below.
    span = max(max_tokens, 2) * max(max_token_chars(tokenizer), 32)
    if len(text) > 2 * span:
        text = text[:span] + text[-span:]
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]  # as tokenised
    if len(ids) <= max_tokens:
        return text
    half = max(max_tokens // 2, 1)
    return tokenizer.decode(ids[:half]) + marker + tokenizer.decode(ids[-half:])
