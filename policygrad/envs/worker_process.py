"""An environment worker process (:mod:`policygrad.envs.workers` says what it contains): the loop
it serves (:func:`_serve`: build environments from the factory it was sent, answer protocol
calls), its plain-data replies (a tagged tree the trainer decodes without importing anything:
:func:`read_reply`, :func:`decode_tree`), and :class:`EnvWorker`, the trainer's end of one
worker, which stops it with every process it started (:func:`policygrad.sandbox.procfs.descendants`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import multiprocessing
import numbers
import os
import pickle
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from policygrad.envs.base import EnvironmentFailure, StepResult, is_scalar_bool
from policygrad.rewards.plain import plain_loads
from policygrad.rewards.remote import main_module_hidden
from policygrad.sandbox.procfs import descendants

__all__ = ["EnvWorker", "decode_tree", "env_call", "native_tools", "one_line", "read_reply"]


def one_line(exc: BaseException) -> str:
    """An exception as the one line an episode's error carries (an :class:`EnvironmentFailure`'s
    message says what failed by itself: without its type's name)."""
    text = str(exc) if isinstance(exc, EnvironmentFailure) else f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:300] if text else type(exc).__name__


def native_tools(env: Any) -> list[dict] | None:
    """The JSON schemas of a tool environment that leaves its tools to the chat template
    (``tool_schemas()`` with ``describe_tools`` False: the template's own tool format), else None."""
    if getattr(env, "describe_tools", True) or not callable(getattr(env, "tool_schemas", None)):
        return None
    return env.tool_schemas()


def env_call(env: Any, method: str, args: tuple) -> Any:
    """One protocol call on ``env``: ``reset`` (``args`` = row, seed) returns ``(messages,
    native tools)``; ``final_reward`` (stop reason) returns the reward, or ``(reward, info)`` for an
    environment with ``final_info()`` (numbers to log for the episode, e.g. an agent's named
    rewards); ``step`` (action, and whether a limit cut that turn: then an environment with a
    ``turn_cut()`` hook hears of it first) and ``close`` return what the environment's method
    returns (``close`` of an environment without one: None)."""
    if method == "reset":
        messages = env.reset(args[0], seed=args[1])
        return messages, native_tools(env)
    if method == "step":
        if len(args) > 1 and args[1] and callable(getattr(env, "turn_cut", None)):
            env.turn_cut()
        return env.step(args[0])
    if method == "final_reward":  # with the episode's numbers to log, when the environment has them
        reward = env.final_reward(args[0])
        final_info = getattr(env, "final_info", None)
        return (reward, final_info()) if callable(final_info) else reward
    if method == "close":
        close = getattr(env, "close", None)
        return close() if callable(close) else None
    raise ValueError(f"unknown environment call {method!r}")


# --------------------------------------------------------------------------------------------
# Plain data across the process boundary: a tagged tree the trainer decodes without importing
# anything (its unpickler refuses every class).


class _Opaque:
    """Stands in for a value that is not plain data; its class is named after the original's
    type and its repr is the original's, so a check's error reads as it would in-process."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


@functools.lru_cache(maxsize=256)
def _opaque_type(name: str) -> type:
    return type(name if name.isidentifier() else "Opaque", (_Opaque,), {})


def _encode(value: Any, depth: int = 0) -> tuple:
    if isinstance(value, bool) or value is None:
        return ("v", value)
    if is_scalar_bool(value):  # numpy's and torch's booleans cross as Python's
        return ("v", bool(value))
    if isinstance(value, numbers.Integral):
        return ("v", int(value))
    if isinstance(value, numbers.Real):
        return ("v", float(value))
    if isinstance(value, str):
        return ("v", str(value))
    if depth < 32:
        if isinstance(value, StepResult):
            return (
                "s",
                *(_encode(getattr(value, f.name), depth + 1) for f in dataclasses.fields(StepResult)),
            )
        if isinstance(value, Mapping):
            return ("d", [(_encode(k, depth + 1), _encode(v, depth + 1)) for k, v in value.items()])
        if isinstance(value, (list, tuple)):
            return ("l" if isinstance(value, list) else "t", [_encode(v, depth + 1) for v in value])
    return ("o", type(value).__name__, repr(value)[:200])


def decode_tree(node: tuple) -> Any:
    """The trainer's side of a worker's reply tree: plain values, :class:`StepResult`, dicts,
    lists and tuples as sent; anything else as a stand-in named after its type, with its repr."""
    kind = node[0]
    if kind == "v":
        return node[1]
    if kind == "s":
        return StepResult(*(decode_tree(n) for n in node[1:]))
    if kind == "d":
        return {decode_tree(k): decode_tree(v) for k, v in node[1]}
    if kind == "l":
        return [decode_tree(v) for v in node[1]]
    if kind == "t":
        return tuple(decode_tree(v) for v in node[1])
    return _opaque_type(node[1])(node[2])


def read_reply(data: bytes) -> Any:
    """A worker's reply, refusing any pickled class."""
    return plain_loads(data, "environment worker")


