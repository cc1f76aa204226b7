"""The ``code_tests`` reward: a completion's program run against its row's tests in the sandbox.

Protocol (every reward's): ``fn(prompts, completions, **row_fields) -> list[float]``. For each
completion:

1. the program is the last fenced Python block of the completion (```` ```python ````,
   ```` ```py ```` or an untagged fence; an unclosed last fence counts), else the whole text
   (:func:`extract_program`);
2. with a HumanEval-style row (``test`` defining ``check(candidate)`` and ``entry_point``), the
   row's code prompt (``stub``, else the prompt itself) comes first: a completion that defines
   ``entry_point`` is appended to it (the stub's imports and helpers stay available), one that
   does not is the function's body and is joined to it, as HumanEval does (:func:`build_program`);
3. the tests run in :meth:`policygrad.sandbox.runner.Sandbox.run_tests`: HumanEval's ``check``
   (one test) and/or the row's ``tests`` (a list of statements such as ``"assert add(2, 3) ==
   5"``, one test each); the stub runs on the tests' side as well, since its helpers belong to
   the tests;
4. the score is 1.0 when every test passes, else 0.0; with ``partial=True`` the fraction passing.

Row fields read: ``test`` (str), ``entry_point`` (str, or a list of names), ``tests`` (list of
str), ``stub`` (str). A row with neither ``tests`` nor ``test`` + ``entry_point`` is an error
(``ValueError`` naming the fields). The functions the tests may call are ``entry_point`` and,
for ``tests``, the names the statements use but neither define nor get from the built-ins or
the stub (:func:`called_names`): built-ins are never replaced by the program's functions.

The programs of a batch run concurrently in a bounded thread pool (``workers``), two sandboxes
each; see :mod:`policygrad.sandbox.runner` for the isolation, the limits and the threat model.
"""

from __future__ import annotations

import ast
import builtins
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from policygrad.rewards.verifiers import answer_correctness
from policygrad.sandbox.runner import Sandbox, SandboxLimits, TestResult, TestSpec

__all__ = [
    "CodeTests",
    "TaskReward",
    "build_program",
    "called_names",
    "code_tests",
    "configure_code_rewards",
    "extract_program",
    "is_code_row",
    "spec_for_row",
]

log = logging.getLogger("policygrad")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = ("python", "python3", "py", "")


