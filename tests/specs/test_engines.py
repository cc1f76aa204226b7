"""Tests of policygrad.specs.engines: whether vLLM is installed, answered without importing it."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from policygrad.specs import engines

pytestmark = pytest.mark.unit


def test_vllm_available_looks_without_importing(monkeypatch):
    seen = []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: seen.append(name) or object())
    assert engines.vllm_available() is True and seen == ["vllm"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda _name: None)
    assert engines.vllm_available() is False
    assert "vllm" not in sys.modules or sys.modules["vllm"] is not None
