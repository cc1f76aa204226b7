"""ToolEnv (policygrad.envs.tools): tool-call parsing, schemas, and calls run in the sandbox.

Like tests/sandbox/test_runner.py, the sandbox runs under the machine's default isolation
(``auto``) and under ``none`` where no isolation works here.
"""

from __future__ import annotations

import time

import pytest

from policygrad.envs.base import check_step_result
from policygrad.envs.tools import ToolEnv, parse_tool_calls, shared_sandbox, tool_schema
from policygrad.sandbox.runner import SandboxUnavailable, available_isolation

pytestmark = pytest.mark.integration  # starts sandbox processes

AVAILABLE = available_isolation()
MODE = "auto" if AVAILABLE else "none"


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number
            (default 0).
    """
    return a + b


def shout(text: str) -> str:
    """Upper-case a text, printing along the way."""
    print("noise " * 2000)  # the tool's own output is dropped, not mixed into the result
    return text.upper()


def spin(seconds: float) -> str:  # noqa: ARG001 - the argument is the model's
    """Busy-loop forever (a hostile input's effect)."""
    while True:
        pass


def fail(reason: str) -> str:
    """Raise."""
    raise RuntimeError(reason)


def _call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def test_parse_tool_calls():
    text = "Let me add.\n" + _call("add", '{"a": 1, "b": 2}') + _call("add", '"{\\"a\\": 3}"')
    assert parse_tool_calls(text) == [("add", {"a": 1, "b": 2}, None), ("add", {"a": 3}, None)]
    assert parse_tool_calls("The answer is 3.") == []
    bad = parse_tool_calls(
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "add", "arguments": 3}</tool_call><tool_call>{"name": "a"'
    )
    assert [c.error is not None for c in bad] == [True, True, True, True]
    assert "not valid JSON" in bad[0].error and "not closed" in bad[3].error and bad[2].name == "add"


def test_tool_schema_from_signature_and_docstring():
    assert tool_schema(add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number."},
                    "b": {"type": "integer", "description": "the second number (default 0)."},
                },
                "required": ["a"],
            },
        },
    }
    env = ToolEnv([add], isolation=MODE)
    assert env.tool_schemas() == [tool_schema(add)]
    prompt = env.system_prompt()
    assert "<tools>" in prompt and '"name": "add"' in prompt and "<tool_call>" in prompt
    assert (
        ToolEnv([add], isolation=MODE, describe_tools=False).reset({"prompt": "q"}, seed=0)[0]["content"]
        == env.instructions()
    )


def test_a_turn_with_calls_gets_tool_messages_and_one_without_is_done():
    env = ToolEnv([add, shout, fail], isolation=MODE)
    messages = env.reset({"prompt": "What is 2 + 3?"}, seed=0)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == "What is 2 + 3?"
    turn = (
        _call("add", '{"a": 2, "b": 3}')
        + _call("shout", '{"text": "hi"}')
        + _call("fail", '{"reason": "no"}')
    )
    result = check_step_result(env.step(turn))
    assert not result.done
    assert result.observation == [
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "HI"},
        {"role": "tool", "content": "error: RuntimeError: no"},
    ]
    assert result.info == {"tool_calls": 3.0, "tool_errors": 1.0}
    final = check_step_result(env.step("It is 5."))
    assert final.done and final.observation == [] and final.info["tool_calls"] == 0.0


def test_malformed_unknown_and_bad_arguments_are_error_messages():
    env = ToolEnv([add], isolation=MODE, max_tool_calls=4)
    env.reset({"prompt": "q"}, seed=0)
    result = env.step(
        "<tool_call>{oops}</tool_call>"
        + _call("nope", "{}")
        + _call("add", '{"b": 1}')
        + _call("add", '{"a": "x"}')
        + _call("add", '{"a": 1}')
    )
    texts = [m["content"] for m in result.observation]
    assert texts[0].startswith("error: the tool call is not valid JSON")
    assert texts[1] == "error: unknown tool 'nope'; the tools are: add"
    assert texts[2] == "error: bad arguments for add: missing a required argument: 'a'"
    assert texts[3] == "error: bad arguments for add: argument 'a' must be integer, got string"
    assert texts[4] == "error: not run: at most 4 tool calls per turn"
    assert result.info == {"tool_calls": 5.0, "tool_errors": 5.0} and not result.done


def test_a_call_that_never_returns_times_out():
    env = ToolEnv([spin], isolation=MODE, tool_timeout_s=1)
    env.reset({"prompt": "q"}, seed=0)
    start = time.monotonic()
    result = env.step(_call("spin", '{"seconds": 1e9}'))
    assert time.monotonic() - start < 15
    assert result.observation == [{"role": "tool", "content": "error: spin timed out after 1 s"}]
    assert result.info["tool_errors"] == 1.0


def test_one_sandbox_per_process_and_no_silent_fallback(monkeypatch):
    assert ToolEnv([add], isolation=MODE).sandbox is ToolEnv([add], isolation=MODE).sandbox
    import policygrad.envs.tools as tools

    def refuse(*_):
        raise SandboxUnavailable("nothing works here")

    monkeypatch.setattr(tools, "_SANDBOXES", {})
    monkeypatch.setattr(tools, "Sandbox", refuse)
    with pytest.raises(SandboxUnavailable, match=r"option isolation .*'none'"):
        shared_sandbox("auto")


def test_bad_tools_and_options():
    with pytest.raises(TypeError, match="module-level function"):
        ToolEnv([lambda x: x], isolation=MODE)
    with pytest.raises(ValueError, match="no tools"):
        ToolEnv(isolation=MODE)
    with pytest.raises(ValueError, match="max_tool_calls"):
        ToolEnv([add], isolation=MODE, max_tool_calls=0)
    with pytest.raises(ValueError, match="wall_time_s"):
        ToolEnv([add], isolation=MODE, tool_timeout_s=0)


def test_a_tool_call_nested_deeper_than_the_parser_goes_is_an_error_message():
    # The model writes the text: a nesting no JSON parser follows must not fail the episode.
    deep = "<tool_call>" + '{"a":' * 100_000 + "1" + "}" * 100_000 + "</tool_call>"
    calls = parse_tool_calls(deep)
    assert len(calls) == 1 and calls[0].error == "the tool call's JSON nests too deeply"
