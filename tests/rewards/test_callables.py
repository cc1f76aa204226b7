"""Python objects as reward functions: which callables are async, async ones called like sync
ones (inside a running event loop too), and how a config records an object (its import path, or
a placeholder naming it)."""

from __future__ import annotations

import asyncio
import functools
import json

import pytest

from policygrad.rewards.callables import (
    NOT_IMPORTABLE,
    awaited,
    describe_object,
    import_path,
    is_async_callable,
)

pytestmark = pytest.mark.unit


async def async_lengths(_prompts, completions, **_fields):
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


def sync_lengths(_prompts, completions, **_fields):
    return [float(len(c)) for c in completions]


class AsyncScorer:
    async def __call__(self, _prompts, completions, **_fields):
        return [1.0] * len(completions)


class SyncScorer:
    def __call__(self, _prompts, completions, **_fields):
        return [1.0] * len(completions)


async def failing(_prompts, _completions, **_fields):
    raise KeyError("no answer field")


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (async_lengths, True),
        (functools.partial(async_lengths, scale=2), True),
        (functools.partial(functools.partial(async_lengths), scale=2), True),  # nested partials
        (AsyncScorer(), True),
        (sync_lengths, False),
        (functools.partial(sync_lengths), False),
        (SyncScorer(), False),
        (lambda _p, c: c, False),
        (AsyncScorer, False),  # the class: calling it makes an instance, not a coroutine
    ],
)
def test_is_async_callable(fn, expected):
    assert is_async_callable(fn) is expected


def test_a_sync_function_is_returned_as_is():
    assert awaited(sync_lengths) is sync_lengths
    scorer = SyncScorer()
    assert awaited(scorer) is scorer


def test_an_async_function_is_called_like_a_sync_one_with_its_name():
    fn = awaited(async_lengths)
    assert fn is not async_lengths and fn.__policygrad_async__ is True
    assert fn.__name__ == "async_lengths"
    assert fn(["p", "q"], ["ab", "abc"], answer=["1", "2"]) == [2.0, 3.0]


def test_an_async_object_is_named_by_its_class():
    fn = awaited(AsyncScorer())
    assert fn.__name__ == "AsyncScorer"
    assert fn(["p"], ["x"]) == [1.0]


def test_an_async_functions_error_reaches_the_caller():
    with pytest.raises(KeyError, match="no answer field"):
        awaited(failing)(["p"], ["x"])


def test_inside_a_running_event_loop_the_call_runs_in_a_thread_of_its_own():
    fn = awaited(async_lengths)

    async def notebook_cell():
        asyncio.get_running_loop()  # a loop runs here: asyncio.run would refuse
        return fn(["p"], ["abcd"])

    assert asyncio.run(notebook_cell()) == [4.0]


def test_inside_a_running_event_loop_errors_still_reach_the_caller():
    fn = awaited(failing)

    async def notebook_cell():
        return fn(["p"], ["x"])

    with pytest.raises(KeyError, match="no answer field"):
        asyncio.run(notebook_cell())


def test_import_path_of_importable_objects():
    assert import_path(json.dumps) == "json:dumps"
    assert import_path(json.JSONDecoder) == "json.decoder:JSONDecoder"
    assert import_path(json.JSONDecoder.decode) == "json.decoder:JSONDecoder.decode"  # a class's function


def test_import_path_is_none_where_importing_gives_something_else():
    def nested(_prompts, _completions):
        return []

    assert import_path(lambda _p, _c: []) is None
    assert import_path(nested) is None  # "<locals>" in its qualname
    assert import_path(json.JSONDecoder().decode) is None  # a bound method: import gives the function
    assert import_path(SyncScorer()) is None  # an instance has no qualname

    def in_main():
        pass

    in_main.__module__, in_main.__qualname__ = "__main__", "in_main"
    assert import_path(in_main) is None

    def renamed():
        pass

    renamed.__module__, renamed.__qualname__ = "json", "dumps"  # names json.dumps, which is another object
    assert import_path(renamed) is None
    renamed.__module__ = "no_such_module_anywhere"
    assert import_path(renamed) is None


def test_describe_object():
    assert describe_object("my_rewards.py:score") == "my_rewards.py:score"  # a spec as is
    assert describe_object(json.dumps) == "json:dumps"
    assert describe_object(lambda _p, _c: []) == "<callable <lambda> (not importable)>"
    assert describe_object(SyncScorer()) == "<callable SyncScorer (not importable)>"
    assert describe_object([{"prompt": "p"}], kind="dataset") == "<dataset list (not importable)>"
    assert NOT_IMPORTABLE.format(kind="dataset", name="rows") == "<dataset rows (not importable)>"


def test_an_async_partial_is_named_after_its_function():
    fn = awaited(functools.partial(async_lengths, scale=2))
    assert fn.__name__ == "async_lengths"
