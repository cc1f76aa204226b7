"""Reward functions by name, their weighted sum, and the treatment of truncated completions.

A reward function follows the protocol of :mod:`policygrad.rewards.verifiers`::

    fn(prompts: list[str], completions: list[str], **row_fields: list) -> list[float]

and is named in a config as a built-in (``answer_correctness``, ``answer_format``,
``length_penalty``, ``code_tests``), an importable ``package.module:function`` or a file
``path/to/file.py:function`` (:func:`load_reward_function`). :class:`CompositeReward` calls each
function once per batch, validates what it returns, and sums the weighted scores.

Errors from reward functions (a chosen policy, ``on_error``):

* ``"raise"`` (default): a function that raises, returns ``None``, a string, NaN or infinity for a
  row stops the run with :class:`RewardFunctionError` naming the function, the row index and the
  first 80 characters of the row's prompt. When the batch call raises, the function is called
  again one row at a time to find the first failing row.
* ``"skip"``: such rows are marked invalid (``valid[i] = False``, reward 0.0) and counted in the
  metric ``reward/invalid_frac``; the trainer leaves invalid rows out of the loss. A function that
  raises for every row makes every row invalid.

Returning the wrong number of scores, or something that is not a sequence of scores, breaks the
protocol for the whole batch rather than for a row; that always raises (``RewardFunctionError``),
whatever ``on_error`` says, because no row can be blamed and skipping would hide a bug.

Loading functions by name is :mod:`policygrad.rewards.specs`; the truncation policy is
:mod:`policygrad.rewards.truncation` (both re-exported here).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from policygrad.core.diagnostics import mean_value
from policygrad.rewards.callables import callable_name
from policygrad.rewards.specs import (
    BUILTIN_REWARDS,
    RewardCallFailed,
    RewardFunctionError,
    check_reward_spec,
    load_reward_function,
)
from policygrad.rewards.truncation import TRUNCATION_MODES, apply_truncation_policy

__all__ = [
    "BUILTIN_REWARDS",
    "ON_ERROR_MODES",
    "TRUNCATION_MODES",
    "CompositeReward",
    "RewardCallFailed",
    "RewardFunctionError",
    "RewardOutput",
    "apply_truncation_policy",
    "check_reward_spec",
    "load_reward_function",
    "row_fields_from_rows",
]

ON_ERROR_MODES = ("raise", "skip")
_RESERVED_FIELDS = ("prompts", "completions")


class RewardOutput(NamedTuple):
    """What :class:`CompositeReward` returns; unpacks as ``rewards, components, valid``.

    Attributes:
        rewards: float32 [B], the weighted sum ``sum_k w_k r_k``; 0.0 on invalid rows.
        components: function name -> float32 [B] of its raw (unweighted) scores; NaN where that
            function failed for the row (``on_error="skip"``).
        valid: bool [B]; False where any function failed for the row.
    """

    rewards: torch.Tensor
    components: dict[str, torch.Tensor]
    valid: torch.Tensor

    def metrics(self) -> dict[str, float]:
        """Logging metrics: ``reward/invalid_frac`` (fraction of invalid rows, in [0, 1]) and,
        per function, ``reward_fn/<name>/mean`` (mean raw score over rows where it succeeded; NaN
        when none did) and ``reward_fn/<name>/invalid`` (rows it failed on, a count)."""
        count = self.valid.numel()
        out = {"reward/invalid_frac": float((~self.valid).sum().item()) / count if count else 0.0}
        for name, scores in self.components.items():
            ok = ~torch.isnan(scores)
            out[f"reward_fn/{name}/mean"] = mean_value(scores[ok]) if ok.any() else float("nan")
            out[f"reward_fn/{name}/invalid"] = float((~ok).sum().item())
        return out


# Scores become float32 tensors: anything beyond float32's range would turn into infinity there.
FLOAT32_MAX = 3.4028234663852886e38


def _as_score(value: Any) -> float | None:
    """A finite float from one returned score, or ``None`` when it is not a finite real number
    within float32's range (|x| <= 3.4e38; a larger score would become infinite in training).

    Accepted: bool, int, float, any ``numbers.Real``, one-element tensors and numpy scalars."""
    if isinstance(value, torch.Tensor) or (hasattr(value, "item") and getattr(value, "shape", None) == ()):
        if getattr(value, "numel", lambda: 1)() != 1:
            return None
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    try:
        result = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return result if math.isfinite(result) and abs(result) <= FLOAT32_MAX else None


def _as_score_list(name: str, raw: Any, batch: int) -> list:
    """The scores a function returned for a batch, as a list of B items (not yet validated)."""
    if isinstance(raw, torch.Tensor) or hasattr(raw, "ndim"):
        if raw.ndim != 1 or len(raw) != batch:
            raise RewardFunctionError(
                f"reward function {name!r} returned an array of shape {tuple(raw.shape)} for {batch} "
                "completions; it must return one number per completion"
            )
        return list(raw.tolist())
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        raise RewardFunctionError(
            f"reward function {name!r} returned {type(raw).__name__} ({raw!r:.80}); it must return a list of "
            f"{batch} numbers, one per completion"
        )
    if len(raw) != batch:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(raw)} scores for {batch} completions; "
            "it must return one number per completion"
        )
    return list(raw)


class CompositeReward:
    """A weighted sum of reward functions with validation and a documented error policy.

    ``reward(prompts, completions, **row_fields)`` calls every function once on the whole batch
    (B rows) and returns :class:`RewardOutput`: ``rewards[i] = sum_k w_k * r_k[i]`` (float32 [B]),
    the raw per-function scores, and the validity mask (bool [B]). The error policy is described
    in the module docstring (``on_error="raise" | "skip"``).

    Args:
        functions: a non-empty list of entries, each one of: a spec or callable (weight 1.0);
            ``(spec_or_fn, weight)``; ``(spec_or_fn, weight, kwargs)``; or a mapping
            ``{"name": spec_or_fn, "weight": w, "kwargs": {...}}``. ``kwargs`` are options bound
            to the function on every call (``{"max_length": 64}`` for ``length_penalty``).
        on_error: ``"raise"`` or ``"skip"``.

    Raises:
        ValueError: empty ``functions``, a malformed entry, a non-finite weight, an unknown
            ``on_error``; any error of :func:`load_reward_function`.
    """

    def __init__(self, functions: Sequence, *, on_error: str = "raise"):
        if on_error not in ON_ERROR_MODES:
            raise ValueError(f"unknown on_error {on_error!r}; valid modes: {', '.join(ON_ERROR_MODES)}")
        if (
            isinstance(functions, (str, Mapping))
            or callable(functions)
            or not isinstance(functions, Sequence)
        ):
            functions = [functions]
        if len(functions) == 0:
            raise ValueError(
                "CompositeReward needs at least one reward function; give e.g. ['answer_correctness']"
            )
        self.on_error = on_error
        self.entries: list[tuple[str, Callable, float, dict]] = []
        seen: dict[str, int] = {}
        for position, entry in enumerate(functions):
            spec, weight, kwargs = self._parse_entry(position, entry)
            fn = load_reward_function(spec)
            base = spec if isinstance(spec, str) else callable_name(fn)
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}#{seen[base]}"
            self.entries.append((name, fn, weight, kwargs))

    @staticmethod
    def _parse_entry(position: int, entry) -> tuple[Any, float, dict]:
        kwargs: Any = {}
        weight: Any = 1.0
        if isinstance(entry, Mapping):
            unknown = set(entry) - {"name", "weight", "kwargs"}
            if "name" not in entry or unknown:
                raise ValueError(
                    f"reward function entry {position} {dict(entry)!r}: a mapping needs 'name' and may have "
                    "'weight' and 'kwargs' only"
                )
            spec, weight, kwargs = entry["name"], entry.get("weight", 1.0), entry.get("kwargs") or {}
        elif isinstance(entry, tuple):
            if len(entry) not in (2, 3):
                raise ValueError(
                    f"reward function entry {position} {entry!r}: "
                    "use (function, weight) or (function, weight, kwargs)"
                )
            spec, weight = entry[0], entry[1]
            kwargs = entry[2] if len(entry) == 3 else {}
        else:
            spec = entry
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(float(weight))
        ):
            raise ValueError(
                f"reward function entry {position}: weight must be a finite number, got {weight!r}"
            )
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"reward function entry {position}: kwargs must be a mapping, got {kwargs!r}")
        clash = set(kwargs) & set(_RESERVED_FIELDS)
        if clash:
            raise ValueError(f"reward function entry {position}: kwargs may not set {sorted(clash)}")
        return spec, float(weight), dict(kwargs)

    @property
    def names(self) -> list[str]:
        """Component names in call order (a repeated function gets ``#2``, ``#3`` ...)."""
        return [name for name, *_ in self.entries]

    def _row_message(self, name: str, index: int, prompts: Sequence[str], problem: str) -> str:
        prompt = str(prompts[index])[:80]
        return (
            f"reward function {name!r} {problem} for row {index} (prompt: {prompt!r}); fix the function, "
            "or set on_error='skip' to leave such rows out of the loss and count them in reward/invalid_frac"
        )

    def _call_rows(self, name, fn, kwargs, prompts, completions, row_fields, batch_exc):
        """Call ``fn`` one row at a time after the batch call raised; returns scores or exceptions."""
        results: list[Any] = []
        for i in range(len(prompts)):
            fields = {key: values[i : i + 1] for key, values in row_fields.items()}
            try:
                out = fn(prompts[i : i + 1], completions[i : i + 1], **fields, **kwargs)
                results.append(_as_score_list(name, out, 1)[0])
            except Exception as exc:  # noqa: BLE001 - the policy decides what a failing row means
                results.append(exc)
        if self.on_error == "raise" and not any(isinstance(r, BaseException) for r in results):
            # Row by row succeeded where the batch failed: the batch call itself is broken.
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(batch_exc).__name__}: {batch_exc} on the batch of "
                f"{len(prompts)} rows but not on any single row; fix the function"
            ) from batch_exc
        return results

    def _call_batch(self, name, fn, kwargs, prompts, completions, row_fields) -> list[Any]:
        """One function's scores of the batch, an exception in place of each failed row's score;
        after the batch call raised, row by row (:meth:`_call_rows`)."""
        try:
            raw = fn(prompts, completions, **row_fields, **kwargs)
        except RewardCallFailed as exc:  # the whole call failed: every row did, no retries
            if self.on_error == "raise":
                raise RewardFunctionError(
                    f"reward function {name!r} {exc}; fix the function (or raise reward.timeout_s), or "
                    "set on_error='skip' to leave such rows out of the loss and count them in "
                    "reward/invalid_frac"
                ) from exc
            return [exc] * len(prompts)
        except Exception as exc:  # noqa: BLE001 - the policy decides
            return self._call_rows(name, fn, kwargs, prompts, completions, row_fields, exc)
        return _as_score_list(name, raw, len(prompts))

    def _row_score(self, name: str, index: int, value: Any, prompts: Sequence[str]) -> float | None:
        """A row's score, or None when it failed or is not a usable number (with ``on_error="raise"``
        a RewardFunctionError instead)."""
        if isinstance(value, BaseException):
            if self.on_error == "raise":
                problem = f"raised {type(value).__name__}: {value}"
                raise RewardFunctionError(self._row_message(name, index, prompts, problem)) from value
            return None
        score = _as_score(value)
        if score is None and self.on_error == "raise":
            problem = (
                f"returned {value!r:.40} ({type(value).__name__}), not a finite real number "
                "within float32's range,"
            )
            raise RewardFunctionError(self._row_message(name, index, prompts, problem))
        return score

    def _check_sums(self, total: list[float], valid: list[bool]) -> None:
        """Mark invalid the rows whose weighted sum leaves float32's range (or raise)."""
        for i, t in enumerate(total):  # each score fits float32, their weighted sum may not
            if valid[i] and not abs(t) <= FLOAT32_MAX:
                if self.on_error == "raise":
                    raise RewardFunctionError(
                        f"the weighted sum of the rewards of row {i} is {t:g}, beyond float32's range "
                        "(|x| <= 3.4e38); lower the scores or reward.weights"
                    )
                valid[i] = False

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **row_fields: Sequence
    ) -> RewardOutput:
        """Score a batch.

        Args:
            prompts: B prompt strings (dataset text, before any chat template).
            completions: B decoded completion strings.
            **row_fields: dataset columns, each a sequence of B values aligned with ``prompts``
                (for G samples per prompt, repeat each row's value G times; see
                :func:`row_fields_from_rows`).

        Returns:
            RewardOutput(rewards float32 [B], components {name: float32 [B]}, valid bool [B]).

        Raises:
            ValueError: ``prompts`` and ``completions`` differ in length, or a row field is not a
                sequence of B values (the message names the field).
            RewardFunctionError: a function broke the protocol for the batch (wrong length, not
                a sequence), or, with ``on_error="raise"``, failed on a row.
        """
        prompts, completions = list(prompts), list(completions)
        batch = len(prompts)
        if len(completions) != batch:
            raise ValueError(
                f"{batch} prompts but {len(completions)} completions; pass one completion per prompt"
            )
        _check_row_fields(row_fields, batch)
        total = [0.0] * batch
        valid = [True] * batch
        components: dict[str, torch.Tensor] = {}
        for name, fn, weight, kwargs in self.entries:
            raw = self._call_batch(name, fn, kwargs, prompts, completions, row_fields)
            scores = []
            for i, value in enumerate(raw):
                score = self._row_score(name, i, value, prompts)
                if score is None:
                    valid[i] = False
                    scores.append(float("nan"))
                else:
                    scores.append(score)
                    total[i] += weight * score
            components[name] = torch.tensor(scores, dtype=torch.float32)
        self._check_sums(total, valid)
        rewards = torch.tensor([t if ok else 0.0 for t, ok in zip(total, valid)], dtype=torch.float32)
        return RewardOutput(rewards, components, torch.tensor(valid, dtype=torch.bool))

    def __repr__(self) -> str:
        parts = ", ".join(f"{name}*{weight:g}" for name, _, weight, _ in self.entries)
        return f"CompositeReward({parts}, on_error={self.on_error!r})"


