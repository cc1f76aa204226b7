"""An isolated runner for untrusted Python, and a test runner whose verdict the program cannot forge.

Model-generated programs never run in the trainer's process. :class:`Sandbox` starts each one in a
fresh interpreter (``python -I -S -B``: no ``PYTHON*`` variables, no site packages) running
:mod:`policygrad.sandbox.worker`, in its own session, with an empty environment (only
``PATH`` and ``LANG``), and kills its whole process tree when it ends.

Isolation (``isolation``; the run logs which one is in force when the sandbox is built):

* ``bwrap``: bubblewrap (the Debian/Ubuntu package ``bubblewrap``) builds new PID, network, IPC
  and UTS namespaces (and a user namespace when not root) and a minimal read-only root.
* ``namespaces``: the same with the kernel's namespaces directly (``unshare(2)``, needs root or
  unprivileged user namespaces): the worker becomes PID 1 of a new PID namespace that dies with
  its supervisor, builds a root on a tmpfs holding read-only binds of ``/usr``, ``/lib*``,
  ``/bin``, ``/sbin`` and the interpreter's prefix, ``/dev/{null,zero,full,random,urandom}``, a
  fresh ``/proc`` and one writable tmpfs ``/sandbox`` (also ``/tmp``) of ``max_write_bytes``, and
  ``pivot_root``\\ s into it. No network device but a down loopback exists.
* ``auto`` (the default): ``bwrap`` where the ``bwrap`` binary is found and works, else
  ``namespaces`` where they work; otherwise code rewards refuse to run (:class:`SandboxUnavailable`).
* ``none``: a separate process with the limits below and nothing else; the program runs as the
  trainer's user, can read what that user can read, reach the network and see (and signal) other
  processes. Its supervisor is a child subreaper: every process the program leaves behind, in a
  session of its own or not, is reparented to it and killed when the program ends, unless the
  program kills the supervisor first. Only when set explicitly, with a warning.

In every mode: a fresh unprivileged uid when started as root (``bwrap``/``namespaces``; in a user
namespace every capability is dropped instead), ``PR_SET_NO_NEW_PRIVS``, and resource limits
(:class:`SandboxLimits`): wall time (the coordinator kills the process group), CPU time
(``RLIMIT_CPU``), address space per process (``RLIMIT_AS``), processes (``RLIMIT_NPROC``), bytes
per written file (``RLIMIT_FSIZE``; with namespaces also the size of the only writable
filesystem), 256 open files, no core dumps. Output (stdout and stderr together) is read up to
``max_output_bytes`` and then the pipe is closed: nothing beyond it is buffered; the first 4 KiB
are kept for diagnostics.

Threat model of :meth:`Sandbox.run_tests` (the verdict of the ``code_tests`` reward). The program
is an adversary: arbitrary Python with ``ctypes``, ``fork``, threads, signals and syscalls, that
knows this design. The verdict must depend only on what the program's functions *return* for the
tests' inputs. So the tests never run in the program's interpreter: two sandboxes start per
program, the candidate (the program, serving calls to its functions) and the harness (the
tests: the prompt's helper code, HumanEval's ``check``, assert statements). In the harness the
program's function names are bound to proxies; a call sends its arguments over a pipe and reads
the reply, and only plain data crosses in either direction (JSON of None, bool, int, float, str,
list, tuple, dict, set, frozenset, bytes, complex, checked by exact type; an exception crosses
as a type name and a message and is re-raised in the harness as that built-in exception, or as
``CandidateError``). Hence:

* exit statuses, printed text, files and ``atexit`` hooks of the program are never read;
* ``AssertionError``, built-ins, ``check`` and the harness live in another process the program
  cannot see (its own PID, mount, IPC and network namespaces): replacing them in its own
  interpreter, or defining its own ``check``, changes nothing the harness runs;
* the program runs as a real module (``__candidate__``, registered in its own interpreter's
  ``sys.modules`` as an import registers it, so dataclasses and pickling work): replacing
  entries there (``__main__``, ``__tests__``) is replacing built-ins in the wrong process;
* an object with a rigged ``__eq__`` (or any object the program defined) cannot cross: only
  values of the exact built-in types arrive, so comparisons in the tests are the built-ins';
* a program that exits, crashes, hangs, forks, floods the pipe or sends malformed replies
  fails the tests in flight and every later one; a test passes only if it returned normally and
  the candidate answered every call of it;
* the harness writes the verdict (one line per test) to a pipe the candidate does not hold; the
  coordinator counts only explicit passes, so a killed or stalled harness means failure.

Out of scope: a program that special-cases the inputs it is sent (a weak-test problem, not a
harness problem: the tests' code and expected values never enter the candidate's sandbox, so it
can only guess them from the prompt); timing side channels; kernel exploits (namespaces are not
a virtual machine); in ``none`` mode, everything namespaces provide (a program that kills its
supervisor leaves its other processes running). ``RLIMIT_AS`` is per process,
so a program can hold at most ``max_processes x memory_bytes`` in total.

The records it takes and gives are :mod:`policygrad.sandbox.records`; starting and ending a worker
process is :mod:`policygrad.sandbox.launch`; the worker itself is :mod:`policygrad.sandbox.worker`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import selectors
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable

from policygrad.sandbox.launch import (
    CLEAN_ENV,
    Drain,
    bwrap_argv,
    close_fds,
    interpreter,
    kill_worker,
    readonly_paths,
    worker_program,
)
from policygrad.sandbox.records import (
    ProgramResult,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    TestResult,
    TestSpec,
)

__all__ = [
    "ISOLATION_MODES",
    "ProgramResult",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxUnavailable",
    "TestResult",
    "TestSpec",
    "available_isolation",
]

log = logging.getLogger("policygrad")

ISOLATION_MODES = ("auto", "bwrap", "namespaces", "none")
GRACE_S = 2.0  # the harness's reporting time beyond the program's wall time
# Both sandboxes must be up within this; the program's wall time starts when they are (so a
# loaded machine's slow start-up is never counted against a program).
START_TIMEOUT_S = 60.0
SETUP_FAILED = 121  # the worker's exit status when the sandbox could not be set up
# A fresh uid per sandbox when started as root: no other process (and no file) belongs to it, so
# RLIMIT_NPROC counts only this sandbox's processes and nothing outside can be signalled.
_UID_RANGE = (1 << 20, 1 << 21)
# The OS's randomness: never the global generator, which a run seeds (two runs with one seed
# would share uids) and whose stream the sandbox must not move.
_UIDS = random.SystemRandom()

_ISOLATED = "pid, net, mount, ipc, uts namespaces, read-only minimal root"
_PROBE = """
import json, os, socket
print(json.dumps({"interfaces": sorted(name for _, name in socket.if_nameindex()),
                  "uid": os.getuid(), "pid": os.getpid(), "env": sorted(os.environ),
                  "root": sorted(os.listdir("/"))}))
