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
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import numbers
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from policygrad.core.diagnostics import mean_value
from policygrad.rewards.callables import awaited, callable_name
from policygrad.rewards.code import code_tests
from policygrad.rewards.reward_model import REWARD_MODEL_PREFIX
from policygrad.rewards.verifiers import answer_correctness, answer_format, length_penalty

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

RewardFn = Callable[..., Sequence[float]]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "answer_correctness": answer_correctness,
    "answer_format": answer_format,
    "length_penalty": length_penalty,
    "code_tests": code_tests,
}

ON_ERROR_MODES = ("raise", "skip")
TRUNCATION_MODES = ("none", "penalty", "exclude")
_RESERVED_FIELDS = ("prompts", "completions")


class RewardFunctionError(ValueError):
    """A reward function failed or broke the protocol; the message names the function and row."""


class RewardCallFailed(Exception):
    """A call of a reward function failed as a whole rather than on a row: it ran past
    ``reward.timeout_s`` or its worker process ended (``policygrad.rewards.isolation``). No row
    can be blamed, so :class:`CompositeReward` does not retry the rows one at a time: every row
    of the batch failed, and ``on_error`` decides (``raise`` names the function and the batch)."""


def _spec_forms() -> str:
    return (
        f"a built-in name ({', '.join(sorted(BUILTIN_REWARDS))}), 'package.module:function' "
        "or 'path/to/file.py:function'"
    )


def _split_spec(spec: str) -> tuple[str, str, str | None]:
    """``(target, attribute, path)`` of a ``module:function`` or ``file.py:function`` spec;
    ``path`` is the file's absolute path (None for a module). See :func:`load_reward_function`."""
    if ":" not in spec:
        raise ValueError(f"unknown reward function {spec!r}; give {_spec_forms()}")
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise ValueError(f"malformed reward function spec {spec!r}; give {_spec_forms()}")
    if not (target.endswith(".py") or os.sep in target or "/" in target):
        return target, attr, None
    path = os.path.abspath(os.path.expanduser(target))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"reward function file {target!r} (from spec {spec!r}) does not exist (looked at {path}); "
            "check the path, which is relative to the current directory"
        )
    return target, attr, path


