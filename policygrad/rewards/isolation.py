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

The worker process and its protocol are :mod:`policygrad.rewards.remote`; what crosses back is
:mod:`policygrad.rewards.plain`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policygrad.rewards.callables import awaited, callable_name
from policygrad.rewards.plain import plain_loads, remote_error
from policygrad.rewards.remote import RewardWorker, Unsendable, main_module_hidden, worker_context
from policygrad.rewards.specs import (
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
            raise remote_error(type(exc).__name__, str(exc)) from exc
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
        except Unsendable as exc:
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
