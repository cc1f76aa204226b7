"""Reward functions the user wrote run outside the trainer's process.

The rule: a reward function named in ``reward.functions`` as ``package.module:function`` or
``path/to/file.py:function`` is user code, and with ``reward.isolation`` (the default) it runs in
a worker process (:class:`RewardWorker`, one per run, shared by the run's user functions).
Built-in rewards (``BUILTIN_REWARDS``) and reward models (``reward_model:``, GPU/torch objects)
are the library's code and run in the trainer's process.

What isolation guarantees for every call of a user function:

* it gets its own copies of the prompts, the completions and every row field (each row's
  value copied separately, so a function that pops a row's test cases changes neither the
  dataset nor the other samples of the prompt);
* ``sys.exit``, any ``BaseException`` and ``os._exit`` (or a crash) end the call, never the run:
  an exception becomes the row's error, exactly like an ``Exception`` (``reward.on_error``
  decides); a worker that dies makes the call fail for its whole batch
  (:class:`~policygrad.rewards.registry.RewardCallFailed`) and a fresh worker serves the next
  call;
* a call that takes longer than ``reward.timeout_s`` is stopped (the worker is killed) and fails
  for its whole batch;
* the working directory is the same after the call (the trainer's never changes; the worker's
  is restored after each call);
* the environment variables are the caller's as they are at the call: each request carries
  ``os.environ`` and the worker takes it over before it loads or calls (the worker is forked
  from a server that the process's first run started, with that run's environment, which a
  later run in the same process, a notebook or a sweep, would otherwise inherit);
* only plain data comes back (numbers, strings, lists; arrays as their values): nothing the
  worker sends can make the trainer import or run user code.

With ``reward.isolation: false`` the functions run in the trainer's process on copies of their
inputs, with the working directory restored and ``SystemExit`` / other ``BaseException``s turned
into the row's error; ``os._exit`` and hangs are then not contained and ``timeout_s`` does not
apply.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import numbers
import os
import pickle
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policygrad.rewards.registry import (
    BUILTIN_REWARDS,
    RewardCallFailed,
    RewardFunctionError,
    load_reward_function,
)

__all__ = [
    "GuardedRewardFunction",
    "IsolatedRewardFunction",
    "RewardWorker",
    "copy_inputs",
    "isolate_reward_functions",
    "is_user_reward",
]

# Errors of load_reward_function the worker reports by name; re-raised as the same class here so
# a bad spec reads exactly as it would in-process. Anything else becomes a RewardFunctionError.
_LOAD_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (FileNotFoundError, ValueError, TypeError, ImportError, SyntaxError, RewardFunctionError)
}


def is_user_reward(spec: Any) -> bool:
    """True for a ``module:function`` or ``file.py:function`` spec: code the user wrote, which
    isolation runs in the worker. Built-in names and ``reward_model:`` entries are False, and so
    are callables (already loaded in this process)."""
    if not isinstance(spec, str):
        return False
    spec = spec.strip()
    return spec not in BUILTIN_REWARDS and not spec.startswith("reward_model:") and ":" in spec


def copy_inputs(prompts: Sequence, completions: Sequence, fields: Mapping[str, Any]):
    """Fresh copies of one call's inputs: new lists of the prompts and completions, and every
    keyword value deep-copied, a list's or tuple's items one at a time (so rows that shared an
    object, such as the G samples of a prompt, no longer do); tensors are cloned.

    Returns:
        ``(prompts, completions, fields)``, sharing no mutable object with the arguments.
    """
    copied: dict[str, Any] = {}
    for key, values in fields.items():
        if isinstance(values, (list, tuple)):
            copied[key] = type(values)(copy.deepcopy(v) for v in values)
        elif hasattr(values, "clone") and callable(values.clone):
            copied[key] = values.clone()
        else:
            copied[key] = copy.deepcopy(values)
    return list(prompts), list(completions), copied


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


def _remote_error(name: str, message: str, tb: str = "") -> RemoteRewardError:
    error = _remote_type(name, RemoteRewardError)(message)
    error.remote_traceback = tb
    if tb and hasattr(error, "add_note"):  # shown with POLICYGRAD_DEBUG=1, never in the one-line error
        error.add_note(f"traceback in the reward worker:\n{tb}")
    return error


# --------------------------------------------------------------------------------------------
# Plain data across the process boundary.


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


def _plain_result(out: Any) -> tuple:
    """What a reward function returned, as plain data for the trainer (see ``_from_plain``)."""
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


def _from_plain(result: tuple) -> Any:
    """The trainer's side of :func:`_plain_result`."""
    kind = result[0]
    if kind == "array":
        import torch

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

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"the reward worker sent a {module}.{name} object; only plain data is accepted"
        )


def _loads(data: bytes) -> Any:
    import io

    return _PlainUnpickler(io.BytesIO(data)).load()


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
    """The worker's loop: requests ``(request, environ)`` with ``request`` one of ``("load",
    spec)``, ``("call", spec, prompts, completions, fields)``, ``("close", "")``, and
    ``environ`` the caller's environment (a dict, or None: keep the current one); one reply
    each: ``("ok", value)`` or ``("error", type, message, traceback)``."""
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
            request, environ = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)  # the trainer closed the pipe
        op, spec = request[0], request[1]
        try:
            if op == "close":
                os._exit(0)
            if environ is not None:
                _use_environment(environ)
            if op == "load":
                functions[spec] = load_reward_function(spec)
                reply: tuple = ("ok", None)
            else:
                _, _, prompts, completions, fields = request
                if spec not in functions:  # a restarted worker
                    functions[spec] = load_reward_function(spec)
                reply = ("ok", _plain_result(functions[spec](prompts, completions, **fields)))
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


