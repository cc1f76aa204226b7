"""Reward functions the user wrote run outside the trainer's process.

The rule: a reward function named in ``reward.functions`` as ``package.module:function`` or
``path/to/file.py:function`` is user code, and with ``reward.isolation`` (the default) it runs in
a worker process (:class:`RewardWorker`, one per run, shared by the run's user functions).
Built-in rewards (``BUILTIN_REWARDS``) and reward models (``reward_model:``, GPU/torch objects)
are the library's code and run in the trainer's process.

A reward function given as a Python object (``policygrad.train(reward_funcs=[fn])``,
``Trainer(reward_functions=[fn])``) is user code too. It runs in the worker when it can be sent
there: it is pickled with the standard :mod:`pickle` (a module-level function or class by its
``module:qualname``, a ``functools.partial`` or an instance with its state) and the worker can
unpickle it (see ``sys.path`` above). The worker then holds its own copy:
state an object keeps between calls stays in the worker. A callable that cannot be sent (a
lambda, a closure, anything defined in ``__main__`` such as a script's or a notebook's
functions, an object holding torch tensors or modules, which stay on the trainer's device) runs
in the trainer's process as :class:`GuardedRewardFunction`, and the run logs one warning line
naming it and why: its inputs are still copies, ``SystemExit`` and other ``BaseException``s
still end only the call, ``reward.timeout_s`` is still enforced (by a watchdog, see there), but
``os._exit`` or a crash ends the run. Define the function at the top level of an importable
module (or name it as ``file.py:function``) to have it contained in full.

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
  later run in the same process, a notebook or a sweep, would otherwise inherit); so is
  ``sys.path``: entries the worker lacks are appended before it loads, so a module the trainer
  can import (one its checks found) loads there too;
* only plain data comes back (numbers, strings, lists; arrays as their values): nothing the
  worker sends can make the trainer import or run user code.

With ``reward.isolation: false`` the functions (specs and objects) run in the trainer's process
on copies of their inputs, with the working directory restored, ``SystemExit`` / other
``BaseException``s turned into the row's error and ``reward.timeout_s`` enforced by a watchdog;
``os._exit`` and crashes are then not contained.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import io
import logging
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

from policygrad.rewards.callables import awaited, callable_name
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
    "main_module_hidden",
    "plain_loads",
    "worker_context",
]

log = logging.getLogger("policygrad")

# Errors of load_reward_function the worker reports by name; re-raised as the same class here so
# a bad spec reads exactly as it would in-process. Anything else becomes a RewardFunctionError.
_LOAD_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (FileNotFoundError, ValueError, TypeError, ImportError, SyntaxError, RewardFunctionError)
}


def is_user_reward(spec: Any) -> bool:
    """True for a ``module:function`` or ``file.py:function`` spec: code the user wrote, which
    isolation runs in the worker. Built-in names and ``reward_model:`` entries are False, and so
    are callables (:func:`isolate_reward_functions` contains those by what can be sent)."""
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
            raise _remote_error(name, message, tb)
        return _from_plain(reply[1])

    def close(self) -> None:
        """Stop the worker process (idempotent)."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            try:
                self._conn.send_bytes(pickle.dumps((("close", ""), None, None)))
                self._process.join(2)
            except OSError:
                pass
        self._discard()


class _Unsendable(Exception):
    """A callable that stays in the trainer's process; the message says why."""


class _CallablePickler(pickle.Pickler):
    """The standard pickler, refusing torch tensors and modules: a callable holding a model
    keeps it on the trainer's device instead of a second copy in the worker."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, (torch.Tensor, torch.nn.Module)):
            raise _Unsendable(f"it holds a torch {type(obj).__name__}, which stays on the trainer's device")
        return NotImplemented


def _pickle_callable(fn: Callable) -> bytes:
    import io

    buffer = io.BytesIO()
    _CallablePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    return buffer.getvalue()


def _defined_in_main(fn: Any) -> bool:
    """True when ``fn`` (a function, a partial of one, or an object's class) comes from
    ``__main__``, which the worker cannot import: pickle would name it, and unpickling would
    look in the worker's own ``__main__``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = fn if inspect.isroutine(fn) or inspect.isclass(fn) else type(fn)
    return getattr(owner, "__module__", None) == "__main__"


def _is_library_object(fn: Any) -> bool:
    """The library's own reward objects (a reward model, the code-test reward): run in the
    trainer's process like the built-ins they stand for."""
    module = type(fn).__module__ or ""
    return module == "policygrad" or module.startswith("policygrad.")


class IsolatedRewardFunction:
    """A user reward function, called in a :class:`RewardWorker` with the reward protocol
    ``fn(prompts, completions, **row_fields) -> scores``. Its ``__name__`` is the spec (or, for
    a callable sent as an object, ``name``: the callable's own), so the reward component keeps
    the name it has in-process."""

    def __init__(self, spec: str, worker: RewardWorker, *, name: str | None = None):
        self.spec = spec.strip()
        self.__name__ = self.spec if name is None else name
        self.worker = worker

    def __call__(self, prompts, completions, **fields):
        return self.worker.call(self.spec, *copy_inputs(prompts, completions, fields))

    def close(self) -> None:
        self.worker.close()

    def __repr__(self) -> str:
        return f"IsolatedRewardFunction({self.spec!r})"


class GuardedRewardFunction:
    """A reward function run in the trainer's process (``reward.isolation: false``, or a callable
    that cannot be sent to the worker), on copies of its inputs, with the working directory
    restored after each call and ``SystemExit`` (or any other ``BaseException`` but
    ``KeyboardInterrupt``) turned into an error of the call.

    With ``timeout_s``, each call runs in a thread of its own that the caller waits for at most
    ``timeout_s`` seconds (a watchdog); a call that overruns raises
    :class:`~policygrad.rewards.registry.RewardCallFailed` (an error for its whole batch, which
    ``reward.on_error`` handles). Python cannot stop a thread: the overrunning call goes on in
    the background (a daemon thread, on its own copies of the inputs; it does not keep the
    process from exiting) and its result is dropped. ``os._exit`` and crashes are not contained.
    """

    def __init__(self, fn: Callable, name: str, *, timeout_s: float | None = None):
        self.fn = fn
        self.__name__ = name
        self.timeout_s = timeout_s

    def __call__(self, prompts, completions, **fields):
        home = os.getcwd()
        prompts, completions, fields = copy_inputs(prompts, completions, fields)
        try:
            if self.timeout_s is None:
                return self.fn(prompts, completions, **fields)
            return self._watched(prompts, completions, fields)
        except (KeyboardInterrupt, Exception):
            raise
        except BaseException as exc:  # SystemExit and friends: the call failed, the run goes on
            raise _remote_error(type(exc).__name__, str(exc)) from exc
        finally:
            if os.getcwd() != home:
                os.chdir(home)

    def _watched(self, prompts, completions, fields):
        box: dict[str, Any] = {}
        torch = sys.modules.get("torch")
        grad = torch.is_grad_enabled() if torch is not None else None  # thread-local in torch

        def target():
            try:
                if grad is None:
                    box["value"] = self.fn(prompts, completions, **fields)
                else:
                    with torch.set_grad_enabled(grad):
                        box["value"] = self.fn(prompts, completions, **fields)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"policygrad-reward {self.__name__}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise RewardCallFailed(
                f"did not return within reward.timeout_s={self.timeout_s:g} s on a batch of "
                f"{len(completions)} rows; it runs in the trainer's process, where it cannot be stopped "
                "and goes on in the background"
            )
        if "error" in box:
            raise box["error"]
        return box["value"]


