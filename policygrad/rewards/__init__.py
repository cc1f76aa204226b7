"""Reward functions: rule-based verifiers, their registry and weighted sum, truncation handling.

Protocol: ``fn(prompts: list[str], completions: list[str], **row_fields: list) -> list[float]``,
one finite score per completion; each row field is a list aligned with ``prompts``.
"""

from policygrad.rewards.registry import (
    BUILTIN_REWARDS,
    ON_ERROR_MODES,
    TRUNCATION_MODES,
    CompositeReward,
    RewardFunctionError,
    RewardOutput,
    apply_truncation_policy,
    load_reward_function,
    row_fields_from_rows,
)
from policygrad.rewards.verifiers import (
    answer_correctness,
    answer_format,
    answer_matches,
    extract_answer,
    length_penalty,
    math_verify_available,
    normalize_number,
    parse_number,
)

__all__ = [
    "BUILTIN_REWARDS",
    "ON_ERROR_MODES",
    "TRUNCATION_MODES",
    "CompositeReward",
    "RewardFunctionError",
    "RewardOutput",
    "answer_correctness",
    "answer_format",
    "answer_matches",
    "apply_truncation_policy",
    "extract_answer",
    "length_penalty",
    "load_reward_function",
    "math_verify_available",
    "normalize_number",
    "parse_number",
    "row_fields_from_rows",
]
