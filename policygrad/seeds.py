"""Every seed a run uses, derived from the one ``seed`` of its config.

A step, an update, an evaluation and each prompt's samples get seeds of their own, so each is
reproducible on its own: a resumed run samples exactly what a straight run would have, and a
prompt's samples do not depend on the batch, round or rank it lands in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from policygrad.rollout.base import prompt_seed

__all__ = ["Seeds", "offset_seed", "seeded_torch"]


def offset_seed(base: int, k: int) -> int:
    """The ``k``-th seed derived from ``base`` (``base * 1_000_003 + k``; 1,000,003 is prime, so
    the seeds of two bases do not collide for any k below it)."""
    return base * 1_000_003 + k


@dataclass(frozen=True)
class Seeds:
    """The seeds of a run with config seed ``run``.

    - :meth:`step`: torch's stream for what step i draws from it, each in a scope of its own
      (:func:`seeded_torch`): an engine without per-prompt seeds, dropout in the update;
    - :meth:`update`: the minibatch permutations of step i's update;
    - :meth:`evaluation`: the sampled evaluation after step i;
    - :meth:`prompts`: one seed per prompt of a step's sampling round (SHA-256 of run seed, step,
      round and the prompt's position in the step's global batch).
    """

    run: int

    def step(self, step: int) -> int:
        return offset_seed(self.run, step)

    def update(self, step: int) -> int:
        return self.run * 7919 + step

    def evaluation(self, step: int) -> int:
        return offset_seed(self.run, step)

    def prompts(self, step: int, round_index: int, n: int) -> list[int]:
        """Seeds of the ``n`` prompts of round ``round_index`` of step ``step``."""
        return [prompt_seed(self.run, step, round_index, i) for i in range(n)]


@contextlib.contextmanager
def seeded_torch(seed: int) -> Iterator[None]:
    """A scope in which torch's global RNG (CPU and every CUDA device) starts from ``seed``; the
    caller's stream is put back on exit (``torch.random.fork_rng``), so what runs inside draws
    the same numbers wherever it runs, and nothing outside sees its draws."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
