"""The agent endpoint: an OpenAI-compatible ``/v1/chat/completions`` on localhost, one session per
episode, through which a user's agent code (:mod:`policygrad.envs.agent`) talks to the policy.

One endpoint serves a process (:func:`endpoint`; an environment worker, or the trainer when
agents are not isolated); a session's base URL is ``http://127.0.0.1:PORT/sessions/<id>/v1``
with ``<id>`` 32 random hex digits (:func:`secrets.token_hex`): it names a session in memory,
never a file, and a call to an unknown or finished session is refused. The official ``openai``
client works with that ``base_url`` unchanged.

A call is held until the episode runner has sampled the policy's reply (:meth:`Session.answer`);
the reply is the decoded turn, with ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
blocks (the Hermes / Qwen format of the chat templates that take ``tools``) returned as OpenAI
``tool_calls`` when the request gave ``tools``. The run's sampling settings decide the reply:
a request's ``temperature``, ``top_p``, ``max_tokens``, ``seed`` and ``model`` are read but not
used (the objective assumes the run's sampling distribution). Refused with 400: ``stream``,
``n`` > 1, and messages that are not chat messages. Text completions (``/v1/completions``) are
refused with 404: a text prompt has no turns whose ids could be kept apart from the agent's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = [
    "AgentCall",
    "AgentRequestError",
    "Endpoint",
    "Session",
    "endpoint",
    "message_key",
    "parse_tool_calls",
    "plain_message",
    "read_call",
    "reply_message",
]

_PATH = re.compile(r"^/sessions/([0-9a-f]{32})/v1/([a-z/]+?)/?$")
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MAX_BODY_BYTES = 16 * 2**20  # a request larger than this is refused (413) before it is read


class AgentRequestError(ValueError):
    """A request the endpoint refuses; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass
class AgentCall:
    """One ``/v1/chat/completions`` call waiting for the policy's turn.

    Attributes:
        messages: the request's messages, each as :func:`read_call` leaves it.
        tools: the request's ``tools`` (None: none).
        model: the request's ``model`` (echoed in the reply).
        reply: the assistant message given back (None: not yet).
        refused: why it was refused instead (None: not refused).
    """

    messages: list[dict]
    tools: list[dict] | None
    model: str
    reply: dict | None = None
    finish_reason: str = "stop"
    refused: str | None = None


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (empty), or a list of ``{"type": "text"}``
    parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, Mapping)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise AgentRequestError(
                    f"{where}.content[{i}] must be a text part ({{'type': 'text', 'text': ...}})"
                )
            parts.append(part["text"])
        return "".join(parts)
    raise AgentRequestError(f"{where}.content must be a string, a list of text parts or null")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise AgentRequestError(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise AgentRequestError(f"{where}.tool_calls[{i}] must have function.name")
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        out.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return out


def read_call(body: Any) -> AgentCall:
    """A chat completions request body as an :class:`AgentCall`: each message as ``{"role",
    "content" (text)}`` plus ``tool_calls`` (an assistant's) or ``tool_call_id`` (a tool's) when
    present.

    Raises:
        AgentRequestError: not a JSON object, no messages, a message without a string ``role``,
            content that is not text, ``stream`` true, ``n`` other than 1, ``tools`` not a list.
    """
    if not isinstance(body, Mapping):
        raise AgentRequestError("the request body must be a JSON object")
    if body.get("stream"):
        raise AgentRequestError(
            "stream=true is not served: the endpoint returns whole turns; call without stream"
        )
    if body.get("n") not in (None, 1):
        raise AgentRequestError(f"n={body.get('n')!r} is not served: a session samples one reply per call")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AgentRequestError("messages must be a non-empty list of chat messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise AgentRequestError(f"{where} must be an object with a string 'role'")
        message = {"role": m["role"], "content": _text(m.get("content"), where)}
        calls = _tool_calls(m.get("tool_calls"), where)
        if calls:
            message["tool_calls"] = calls
        if m.get("tool_call_id") is not None:
            message["tool_call_id"] = str(m["tool_call_id"])
        out.append(message)
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)):
        raise AgentRequestError("tools must be a list of tool objects")
    return AgentCall(out, list(tools) if tools else None, str(body.get("model") or "policy"))