def _context():
    """forkserver (a clean server process that forks workers with this module, and torch,
    already imported: a restarted worker is ready in milliseconds), else spawn."""
    try:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    except ValueError:  # platforms without forkserver
        return multiprocessing.get_context("spawn")


@contextlib.contextmanager
def _main_module_hidden():
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

    def _start(self) -> None:
        ctx = _context()
        parent, child = ctx.Pipe(duplex=True)
        process = ctx.Process(target=_serve, args=(child,), name="policygrad-reward-worker", daemon=True)
        with _main_module_hidden():
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
            self._conn.send_bytes(pickle.dumps((request, dict(os.environ))))
            if not self._conn.poll(timeout):
                self._discard()
                raise RewardCallFailed(
                    f"did not return within reward.timeout_s={timeout:g} s {what}; it was stopped"
                )
            try:
                reply = _loads(self._conn.recv_bytes())
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

    def call(self, spec: str, prompts: list, completions: list, fields: dict) -> Any:
        """Call the function ``spec`` on one batch in the worker (``fields``: the row fields and
        bound options); returns what it returned as plain data: a list, a tensor of an array's
        values, or a stand-in that the protocol refuses.

        Raises:
            RemoteRewardError: the function raised (any ``BaseException``); the class is named
                after the original.
            RewardCallFailed: the call timed out or the worker died.
        """
        what = f"on a batch of {len(completions)} rows"
        reply = self._request(("call", spec, prompts, completions, fields), timeout=self.timeout_s, what=what)
        if reply[0] == "error":
            _, name, message, tb = reply
            raise _remote_error(name, message, tb)
        return _from_plain(reply[1])

    def close(self) -> None:
        """Stop the worker process (idempotent)."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            try:
                self._conn.send_bytes(pickle.dumps((("close", ""), None)))
                self._process.join(2)
            except OSError:
                pass
        self._discard()


class IsolatedRewardFunction:
    """A user reward function, called in a :class:`RewardWorker` with the reward protocol
    ``fn(prompts, completions, **row_fields) -> scores``. Its ``__name__`` is the spec, so the
    reward component keeps the name it has in-process."""

    def __init__(self, spec: str, worker: RewardWorker):
        self.spec = self.__name__ = spec.strip()
        self.worker = worker

    def __call__(self, prompts, completions, **fields):
        return self.worker.call(self.spec, *copy_inputs(prompts, completions, fields))

    def close(self) -> None:
        self.worker.close()

    def __repr__(self) -> str:
        return f"IsolatedRewardFunction({self.spec!r})"


class GuardedRewardFunction:
    """A reward function run in the trainer's process (``reward.isolation: false``), on copies of
    its inputs, with the working directory restored after each call and ``SystemExit`` (or any
    other ``BaseException`` but ``KeyboardInterrupt``) turned into an error of the call."""

    def __init__(self, fn: Callable, name: str):
        self.fn = fn
        self.__name__ = name

    def __call__(self, prompts, completions, **fields):
        home = os.getcwd()
        prompts, completions, fields = copy_inputs(prompts, completions, fields)
        try:
            return self.fn(prompts, completions, **fields)
        except (KeyboardInterrupt, Exception):
            raise
        except BaseException as exc:  # SystemExit and friends: the call failed, the run goes on
            raise _remote_error(type(exc).__name__, str(exc)) from exc
        finally:
            if os.getcwd() != home:
                os.chdir(home)


def isolate_reward_functions(
    specs: Sequence, *, isolation: bool = True, timeout_s: float | None = None
) -> tuple[list, RewardWorker | None]:
    """Replace the user reward functions of ``specs`` (``module:function``, ``file.py:function``)
    by isolated callables; built-ins, ``reward_model:`` entries and objects pass unchanged.

    With ``isolation`` the functions are loaded in one new :class:`RewardWorker` (so a missing
    file or a broken module is reported here, before the run writes anything); without it they
    are loaded in this process and wrapped in :class:`GuardedRewardFunction`.

    Returns:
        ``(functions, worker)``; ``worker`` is None when no function is isolated. Close it
        (``worker.close()``) when the run ends; it is also stopped when garbage-collected.

    Raises:
        FileNotFoundError, ValueError, TypeError, ImportError, SyntaxError, RewardFunctionError:
            a spec that does not load (as :func:`load_reward_function` raises them).
    """
    user = [s for s in specs if is_user_reward(s)]
    if not user:
        return list(specs), None
    if not isolation:
        out = [
            GuardedRewardFunction(load_reward_function(s), s.strip()) if is_user_reward(s) else s
            for s in specs
        ]
        return out, None
    worker = RewardWorker(timeout_s=timeout_s)
    try:
        for spec in dict.fromkeys(s.strip() for s in user):
            worker.load(spec)
    except BaseException:
        worker.close()
        raise
    return [IsolatedRewardFunction(s, worker) if is_user_reward(s) else s for s in specs], worker
