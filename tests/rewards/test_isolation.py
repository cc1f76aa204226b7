"""User reward functions run in a worker process: copies of their inputs, timeouts, exits and
crashes contained, the working directory unchanged, only plain data back; the same protocol and
error policy as in-process (``CompositeReward``)."""

from __future__ import annotations

import os

import pytest

from policygrad.rewards.callables import describe_object
from policygrad.rewards.isolation import is_user_reward, isolate_reward_functions
from policygrad.rewards.registry import CompositeReward, RewardFunctionError, row_fields_from_rows

pytestmark = pytest.mark.integration  # starts worker processes


@pytest.fixture(scope="module")
def isolated(user_file):
    """name -> an isolated function (one worker for all, 2 s timeout)."""
    names = [
        "ok",
        "exits",
        "raises_base_exception",
        "hard_exit",
        "moves",
        "where",
        "pops",
        "sleeps",
        "tensor",
        "matrix",
        "custom_objects",
        "huge",
    ]
    functions, worker = isolate_reward_functions([f"{user_file}:{n}" for n in names], timeout_s=2.0)
    yield dict(zip(names, functions))
    worker.close()


def _score(fn, on_error="skip", n=2, **fields):
    return CompositeReward([fn], on_error=on_error)(["p"] * n, ["ab", "c"][:n], **fields)


def test_only_user_code_is_isolated(user_file):
    assert is_user_reward(f"{user_file}:ok") and is_user_reward("my_pkg.rewards:score")
    assert not is_user_reward("answer_correctness") and not is_user_reward("reward_model:/models/rm")
    functions, worker = isolate_reward_functions(["answer_correctness", "length_penalty"])
    assert worker is None and functions == ["answer_correctness", "length_penalty"]


def test_an_isolated_function_scores_like_in_process(isolated, user_file):
    out = _score(isolated["ok"])
    assert out.rewards.tolist() == [2.0, 1.0] and out.valid.all()
    assert list(out.components) == [f"{user_file}:ok"]  # the same component name
    assert _score(isolated["tensor"]).rewards.tolist() == [0.25, 0.25]


def test_exits_and_crashes_end_the_call_not_the_trainer(isolated):
    for name in ("exits", "raises_base_exception", "hard_exit"):
        out = _score(isolated[name])
        assert not out.valid.any(), name
    with pytest.raises(RewardFunctionError, match=r"exits' raised SystemExit: 0 for row 0"):
        _score(isolated["exits"], on_error="raise")
    with pytest.raises(RewardFunctionError, match=r"raised Custom: not an Exception for row 0"):
        _score(isolated["raises_base_exception"], on_error="raise")
    with pytest.raises(RewardFunctionError, match=r"hard_exit' ended its worker process \(exit status 0"):
        _score(isolated["hard_exit"], on_error="raise")
    assert _score(isolated["ok"]).valid.all()  # a fresh worker serves the next call


def test_the_working_directory_is_the_same_after_a_call(isolated):
    cwd = os.getcwd()
    assert _score(isolated["moves"]).rewards.tolist() == [0.5, 0.5]
    assert os.getcwd() == cwd
    assert _score(isolated["where"]).rewards.tolist() == [1.0, 1.0]  # the worker's, restored too


def test_every_call_and_row_gets_its_own_copies(isolated):
    shared = [1, 2, 3]  # one dataset row's list, repeated for its G samples
    completions = ["ab", "c"]
    for _ in range(2):
        out = CompositeReward([isolated["pops"]], on_error="raise")(
            ["p", "p"], completions, tests=[shared, shared]
        )
        assert out.rewards.tolist() == [3.0, 3.0]
    assert shared == [1, 2, 3] and completions == ["ab", "c"]


def test_a_call_over_its_timeout_is_stopped(isolated):
    out = _score(isolated["sleeps"])
    assert not out.valid.any()
    with pytest.raises(
        RewardFunctionError, match=r"sleeps' did not return within reward.timeout_s=2 s on a batch of 2"
    ):
        _score(isolated["sleeps"], on_error="raise")
    assert _score(isolated["ok"]).valid.all()


