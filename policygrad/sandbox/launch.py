"""Starting and ending a sandbox worker process (:mod:`policygrad.sandbox.runner` uses these): the
program it runs (:func:`worker_program`, built by :func:`modules_program`), the interpreter and
the read-only paths it needs, the bubblewrap command line, the reading of its output pipe with a
cap (:class:`Drain`), and the end of the worker and everything it started (:func:`kill_worker`).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

from policygrad.sandbox.records import SandboxLimits

__all__ = [
    "CLEAN_ENV",
    "KEPT_OUTPUT_BYTES",
    "WORKER_MODULES",
    "Drain",
    "bwrap_argv",
    "close_fds",
    "interpreter",
    "kill_worker",
    "modules_program",
    "readonly_paths",
    "worker_program",
]

log = logging.getLogger("policygrad")

KEPT_OUTPUT_BYTES = 4096  # the head of a program's output kept in results, for diagnostics
CLEAN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
# The worker's modules, each after those it imports; the sandbox has none of the package's files,
# so the worker program carries their source.
WORKER_MODULES = ("procfs", "wire", "confine", "worker")

# Runs each module's source as that module: registered in sys.modules under its name, in empty
# stand-ins of its packages, so its imports of the modules before it find them. Nothing else of
# the package is imported, and none of its files exists in the sandbox.
_INSTALL = """\
import sys, types
def _install(sources):
    for name in ("policygrad", "policygrad.sandbox"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    for name, filename, source in sources:
        module = types.ModuleType(name)
        module.__file__ = filename
        sys.modules[name] = module
        exec(compile(source, filename, "exec"), module.__dict__)
        parent, _, leaf = name.rpartition(".")
        setattr(sys.modules[parent], leaf, module)
_install(SOURCES)
"""


def modules_program(leaves: Sequence[str]) -> str:
    """A ``python -c`` program that runs the source of ``policygrad.sandbox.<leaf>`` for each of
    ``leaves`` (each after the ones it imports; read from this package's files now) as that
    module, without the package: standard-library modules run in a bare interpreter
    (``python -I -S``). Code appended to the program finds them in ``sys.modules``."""
    here = os.path.dirname(os.path.abspath(__file__))
    sources = []
    for leaf in leaves:
        with open(os.path.join(here, f"{leaf}.py"), encoding="utf-8") as handle:
            sources.append((f"policygrad.sandbox.{leaf}", f"policygrad/sandbox/{leaf}.py", handle.read()))
    return _INSTALL.replace("SOURCES", repr(sources))


def worker_program() -> str:
    """The ``python -c`` program of a sandbox worker: :data:`WORKER_MODULES` installed by
    :func:`modules_program`, then :func:`policygrad.sandbox.worker.main`."""
    return modules_program(WORKER_MODULES) + 'sys.modules["policygrad.sandbox.worker"].main()\n'


def interpreter() -> str:
    """The interpreter the sandbox runs: this one's real file (a venv's python is a symlink)."""
    return os.path.realpath(sys.executable)


def readonly_paths(python: str) -> list[str]:
    """The system paths a sandbox binds read-only for ``python``: ``/usr``, ``/bin``, the ``/lib``s
    and the interpreter's prefixes (those that exist)."""
    paths = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
    for prefix in {sys.base_prefix, sys.base_exec_prefix, os.path.dirname(os.path.dirname(python))}:
        if prefix and prefix not in ("/", "") and not any(prefix.startswith(p + "/") for p in ("/usr",)):
            paths.append(os.path.realpath(prefix))
    return [p for p in dict.fromkeys(paths) if os.path.lexists(p)]


def bwrap_argv(bwrap: str, python: str, limits: SandboxLimits) -> list[str]:
    """The bubblewrap command line (up to its ``--``) that starts ``python`` in the sandbox."""
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL"]
    if os.geteuid() == 0:
        # Kept only until the worker has switched to its fresh uid (which clears every capability).
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user"]
    made: set[str] = set()
    for path in readonly_paths(python):
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
            continue
        # bwrap would copy the modes of missing parents (/root is 0700): the fresh uid could not
        # reach the interpreter's prefix below them. Make them 0755.
        parent = os.path.dirname(path)
        ancestors = []
        while parent not in ("/", "") and parent not in made:
            ancestors.append(parent)
            parent = os.path.dirname(parent)
        for directory in reversed(ancestors):
            argv += ["--perms", "0755", "--dir", directory]
            made.add(directory)
        argv += ["--ro-bind", path, path]
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        argv += ["--ro-bind-try", path, path]
    argv += ["--dev", "/dev", "--proc", "/proc",
             "--perms", "1777", "--size", str(int(limits.max_write_bytes)), "--tmpfs", "/sandbox",
             "--symlink", "sandbox", "/tmp", "--chdir", "/sandbox", "--clearenv"]
    for key, value in CLEAN_ENV.items():
        argv += ["--setenv", key, value]
    return argv + ["--"]




class Drain:
    """Reads a program's output pipe: counts bytes up to a cap, keeps the first 4 KiB, then closes
    the pipe (the program's later writes fail) so nothing more is read or buffered."""

    def __init__(self, fd: int, cap: int, keep: int = KEPT_OUTPUT_BYTES):
        self.fd, self.cap, self.keep = fd, cap, keep
        self.head = bytearray()
        self.count = 0

    def feed(self, data: bytes) -> bool:
        """Take one chunk; False when the pipe should be closed (EOF or the cap reached)."""
        if not data:
            return False
        self.count += len(data)
        if len(self.head) < self.keep:
            self.head += data[: self.keep - len(self.head)]
        return self.count < self.cap

    @property
    def text(self) -> str:
        return bytes(self.head).decode("utf-8", "replace")


def kill_worker(proc: subprocess.Popen) -> None:
    """End a worker and everything it started, and reap it: SIGTERM to its supervisor (which
    SIGKILLs its child, the sandbox's PID 1, whose death takes the PID namespace down, and reaps
    it; in ``none`` mode, the program's process, then every process it left behind), then SIGKILL
    to the whole process group for whatever is left (``none`` mode, bwrap)."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=2)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # a process in uninterruptible sleep; the kernel will finish it
        log.warning("sandbox process %d did not exit after SIGKILL", proc.pid)


def close_fds(*fds: int) -> None:
    """Close each of ``fds``, ignoring those already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
