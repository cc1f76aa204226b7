"""The reward worker process (:mod:`policygrad.rewards.isolation` says what it contains): the loop
the worker serves (:func:`_serve`) and :class:`RewardWorker`, the trainer's handle on it, which
loads functions by spec or as pickled objects, calls them with a timeout and restarts the worker
after a timeout or its death. :func:`worker_context` and :func:`main_module_hidden` start the
environment workers (:mod:`policygrad.envs.workers`) too.

A request carries the caller's ``os.environ`` and ``sys.path`` (the worker takes them over before
it loads or calls); only plain data comes back (:mod:`policygrad.rewards.plain`).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from policygrad.rewards.callables import awaited
from policygrad.rewards.plain import from_plain, plain_loads, plain_result, remote_error
from policygrad.rewards.specs import RewardCallFailed, RewardFunctionError, load_reward_function

__all__ = ["RewardWorker", "Unsendable", "main_module_hidden", "worker_context"]

# Errors of load_reward_function the worker reports by name; re-raised as the same class here so
# a bad spec reads exactly as it would in-process. Anything else becomes a RewardFunctionError.
_LOAD_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (FileNotFoundError, ValueError, TypeError, ImportError, SyntaxError, RewardFunctionError)
}


# --------------------------------------------------------------------------------------------
# The worker process.


def _watch_parent() -> None:
    """End the worker when the trainer is gone, even while a reward call hangs."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)


def _use_environment(environ: dict[str, str]) -> None:
    """Make this process's environment exactly ``environ`` (``os.environ`` sets the C-level
    environment too, so subprocesses and C extensions see it)."""
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