def test_protocol_errors_and_out_of_range_scores_read_as_in_process(isolated):
    with pytest.raises(RewardFunctionError, match=r"returned an array of shape \(2, 2\) for 2 completions"):
        _score(isolated["matrix"])
    with pytest.raises(RewardFunctionError, match=r"returned <.*\(Score\), not a finite real number"):
        _score(isolated["custom_objects"], on_error="raise")
    with pytest.raises(
        RewardFunctionError, match=r"returned 1e\+39 \(float\), not a finite real number within float32"
    ):
        _score(isolated["huge"], on_error="raise")


def test_a_spec_that_does_not_load_is_refused_before_the_run(user_file, tmp_path):
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        isolate_reward_functions([f"{user_file}:nope"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        isolate_reward_functions([f"{tmp_path}/missing.py:f"])


def test_without_isolation_inputs_are_still_copied_and_exits_contained(user_file):
    functions, worker = isolate_reward_functions([f"{user_file}:pops", f"{user_file}:exits"], isolation=False)
    assert worker is None
    shared = [1, 2, 3]
    out = CompositeReward([functions[0]])(["p", "p"], ["a", "b"], tests=[shared, shared])
    assert out.rewards.tolist() == [3.0, 3.0] and shared == [1, 2, 3]
    assert not _score(functions[1]).valid.any()


CALLABLE_REWARDS = """
import os
import sys
import time


def pid(prompts, completions, **fields):
    return [float(os.getpid())] * len(completions)


def exits(prompts, completions, **fields):
    sys.exit(0)


def hard_exit(prompts, completions, **fields):
    os._exit(0)


def rewrites(prompts, completions, tests=None, **fields):
    for t in tests:
        t.append("rewritten")
    completions[:] = ["rewritten"] * len(completions)
    return [1.0] * len(completions)


def sleeps(prompts, completions, **fields):
    time.sleep(20)
    return [1.0] * len(completions)


class Group:
    @staticmethod
    def length(prompts, completions, **fields):
        return [float(len(c)) for c in completions]


class Scaled:
    def __init__(self, factor):
        self.factor = factor

    def __call__(self, prompts, completions, **fields):
        return [self.factor * len(c) for c in completions]
"""


@pytest.fixture(scope="module")
def callables(tmp_path_factory):
    """An importable module of reward callables (its folder on sys.path only in this process)."""
    import importlib
    import sys

    folder = tmp_path_factory.mktemp("callable_rewards")
    (folder / "pg_callable_rewards.py").write_text(CALLABLE_REWARDS)
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("pg_callable_rewards")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("pg_callable_rewards", None)


def test_an_importable_callable_runs_in_the_worker(callables):
    import functools

    objects = [callables.pid, callables.Scaled(0.5), functools.partial(callables.Scaled(2.0))]
    functions, worker = isolate_reward_functions(objects, timeout_s=10.0)
    try:
        out = CompositeReward(functions, on_error="raise")(["p", "p"], ["ab", "c"])
        assert out.components["pid"].tolist()[0] != float(os.getpid())  # another process
        assert list(out.components) == CompositeReward(objects).names  # the names they had in-process
        assert out.components["Scaled"].tolist() == [1.0, 0.5]
        assert out.components["Scaled#2"].tolist() == [4.0, 2.0]  # a partial is named after its callable
    finally:
        if worker is not None:
            worker.close()


def test_a_callable_that_exits_ends_the_call_not_the_run(callables):
    import sys

    def closure_exits(_prompts, _completions, **_fields):
        sys.exit(0)

    specs = [callables.exits, callables.hard_exit, closure_exits, callables.pid]
    functions, worker = isolate_reward_functions(specs, timeout_s=10.0)
    try:
        for fn in functions[:3]:
            assert not _score(fn).valid.any(), fn
        with pytest.raises(RewardFunctionError, match=r"'exits' raised SystemExit: 0 for row 0"):
            _score(functions[0], on_error="raise")
        with pytest.raises(RewardFunctionError, match=r"'hard_exit' ended its worker process \(exit status"):
            _score(functions[1], on_error="raise")
        with pytest.raises(RewardFunctionError, match=r"'closure_exits' raised SystemExit: 0 for row 0"):
            _score(functions[2], on_error="raise")
        assert _score(functions[3]).valid.all()  # sent again to the fresh worker
    finally:
        if worker is not None:
            worker.close()


def test_callables_get_their_own_copies_of_the_completions_and_the_users_rows(callables):
    def closure_rewrites(prompts, completions, tests=None, **_fields):
        return callables.rewrites(prompts, completions, tests=tests)

    def checks(_prompts, completions, tests=None, **_fields):
        return [float(c in ("ab", "c") and t == [1, 2]) for c, t in zip(completions, tests)]

    rows = [{"prompt": "p", "tests": [1, 2]}]  # the user's dataset row, repeated for 2 samples
    completions = ["ab", "c"]
    for first in (callables.rewrites, closure_rewrites):  # in the worker, then in-process
        functions, worker = isolate_reward_functions([first, checks], timeout_s=10.0)
        try:
            out = CompositeReward(functions)(["p", "p"], completions, **row_fields_from_rows(rows, repeat=2))
            assert out.components["checks"].tolist() == [1.0, 1.0], first
        finally:
            if worker is not None:
                worker.close()
    assert rows == [{"prompt": "p", "tests": [1, 2]}] and completions == ["ab", "c"]


def test_a_callable_over_its_timeout_fails_its_batch(callables):
    import threading
    import time

    release = threading.Event()

    def closure_hangs(_prompts, completions, **_fields):
        release.wait(20)
        return [1.0] * len(completions)

    # Loaded with time to start a cold worker; then each call gets 1 s.
    functions, worker = isolate_reward_functions([closure_hangs, callables.sleeps], timeout_s=30.0)
    try:
        assert [type(f).__name__ for f in functions] == ["GuardedRewardFunction", "IsolatedRewardFunction"]
        functions[0].timeout_s = worker.timeout_s = 1.0
        for fn, name in zip(functions, ("closure_hangs", "sleeps")):
            start = time.monotonic()
            timed_out = rf"'{name}' did not return within reward.timeout_s=1 s on a batch of 2"
            with pytest.raises(RewardFunctionError, match=timed_out):
                _score(fn, on_error="raise")
            assert time.monotonic() - start < 10
            assert not _score(fn).valid.any()
    finally:
        release.set()
        if worker is not None:
            worker.close()


def test_an_unpicklable_closure_runs_in_process_contained_and_is_named(caplog):
    import logging
    import sys

    seen = []

    def closure(_prompts, completions, tests=None, **_fields):
        seen.append(os.getpid())
        tests[0].append(3)
        if len(completions) > 1:
            sys.exit(0)
        return [1.0]

    with caplog.at_level(logging.WARNING, logger="policygrad"):
        functions, worker = isolate_reward_functions([closure], timeout_s=10.0)
    assert worker is None
    assert "reward function 'closure' runs in the trainer's process: it cannot be pickled" in caplog.text
    shared = [1, 2]
    out = _score(functions[0], tests=[shared, shared])  # the batch exits; each row alone scores
    assert out.valid.all() and shared == [1, 2] and set(seen) == {os.getpid()}


def test_without_isolation_the_timeout_still_holds(user_file, callables):
    functions, worker = isolate_reward_functions(
        [f"{user_file}:naps", callables.exits], isolation=False, timeout_s=0.2
    )
    assert worker is None
    with pytest.raises(RewardFunctionError, match=r"'.*naps' did not return within reward.timeout_s=0.2 s"):
        _score(functions[0], on_error="raise")
    with pytest.raises(RewardFunctionError, match=r"'exits' raised SystemExit: 0 for row 0"):
        _score(functions[1], on_error="raise")


def test_a_callable_recorded_by_its_qualified_name_loads_in_the_worker(callables):
    # Run(reward_functions=[Group.length]) records and runs it as "module:Group.length".
    spec = describe_object(callables.Group.length)
    assert spec == "pg_callable_rewards:Group.length"
    functions, worker = isolate_reward_functions([spec], timeout_s=30.0)
    try:
        assert _score(functions[0]).rewards.tolist() == [2.0, 1.0]
    finally:
        worker.close()
