"""``builtin:code_feedback``: write a function, see the visible tests that fail, fix it, repeat.

Multi-turn code repair with execution feedback, in the spirit of Self-Debugging (Chen et al.
2023) and RLEF (Gehring et al. 2024): each turn's program (:func:`policygrad.rewards.code.
build_program`: the last fenced block, joined to a HumanEval stub) runs against the row's
*visible* tests in the sandbox; when they all pass the episode is done, otherwise the next user
message lists the failing visible tests and their errors. The final reward comes from the
*hidden* tests, run once on the last program, so the feedback never shows what is scored.

Which tests are which (rows of ``builtin:code``, HumanEval, or any row
:func:`policygrad.rewards.code.spec_for_row` reads):

* a row with assert statements (``tests``; assert code in ``test``): the first half of them
  (at least one) are visible, the rest hidden. A row with one assert has nothing left to hide:
  its hidden test is that assert (the final reward then repeats the visible verdict).
* HumanEval (``test`` defining ``check(candidate)``, one test with no parts to split): the check
  is both the visible and the hidden test; the feedback shows only its first error (the type
  and message of the exception, e.g. ``AssertionError`` with whatever text the check gives, never
  the check's code), so the hidden test's content stays hidden but its verdict does not. With
  both asserts and a check, the check is hidden with the remaining asserts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from policygrad.envs.base import Environment, StepResult
from policygrad.envs.tools import shared_sandbox
from policygrad.rewards.code import build_program, spec_for_row
from policygrad.sandbox.runner import SandboxLimits, TestResult, TestSpec

__all__ = ["CodeFeedbackEnv", "split_tests", "visible_count"]

_LABEL = re.compile(r"^AssertionError: \[visible (\d+)\] ", re.DOTALL)
_MAX_ERROR_CHARS = 300
_MAX_TEST_CHARS = 200


def _labelled(index: int, source: str) -> str:
    """A visible test that names itself when it fails: the harness reports errors in order but
    not which test each belongs to. The test's code runs unchanged, by ``exec`` in the test's own
    namespace (the proxies of the program's functions are there)."""
    return (
        f"_source = {source!r}\n"
        "try:\n"
        "    exec(compile(_source, 'test.py', 'exec'), globals())\n"
        "except BaseException as _exc:\n"
        "    _text = type(_exc).__name__ + (': ' + str(_exc) if str(_exc) else '')\n"
        f"    raise AssertionError('[visible {index}] ' + _text) from None\n"
    )


def visible_count(n: int) -> int:
    """How many of a row's ``n`` asserts are visible: the first half, at least one."""
    return max(1, n // 2)


def split_tests(spec: TestSpec) -> tuple[TestSpec, TestSpec]:
    """``(visible, hidden)`` tests of a row's :class:`TestSpec` (module docstring); the visible
    asserts are labelled so that their failures can be told apart.

    Raises:
        ValueError: a spec without tests (as :class:`TestSpec`).
    """
    asserts = spec.asserts
    if not asserts:  # HumanEval: one check, both visible and hidden
        return spec, spec
    k = visible_count(len(asserts))
    visible = TestSpec(names=spec.names, asserts=tuple(_labelled(i, a) for i, a in enumerate(asserts[:k])),
                       prelude=spec.prelude)
    hidden_asserts = asserts[k:]
    if not hidden_asserts and not spec.check:
        hidden_asserts = asserts  # one assert: nothing is left to hide
    hidden = TestSpec(names=spec.names, check=spec.check, entry_point=spec.entry_point,
                      asserts=tuple(hidden_asserts), prelude=spec.prelude)
    return visible, hidden


def _cut(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CodeFeedbackEnv(Environment):
    """Code with test feedback over several turns (module docstring).

    Args:
        isolation: the sandbox's isolation: ``"auto"`` (bwrap, else namespaces; an error when
            neither works), ``"bwrap"``, ``"namespaces"``, or ``"none"`` (no isolation; unsafe).
        timeout_s: wall seconds per program run (all its tests), CPU seconds likewise.
        partial_credit: the final reward is the fraction of hidden tests passed instead of 1.0
            when all pass, else 0.0.
        memory_mb: address space per sandbox process, MiB.
        max_feedback_chars: the feedback message is cut to this many characters.

    Raises:
        ValueError: a bad option; at :meth:`reset`, a row without tests (names the fields).
        SandboxUnavailable: the requested isolation does not work here (names ``isolation``).
        SandboxError: from :meth:`step` / :meth:`final_reward`, when a sandbox does not start
            (never because of what the program does).

    ``StepResult.info``: ``visible_passed`` (fraction of the visible tests passed) and
    ``timed_out`` (1 when the program ran out of time).
    """

    def __init__(self, *, isolation: str = "auto", timeout_s: float = 10.0, partial_credit: bool = False,
                 memory_mb: int = 1024, max_feedback_chars: int = 2000):
        if (isinstance(max_feedback_chars, bool) or not isinstance(max_feedback_chars, int)
                or max_feedback_chars < 200):
            raise ValueError(f"max_feedback_chars must be an int of at least 200, got {max_feedback_chars!r}")
        self.sandbox = shared_sandbox(
            isolation, SandboxLimits(wall_time_s=float(timeout_s), memory_bytes=int(memory_mb) << 20)
        )
        self.timeout_s = float(timeout_s)
        self.partial_credit = bool(partial_credit)
        self.max_feedback_chars = max_feedback_chars
        self.program: str | None = None
        self._visible_result: TestResult | None = None

    def reset(self, row: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:  # noqa: ARG002
        """The row's ``prompt`` as the one user message.

        Raises:
            ValueError: the row has no tests (:func:`~policygrad.rewards.code.spec_for_row`).
            KeyError: the row has no ``prompt``.
        """
        if "prompt" not in row:
            raise KeyError(f"CodeFeedbackEnv needs rows with a 'prompt' field; got {sorted(row)}")
        spec = spec_for_row(test=row.get("test"), entry_point=row.get("entry_point"), tests=row.get("tests"),
                            stub=row.get("stub"), prompt=row.get("prompt"))
        self.visible, self.hidden = split_tests(spec)
        self.visible_sources = list(spec.asserts[: visible_count(len(spec.asserts))])
        # As the code_tests reward: HumanEval's prompt is the code the completion continues.
        self.stub = row.get("stub")
        if self.stub is None and spec.check:
            self.stub = row.get("prompt")
        entry = row.get("entry_point")
        self.entry_point = entry if isinstance(entry, str) or entry is None else (list(entry) or [None])[0]
        self.program = None
        self._visible_result = None
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, action: str) -> StepResult:
        """Run the turn's program against the visible tests: done when all pass, else the
        failures as the next user message."""
        self.program = build_program(action, stub=self.stub, entry_point=self.entry_point)
        result = self.sandbox.run_tests(self.program, self.visible)
        self._visible_result = result
        info = {"visible_passed": result.passed / result.total, "timed_out": float(result.timed_out)}
        if result.all_passed:
            return StepResult([], 0.0, True, info)
        return StepResult([{"role": "user", "content": self.feedback(result)}], 0.0, False, info)

    def feedback(self, result: TestResult) -> str:
        """The message listing the failing visible tests (each with its code and error), cut to
        ``max_feedback_chars``."""
        failed = result.total - result.passed
        if self.visible.check:
            error = result.errors[0] if result.errors else "no verdict"
            lines = [f"Your program fails the tests: {_cut(error, _MAX_ERROR_CHARS)}"]
        else:
            lines = [f"Your program fails {failed} of {result.total} tests:"]
            sources = self.visible_sources
            for error in result.errors:
                match = _LABEL.match(error)
                if match and int(match.group(1)) < len(sources):
                    test = _cut(sources[int(match.group(1))], _MAX_TEST_CHARS)
                    lines.append(f"- {test}\n  {_cut(error[match.end():], _MAX_ERROR_CHARS)}")
                else:  # no label: the harness failed the test before it ran (e.g. the time ran out)
                    lines.append(f"- {_cut(error, _MAX_ERROR_CHARS)}")
        if result.timed_out:
            lines.append(f"(The time limit of {self.timeout_s:g} s was reached.)")
        tail = "Fix the program and reply with the whole corrected program in a ```python block."
        body = "\n".join(lines)
        room = self.max_feedback_chars - len(tail) - 1
        return (body if len(body) <= room else body[: room - 4] + "\n...") + "\n" + tail

    def final_reward(self, stop_reason: str) -> float:  # noqa: ARG002 - the last program is scored as is
        """The hidden tests on the last program: 1.0 when all pass, else 0.0 (with
        ``partial_credit``, the fraction passed); 0.0 when no turn was taken."""
        if self.program is None:
            return 0.0
        if self.hidden is self.visible and self._visible_result is not None:
            result = self._visible_result  # HumanEval: the check already ran on this program
        else:
            result = self.sandbox.run_tests(self.program, self.hidden)
        if self.partial_credit:
            return result.passed / result.total
        return 1.0 if result.all_passed else 0.0
