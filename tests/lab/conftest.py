"""Fixtures of the lab tests: one intra-op thread, tiny models in memory and on disk."""

from __future__ import annotations

import pytest

from tests.tiny import make_tiny_llama


@pytest.fixture(autouse=True)
def _every_test_on_one_thread(one_thread):
    """The ``one_thread`` fixture of tests/conftest.py for every test here."""


@pytest.fixture(scope="session")
def tiny_lm():
    """``(model, tokenizer)``: the tiny Llama of ``tests.tiny`` (seed 0), float32, eval mode."""
    model, tokenizer = make_tiny_llama(seed=0)
    model.eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def tiny_lm_dir(tmp_path_factory) -> str:
    """A model folder holding the same tiny Llama (for config-only and CLI tests)."""
    path = tmp_path_factory.mktemp("lab_tiny_llama")
    make_tiny_llama(path, seed=0)
    return str(path)
