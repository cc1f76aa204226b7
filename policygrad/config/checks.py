"""The base of the configuration tree: :class:`ConfigError`, the bounds every section shares and
the checks it validates with (:func:`check_choice`, :func:`check_positive`, :func:`check_at_most`),
and :func:`read_chat_template`, which resolves ``data.chat_template`` for the run and its plan.

Every error is one line that names the dotted field and says how to fix it.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "MAX_ENV_RETRIES",
    "MIN_TEMPERATURE",
    "ConfigError",
    "check_at_most",
    "check_choice",
    "check_positive",
    "parse_cpus",
    "read_chat_template",
]


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range. The message names the field."""


# The smallest sampling temperature: below it the tempered logits of a float32 model overflow or
# the log-probs of every token but the top one are -1e30-like numbers with no usable precision.
MIN_TEMPERATURE = 1e-3
# The most fresh attempts of a failed episode (rollout.env_retries): each is a whole episode again.
MAX_ENV_RETRIES = 10


def check_choice(path: str, value: Any, choices) -> None:
    """Raise a :class:`ConfigError` naming ``path`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{path}={value!r} is not valid; choose one of {sorted(choices)}")


def check_positive(path: str, value, *, allow_zero: bool = False, why: str = "") -> None:
    """Raise a :class:`ConfigError` naming ``path`` unless ``value`` is a number > 0 (>= 0 with
    ``allow_zero``). ``why``: appended to the message (what the field means, what a bad value would do)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{path} must be {bound}, got {value!r}{why}")


def check_at_most(path: str, value, limit: float, *, low: str = "[0", why: str = "") -> None:
    """Raise a :class:`ConfigError` naming ``path`` and its valid range (``low``: its lower end as
    written, ``[0`` or ``(0``) when ``value`` (a number, its lower bound already checked) is above
    ``limit``."""
    if value > limit:
        raise ConfigError(f"{path} must be in {low}, {limit:g}], got {value!r}{why}")


def parse_cpus(path: str, spec) -> list[int]:
    """CPU ids of a list like ``"1"``, ``"2-3"`` or ``"0,2,4-5"`` (Linux's cpulist format), in
    order, each once.

    Raises:
        ConfigError: not such a list, naming ``path``.
    """
    cpus: list[int] = []
    text = str(spec).strip()
    for part in text.split(",") if text else []:
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) < int(low)):
            raise ConfigError(f"{path}: {spec!r} is not a CPU list like \"1\", \"2-3\" or \"0,2,4-5\"")
        for cpu in range(int(low), int(high or low) + 1):
            if cpu not in cpus:
                cpus.append(cpu)
    if not cpus:
        raise ConfigError(f"{path}: {spec!r} names no CPU; give a CPU list like \"1\" or \"2-3\"")
    return cpus


def read_chat_template(value: str) -> str:
    """``data.chat_template``: the text of the file it names, or the template itself.

    Raises:
        ConfigError: a file that cannot be read.
    """
    path = os.path.expanduser(value)
    if "{" not in value and os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as handle:
                return handle.read()
        except OSError as exc:
            raise ConfigError(f"data.chat_template: cannot read {path!r} ({exc})") from exc
    if "{" not in value:
        raise ConfigError(
            f"data.chat_template={value!r} is neither a Jinja template nor an existing file; give the "
            "template text or its path"
        )
    return value
