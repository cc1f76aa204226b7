"""What the tests of benchmarks/ share: importing a script the way the scripts import each other."""

from __future__ import annotations

import importlib
import os

import pytest

BENCH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"
)


@pytest.fixture
def import_script(monkeypatch):
    """``import_script("levers")`` imports ``benchmarks/levers.py``: the scripts import one another
    (``_common``, ``_roofline``) by bare name, so benchmarks/ goes on ``sys.path`` for the test."""
    monkeypatch.syspath_prepend(BENCH)
    return importlib.import_module