def extract_program(completion: str) -> str:
    """The last fenced Python block of ``completion`` (tag ``python``, ``python3``, ``py`` or
    none; a last fence left open runs to the end), else the whole text.

    >>> extract_program("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    """
    blocks = [body for tag, body in _FENCE.findall(completion) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else completion


def _defines(code: str, name: str) -> bool:
    """Whether ``code`` defines ``name`` at top level (a def, a class or an assignment)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return re.search(rf"^(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
    return False


def _compiles(code: str) -> bool:
    try:
        compile(code, "program.py", "exec")
    except (SyntaxError, ValueError):
        return False
    return True


def build_program(completion: str, *, stub: str | None = None, entry_point: str | None = None) -> str:
    """The program to test for one completion (see the module docstring, step 2).

    Args:
        completion: the model's text.
        stub: the code the completion continues (HumanEval's prompt), or None.
        entry_point: the function the tests call (HumanEval), or None.

    Returns:
        Python source: the extracted program; with a stub, ``stub + body`` when the program does
        not define ``entry_point``, else ``stub + "\\n" + program`` (or the program alone when
        that combination does not compile but the program does).
    """
    code = extract_program(completion)
    if not stub or not entry_point:
        return code
    if not _defines(code, entry_point):
        return stub + code
    joined = stub.rstrip("\n") + "\n\n\n" + code
    return joined if _compiles(joined) or not _compiles(code) else code


def _bound_names(tree: ast.AST) -> set[str]:
    """Names a piece of code binds: assignments, defs, classes, imports, loop and with targets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def called_names(tests: Sequence[str], prelude: str | None = None) -> list[str]:
    """The program's functions a list of test statements uses: names read by the tests that the
    tests do not bind themselves and that are neither built-ins nor bound by ``prelude``.

    >>> called_names(["assert add(1, 2) == 3", "x = sq(2)\\nassert x == len([1, 2, 3, 4])"])
    ['add', 'sq']

    Raises:
        ValueError: a test statement that is not valid Python (the message quotes it).
    """
    read: list[str] = []
    bound: set[str] = set(dir(builtins))
    if prelude:
        try:
            bound |= {n for n in _bound_names(ast.parse(prelude))}
        except SyntaxError:
            pass
    for text in tests:
        try:
            tree = ast.parse(text)
        except SyntaxError as exc:
            raise ValueError(
                f"test {text[:80]!r} is not valid Python ({exc.msg}); fix the row's tests"
            ) from None
        bound |= _bound_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in read:
                read.append(node.id)
    return [name for name in read if name not in bound]


def _field(row_fields: dict, key: str, i: int):
    values = row_fields.get(key)
    return None if values is None else values[i]


def _test_list(tests) -> list:
    """A row's ``tests`` as a list: one string is one test, None or blank is none."""
    if tests is None:
        return []
    if isinstance(tests, str):
        return [tests] if tests.strip() else []
    return list(tests)


def is_code_row(row: dict) -> bool:
    """Whether a dataset row carries code tests: a non-empty ``tests`` (a list of assert
    statements, or one string: one test) or a non-empty ``test`` (HumanEval's check code, or
    assert code). The fields :func:`spec_for_row` reads tests from, so a row that ``code_tests``
    trains on is also evaluated by its tests, never by an ``answer`` it may carry."""
    test = row.get("test")
    return bool(_test_list(row.get("tests"))) or (isinstance(test, str) and bool(test.strip()))


def spec_for_row(
    *,
    test: str | None = None,
    entry_point: str | Sequence[str] | None = None,
    tests: Sequence[str] | None = None,
    stub: str | None = None,
    prompt: str | None = None,
) -> TestSpec:
    """The :class:`~policygrad.sandbox.runner.TestSpec` of one row (module docstring).

    Args:
        test: HumanEval's test code (defining ``check``), or assert code without ``check``.
        entry_point: the tested function (a name, or a list of names).
        tests: assert statements, one test each.
        stub: the row's code prompt; for HumanEval rows without one, ``prompt`` is the stub.
        prompt: the row's prompt.

    Raises:
        ValueError: no tests in the row, a non-string test, ``check`` code without an entry point,
            or a test that is not valid Python; the message names the field.
    """
    asserts = _test_list(tests)
    if isinstance(test, str) and not test.strip():
        test = None  # blank, as is_code_row reads it
    if any(not isinstance(t, str) for t in asserts):
        raise ValueError("row field 'tests' must be a list of strings (assert statements)")
    entries = [entry_point] if isinstance(entry_point, str) else list(entry_point or [])
    check = None
    if test:
        if not isinstance(test, str):
            raise ValueError(f"row field 'test' must be a string of Python code, got {type(test).__name__}")
        if re.search(r"^def\s+check\s*\(", test, re.MULTILINE):
            if not entries:
                raise ValueError("row field 'test' defines check(candidate) but the row has no 'entry_point'")
            check = test
            stub = stub if stub is not None else prompt
        else:
            asserts.insert(0, test)
    if check is None and not asserts:
        raise ValueError(
            "the row has no tests: give 'tests' (a list of assert statements) or 'test' (HumanEval's "
            "check code) with 'entry_point'"
        )
    prelude = stub if stub and _compiles(stub) else None
    names = list(dict.fromkeys(entries + called_names(asserts, prelude)))
    return TestSpec(names=tuple(names), check=check, entry_point=entries[0] if check else None,
                    asserts=tuple(asserts), prelude=prelude)


class CodeTests:
    """The ``code_tests`` reward with its sandbox (see the module docstring).

    Args:
        isolation: the sandbox's isolation (``auto``, ``bwrap``, ``namespaces``, ``none``).
        partial: score the fraction of passing tests instead of all-or-nothing.
        timeout_s: wall seconds per program (all its tests); CPU seconds per process likewise.
        memory_mb: address space per process, MiB.
        max_processes: processes and threads per program.
        max_write_mb: the most a program may write, MiB.
        max_output_kb: a program's output read before its pipe is closed, KiB.
        workers: programs run at once; 0: twice the number of CPUs, at most 16.

    Raises:
        ValueError: a bad option (named).
        SandboxUnavailable: no isolation of the requested kind here (the message says what to do).

    Calling it scores a batch: ``(prompts, completions, **row_fields) -> list[float]``; a row
    without tests raises ``ValueError``; a sandbox that fails to start raises ``SandboxError``.
    :meth:`results` returns the :class:`~policygrad.sandbox.runner.TestResult` of each row.
    """

    def __init__(self, *, isolation: str = "auto", partial: bool = False, timeout_s: float = 10.0,
                 memory_mb: int = 1024, max_processes: int = 64, max_write_mb: int = 256,
                 max_output_kb: int = 1024, workers: int = 0):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"code reward workers must be a non-negative int (0: auto), got {workers!r}")
        limits = SandboxLimits(
            wall_time_s=float(timeout_s),
            memory_bytes=int(memory_mb) << 20,
            max_processes=int(max_processes),
            max_write_bytes=int(max_write_mb) << 20,
            max_output_bytes=int(max_output_kb) << 10,
        )
        self.partial = bool(partial)
        self.sandbox = Sandbox(isolation, limits)
        # Each program is two interpreters that mostly start up and wait on each other: twice the
        # CPU count keeps the cores busy (benchmarks/README.md).
        self.workers = workers or min(16, 2 * (os.cpu_count() or 1))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.__name__ = "code_tests"
        log.info(
            "code sandbox: isolation=%s; limits: %.0f s wall, %d MiB memory, %d processes, %d MiB written, "
            "%d KiB output; %d programs at a time",
            self.sandbox.description, limits.wall_time_s, memory_mb, max_processes, max_write_mb,
            max_output_kb, self.workers,
        )

    def _map(self, fn: Callable, items: list) -> list:
        if len(items) <= 1:
            return [fn(item) for item in items]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="policygrad-sandbox")
        return list(self._pool.map(fn, items))

    def results(
        self, prompts: Sequence[str], completions: Sequence[str], **row_fields: Any
    ) -> list[TestResult]:
        """Run every completion's program against its row's tests; one TestResult per row."""
        n = len(completions)
        if prompts is not None and len(prompts) != n:
            raise ValueError(f"code_tests: {len(prompts)} prompts but {n} completions; pass one per prompt")
        jobs = []
        for i in range(n):
            fields = {key: _field(row_fields, key, i) for key in ("test", "entry_point", "tests", "stub")}
            try:
                spec = spec_for_row(**fields, prompt=prompts[i] if prompts is not None else None)
            except ValueError as exc:
                raise ValueError(f"code_tests: row {i}: {exc}") from None
            stub = fields["stub"]
            if stub is None and spec.check and prompts is not None:
                stub = prompts[i]  # HumanEval's own rows: the prompt is the code to continue
            entries = fields["entry_point"]
            entry = entries if isinstance(entries, str) else (entries[0] if entries else None)
            jobs.append((build_program(str(completions[i]), stub=stub, entry_point=entry), spec))
        return self._map(lambda job: self.sandbox.run_tests(*job), jobs)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], *, partial: bool | None = None,
                 **row_fields: Any) -> list[float]:
        partial = self.partial if partial is None else bool(partial)
        scores = []
        for result in self.results(prompts, completions, **row_fields):
            if partial:
                scores.append(result.passed / result.total)
            else:
                scores.append(1.0 if result.all_passed else 0.0)
        return scores

    def close(self) -> None:
        """Stop the thread pool (the sandbox processes of a call always end with the call)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __repr__(self) -> str:
        return (
            f"CodeTests(isolation={self.sandbox.isolation!r}, partial={self.partial}, "
            f"workers={self.workers})"
        )


_DEFAULT: CodeTests | None = None
_DEFAULT_LOCK = threading.Lock()


def code_tests(prompts: Sequence[str], completions: Sequence[str], **row_fields: Any) -> list[float]:
    """The built-in ``code_tests`` reward with the default sandbox (``isolation="auto"``, 10 s,
    1 GiB, 64 processes, 256 MiB written); ``partial=True`` scores the fraction of passing tests.
    A run configures its own instance from ``reward.code`` (:class:`CodeTests`).

    Returns:
        one score per completion, in [0, 1].

    Raises:
        ValueError: a row without tests. SandboxUnavailable: no isolation on this machine.
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = CodeTests()
    return _DEFAULT(prompts, completions, **row_fields)


