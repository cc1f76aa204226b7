"""Where an episode's environment lives: in worker processes (contained), or in the trainer's
process (trusted).

With ``rollout.env_isolation`` (the default) the environments of a step's episodes are built and
called in a small pool of ``rollout.env_workers`` persistent worker processes
(:class:`ProcessHost`): episode environment ``h`` lives in worker ``h mod W``; every call
(build, ``reset``, ``step``, ``final_reward``, ``close``) is one message over a pipe, and each
worker runs one call at a time, so at most W calls run at once (as W threads did). What this
contains, that threads in the trainer's process cannot:

* ``os._exit``, a crash (segfault), an out-of-memory kill or a signal an environment sends its
  own process end that worker only: the call in flight fails with the exit status or signal,
  the other episodes it hosted fail as lost, and a fresh worker hosts the next environments
  (:mod:`policygrad.envs.episodes` retries failed episodes, ``rollout.env_retries``);
* ``rollout.env_step_timeout_s`` is kept by the trainer, which waits on the pipe: a call over it
  (a hang, or a C call that holds the GIL) has its worker killed, so the time can't stretch;
* ``os.chdir`` moves the worker, never the run (the worker's directory is restored after each
  call, so episodes don't depend on which others share their worker);
* a fork: each worker leads its own session and process group and is a child subreaper
  (``PR_SET_CHILD_SUBREAPER``: orphaned descendants become its children, not init's); when the
  worker is stopped, replaced or the run ends, every descendant of it (found from the parent
  links in ``/proc``, in any session: a ``start_new_session`` child too), its group and then
  the worker are killed (SIGKILL), so no copy outlives the run; the worker is
  not in the trainer's process group either, so Ctrl-C or a SIGTERM sent to the group reaches
  the trainer alone, which stops the workers as it ends. The limit: a worker that ends on its
  own (its environment calls ``os._exit``, crashes) leaves its descendants in a new session to
  init, out of reach; those in its process group are still killed with the group. Orphans
  re-parented to a worker stay zombies until it is stopped (reaping them there could take the
  exit status of a child the environment waits for).

Workers start from the forkserver (a clean process: no trainer threads, none of the trainer's
signal handlers), get the trainer's environment variables, ``sys.path`` and working directory,
ask the kernel to kill them when their parent ends (``PR_SET_PDEATHSIG``) and also watch the
trainer (they exit when it is gone). Only plain data comes back (numbers, strings, lists, dicts;
other objects as stand-ins carrying their type name and repr), and is checked in the trainer as
an in-process environment's values are (:func:`~policygrad.envs.base.check_step_result` ...).

The environment is sent to the workers as its spec (``builtin:NAME``, ``module:Class``,
``file.py:Class``, loaded again there) or, for an object (``policygrad.train(env=Class)``), by
pickle. One that cannot be sent (defined in ``__main__``, a lambda or closure, unpicklable) or
that a worker cannot load runs in the trainer's process (:class:`InProcessHost`, threads as
before) with one warning line saying why; so does every environment with
``rollout.env_isolation: false`` (trusted code; saves the pipe's round trips).

A worker process itself, its replies and the trainer's end of it are
:mod:`policygrad.envs.worker_process`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import multiprocessing.connection
import os
import pickle
import queue
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policygrad.envs.worker_process import EnvWorker, decode_tree, env_call, one_line, read_reply
from policygrad.rewards.remote import worker_context

__all__ = [
    "InProcessHost",
    "ProcessHost",
    "call_all",
    "copy_row",
    "env_call",
    "make_host",
    "one_line",
    "probe_in_worker",
]

log = logging.getLogger("policygrad")

# Seconds a new worker may take to load the environment before it counts as failed to start.
START_TIMEOUT_S = 120.0


# --------------------------------------------------------------------------------------------
# Hosts.


def call_all(
    calls: Sequence[Callable[[], Any]], *, workers: int, timeout_s: float | None,
    timeout_field: str = "rollout.env_step_timeout_s",
) -> list[tuple[bool, Any]]:
    """Run ``calls`` on at most ``workers`` threads at once, each bounded by ``timeout_s``.

    Returns:
        ``(True, result)`` or ``(False, one-line error)`` per call, in order. A call over the
        timeout is abandoned (Python cannot stop a thread: it runs on as a daemon thread, whose
        result is dropped) and reported as an error, so an environment that hangs costs its
        episode, never the run.
    """
    results: list[tuple[bool, Any] | None] = [None] * len(calls)
    done: queue.Queue = queue.Queue()
    pending, running = deque(range(len(calls))), {}

    def target(i: int, fn: Callable[[], Any]) -> None:
        try:
            done.put((i, (True, fn())))
        except BaseException as exc:  # noqa: BLE001 - sys.exit() too: any end of user code fails the episode
            done.put((i, (False, f"{type(exc).__name__}: {exc}".splitlines()[0][:300])))

    while pending or running:
        while pending and len(running) < max(workers, 1):
            i = pending.popleft()
            running[i] = time.monotonic() + timeout_s if timeout_s is not None else None
            threading.Thread(
                target=target, args=(i, calls[i]), daemon=True, name=f"policygrad-env-{i}"
            ).start()
        deadlines = [d for d in running.values() if d is not None]
        wait = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
        try:
            i, outcome = done.get(timeout=wait)
            if i in running:
                del running[i]
                results[i] = outcome
        except queue.Empty:
            now = time.monotonic()
            for i, deadline in list(running.items()):
                if deadline is not None and deadline <= now:
                    del running[i]
                    results[i] = (False, f"timed out after {timeout_s:g} s ({timeout_field})")
    return results  # type: ignore[return-value]


class InProcessHost:
    """Environments in the trainer's process; calls on at most ``workers`` threads at once,
    each bounded by ``timeout_s`` (an overrunning call is abandoned, see :func:`call_all`)."""

    isolated = False

    def __init__(self, make_env: Callable[[], Any], *, workers: int, timeout_s: float | None,
                 timeout_field: str = "rollout.env_step_timeout_s"):
        self.make_env, self.workers, self.timeout_s = make_env, workers, timeout_s
        self.timeout_field = timeout_field
        self.envs: dict[int, Any] = {}
        self._next = 0

    def new_handles(self, n: int) -> list[int]:
        handles = list(range(self._next, self._next + n))
        self._next += n
        return handles

    def alive(self, handle: int) -> bool:
        return handle in self.envs

    def call(self, requests: Sequence[tuple[int, str, tuple]]) -> list[tuple[bool, Any]]:
        """``(True, value)`` or ``(False, one-line error)`` per ``(handle, method, args)``."""

        def one(handle: int, method: str, args: tuple):
            if method == "make":
                self.envs[handle] = self.make_env()
                return None
            try:
                return env_call(self.envs[handle], method, args)
            finally:
                if method == "close":
                    self.envs.pop(handle, None)

        return call_all(
            [functools.partial(one, *r) for r in requests], workers=self.workers, timeout_s=self.timeout_s,
            timeout_field=self.timeout_field,
        )

    def close(self) -> None:
        self.envs.clear()


class ProcessHost:
    """Environments in ``workers`` worker processes (see the module docstring)."""

    isolated = True

    def __init__(self, payload: bytes, *, workers: int, timeout_s: float | None,
                 timeout_field: str = "rollout.env_step_timeout_s"):
        self.payload, self.timeout_s, self.timeout_field = payload, timeout_s, timeout_field
        self.slots: list[EnvWorker | None] = [None] * max(int(workers), 1)
        self.lost: dict[int, str] = {}  # handle -> why its environment is gone
        self._hosted: list[set[int]] = [set() for _ in self.slots]
        self._next = 0
        self._ctx = worker_context()
        # At the latest when the host is collected or the interpreter exits (a script that never
        # closed its run): the workers and what they forked, which PR_SET_PDEATHSIG would not reach.
        weakref.finalize(self, _stop_all, self.slots)

    def new_handles(self, n: int) -> list[int]:
        handles = list(range(self._next, self._next + n))
        self._next += n
        return handles

    def alive(self, handle: int) -> bool:
        return handle not in self.lost and handle in self._hosted[handle % len(self.slots)]

    def start(self, slots: Sequence[int]) -> dict[int, str]:
        """Start the workers of ``slots`` that are not running; ``{slot: why}`` of those that
        could not load the environment."""
        fresh = []
        for s in dict.fromkeys(slots):
            if self.slots[s] is None:
                self.slots[s] = EnvWorker(self._ctx, self.payload)
                fresh.append(s)
        failed = {}
        for s in fresh:
            why = self.slots[s].wait_ready(START_TIMEOUT_S)
            if why is not None:
                failed[s] = why
                self._lose(s, None, "")
        return failed

    def _lose(self, slot: int, running: int | None, why: str) -> None:
        """Stop worker ``slot``; its environments are lost (``running``, the handle whose call
        ended it, with ``why``)."""
        worker = self.slots[slot]
        if worker is not None:
            worker.stop()
        self.slots[slot] = None
        for h in self._hosted[slot]:
            self.lost[h] = (
                why
                if h == running
                else "its environment was lost with its worker process (another episode's call on the same "
                "worker ended it or timed out)"
            )
        self._hosted[slot] = set()

    def call(self, requests: Sequence[tuple[int, str, tuple]]) -> list[tuple[bool, Any]]:
        """``(True, value)`` or ``(False, one-line error)`` per ``(handle, method, args)``, in
        order; ``make`` builds the environment ``handle``."""
        W = len(self.slots)
        results: list[tuple[bool, Any] | None] = [None] * len(requests)
        queues: dict[int, deque] = {}
        for i, (h, method, _) in enumerate(requests):
            if method == "make":
                self.lost.pop(h, None)
            queues.setdefault(h % W, deque()).append(i)
        for slot, why in self.start([s for s in queues if self.slots[s] is None]).items():
            for i in queues.pop(slot):
                results[i] = (False, f"an environment worker could not start: {why}")
        running: dict[int, tuple[int, float | None]] = {}  # slot -> (request, deadline)
        while queues or running:
            for slot in list(queues):
                while slot not in running and queues[slot]:
                    i = queues[slot].popleft()
                    failure = self._send(slot, requests[i])
                    if failure is not None:
                        results[i] = (False, failure)
                    else:
                        deadline = time.monotonic() + self.timeout_s if self.timeout_s is not None else None
                        running[slot] = (i, deadline)
                if not queues[slot]:
                    del queues[slot]
            if running:
                self._await(running, requests, results)
        return results  # type: ignore[return-value]

    def _await(self, running: dict, requests: Sequence, results: list) -> None:
        """Wait for the first of the ``running`` calls (slot -> (request, deadline)) to answer,
        end its worker, or pass its deadline; record those in ``results``."""
        deadlines = [d for _, d in running.values() if d is not None]
        wait = max(min(deadlines) - time.monotonic(), 0.0) if deadlines else None
        by_conn = {self.slots[s].conn: s for s in running}
        by_sentinel = {self.slots[s].process.sentinel: s for s in running}
        ready = multiprocessing.connection.wait([*by_conn, *by_sentinel], timeout=wait)
        for slot in {by_conn.get(r, by_sentinel.get(r)) for r in ready}:
            i, _ = running.pop(slot)
            results[i] = self._reply(slot, requests[i])
        now = time.monotonic()
        for slot, (i, deadline) in list(running.items()):
            if deadline is not None and deadline <= now:
                del running[slot]
                why = f"timed out after {self.timeout_s:g} s ({self.timeout_field})"
                self._lose(slot, requests[i][0], why)
                results[i] = (False, why)

    def _send(self, slot: int, request: tuple[int, str, tuple]) -> str | None:
        """Send ``request`` to worker ``slot`` (started if needed); why it could not be (None: sent)."""
        h, method, _ = request
        if method != "make" and not self.alive(h):
            return self.lost.get(h, "its environment was never built")
        if self.slots[slot] is None:
            why = self.start([slot]).get(slot)
            if why is not None:
                return f"an environment worker could not start: {why}"
        try:
            data = pickle.dumps(request)
        except Exception as exc:  # noqa: BLE001 - e.g. a row that cannot be pickled
            return f"its arguments cannot be sent to the environment worker ({one_line(exc)})"
        try:
            self.slots[slot].conn.send_bytes(data)
        except OSError:  # the worker is gone: read as its death when the reply is awaited
            pass
        return None

    def _reply(self, slot: int, request: tuple[int, str, tuple]) -> tuple[bool, Any]:
        worker, (h, method, _) = self.slots[slot], request
        try:
            if not worker.conn.poll():
                raise EOFError
            kind, value = read_reply(worker.conn.recv_bytes())
        except (EOFError, OSError):
            why = (
                f"its environment worker process ended ({worker.exit()}: os._exit, a crash, a signal or an "
                "out-of-memory kill)"
            )
            self._lose(slot, h, why)
            return False, why
        except pickle.UnpicklingError as exc:
            return False, str(exc)
        if method == "make" and kind == "ok":
            self._hosted[slot].add(h)
        if method == "close":
            self._hosted[slot].discard(h)
        return (True, decode_tree(value)) if kind == "ok" else (False, value)

    def close(self) -> None:
        """Stop every worker (and what it forked). Idempotent."""
        for s in range(len(self.slots)):
            if self.slots[s] is not None:
                self._lose(s, None, "the environment workers were closed")


def _stop_all(slots: list[EnvWorker | None]) -> None:
    for worker in slots:
        if worker is not None:
            worker.stop()


# --------------------------------------------------------------------------------------------


def _unsendable(make_env: Any) -> str | None:
    """Why ``make_env`` cannot be built in a worker (None: it can)."""
    target = getattr(make_env, "target", make_env)
    while isinstance(target, functools.partial):
        target = target.func
    owner = target if inspect.isroutine(target) or inspect.isclass(target) else type(target)
    if getattr(owner, "__module__", None) == "__main__":
        return "it is defined in __main__ (a script or a notebook), which a worker process cannot import"
    return None


def probe_in_worker(make_env: Callable[[], Any], name: str, timeout_s: float | None = None) -> bool:
    """Build one environment with ``make_env`` and close it in a worker process of its own, so
    that a constructor's typo shows at start while its ``os._exit``, crash or ``chdir`` stay out
    of the trainer's process. Returns False, having run nothing, when ``make_env`` cannot be sent
    to a worker or a worker cannot load it (the caller probes in its own process, as the run
    will host it there). Building and closing are each bounded by ``timeout_s``
    (``rollout.env_step_timeout_s``; None: :data:`START_TIMEOUT_S`), past which the worker is
    killed and the check fails.

    Raises:
        ValueError: the class refused its options (``env.options do not fit ...``), the
            constructor or ``close()`` failed, or building or loading ended the worker process.
        NotAnEnvironment: what ``make_env`` built has no ``reset()``/``step()``.
    """
    if _unsendable(make_env) is not None:
        return False
    try:
        blob = pickle.dumps(make_env)
    except Exception:  # noqa: BLE001 - whatever pickle raises: it cannot be sent
        return False
    payload = pickle.dumps((dict(os.environ), list(sys.path), os.getcwd(), blob))
    host = ProcessHost(payload, workers=1, timeout_s=START_TIMEOUT_S if timeout_s is None else timeout_s)
    try:
        failed = host.start([0]).get(0)
        if failed is not None:
            if "ended it" in failed:
                raise ValueError(f"env.name {name}: {failed}")
            return False
        (handle,) = host.new_handles(1)
        ((ok, value),) = host.call([(handle, "make", ())])
        if not ok:
            kind, _, message = str(value).partition(": ")
            if kind == "NotAnEnvironment":
                from policygrad.envs.registry import NotAnEnvironment  # the registry imports this module

                raise NotAnEnvironment(message)
            if kind in ("TypeError", "ValueError"):  # the class refused the options (a name, a value)
                raise ValueError(f"env.options do not fit {name}: {message}")
            raise ValueError(f"env.name {name} could not be built: {value}")
        ((ok, value),) = host.call([(handle, "close", ())])
        if not ok:
            raise ValueError(f"env.name {name}: close() failed: {value}")
        return True
    finally:
        host.close()


def make_host(
    make_env: Callable[[], Any], *, isolation: bool, workers: int, timeout_s: float | None, name: str,
    timeout_field: str = "rollout.env_step_timeout_s",
):
    """The host of a run's environments (see the module docstring): a :class:`ProcessHost` with
    ``isolation`` when ``make_env`` can be sent to a worker and loads there (one worker is
    started here to check), else an :class:`InProcessHost` (with ``isolation``: one warning
    line naming environment ``name`` and why); a call over ``timeout_s`` fails naming
    ``timeout_field``.

    Raises:
        ValueError: loading the environment ended the worker process (``os._exit`` or a crash
            at import), which in the trainer's process would end the run.
    """
    if not isolation:
        return InProcessHost(make_env, workers=workers, timeout_s=timeout_s, timeout_field=timeout_field)
    why = _unsendable(make_env)
    if why is None:
        try:
            blob = pickle.dumps(make_env)
        except Exception as exc:  # noqa: BLE001 - whatever pickle raises: it cannot be sent
            why = f"it cannot be pickled ({one_line(exc)})"
    if why is None:
        payload = pickle.dumps((dict(os.environ), list(sys.path), os.getcwd(), blob))
        host = ProcessHost(payload, workers=workers, timeout_s=timeout_s, timeout_field=timeout_field)
        failed = host.start([0]).get(0)
        if failed is None:
            return host
        if "ended it" in failed:
            raise ValueError(f"env.name {name}: {failed}")
        why = f"a worker process cannot load it ({failed})"
    agent = name.startswith("agent ")  # policygrad.envs.agent.AgentFunction's name
    log.warning(
        "%s runs in the trainer's process: %s; os._exit, crashes, signals, chdir and forks in it are not "
        "contained; define it in an importable module (or name it as %s) to run it in environment worker "
        "processes",
        name if agent else f"environment {name}",
        why,
        "agent.function=file.py:function" if agent else "file.py:Class",
    )
    return InProcessHost(make_env, workers=workers, timeout_s=timeout_s, timeout_field=timeout_field)


def copy_row(row: Mapping[str, Any]) -> Any:
    """An episode's own copy of its dataset row (the G episodes of a row share none of it)."""
    return copy.deepcopy(row)
