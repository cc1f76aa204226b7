"""The user reward module that the isolation and reward-worker tests load (as ``file.py:function``
specs): functions that score, exit, crash, move, sleep, pop their inputs and read the environment."""

from __future__ import annotations

import os

import pytest

USER_REWARDS = """
import os
import sys
import time


def ok(prompts, completions, **fields):
    return [float(len(c)) for c in completions]


def exits(prompts, completions, **fields):
    sys.exit(0)


class Custom(BaseException):
    pass


def raises_base_exception(prompts, completions, **fields):
    raise Custom("not an Exception")


def hard_exit(prompts, completions, **fields):
    os._exit(0)


def moves(prompts, completions, **fields):
    os.chdir("/")
    return [0.5] * len(completions)


def where(prompts, completions, **fields):
    return [float(os.getcwd() == {cwd!r})] * len(completions)


def pops(prompts, completions, tests=None, **fields):
    scores = [float(len(t)) for t in tests]
    for t in tests:
        t.pop()
    completions.clear()
    return scores


def sleeps(prompts, completions, **fields):
    time.sleep(10_000)


def tensor(prompts, completions, **fields):
    import torch

    return torch.full((len(completions),), 0.25)


def matrix(prompts, completions, **fields):
    import torch

    return torch.zeros(len(completions), 2)


class Score:
    pass


def custom_objects(prompts, completions, **fields):
    return [Score() for _ in completions]


def huge(prompts, completions, **fields):
    return [1e39] * len(completions)


def naps(prompts, completions, **fields):
    time.sleep(1.0)
    return [float(len(c)) for c in completions]


def env_value(prompts, completions, **fields):
    return [float(os.environ.get("POLICYGRAD_TEST_RUN_VALUE", "-1"))] * len(completions)
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user_rewards") / "user_rewards.py"
    path.write_text(USER_REWARDS.format(cwd=os.getcwd()))
    return str(path)

