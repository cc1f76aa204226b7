"""The sandbox worker's parts that run without a sandbox, in this process: modules made as an
import makes them, the harness side of the candidate channel, and the ``tests`` role against a
candidate played by a thread (the wire form and the frames: tests/sandbox/test_wire.py; the
resource limits: tests/sandbox/test_confine.py; the children of a process:
tests/sandbox/test_procfs.py).

Round trips of plain data and what cannot cross are in tests/rewards/test_code_reward.py; the
whole worker in its sandbox (namespaces, bubblewrap, the ``script`` and ``candidate`` roles, the
supervisor) runs in tests/sandbox/test_runner.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import linecache
import os
import struct
import sys
import threading
import time

import pytest

from policygrad.sandbox import worker
from policygrad.sandbox.worker import CandidateError, Channel

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh_modules():
    """Module names the worker registers in ``sys.modules``, removed after the test."""
    names = ("__tests__", "__pg_test_module__")
    yield
    for name in names:
        sys.modules.pop(name, None)




# ----------------------------------------------------------------------------- modules


@pytest.mark.usefixtures("fresh_modules")
def test_new_module_is_made_as_an_import_makes_it():
    source = (
        "import dataclasses\n\n@dataclasses.dataclass\nclass Point:\n    x: int\n\n"
        "def double(p):\n    return Point(2 * p.x)"  # no newline at the end
    )
    module = worker.new_module("__pg_test_module__", "solution_x.py", source)
    assert module.__name__ == "__pg_test_module__" and module.__file__ == "solution_x.py"
    assert "__pg_test_module__" not in sys.modules  # registered by run_module, not before
    lines = linecache.getlines("solution_x.py")
    assert lines[-1] == "    return Point(2 * p.x)\n"  # a newline added to the last line
    worker.run_module(source, module)
    assert sys.modules["__pg_test_module__"] is module
    assert module.double(module.Point(3)) == module.Point(6)  # a dataclass finds its module
    assert dataclasses.is_dataclass(module.Point)
    assert inspect.getsource(module.double) == "def double(p):\n    return Point(2 * p.x)\n"


# ----------------------------------------------------------------------------- the channel


class Pipes:
    """The two pipes of a channel: requests (harness -> candidate), responses (back)."""

    def __init__(self):
        self.req_r, self.req_w = os.pipe()
        self.resp_r, self.resp_w = os.pipe()

    def channel(self, deadline=None):
        return Channel(self.req_w, self.resp_r, time.monotonic() + 60 if deadline is None else deadline)

    def reply(self, payload):
        worker.write_frame(self.resp_w, payload)

    def pending_requests(self):
        import select

        return bool(select.select([self.req_r], [], [], 0)[0])

    def close(self):
        for fd in (self.req_r, self.req_w, self.resp_r, self.resp_w):
            try:
                os.close(fd)
            except OSError:
                pass


@pytest.fixture
def pipes():
    p = Pipes()
    yield p
    p.close()


def test_a_call_sends_its_arguments_and_decodes_the_answer(pipes):
    channel = pipes.channel()
    pipes.reply({"ok": worker.encode((3, "x"))})
    assert channel.call("add", (1, (2,)), {"k": None}) == (3, "x")
    assert worker.read_frame(pipes.req_r) == {
        "call": "add",
        "args": [1, {"__t": "tuple", "v": [2]}],
        "kwargs": {"__t": "dict", "v": [["k", None]]},
    }


def test_a_builtin_exception_is_raised_as_itself(pipes):
    channel = pipes.channel()
    pipes.reply({"raised": "ValueError", "message": "negative input"})
    with pytest.raises(ValueError, match="^negative input$") as caught:
        channel.call("f", (), {})
    assert type(caught.value) is ValueError
    assert channel.broken is None  # a raised exception is an answer: the channel lives on


def test_a_type_error_is_raised_as_itself(pipes):
    channel = pipes.channel()
    pipes.reply({"raised": "TypeError", "message": "unsupported operand"})
    with pytest.raises(TypeError, match="^unsupported operand$"):
        channel.call("f", (), {})


@pytest.mark.parametrize(
    "raised",
    [
        "SystemExit",  # a BaseException only
        "MyOwnError",  # the program's class
        "UnicodeDecodeError",  # built in, but its constructor wants five arguments
    ],
)
def test_other_exceptions_become_candidate_errors(pipes, raised):
    channel = pipes.channel()
    pipes.reply({"raised": raised, "message": "boom"})
    with pytest.raises(CandidateError, match=rf"^f\(\) raised {raised}: boom$"):
        channel.call("f", (), {})
    assert channel.broken is None


def test_an_answer_that_is_not_plain_data(pipes):
    channel = pipes.channel()
    pipes.reply({"ok": {"__t": "eq_all", "v": []}})
    with pytest.raises(CandidateError, match=r"^f\(\) returned something that is not plain data"):
        channel.call("f", (), {})
    assert channel.broken is None


@pytest.mark.parametrize(
    "reply", [{"ok": 1, "extra": 2}, {"raised": 1, "message": "m"}, ["ok", 1], {"raised": "ValueError"}]
)
def test_a_malformed_reply_breaks_the_channel_for_good(pipes, reply):
    channel = pipes.channel()
    pipes.reply(reply)
    with pytest.raises(CandidateError, match="^malformed reply$"):
        channel.call("f", (), {})
    worker.read_frame(pipes.req_r)  # the first request
    pipes.reply({"ok": 1})  # a later good answer is never read:
    with pytest.raises(CandidateError, match="^malformed reply$"):
        channel.call("f", (), {})
    assert not pipes.pending_requests()  # no request was sent


def test_an_ended_candidate_breaks_the_channel(pipes):
    channel = pipes.channel()
    os.close(pipes.resp_w)
    with pytest.raises(CandidateError, match=r"^the candidate's process ended \(EOFError\)$"):
        channel.call("f", (), {})
    assert channel.broken == "the candidate's process ended (EOFError)"


def test_the_time_limit_breaks_the_channel(pipes):
    channel = pipes.channel(deadline=time.monotonic() - 1)
    with pytest.raises(CandidateError, match="^time limit reached$"):
        channel.call("f", (), {})
    assert channel.broken == "time limit reached"


def test_an_unreadable_reply_breaks_the_channel(pipes):
    channel = pipes.channel()
    os.write(pipes.resp_w, struct.pack(">I", 3) + b"{x}")
    with pytest.raises(CandidateError, match=r"^unreadable reply \(JSONDecodeError: "):
        channel.call("f", (), {})


def test_wait_ready_wants_the_ready_frame_first(pipes):
    pipes.reply({"ready": True})
    pipes.channel().wait_ready()
    pipes.reply({"ok": 1})
    with pytest.raises(RuntimeError, match=r"^unexpected first frame \{'ok': 1\}$"):
        pipes.channel().wait_ready()


def test_a_proxy_is_named_as_the_candidates_function(pipes):
    proxy = pipes.channel().proxy("add")
    assert proxy.__name__ == proxy.__qualname__ == "add"
    pipes.reply({"ok": 5})
    assert proxy(2, b=3) == 5
    assert worker.read_frame(pipes.req_r)["kwargs"] == {"__t": "dict", "v": [["b", 3]]}


# ----------------------------------------------------------------------------- the tests role


def play_candidate(pipes, functions, first=None):
    """A thread answering the harness as the candidate process does: a ready frame (or
    ``first``), then one answer per request until the request pipe closes."""

    def run():
        worker.write_frame(pipes.resp_w, first or {"ready": True})
        while True:
            try:
                request = worker.read_frame(pipes.req_r)
            except (EOFError, OSError):
                return
            try:
                value = functions[request["call"]](*worker.decode(request["args"]))
                reply = {"ok": worker.encode(value)}
            except Exception as exc:  # noqa: BLE001 - as the candidate role answers
                reply = {"raised": type(exc).__name__, "message": str(exc)}
            worker.write_frame(pipes.resp_w, reply)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def run_tests_role(pipes, tests, functions, first=None):
    report_r, report_w = os.pipe()
    thread = play_candidate(pipes, functions, first)
    spec = {
        "fds": {"report": report_w, "req": pipes.req_w, "resp": pipes.resp_r},
        "start_timeout_s": 60,
        "limits": {"wall_time_s": 60},
        "tests": {"names": ["add"], "prelude": "", "check": None, "entry_point": "add", **tests},
    }
    try:
        worker.role_tests(spec)
    finally:
        os.close(report_w)
        os.close(pipes.req_w)  # the candidate thread sees the end of requests
        thread.join()
    with os.fdopen(report_r) as f:
        return [json.loads(line) for line in f]


def add_non_negative(a, b):
    if a < 0:
        raise ValueError(f"negative input {a}")
    return a + b


@pytest.mark.usefixtures("fresh_modules")
def test_the_tests_role_reports_each_assert(pipes):
    asserts = ["assert add(1, 2) == 3", "assert add(1, 1) == 3, 'one and one'", "add(-1, 0)"]
    records = run_tests_role(pipes, {"asserts": asserts}, {"add": add_non_negative})
    assert records == [
        {"ready": True},
        {"test": 0, "passed": True, "error": None},
        {"test": 1, "passed": False, "error": "AssertionError: one and one"},
        # The candidate's ValueError crosses as a ValueError and fails the test.
        {"test": 2, "passed": False, "error": "ValueError: negative input -1"},
        {"done": True},
    ]


@pytest.mark.usefixtures("fresh_modules")
def test_a_test_expecting_the_candidates_type_error_passes(pipes):
    asserts = [
        "try:\n    add('x', 1)\nexcept TypeError:\n    pass\nelse:\n    raise AssertionError('no error')"
    ]
    records = run_tests_role(pipes, {"asserts": asserts}, {"add": lambda a, b: a + b})
    assert records[1] == {"test": 0, "passed": True, "error": None}


@pytest.mark.usefixtures("fresh_modules")
def test_a_humaneval_check_runs_first_with_the_prelude(pipes):
    tests = {
        "prelude": "OFFSET = 10\n",
        "check": "def check(candidate):\n    assert candidate(OFFSET, 5) == 15\n",
        "asserts": ["assert add(0, 0) == 0"],
    }
    records = run_tests_role(pipes, tests, {"add": lambda a, b: a + b})
    assert records[1:] == [
        {"test": 0, "passed": True, "error": None},
        {"test": 1, "passed": True, "error": None},
        {"done": True},
    ]


@pytest.mark.usefixtures("fresh_modules")
def test_a_prompt_that_is_not_code_is_a_note(pipes):
    records = run_tests_role(pipes, {"prelude": "def (:\n", "asserts": []}, {"add": lambda a, b: a + b})
    assert records[0] == {"ready": True}
    assert records[1]["note"].startswith("the prompt did not run as code: SyntaxError")
    assert records[2:] == [{"done": True}]


@pytest.mark.usefixtures("fresh_modules")
def test_a_candidate_that_does_not_start_is_a_setup_error(pipes):
    records = run_tests_role(pipes, {"asserts": ["assert True"]}, {}, first={"hello": 1})
    started = "the candidate's sandbox did not start"
    assert records == [{"setup_error": f"{started}: RuntimeError: unexpected first frame {{'hello': 1}}"}]
