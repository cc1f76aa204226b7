"""Environment specs to factories: built-ins, ``module:Class``, ``file.py:Class`` and objects;
each form's errors name what is wrong (the spec, the file, ``env.options``), and a factory builds
a fresh environment per call."""

# ruff: noqa: ARG002 - environments take the protocol's arguments
from __future__ import annotations

import os
import time

import pytest

from policygrad.envs import Environment, StepResult
from policygrad.envs.guess import GuessEnv
from policygrad.envs.registry import BUILTIN_ENVIRONMENTS, check_environment_spec, environment_factory
from tests.envs.test_episodes import Replies

pytestmark = pytest.mark.unit

NOT_CALLABLE = 3  # named by a spec below


class Counted(Environment):
    """Counts its constructions and closes (class-wide)."""

    built = 0
    closed = 0

    def __init__(self, *, size: int = 1):
        type(self).built += 1
        self.size = size

    def reset(self, row, *, seed):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        return StepResult(done=True)

    def close(self):
        type(self).closed += 1


class Picky(Environment):
    """Refuses a non-positive size with ValueError (a value the class checks)."""

    def __init__(self, *, size: int = 1):
        if size <= 0:
            raise ValueError(f"size must be positive, got {size}")

    def reset(self, row, *, seed):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        return StepResult(done=True)


class Duck:
    """Has reset and step without subclassing Environment."""

    def reset(self, row, *, seed):
        return [{"role": "user", "content": "hi"}]

    def step(self, action):
        return StepResult(done=True)


def make_a_dict(**_options):
    return {"reset": None}


# ----------------------------------------------------------------------------- built-ins


def test_builtin_guess_builds_a_new_environment_on_every_call():
    check_environment_spec("builtin:guess")
    make = environment_factory("builtin:guess", {"low": 3, "high": 7})
    a, b = make(), make()
    assert isinstance(a, GuessEnv) and isinstance(b, GuessEnv)
    assert a is not b


def test_the_builtins_are_importable_classes():
    assert set(BUILTIN_ENVIRONMENTS) == {"guess", "calculator", "code_feedback"}
    for name in BUILTIN_ENVIRONMENTS:
        check_environment_spec(f"builtin:{name}")
        check_environment_spec(f"  builtin:{name} ")  # surrounding spaces are stripped


def test_an_unknown_builtin_lists_the_builtins():
    for call in (check_environment_spec, environment_factory):
        with pytest.raises(ValueError) as info:
            call("builtin:gues")
        message = str(info.value)
        assert message.startswith("unknown environment 'builtin:gues'; give ")
        for name in ("builtin:guess", "builtin:calculator", "builtin:code_feedback"):
            assert name in message


# ----------------------------------------------------------------------------- malformed and missing


@pytest.mark.parametrize("spec", ["guess", "module:", ":Class", "no_colon_here.py"])
def test_a_malformed_spec_is_refused(spec):
    for call in (check_environment_spec, environment_factory):
        with pytest.raises(ValueError, match=r"^malformed environment spec "):
            call(spec)


def test_a_spec_that_is_neither_a_string_nor_callable_is_a_type_error():
    with pytest.raises(TypeError, match=r"^env.name must be a string or an Environment class, got int$"):
        check_environment_spec(42)


def test_a_missing_file_is_file_not_found(tmp_path):
    spec = f"{tmp_path}/nowhere.py:Env"
    for call in (check_environment_spec, environment_factory):
        with pytest.raises(FileNotFoundError) as info:
            call(spec)
        assert f"environment file '{tmp_path}/nowhere.py'" in str(info.value)


def test_an_unimportable_module_is_named():
    with pytest.raises(ValueError, match=r"^cannot import module 'no_such_module_xyz' for env.name"):
        check_environment_spec("no_such_module_xyz:Env")
    # A missing submodule of a package that exists shows when the factory imports it.
    with pytest.raises(ValueError, match=r"^cannot import 'policygrad.no_such_mod' for env.name"):
        environment_factory("policygrad.no_such_mod:X")


# ----------------------------------------------------------------------------- user classes


def test_a_file_spec_loads_the_class_without_running_it_at_check_time(tmp_path):
    ran = tmp_path / "ran"
    source = tmp_path / "my_env.py"
    source.write_text(
        f"open({str(ran)!r}, 'w').close()\n"
        "from policygrad.envs import Environment, StepResult\n\n"
        "class Echo(Environment):\n"
        "    def __init__(self, *, word='hi'):\n"
        "        self.word = word\n"
        "    def reset(self, row, *, seed):\n"
        "        return [{'role': 'user', 'content': self.word}]\n"
        "    def step(self, action):\n"
        "        return StepResult(done=True)\n"
    )
    spec = f"{source}:Echo"
    check_environment_spec(spec)
    assert not ran.exists()  # checked, not imported
    make = environment_factory(spec, {"word": "yo"})
    assert ran.exists()
    a, b = make(), make()
    assert a is not b and type(a).__name__ == "Echo"
    assert a.reset({}, seed=0) == [{"role": "user", "content": "yo"}]


def test_a_file_that_fails_to_import_is_named(tmp_path):
    source = tmp_path / "broken_env.py"
    source.write_text("class Env(:\n")
    with pytest.raises(ValueError, match=r"broken_env\.py' failed to load: SyntaxError"):
        environment_factory(f"{source}:Env")


