"""Fixtures of the lab tests: one intra-op thread, tiny models in memory and on disk."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import make_tiny_llama


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy 2-core machine spinning OpenMP
    threads make them far slower. Restored after the test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
