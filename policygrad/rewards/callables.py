"""Python objects as reward functions: async functions called like sync ones, and how a config
records an object (its import path when it has one, a clear placeholder when not).

An async reward function (``async def fn(prompts, completions, **fields)``, or an object whose
``__call__`` is async) is run to completion with :func:`asyncio.run` in the calling thread, or,
when that thread already runs an event loop (a notebook), in a short-lived thread of its own, so
the protocol stays ``fn(...) -> list[float]`` for the rest of the library.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "NOT_IMPORTABLE",
    "awaited",
    "callable_name",
    "describe_object",
    "import_path",
    "is_async_callable",
]

# How config.yaml records an object that cannot be named by an import path.
NOT_IMPORTABLE = "<{kind} {name} (not importable)>"


def is_async_callable(fn: Any) -> bool:
    """True for an ``async def`` function, a ``functools.partial`` of one, or an object whose
    ``__call__`` is ``async def``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    call = type(fn).__call__ if not inspect.isroutine(fn) else None  # an object with async __call__
    return inspect.iscoroutinefunction(fn) or (call is not None and inspect.iscoroutinefunction(call))


def _run(coroutine):
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop in this thread: the plain way
        return asyncio.run(coroutine)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="policygrad-async-reward", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def callable_name(fn: Callable) -> str:
    """The name a reward function is known by: its ``__name__``, a ``functools.partial``'s
    function's (through nested partials), else its class name (a callable object)."""
    while getattr(fn, "__name__", None) is None and isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def awaited(fn: Callable) -> Callable:
    """``fn`` itself when it is synchronous; for an async callable, a synchronous wrapper with
    its name (``functools.wraps``) that runs each call's coroutine to completion."""
    if not is_async_callable(fn):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return _run(fn(*args, **kwargs))

    call.__name__ = callable_name(fn)
    call.__policygrad_async__ = True
    return call


def import_path(obj: Any) -> str | None:
    """``"module:qualname"`` when importing it gives back ``obj`` itself, else None (a lambda, a
    nested function, an object defined in ``__main__`` or in a notebook, a bound method of an
    instance)."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except Exception:  # noqa: BLE001 - anything that fails to import is "not importable"
        return None
    return f"{module}:{qualname}" if target is obj else None


def describe_object(obj: Any, *, kind: str = "callable") -> str:
    """How a config records ``obj``: a string as is, else its :func:`import_path`, else
    ``<callable NAME (not importable)>`` (``kind`` replaces ``callable``, e.g. ``dataset``)."""
    if isinstance(obj, str):
        return obj
    path = import_path(obj)
    if path is not None:
        return path
    name = getattr(obj, "__name__", None) or type(obj).__name__
    return NOT_IMPORTABLE.format(kind=kind, name=name)
