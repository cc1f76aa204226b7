"""Whether a generation engine can be used here, answered without importing it."""

from __future__ import annotations

import importlib.util

__all__ = ["vllm_available"]


def vllm_available() -> bool:
    """True when the ``vllm`` package is importable (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None
