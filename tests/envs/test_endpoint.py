"""The agent endpoint over HTTP: what it accepts, what it refuses, and how a session's calls are
held, answered and refused (tool calls parsed from the Hermes format)."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest

from policygrad.envs.endpoint import (
    MAX_BODY_BYTES,
    AgentRequestError,
    endpoint,
    message_key,
    parse_tool_calls,
    read_call,
    reply_message,
)

pytestmark = pytest.mark.unit

USER = {"role": "user", "content": "hi"}


def post(url: str, body, timeout: float = 10.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def answer_next(session, text: str) -> threading.Thread:
    """Answer the session's next call with ``text`` (as the agent environment does)."""

    def go():
        with session.cond:
            while session.pending is None:
                session.cond.wait()
            call = session.take()
        reply, finish, _ = reply_message(text, call.tools)
        session.answer(reply, finish)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def post_in_flight(session) -> tuple[threading.Thread, dict]:
    """A call posted on a thread, returned once the session holds it: ``(thread, out)``, the
    reply in ``out["r"]`` when it ends."""
    out: dict = {}
    thread = threading.Thread(
        target=lambda: out.update(r=post(session.url + "/chat/completions", {"messages": [USER]})),
        daemon=True,
    )
    thread.start()
    with session.cond:
        while session.pending is None:
            session.cond.wait()
    return thread, out


def test_a_call_is_held_until_answered_and_comes_back_as_a_chat_completion():
    session = endpoint().open()
    try:
        answer_next(session, "4")
        status, body = post(
            session.url + "/chat/completions", {"model": "m", "messages": [USER], "temperature": 0.1}
        )
        assert status == 200
        assert body["object"] == "chat.completion" and body["model"] == "m"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "4", "refusal": None}
        assert body["choices"][0]["finish_reason"] == "stop"
    finally:
        endpoint().close(session)


def test_a_second_call_while_one_is_in_flight_is_refused_with_409():
    session = endpoint().open()
    try:
        thread, first = post_in_flight(session)
        status, body = post(session.url + "/chat/completions", {"messages": [USER]})
        assert status == 409 and "one after another" in body["error"]["message"]
        answer_next(session, "ok")
        thread.join(10)
        assert first["r"][0] == 200
    finally:
        endpoint().close(session)


def test_an_ended_session_refuses_the_call_in_flight_and_every_later_one():
    session = endpoint().open()
    thread, out = post_in_flight(session)
    session.end("the episode is over (max_turns): return the reward")
    thread.join(10)
    assert out["r"][0] == 400 and "episode is over (max_turns)" in out["r"][1]["error"]["message"]
    status, body = post(session.url + "/chat/completions", {"messages": [USER]})
    assert status == 400 and "max_turns" in body["error"]["message"]
    endpoint().close(session)
    status, body = post(session.url + "/chat/completions", {"messages": [USER]})
    assert status == 404  # forgotten once closed


@pytest.mark.parametrize(
    ("path", "status", "words"),
    [
        ("/sessions/" + "0" * 32 + "/v1/chat/completions", 404, "no such session"),
        ("/sessions/../../etc/passwd/v1/chat/completions", 404, "no such session"),
        ("/v1/chat/completions", 404, "no such session"),
    ],
)
def test_unknown_sessions_and_paths_are_refused(path, status, words):
    url = f"http://127.0.0.1:{endpoint().port}{path}"
    got, body = post(url, {"messages": [USER]})
    assert got == status and words in body["error"]["message"]