class TaskReward:
    """The verifier a dataset's rows call for, for evaluation: ``code_tests`` on code rows
    (:func:`is_code_row`), ``answer_correctness`` on the others, row by row.

    Args:
        code_options: keyword arguments of :class:`CodeTests` (the run's ``reward.code``); the
            sandbox is built on the first code row, so evaluating arithmetic needs none.
    """

    functions = ("code_tests", "answer_correctness")
    """The built-in rewards it applies, as ``reward.functions`` names them."""

    def __init__(self, code_options: dict | None = None):
        self.code_options = dict(code_options or {})
        self._code: CodeTests | None = None
        self.__name__ = "task_reward"

    @property
    def code(self) -> CodeTests:
        if self._code is None:
            self._code = CodeTests(**self.code_options)
        return self._code

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **row_fields: Any) -> list[float]:
        n = len(completions)
        rows = [{key: values[i] for key, values in row_fields.items()} for i in range(n)]
        code_rows = [i for i in range(n) if is_code_row(rows[i])]
        other = [i for i in range(n) if i not in set(code_rows)]
        scores = [0.0] * n
        for subset, fn in ((code_rows, self.code if code_rows else None), (other, answer_correctness)):
            if not subset:
                continue
            fields = {key: [values[i] for i in subset] for key, values in row_fields.items()}
            out = fn([prompts[i] for i in subset], [completions[i] for i in subset], **fields)
            for i, score in zip(subset, out):
                scores[i] = float(score)
        return scores


def configure_code_rewards(specs: Sequence, options: dict) -> list:
    """Replace every ``"code_tests"`` entry of a reward-function list by one :class:`CodeTests`
    built with ``options`` (a run's ``reward.code``); other entries are returned unchanged.

    Raises:
        ValueError, SandboxUnavailable: as :class:`CodeTests`.
    """
    if not any(isinstance(s, str) and s.strip() == "code_tests" for s in specs):
        return list(specs)
    reward = CodeTests(**options)
    return [reward if isinstance(s, str) and s.strip() == "code_tests" else s for s in specs]
