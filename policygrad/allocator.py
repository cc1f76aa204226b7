"""The memory allocator of the ``policygrad`` command: tcmalloc (or jemalloc) preloaded when the
machine has it.

A training step allocates and frees the same large tensors over and over: activations, the
bf16 copies autocast makes of every weight in each forward, the dense embedding gradient of
each micro-batch. glibc's malloc serves blocks above its mmap threshold (at most 32 MiB) with
fresh ``mmap`` calls and unmaps them on free, so each such tensor page-faults anew on first touch
(millions of minor faults per run, about 8 % of it in the kernel). tcmalloc and jemalloc keep
freed memory for reuse. vLLM's CPU backend recommends preloading tcmalloc for the same reason.
Measured on the grpo_vs_trl step (``benchmarks/levers.py``, the ``allocator`` lever):
tcmalloc took the step from 18.6 s to 11.8 s, jemalloc to 16.7 s, glibc told by ``mallopt`` to
keep its memory to 17.8 s.

An allocator can only be chosen before the process starts (``LD_PRELOAD``), so the command
re-executes itself once, the same interpreter with the same arguments, with the library
prepended to ``LD_PRELOAD``. ``POLICYGRAD_ALLOCATOR`` chooses: ``auto`` (default: tcmalloc if
installed, else jemalloc, else the system's), ``tcmalloc``, ``jemalloc`` (an error when not
installed) or ``system`` (no preload). On Debian/Ubuntu: ``apt install libtcmalloc-minimal4``
(or ``libjemalloc2``). Only the command line does this; ``import policygrad`` never touches the
process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "ALLOCATORS",
    "ENV",
    "LIBRARIES",
    "find_library",
    "plan_preload",
    "preload_and_reexec",
    "preloaded",
]

ENV = "POLICYGRAD_ALLOCATOR"
"""Environment variable that chooses the allocator (``auto``, ``tcmalloc``, ``jemalloc``, ``system``)."""

ALLOCATORS = ("auto", "tcmalloc", "jemalloc", "system")

# Set for the re-executed process (it must never re-execute again), with the LD_PRELOAD it had
# before; it restores that and drops both, so the processes it starts (reward workers, sandboxed
# programs, whose file systems may lack the library) inherit the user's environment unchanged.
_DONE_ENV = "POLICYGRAD_ALLOCATOR_PRELOADED"
_ORIGINAL_ENV = "POLICYGRAD_ALLOCATOR_ORIGINAL_LD_PRELOAD"
_preloaded: str | None = None

LIBRARIES: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"),
    "jemalloc": ("libjemalloc.so.2",),
}
"""Shared-library file names of each allocator, the preferred first."""

_LIB_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
)


def find_library(name: str, exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """The path of allocator ``name``'s shared library in the usual folders, or None."""
    for filename in LIBRARIES[name]:
        for folder in _LIB_DIRS:
            path = os.path.join(folder, filename)
            if exists(path):
                return path
    return None


def preloaded_allocator(
    ld_preload: str, realpath: Callable[[str], str] = os.path.realpath
) -> tuple[str, str] | None:
    """The allocator an ``LD_PRELOAD`` value already loads.

    Any build counts (``libtcmalloc_minimal``, ``libtcmalloc``, ``libtcmalloc_debug``,
    ``libjemalloc``, whatever the version suffix), by the entry's file name or by the file a
    symbolic link points to. Entries are separated by spaces or colons, as the dynamic loader reads
    them.

    Returns:
        ``(name, entry)``: the allocator's key in :data:`LIBRARIES` and the ``LD_PRELOAD`` entry
        that loads it; None when no entry is one. Raises nothing (a missing file is only a name).
    """
    for entry in ld_preload.replace(":", " ").split():
        for candidate in (entry, realpath(entry)):
            base = os.path.basename(candidate)
            for name in LIBRARIES:
                if base.startswith(f"lib{name}"):
                    return name, entry
    return None