def _serve(conn) -> None:
    """The worker's loop: requests ``(request, environ, path)`` with ``request`` one of
    ``("load", spec)``, ``("object", key, payload)`` (a pickled callable, stored under ``key``),
    ``("call", spec_or_key, prompts, completions, fields)``, ``("close", "")``, ``environ`` the
    caller's environment and ``path`` its ``sys.path`` (or None: keep the current ones); one
    reply each: ``("ok", value)`` or ``("error", type, message, traceback)``."""
    # Ctrl-C, and SIGTERM sent to the trainer's whole process group (torchrun stopping its
    # workers, a job scheduler, kill -- -PGID), are the trainer's to handle: it finishes the step,
    # which may be waiting on this worker, then closes it. The worker ends with the trainer anyway.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, daemon=True).start()
    home = os.getcwd()
    functions: dict[str, Callable] = {}
    while True:
        try:
            request, environ, path = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the trainer closed the pipe
        op, spec = request[0], request[1]
        try:
            if op == "close":
                os._exit(0)
            if environ is not None:
                _use_environment(environ)
            if path is not None:  # where the caller's modules live
                sys.path.extend(p for p in path if p not in sys.path)
            if op == "load":
                functions[spec] = load_reward_function(spec)
                reply: tuple = ("ok", None)
            elif op == "object":
                functions[spec] = awaited(pickle.loads(request[2]))  # bytes: a failure is this reply's
                reply = ("ok", None)
            else:
                _, _, prompts, completions, fields = request
                if spec not in functions:  # a restarted worker
                    functions[spec] = load_reward_function(spec)
                reply = ("ok", plain_result(functions[spec](prompts, completions, **fields)))
        except BaseException as exc:  # noqa: BLE001 - SystemExit included: the call failed, not the worker
            reply = ("error", type(exc).__name__, str(exc), traceback.format_exc(limit=20))
        finally:
            if os.getcwd() != home:
                os.chdir(home)
        try:
            data = pickle.dumps(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an exception message that is not a str
            data = pickle.dumps(("error", "RewardError", f"its result cannot be sent back ({exc})", ""))
        conn.send_bytes(data)


def worker_context():
    """The start method of the reward and environment workers: forkserver (a clean server
    process that forks workers with this module, and torch, already imported: a restarted
    worker is ready in milliseconds), else spawn."""
    try:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    except ValueError:  # platforms without forkserver
        return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def main_module_hidden():
    """While a worker starts, hide the ``__main__`` module from multiprocessing: a spawned or
    forkserver child would otherwise run the user's script again (a training script without an
    ``if __name__ == "__main__":`` guard would start a second run inside the worker). The worker
    needs nothing from ``__main__``: its code is this module."""
    main = sys.modules.get("__main__")
    saved = {k: getattr(main, k) for k in ("__spec__", "__file__") if main is not None and hasattr(main, k)}
    try:
        if main is not None:
            main.__spec__ = None
            if hasattr(main, "__file__"):
                del main.__file__
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def _stop(process) -> None:
    if process is not None and process.is_alive():
        process.kill()
        process.join(5)


class RewardWorker:
    """One worker process that loads reward functions by spec and calls them; restarted on the
    next call after a timeout or its death. Thread-unsafe: the trainer calls it from one thread.

    Args:
        timeout_s: the most seconds one call may take; None: no limit.
    """

    def __init__(self, *, timeout_s: float | None = None):
        self.timeout_s = timeout_s
        self._process = None
        self._conn = None
        self._finalizer = None
        self._objects: dict[str, bytes] = {}  # key -> pickled callable, sent again to a new worker
        self._sent: set[str] = set()  # the keys the current worker process holds

    def _start(self) -> None:
        self._sent = set()
        ctx = worker_context()
        parent, child = ctx.Pipe(duplex=True)
        process = ctx.Process(target=_serve, args=(child,), name="policygrad-reward-worker", daemon=True)
        with main_module_hidden():
            process.start()
        child.close()
        self._process, self._conn = process, parent
        self._finalizer = weakref.finalize(self, _stop, process)

    def _discard(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = self._finalizer = None

    def _request(self, request: tuple, *, timeout: float | None, what: str) -> Any:
        if self._process is None or not self._process.is_alive():
            self._discard()
            self._start()
        try:
            # The caller's environment now, not the forkserver's (module docstring).
            self._conn.send_bytes(pickle.dumps((request, dict(os.environ), list(sys.path))))
            if not self._conn.poll(timeout):
                self._discard()
                raise RewardCallFailed(
                    f"did not return within reward.timeout_s={timeout:g} s {what}; it was stopped"
                )
            try:
                reply = plain_loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._process.join(5)
                code = self._process.exitcode
                self._discard()
                how = f"exit status {code}" if code is not None and code >= 0 else f"signal {-(code or 0)}"
                raise RewardCallFailed(
                    f"ended its worker process ({how}: os._exit, a crash or a kill) {what}"
                ) from None
        except RewardCallFailed:
            raise
        except BaseException:
            self._discard()  # a reply may still be on its way: never read it as the next one's
            raise
        return reply

    def load(self, spec: str) -> None:
        """Load ``spec`` in the worker (importing the user's module there, not here).

        Raises:
            FileNotFoundError, ValueError, TypeError, ImportError, SyntaxError,
            RewardFunctionError: as :func:`~policygrad.rewards.registry.load_reward_function`
                raises them for ``spec``.
        """
        reply = self._request(("load", spec), timeout=self.timeout_s, what="while loading")
        if reply[0] == "error":
            _, name, message, _ = reply
            raise _LOAD_ERRORS.get(name, RewardFunctionError)(message)

    def load_object(self, fn: Callable, name: str) -> str:
        """Send the callable ``fn`` to the worker (pickled, see the module docstring) and return
        the key that :meth:`call` takes for it; a restarted worker gets it again before its
        next call.

        Raises:
            pickle.PicklingError, TypeError, AttributeError, ...: ``fn`` cannot be pickled here.
            RewardFunctionError: the worker cannot unpickle it (e.g. its module is not importable
                there), or the load timed out or ended the worker; the message says why.
        """
        payload = _pickle_callable(fn)
        key = f"<object {len(self._objects)}: {name}>"
        self._objects[key] = payload
        try:
            self._send_object(key)
        except BaseException:
            del self._objects[key]
            raise
        return key

    def _send_object(self, key: str) -> None:
        request = ("object", key, self._objects[key])
        try:
            reply = self._request(request, timeout=self.timeout_s, what="while loading")
        except RewardCallFailed as exc:
            raise RewardFunctionError(str(exc)) from None
        if reply[0] == "error":
            raise RewardFunctionError(f"the reward worker cannot unpickle it ({reply[1]}: {reply[2]})")
        self._sent.add(key)

    def call(self, spec: str, prompts: list, completions: list, fields: dict) -> Any:
        """Call the function ``spec`` (or the key :meth:`load_object` returned) on one batch in
        the worker (``fields``: the row fields and bound options); returns what it returned as
        plain data: a list, a tensor of an array's values, or a stand-in that the protocol
        refuses.

        Raises:
            RemoteRewardError: the function raised (any ``BaseException``); the class is named
                after the original.
            RewardCallFailed: the call timed out or the worker died.
        """
        what = f"on a batch of {len(completions)} rows"
        alive = self._process is not None and self._process.is_alive()
        if spec in self._objects and not (alive and spec in self._sent):
            try:  # a restarted worker: it loaded once, so it loads again
                self._send_object(spec)
            except RewardFunctionError as exc:
                raise RewardCallFailed(f"could not be loaded in a restarted reward worker: {exc}") from None
        reply = self._request(("call", spec, prompts, completions, fields), timeout=self.timeout_s, what=what)
        if reply[0] == "error":
            _, name, message, tb = reply
            raise remote_error(name, message, tb)
        return from_plain(reply[1])

    def close(self) -> None:
        """Stop the worker process (idempotent)."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            try:
                self._conn.send_bytes(pickle.dumps((("close", ""), None, None)))
                self._process.join(2)
            except OSError:
                pass
        self._discard()


class Unsendable(Exception):
    """A callable that stays in the trainer's process; the message says why."""


class _CallablePickler(pickle.Pickler):
    """The standard pickler, refusing torch tensors and modules: a callable holding a model
    keeps it on the trainer's device instead of a second copy in the worker."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, (torch.Tensor, torch.nn.Module)):
            raise Unsendable(f"it holds a torch {type(obj).__name__}, which stays on the trainer's device")
        return NotImplemented


def _pickle_callable(fn: Callable) -> bytes:
    buffer = io.BytesIO()
    _CallablePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    return buffer.getvalue()