def test_text_completions_and_bad_bodies_are_refused_with_a_reason():
    session = endpoint().open()
    try:
        status, body = post(session.url + "/completions", {"prompt": "hi"})
        assert status == 404 and "/v1/chat/completions" in body["error"]["message"]
        status, body = post(session.url + "/chat/completions", b"{not json")
        assert status == 400 and "not JSON" in body["error"]["message"]
        status, body = post(session.url + "/chat/completions", {"messages": [USER], "stream": True})
        assert status == 400 and "stream" in body["error"]["message"]
        with urllib.request.urlopen(session.url + "/models", timeout=10) as response:
            assert json.loads(response.read())["data"][0]["id"] == "policy"
    finally:
        endpoint().close(session)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([], "JSON object"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [USER], "n": 2}, "n=2"),
        ({"messages": [{"content": "x"}]}, "string 'role'"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text part"),
        ({"messages": [{"role": "user", "content": 3}]}, "content must be"),
        ({"messages": [USER], "tools": {"a": 1}}, "tools must be a list"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]},
            "function.name",
        ),
    ],
)
def test_read_call_refuses_what_is_not_a_chat_request(body, words):
    with pytest.raises(AgentRequestError, match=words):
        read_call(body)


def test_read_call_keeps_text_parts_tool_calls_and_tool_ids():
    call = read_call(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ],
            "tools": [{"type": "function"}],
        }
    )
    assert call.messages[0] == {"role": "user", "content": "ab"}
    assert call.messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert call.messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    assert call.tools == [{"type": "function"}] and call.model == "policy"


def test_tool_calls_are_parsed_from_hermes_tags_and_malformed_ones_stay_text():
    text = (
        'Let me compute. <tool_call>{"name": "calc", "arguments": {"e": "1+2"}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": "{\\"e\\": \\"3\\"}"}</tool_call><tool_call>[1]</tool_call>'
    )
    content, calls, malformed = parse_tool_calls(text)
    assert content == "Let me compute. <tool_call>[1]</tool_call>"
    assert [c["function"] for c in calls] == [
        {"name": "calc", "arguments": '{"e": "1+2"}'},
        {"name": "calc", "arguments": '{"e": "3"}'},
    ]
    assert [c["id"] for c in calls] == ["call_0", "call_1"] and malformed == 1
    reply, finish, _ = reply_message(text, tools=[{"type": "function"}])
    assert finish == "tool_calls" and len(reply["tool_calls"]) == 2
    reply, finish, _ = reply_message(text, tools=None)  # no tools offered: the text as it is
    assert reply == {"role": "assistant", "content": text} and finish == "stop"


def test_message_keys_compare_text_and_tool_arguments_as_values_not_call_ids():
    ours = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": 2}'}}
        ],
    }
    theirs = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "xyz", "type": "function", "function": {"name": "f", "arguments": '{"b": 2, "a": 1}'}}
        ],
    }
    assert message_key(ours) == message_key(theirs)
    changed = {**theirs, "tool_calls": [{"id": "xyz", "function": {"name": "f", "arguments": '{"a": 2}'}}]}
    assert message_key(ours) != message_key(changed)
    assert message_key(USER) != message_key({"role": "user", "content": "hi "})


def test_session_ids_are_random_and_not_paths():
    a, b = endpoint().open(), endpoint().open()
    try:
        token = a.url.split("/sessions/")[1].split("/")[0]
        assert len(token) == 32 and set(token) <= set("0123456789abcdef") and a.url != b.url
        assert a.url.startswith(f"http://127.0.0.1:{endpoint().port}/sessions/")
    finally:
        endpoint().close(a)
        endpoint().close(b)


def test_an_oversized_body_is_refused_with_its_reason():
    session = endpoint().open()
    try:
        status, body = post(session.url + "/chat/completions", b" " * (MAX_BODY_BYTES + 1))
        assert status == 413 and "send less" in body["error"]["message"]
    finally:
        endpoint().close(session)


def test_a_client_gone_before_its_reply_leaves_no_traceback(capfd):
    session = endpoint().open()
    try:
        sock = socket.create_connection(("127.0.0.1", endpoint().port))
        data = json.dumps({"messages": [USER]}).encode()
        path = session.url.split(str(endpoint().port), 1)[1] + "/chat/completions"
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data
        )
        with session.cond:
            while session.pending is None:
                session.cond.wait()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, not a close
        sock.close()
        answer_next(session, "late").join(10)
        time.sleep(0.2)  # the handler's failed write
        assert "Traceback" not in capfd.readouterr().err
    finally:
        endpoint().close(session)
