"""``builtin:calculator``: arithmetic word problems with a calculator tool.

The model may call ``calculate(expression)`` (:mod:`policygrad.envs.tools`, Hermes/Qwen
``<tool_call>`` tags) as often as it likes, up to ``max_tool_calls`` per turn; the turn without a
tool call is its final answer, scored like ``answer_correctness``: 1.0 when its final number
(:func:`policygrad.rewards.verifiers.extract_answer`) equals the row's ``answer``. Rows:
``builtin:arithmetic`` and GSM8K (Cobbe et al. 2021), i.e. any row with ``prompt`` and
``answer``. A tool-use setting in the spirit of Toolformer (Schick et al. 2023) and ReTool /
ToolRL-style RL on calculators.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policygrad.envs.tools import ToolEnv
from policygrad.rewards.verifiers import answer_matches, extract_answer

__all__ = ["CalculatorEnv", "calculate"]


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

    Args:
        expression: the expression, e.g. "(12 + 7) * 3".
    """
    # Runs in the sandbox on its own (only this function's source is sent): everything it needs
    # is inside. The expression is the model's: parsed with ast, never eval'd, and only numbers
    # and arithmetic operators are accepted; exponents and results are bounded so that a single
    # call cannot spend the tool's time limit on one enormous integer.
    import ast
    import operator

    binary = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
              ast.Pow: operator.pow}
    unary = {ast.UAdd: operator.pos, ast.USub: operator.neg}

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in unary:
            return unary[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in binary:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 1000 or abs(left) > 10**6 and right > 100):
                raise ValueError("exponent too large")
            out = binary[type(node.op)](left, right)
            if isinstance(out, complex):
                raise ValueError("the result is not a real number")
            if isinstance(out, int) and out.bit_length() > 3000:
                raise ValueError("the result is too large")
            return out
        raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")

    text = expression.replace("^", "**").replace("×", "*").replace("÷", "/").replace(",", "")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression[:100]!r}") from None
    result = value(tree.body)
    if isinstance(result, float) and result.is_integer() and abs(result) < 2**53:
        result = int(result)
    return str(result)


class CalculatorEnv(ToolEnv):
    """Arithmetic problems with the ``calculate`` tool (module docstring).

    Args:
        max_tool_calls: tool calls run per turn (default 4).
        tool_timeout_s: wall seconds per tool call (default 5).
        isolation: the tools' sandbox (``"auto"``; ``"none"``: no isolation, unsafe).
        describe_tools: the tools' description in the system message (False when the runner
            passes :meth:`tool_schemas` to the chat template).

    Raises:
        ValueError, SandboxUnavailable: as :class:`~policygrad.envs.tools.ToolEnv`.
        KeyError: :meth:`reset` on a row without ``prompt`` or ``answer``.
    """

    tools = (calculate,)

    def __init__(self, *, max_tool_calls: int = 4, tool_timeout_s: float = 5.0, isolation: str = "auto",
                 describe_tools: bool = True):
        super().__init__(max_tool_calls=max_tool_calls, tool_timeout_s=tool_timeout_s,
                         isolation=isolation, describe_tools=describe_tools)

    def instructions(self) -> str:
        return ("Use the calculate tool for arithmetic. When you are done, reply without a tool call "
                "and give the final answer as a number on the last line.")

    def reset(self, row: Mapping[str, Any], *, seed: int) -> list[dict[str, str]]:
        if "answer" not in row:
            raise KeyError(f"CalculatorEnv needs rows with an 'answer' field; got {sorted(row)}")
        return super().reset(row, seed=seed)

    def final_reward(self, stop_reason: str) -> float:  # noqa: ARG002 - a truncated answer is scored as is
        """1.0 when the last turn's final number equals the row's ``answer``, else 0.0 (also with
        no turn, or when the last turn was a tool call)."""
        if self.last_action is None:
            return 0.0
        predicted = extract_answer(self.last_action)
        return 1.0 if answer_matches(predicted, self.row["answer"], use_math_verify=False) else 0.0