def check_reward_spec(spec: str | Callable) -> None:
    """The checks of :func:`load_reward_function` that run none of the user's code: a known name,
    a well-formed spec, an existing ``.py`` file that parses, a findable top-level module. A run
    makes them before it reads any model; the function itself is loaded later, in the worker.
    ``reward_model:PATH`` entries are left to the reward-model loader.

    Raises:
        FileNotFoundError / ValueError / TypeError: as :func:`load_reward_function`.
    """
    if callable(spec):
        return
    if not isinstance(spec, str):
        raise TypeError(f"reward function spec must be a string or a callable, got {type(spec).__name__}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS or spec.startswith(REWARD_MODEL_PREFIX):
        return
    target, _, path = _split_spec(spec)
    if path is None:
        if importlib.util.find_spec(target.split(".")[0]) is None:
            raise ValueError(
                f"cannot import module {target!r} for reward function spec {spec!r} (not found); "
                "install it or put it on PYTHONPATH, or use 'path/to/file.py:function'"
            )
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    try:  # parsed, never run: whether it imports and defines the function shows when it loads
        ast.parse(source, filename=path)
    except SyntaxError as e:
        raise RewardFunctionError(
            f"reward function file {path!r} failed to load: SyntaxError: {e.msg} (line {e.lineno}); fix the "
            "file (reward.functions)"
        ) from None


def load_reward_function(spec: str | Callable) -> Callable:
    """Resolve a reward-function spec to a callable.

    Args:
        spec: a callable (returned unchanged); a built-in name from ``BUILTIN_REWARDS``;
            ``"package.module:function"`` (imported with ``importlib``; ``function`` may be a
            qualified name such as ``Class.method``, as config.yaml records a callable); or
            ``"path/to/file.py:function"`` (the file is executed as a fresh module; a relative path
            is relative to the current directory).

    Returns:
        The function (an async one wrapped to run each call to completion, see
        :func:`policygrad.rewards.callables.awaited`). It is not called here.

    Raises:
        FileNotFoundError: the ``.py`` file does not exist.
        ValueError: an unknown name, a malformed spec, a module that cannot be imported, or a
            missing attribute (the message lists the module's callables).
        TypeError: the attribute is not callable, or ``spec`` is neither a string nor a callable.
    """
    if callable(spec):
        return awaited(spec)
    if not isinstance(spec, str):
        raise TypeError(f"reward function spec must be a string or a callable, got {type(spec).__name__}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    target, attr, path = _split_spec(spec)
    if path is not None:
        module_name = f"policygrad_user_reward_{abs(hash(path)):x}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"cannot load {path!r} as a Python module; the reward file must be a .py file")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except SystemExit as exc:  # sys.exit() at module level: the file is a program, not a library
            sys.modules.pop(module_name, None)
            raise RewardFunctionError(
                f"reward function file {path!r} exited at import with status {exc.code!r} (sys.exit or exit()"
                " at module level); a reward file only defines functions: put the code that runs under "
                "if __name__ == '__main__': (reward.functions)"
            ) from None
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise RewardFunctionError(
                f"reward function file {path!r} failed to load: {type(exc).__name__}: {exc}; fix the file "
                "(reward.functions)"
            ) from exc
        where = f"file {target!r}"
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ValueError(
                f"cannot import module {target!r} for reward function spec {spec!r} ({exc}); "
                "install it or put it on PYTHONPATH, or use 'path/to/file.py:function'"
            ) from exc
        where = f"module {target!r}"
    fn: Any = module
    for part in attr.split("."):  # a qualname: the records of import_path, e.g. Class.method
        if not hasattr(fn, part):
            available = sorted(
                name for name, value in vars(module).items() if callable(value) and not name.startswith("_")
            )
            raise ValueError(
                f"{where} has no attribute {attr!r} (spec {spec!r}); its public callables are: "
                f"{', '.join(available) or '(none)'}"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{attr!r} in {where} is a {type(fn).__name__}, not a function (spec {spec!r})")
    return awaited(fn)




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


def _as_1d(name: str, value, dtype: torch.dtype) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D [B], got shape {tuple(tensor.shape)}")
    return tensor.to(dtype)


def apply_truncation_policy(
    rewards,
    truncated,
    *,
    mode: str = "none",
    penalty: float = -1.0,
    valid=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Treat completions that hit the length cap without an end-of-sequence token.

    Modes:

    * ``"none"``: rewards unchanged; truncated rows are scored like any other.
    * ``"penalty"``: the reward of every truncated row is replaced by the constant ``penalty``
      (the "EOS trick" of Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO",
      which gives a completion without EOS a score of -1 whatever its content).
    * ``"exclude"``: truncated rows are marked invalid, so the trainer leaves them out of the loss
      (DAPO's overlong filtering, Yu et al. 2025, Sec. 3.4); their reward is unchanged.

    Args:
        rewards: float [B] sequence-level rewards (tensor or list).
        truncated: bool [B], True where the completion has no EOS.
        mode: ``"none"``, ``"penalty"`` or ``"exclude"``.
        penalty: the constant reward of truncated rows in ``"penalty"`` mode (finite).
        valid: optional bool [B] validity mask to combine with (e.g. from :class:`CompositeReward`).

    Returns:
        (rewards float32 [B], valid bool [B]) as new tensors; inputs are not modified.

    Raises:
        ValueError: unknown ``mode`` (the valid ones are listed), shapes that are not [B] or differ,
            a non-finite ``penalty``.
    """
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"unknown truncation mode {mode!r}; valid modes: {', '.join(TRUNCATION_MODES)}")
    rewards_t = _as_1d("rewards", rewards, torch.float32).clone()
    truncated_t = _as_1d("truncated", truncated, torch.bool)
    valid_t = torch.ones_like(truncated_t) if valid is None else _as_1d("valid", valid, torch.bool).clone()
    if not (rewards_t.shape == truncated_t.shape == valid_t.shape):
        raise ValueError(
            f"rewards {tuple(rewards_t.shape)}, truncated {tuple(truncated_t.shape)} and valid "
            f"{tuple(valid_t.shape)} must all be [B] with the same B"
        )
    if (
        isinstance(penalty, bool)
        or not isinstance(penalty, numbers.Real)
        or not math.isfinite(float(penalty))
    ):
        raise ValueError(f"penalty must be a finite number, got {penalty!r}")
    if mode == "penalty":
        rewards_t = torch.where(truncated_t, torch.full_like(rewards_t, float(penalty)), rewards_t)
    elif mode == "exclude":
        valid_t = valid_t & ~truncated_t
    return rewards_t, valid_t
