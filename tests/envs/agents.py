"""Agent functions for the agent tests, importable (``tests.envs.agents:NAME``) so that worker
processes load them. Each talks to the policy only through the OpenAI client it is given."""

# ruff: noqa: ARG001 - agents take (client, row)
from __future__ import annotations

import json
import os
import re
import time

import openai

_INTEGER = re.compile(r"-?\d+")


def judge(text: str, row) -> str | None:
    """GuessEnv's reply to a turn: None when it found the secret."""
    match = _INTEGER.search(text)
    if match is None:
        return f"Reply with one integer between {row['low']} and {row['high']}."
    if int(match.group()) == row["secret"]:
        return None
    return "Higher." if int(match.group()) < row["secret"] else "Lower."


async def guess(client, row):
    """builtin:guess's game played by an agent: the same opening, replies and reward as
    :class:`policygrad.envs.guess.GuessEnv` on rows with a secret."""
    messages = [{"role": "user", "content": row["prompt"]}]
    try:
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages, temperature=0.3)
            text = reply.choices[0].message.content
            feedback = judge(text, row)
            if feedback is None:
                return 1.0
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
    except openai.BadRequestError:  # the episode is over (a turn limit): not found
        return 0.0


def guess_sync(client, row):
    """:func:`guess` as a plain function with the synchronous client, stepping through the
    conversation by turn count instead of a loop over replies."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(100):
        try:
            response = client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError:
            return 0.0
        feedback = judge(response.choices[0].message.content, row)
        if feedback is None:
            return 1.0
        messages.extend(
            (
                {"role": "assistant", "content": response.choices[0].message.content},
                {"role": "user", "content": feedback},
            )
        )
    return 0.0


async def guess_summary(client, row):
    """:func:`guess`, but each call after the first sends a summary instead of the history (a
    library that compacts its context): no call extends the one before, so every turn after
    the first starts a new segment."""
    messages = [{"role": "user", "content": row["prompt"]}]
    try:
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            text = reply.choices[0].message.content
            feedback = judge(text, row)
            if feedback is None:
                return 1.0
            summary = f"You guessed {text.strip()!r}. {feedback}"
            messages = [{"role": "user", "content": row["prompt"]}, {"role": "user", "content": summary}]
    except openai.BadRequestError:
        return 0.0


async def named(client, row):
    """One call; two named rewards."""
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    return {"found": 1.0, "style": -0.25}


async def raises(client, row):
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    raise ValueError("the agent's own bug")


async def never_calls(client, row):
    return 1.0


async def hangs(client, row):
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    time.sleep(3600)  # blocks its thread, as a stuck tool would


async def rewrites(client, row):
    """Drops its earlier turns: the second call does not extend the first."""
    first = [{"role": "user", "content": row["prompt"]}]
    await client.chat.completions.create(model="policy", messages=first)
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "start over"}])
    return 1.0


async def exits(client, row):
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    os._exit(3)


CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


async def tools(client, row):
    """Runs the model's tool calls and sends their results back as tool messages; the reward
    counts the well-formed calls it was given (the last turn's text has none)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    seen = 0
    try:
        for _ in range(4):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALCULATOR_TOOL]
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return float(seen)
            for call in message.tool_calls:
                seen += 1
                args = json.loads(call.function.arguments)
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": str(len(args["expression"]))}
                )
    except openai.BadRequestError:
        return float(seen)
    return float(seen)


async def named_after_limit(client, row):
    """Calls until the episode is over, then returns named rewards (a limit ended it)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    try:
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "more"},
            ]
    except openai.BadRequestError:
        return {"found": 0.0, "style": -1.0}


class AsyncCallable:
    """An agent object whose ``__call__`` is ``async``: it gets the async client."""

    async def __call__(self, client, row):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": row["prompt"]}]
        )
        return 0.5


async_callable = AsyncCallable()


async def finish_reason(client, row):
    """One call; the reward says whether its reply came back cut (``finish_reason: length``)."""
    reply = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    return 1.0 if reply.choices[0].finish_reason == "length" else 0.0


async def restarts_huge(client, row):
    """Rewrites its history into one enormous message after the first turn."""
    await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    huge = [{"role": "user", "content": "x " * 1_000_000}]
    try:
        await client.chat.completions.create(model="policy", messages=huge)
    except openai.BadRequestError:
        return 0.5
    return 1.0
