"""Python functions as tools of an environment, called by the model in the Hermes/Qwen tag format.

A turn calls tools by writing, anywhere in its text::

    <tool_call>
    {"name": "calculate", "arguments": {"expression": "12 * 7"}}
    </tool_call>

the format the chat templates of Qwen2.5 and Qwen3 (NousResearch's Hermes function calling)
render tools in and train their models to write. Each call runs in the code sandbox
(:mod:`policygrad.sandbox`) as a small program, the tool's source (``inspect.getsource``) and one
call with the JSON arguments, which prints a JSON result; the result comes back as a message of
role ``tool`` (the templates wrap it in ``<tool_response>``). A turn without a ``<tool_call>`` is
the final answer: the episode is done.

The tools' code is the environment author's, but their arguments are the model's: a tool that
``eval``\\ s or loops on what it is given runs in the sandbox, under a wall-time limit per call.
A tool must therefore be self-contained: a module-level function whose body imports what it
needs (only its own source reaches the sandbox), taking and returning JSON values.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import threading
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policygrad.envs.base import Environment, StepResult
from policygrad.sandbox.runner import Sandbox, SandboxLimits, SandboxUnavailable

__all__ = ["ToolCall", "ToolEnv", "parse_tool_calls", "shared_sandbox", "tool_schema"]

_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
# The result line of a tool program: a marker the tool's own prints are unlikely to start with.
_RESULT_MARKER = "<<policygrad-tool-result>>"  # printable: str.splitlines splits at control characters
_MAX_RESULT_CHARS = 600
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object", type(None): "null"}

_SANDBOXES: dict[tuple[str, SandboxLimits], Sandbox] = {}
_SANDBOX_LOCK = threading.Lock()


def shared_sandbox(isolation: str = "auto", limits: SandboxLimits | None = None) -> Sandbox:
    """The process's :class:`~policygrad.sandbox.Sandbox` for ``(isolation, limits)``, built on
    first use and shared by every episode after (building one probes the isolation: seconds).
    Every environment that runs model-written code (tools, :mod:`policygrad.envs.code_feedback`)
    takes its sandbox here.

    Args:
        isolation: ``"auto"``, ``"bwrap"``, ``"namespaces"`` or ``"none"`` (no isolation: the
            tools run as this user, with resource limits only; the explicit escape hatch).
        limits: the per-call limits (default: :class:`SandboxLimits`'s).

    Raises:
        ValueError: an unknown ``isolation``.
        SandboxUnavailable: no isolation of that kind here; never silently ``none``. The message
            names the environment option ``isolation``.
    """
    limits = limits if limits is not None else SandboxLimits()
    key = (isolation, limits)
    with _SANDBOX_LOCK:
        sandbox = _SANDBOXES.get(key)
        if sandbox is None:
            try:
                sandbox = Sandbox(isolation, limits)
            except SandboxUnavailable as exc:
                raise SandboxUnavailable(
                    "this environment runs model-written code in a sandbox and none is available with "
                    f"isolation={isolation!r}: "
                    f"{exc}. For the environment, set its option isolation (env.options.isolation) to an "
                    "available mode, or to 'none' to run tool calls without isolation (unsafe: as this "
                    "user, with resource limits only)"
                ) from exc
            _SANDBOXES[key] = sandbox
    return sandbox


class ToolCall(typing.NamedTuple):
    """One parsed ``<tool_call>``: ``name`` and ``arguments`` when it parsed, else ``error`` (a
    one-line reason) and the name when one was readable."""

    name: str | None
    arguments: dict[str, Any] | None
    error: str | None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` of ``text``, in order.

    A block whose JSON does not parse, is not an object, lacks a string ``name`` or has
    ``arguments`` that are not an object (a JSON string holding one is accepted, as some models
    write it) becomes a :class:`ToolCall` with ``error`` set; so does a last block left open.
    No ``<tool_call>`` at all: an empty list (the turn is a final answer).
    """
    calls = []
    for body, closing in _TOOL_CALL.findall(text):
        if not closing:
            calls.append(ToolCall(None, None, "the <tool_call> is not closed with </tool_call>"))
            continue
        try:
            obj = json.loads(body.strip())
        except ValueError as exc:
            calls.append(ToolCall(None, None, f"the tool call is not valid JSON ({exc})"))
            continue
        except RecursionError:  # what the model wrote nests deeper than the parser goes
            calls.append(ToolCall(None, None, "the tool call's JSON nests too deeply"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            why = 'the tool call must be a JSON object {"name": ..., "arguments": {...}}'
            calls.append(ToolCall(None, None, why))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                pass
        if args is None:
            args = {}
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], None, "the tool call's arguments must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args, None))
    return calls


def _doc_parts(fn: Callable) -> tuple[str, dict[str, str]]:
    """A function's description (its docstring's first paragraph) and the per-argument
    descriptions of a Google-style ``Args:`` section."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    match = re.search(r"^(Args|Arguments|Parameters):\s*\n((?:[ \t]+.*\n?|\s*\n)*)", doc, re.MULTILINE)
    if match:
        current = None
        for line in match.group(2).splitlines():
            item = re.match(r"^\s{1,8}(\w+)(?:\s*\([^)]*\))?:\s*(.*)$", line)
            if item:
                current = item.group(1)
                params[current] = item.group(2).strip()
            elif current and line.strip():
                params[current] += " " + line.strip()
    return description, params


def _json_type(annotation: Any) -> dict[str, Any]:
    """The JSON-schema type of a parameter annotation (``{}``: any)."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, Sequence):
        return {"type": "array"}
    if origin in (dict, Mapping):
        return {"type": "object"}
    if origin is typing.Union or type(annotation).__name__ == "UnionType":
        types = [_json_type(a).get("type") for a in typing.get_args(annotation)]
        if all(types):
            return {"type": types}
    return {}


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The OpenAI-style JSON schema of a function, from its signature and docstring::

        {"type": "function", "function": {"name": ..., "description": ...,
         "parameters": {"type": "object", "properties": {...}, "required": [...]}}}

    the ``tools=`` format of ``tokenizer.apply_chat_template``. Parameters without a default are
    required; annotations ``str``, ``int``, ``float``, ``bool``, ``list``, ``dict`` (and unions of
    them) give the types; a Google-style ``Args:`` section gives the descriptions.

    Raises:
        TypeError: ``fn`` takes ``*args`` or ``**kwargs`` (a schema cannot describe them).
    """
    description, docs = _doc_parts(fn)
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__} takes *{name}; a tool's parameters must be named")
        prop = _json_type(hints.get(name, Any))
        if name in docs:
            prop["description"] = docs[name]
        properties[name] = prop
        if param.default is param.empty:
            required.append(name)
    return {
        "type": "function",
        "function": {
            "name": fn.__name__,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _tool_source(fn: Callable) -> str:
    """The source of a self-contained module-level function, decorators removed.

    Raises:
        TypeError: a lambda, a nested function, a method, or source that cannot be read.
    """
    if not inspect.isfunction(fn) or fn.__name__ == "<lambda>" or "<locals>" in fn.__qualname__:
        raise TypeError(
            f"tool {getattr(fn, '__name__', fn)!r} must be a module-level function (its source runs in "
            "the sandbox on its own)"
        )
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError) as exc:
        raise TypeError(f"the source of tool {fn.__name__} cannot be read: {exc}") from exc
    lines = source.splitlines()
    while lines and lines[0].lstrip().startswith("@"):
        lines.pop(0)
    return "\n".join(lines) + "\n"


def _type_error(fn: Callable, args: Mapping[str, Any]) -> str | None:
    """Why ``args`` do not fit ``fn``'s signature and simple annotations, or None."""
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as exc:
        return str(exc)
    hints = typing.get_type_hints(fn)
    for name, value in args.items():
        expected = _json_type(hints.get(name, Any)).get("type")
        if expected is None:
            continue
        allowed = expected if isinstance(expected, list) else [expected]
        actual = _JSON_TYPES.get(type(value))
        if actual == "integer" and "number" in allowed:
            continue
        if actual not in allowed:
            return f"argument {name!r} must be {' or '.join(allowed)}, got {actual or type(value).__name__}"
    return None


def _program(source: str, name: str, args: Mapping[str, Any], max_chars: int) -> str:
    """The sandbox program of one call: the tool's source, then the call, printing one marked
    JSON line ``{"result": text}`` or ``{"error": "Type: message"}``."""
    return (
        "import contextlib as _contextlib, io as _io, json as _json\n\n"
        f"{source}\n\n"
        f"_args = _json.loads({json.dumps(args)!r})\n"
        "try:\n"
        # The tool's own prints are dropped: only the first 4 KiB of output come back.
        "    with _contextlib.redirect_stdout(_io.StringIO()):\n"
        f"        _value = {name}(**_args)\n"
        "    _text = _value if isinstance(_value, str) else _json.dumps(_value, default=repr)\n"
        f"    _out = {{'result': _text[:{max_chars}]}}\n"
        "except Exception as _exc:\n"
        "    _out = {'error': (type(_exc).__name__ + ': ' + str(_exc))[:500]}\n"
        f"print({_RESULT_MARKER!r} + _json.dumps(_out, ensure_ascii=False), flush=True)\n"
    )


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ToolEnv(Environment):
    """An environment whose model may call Python functions as tools (module docstring).

    Subclass it with a class attribute ``tools`` (functions) and a :meth:`reset` (and
    :meth:`final_reward`), or use it directly with ``tools=``: its :meth:`reset` shows the row's
    ``prompt`` after a system message describing the tools.

    Args:
        tools: the functions (default: the class attribute ``tools``); each module-level,
            self-contained, with JSON arguments and a JSON (or str) result.
        tool_timeout_s: wall seconds per tool call (and CPU seconds) in the sandbox.
        max_tool_calls: tool calls run per turn; the rest get an error message each.
        isolation: the sandbox's isolation: ``"auto"`` (bwrap, else namespaces; an error when
            neither works), ``"bwrap"``, ``"namespaces"``, or ``"none"`` (no isolation; unsafe).
        describe_tools: put :meth:`system_prompt` in the opening system message (set False when
            the runner passes :meth:`tool_schemas` to a chat template with native tool support).
        max_result_chars: a tool's result text is cut to this many characters (at most 600: the
            sandbox keeps the first 4 KiB of a program's output, and a character takes at most
            6 bytes as escaped JSON).
        memory_mb: address space of a tool call's process, MiB.

    Raises:
        ValueError: a bad option, two tools with one name, no tools.
        TypeError: a tool that is not a self-contained module-level function.
        SandboxUnavailable: the requested isolation does not work here (names ``isolation``).

    ``StepResult.info`` of each turn: ``tool_calls`` (calls written), ``tool_errors`` (those that
    failed: malformed, unknown tool, bad arguments, an exception, a timeout, over the limit).
    """

    tools: Sequence[Callable] = ()

    def __init__(
        self,
        tools: Sequence[Callable] | None = None,
        *,
        tool_timeout_s: float = 5.0,
        max_tool_calls: int = 4,
        isolation: str = "auto",
        describe_tools: bool = True,
        max_result_chars: int = 600,
        memory_mb: int = 512,
    ):
        functions = list(self.tools if tools is None else tools)
        if not functions:
            raise ValueError(f"{type(self).__name__} has no tools; pass tools=[...] or set the class's tools")
        if isinstance(max_tool_calls, bool) or not isinstance(max_tool_calls, int) or max_tool_calls < 1:
            raise ValueError(f"max_tool_calls must be a positive int, got {max_tool_calls!r}")
        if (isinstance(max_result_chars, bool) or not isinstance(max_result_chars, int)
                or not 0 < max_result_chars <= _MAX_RESULT_CHARS):
            raise ValueError(
                f"max_result_chars must be an int in [1, {_MAX_RESULT_CHARS}], got {max_result_chars!r}"
            )
        self._functions: dict[str, Callable] = {}
        self._sources: dict[str, str] = {}
        for fn in functions:
            source = _tool_source(fn)
            if fn.__name__ in self._functions:
                raise ValueError(f"two tools are named {fn.__name__!r}")
            self._functions[fn.__name__] = fn
            self._sources[fn.__name__] = source
        self._schemas = [tool_schema(fn) for fn in functions]
        self.max_tool_calls = max_tool_calls
        self.max_result_chars = max_result_chars
        self.describe_tools = bool(describe_tools)
        # Sandbox limits check the numbers (ValueError naming the limit).
        limits = SandboxLimits(wall_time_s=float(tool_timeout_s), memory_bytes=int(memory_mb) << 20,
                               max_output_bytes=64 << 10)
        self.tool_timeout_s = float(tool_timeout_s)
        # Built here, not at the first call: an unavailable isolation shows when the run starts
        # (the registry builds one environment to check the options).
        self.sandbox = shared_sandbox(isolation, limits)
        self.turns = 0
        self.last_action: str | None = None

    # ----- descriptions -------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools as OpenAI-style JSON schemas (:func:`tool_schema`), for a chat template's
        ``tools=`` argument."""
        return [json.loads(json.dumps(s)) for s in self._schemas]  # copies: callers may edit them

    def system_prompt(self) -> str:
        """The tools and the call format as text, for templates without native tool support: the
        wording of the Qwen2.5 chat template's tool section, so a Qwen model reads what it was
        trained on."""
        tools = "\n".join(json.dumps(s, ensure_ascii=False) for s in self._schemas)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{tools}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def instructions(self) -> str:
        """Text after the tool description in the system message (subclasses say how to answer)."""
        return "When you have the answer, reply without a tool call."

    # ----- the episode --------------------------------------------------------------------------
    def reset(self, row: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:  # noqa: ARG002
        """A system message (tools and :meth:`instructions`) and the row's ``prompt`` as the user
        message.

        Raises:
            KeyError: the row has no ``prompt``.
        """
        self.row = dict(row)
        self.turns = 0
        self.last_action = None
        if "prompt" not in row:
            raise KeyError(f"{type(self).__name__} needs rows with a 'prompt' field; got {sorted(row)}")
        parts = [self.system_prompt()] if self.describe_tools else []
        parts.append(self.instructions())
        return [{"role": "system", "content": "\n\n".join(p for p in parts if p)},
                {"role": "user", "content": str(row["prompt"])}]

    def step(self, action: str) -> StepResult:
        """Run the turn's tool calls (at most ``max_tool_calls``), one ``tool`` message each; a
        turn without any is the final answer (``done``). Never raises for what the model wrote."""
        self.turns += 1
        self.last_action = action
        calls = parse_tool_calls(action)
        if not calls:
            return StepResult([], 0.0, True, {"tool_calls": 0.0, "tool_errors": 0.0})
        messages = []
        errors = 0
        for index, call in enumerate(calls):
            if index >= self.max_tool_calls:
                ok, text = False, (f"error: not run: at most {self.max_tool_calls} tool calls per turn")
            else:
                ok, text = self.call_tool(call)
            errors += not ok
            messages.append({"role": "tool", "content": text})
        info = {"tool_calls": float(len(calls)), "tool_errors": float(errors)}
        return StepResult(messages, 0.0, False, info)

    def call_tool(self, call: ToolCall) -> tuple[bool, str]:
        """Run one parsed call in the sandbox: ``(succeeded, message text)``; the text of a
        failure is one line starting with ``error:``."""
        if call.error is not None:
            return False, f"error: {call.error}"
        fn = self._functions.get(call.name)
        if fn is None:
            return False, f"error: unknown tool {call.name!r}; the tools are: {', '.join(self._functions)}"
        problem = _type_error(fn, call.arguments)
        if problem is not None:
            return False, f"error: bad arguments for {call.name}: {problem}"
        try:
            program = _program(self._sources[call.name], call.name, call.arguments, self.max_result_chars)
        except (TypeError, ValueError) as exc:  # arguments json cannot write (nan is fine; cycles are not)
            return False, f"error: bad arguments for {call.name}: {exc}"
        result = self.sandbox.run(program)
        if result.timed_out:
            return False, f"error: {call.name} timed out after {self.tool_timeout_s:g} s"
        for line in reversed(result.output.splitlines()):
            if line.startswith(_RESULT_MARKER):
                try:
                    out = json.loads(line[len(_RESULT_MARKER):])
                except ValueError:
                    break
                if "error" in out:
                    return False, f"error: {_one_line(str(out['error']))}"
                return True, str(out.get("result", ""))
        # No result line: the process died (memory limit, a signal) or its output was cut.
        tail = result.output.strip().splitlines()
        why = _one_line(tail[-1]) if tail else f"exit status {result.returncode}"
        return False, f"error: {call.name} failed: {why}"
