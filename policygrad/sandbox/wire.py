"""Plain data across the sandbox's pipes: the JSON form of plain data (:func:`encode`,
:func:`decode`, exact types only) and length-prefixed frames (a 4-byte big-endian length and a
JSON body: :func:`write_frame`, :func:`read_frame`).

Only the standard library: this module runs inside the sandbox (:mod:`policygrad.sandbox.worker`).
"""

from __future__ import annotations

import json
import os
import select
import struct
import time

__all__ = ["MAX_FRAME_BYTES", "decode", "encode", "read_frame", "write_frame"]

MAX_FRAME_BYTES = 16 << 20  # the largest request or response; larger answers fail the call

_TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex")


def encode(value):
    """A JSON-ready form of plain data: None, bool, int, float, str, and lists, tuples, dicts,
    sets, frozensets of them, bytes, complex. The type test is exact (``type(x) is int``), so no
    subclass, and no object whose methods the program wrote, can cross.

    Raises:
        TypeError: any other type.
    """
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is float or kind is str:
        return value
    if kind is list:
        return [encode(v) for v in value]
    if kind is tuple:
        return {"__t": "tuple", "v": [encode(v) for v in value]}
    if kind is dict:
        return {"__t": "dict", "v": [[encode(k), encode(v)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"__t": kind.__name__, "v": [encode(v) for v in value]}
    if kind is bytes or kind is bytearray:
        return {"__t": "bytes", "v": bytes(value).hex()}
    if kind is complex:
        return {"__t": "complex", "v": [value.real, value.imag]}
    raise TypeError(f"a {kind.__name__} cannot cross the sandbox boundary (plain data only)")


def _decode_dict_items(pairs):
    """A dict from the ``[key, value]`` pairs of an encoded one."""
    out = {}
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("malformed dict item")
        out[decode(pair[0])] = decode(pair[1])
    return out


def decode(obj):
    """The inverse of :func:`encode` on parsed JSON; anything else raises ``ValueError``."""
    kind = type(obj)
    if obj is None or kind is bool or kind is int or kind is float or kind is str:
        return obj
    if kind is list:
        return [decode(v) for v in obj]
    if kind is dict and len(obj) == 2 and obj.get("__t") in _TAGS and "v" in obj:
        tag, v = obj["__t"], obj["v"]
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if type(v) is not list:
            raise ValueError(f"malformed {tag}")
        if tag == "tuple":
            return tuple(decode(x) for x in v)
        if tag == "dict":
            return _decode_dict_items(v)
        if tag == "set":
            return {decode(x) for x in v}
        if tag == "frozenset":
            return frozenset(decode(x) for x in v)
        if tag == "complex" and len(v) == 2 and all(type(x) in (int, float) for x in v):
            return complex(v[0], v[1])
    raise ValueError(f"not plain data: {str(obj)[:60]}")


def write_frame(fd, payload):
    data = json.dumps(payload).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n, deadline):
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("time limit reached")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd, deadline=None):
    (size,) = struct.unpack(">I", _read_exact(fd, 4, deadline))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a {size}-byte message exceeds the {MAX_FRAME_BYTES}-byte limit")
    return json.loads(_read_exact(fd, size, deadline))
