"""Shared pytest fixtures."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.tiny import make_tiny_llama

# trackio reads TRACKIO_DIR once, when it is first imported: point it at a temporary folder before
# any test can import it, so no test writes into the user's trackio store.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="policygrad-tests-trackio-")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A local Hugging Face model folder holding the tiny Llama of ``tests.tiny`` (seed 0)."""
    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_llama(path, seed=0)
    return str(path)


def pytest_collection_modifyitems(config, items):
    """Every test belongs to one tier: ``unit`` (no model, seconds) or ``integration``."""
    for item in items:
        tiers = {m.name for m in item.iter_markers()} & {"unit", "integration"}
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: mark it unit or integration (found {sorted(tiers)})")
