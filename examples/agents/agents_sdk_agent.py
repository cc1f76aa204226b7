"""The calculator agent built with the OpenAI Agents SDK (``pip install openai-agents``), trained
with policygrad unchanged: the SDK's model is pointed at the client policygrad gives, and its
tracing (which would send traces to OpenAI) is turned off::

    policygrad train configs/agent_calculator.yaml --agent.function=examples/agents/agents_sdk_agent.py:run
"""

from __future__ import annotations

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI, BadRequestError

from policygrad.envs.calculator import calculate
from policygrad.rewards.verifiers import answer_matches, extract_answer

set_tracing_disabled(True)

INSTRUCTIONS = (
    "You can use a calculator. To call it, write "
    '<tool_call>{"name": "calculate", "arguments": {"expression": "..."}}</tool_call> and wait for the '
    "result. When you are done, reply without a tool call and give the final answer as a number on the "
    "last line."
)


@function_tool
def calculate_tool(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses."""
    try:
        return calculate(expression)
    except (ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"


calculate_tool.name = "calculate"


async def run(client: AsyncOpenAI, row: dict) -> float:
    """One episode on an arithmetic row (``prompt``, ``answer``): 1.0 when the final answer is right."""
    agent = Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        tools=[calculate_tool],
        model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
    )
    try:
        result = await Runner.run(agent, row["prompt"], max_turns=3)
    except (BadRequestError, MaxTurnsExceeded):  # a limit ended the episode (policygrad's or the SDK's)
        return 0.0
    answer = str(result.final_output or "")
    return 1.0 if answer_matches(extract_answer(answer), row["answer"], use_math_verify=False) else 0.0