def test_a_missing_attribute_is_named():
    with pytest.raises(ValueError, match=r"^'tests.envs.test_registry' has no attribute 'Nope'"):
        environment_factory("tests.envs.test_registry:Nope")


def test_a_module_spec_loads_the_class():
    spec = "tests.envs.test_episodes:Replies"
    check_environment_spec(spec)
    make = environment_factory(spec)
    a, b = make(), make()
    assert type(a) is Replies and type(b) is Replies and a is not b


def test_the_factory_probes_one_environment_and_closes_it():
    Counted.built = Counted.closed = 0
    make = environment_factory(Counted, {"size": 4})
    assert (Counted.built, Counted.closed) == (1, 1)  # the probe, built with the options and closed
    env = make()
    assert (Counted.built, Counted.closed) == (2, 1) and env.size == 4


def test_an_options_typo_names_env_options():
    with pytest.raises(ValueError) as info:
        environment_factory("builtin:guess", {"hihg": 7})
    message = str(info.value)
    assert message.startswith("env.options do not fit builtin:guess: ")
    assert "hihg" in message


def test_a_constructor_refusing_a_value_is_named_as_env_options():
    with pytest.raises(ValueError) as info:
        environment_factory(Picky, {"size": 0})
    assert str(info.value).startswith("env.options do not fit ")
    assert str(info.value).endswith(": size must be positive, got 0")
    fragment = r"^env.options do not fit builtin:guess: low=9 must be at most high=2"
    with pytest.raises(ValueError, match=fragment):
        environment_factory("builtin:guess", {"low": 9, "high": 2})


def test_a_spec_naming_a_non_callable_is_a_type_error():
    with pytest.raises(TypeError) as info:
        environment_factory("tests.envs.test_registry:NOT_CALLABLE")
    assert str(info.value) == (
        "env.name 'tests.envs.test_registry:NOT_CALLABLE' names a int, not a class or factory"
    )


def test_a_factory_building_no_environment_says_to_subclass_and_is_not_an_options_error():
    with pytest.raises(TypeError) as info:
        environment_factory(make_a_dict, {"size": 1})
    message = str(info.value)
    assert "built a dict, which has no reset()/step(); subclass policygrad.envs.Environment" in message
    assert not isinstance(info.value, ValueError)
    assert "env.options" not in message


def test_any_object_with_reset_and_step_is_accepted():
    make = environment_factory(Duck)
    assert isinstance(make(), Duck)


class BuildFails:
    def __init__(self):
        raise RuntimeError("ctor boom")


class CloseFails(Environment):
    def reset(self, row, *, seed):  # noqa: ARG002
        return [{"role": "user", "content": "x"}]

    def step(self, action):  # noqa: ARG002
        return None

    def close(self):
        raise RuntimeError("close boom")


def test_a_constructor_or_close_that_raises_is_one_line_at_start():
    with pytest.raises(ValueError, match=r"^env\.name BuildFails could not be built: RuntimeError: ctor"):
        environment_factory(BuildFails)
    with pytest.raises(ValueError, match=r"^env\.name CloseFails: close\(\) failed: RuntimeError: close"):
        environment_factory(CloseFails)


class ExitsWhenBuilt(Environment):
    def __init__(self):
        os._exit(0)

    def reset(self, row, *, seed):  # noqa: ARG002
        return [{"role": "user", "content": "x"}]

    def step(self, action):  # noqa: ARG002
        return None


class MovesWhenBuilt(CloseFails):
    def __init__(self):
        os.chdir("/")

    def close(self):
        return None


def test_the_isolated_probe_runs_in_a_worker_and_says_what_the_in_process_one_says():
    """With isolation the start-up check builds its environment in a worker process: an
    ``os._exit`` there is named (in this process it would end the caller with status 0 and no
    line), a ``chdir`` stays there, and every refusal reads as the in-process check's."""
    with pytest.raises(ValueError, match=r"^env\.name ExitsWhenBuilt could not be built: .*exit status 0"):
        environment_factory(ExitsWhenBuilt, isolation=True)
    here = os.getcwd()
    environment_factory(MovesWhenBuilt, isolation=True)
    assert os.getcwd() == here
    Counted.built = 0
    environment_factory(Counted, {"size": 4}, isolation=True)
    assert Counted.built == 0  # built in the worker, not here
    with pytest.raises(ValueError, match=r"^env\.options do not fit builtin:guess: .*hihg"):
        environment_factory("builtin:guess", {"hihg": 7}, isolation=True)
    with pytest.raises(ValueError, match=r"^env\.name BuildFails could not be built: RuntimeError: ctor"):
        environment_factory(BuildFails, isolation=True)
    with pytest.raises(ValueError, match=r"^env\.name CloseFails: close\(\) failed: RuntimeError: close"):
        environment_factory(CloseFails, isolation=True)
    with pytest.raises(TypeError, match="built a dict, which has no reset"):
        environment_factory(make_a_dict, {"size": 1}, isolation=True)


class HangsWhenBuilt(CloseFails):
    def __init__(self):
        time.sleep(600)


def test_the_isolated_probe_of_a_constructor_that_hangs_ends_within_the_step_timeout():
    start = time.monotonic()
    refused = r"^env\.name HangsWhenBuilt could not be built: .*timed out after 1 s"
    with pytest.raises(ValueError, match=refused):
        environment_factory(HangsWhenBuilt, isolation=True, timeout_s=1.0)
    assert time.monotonic() - start < 60  # 1 s, the worker's start, and its kill
