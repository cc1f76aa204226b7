"""The program that runs inside the code sandbox; :mod:`policygrad.sandbox.runner` starts it.

The sandbox starts a fresh interpreter as ``python -I -S -B -c <program>`` (isolated mode: no
``PYTHON*`` variables, no site packages, no user site, no bytecode written), where the program
(:func:`policygrad.sandbox.launch.worker_program`) carries the source of this module and of the
ones it imports (:mod:`~policygrad.sandbox.procfs`, :mod:`~policygrad.sandbox.wire`,
:mod:`~policygrad.sandbox.confine`), runs each as that module and calls :func:`main`; then it
writes one JSON spec to its standard input and closes it. Only the standard library is used, and
everything these modules need is imported before any untrusted code runs.

What it does, in order (every step is trusted code, before the program's first line):

1. read the spec (role, isolation, limits, the program, the tests, the file descriptors);
2. ``isolation == "namespaces"``: enter new user (when not root), mount, PID, network, IPC and
   UTS namespaces, fork twice (a supervisor outside the PID namespace, an init that is PID 1
   inside it and dies with the supervisor, so killing the supervisor's process group ends
   everything the program started), build a minimal read-only root (``/usr``, ``/lib*``,
   ``/bin``, the interpreter's prefix, a few ``/dev`` nodes, a fresh ``/proc``) with one
   writable tmpfs of ``max_write_bytes`` at ``/sandbox``, and ``pivot_root`` into it.
   ``"bwrap"``: bubblewrap has done the same; ``"none"``: only a supervisor process, a child
   subreaper that kills everything the program left behind when it ends
   (:func:`~policygrad.sandbox.confine.supervise`);
3. drop privileges: to the spec's ``uid`` (a fresh unprivileged uid when started as root), or,
   inside a user namespace, every capability; ``PR_SET_NO_NEW_PRIVS``;
4. resource limits (``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``,
   ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0), hard limits equal to the soft ones;
5. run the role:

* ``script``: run the program as the module ``__main__``; its exit status is the process's.
* ``candidate``: send a ready frame, execute the program as the module ``__candidate__``, then
  answer call requests ``{"call": name, "args": [...], "kwargs": [...]}`` read from ``req_fd``
  with ``{"ok": value}`` or ``{"raised": exception type name, "message": text}`` on
  ``resp_fd``. Only plain data crosses (see :func:`~policygrad.sandbox.wire.encode`).
* ``tests``: wait for the candidate's ready frame, run the tests (each in its own module
  ``__tests__``) with the candidate's functions replaced by proxies that make those calls, and
  write one JSON line per test to ``report_fd``.

Each runs its code as a real module (:func:`new_module`): registered in ``sys.modules`` under
its name, as an import registers it, with its source in ``linecache``, so dataclasses, pickling,
``typing.get_type_hints``, ``inspect.getsource`` and ``enum`` work as in a file one imports.

Frames on the request/response pipes are a 4-byte big-endian length and a JSON body
(:mod:`~policygrad.sandbox.wire`).
"""

from __future__ import annotations

import builtins
import json
import linecache
import os
import socket  # noqa: F401 - imported before the program runs, for the probe's use
import sys
import time
import traceback
import types

from policygrad.sandbox.confine import SETUP_FAILED, drop_privileges, enter_namespaces, set_limits, supervise
from policygrad.sandbox.wire import decode, encode, read_frame, write_frame

# ---------------------------------------------------------------------------------------------
# Roles.


def new_module(name, filename, source):
    """A module object named ``name``, as an import makes it: ``__file__`` is ``filename`` and
    the source is in :mod:`linecache` under it (so ``inspect.getsource`` and tracebacks find it).
    The caller registers it in ``sys.modules`` before running ``source`` in it: dataclasses,
    pickle, ``typing.get_type_hints`` and ``inspect`` find a class's module there by name."""
    module = types.ModuleType(name)
    module.__file__ = filename
    module.__builtins__ = builtins
    lines = source.splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    # mtime None: linecache.checkcache keeps the entry (there is no file to compare with).
    linecache.cache[filename] = (len(source), None, lines, filename)
    return module


def run_module(source, module):
    """Register ``module`` in ``sys.modules`` under its name (replacing what was there; the
    caller keeps a reference to anything it still needs) and execute ``source`` in it."""
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)


def role_script(spec):
    # The program becomes __main__ (in place of the launching program); the worker's functions keep
    # their own globals.
    module = new_module("__main__", "program.py", spec["program"])
    try:
        run_module(spec["program"], module)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - report any failure of the program as exit status 1
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def role_candidate(spec):
    req, resp = spec["fds"]["req"], spec["fds"]["resp"]
    write_frame(resp, {"ready": True})
    # Registered for the rest of this process's life: the program's classes are looked up there
    # whenever an instance is pickled or a hint resolved, during the calls too.
    module = new_module("__candidate__", "solution.py", spec["program"])
    namespace = module.__dict__
    load_error = None
    try:
        run_module(spec["program"], module)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
        load_error = f"{type(exc).__name__}: {exc}"[:2000]
    while True:
        try:
            request = read_frame(req)
        except EOFError:
            os._exit(0)
        name = request.get("call")
        try:
            if load_error is not None:
                raise RuntimeError(f"the program failed to load: {load_error}")
            fn = namespace.get(name)
            if not callable(fn):
                raise NameError(f"the program defines no function {name!r}")
            args = decode(request["args"])
            kwargs = decode(request["kwargs"])
            reply = {"ok": encode(fn(*args, **kwargs))}
        except BaseException as exc:  # noqa: BLE001 - every failure is the call's result
            try:
                reply = {"raised": type(exc).__name__, "message": str(exc)[:2000]}
            except BaseException:  # noqa: BLE001 - a str() that raises
                reply = {"raised": "Exception", "message": "(unprintable)"}
        write_frame(resp, reply)