"""


_PROBES: dict[tuple[str, str], tuple[bool, str]] = {}
_PROBE_LOCK = threading.Lock()


class Sandbox:
    """Runs untrusted Python programs and tests them (see the module docstring).

    Args:
        isolation: ``"auto"``, ``"bwrap"``, ``"namespaces"`` or ``"none"``.
        limits: :class:`SandboxLimits` (default: 10 s, 1 GiB, 64 processes, 256 MiB written,
            1 MiB of output).

    Attributes:
        isolation: the mode in force (never ``"auto"``).
        description: one line: the mode and what it isolates.

    Raises:
        ValueError: an unknown ``isolation``.
        SandboxUnavailable: the requested isolation (for ``auto``: any) cannot be established
            here; the message says why and how to proceed.

    Thread-safe: one instance serves a pool of threads, each call in its own processes.
    """

    def __init__(self, isolation: str = "auto", limits: SandboxLimits | None = None):
        if isolation not in ISOLATION_MODES:
            raise ValueError(
                f"unknown sandbox isolation {isolation!r}; choose one of {', '.join(ISOLATION_MODES)}"
            )
        self.limits = limits if limits is not None else SandboxLimits()
        self.python = interpreter()
        self._worker_source = worker_program()
        self.isolation, self.description = self._resolve(isolation)

    # ----- isolation ------------------------------------------------------------------------
    def _resolve(self, requested: str) -> tuple[str, str]:
        if requested == "none":
            ok, detail = self._probe("none")
            if not ok:
                raise SandboxError(f"the sandbox worker does not start: {detail}")
            log.warning(
                "code sandbox: isolation=none: programs run as separate processes with resource limits only; "
                "they can read the user's files, reach the network and see other processes"
            )
            return "none", "none (separate process, resource limits only)"
        candidates = ["bwrap", "namespaces"] if requested == "auto" else [requested]
        reasons = []
        for mode in candidates:
            if mode == "bwrap" and shutil.which("bwrap") is None:
                reasons.append("bwrap: not installed (Debian/Ubuntu package bubblewrap)")
                continue
            ok, detail = self._probe(mode)
            if ok:
                return mode, f"{mode} ({detail})"
            reasons.append(f"{mode}: {detail}")
        raise SandboxUnavailable(
            f"no sandbox isolation could be established for isolation={requested!r} ("
            + "; ".join(reasons)
            + "); install bubblewrap, run as root or enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1), or set reward.code.isolation=none "
            "(policygrad eval: --isolation none) to run model-generated code without isolation (unsafe)"
        )

    def _probe(self, mode: str) -> tuple[bool, str]:
        """Run a fixed program in ``mode`` once per process; (works, description or reason)."""
        key = (mode, self.python)
        with _PROBE_LOCK:
            if key in _PROBES:
                return _PROBES[key]
        try:
            result = self._run("script", {"program": _PROBE}, mode, SandboxLimits(wall_time_s=30.0))
            facts = json.loads(result.output) if result.returncode == 0 else None
        except (OSError, ValueError, SandboxError) as exc:
            facts, result = None, None
            reason = f"{type(exc).__name__}: {exc}"
        if facts is None:
            if result is not None:
                text = result.output.strip().splitlines()
                reason = text[-1] if text else f"exit status {result.returncode}"
            outcome = (False, reason)
        elif mode != "none" and set(facts["interfaces"]) - {"lo"}:
            outcome = (False, f"network interfaces visible: {facts['interfaces']}")
        elif mode != "none" and facts["pid"] > 2:
            outcome = (False, f"no new PID namespace (pid {facts['pid']})")
        else:
            fresh = os.geteuid() == 0 and mode != "none"
            parts = [] if mode == "none" else [_ISOLATED]
            parts.append(f"uid {facts['uid']}" + (" (fresh)" if fresh else ""))
            outcome = (True, ", ".join(parts))
        with _PROBE_LOCK:
            _PROBES[key] = outcome
        return outcome

    # ----- processes ------------------------------------------------------------------------
    def _argv(self, mode: str) -> list[str]:
        prefix = []
        if mode == "bwrap":
            prefix = bwrap_argv(shutil.which("bwrap") or "bwrap", self.python, self.limits)
        return prefix + [self.python, "-I", "-S", "-B", "-c", self._worker_source]

    def _spawn(self, role: str, payload: dict, mode: str, limits: SandboxLimits, *, stdout: int,
               fds: dict[str, int], cwd: str) -> subprocess.Popen:
        spec = {
            "role": role,
            "isolation": mode,
            "limits": limits.for_worker(),
            "uid": _UIDS.randrange(*_UID_RANGE) if os.geteuid() == 0 and mode != "none" else None,
            "ro_paths": readonly_paths(self.python),
            "fds": fds,
            "start_timeout_s": START_TIMEOUT_S,
            **payload,
        }
        proc = subprocess.Popen(
            self._argv(mode),
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=stdout,
            pass_fds=tuple(fds.values()),
            env=dict(CLEAN_ENV),
            cwd=cwd,
            start_new_session=True,
        )
        try:
            proc.stdin.write(json.dumps(spec).encode())
            proc.stdin.close()
        except BrokenPipeError:  # the worker (or bwrap) died at once; its output says why
            pass
        return proc

    def _workdir(self, mode: str) -> str | None:
        return tempfile.mkdtemp(prefix="policygrad-sandbox-") if mode == "none" else None

    @staticmethod
    def _pump(drains: dict[int, Drain], until_eof: int | None, deadline: Callable[[], float]) -> bool:
        """Read the pipes until ``until_eof`` closes (or, None, all close) or ``deadline()``
        passes (re-read after every chunk); True when the deadline came first. Every pipe is
        closed on return."""
        selector = selectors.DefaultSelector()
        for fd in drains:
            selector.register(fd, selectors.EVENT_READ)
        open_fds = set(drains)
        timed_out = False
        try:
            while open_fds and (until_eof is None or until_eof in open_fds):
                left = deadline() - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in selector.select(timeout=left):
                    fd = key.fd
                    try:
                        data = os.read(fd, 65536)
                    except OSError:
                        data = b""
                    if not drains[fd].feed(data):
                        selector.unregister(fd)
                        os.close(fd)
                        open_fds.discard(fd)
        finally:
            for fd in open_fds:
                selector.unregister(fd)
                os.close(fd)
            selector.close()
        return timed_out

    def _run(self, role: str, payload: dict, mode: str, limits: SandboxLimits) -> ProgramResult:
        start = time.monotonic()
        workdir = self._workdir(mode)
        out_r, out_w = os.pipe()
        try:
            proc = self._spawn(role, payload, mode, limits, stdout=out_w, fds={}, cwd=workdir or "/")
        except BaseException:
            close_fds(out_r, out_w)
            raise
        finally:
            close_fds(out_w)
        drain = Drain(out_r, int(limits.max_output_bytes))
        try:
            timed_out = self._pump({out_r: drain}, out_r, lambda: start + limits.wall_time_s)
            if not timed_out:
                left = max(0.0, start + limits.wall_time_s - time.monotonic())
                try:
                    proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    timed_out = True
        finally:
            kill_worker(proc)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        return ProgramResult(
            returncode=None if timed_out else proc.returncode,
            output=drain.text,
            output_bytes=drain.count,
            timed_out=timed_out,
            seconds=time.monotonic() - start,
        )

    # ----- public API -----------------------------------------------------------------------
    def run(self, program: str) -> ProgramResult:
        """Run ``program`` (Python source, as ``__main__``) in the sandbox.

        Returns:
            :class:`ProgramResult`. A program that exits non-zero, crashes or runs out of time is a
            result, not an error.

        Raises:
            OSError: the interpreter (or bwrap) cannot be started.
        """
        return self._run("script", {"program": program}, self.isolation, self.limits)

    def run_tests(self, program: str, tests: TestSpec) -> TestResult:
        """Run ``tests`` against ``program`` (Python source) in two sandboxes (module docstring).

        Returns:
            :class:`TestResult`; a program that fails, cheats, crashes or hangs gets failed tests.

        Raises:
            SandboxError: a sandbox did not start (e.g. the machine refused the namespaces, or it
                is too overloaded to start a process within the wall time). Never raised because
                of anything the program does after its first line runs.
        """
        start = time.monotonic()
        limits = self.limits
        workdirs = [self._workdir(self.isolation), self._workdir(self.isolation)]
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        rep_r, rep_w = os.pipe()
        cand_out_r, cand_out_w = os.pipe()
        test_out_r, test_out_w = os.pipe()
        procs: list[subprocess.Popen] = []
        try:
            procs.append(self._spawn(
                "candidate", {"program": program}, self.isolation, limits, stdout=cand_out_w,
                fds={"req": req_r, "resp": resp_w}, cwd=workdirs[0] or "/",
            ))
            procs.append(self._spawn(
                "tests", {"tests": {"names": list(tests.names), "check": tests.check,
                                    "entry_point": tests.entry_point, "asserts": list(tests.asserts),
                                    "prelude": tests.prelude}},
                self.isolation, limits, stdout=test_out_w,
                fds={"req": req_w, "resp": resp_r, "report": rep_w}, cwd=workdirs[1] or "/",
            ))
        except BaseException:
            for proc in procs:
                kill_worker(proc)
            close_fds(rep_r, cand_out_r, test_out_r)
            raise
        finally:
            close_fds(req_r, req_w, resp_r, resp_w, rep_w, cand_out_w, test_out_w)
        drains = {
            rep_r: Drain(rep_r, 1 << 20, keep=1 << 20),  # the verdict lines, read whole
            cand_out_r: Drain(cand_out_r, int(limits.max_output_bytes)),
            test_out_r: Drain(test_out_r, int(limits.max_output_bytes)),
        }
        report = drains[rep_r]
        ready_at: list[float] = []

        def deadline() -> float:
            if not ready_at and b'"ready": true' in report.head:
                ready_at.append(time.monotonic())
            return ready_at[0] + limits.wall_time_s + GRACE_S if ready_at else start + START_TIMEOUT_S

        try:
            timed_out = self._pump(drains, rep_r, deadline)
        finally:
            for proc in procs:
                kill_worker(proc)
            for workdir in workdirs:
                if workdir:
                    shutil.rmtree(workdir, ignore_errors=True)
        return self._verdict(bytes(drains[rep_r].head), tests, timed_out, drains[cand_out_r].text,
                             drains[test_out_r].text, procs[1].returncode, time.monotonic() - start)

    @staticmethod
    def _verdict(report: bytes, tests: TestSpec, timed_out: bool, cand_output: str, test_output: str,
                 harness_status: int | None, seconds: float) -> TestResult:
        passed: dict[int, bool] = {}
        errors: dict[int, str] = {}
        ready = False
        for line in report.decode("utf-8", "replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if "setup_error" in record:
                raise SandboxError(f"{record['setup_error']}; its output: {cand_output.strip()[-500:]!r}")
            if record.get("ready") is True:
                ready = True
            test = record.get("test")
            if isinstance(test, int) and not isinstance(test, bool) and 0 <= test < tests.total:
                passed[test] = record.get("passed") is True
                if record.get("error"):
                    errors[test] = str(record["error"])
        if not ready:
            why = "timed out" if timed_out else f"exit status {harness_status}"
            raise SandboxError(
                f"the test harness's sandbox did not start ({why}); "
                f"its output: {test_output.strip()[-500:]!r}"
            )
        count = sum(1 for i in range(tests.total) if passed.get(i))
        failures = tuple(
            errors.get(i, "no verdict (time limit reached)" if timed_out else "no verdict")
            for i in range(tests.total) if not passed.get(i)
        )
        return TestResult(count, tests.total, timed_out, failures, cand_output, seconds)


def available_isolation() -> dict[str, str]:
    """Which isolation modes work on this machine: mode -> description, for modes that do."""
    out = {}
    for mode in ("bwrap", "namespaces"):
        try:
            out[mode] = Sandbox(mode).description
        except SandboxUnavailable:
            continue
    return out
