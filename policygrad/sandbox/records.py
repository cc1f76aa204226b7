"""What the code sandbox takes and gives (:mod:`policygrad.sandbox.runner`): its errors, the
per-program limits (:class:`SandboxLimits`), the tests of a program (:class:`TestSpec`) and the
results of a run (:class:`ProgramResult`) and of a test run (:class:`TestResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["ProgramResult", "SandboxError", "SandboxLimits", "SandboxUnavailable", "TestResult", "TestSpec"]


class SandboxError(OSError):
    """The sandbox itself failed (it did not start, or its harness broke): not the program's fault.
    An ``OSError``: the machine refused or could not run a process as asked (the CLI shows it as
    one ``error:`` line)."""


class SandboxUnavailable(SandboxError):
    """No isolation of the requested kind can be established on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits.

    Attributes:
        wall_time_s: seconds for the program: for :meth:`Sandbox.run`, from its start; for
            :meth:`Sandbox.run_tests`, from the moment both sandboxes are up (start-up may take up
            to 60 s on a loaded machine) to the last test's verdict. Then everything is killed.
        cpu_time_s: CPU seconds per process (``RLIMIT_CPU``); None: ``wall_time_s``.
        memory_bytes: address space per process (``RLIMIT_AS``).
        max_processes: processes and threads of the program (``RLIMIT_NPROC``; with a fresh uid
            per sandbox, as root, they are the program's own; otherwise the user's processes
            count too, so in ``none`` mode as a normal user a program may not be able to fork).
        max_write_bytes: the largest file the program may write (``RLIMIT_FSIZE``) and, with
            namespaces or bwrap, the size of its only writable filesystem.
        max_output_bytes: stdout + stderr read before the pipe is closed (the rest is never read).
    """

    wall_time_s: float = 10.0
    cpu_time_s: float | None = None
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_write_bytes: int = 256 << 20
    max_output_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("wall_time_s", "memory_bytes", "max_processes", "max_write_bytes", "max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limit {name} must be a positive number, got {value!r}")
        if self.cpu_time_s is not None and not self.cpu_time_s > 0:
            raise ValueError(f"sandbox limit cpu_time_s must be positive or None, got {self.cpu_time_s!r}")
        if self.memory_bytes < 64 << 20:
            raise ValueError(
                f"sandbox limit memory_bytes={self.memory_bytes} is below the 64 MiB an interpreter needs"
            )

    def for_worker(self) -> dict:
        """The limits as the worker's spec holds them (``cpu_time_s`` filled in)."""
        out = asdict(self)
        out["cpu_time_s"] = self.cpu_time_s if self.cpu_time_s is not None else self.wall_time_s
        return out


@dataclass(frozen=True)
class ProgramResult:
    """What :meth:`Sandbox.run` saw: ``returncode`` (None when killed at the time limit; negative:
    killed by that signal), the first 4 KiB of the output and its total size in bytes (counted up
    to ``max_output_bytes``), whether the wall time ran out, and the seconds taken."""

    returncode: int | None
    output: str
    output_bytes: int
    timed_out: bool
    seconds: float


@dataclass(frozen=True)
class TestSpec:
    """The tests of one program, run in the harness sandbox.

    Attributes:
        names: the program's functions the tests may call (each becomes a proxy in the harness).
        check: HumanEval's test code, defining ``check(candidate)``; called with the proxy of
            ``entry_point``. Counts as one test.
        entry_point: the function ``check`` receives.
        asserts: statements run one by one (each a test), e.g. ``"assert add(2, 3) == 5"``.
        prelude: code run in the harness before the tests (HumanEval's prompt: the helpers it
            defines belong to the tests, not to the program).
    """

    __test__ = False  # not a pytest class

    names: tuple[str, ...]
    check: str | None = None
    entry_point: str | None = None
    asserts: tuple[str, ...] = ()
    prelude: str | None = None

    def __post_init__(self):
        if self.check and not self.entry_point:
            raise ValueError("a TestSpec with check code needs entry_point (the function check receives)")
        if not self.check and not self.asserts:
            raise ValueError("a TestSpec needs check code or at least one assert statement")

    @property
    def total(self) -> int:
        return (1 if self.check else 0) + len(self.asserts)


@dataclass(frozen=True)
class TestResult:
    """The verdict on one program: ``passed`` of ``total`` tests passed (a test counts only when
    the harness reported it passed), ``timed_out`` when the wall time ran out first, ``errors``
    (per failed test, in order: its message), the head of the program's output and the seconds
    taken. ``all_passed`` is the binary verdict."""

    __test__ = False  # not a pytest class

    passed: int
    total: int
    timed_out: bool
    errors: tuple[str, ...] = field(default=())
    output: str = ""
    seconds: float = 0.0

    @property
    def all_passed(self) -> bool:
        return self.total > 0 and self.passed == self.total