def isolate_reward_functions(
    specs: Sequence, *, isolation: bool = True, timeout_s: float | None = None
) -> tuple[list, RewardWorker | None]:
    """Replace the user reward functions of ``specs`` (``module:function``, ``file.py:function``,
    and callables given as objects) by contained callables; built-in names, ``reward_model:``
    entries and the library's reward objects pass unchanged.

    With ``isolation`` the specs are loaded in one new :class:`RewardWorker` (so a missing file or
    a broken module is reported here, before the run writes anything), and so are the callables
    that can be sent there (see the module docstring); a callable that cannot be sent becomes a
    :class:`GuardedRewardFunction` with ``timeout_s``, and one warning line names it and says
    why. Without ``isolation`` every user function is loaded in this process and becomes a
    :class:`GuardedRewardFunction` with ``timeout_s``. Either way a callable keeps its name as a
    reward component.

    Returns:
        ``(functions, worker)``; ``worker`` is None when no function is isolated. Close it
        (``worker.close()``) when the run ends; it is also stopped when garbage-collected.

    Raises:
        FileNotFoundError, ValueError, TypeError, ImportError, SyntaxError, RewardFunctionError:
            a spec that does not load (as :func:`load_reward_function` raises them).
    """
    user = [s for s in specs if is_user_reward(s)]
    objects = [s for s in specs if callable(s) and not isinstance(s, str) and not _is_library_object(s)]
    if not user and not objects:
        return list(specs), None
    if not isolation:
        out = []
        for s in specs:
            if is_user_reward(s):
                out.append(GuardedRewardFunction(load_reward_function(s), s.strip(), timeout_s=timeout_s))
            elif any(s is o for o in objects):
                fn = awaited(s)
                out.append(GuardedRewardFunction(fn, callable_name(fn), timeout_s=timeout_s))
            else:
                out.append(s)
        return out, None
    worker = RewardWorker(timeout_s=timeout_s)
    out = []
    try:
        for spec in dict.fromkeys(s.strip() for s in user):
            worker.load(spec)
        for s in specs:
            if is_user_reward(s):
                out.append(IsolatedRewardFunction(s, worker))
            elif any(s is o for o in objects):
                out.append(_contain_object(s, worker, timeout_s))
            else:
                out.append(s)
    except BaseException:
        worker.close()
        raise
    if not any(isinstance(f, IsolatedRewardFunction) for f in out):
        worker.close()
        return out, None
    return out, worker


def _contain_object(fn: Callable, worker: RewardWorker, timeout_s: float | None):
    """``fn`` in the worker when it can be sent there, else guarded in this process (logged)."""
    name = callable_name(awaited(fn))  # the component name it has in-process
    if _defined_in_main(fn):
        why = "it is defined in __main__ (a script or a notebook), which the reward worker cannot import"
    else:
        try:
            return IsolatedRewardFunction(worker.load_object(fn, name), worker, name=name)
        except _Unsendable as exc:
            why = str(exc)
        except RewardFunctionError as exc:
            why = str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever pickle raises: it cannot be sent
            why = f"it cannot be pickled ({type(exc).__name__}: {exc})"
    log.warning(
        "reward function %r runs in the trainer's process: %s; its inputs are copies, sys.exit and "
        "reward.timeout_s are contained, os._exit and crashes are not; define it at the top level of "
        "an importable module to run it in the reward worker",
        name,
        why,
    )
    return GuardedRewardFunction(awaited(fn), name, timeout_s=timeout_s)
