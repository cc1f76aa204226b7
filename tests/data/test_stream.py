"""``PromptStream``: rows ``take``-n from a source by position, so a stream resumed at a saved
position yields exactly the rows a straight run would have."""

from __future__ import annotations

import pytest

from policygrad.data.stream import PromptStream

pytestmark = pytest.mark.unit


class Source:
    """``train_row(i)`` is a pure function of ``i``; counts its calls."""

    def __init__(self):
        self.calls = []

    def train_row(self, i):
        self.calls.append(i)
        return {"prompt": f"p{i}", "i": i}


def test_take_returns_consecutive_rows_and_advances_the_position():
    source = Source()
    stream = PromptStream(source)
    assert stream.position == 0
    assert [r["i"] for r in stream.take(3)] == [0, 1, 2]
    assert stream.position == 3
    assert [r["i"] for r in stream.take(2)] == [3, 4]
    assert stream.position == 5
    assert source.calls == [0, 1, 2, 3, 4]  # each row asked for once, in order


def test_take_zero_is_empty_and_keeps_the_position():
    stream = PromptStream(Source())
    stream.take(2)
    assert stream.take(0) == []
    assert stream.position == 2


def test_a_resumed_stream_continues_the_straight_run_exactly():
    straight = PromptStream(Source())
    rows = straight.take(2) + straight.take(3) + straight.take(4)
    resumed = PromptStream(Source())
    resumed.position = 5  # as restored from a checkpoint saved after the second take
    assert resumed.take(4) == rows[5:]
    assert resumed.position == straight.position == 9