def _check_row_fields(row_fields: Mapping[str, Any], batch: int) -> None:
    """Every row field is a sequence of ``batch`` values under a name the protocol does not use."""
    for key, values in row_fields.items():
        if key in _RESERVED_FIELDS:
            raise ValueError(
                f"row field {key!r} clashes with the protocol's argument; rename the dataset column"
            )
        if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, torch.Tensor)):
            raise ValueError(
                f"row field {key!r} must be a list of {batch} values (one per completion), "
                f"got {type(values).__name__}"
            )
        if len(values) != batch:
            raise ValueError(
                f"row field {key!r} has {len(values)} values for {batch} completions; "
                "repeat each prompt's value once per sample "
                "(row_fields_from_rows(rows, repeat=group_size))"
            )


def row_fields_from_rows(
    rows: Sequence[Mapping[str, Any]], *, repeat: int = 1, exclude: Sequence[str] = ("prompt",)
) -> dict[str, list]:
    """Turn dataset rows into the row-field lists of the reward protocol.

    Each key found in any row becomes a list with one value per completion; every row's value is
    repeated ``repeat`` times in a row (the layout of G samples per prompt: rows i*G .. i*G+G-1).
    A key missing from some rows gets ``None`` there.

    Args:
        rows: P dataset rows (dicts).
        repeat: G, samples per prompt (>= 1).
        exclude: keys to leave out (the prompt text is passed separately as ``prompts``).

    Returns:
        dict field -> list of P*G values.

    Raises:
        ValueError: ``repeat`` < 1, or a row key named ``prompts``/``completions``.
    """
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive integer (samples per prompt), got {repeat!r}")
    keys: list[str] = []
    for row in rows:
        for key in row:
            if key not in keys and key not in exclude:
                keys.append(key)
    for key in keys:
        if key in _RESERVED_FIELDS:
            raise ValueError(f"dataset field {key!r} clashes with the reward protocol's argument; rename it")
    return {key: [row.get(key) for row in rows for _ in range(repeat)] for key in keys}