def plan_preload(
    env: Mapping[str, str], platform: str, find: Callable[[str], str | None] | None = None
) -> str | None:
    """What the command should do about its allocator.

    Args:
        env: the process environment.
        platform: ``sys.platform`` (only ``linux`` preloads).
        find: allocator name -> library path or None (default :func:`find_library`, looked up
            when called, so the machine's libraries are read then).

    Returns:
        The library to preload and re-execute with; None: run as is.

    Raises:
        ValueError: ``POLICYGRAD_ALLOCATOR`` is not one of :data:`ALLOCATORS`, names an
            allocator that is not installed, or names another than the one ``LD_PRELOAD`` already
            loads.
    """
    choice = (env.get(ENV) or "auto").strip().lower()
    if choice not in ALLOCATORS:
        raise ValueError(f"{ENV}={choice!r} is not valid; choose one of {', '.join(ALLOCATORS)}")
    if choice == "system" or env.get(_DONE_ENV) or platform != "linux":
        return None
    users = preloaded_allocator(env.get("LD_PRELOAD", ""))
    if users is not None:  # the user chose one already
        kind, path = users
        if choice not in ("auto", kind):
            raise ValueError(
                f"{ENV}={choice} but LD_PRELOAD already loads {kind} ({path}); remove one of the two"
            )
        return None
    find = find or find_library
    names = ("tcmalloc", "jemalloc") if choice == "auto" else (choice,)
    for name in names:
        path = find(name)
        if path is not None:
            return path
    if choice != "auto":
        package = "libtcmalloc-minimal4" if choice == "tcmalloc" else "libjemalloc2"
        raise ValueError(
            f"{ENV}={choice}: its library is not installed (Debian/Ubuntu: apt install {package}); "
            f"or set {ENV}=auto"
        )
    return None


def preload_and_reexec(
    argv: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    execve: Callable[..., object] = os.execve,
) -> None:
    """Re-execute this command with the allocator :func:`plan_preload` picks (returns only when
    nothing is to be done). Called first thing by the ``policygrad`` entry points.

    In the re-executed process it returns at once, after putting ``LD_PRELOAD`` back as the
    user had it (:func:`preloaded` then names the library).

    Args:
        argv: the interpreter's own command line (default ``sys.orig_argv``: the same flags,
            ``-m policygrad`` or the script, and the arguments).
        env: the environment (default ``os.environ``).
        execve: ``os.execve`` (replaced in tests).

    Raises:
        ValueError: as :func:`plan_preload`.
    """
    global _preloaded
    if env is None and _DONE_ENV in os.environ:  # this is the re-executed process
        _preloaded = os.environ.pop(_DONE_ENV)
        original = os.environ.pop(_ORIGINAL_ENV, "")
        if original:
            os.environ["LD_PRELOAD"] = original
        else:
            os.environ.pop("LD_PRELOAD", None)
        return
    env = dict(os.environ if env is None else env)
    library = plan_preload(env, sys.platform)
    argv = list(getattr(sys, "orig_argv", []) if argv is None else argv)
    if library is None or not argv or not sys.executable or _program_from_stdin(argv):
        return
    original = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = " ".join(p for p in (library, original) if p)
    env[_DONE_ENV] = library
    env[_ORIGINAL_ENV] = original
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:  # could not re-execute (a sandbox forbidding exec, ...): run on, as is
        return


def _program_from_stdin(argv: Sequence[str]) -> bool:
    """Whether the interpreter read its program from stdin (``python -``, ``cmd | python``): a
    re-executed one would find stdin consumed and run nothing."""
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", "<stdin>") != "<stdin>" or getattr(main, "__spec__", None) is not None:
        return False  # a script or -m
    return "-c" not in argv[1:]


def preloaded() -> str | None:
    """The allocator library this process was re-executed with (None: the system's)."""
    return _preloaded
