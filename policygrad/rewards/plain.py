"""Plain data across the reward worker's process boundary (:mod:`policygrad.rewards.remote`).

What a reward function returned crosses as builtin scalars, strings and lists (an array as its
shape and values, anything else as a stand-in with its type's name and repr:
:func:`plain_result`, read back by :func:`from_plain`); an exception the function raised crosses
as its class's name, message and traceback (:func:`remote_error`). The trainer unpickles a reply
with :func:`plain_loads`, which refuses any class, so nothing a worker sends can make the trainer
import or run user code. The environment workers (:mod:`policygrad.envs.workers`) read their
replies with :func:`plain_loads` too.
"""

from __future__ import annotations

import io
import numbers
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["RemoteRewardError", "from_plain", "plain_loads", "plain_result", "remote_error"]


class _Opaque:
    """Stands in for a returned object that is not plain data: keeps its type's name and repr so
    the protocol's error message reads as it would in-process (see :func:`_remote_type`)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


_REMOTE_TYPES: dict[tuple[str, type], type] = {}


def _remote_type(name: str, base: type) -> type:
    """A local class named ``name`` (e.g. ``RuntimeError``, ``SystemExit``) deriving from ``base``:
    the error a worker reported, re-raised here without importing the user's module."""
    key = (name, base)
    if key not in _REMOTE_TYPES:
        _REMOTE_TYPES[key] = type(name if name.isidentifier() else "RewardError", (base,), {})
    return _REMOTE_TYPES[key]


class RemoteRewardError(Exception):
    """An exception a reward function raised in the worker (any ``BaseException`` there, such as
    ``SystemExit``). Its class is named after the original one; ``remote_traceback`` holds the
    worker's traceback."""

    remote_traceback = ""


def remote_error(name: str, message: str, tb: str = "") -> RemoteRewardError:
    """The exception ``name`` (with ``message``) that a reward function raised in the worker, as a
    :class:`RemoteRewardError` subclass of that name; ``tb``: the worker's traceback."""
    error = _remote_type(name, RemoteRewardError)(message)
    error.remote_traceback = tb
    if tb and hasattr(error, "add_note"):  # shown with POLICYGRAD_DEBUG=1, never in the one-line error
        error.add_note(f"traceback in the reward worker:\n{tb}")
    return error


def _plain_value(value: Any) -> Any:
    """One returned score as plain data: numbers and strings as they are, one-element arrays as
    their Python number, anything else as an opaque stand-in (type name and repr)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and getattr(value, "shape", None) in ((), (1,)):
        try:
            return value.item()
        except Exception:  # noqa: BLE001 - then it is opaque
            pass
    return ("opaque", type(value).__name__, repr(value)[:200])


def plain_result(out: Any) -> tuple:
    """What a reward function returned, as plain data for the trainer (see :func:`from_plain`)."""
    if hasattr(out, "ndim") and hasattr(out, "tolist") and hasattr(out, "shape"):
        try:
            return ("array", tuple(int(d) for d in out.shape), _flat(out))
        except Exception:  # noqa: BLE001
            pass
    if isinstance(out, (list, tuple)) or (
        isinstance(out, Sequence) and not isinstance(out, (str, bytes, Mapping))
    ):
        return ("list", [_plain_value(v) for v in out])
    return ("opaque", type(out).__name__, repr(out)[:200])


def _flat(array) -> list:
    values = array.tolist()
    out: list = []

    def walk(v):
        if isinstance(v, list):
            for x in v:
                walk(x)
        else:
            out.append(v)

    walk(values)
    return out


def from_plain(result: tuple) -> Any:
    """The trainer's side of :func:`plain_result`: a list, a float64 tensor of an array's values, or
    a stand-in (named after the original type) that the reward protocol refuses."""
    kind = result[0]
    if kind == "array":
        _, shape, values = result
        try:
            return torch.tensor(values, dtype=torch.float64).reshape(shape)
        except (TypeError, ValueError, RuntimeError):  # not numbers: the protocol refuses it
            return _remote_type("ndarray", _Opaque)(f"array of shape {shape}: {values[:8]!r}")
    if kind == "list":
        return [
            _remote_type(v[1], _Opaque)(v[2]) if isinstance(v, tuple) and v[:1] == ("opaque",) else v
            for v in result[1]
        ]
    return _remote_type(result[1], _Opaque)(result[2])


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles only builtin containers and scalars: a reply can never name a class to import."""

    def __init__(self, data: bytes, sender: str):
        super().__init__(io.BytesIO(data))
        self.sender = sender

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"the {self.sender} sent a {module}.{name} object; only plain data is accepted"
        )


def plain_loads(data: bytes, sender: str = "reward worker") -> Any:
    """A worker's reply, refusing any pickled class (``sender`` names the worker in the error).

    Raises:
        pickle.UnpicklingError: the reply names a class.
    """
    return _PlainUnpickler(data, sender).load()
