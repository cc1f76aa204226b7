"""``PtxData``: the cyclic, resumable stream of tokenized text for the PPO-ptx loss, and its
one-line errors naming the ``ptx.*`` field to change.

Token ids of the tiny character tokenizer (tests/tiny.py): a character's id is 4 + its index in
``string.printable`` (digits 0-9, then letters), so ``a``=14, ``b``=15, ``c``=16, ``d``=17, ``e``=18,
``f``=19; no special token is added to a text; ``<pad>`` = 0."""

from __future__ import annotations

import json

import pytest
import torch

from policygrad.data.ptx import PtxData
from tests.tiny import make_tiny_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    return make_tiny_tokenizer()


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def rows(*texts, field="text"):
    return [json.dumps({field: t}) for t in texts]


def test_texts_are_tokenized_cut_and_short_ones_dropped(tmp_path, tokenizer):
    # "abcd" is cut to max_length 3 -> [a b c]; "d" is one token (< 2) and is dropped; blank skipped.
    path = write_lines(tmp_path / "t.jsonl", [*rows("abcd", "d"), "", *rows("ef")])
    data = PtxData(path, tokenizer, max_length=3, batch_size=3)
    assert data.sequences == [[14, 15, 16], [18, 19]]
    assert data.pad_id == 0 and data.batch_size == 3 and data.position == 0


def test_batches_wrap_around_right_padded(tmp_path, tokenizer):
    path = write_lines(tmp_path / "t.jsonl", rows("abc", "ef"))
    data = PtxData(path, tokenizer, max_length=8, batch_size=3)
    # Batch 1: sequences 0, 1, 0 (wrapped); batch 2: 1, 0, 1. Shorter rows padded on the right.
    ids, mask = data.next_batch()
    assert ids.tolist() == [[14, 15, 16], [18, 19, 0], [14, 15, 16]]
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long
    assert data.position == 3
    ids, mask = data.next_batch()
    assert ids.tolist() == [[18, 19, 0], [14, 15, 16], [18, 19, 0]]
    assert mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 0]]
    assert data.position == 6


def test_a_batch_is_as_wide_as_its_longest_text_only(tmp_path, tokenizer):
    path = write_lines(tmp_path / "t.jsonl", rows("ab", "ab", "abcdef"))
    data = PtxData(path, tokenizer, max_length=8, batch_size=2)
    assert data.next_batch()[0].shape == (2, 2)  # two 2-token texts: no padding to the longest (6)
    assert data.next_batch()[0].shape == (2, 6)  # "abcdef" and, wrapped, "ab"


def test_resuming_at_a_saved_position_gives_the_straight_runs_batches(tmp_path, tokenizer):
    path = write_lines(tmp_path / "t.jsonl", rows("abc", "ef", "cab", "fed", "aa"))
    straight = PtxData(path, tokenizer, batch_size=2)
    batches = [straight.next_batch() for _ in range(4)]
    resumed = PtxData(path, tokenizer, batch_size=2)
    resumed.position = 4  # saved after two batches
    for expected in batches[2:]:
        got = resumed.next_batch()
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_another_text_field(tmp_path, tokenizer):
    path = write_lines(tmp_path / "t.jsonl", rows("ab", field="body"))
    assert PtxData(path, tokenizer, field="body").sequences == [[14, 15]]


def test_a_tokenizer_without_pad_pads_with_zero(tmp_path):
    class NoPad:
        pad_token_id = None

        def __call__(self, text, **kwargs):
            return {"input_ids": [ord(c) for c in text][: kwargs["max_length"]]}

    path = write_lines(tmp_path / "t.jsonl", rows("ab", "abc"))
    ids, _ = PtxData(path, NoPad(), batch_size=2).next_batch()
    assert ids.tolist() == [[97, 98, 0], [97, 98, 99]]


def test_missing_file_names_ptx_dataset(tmp_path, tokenizer):
    missing = str(tmp_path / "none.jsonl")
    with pytest.raises(FileNotFoundError, match=r"ptx.dataset '.*none.jsonl' does not exist"):
        PtxData(missing, tokenizer)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"max_length": 1}, "ptx.max_length must be >= 2, got 1"),
        ({"batch_size": 0}, "ptx.batch_size must be >= 1, got 0"),
    ],
)
def test_bad_sizes_name_their_field(tmp_path, tokenizer, sizes, message):
    path = write_lines(tmp_path / "t.jsonl", rows("abc"))
    with pytest.raises(ValueError, match=message):
        PtxData(path, tokenizer, **sizes)


def test_a_line_that_is_not_json_is_named_by_number(tmp_path, tokenizer):
    path = write_lines(tmp_path / "t.jsonl", [*rows("abc"), "{not json"])
    with pytest.raises(ValueError, match=r"t.jsonl:2 is not valid JSON"):
        PtxData(path, tokenizer)


@pytest.mark.parametrize(
    ("line", "fields"),
    [
        (json.dumps({"body": "abc", "id": 1}), "'body', 'id'"),  # no "text" field
        (json.dumps({"text": ""}), "'text'"),  # an empty text
        (json.dumps({"text": 5}), "'text'"),  # not a string
        (json.dumps(["abc"]), "list"),  # not an object: its type is named
    ],
)
def test_a_row_without_its_text_names_the_line_the_fields_and_the_option(tmp_path, tokenizer, line, fields):
    path = write_lines(tmp_path / "t.jsonl", [*rows("abc"), "", line])
    expected = rf"t.jsonl:3 has no non-empty string field 'text' \(fields: {fields}\); set ptx.text_field"
    with pytest.raises(ValueError, match=expected):
        PtxData(path, tokenizer)


def test_no_text_of_two_tokens_is_an_error(tmp_path, tokenizer):
    path = write_lines(tmp_path / "t.jsonl", rows("a", "b"))
    with pytest.raises(ValueError, match="holds no text of at least 2 tokens"):
        PtxData(path, tokenizer)