def message_key(message: Mapping[str, Any]) -> tuple:
    """What must be equal for a message to count as the same one in a later call: its role, its
    text and its tool calls' names and arguments (JSON compared as values; call ids are not
    compared, since agent libraries may renumber them)."""
    calls = []
    for call in message.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        try:
            arguments = json.dumps(json.loads(arguments), sort_keys=True)
        except (TypeError, ValueError):
            pass
        calls.append((call["function"]["name"], arguments))
    return message["role"], message.get("content") or "", tuple(calls)


def plain_message(message: Mapping[str, Any]) -> dict[str, str]:
    """``{"role", "content"}``: what the chat template renders of a message in an episode."""
    return {"role": message["role"], "content": message.get("content") or ""}


def parse_tool_calls(text: str) -> tuple[str, list[dict], int]:
    """``(content left, tool calls, malformed blocks)`` of a turn's text: every ``<tool_call>``
    block holding a JSON object with a string ``name`` (and ``arguments``, an object or a JSON
    string) becomes an OpenAI tool call (``id`` ``call_<k>``, ``arguments`` as a JSON string) and
    leaves the text; a malformed block stays in the text and is counted."""
    calls, malformed = [], 0

    def take(match: re.Match) -> str:
        nonlocal malformed
        try:
            call = json.loads(match.group(1))
        except ValueError:
            call = None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("name"), str)
            or not isinstance(arguments, dict)
        ):
            malformed += 1
            return match.group(0)
        calls.append(
            {
                "id": f"call_{len(calls)}",
                "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(arguments)},
            }
        )
        return ""

    content = _TOOL_CALL.sub(take, text)
    return (content.strip() if calls else content), calls, malformed


def reply_message(text: str, tools: Sequence[dict] | None) -> tuple[dict, str, int]:
    """``(assistant message, finish_reason, malformed tool-call blocks)`` of a turn's ``text``;
    tool calls are parsed only when the call gave ``tools``."""
    if not tools:
        return {"role": "assistant", "content": text}, "stop", 0
    content, calls, malformed = parse_tool_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, "stop", malformed
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls", malformed


class Session:
    """One episode's calls: at most one in flight; the agent side (:class:`~policygrad.envs.agent.AgentEnv`)
    waits for it (:meth:`wait`) and answers it (:meth:`answer`); :meth:`end` refuses the one in
    flight and every later call with a reason."""

    def __init__(self, token: str, url: str):
        self.token, self.url = token, url
        self.cond = threading.Condition()
        self.pending: AgentCall | None = None  # received, not yet taken by the agent side
        self.taken: AgentCall | None = None  # taken, not yet answered
        self.over: str | None = None
        self.calls = 0

    def submit(self, call: AgentCall) -> AgentCall:
        """The HTTP side: hand ``call`` over and wait for its answer or refusal.

        Raises:
            AgentRequestError: the session is over (400) or a call is already in flight (409).
        """
        with self.cond:
            if self.over is not None:
                raise AgentRequestError(self.over)
            if self.pending is not None or self.taken is not None:
                raise AgentRequestError(
                    "another call of this session is still waiting for its reply; an episode's calls are "
                    "one after another (use one session per episode)",
                    409,
                )
            self.pending = call
            self.calls += 1
            self.cond.notify_all()
            while call.reply is None and call.refused is None:
                self.cond.wait()
        if call.refused is not None:
            raise AgentRequestError(call.refused)
        return call

    def take(self) -> AgentCall | None:
        """The agent side: the call received since the last take (None: none); the caller holds
        ``cond``."""
        call, self.pending = self.pending, None
        if call is not None:
            self.taken = call
        return call

    def answer(self, reply: dict, finish_reason: str) -> None:
        """Give the taken call its reply."""
        with self.cond:
            call, self.taken = self.taken, None
            if call is not None:
                call.reply, call.finish_reason = reply, finish_reason
            self.cond.notify_all()

    def end(self, why: str) -> None:
        """Refuse the call in flight and every later one with ``why`` (idempotent: the first
        reason stays)."""
        with self.cond:
            if self.over is None:
                self.over = why
            for call in (self.pending, self.taken):
                if call is not None and call.reply is None:
                    call.refused = self.over
            self.pending = self.taken = None
            self.cond.notify_all()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:  # noqa: ARG002 - socketserver's signature
        """A client gone mid-reply (an agent that dropped its call, a client timeout) is its own
        business: no traceback on the run's stderr."""
        return