class CandidateError(Exception):
    """The candidate's function could not give an answer (it raised something that is not a
    built-in exception, it returned something that is not plain data, its process ended, or the
    time ran out)."""


# Exceptions a candidate may "raise" across the boundary: built-in Exception subclasses only, so
# a test that expects e.g. ValueError still sees one; BaseException-only ones (SystemExit,
# KeyboardInterrupt, GeneratorExit) and everything else become CandidateError.
_BUILTIN_ERRORS = {
    name: obj for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception)
}


class Channel:
    """The harness side of the pipes to the candidate process."""

    def __init__(self, req, resp, deadline):
        self.req, self.resp, self.deadline = req, resp, deadline
        self.broken = None  # why the channel died (then every later call fails)

    def wait_ready(self):
        frame = read_frame(self.resp, self.deadline)
        if frame != {"ready": True}:
            raise RuntimeError(f"unexpected first frame {str(frame)[:80]}")

    def call(self, name, args, kwargs):
        if self.broken is not None:
            raise CandidateError(self.broken)
        request = {"call": name, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
        try:
            write_frame(self.req, request)
            reply = read_frame(self.resp, self.deadline)
        except TimeoutError:
            self.broken = "time limit reached"
            raise CandidateError(self.broken) from None
        except (EOFError, OSError) as exc:
            self.broken = f"the candidate's process ended ({type(exc).__name__})"
            raise CandidateError(self.broken) from None
        except Exception as exc:  # noqa: BLE001 - malformed frames: the candidate broke the protocol
            self.broken = f"unreadable reply ({type(exc).__name__}: {str(exc)[:200]})"
            raise CandidateError(self.broken) from None
        if type(reply) is dict and set(reply) == {"ok"}:
            try:
                return decode(reply["ok"])
            except Exception as exc:  # noqa: BLE001 - not plain data
                raise CandidateError(f"{name}() returned something that is not plain data: {exc}") from None
        if (type(reply) is dict and set(reply) == {"raised", "message"} and type(reply["raised"]) is str
                and type(reply["message"]) is str):
            error = _BUILTIN_ERRORS.get(reply["raised"], None)
            if error is not None:
                try:
                    exc = error(reply["message"])
                except TypeError:  # an exception class whose constructor wants other arguments
                    exc = None
                if exc is not None:  # raised outside the try: a TypeError of the program is itself
                    raise exc
            raise CandidateError(f"{name}() raised {reply['raised'][:80]}: {reply['message'][:500]}")
        self.broken = "malformed reply"
        raise CandidateError(self.broken)

    def proxy(self, name):
        def candidate(*args, **kwargs):
            return self.call(name, args, kwargs)

        candidate.__name__ = candidate.__qualname__ = name
        return candidate


def role_tests(spec):
    fds = spec["fds"]
    report_fd = fds["report"]

    def report(**record):
        os.write(report_fd, (json.dumps(record) + "\n").encode())

    # The program's time starts when its sandbox is up: start-up on a loaded machine is not its.
    channel = Channel(fds["req"], fds["resp"], time.monotonic() + float(spec["start_timeout_s"]))
    try:
        channel.wait_ready()
    except Exception as exc:  # noqa: BLE001 - the candidate's sandbox did not start
        report(setup_error=f"the candidate's sandbox did not start: {type(exc).__name__}: {exc}")
        return
    channel.deadline = time.monotonic() + float(spec["limits"]["wall_time_s"])
    report(ready=True)
    tests = spec["tests"]
    prelude = tests.get("prelude") or ""
    module = new_module("__tests__", "prompt.py", prelude)
    namespace = module.__dict__
    if prelude:
        # The prompt's own code (HumanEval's helpers): it belongs to the tests, so it runs here.
        try:
            run_module(prelude, module)
        except BaseException as exc:  # noqa: BLE001 - a prompt that is not a program
            report(note=f"the prompt did not run as code: {type(exc).__name__}: {exc}"[:500])
    for name in tests["names"]:
        namespace[name] = channel.proxy(name)
    cases = []
    if tests.get("check"):
        entry = tests["entry_point"]
        cases.append((tests["check"] + f"\n\ncheck({entry})\n", "check.py"))
    cases += [(source, f"test_{i}.py") for i, source in enumerate(tests.get("asserts") or [])]
    for index, (source, filename) in enumerate(cases):
        error = None
        case = new_module("__tests__", filename, source)  # each test in its own copy of the namespace
        case.__dict__.update(namespace)
        case.__file__ = filename
        try:
            run_module(source, case)
        except BaseException as exc:  # noqa: BLE001 - any exception fails the test
            error = f"{type(exc).__name__}: {exc}"[:1000]
        if error is None and channel.broken is not None:
            error = f"the candidate failed during the test: {channel.broken}"
        report(test=index, passed=error is None, error=error)
    report(done=True)


ROLES = {"script": role_script, "candidate": role_candidate, "tests": role_tests}


def main():
    spec = json.loads(sys.stdin.buffer.read())
    in_userns = False
    try:
        isolation = spec["isolation"]
        if isolation == "namespaces":
            in_userns = enter_namespaces(spec)
        elif isolation == "bwrap":
            os.chdir("/sandbox")  # bubblewrap's own PID 1 supervises and dies with its parent
        else:
            supervise(reap_tree=True)
        drop_privileges(spec, in_userns)
        set_limits(spec["limits"])
    except BaseException as exc:  # noqa: BLE001 - report and stop: the sandbox is not in force
        sys.stderr.write(f"sandbox setup failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)
    ROLES[spec["role"]](spec)