# --------------------------------------------------------------------------------------------
# The worker process.


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent ends (prctl PR_SET_PDEATHSIG), and make it
    a child subreaper (PR_SET_CHILD_SUBREAPER): a process its environment started whose parent
    ends (a daemon, a ``start_new_session`` child of a shell) becomes this worker's child instead
    of init's, so :meth:`EnvWorker.stop` still finds it among the worker's descendants."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        libc.prctl(36, 1, 0, 0, 0)  # 36: PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # not Linux: the parent watch below still ends it
        pass


def _kill_descendants(pid: int) -> None:
    """SIGKILL every descendant of ``pid`` (alive, a subreaper): those in other sessions and
    process groups too, which a group kill misses. Rounds until no new one appears, since the
    children of a killed process are re-parented to ``pid`` and found by the next round."""
    killed: set[int] = set()
    for _ in range(10):
        new = [p for p in descendants(pid) if p not in killed]
        if not new:
            return
        for p in new:
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        killed.update(new)


def _watch_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)


def _serve(conn, payload: bytes) -> None:
    """A worker: load the factory from ``payload`` (``(factory, environ, sys.path, cwd)``), reply
    ``("ready", None)`` or ``("error", line)``, then serve requests ``(handle, method, args)``
    (method ``make`` builds environment ``handle``) with one reply each: ``("ok", tree)`` or
    ``("error", line)``."""
    try:
        os.setsid()  # its own session and process group: killed as a group, out of the trainer's
    except OSError:
        pass
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_watch_parent, daemon=True).start()
    environ, path, cwd, blob = pickle.loads(payload)
    os.environ.clear()
    os.environ.update(environ)
    sys.path.extend(p for p in path if p not in sys.path)
    try:
        os.chdir(cwd)
        factory = pickle.loads(blob)
        reply: tuple = ("ready", None)
    except BaseException as exc:  # noqa: BLE001 - reported to the trainer, which decides
        factory, reply = None, ("error", one_line(exc))
    conn.send_bytes(pickle.dumps(reply))
    if factory is None:
        os._exit(0)
    home = os.getcwd()
    envs: dict[int, Any] = {}
    while True:
        try:
            handle, method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the trainer closed the pipe
        try:
            if method == "make":
                envs[handle] = factory()
                reply = ("ok", ("v", None))
            else:
                try:
                    reply = ("ok", _encode(env_call(envs[handle], method, args)))
                finally:
                    if method == "close":
                        envs.pop(handle, None)
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt too: the call failed
            reply = ("error", one_line(exc))
        finally:
            if os.getcwd() != home:
                os.chdir(home)
        try:
            data = pickle.dumps(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a recursion too deep
            data = pickle.dumps(("error", f"its result cannot be sent back ({one_line(exc)})"))
        conn.send_bytes(data)


class EnvWorker:
    """The trainer's end of one worker process."""

    def __init__(self, ctx, payload: bytes):
        parent, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_serve, args=(child, payload), name="policygrad-env-worker", daemon=True
        )
        with main_module_hidden():
            self.process.start()
        child.close()
        self.conn = parent
        self.ready = False

    def wait_ready(self, timeout: float) -> str | None:
        """None once the worker loaded the environment, else why it did not."""
        if self.ready:
            return None
        try:
            if not self.conn.poll(timeout):
                return f"it did not load the environment within {timeout:g} s"
            kind, value = read_reply(self.conn.recv_bytes())
        except (EOFError, OSError):
            return f"loading the environment ended it ({self.exit()})"
        if kind != "ready":
            return value
        self.ready = True
        return None

    def exit(self) -> str:
        """How the process ended, as a phrase."""
        self.process.join(5)
        code = self.process.exitcode
        if code is None:
            return "it stopped answering"
        if code >= 0:
            return f"exit status {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return name

    def stop(self) -> None:
        """Kill every descendant of the worker (what its environments started, in any session:
        the worker is their subreaper), every process still in its group, then the worker."""
        pid = self.process.pid
        if pid is not None:
            if self.process.is_alive():
                _kill_descendants(pid)
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        try:
            self.conn.close()
        except OSError:
            pass
