"""Reward functions by name: the built-ins, ``package.module:function`` and
``path/to/file.py:function`` specs, checked before a run (:func:`check_reward_spec`, none of the
user's code runs) and loaded (:func:`load_reward_function`); and the errors of reward functions.

A reward function follows the protocol of :mod:`policygrad.rewards.verifiers`; how the loaded
functions are called and summed is :mod:`policygrad.rewards.registry`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from policygrad.rewards.callables import awaited
from policygrad.rewards.code import code_tests
from policygrad.rewards.reward_model import REWARD_MODEL_PREFIX
from policygrad.rewards.verifiers import answer_correctness, answer_format, length_penalty

__all__ = [
    "BUILTIN_REWARDS",
    "RewardCallFailed",
    "RewardFunctionError",
    "check_reward_spec",
    "load_reward_function",
]

RewardFn = Callable[..., Sequence[float]]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "answer_correctness": answer_correctness,
    "answer_format": answer_format,
    "length_penalty": length_penalty,
    "code_tests": code_tests,
}



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