class Endpoint:
    """The process's HTTP server (``ThreadingHTTPServer`` on 127.0.0.1, an ephemeral port) and
    its open sessions."""

    def __init__(self):
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.endpoint = self  # type: ignore[attr-defined]
        self.port = self.server.server_address[1]
        threading.Thread(
            target=self.server.serve_forever, name="policygrad-agent-endpoint", daemon=True
        ).start()

    def open(self) -> Session:
        """A new session with a fresh random id."""
        token = secrets.token_hex(16)
        session = Session(token, f"http://127.0.0.1:{self.port}/sessions/{token}/v1")
        with self.lock:
            self.sessions[token] = session
        return session

    def close(self, session: Session, why: str = "the session is closed") -> None:
        """End ``session`` and forget it."""
        session.end(why)
        with self.lock:
            self.sessions.pop(session.token, None)

    def find(self, token: str) -> Session | None:
        with self.lock:
            return self.sessions.get(token)


_ENDPOINT: tuple[int, Endpoint] | None = None
_ENDPOINT_LOCK = threading.Lock()


def endpoint() -> Endpoint:
    """This process's endpoint, started on first use (and again in a forked child)."""
    global _ENDPOINT
    with _ENDPOINT_LOCK:
        if _ENDPOINT is None or _ENDPOINT[0] != os.getpid():
            _ENDPOINT = (os.getpid(), Endpoint())
        return _ENDPOINT[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002, ARG002 - the run's log is not an access log
        return

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "param": None, "code": None}})

    def _route(self) -> tuple[Session, str] | None:
        match = _PATH.match(self.path.split("?", 1)[0])
        session = self.server.endpoint.find(match.group(1)) if match else None  # type: ignore[attr-defined]
        if session is None:
            self._error(404, "no such session: use the base_url the agent was given")
            return None
        return session, match.group(2)

    def do_GET(self):  # noqa: N802 - http.server's name
        routed = self._route()
        if routed is None:
            return
        if routed[1] != "models":
            self._error(404, f"GET /v1/{routed[1]} is not served")
            return
        self._send(
            200,
            {
                "object": "list",
                "data": [{"id": "policy", "object": "model", "created": 0, "owned_by": "policygrad"}],
            },
        )

    def do_POST(self):  # noqa: N802 - http.server's name
        try:
            length = max(int(self.headers.get("Content-Length") or 0), 0)
        except ValueError:
            length = 0
        if length > MAX_BODY_BYTES:  # read and dropped in chunks, so the client sees the reason
            self.close_connection = True
            while length > 0:
                chunk = self.rfile.read(min(length, 1 << 16))
                if not chunk:
                    break
                length -= len(chunk)
            self._error(413, f"the request is over {MAX_BODY_BYTES} bytes; send less")
            return
        body = self.rfile.read(length)
        routed = self._route()
        if routed is None:
            return
        session, route = routed
        if route != "chat/completions":
            self._error(
                404,
                f"POST /v1/{route} is not served: the agent endpoint serves /v1/chat/completions "
                "(a text completion has no turns whose ids could be kept apart)",
            )
            return
        try:
            try:
                request = json.loads(body or b"null")
            except ValueError:
                raise AgentRequestError("the request body is not JSON") from None
            call = session.submit(read_call(request))
        except AgentRequestError as exc:
            self._error(exc.status, str(exc))
            return
        message = {"role": "assistant", "content": call.reply.get("content"), "refusal": None}
        if call.reply.get("tool_calls"):
            message["tool_calls"] = call.reply["tool_calls"]
        self._send(
            200,
            {
                "id": f"chatcmpl-{session.token[:12]}-{session.calls}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": call.model,
                "choices": [
                    {"index": 0, "message": message, "finish_reason": call.finish_reason, "logprobs": None}
                ],
            },
        )
