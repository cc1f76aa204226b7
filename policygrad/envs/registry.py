"""Environment specs -> a factory of fresh environments, one per episode.

A spec is ``builtin:NAME`` (:data:`BUILTIN_ENVIRONMENTS`), ``package.module:Class``,
``path/to/file.py:Class``, or an object: an :class:`~policygrad.envs.base.Environment` subclass
or any callable that returns a new environment when called with the ``env.options`` as keyword
arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from policygrad.envs.base import Environment
from policygrad.envs.workers import probe_in_worker

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "EnvironmentFactory",
    "check_environment_spec",
    "environment_factory",
    "load_spec",
]

BUILTIN_PREFIX = "builtin:"
# name -> "module:Class", imported on use.
BUILTIN_ENVIRONMENTS = {
    "guess": "policygrad.envs.guess:GuessEnv",
    "calculator": "policygrad.envs.calculator:CalculatorEnv",
    "code_feedback": "policygrad.envs.code_feedback:CodeFeedbackEnv",
}


class NotAnEnvironment(TypeError):
    """The spec built something without ``reset()`` and ``step()``."""


def _forms() -> str:
    names = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_ENVIRONMENTS)
    return f"{names}, 'package.module:Class' or 'path/to/file.py:Class'"


def check_environment_spec(spec: Any, field: str = "env.name") -> None:
    """The checks of :func:`environment_factory` that run none of the user's code (a known
    built-in, a well-formed spec, an existing file, a findable module).

    Raises:
        ValueError: an unknown built-in, a malformed spec, a module that cannot be found.
        FileNotFoundError: a ``.py`` file that does not exist.
        TypeError: neither a string nor a callable (an environment instance: named as such, with
            the class or factory to pass instead).
    """
    if callable(spec):
        return
    if not isinstance(spec, str):
        kind = type(spec).__name__
        if all(callable(getattr(spec, m, None)) for m in ("reset", "step")):
            # Each episode resets and steps its own environment, and a group's G episodes run at
            # once: one shared instance would mix their states.
            raise TypeError(
                f"env is an environment instance ({kind}), but every episode needs its own (a group's "
                f"episodes run at once, each resetting and stepping it): pass the class, env={kind}, with "
                f"its arguments in env.options, or a factory that returns a new one, env=lambda: {kind}(...)"
            )
        raise TypeError(f"env.name must be a string or an Environment class, got {kind}")
    spec = spec.strip()
    if spec.startswith(BUILTIN_PREFIX):
        if spec[len(BUILTIN_PREFIX) :] not in BUILTIN_ENVIRONMENTS:
            raise ValueError(f"unknown environment {spec!r}; give {_forms()}")
        return
    target, _, attr = spec.rpartition(":")
    env = field == "env.name"
    if not target or not attr:
        forms = _forms() if env else "'package.module:function' or 'path/to/file.py:function'"
        raise ValueError(f"malformed {'environment spec' if env else field} {spec!r}; give {forms}")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = os.path.abspath(os.path.expanduser(target))
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{'environment' if env else 'agent'} file {target!r} ({field} {spec!r}) does not exist "
                f"(looked at {path})"
            )
    elif importlib.util.find_spec(target.split(".")[0]) is None:
        raise ValueError(
            f"cannot import module {target!r} for {field} {spec!r}; install it or put it on "
            f"PYTHONPATH, or use 'path/to/file.py:{'Class' if env else 'function'}'"
        )


def load_spec(spec: str, field: str = "env.name", kind: str = "environment") -> Any:
    """The object ``spec`` names: ``builtin:NAME`` (environments only), ``package.module:attr`` or
    ``path/to/file.py:attr`` (the file loaded as a module of its own).

    Args:
        spec: the spec.
        field: the config field it came from, named in errors.
        kind: what it should name (``environment``, ``agent``), named in errors.

    Raises:
        ValueError / FileNotFoundError: as :func:`check_environment_spec`; a file that does not
            load or exits at import; a module that cannot be imported; a missing attribute.
    """
    spec = spec.strip()
    if spec.startswith(BUILTIN_PREFIX) and kind == "environment":
        check_environment_spec(spec)
        spec = BUILTIN_ENVIRONMENTS[spec[len(BUILTIN_PREFIX) :]]
    check_environment_spec(spec, field)
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = os.path.abspath(os.path.expanduser(target))
        name = f"policygrad_user_{kind[:3]}_{abs(hash(path)):x}"
        loader = importlib.util.spec_from_file_location(name, path)
        if loader is None or loader.loader is None:
            raise ValueError(f"cannot load {path!r} as a Python module ({field} {spec!r})")
        module = importlib.util.module_from_spec(loader)
        sys.modules[name] = module
        try:
            loader.loader.exec_module(module)
        except SystemExit as exc:  # sys.exit() at module level would end the command without a word
            sys.modules.pop(name, None)
            raise ValueError(
                f"{kind} file {path!r} exited at import with status {exc.code!r} (sys.exit or exit() at "
                f"module level); an {kind} file only defines things: put the code that runs under "
                f"if __name__ == '__main__': ({field} {spec!r})"
            ) from None
        except Exception as exc:
            sys.modules.pop(name, None)
            raise ValueError(f"{kind} file {path!r} failed to load: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            raise ValueError(f"cannot import {target!r} for {field} {spec!r} ({exc})") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            found = _what_it_has(obj, target) if kind == "environment" else "check the name after ':'"
            raise ValueError(f"{target!r} has no attribute {attr!r} ({field} {spec!r}); {found}")
        obj = getattr(obj, part)
    return obj


def _what_it_has(obj: Any, target: str) -> str:
    """The fix of a spec naming something ``obj`` (a module or class) does not have: the
    Environment subclasses it defines, else its other classes, else that it defines none."""
    own = getattr(obj, "__name__", None)
    classes = [
        name for name, value in vars(obj).items()
        if isinstance(value, type) and not name.startswith("_") and getattr(value, "__module__", own) == own
    ]
    envs = [name for name in classes if issubclass(getattr(obj, name), Environment)]
    if envs:
        return f"its Environment classes: {', '.join(sorted(envs))}; give {target}:NAME with one of them"
    if classes:
        listed = ", ".join(sorted(classes))
        return f"it defines no Environment subclass (its classes: {listed}); give {target}:Class"
    return f"it defines no class; give {target}:Class of an Environment subclass defined in it"


class EnvironmentFactory:
    """Builds a fresh environment per call: ``target(**options)``, checked to have ``reset()``
    and ``step()``. Picklable by its spec when ``spec`` is a string (a worker process loads it
    again, :mod:`policygrad.envs.workers`), else by the standard pickle of ``target``.

    Raises (when called):
        NotAnEnvironment: what ``target`` built has no ``reset()``/``step()``.
    """

    def __init__(self, spec: Any, target: Callable[..., Any], options: dict[str, Any]):
        self.spec, self.target, self.options = spec, target, options

    def __call__(self) -> Environment:
        env = self.target(**self.options)
        if not all(callable(getattr(env, m, None)) for m in ("reset", "step")):
            raise NotAnEnvironment(
                f"env.name {self.spec!r} built a {type(env).__name__}, which has no reset()/step(); "
                "subclass policygrad.envs.Environment"
            )
        return env

    def __reduce__(self):
        if isinstance(self.spec, str):
            return _factory_of_spec, (self.spec, self.options)
        return EnvironmentFactory, (self.spec, self.target, self.options)


def _factory_of_spec(spec: str, options: dict[str, Any]) -> EnvironmentFactory:
    return EnvironmentFactory(spec, load_spec(spec), options)


def environment_factory(
    spec: Any,
    options: Mapping[str, Any] | None = None,
    *,
    isolation: bool = False,
    timeout_s: float | None = None,
) -> EnvironmentFactory:
    """A function of no arguments that builds a fresh environment for one episode
    (:class:`EnvironmentFactory`).

    Args:
        spec: see the module docstring.
        options: keyword arguments of the class or factory (``env.options``).
        isolation: build the check's environment in a worker process of its own
            (:func:`~policygrad.envs.workers.probe_in_worker`; ``rollout.env_isolation``), so its
            ``os._exit``, crash or ``chdir`` cannot end or move the caller; else (or when it
            cannot be sent to a worker) in this process.
        timeout_s: with ``isolation``, the most seconds the check's build and ``close()`` may
            each take (``rollout.env_step_timeout_s``; None: 120 s).

    Raises:
        ValueError / FileNotFoundError / TypeError: as :func:`check_environment_spec`; a spec
            that names something not callable; options the class rejects (checked by building
            one environment here, so a typo shows at start, not in the first step).
    """
    check_environment_spec(spec)  # an instance or another non-callable object: named before load_spec
    target = spec if callable(spec) else load_spec(spec)
    if not callable(target):
        raise TypeError(f"env.name {spec!r} names a {type(target).__name__}, not a class or factory")
    make = EnvironmentFactory(spec, target, dict(options or {}))

    shown = spec if isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
    if isolation and probe_in_worker(make, shown, timeout_s):
        return make
    try:
        probe = make()
    except NotAnEnvironment:
        raise
    except (TypeError, ValueError) as exc:  # the class refused the options (a name, a value)
        raise ValueError(f"env.options do not fit {shown}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the user's constructor: one line, not a traceback
        raise ValueError(f"env.name {shown} could not be built: {type(exc).__name__}: {exc}") from exc
    close = getattr(probe, "close", None)
    if callable(close):
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - the user's close(): one line, not a traceback
            raise ValueError(f"env.name {shown}: close() failed: {type(exc).__name__}: {exc}") from exc
    return make
