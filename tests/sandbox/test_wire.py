"""Plain data across the sandbox's pipes (:mod:`policygrad.sandbox.wire`): the wire form of
plain data and the length-prefixed frames. Round trips of plain data and what cannot cross are in
tests/rewards/test_code_reward.py."""

from __future__ import annotations

import json
import os
import struct
import time

import pytest

from policygrad.sandbox import wire

pytestmark = pytest.mark.unit


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass



# ----------------------------------------------------------------------------- wire form


def test_the_wire_form_of_plain_data():
    value = (1, [2.5, None], {"k": b"\x01\xff"}, {3}, frozenset(), 1 - 2j)
    assert wire.encode(value) == {
        "__t": "tuple",
        "v": [
            1,
            [2.5, None],
            {"__t": "dict", "v": [["k", {"__t": "bytes", "v": "01ff"}]]},
            {"__t": "set", "v": [3]},
            {"__t": "frozenset", "v": []},
            {"__t": "complex", "v": [1.0, -2.0]},
        ],
    }


def test_a_bytearray_crosses_as_bytes():
    assert wire.decode(wire.encode(bytearray(b"ab"))) == b"ab"


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"__t": "set", "v": "ab"}, "malformed set"),
        ({"__t": "dict", "v": [[1, 2, 3]]}, "malformed dict item"),
        ({"__t": "complex", "v": [1.0]}, "not plain data"),
        ({"__t": "complex", "v": ["1", 0]}, "not plain data"),
        ({"__t": "bytes", "v": [1]}, "not plain data"),  # bytes travel as a hex string only
        ({"__t": "tuple", "v": [], "extra": 1}, "not plain data"),
    ],
)
def test_malformed_tagged_forms_are_refused(obj, message):
    with pytest.raises(ValueError, match=message):
        wire.decode(obj)


# ----------------------------------------------------------------------------- frames


def test_a_frame_is_a_big_endian_length_and_a_json_body(pipe):
    r, w = pipe
    wire.write_frame(w, {"a": 1})
    body = json.dumps({"a": 1}).encode()  # b'{"a": 1}': 8 bytes
    assert os.read(r, 100) == b"\x00\x00\x00\x08" + body
    wire.write_frame(w, {"ok": [1, "x"]})
    wire.write_frame(w, None)
    assert wire.read_frame(r) == {"ok": [1, "x"]}
    assert wire.read_frame(r, time.monotonic() + 60) is None


def test_a_frame_over_the_limit_is_refused_before_its_body_is_read(pipe):
    r, w = pipe
    os.write(w, struct.pack(">I", wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(ValueError, match=r"^a 16777217-byte message exceeds the 16777216-byte limit$"):
        wire.read_frame(r)


@pytest.mark.parametrize("sent", [b"", b"\x00\x00", b"\x00\x00\x00\x05{}"])
def test_a_closed_pipe_ends_the_read_wherever_it_stops(pipe, sent):
    r, w = pipe
    os.write(w, sent)
    os.close(w)
    with pytest.raises(EOFError, match="the other side closed the pipe"):
        wire.read_frame(r)


def test_a_passed_deadline_stops_the_read(pipe):
    r, _ = pipe
    with pytest.raises(TimeoutError, match="time limit reached"):
        wire.read_frame(r, deadline=time.monotonic() - 1)
