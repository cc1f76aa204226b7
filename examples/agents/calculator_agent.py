"""A tool-using agent written against the OpenAI client, trained with policygrad.

The agent is ordinary code: it sends the problem, runs the ``calculate`` tool whenever the model
calls it, sends the result back, and scores the final answer. policygrad gives it a client whose
``base_url`` is one session of its agent endpoint, so every call is a turn of the policy, trained
on the token ids it sampled::

    policygrad train configs/agent_calculator.yaml
    policygrad eval --agent examples/agents/calculator_agent.py:run --dataset builtin:arithmetic

Nothing here is specific to policygrad but the signature ``run(client, row) -> reward``: the same
function runs against any OpenAI-compatible server.
"""

from __future__ import annotations

import json

import openai

from policygrad.envs.calculator import calculate
from policygrad.rewards.verifiers import answer_matches, extract_answer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
                "required": ["expression"],
            },
        },
    }
]
# The bundled model's chat template does not render `tools`, so the system message describes the
# tool and its call format (the Hermes <tool_call> tags the endpoint parses).
SYSTEM = (
    "You can use a calculator. To call it, write "
    '<tool_call>{"name": "calculate", "arguments": {"expression": "..."}}</tool_call> and wait for the '
    "result. When you are done, reply without a tool call and give the final answer as a number on the "
    "last line."
)


async def run(client: openai.AsyncOpenAI, row: dict) -> float:
    """One episode on an arithmetic row (``prompt``, ``answer``): 1.0 when the final answer is right."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    answer = ""
    try:
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                try:
                    result = calculate(json.loads(call.function.arguments)["expression"])
                except (ValueError, KeyError, TypeError, ZeroDivisionError, OverflowError) as exc:
                    result = f"error: {exc}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError:  # policygrad ended the episode at a limit (rollout.max_turns ...)
        pass
    return 1.0 if answer_matches(extract_answer(answer), row["answer"], use_math_verify=False) else 0.0
