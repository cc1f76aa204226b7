"""Shared pytest fixtures."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.tiny import make_tiny_llama

# trackio reads TRACKIO_DIR once, when it is first imported: point it at a temporary folder before
# any test can import it, so no test writes into the user's trackio store.
os.environ["TRACKIO_DIR"] = tempfile.mkdtemp(prefix="policygrad-tests-trackio-")


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restored after it: tiny models gain nothing from more,
    and on a busy 2-core machine spinning OpenMP threads make each step about 50x slower.
    Packages and modules of tiny-model tests turn it on for all their tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
